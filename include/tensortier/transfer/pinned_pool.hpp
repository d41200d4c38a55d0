// A byte budget of page-aligned host staging buffers, page-locked and registered with CUDA
// (cuMemHostRegister, portable) when the driver is available and the pool is asked to, and reused:
// registration is expensive, so buffers live as long as the pool and go back to it when released.
//
// Budget: the bytes of all buffers the pool holds (lent and idle) never exceed budget_bytes. When
// a request does not fit, idle buffers of other sizes are freed to make room; if lent buffers
// still hold too much, Acquire() BLOCKS until enough comes back (TryAcquire() returns nothing
// instead). A request larger than the whole budget can never be met and throws
// std::invalid_argument at once. A thread that holds buffers and asks for more than the rest of
// the budget waits for itself forever: take what a task needs in one place (as BounceRing does).
//
// Thread-safe. Buffers may outlive the pool object (its state lives until the last one is back).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "tensortier/cuda/cuda_driver.hpp"

namespace tensortier {

namespace detail {
struct PinnedPoolState;
struct PinnedBlock;
}  // namespace detail

// A buffer lent by a PinnedPool; goes back to the pool on destruction (or Release()). Move-only.
class PinnedBuffer {
 public:
  PinnedBuffer() noexcept;
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  // Page-aligned; null for an empty (default or moved-from) buffer.
  std::byte* data() const noexcept;
  // The size asked for, rounded up to whole pages.
  size_t size() const noexcept;
  // Whether the memory is registered with CUDA (else it is mlock()ed where the limit allows).
  bool registered() const noexcept;
  explicit operator bool() const noexcept { return block_ != nullptr; }
  // Gives the buffer back now.
  void Release() noexcept;

 private:
  friend class PinnedPool;
  PinnedBuffer(std::shared_ptr<detail::PinnedPoolState> pool,
               std::unique_ptr<detail::PinnedBlock> block);

  std::shared_ptr<detail::PinnedPoolState> pool_;
  std::unique_ptr<detail::PinnedBlock> block_;
};

struct PinnedPoolOptions {
  uint64_t budget_bytes = 256u << 20;
  // Register buffers with CUDA when CudaDriver is available (they are only mlock()ed otherwise).
  bool register_with_cuda = true;
  // The device whose primary context registers them (registrations are portable: every context
  // can use them).
  int device = 0;
};

class PinnedPool {
 public:
  // Throws std::invalid_argument for a zero budget. Creating the pool allocates nothing.
  explicit PinnedPool(PinnedPoolOptions options = {}, const CudaDriver& driver = CudaDriver::Get());
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A buffer of at least `bytes` (rounded up to pages), reusing an idle one of that size when
  // there is one. Blocks while the budget is held by lent buffers (see above). Throws
  // std::invalid_argument when `bytes` is 0 or over the budget, std::bad_alloc, or CudaError
  // when registration fails (nothing is silently left pageable). Where the driver cannot
  // register host memory (CUDA_ERROR_NOT_SUPPORTED or _OPERATING_SYSTEM: some sandboxes) the
  // buffer comes from cuMemAllocHost instead.
  PinnedBuffer Acquire(size_t bytes);
  // As Acquire(), but returns nullopt instead of blocking.
  std::optional<PinnedBuffer> TryAcquire(size_t bytes);
  // Frees the idle buffers.
  void Trim();

  uint64_t budget() const noexcept { return options_.budget_bytes; }
  // Whether buffers are registered with CUDA (asked for, and the driver available).
  bool registers() const noexcept;
  // Bytes of all buffers held (lent + idle), of lent ones, and buffers allocated so far.
  uint64_t held_bytes() const;
  uint64_t lent_bytes() const;
  uint64_t allocations() const;

 private:
  std::optional<PinnedBuffer> Take(size_t bytes, bool wait);

  PinnedPoolOptions options_;
  std::shared_ptr<detail::PinnedPoolState> state_;
};

}  // namespace tensortier
