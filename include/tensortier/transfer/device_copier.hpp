// Ordered, asynchronous copies between host memory and a "device", with fences: the seam between
// the bounce ring and CUDA. MemcpyCopier's device is host memory and its copies run on a thread
// of its own (a real asynchronous engine, so the ring's overlap logic runs on CI); CudaCopier's
// copies run on a CUDA stream and its fences are CUDA events.
//
// Contract: copies complete in the order they were queued; Record() returns a fence that is done
// once every copy queued before it is done, and fences are done in the order they were recorded.
// REQUIRES: host memory handed to a copy stays valid and unchanged (for CopyToDevice) or untouched
// (for CopyFromDevice) until a later fence is done.
//
// Errors: a copy that cannot be queued throws from CopyToDevice/CopyFromDevice (then nothing of it
// was queued). A copy that fails later makes Done()/Wait() of every later fence throw, until
// Synchronize() has thrown it once (MemcpyCopier; a CUDA stream error is sticky anyway).
//
// Thread-compatible: one thread at a time per copier (one per ring).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tensortier/cuda/cuda_driver.hpp"

namespace tensortier {

class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  // "memcpy", "cuda".
  virtual std::string_view name() const noexcept = 0;
  // The context whose driver should page-lock and register host buffers for these copies, or
  // null when registration would not help (BounceRing uses it for the pool it makes itself).
  virtual const PrimaryContext* pinning_context() const noexcept = 0;

  // Queue a copy of `bytes` from host `src` to device address `dst`.
  virtual void CopyToDevice(uint64_t dst, const void* src, size_t bytes) = 0;
  // Queue a copy of `bytes` from device address `src` to host `dst`.
  virtual void CopyFromDevice(void* dst, uint64_t src, size_t bytes) = 0;
  // A fence after every copy queued so far. Fences never decrease; a fence is done once every
  // copy queued before it is done.
  virtual uint64_t Record() = 0;
  // Non-blocking: whether `fence` is done. Throws a failed earlier copy's error.
  virtual bool Done(uint64_t fence) = 0;
  // Blocks until `fence` is done. Throws a failed earlier copy's error.
  virtual void Wait(uint64_t fence) = 0;
  // Blocks until every queued copy is done; throws the first error not yet thrown by a
  // Synchronize() (and forgets it, so the copier can be used again where its engine allows).
  virtual void Synchronize() = 0;
};

// Test and CPU fallback: the "device address" is a host address (reinterpret_cast<uint64_t>).
struct MemcpyCopierOptions {
  // Sleep before each copy: makes copies slower than file I/O, to check the ring's ordering.
  std::chrono::microseconds delay{0};
  // When > 0, copy number `fail_nth` (1-based, over the copier's life) fails instead of copying,
  // asynchronously, like a device fault.
  uint64_t fail_nth = 0;
};

class MemcpyCopier final : public DeviceCopier {
 public:
  explicit MemcpyCopier(MemcpyCopierOptions options = {});
  // Finishes every queued copy first.
  ~MemcpyCopier() override;
  MemcpyCopier(const MemcpyCopier&) = delete;
  MemcpyCopier& operator=(const MemcpyCopier&) = delete;

  std::string_view name() const noexcept override { return "memcpy"; }
  const PrimaryContext* pinning_context() const noexcept override { return nullptr; }
  void CopyToDevice(uint64_t dst, const void* src, size_t bytes) override;
  void CopyFromDevice(void* dst, uint64_t src, size_t bytes) override;
  uint64_t Record() override;
  bool Done(uint64_t fence) override;
  void Wait(uint64_t fence) override;
  void Synchronize() override;

  // Copies completed so far (for tests).
  uint64_t completed() const;

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  void Enqueue(Copy copy);
  void Run();
  // REQUIRES: mu_ held and copies up to `fence` completed.
  void ThrowIfFailedBefore(uint64_t fence);

  const MemcpyCopierOptions options_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the worker waits for copies
  std::condition_variable done_cv_;  // waiters wait for completions
  std::deque<Copy> queue_;           // guarded by mu_
  uint64_t queued_ = 0;              // copies queued so far; guarded by mu_
  uint64_t completed_ = 0;           // guarded by mu_
  std::exception_ptr error_;         // first failure not yet thrown by Synchronize(); mu_
  uint64_t error_copy_ = 0;          // 1-based number of the copy that failed; mu_
  bool stopping_ = false;            // guarded by mu_
  std::thread worker_;
};

// Copies on a CUDA stream of the device's primary context: the caller's stream when given (which
// must belong to that context, as PyTorch's streams do), else a non-blocking stream of its own.
// Fences are events (blocking-sync: waiters sleep rather than spin), recycled once done.
class CudaCopier final : public DeviceCopier {
 public:
  // Throws CudaError when the driver is unavailable or the device is invalid.
  explicit CudaCopier(const CudaDriver& driver, int device = 0,
                      std::optional<cuda::CUstream> stream = std::nullopt);
  // Waits for its copies (errors ignored).
  ~CudaCopier() override;
  CudaCopier(const CudaCopier&) = delete;
  CudaCopier& operator=(const CudaCopier&) = delete;

  std::string_view name() const noexcept override { return "cuda"; }
  const PrimaryContext* pinning_context() const noexcept override { return &context_; }
  void CopyToDevice(uint64_t dst, const void* src, size_t bytes) override;
  void CopyFromDevice(void* dst, uint64_t src, size_t bytes) override;
  uint64_t Record() override;
  bool Done(uint64_t fence) override;
  void Wait(uint64_t fence) override;
  void Synchronize() override;

  const PrimaryContext& context() const noexcept { return context_; }
  cuda::CUstream stream() const noexcept { return stream_; }

 private:
  // Retires every pending fence up to and including `fence` (all done).
  void RetireThrough(uint64_t fence);

  PrimaryContext context_;
  std::optional<Stream> own_stream_;
  cuda::CUstream stream_;
  uint64_t next_fence_ = 1;
  uint64_t done_through_ = 0;                       // every fence <= this is done
  std::deque<std::pair<uint64_t, Event>> pending_;  // recorded, not known done, in order
  std::vector<Event> spare_;                        // done events, for reuse
  bool unfenced_ = false;                           // copies queued after the last Record()
};

}  // namespace tensortier
