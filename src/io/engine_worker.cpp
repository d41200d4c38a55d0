#include "tensortier/io/engine_worker.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>
#include <iterator>
#include <new>

#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/io/page_cache.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier::detail {

namespace {

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

}  // namespace

Worker::Worker(BackendFactory factory, unsigned depth, uint64_t budget, uint64_t bounce_budget,
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

Worker::~Worker() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void Worker::CopiedOut(Task* t, uint64_t bytes) {
  std::lock_guard lock(mu_);
  copied_.push_back({t, bytes});
  // Notified under the lock: once it is released the worker may finish and be destroyed.
  cv_.notify_one();
}

void Worker::Enqueue(std::vector<std::unique_ptr<Task>>& tasks) {
  {
    std::lock_guard lock(mu_);
    for (auto& t : tasks) queue_.push_back(std::move(t));
  }
  cv_.notify_one();
}

void Worker::Run() {
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
        t->op->Fail(std::make_exception_ptr(
            IoError(ENOMEM, "allocate a bounce buffer", piece.file.path(), t->offset, t->length)));
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

IoRequest Worker::Prepare(Task* t) {
  std::byte* target = t->user;
  if (t->direct && t->needs_bounce) {
    if (t->bounce == nullptr) t->bounce = TakeBounce(t->length);
    target = t->bounce->data();
    if (t->op->op == IoOp::kWrite) std::memcpy(target, t->user, t->length);
  }
  ++t->submissions;
  return IoRequest{t->op->op, t->fd, target, t->length, t->offset, reinterpret_cast<uint64_t>(t)};
}

void Worker::SubmitOrFail(const std::vector<IoRequest>& requests) {
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

void Worker::FailInFlight(std::exception_ptr error) {
  broken_ = error;
  for (Task* t : slots_) {
    if (t == nullptr) continue;
    Unslot(t);
    t->op->Fail(error);
    Finish(t);
  }
}

void Worker::Complete(Task* t, const IoCompletion& completion) {
  const Operation& op = *t->op;
  const int64_t result = completion.result;
  if (completion.refused) {
    // The ring could not take it (EAGAIN: out of resources, EBUSY: completion queue overflow):
    // the caller hears why, rather than the worker resubmitting into a ring that refuses.
    t->op->Fail(
        std::make_exception_ptr(IoError(static_cast<int>(-result),
                                        StrCat(NameOf(kIoOpNames, op.op, "write"), " (",
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
                                        StrCat(NameOf(kIoOpNames, op.op, "write"), " (",
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

void Worker::Advance(Task* t, uint64_t n) {
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

void Worker::Finish(Task* t) {
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

void Worker::WaitForWork(std::unique_lock<std::mutex>& lock) {
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

AlignedBuffer* Worker::TakeBounce(uint64_t bytes) {
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

void Worker::TrimBounce(Clock::time_point cutoff) {
  while (free_bounce_.size() > kIdleBounce && free_bounce_.front().released <= cutoff) {
    AlignedBuffer* b = free_bounce_.front().buffer;
    free_bounce_.erase(free_bounce_.begin());
    bounce_bytes_.fetch_sub(b->size(), std::memory_order_relaxed);
    std::erase_if(bounce_, [b](const std::unique_ptr<AlignedBuffer>& p) { return p.get() == b; });
  }
}

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

}  // namespace tensortier::detail
