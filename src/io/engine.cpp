#include "tensortier/io/engine.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <future>
#include <iterator>
#include <new>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <unordered_map>
#include "tensortier/util/strings.hpp"

#include <fcntl.h>
#include <unistd.h>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/io/page_cache.hpp"
#include "tensortier/util/thread_group.hpp"

namespace tensortier {
namespace detail {

struct Operation {
  IoOp op;
  std::vector<IoDesc> pieces;  // keeps the files open until the operation completes
  std::atomic<uint64_t> pending{0};
  std::atomic<bool> failed{false};

  mutable std::mutex mu;
  std::condition_variable cv;
  bool complete = false;     // guarded by mu
  std::exception_ptr error;  // first error; guarded by mu
  bool error_seen = false;   // a Wait() has thrown it; guarded by mu
  IoResult result;           // guarded by mu once dispatched

  void Fail(std::exception_ptr e) {
    std::lock_guard lock(mu);
    if (!error) error = std::move(e);
    failed.store(true, std::memory_order_relaxed);
  }

  void WaitComplete() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return complete; });
  }
};

// One piece of work for a worker: a contiguous range on one descriptor. Advanced in place as
// short transfers complete.
struct Task {
  std::shared_ptr<Operation> op;
  uint32_t piece;
  int fd;
  bool direct;
  bool needs_bounce;
  uint64_t offset;
  uint64_t length;
  std::byte* user;
  uint64_t charged;  // bytes counted against the worker's in-flight budget
  // Holds a bounce buffer (a staged read, or an unaligned read or write): `charged` also counts
  // against the bounce budget, TENSORTIER_MAX_STAGED.
  bool bounced = false;
  // A direct read that may end inside the block holding end of file (IoDesc::may_fill_past_eof):
  // the file's size when planned, UINT64_MAX otherwise. A count that stops off the alignment at
  // or past it is end of file, not a remainder to read buffered (elsewhere it still is).
  uint64_t eof_block_size = UINT64_MAX;
  uint64_t done = 0;
  uint32_t submissions = 0;
  uint32_t retries = 0;  // EAGAIN/EINTR completions in a row
  uint32_t slot = 0;     // index in the worker's in-flight table while submitted
  AlignedBuffer* bounce = nullptr;
};

class Worker;

