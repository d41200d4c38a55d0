// What the engine's planner makes and its workers run: an operation (one Submit) and its
// tasks (contiguous ranges of it on one descriptor). Internal to the engine.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/engine.hpp"

namespace tensortier::detail {

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

}  // namespace tensortier::detail
