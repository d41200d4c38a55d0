#include "tensortier/transfer/pinned_pool.hpp"

#include <condition_variable>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace detail {

// One buffer: the mapping and its CUDA registration when there is one (declared after the
// mapping, so it is unregistered before the memory is unmapped), or memory from cuMemAllocHost
// where the driver cannot register memory it did not allocate (some sandboxes).
struct PinnedBlock {
  AlignedBuffer memory;
  std::optional<HostRegistration> registration;
  std::optional<PinnedHostMemory> allocated;

  std::byte* data() const noexcept {
    return allocated ? static_cast<std::byte*>(allocated->data()) : memory.data();
  }
  size_t size() const noexcept { return allocated ? allocated->size() : memory.size(); }
};

struct PinnedPoolState {
  uint64_t budget;
  std::optional<PrimaryContext> context;  // set when buffers are registered
  // Why the driver refused to register host memory, once it has (NOT_SUPPORTED or
  // OPERATING_SYSTEM): buffers come from cuMemAllocHost from then on. Guarded by mu.
  std::string register_refused;

  std::mutex mu;
  std::condition_variable returned;                          // a buffer came back
  std::multimap<size_t, std::unique_ptr<PinnedBlock>> idle;  // by size; guarded by mu
  uint64_t held = 0;                                         // lent + idle + being made; mu
  uint64_t lent = 0;                                         // guarded by mu
  uint64_t allocations = 0;                                  // guarded by mu

  void Return(std::unique_ptr<PinnedBlock> block) noexcept {
    {
      std::lock_guard lock(mu);
      const size_t size = block->size();
      lent -= size;
      idle.emplace(size, std::move(block));
    }
    returned.notify_all();
  }
};

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// PinnedBuffer

PinnedBuffer::PinnedBuffer() noexcept = default;

PinnedBuffer::PinnedBuffer(std::shared_ptr<detail::PinnedPoolState> pool,
                           std::unique_ptr<detail::PinnedBlock> block)
    : pool_(std::move(pool)), block_(std::move(block)) {}

PinnedBuffer::~PinnedBuffer() {
  Release();
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : pool_(std::move(other.pool_)), block_(std::move(other.block_)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::move(other.pool_);
    block_ = std::move(other.block_);
  }
  return *this;
}

std::byte* PinnedBuffer::data() const noexcept {
  return block_ != nullptr ? block_->data() : nullptr;
}

size_t PinnedBuffer::size() const noexcept {
  return block_ != nullptr ? block_->size() : 0;
}

bool PinnedBuffer::registered() const noexcept {
  return block_ != nullptr && (block_->registration.has_value() || block_->allocated.has_value());
}

void PinnedBuffer::Release() noexcept {
  if (block_ != nullptr) pool_->Return(std::move(block_));
  pool_.reset();
}

// ---------------------------------------------------------------------------------------------
// PinnedPool

PinnedPool::PinnedPool(PinnedPoolOptions options, const CudaDriver& driver)
    : options_(options), state_(std::make_shared<detail::PinnedPoolState>()) {
  if (options_.budget_bytes == 0) throw std::invalid_argument("PinnedPool: budget_bytes is 0");
  state_->budget = options_.budget_bytes;
  if (options_.register_with_cuda && driver.available()) {
    state_->context.emplace(driver, options_.device);  // throws CudaError for a bad device
  }
}

PinnedPool::~PinnedPool() = default;  // lent buffers keep the state alive

bool PinnedPool::registers() const noexcept {
  return state_->context.has_value();
}

uint64_t PinnedPool::held_bytes() const {
  std::lock_guard lock(state_->mu);
  return state_->held;
}

uint64_t PinnedPool::lent_bytes() const {
  std::lock_guard lock(state_->mu);
  return state_->lent;
}

uint64_t PinnedPool::allocations() const {
  std::lock_guard lock(state_->mu);
  return state_->allocations;
}