// Copies `n` bytes read into `t`'s bounce buffer out to its destination. Memory the caller may
// not write fails the operation with EFAULT, as a direct read into it does, instead of killing
// the process; false then. Asked here, where the copy is about to fault the pages in anyway,
// not before the read: on the worker that would fault them in with the disk waiting.
bool CopyOut(const Task& t, uint64_t n) {
  if (!MemoryIsWritable(t.user, n)) {
    try {
      t.op->Fail(std::make_exception_ptr(IoError(EFAULT, "read into memory that is not writable",
                                                 t.op->pieces[t.piece].file.path(), t.offset, n)));
    } catch (...) {  // building the error (bad_alloc): fail with that, not the thread
      t.op->Fail(std::current_exception());
    }
    return false;
  }
  std::memcpy(t.user, t.bounce->data(), n);
  return true;
}

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
         uint64_t chunk, std::chrono::milliseconds bounce_idle, CopyPool* copier)
      : depth_(depth),
        budget_(budget),
        bounce_budget_(bounce_budget),
        chunk_(chunk),
        bounce_idle_(bounce_idle),
        copier_(copier),
        slots_(depth, nullptr) {
    free_slots_.reserve(depth);
    for (unsigned i = depth; i > 0; --i) free_slots_.push_back(i - 1);
    std::promise<std::string> started;
    auto ready = started.get_future();
    thread_ = std::thread([this, factory = std::move(factory), &started]() mutable {
      try {
        backend_ = factory(depth_);  // created here: the ring's single issuer is this thread
      } catch (...) {
        started.set_exception(std::current_exception());
        return;
      }
      started.set_value(std::string(backend_->name()));
      Run();
    });
    try {
      name_ = ready.get();
    } catch (...) {
      thread_.join();
      throw;
    }
  }

  ~Worker() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

  const std::string& name() const { return name_; }

  // Bytes of bounce buffers this worker holds, in use or free, and how many it has made so far
  // (any thread).
  uint64_t bounce_bytes() const { return bounce_bytes_.load(std::memory_order_relaxed); }
  uint64_t bounce_allocations() const {
    return bounce_allocations_.load(std::memory_order_relaxed);
  }

  // A copy posted by Complete() is done (a copier thread); `bytes` 0 when it failed.
  void CopiedOut(Task* t, uint64_t bytes) {
    std::lock_guard lock(mu_);
    copied_.push_back({t, bytes});
    // Notified under the lock: once it is released the worker may finish and be destroyed.
    cv_.notify_one();
  }

  void Enqueue(std::vector<std::unique_ptr<Task>>& tasks) {
    {
      std::lock_guard lock(mu_);
      for (auto& t : tasks) queue_.push_back(std::move(t));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    std::vector<IoCompletion> completions(depth_);
    std::vector<Task*> starting;
    std::vector<IoRequest> requests;
    std::vector<CopiedTask> copied;
    for (;;) {
      starting.clear();
      copied.clear();
      {
        std::unique_lock lock(mu_);
        if (in_flight_ == 0 && retry_.empty() && copied_.empty()) {
          WaitForWork(lock);
          // Stopping, and nothing is left.
          if (queue_.empty() && copied_.empty() && copying_ == 0) return;
        }
        copied.swap(copied_);
      }
      for (const CopiedTask& c : copied) {
        --copying_;
        if (c.bytes == 0) {
          Finish(c.task);  // the copy failed its operation
        } else {
          Advance(c.task, c.bytes);  // may queue a retry, or free budget for the queue
        }
      }
      {
        std::unique_lock lock(mu_);
        // Retries take ring slots too, and may be more than are free: a short transfer copied
        // out by a copy thread comes back holding none. The rest wait for the next pass.
        const size_t room = depth_ - in_flight_;
        if (retry_.size() <= room) {
          starting.swap(retry_);
        } else {
          starting.assign(retry_.begin(), retry_.begin() + static_cast<ptrdiff_t>(room));
          retry_.erase(retry_.begin(), retry_.begin() + static_cast<ptrdiff_t>(room));
        }
        while (!queue_.empty() && in_flight_ + starting.size() < depth_) {
          const Task& next = *queue_.front();
          bool idle = in_flight_ == 0 && starting.empty() && copying_ == 0;
          if (!idle && !Fits(next)) break;
          in_flight_bytes_ += next.charged;
          if (next.bounced) bounced_bytes_ += next.charged;
          starting.push_back(queue_.front().release());
          queue_.pop_front();
        }
      }
      requests.clear();
      for (Task* t : starting) {
        if (broken_) t->op->Fail(broken_);
        if (t->op->failed.load(std::memory_order_relaxed)) {
          Finish(t);  // the operation already failed: do not start more of it
          continue;
        }
        try {
          requests.push_back(Prepare(t));
          // A bounced write copied its data in Prepare (in a new process, into bounce memory
          // touched for the first time: ~4 ms per 4 MiB chunk here): submit it now, so that the
          // disk works while the next one is copied instead of waiting for the whole batch.
          if (t->op->op == IoOp::kWrite && t->bounce != nullptr) {
            SubmitOrFail(requests);
            requests.clear();
          }
        } catch (const std::bad_alloc&) {  // a bounce buffer: fail this operation, not the process
          const IoDesc& piece = t->op->pieces[t->piece];
          t->op->Fail(std::make_exception_ptr(IoError(ENOMEM, "allocate a bounce buffer",
                                                      piece.file.path(), t->offset, t->length)));
          Finish(t);
        }
      }
      if (!requests.empty()) SubmitOrFail(requests);
      if (free_bounce_.size() > kIdleBounce) TrimBusy();  // while that I/O runs
      if (in_flight_ == 0) continue;
      size_t n = 0;
      try {
        n = backend_->Reap(completions, 1);
      } catch (...) {
        FailInFlight(std::current_exception());
        continue;
      }
      for (size_t i = 0; i < n; ++i) {
        Task* t = reinterpret_cast<Task*>(completions[i].user_data);
        Unslot(t);
        Complete(t, completions[i]);
      }
    }
  }

  IoRequest Prepare(Task* t) {
    std::byte* target = t->user;
    if (t->direct && t->needs_bounce) {
      if (t->bounce == nullptr) t->bounce = TakeBounce(t->length);
      target = t->bounce->data();
      if (t->op->op == IoOp::kWrite) std::memcpy(target, t->user, t->length);
    }
    ++t->submissions;
    return IoRequest{t->op->op, t->fd, target, t->length, t->offset, reinterpret_cast<uint64_t>(t)};
  }

  void SubmitOrFail(const std::vector<IoRequest>& requests) {
    try {
      backend_->Submit(requests);
    } catch (...) {
      // None of them started (Backend contract): fail each.
      auto error = std::current_exception();
      for (const IoRequest& r : requests) {
        Task* t = reinterpret_cast<Task*>(r.user_data);
        t->op->Fail(error);
        Finish(t);
      }
      return;
    }
    for (const IoRequest& r : requests) {
      Task* t = reinterpret_cast<Task*>(r.user_data);
      t->slot = free_slots_.back();
      free_slots_.pop_back();
      slots_[t->slot] = t;
    }
    in_flight_ += static_cast<unsigned>(requests.size());
  }

  void Unslot(Task* t) {
    slots_[t->slot] = nullptr;
    free_slots_.push_back(t->slot);
    --in_flight_;
  }

  // Reaping itself failed (the ring is unusable): fail what is in flight and everything after,
  // rather than wait forever for completions that cannot be collected.
  void FailInFlight(std::exception_ptr error) {
    broken_ = error;
    for (Task* t : slots_) {
      if (t == nullptr) continue;
      Unslot(t);
      t->op->Fail(error);
      Finish(t);
    }
  }

  void Complete(Task* t, const IoCompletion& completion) {
    const Operation& op = *t->op;
    const int64_t result = completion.result;
    if (completion.refused) {
      // The ring could not take it (EAGAIN: out of resources, EBUSY: completion queue overflow):
      // the caller hears why, rather than the worker resubmitting into a ring that refuses.
      t->op->Fail(
          std::make_exception_ptr(IoError(static_cast<int>(-result),
                                          StrCat(op.op == IoOp::kRead ? "read" : "write", " (",
                                                 backend_->name(), " refused to submit it)"),
                                          op.pieces[t->piece].file.path(), t->offset, t->length)));
      Finish(t);
      return;
    }
    if (result == -EINTR || result == -EAGAIN) {  // not an error: the kernel asks to try again
      if (++t->retries <= kMaxRetries) {
        retry_.push_back(t);
        return;
      }
      // Asked again and again: say so rather than spin on it for good.
      t->op->Fail(
          std::make_exception_ptr(IoError(static_cast<int>(-result),
                                          StrCat(op.op == IoOp::kRead ? "read" : "write", " (",
                                                 kMaxRetries, " retries asked for in a row)"),
                                          op.pieces[t->piece].file.path(), t->offset, t->length)));
      Finish(t);
      return;
    }
    t->retries = 0;
    if (result < 0) {
      t->op->Fail(std::make_exception_ptr(
          IoError(static_cast<int>(-result),
                  op.op == IoOp::kRead ? (t->direct ? "read (O_DIRECT)" : "read")
                                       : (t->direct ? "write (O_DIRECT)" : "write"),
                  op.pieces[t->piece].file.path(), t->offset, t->length)));
      Finish(t);
      return;
    }
    uint64_t n = std::min<uint64_t>(static_cast<uint64_t>(result), t->length);
    if (n == 0) {
      if (op.op == IoOp::kRead) {
        std::lock_guard lock(t->op->mu);
        t->op->result.stats.eof = true;
      } else {
        t->op->Fail(std::make_exception_ptr(IoError(
            EIO, "write (no progress)", op.pieces[t->piece].file.path(), t->offset, t->length)));
      }
      Finish(t);
      return;
    }
    if (t->bounce != nullptr && op.op == IoOp::kRead) {
      if (copier_ != nullptr) {
        ++copying_;
        copier_->Post(this, t, n);  // back through CopiedOut, then Advance
        return;
      }
      if (!CopyOut(*t, n)) {
        Finish(t);
        return;
      }
    }
    Advance(t, n);
  }

  // `n` more bytes of `t` are transferred (and copied out of its bounce buffer): finishes it, or
  // continues a short transfer where it stopped.
  void Advance(Task* t, uint64_t n) {
    const Operation& op = *t->op;
    t->done += n;
    t->offset += n;
    t->user += n;
    t->length -= n;
    if (t->length == 0) {
      Finish(t);
      return;
    }
    // Short transfer: continue where it stopped. A remainder that breaks the O_DIRECT rules (the
    // kernel returned a count that is not block-aligned) continues through the page cache.
    const File& file = op.pieces[t->piece].file;
    if (t->direct && t->offset >= t->eof_block_size && t->offset % file.offset_alignment() != 0) {
      {
        std::lock_guard lock(t->op->mu);
        t->op->result.stats.eof = true;
      }
      Finish(t);
      return;
    }
    if (t->direct &&
        (t->offset % file.offset_alignment() != 0 || t->length % file.offset_alignment() != 0 ||
         (t->bounce == nullptr && !IsAligned(t->user, file.memory_alignment())))) {
      t->direct = false;
      t->fd = file.buffered_fd();
      ReleaseBounce(t);
    }
    {
      std::lock_guard lock(t->op->mu);
      ++t->op->result.stats.resubmits;
    }
    retry_.push_back(t);
  }

  void Finish(Task* t) {
    std::unique_ptr<Task> owned(t);
    ReleaseBounce(t);
    {
      std::lock_guard lock(mu_);
      in_flight_bytes_ -= t->charged;
      if (t->bounced) bounced_bytes_ -= t->charged;
    }
    Operation& op = *t->op;
    bool last;
    std::vector<IoDesc> finished_pieces;  // let go of outside the lock
    {
      std::lock_guard lock(op.mu);
      op.result.bytes += t->done;
      op.result.segment_bytes[t->piece] += t->done;
      op.result.stats.transferred_bytes += t->done;
      op.result.stats.requests += t->submissions;
      last = --op.pending == 0;
      // A finished operation needs its files no more: neither a future kept nor the engine's
      // list of operations may hold their descriptors open (EMFILE, deleted files' space held).
      if (last) finished_pieces.swap(op.pieces);
    }
    if (last) {
      // Let go of the files before anyone can see the operation complete.
      finished_pieces.clear();
      {
        std::lock_guard lock(op.mu);
        op.complete = true;
      }
      op.cv.notify_all();
    }
  }

  // Waits, idle, until work arrives or the engine stops. Meanwhile each bounce buffer beyond
  // kIdleBounce goes once it has been unused for bounce_idle_ (at once for 0): a caller that just
  // offloaded its tensors to free RAM expects that memory back, while a caller whose next burst
  // follows soon (the next shard of a checkpoint) would fault it all in again. Counted from each
  // buffer's release, not from the start of this wait, so a trickle of small requests that keeps
  // waking the worker does not keep a burst's buffers forever.
  void WaitForWork(std::unique_lock<std::mutex>& lock) {
    // Queued tasks wait while copies out hold the budget; a stopping worker waits for its copies.
    auto has_work = [&] {
      return !copied_.empty() || (stopping_ && copying_ == 0) ||
             (!queue_.empty() && (copying_ == 0 || Fits(*queue_.front())));
    };
    while (free_bounce_.size() > kIdleBounce) {
      const Clock::time_point due = free_bounce_.front().released + bounce_idle_;
      if (cv_.wait_until(lock, due, has_work)) return;
      lock.unlock();  // unmapping takes a while: let callers enqueue meanwhile
      TrimBounce(Clock::now() - bounce_idle_);
      lock.lock();
    }
    cv_.wait(lock, has_work);
  }

  // Whether `t` may start within the budgets (under mu_).
  bool Fits(const Task& t) const {
    return in_flight_bytes_ + t.charged <= budget_ &&
           (!t.bounced || bounced_bytes_ + t.charged <= bounce_budget_);
  }

  // The most recently released free bounce buffer of at least `bytes` (tasks are chunk_ bytes, or
  // a little more where the file's O_DIRECT offset alignment does not divide chunk_), else a new
  // one. Taking the newest lets the oldest age out when less is in flight than before.
  AlignedBuffer* TakeBounce(uint64_t bytes) {
    auto fits = std::find_if(free_bounce_.rbegin(), free_bounce_.rend(),
                             [bytes](const FreeBounce& f) { return f.buffer->size() >= bytes; });
    if (fits == free_bounce_.rend()) {
      bounce_.push_back(std::make_unique<AlignedBuffer>(std::max(chunk_, bytes), Pages::kReused));
      bounce_bytes_.fetch_add(bounce_.back()->size(), std::memory_order_relaxed);
      bounce_allocations_.fetch_add(1, std::memory_order_relaxed);
      return bounce_.back().get();
    }
    AlignedBuffer* b = fits->buffer;
    free_bounce_.erase(std::next(fits).base());
    return b;
  }

  // Frees the free bounce buffers released at or before `cutoff`, oldest first, keeping
  // kIdleBounce: a burst of unaligned or staged I/O may have made one per request in flight (up
  // to the byte budget).
  void TrimBounce(Clock::time_point cutoff) {
    while (free_bounce_.size() > kIdleBounce && free_bounce_.front().released <= cutoff) {
      AlignedBuffer* b = free_bounce_.front().buffer;
      free_bounce_.erase(free_bounce_.begin());
      bounce_bytes_.fetch_sub(b->size(), std::memory_order_relaxed);
      std::erase_if(bounce_, [b](const std::unique_ptr<AlignedBuffer>& p) { return p.get() == b; });
    }
  }

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

void CopyPool::Run() {
  for (;;) {
    Job job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = jobs_.front();
      jobs_.pop_front();
    }
    const bool copied = CopyOut(*job.task, job.bytes);
    job.worker->CopiedOut(job.task, copied ? job.bytes : 0);
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------

bool Future::done() const {
  if (!op_) throw std::logic_error("tensortier::Future: not associated with an operation");
  std::lock_guard lock(op_->mu);
  return op_->complete;
}

bool Future::WaitFor(std::chrono::milliseconds timeout) const {
  if (!op_) throw std::logic_error("tensortier::Future: not associated with an operation");
  std::unique_lock lock(op_->mu);
  return op_->cv.wait_for(lock, timeout, [&] { return op_->complete; });
}

IoResult Future::Wait() const {
  if (!op_) throw std::logic_error("tensortier::Future: not associated with an operation");
  op_->WaitComplete();
  std::lock_guard lock(op_->mu);
  if (op_->error) {
    op_->error_seen = true;
    std::rethrow_exception(op_->error);
  }
  return op_->result;
}

namespace {

using detail::Operation;
using detail::Task;

std::unique_ptr<Task> MakeTask(const std::shared_ptr<Operation>& op, uint32_t piece, int fd,
                               bool direct, uint64_t offset, uint64_t length, std::byte* user,
                               bool needs_bounce) {
  auto t = std::make_unique<Task>();
  t->op = op;
  t->piece = piece;
  t->fd = fd;
  t->direct = direct;
  t->needs_bounce = needs_bounce;
  t->offset = offset;
  t->length = length;
  t->user = user;
  t->charged = length;
  return t;
}

// Splits [offset, offset+length) of one piece into tasks and fills the plan's statistics.
class Planner {
 public:
  Planner(const EngineOptions& options, const SubmitOptions& submit,
          const std::shared_ptr<Operation>& op, std::vector<std::unique_ptr<Task>>& tasks)
      : options_(options),
        stage_reads_(submit.stage_reads && op->op == IoOp::kRead &&
                     options.stage_reads != ReadStaging::kOff),
        op_(op),
        tasks_(tasks),
        stats_(op->result.stats) {}

  void Plan(uint32_t index) {
    const IoDesc& piece = op_->pieces[index];
    const File& file = piece.file;
    auto* user = static_cast<std::byte*>(piece.buf);
    stats_.requested_bytes += piece.length;
    if (piece.length == 0) return;
    if (!file.direct()) {
      stats_.direct_fallback |= !file.direct_fallback_reason().empty();
      Buffered(index, piece.offset, piece.length, user);
      return;
    }
    // Writes go direct only in whole pages. A buffered write of part of a page reads the rest of
    // the page into the cache; if a direct write lands on that rest meanwhile, writeback of the
    // stale page overwrites it (the kernel cannot invalidate a dirty page). Whole pages keep
    // buffered and direct writes, of this operation or of any other, on separate pages.
    const uint64_t align = op_->op == IoOp::kWrite
                               ? std::max<uint64_t>(file.offset_alignment(), SystemPageSize())
                               : file.offset_alignment();
    const uint64_t end = piece.offset + piece.length;
    // A direct read of the block holding end of file lets the kernel fill the whole block, zeroing
    // the caller's bytes past EOF. Reads stop going direct at the last whole block before EOF; the
    // rest goes through the page cache, which copies only what exists (and sees a file that grew).
    uint64_t direct_end = end;
    if (op_->op == IoOp::kRead && !piece.may_fill_past_eof) {
      direct_end = std::min(end, std::max(piece.offset, SizeOf(file)));
    }
    const uint64_t mid_begin = AlignUp(piece.offset, align);
    const uint64_t mid_end = AlignDown(direct_end, align);
    if (mid_begin >= mid_end) {  // smaller than one aligned block: the page cache does it exactly
      Buffered(index, piece.offset, piece.length, user);
      return;
    }
    Buffered(index, piece.offset, mid_begin - piece.offset, user);
    Direct(index, mid_begin, mid_end - mid_begin, user + (mid_begin - piece.offset));
    Buffered(index, mid_end, end - mid_end, user + (mid_end - piece.offset));
  }

 private:
  void Buffered(uint32_t index, uint64_t offset, uint64_t length, std::byte* user) {
    const int fd = op_->pieces[index].file.buffered_fd();
    for (uint64_t done = 0; done < length;) {
      uint64_t n = std::min(length - done, options_.chunk_size);
      tasks_.push_back(MakeTask(op_, index, fd, false, offset + done, n, user + done, false));
      done += n;
    }
    stats_.buffered_bytes += length;
  }

  // REQUIRES: offset and length aligned to the file's O_DIRECT offset alignment.
  void Direct(uint32_t index, uint64_t offset, uint64_t length, std::byte* user) {
    const File& file = op_->pieces[index].file;
    const uint64_t chunk = AlignUp(options_.chunk_size, file.offset_alignment());
    // Resident chunks are read through the page cache. One query for the whole range first: the
    // common cases (nothing or everything cached) need no per-chunk queries.
    Residency whole;
    const bool check =
        op_->op == IoOp::kRead && options_.page_cache_check && MayHaveCachedPages(file);
    if (check) {
      whole = QueryResidency(file.buffered_fd(), offset, length);
      stats_.residency_method = ResidencyMethodName(whole.method);
    }
    const bool all_cached =
        check && whole.checked_bytes > 0 && whole.resident_bytes == whole.checked_bytes;
    const bool some_cached = check && whole.resident_bytes > 0;
    const bool stage = Stages(file);
    for (uint64_t done = 0; done < length;) {
      uint64_t n = std::min(length - done, chunk);
      bool cached = all_cached;
      if (some_cached && !all_cached) {
        Residency r = QueryResidency(file.buffered_fd(), offset + done, n, whole.method);
        cached = r.checked_bytes > 0 && r.resident_bytes * 2 >= r.checked_bytes;
      }
      if (cached) {
        tasks_.push_back(
            MakeTask(op_, index, file.buffered_fd(), false, offset + done, n, user + done, false));
        stats_.buffered_bytes += n;
        stats_.cached_bytes += n;
      } else {
        const bool aligned = IsAligned(user + done, file.memory_alignment());
        const bool bounce = !aligned || (stage && StagesInto(user + done, n));
        tasks_.push_back(
            MakeTask(op_, index, file.direct_fd(), true, offset + done, n, user + done, bounce));
        // The budget bounds memory in flight: a bounced piece holds a whole bounce buffer (at
        // least chunk_size), however few of its bytes it moves. Charged by length, a batch of
        // small unaligned pieces made one buffer per request slot, twice the budget.
        if (bounce) tasks_.back()->charged = std::max(n, options_.chunk_size);
        tasks_.back()->bounced = bounce;
        if (op_->op == IoOp::kRead && op_->pieces[index].may_fill_past_eof) {
          tasks_.back()->eof_block_size = SizeOf(file);
        }
        stats_.direct_bytes += n;
        if (bounce) stats_.bounced_bytes += n;
        if (aligned && bounce) stats_.staged_bytes += n;
      }
      done += n;
    }
  }

  // A batch of many small reads (random reads, many tensors of one file) would pay two system
  // calls per piece for residency; one cachestat per file per batch settles the common cold case.
  // It covers only the span the batch reads: its cost grows with the cached pages it walks
  // (~13 ms for a warm 2 GiB file), and a load reading a large file in 30 batches paid a
  // whole-file walk in each. (mincore would map the range: only per-piece queries there.)
  bool MayHaveCachedPages(const File& file) {
    if (op_->pieces.size() < 2 || ResidencyMethodInUse() != ResidencyMethod::kCachestat) {
      return true;
    }
    const int fd = file.buffered_fd();
    auto [it, inserted] = file_may_be_cached_.try_emplace(fd, true);
    if (inserted) {
      uint64_t begin = UINT64_MAX;
      uint64_t end = 0;
      for (const IoDesc& piece : op_->pieces) {
        if (piece.length == 0 || piece.file.buffered_fd() != fd) continue;
        begin = std::min(begin, piece.offset);
        end = std::max(end, piece.offset + piece.length);
      }
      Residency r = QueryResidency(fd, begin, end - begin, ResidencyMethod::kCachestat);
      it->second = r.method == ResidencyMethod::kUnknown || r.resident_bytes > 0;
      if (!it->second) stats_.residency_method = ResidencyMethodName(r.method);
    }
    return it->second;
  }

  // Whether this operation's direct reads of `file` go through bounce buffers (see ReadStaging).
  bool Stages(const File& file) const { return stage_reads_ && StagesReads(options_, file); }

  // Whether a staged chunk goes through a bounce buffer, given its destination. With copy
  // threads always: the workers only read, into huge pages. Without them, under kAuto only where
  // most of the destination is faulted in already: into memory never touched (the tensors of a
  // load in a new process) the copy out would fault each small page on a worker thread, which
  // then neither reaps nor submits; a direct read faults them in the kernel, without the copy.
  bool StagesInto(const std::byte* user, uint64_t length) const {
    if (options_.stage_reads == ReadStaging::kOn || options_.copy_threads > 0) return true;
    return ResidentMemoryBytes(user, length) * 2 >= length;
  }

  // The file's size when the batch is planned, one fstat per file (not per piece).
  uint64_t SizeOf(const File& file) {
    auto [it, inserted] = file_size_.try_emplace(file.buffered_fd(), 0);
    if (inserted) it->second = file.Size();
    return it->second;
  }

  const EngineOptions& options_;
  const bool stage_reads_;  // the operation allows staging and the options do not forbid it
  const std::shared_ptr<Operation>& op_;
  std::vector<std::unique_ptr<Task>>& tasks_;
  IoStats& stats_;
  std::unordered_map<int, bool> file_may_be_cached_;  // buffered fd -> any page cached
  std::unordered_map<int, uint64_t> file_size_;       // buffered fd -> size at planning
};

void ValidatePiece(IoOp op, const IoDesc& piece) {
  if (!piece.file.is_open()) throw std::invalid_argument("I/O on a closed or unopened File");
  if (piece.length > 0 && piece.buf == nullptr) {
    throw std::invalid_argument(StrCat("null buffer for ", piece.length, " bytes"));
  }
  if (piece.offset > static_cast<uint64_t>(INT64_MAX) ||
      piece.length > static_cast<uint64_t>(INT64_MAX) - piece.offset) {
    throw std::invalid_argument(
        StrCat("file range at offset ", piece.offset, " length ", piece.length, " overflows"));
  }
  if (op == IoOp::kWrite && !piece.file.writable()) {
    ThrowIoError(EBADF, "write (file opened read-only)", piece.file.path(), piece.offset,
                 piece.length);
  }
  if (op == IoOp::kRead && !piece.file.readable()) {
    ThrowIoError(EBADF, "read (file opened write-only: no permission to read it)",
                 piece.file.path(), piece.offset, piece.length);
  }
}

// A refused fallocate may have kept what fit: ext4 allocates up to the full filesystem and moves
// the size there before it says ENOSPC, which left a write that moved no byte holding the space.
// The file goes back to `keep` (its size before, or the write's offset past it) while its size
// still lies within the range [keep, end): anything below the write's offset may have been
// reserved since by a concurrent write. A size beyond the range (a later piece of the operation
// past a gap kept it there, or another operation moved it) cannot come back: the range's blocks
// are given back instead, the size staying. Best effort: the refusal is the error to report,
// whatever happens here.
void GiveBackPartialReservation(const File& file, uint64_t keep, uint64_t end) noexcept {
  try {
    const uint64_t now = file.Size();
    if (now > keep && now <= end) {
      file.Truncate(keep);
    } else if (now > end) {
      file.PunchHole(keep, end - keep);
    }
  } catch (...) {  // the refusal is what the caller hears about
  }
}

// A range ReserveExtendingWrites asked the filesystem for: what to give back if the operation
// fails before any byte of it is written (see GiveBackPartialReservation).
struct Reservation {
  const File* file;
  uint64_t keep;  // the file's size before, or the piece's offset past it
  uint64_t end;   // the piece's end
};

// Gives back `reserved`, latest first: each piece then finds the size its own reservation left,
// and the file ends at the size it had before the operation (or at a piece's offset past it).
void GiveBackReservations(const std::vector<Reservation>& reserved) noexcept {
  for (auto it = reserved.rbegin(); it != reserved.rend(); ++it) {
    GiveBackPartialReservation(*it->file, it->keep, it->end);
  }
}

// O_DIRECT writes past end of file are serialised by the filesystem (ext4 and XFS take the inode
// lock to update the size), which halves sequential write speed. Reserving the range first
// (fallocate mode 0 also moves the size) makes the writes non-extending and fully parallel, and
// reports ENOSPC before any byte is written. Holes before the range stay holes. Each range asked
// for is added to `reserved` (the refused one included: it may have kept what fit), so that a
// failure of the operation before it writes gives all of them back, not only the refused one.
void ReserveExtendingWrites(std::span<const IoDesc> pieces, std::vector<Reservation>& reserved) {
  std::unordered_map<int, uint64_t> sizes;  // one fstat per file, not per piece
  for (const IoDesc& piece : pieces) {
    if (piece.length == 0 || !piece.file.direct()) continue;
    const uint64_t end = piece.offset + piece.length;
    auto [size, inserted] = sizes.try_emplace(piece.file.buffered_fd(), 0);
    if (inserted) size->second = piece.file.Size();
    if (end <= size->second) continue;
    reserved.push_back({&piece.file, std::max(size->second, piece.offset), end});
    try {
      piece.file.Allocate(piece.offset, piece.length);
      size->second = end;  // fallocate mode 0 moved the size
    } catch (const IoError& e) {
      // A filesystem without fallocate still takes plain writes; real failures are reported.
      if (e.error_code() != EOPNOTSUPP && e.error_code() != ENOSYS) throw;
      reserved.pop_back();  // nothing was reserved
    }
  }
}

}  // namespace

bool StagesReads(const EngineOptions& options, const File& file) {
  switch (options.stage_reads) {
    case ReadStaging::kOff:
      return false;
    case ReadStaging::kOn:
      return true;
    case ReadStaging::kAuto:
      break;
  }
  const auto& limits = file.block_queue_limits();
  return limits && ScatteredMemorySplitsRequests(*limits, options.chunk_size) &&
         GetsHugePages(options.chunk_size, Pages::kReused);
}

IoStats& IoStats::operator+=(const IoStats& other) {
  if (backend.empty()) backend = other.backend;
  requested_bytes += other.requested_bytes;
  transferred_bytes += other.transferred_bytes;
  direct_bytes += other.direct_bytes;
  buffered_bytes += other.buffered_bytes;
  bounced_bytes += other.bounced_bytes;
  staged_bytes += other.staged_bytes;
  cached_bytes += other.cached_bytes;
  requests += other.requests;
  resubmits += other.resubmits;
  eof = eof || other.eof;
  direct_fallback = direct_fallback || other.direct_fallback;
  if (!other.residency_method.empty()) residency_method = other.residency_method;
  return *this;
}

namespace {

// A new file of ours in `dir` for a probe: a random name, created exclusively and never through
// a symlink (a probe directory may be shared, such as /tmp: a planted link must not get its
// target truncated). Throws IoError naming `dir`.
std::string CreateProbeFile(const std::string& dir, std::string_view tag) {
  return CreateUniqueFile(
      [&](uint32_t n) { return StrCat(dir, "/.tensortier-probe-", getpid(), "-", tag, "-", n); },
      0600, "create a file in the directory", dir);
}

// A directory that cannot take a file (missing, not a directory, no permission, read-only
// filesystem) fails every backend's probe the same way: reported as that, with its errno,
// rather than as "no I/O backend works".
void RequireDirectoryTakesFiles(const std::string& dir) {
  unlink(CreateProbeFile(dir, "dir").c_str());
}

}  // namespace

Engine::Engine(EngineOptions options, const std::string& probe_dir)
    : owner_pid_(getpid()), options_(std::move(options)) {
  options_.Validate();
  // Workers allocate bounce buffers: settle the page policy here, so that a malformed
  // TENSORTIER_HUGE_PAGES throws to the caller, not on a worker thread.
  UsesHugePages(Pages::kReused);
  StartCopyThreads();
  if (options_.backend != "auto") {
    BackendKind kind = ParseBackendKind(options_.backend);
    Start([kind](unsigned depth) { return MakeBackend(kind, depth); });
    return;
  }
  if (!probe_dir.empty()) RequireDirectoryTakesFiles(probe_dir);
  std::string why;
  for (BackendKind kind : kAllBackends) {
    if (!probe_dir.empty()) {
      BackendProbe p = ProbeBackend(kind, probe_dir);
      if (!p.available || !(p.direct_ok || p.buffered_ok)) {
        why += StrCat(BackendName(kind), ": ", p.detail, "; ");
        continue;
      }
    }
    try {
      Start([kind](unsigned depth) { return MakeBackend(kind, depth); });
      return;
    } catch (const std::exception& e) {
      why += StrCat(BackendName(kind), ": ", e.what(), "; ");
    }
  }
  throw std::runtime_error("no I/O backend works here: " + why.substr(0, why.size() - 2));
}

Engine::Engine(EngineOptions options, BackendFactory factory)
    : owner_pid_(getpid()), options_(std::move(options)) {
  options_.Validate();
  // Workers allocate bounce buffers: settle the page policy here, so that a malformed
  // TENSORTIER_HUGE_PAGES throws to the caller, not on a worker thread.
  UsesHugePages(Pages::kReused);
  StartCopyThreads();
  Start(std::move(factory));
}

// Once, before any backend is tried: a thread that cannot be had is no backend's failure.
void Engine::StartCopyThreads() {
  if (options_.copy_threads == 0) return;
  copy_pool_ = std::make_unique<detail::CopyPool>(options_.copy_threads);
}

void Engine::Start(BackendFactory factory) {
  workers_.clear();
  const uint64_t budget =
      std::max(options_.max_inflight_bytes / options_.workers, options_.chunk_size);
  const uint64_t bounce_budget =
      std::max(options_.max_staged_bytes / options_.workers, options_.chunk_size);
  for (unsigned i = 0; i < options_.workers; ++i) {
    workers_.push_back(std::make_unique<detail::Worker>(
        factory, options_.queue_depth, budget, bounce_budget, options_.chunk_size,
        std::chrono::milliseconds(options_.bounce_idle_ms), copy_pool_.get()));
  }
  backend_ = workers_.front()->name();
}

Engine::~Engine() {
  if (forked()) {
    // Only the thread that called fork() was copied into this child: the workers' threads are
    // gone, and the locks and condition variables they held or waited on stay so (destroying a
    // condition variable with waiters can block). The workers and operations are left in place,
    // and the engine's own mutex is made anew, unheld, for its destructor.
    new std::vector<std::unique_ptr<detail::Worker>>(std::move(workers_));
    copy_pool_.release();  // NOLINT(bugprone-unused-return-value): left in place, as the workers
    new std::vector<std::shared_ptr<Operation>>(std::move(outstanding_));
    new (&mu_) std::mutex;
    return;
  }
  std::vector<std::shared_ptr<Operation>> ops;
  {
    std::lock_guard lock(mu_);
    ops.swap(outstanding_);
  }
  for (auto& op : ops) op->WaitComplete();
  workers_.clear();  // joins, after their copies out
  copy_pool_.reset();
}

Future Engine::Read(const File& file, void* buf, uint64_t length, uint64_t offset) {
  IoDesc piece{file, buf, offset, length};
  return Submit(IoOp::kRead, std::span<const IoDesc>(&piece, 1));
}

Future Engine::Write(const File& file, const void* buf, uint64_t length, uint64_t offset) {
  // The engine never writes into `buf` for a write; the cast only fits the shared descriptor.
  IoDesc piece{file, const_cast<void*>(buf), offset, length};
  return Submit(IoOp::kWrite, std::span<const IoDesc>(&piece, 1));
}

bool Engine::forked() const noexcept {
  return getpid() != owner_pid_;
}

void Engine::CheckNotForked() const {
  if (forked()) {
    throw std::logic_error(StrCat("this I/O engine was made in process ", owner_pid_,
                                  "; in process ", getpid(),
                                  ", a child made by fork(), its "
                                  "worker threads do not exist: make a new engine there"));
  }
}

Future Engine::Submit(IoOp op, std::span<const IoDesc> pieces, const SubmitOptions& submit) {
  CheckNotForked();
  for (const IoDesc& piece : pieces) ValidatePiece(op, piece);
  auto operation = std::make_shared<Operation>();
  operation->op = op;
  operation->pieces.assign(pieces.begin(), pieces.end());
  operation->result.segment_bytes.assign(pieces.size(), 0);
  operation->result.stats.backend = backend_;

  std::vector<std::unique_ptr<Task>> tasks;
  std::vector<Reservation> reserved;
  try {
    if (op == IoOp::kWrite) ReserveExtendingWrites(pieces, reserved);
    Planner planner(options_, submit, operation, tasks);
    for (uint32_t i = 0; i < pieces.size(); ++i) planner.Plan(i);
  } catch (const IoError&) {
    // An I/O error while preparing (fallocate's ENOSPC, a failed fstat) is the operation's
    // outcome, raised once by Wait() (or WaitAll() for a dropped future) as a failed transfer
    // is: which call raises must not depend on whether the filesystem reserves space up front.
    // Nothing was transferred, so no space the operation reserved stays taken.
    GiveBackReservations(reserved);
    tasks.clear();
    operation->Fail(std::current_exception());
    std::lock_guard lock(operation->mu);
    operation->complete = true;
    operation->pieces.clear();
  } catch (...) {  // anything else (a bad piece, no memory) is thrown to the caller, as before
    GiveBackReservations(reserved);
    throw;
  }

  if (operation->failed.load(std::memory_order_relaxed)) {
    std::lock_guard lock(mu_);
    outstanding_.push_back(std::move(operation));
    return Future(outstanding_.back());
  }
  operation->pending.store(tasks.size());
  if (tasks.empty()) {
    std::lock_guard lock(operation->mu);
    operation->complete = true;
    operation->pieces.clear();
    return Future(std::move(operation));
  }
  size_t first;
  {
    std::lock_guard lock(mu_);
    // Forget finished operations whose outcome nobody can still ask WaitAll for.
    if (outstanding_.size() >= 256) {
      std::erase_if(outstanding_, [](const std::shared_ptr<Operation>& o) {
        std::lock_guard op_lock(o->mu);
        return o->complete && (!o->error || o->error_seen);
      });
    }
    outstanding_.push_back(operation);
    first = next_worker_;
    next_worker_ = (next_worker_ + 1) % workers_.size();
  }
  // Round-robin over the workers, starting at a rotating one so small operations spread too.
  const size_t w = workers_.size();
  std::vector<std::vector<std::unique_ptr<Task>>> per_worker(std::min(w, tasks.size()));
  for (size_t i = 0; i < tasks.size(); ++i)
    per_worker[i % per_worker.size()].push_back(std::move(tasks[i]));
  for (size_t i = 0; i < per_worker.size(); ++i) workers_[(first + i) % w]->Enqueue(per_worker[i]);
  return Future(std::move(operation));
}

void Engine::WaitAll() {
  CheckNotForked();
  std::vector<std::shared_ptr<Operation>> ops;
  {
    std::lock_guard lock(mu_);
    ops.swap(outstanding_);
  }
  std::exception_ptr first;
  for (auto& op : ops) {
    op->WaitComplete();
    std::lock_guard lock(op->mu);
    if (op->error && !op->error_seen) {
      op->error_seen = true;
      if (!first) first = op->error;
    }
  }
  if (first) std::rethrow_exception(first);
}

uint64_t Engine::bounce_bytes() const {
  uint64_t total = 0;
  for (const auto& worker : workers_) total += worker->bounce_bytes();
  return total;
}

uint64_t Engine::bounce_allocations() const {
  uint64_t total = 0;
  for (const auto& worker : workers_) total += worker->bounce_allocations();
  return total;
}

// ---------------------------------------------------------------------------------------------

namespace {

// Writes a pattern, reads it back through `engine`, compares. Returns "" or what went wrong.
std::string RoundTrip(Engine& engine, const std::string& path, bool direct, std::string* fallback) {
  constexpr size_t kBytes = 8192;
  AlignedBuffer out(kBytes), in(kBytes);
  for (size_t i = 0; i < kBytes; ++i) out.data()[i] = static_cast<std::byte>(i * 131 + 7);
  try {
    File f = File::Open(path, OpenMode::kReadWrite, direct);  // made by CreateProbeFile
    if (direct && !f.direct()) {
      *fallback = f.direct_fallback_reason();
      return "O_DIRECT not available: " + f.direct_fallback_reason();
    }
    engine.Write(f, out.data(), kBytes, 0).Wait();
    uint64_t got = engine.Read(f, in.data(), kBytes, 0).Wait().bytes;
    if (got != kBytes || std::memcmp(out.data(), in.data(), kBytes) != 0) {
      return "data read back differs from data written";
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

BackendProbe ProbeBackend(BackendKind kind, const std::string& dir) {
  BackendProbe probe;
  probe.kind = kind;
  if (!BackendCompiledIn(kind)) {
    probe.detail = "not built (library not found at build time)";
    return probe;
  }
  EngineOptions options;
  options.workers = 1;
  options.queue_depth = 4;
  options.chunk_size = 4096;  // two requests per round trip: exercises the ring, not just one call
  options.max_inflight_bytes = 1 << 20;
  options.page_cache_check = false;
  std::unique_ptr<Engine> engine;
  try {
    engine = std::make_unique<Engine>(options,
                                      [kind](unsigned depth) { return MakeBackend(kind, depth); });
  } catch (const std::exception& e) {
    probe.detail = e.what();
    return probe;
  }
  probe.available = true;
  std::string path;
  try {
    path = CreateProbeFile(dir, BackendName(kind));
  } catch (const std::exception& e) {
    probe.detail = e.what();
    return probe;
  }
  std::string fallback;
  std::string direct_error = RoundTrip(*engine, path, true, &fallback);
  std::string buffered_error = RoundTrip(*engine, path, false, &fallback);
  unlink(path.c_str());
  probe.direct_ok = direct_error.empty();
  probe.buffered_ok = buffered_error.empty();
  if (!buffered_error.empty()) {
    probe.detail = "buffered: " + buffered_error;
  } else if (!direct_error.empty()) {
    probe.detail = direct_error;
  }
  return probe;
}

}  // namespace tensortier
