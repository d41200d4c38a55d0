// The engine's workers: each a thread owning one backend ring and the bounce buffers for it,
// and the threads that copy staged reads out of those buffers. Internal to the engine.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tensortier/io/engine_task.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/util/thread_group.hpp"

namespace tensortier::detail {

class Worker;

// Threads that copy staged reads out of the workers' bounce buffers into their destinations.
// The destination of a load in a new process is memory never touched: the copy faults in each
// of its small pages, which on the worker itself kept it from reaping and submitting (the disk
// idled). Each copy goes back to its worker (Worker::CopiedOut), which alone finishes the task.
class CopyPool {
 public:
  // Throws std::system_error (EAGAIN, naming TENSORTIER_COPY_THREADS) when a thread cannot start.
  explicit CopyPool(unsigned threads)
      : threads_(
            threads,
            "copy threads (TENSORTIER_COPY_THREADS; 0: the engine's workers copy staged "
            "reads out themselves)",
            [this] { Run(); }, [this] { Stop(); }) {}

  // REQUIRES: no copy is posted or in progress (the workers are gone).
  ~CopyPool() = default;

  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  void Post(Worker* worker, Task* task, uint64_t bytes) {
    {
      std::lock_guard lock(mu_);
      jobs_.push_back({worker, task, bytes});
    }
    cv_.notify_one();
  }

 private:
  struct Job {
    Worker* worker;
    Task* task;
    uint64_t bytes;
  };

  void Run();

  void Stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;   // guarded by mu_
  bool stopping_ = false;  // guarded by mu_
  ThreadGroup threads_;    // last: stopped and joined before the members they use go
};

// A thread that owns one backend ring and the bounce buffers for it.
class Worker {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kIdleBounce = 2;
  // EAGAIN/EINTR completions of one request in a row before it fails with that errno.
  static constexpr uint32_t kMaxRetries = 1000;
  static constexpr std::chrono::milliseconds kBusyBounceIdle{100};

  Worker(BackendFactory factory, unsigned depth, uint64_t budget, uint64_t bounce_budget,
         uint64_t chunk, std::chrono::milliseconds bounce_idle, CopyPool* copier);

  ~Worker();

  const std::string& name() const { return name_; }

  // Bytes of bounce buffers this worker holds, in use or free, and how many it has made so far
  // (any thread).
  uint64_t bounce_bytes() const { return bounce_bytes_.load(std::memory_order_relaxed); }
  uint64_t bounce_allocations() const {
    return bounce_allocations_.load(std::memory_order_relaxed);
  }

  // A copy posted by Complete() is done (a copier thread); `bytes` 0 when it failed.
  void CopiedOut(Task* t, uint64_t bytes);

  void Enqueue(std::vector<std::unique_ptr<Task>>& tasks);

 private:
  void Run();

  IoRequest Prepare(Task* t);

  void SubmitOrFail(const std::vector<IoRequest>& requests);

  void Unslot(Task* t) {
    slots_[t->slot] = nullptr;
    free_slots_.push_back(t->slot);
    --in_flight_;
  }

  // Reaping itself failed (the ring is unusable): fail what is in flight and everything after,
  // rather than wait forever for completions that cannot be collected.
  void FailInFlight(std::exception_ptr error);

  void Complete(Task* t, const IoCompletion& completion);

  // `n` more bytes of `t` are transferred (and copied out of its bounce buffer): finishes it, or
  // continues a short transfer where it stopped.
  void Advance(Task* t, uint64_t n);

  void Finish(Task* t);

  // Waits, idle, until work arrives or the engine stops. Meanwhile each bounce buffer beyond
  // kIdleBounce goes once it has been unused for bounce_idle_ (at once for 0): a caller that just
  // offloaded its tensors to free RAM expects that memory back, while a caller whose next burst
  // follows soon (the next shard of a checkpoint) would fault it all in again. Counted from each
  // buffer's release, not from the start of this wait, so a trickle of small requests that keeps
  // waking the worker does not keep a burst's buffers forever.
  void WaitForWork(std::unique_lock<std::mutex>& lock);

  // Whether `t` may start within the budgets (under mu_).
  bool Fits(const Task& t) const {
    return in_flight_bytes_ + t.charged <= budget_ &&
           (!t.bounced || bounced_bytes_ + t.charged <= bounce_budget_);
  }

  // The most recently released free bounce buffer of at least `bytes` (tasks are chunk_ bytes, or
  // a little more where the file's O_DIRECT offset alignment does not divide chunk_), else a new
  // one. Taking the newest lets the oldest age out when less is in flight than before.
  AlignedBuffer* TakeBounce(uint64_t bytes);

  // Frees the free bounce buffers released at or before `cutoff`, oldest first, keeping
  // kIdleBounce: a burst of unaligned or staged I/O may have made one per request in flight (up
  // to the byte budget).
  void TrimBounce(Clock::time_point cutoff);

  // A worker that never waits (work keeps coming, with less of it in flight than in an earlier
  // burst) frees the buffers it no longer needs here. They must also have sat unused for
  // kBusyBounceIdle: the free list swells between reaping a batch and starting the next, and a
  // zero delay must not free and remake buffers on every round.
  void TrimBusy() {
    TrimBounce(Clock::now() - std::max<Clock::duration>(bounce_idle_, kBusyBounceIdle));
  }

  void ReleaseBounce(Task* t) {
    if (t->bounce != nullptr) free_bounce_.push_back({t->bounce, Clock::now()});
    t->bounce = nullptr;
  }

  const unsigned depth_;
  const uint64_t budget_;
  const uint64_t bounce_budget_;
  const uint64_t chunk_;
  const std::chrono::milliseconds bounce_idle_;
  CopyPool* const copier_;    // null: this thread copies staged reads out
  std::vector<Task*> slots_;  // worker-thread only (constructed before the thread starts)
  std::vector<uint32_t> free_slots_;
  std::string name_;
  std::unique_ptr<Backend> backend_;
  std::thread thread_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Task>> queue_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  uint64_t in_flight_bytes_ = 0;             // guarded by mu_
  uint64_t bounced_bytes_ = 0;               // guarded by mu_: of in_flight_bytes_, bounced tasks
  struct CopiedTask {
    Task* task;
    uint64_t bytes;
  };
  std::vector<CopiedTask> copied_;  // guarded by mu_: copies out done, for Advance

  // Worker-thread only.
  std::exception_ptr broken_;  // set when the ring failed; every later task fails with it
  unsigned in_flight_ = 0;
  unsigned copying_ = 0;  // tasks posted to the copier, not yet advanced (read under mu_ too)
  std::vector<Task*> retry_;
  std::vector<std::unique_ptr<AlignedBuffer>> bounce_;
  struct FreeBounce {
    AlignedBuffer* buffer;
    Clock::time_point released;
  };
  std::vector<FreeBounce> free_bounce_;  // in the order released
  // Written by the worker thread, read by any.
  std::atomic<uint64_t> bounce_bytes_{0};
  std::atomic<uint64_t> bounce_allocations_{0};
};

}  // namespace tensortier::detail