PinnedBuffer PinnedPool::Acquire(size_t bytes) {
  return *Take(bytes, /*wait=*/true);
}

std::optional<PinnedBuffer> PinnedPool::TryAcquire(size_t bytes) {
  return Take(bytes, /*wait=*/false);
}

void PinnedPool::Trim() {
  std::multimap<size_t, std::unique_ptr<detail::PinnedBlock>> freed;
  {
    std::lock_guard lock(state_->mu);
    for (const auto& [size, block] : state_->idle) state_->held -= size;
    freed.swap(state_->idle);
  }
  state_->returned.notify_all();
}  // `freed` is unregistered and unmapped here, outside the lock

std::optional<PinnedBuffer> PinnedPool::Take(size_t bytes, bool wait) {
  if (bytes == 0) throw std::invalid_argument("PinnedPool: a buffer of 0 bytes");
  const size_t size = AlignUp(bytes, kPageSize);
  detail::PinnedPoolState& s = *state_;
  if (size > s.budget) {
    throw std::invalid_argument(StrCat("PinnedPool: a buffer of ", FormatSize(size),
                                       " is over the pool's budget of ", FormatSize(s.budget)));
  }
  std::vector<std::unique_ptr<detail::PinnedBlock>> evicted;  // freed outside the lock
  {
    std::unique_lock lock(s.mu);
    for (;;) {
      if (auto it = s.idle.find(size); it != s.idle.end()) {
        std::unique_ptr<detail::PinnedBlock> block = std::move(it->second);
        s.idle.erase(it);
        s.lent += size;
        return PinnedBuffer(state_, std::move(block));
      }
      if (s.held + size <= s.budget) break;
      if (!s.idle.empty()) {  // make room: free the largest idle buffer
        auto it = std::prev(s.idle.end());
        s.held -= it->first;
        evicted.push_back(std::move(it->second));
        s.idle.erase(it);
        continue;
      }
      if (!wait) return std::nullopt;
      s.returned.wait(lock);
    }
    s.held += size;  // reserved while the buffer is made outside the lock
    s.lent += size;
  }
  evicted.clear();
  auto block = std::make_unique<detail::PinnedBlock>();
  try {
    // With a context the registration pins the pages; without one they are made resident here.
    bool refused = false;
    if (s.context) {
      std::lock_guard lock(s.mu);
      refused = !s.register_refused.empty();
    }
    if (!refused) {
      block->memory =
          AlignedBuffer(size, Pages::kReused, s.context ? Populate::kOnDemand : Populate::kUpFront);
    }
    if (s.context && !refused) {
      try {
        block->registration.emplace(*s.context, block->memory.data(), size);
      } catch (const CudaError& e) {
        if (e.code() != cuda::kErrorNotSupported && e.code() != cuda::kErrorOperatingSystem) throw;
        block->memory = AlignedBuffer();
        std::lock_guard lock(s.mu);
        s.register_refused = e.what();  // the next buffers go straight to cuMemAllocHost
      }
    }
    if (s.context && !block->registration) {
      try {
        block->allocated.emplace(*s.context, size);
      } catch (const CudaError& e) {  // say why it came to this
        std::lock_guard lock(s.mu);
        throw CudaError(e.code(), e.call(),
                        StrCat(e.what(), " (in place of ", s.register_refused, ")"));
      }
      if (reinterpret_cast<uintptr_t>(block->allocated->data()) % kPageSize != 0) {
        throw std::runtime_error(  // O_DIRECT reads and writes go through the buffers
            "cuMemAllocHost returned memory that is not page-aligned");
      }
    }
  } catch (...) {
    {
      std::lock_guard lock(s.mu);
      s.held -= size;
      s.lent -= size;
    }
    s.returned.notify_all();
    throw;
  }
  {
    std::lock_guard lock(s.mu);
    ++s.allocations;
  }
  return PinnedBuffer(state_, std::move(block));
}

}  // namespace tensortier
