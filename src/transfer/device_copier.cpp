#include "tensortier/transfer/device_copier.hpp"

#include <cstring>
#include <exception>
#include <stdexcept>

#include "tensortier/util/strings.hpp"

namespace tensortier {

// ---------------------------------------------------------------------------------------------
// MemcpyCopier

MemcpyCopier::MemcpyCopier(MemcpyCopierOptions options) : options_(options) {
  worker_ = std::thread([this] { Run(); });
}

MemcpyCopier::~MemcpyCopier() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_one();
  worker_.join();  // the worker finishes the queue first
}

void MemcpyCopier::CopyToDevice(uint64_t dst, const void* src, size_t bytes) {
  Enqueue({reinterpret_cast<void*>(dst), src, bytes});
}

void MemcpyCopier::CopyFromDevice(void* dst, uint64_t src, size_t bytes) {
  Enqueue({dst, reinterpret_cast<const void*>(src), bytes});
}

void MemcpyCopier::Enqueue(Copy copy) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(copy);
    ++queued_;
  }
  work_cv_.notify_one();
}

uint64_t MemcpyCopier::Record() {
  std::lock_guard lock(mu_);
  return queued_;
}

bool MemcpyCopier::Done(uint64_t fence) {
  std::lock_guard lock(mu_);
  if (completed_ < fence) return false;
  ThrowIfFailedBefore(fence);
  return true;
}

void MemcpyCopier::Wait(uint64_t fence) {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return completed_ >= fence; });
  ThrowIfFailedBefore(fence);
}

void MemcpyCopier::Synchronize() {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return completed_ == queued_; });
  if (error_) {
    std::exception_ptr error = std::exchange(error_, nullptr);
    error_copy_ = 0;
    std::rethrow_exception(error);
  }
}

uint64_t MemcpyCopier::completed() const {
  std::lock_guard lock(mu_);
  return completed_;
}

void MemcpyCopier::ThrowIfFailedBefore(uint64_t fence) {
  if (error_ && error_copy_ <= fence) std::rethrow_exception(error_);
}

void MemcpyCopier::Run() {
  for (;;) {
    Copy copy{};
    uint64_t number = 0;
    {
      std::unique_lock lock(mu_);
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing is left
      copy = queue_.front();
      queue_.pop_front();
      number = completed_ + 1;
    }
    if (options_.delay.count() > 0) std::this_thread::sleep_for(options_.delay);
    const bool fail = options_.fail_nth != 0 && number == options_.fail_nth;
    if (!fail && copy.bytes > 0) std::memcpy(copy.dst, copy.src, copy.bytes);
    {
      std::lock_guard lock(mu_);
      if (fail && !error_) {
        error_ = std::make_exception_ptr(std::runtime_error(StrCat(
            "MemcpyCopier: injected failure of copy ", number, " (", copy.bytes, " bytes)")));
        error_copy_ = number;
      }
      ++completed_;
    }
    done_cv_.notify_all();
  }
}

// ---------------------------------------------------------------------------------------------
// CudaCopier

CudaCopier::CudaCopier(const CudaDriver& driver, int device, std::optional<cuda::CUstream> stream)
    : context_(driver, device) {
  if (stream) {
    stream_ = *stream;
  } else {
    own_stream_.emplace(context_);
    stream_ = own_stream_->get();
  }
}

CudaCopier::~CudaCopier() {
  // Wait for our own copies only: a new event on the caller's stream would also wait for
  // whatever the caller queued after them (a whole training step, for an async transfer).
  try {
    if (unfenced_) {
      Synchronize();
    } else if (!pending_.empty()) {
      Wait(pending_.back().first);
    }
  } catch (...) {
    try {
      Synchronize();
    } catch (...) {
      // Nothing to report to; the copies are over either way.
    }
  }
}

void CudaCopier::CopyToDevice(uint64_t dst, const void* src, size_t bytes) {
  unfenced_ = true;
  CopyToDeviceAsync(context_, dst, src, bytes, stream_);
}

void CudaCopier::CopyFromDevice(void* dst, uint64_t src, size_t bytes) {
  unfenced_ = true;
  CopyFromDeviceAsync(context_, dst, src, bytes, stream_);
}

uint64_t CudaCopier::Record() {
  Event event = [&] {
    // Blocking sync: a thread waiting on a fence sleeps in cuEventSynchronize instead of
    // spinning on a core that the I/O engine's threads need.
    if (spare_.empty())
      return Event(context_, cuda::kEventDisableTiming | cuda::kEventBlockingSync);
    Event e = std::move(spare_.back());
    spare_.pop_back();
    return e;
  }();
  try {
    event.Record(stream_);
  } catch (...) {
    spare_.push_back(std::move(event));
    throw;
  }
  const uint64_t fence = next_fence_++;
  pending_.emplace_back(fence, std::move(event));
  unfenced_ = false;
  return fence;
}

bool CudaCopier::Done(uint64_t fence) {
  if (fence <= done_through_) return true;
  for (const auto& [id, event] : pending_) {
    if (id < fence) continue;
    if (id > fence) break;
    if (!event.Query()) return false;
    RetireThrough(fence);
    return true;
  }
  throw std::invalid_argument(StrCat("CudaCopier: fence ", fence, " was never recorded"));
}

void CudaCopier::Wait(uint64_t fence) {
  if (fence <= done_through_) return;
  for (const auto& [id, event] : pending_) {
    if (id < fence) continue;
    if (id > fence) break;
    event.Synchronize();
    RetireThrough(fence);
    return;
  }
  throw std::invalid_argument(StrCat("CudaCopier: fence ", fence, " was never recorded"));
}

void CudaCopier::Synchronize() {
  std::exception_ptr error;
  try {
    Wait(Record());
    return;
  } catch (...) {
    error = std::current_exception();
  }
  // The event could not be recorded or reports an error (a CUDA error is sticky): wait for the
  // stream itself, so that no copy still uses host memory once this returns, and forget the
  // pending events (their work is over either way).
  try {
    ScopedContext current(context_);
    context_.driver().api().StreamSynchronize(stream_);
  } catch (...) {
  }
  while (!pending_.empty()) {
    done_through_ = pending_.front().first;
    spare_.push_back(std::move(pending_.front().second));
    pending_.pop_front();
  }
  done_through_ = next_fence_ - 1;
  std::rethrow_exception(error);
}

void CudaCopier::RetireThrough(uint64_t fence) {
  // Events complete in stream order: every earlier one is done too.
  while (!pending_.empty() && pending_.front().first <= fence) {
    spare_.push_back(std::move(pending_.front().second));
    pending_.pop_front();
  }
  done_through_ = fence;
}

}  // namespace tensortier
