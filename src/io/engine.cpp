#include "tensortier/io/engine.hpp"

#include <algorithm>
#include <exception>
#include <new>
#include <stdexcept>

#include <unistd.h>

#include "tensortier/io/backend_probe.hpp"
#include "tensortier/io/engine_planner.hpp"
#include "tensortier/io/engine_reservation.hpp"
#include "tensortier/io/engine_task.hpp"
#include "tensortier/io/engine_worker.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

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

using detail::GiveBackReservations;
using detail::Operation;
using detail::Planner;
using detail::Reservation;
using detail::ReserveExtendingWrites;
using detail::Task;

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

}  // namespace

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

Engine::Engine(EngineOptions options, const std::string& probe_dir) : options_(std::move(options)) {
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
  if (!probe_dir.empty()) detail::RequireDirectoryTakesFiles(probe_dir);
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

Engine::Engine(EngineOptions options, BackendFactory factory) : options_(std::move(options)) {
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
  return maker_.Forked();
}

void Engine::CheckNotForked() const {
  if (forked()) {
    throw std::logic_error(ForkedUseMessage(
        "I/O engine", maker_.pid(), "its worker threads do not exist", "make a new engine there"));
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
    for (const IoDesc& piece : pieces) {
      if (piece.length > 0 && !piece.file.seekable()) {
        ThrowIoError(ESPIPE,
                     StrCat(NameOf(kIoOpNames, op, "write"),
                            " (a FIFO, socket or terminal: it has no offsets to transfer at)"),
                     piece.file.path(), piece.offset, piece.length);
      }
    }
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

}  // namespace tensortier
