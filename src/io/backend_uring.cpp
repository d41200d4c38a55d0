// io_uring backend (liburing). Built only when liburing is found; otherwise creation reports
// ENOTSUP and `auto` moves on.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <vector>

#include "tensortier/io/backend.hpp"
#include "tensortier/io/test_hooks.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

#ifdef TENSORTIER_HAVE_LIBURING
#include <liburing.h>
#endif

namespace tensortier {

#ifdef TENSORTIER_HAVE_LIBURING
namespace {

class UringBackend final : public Backend {
 public:
  explicit UringBackend(unsigned depth) : depth_(depth) {
    // The worker that creates the ring is the only one that submits and reaps, so the kernel can
    // skip cross-thread wakeups; older kernels refuse these flags with EINVAL (probe like
    // liburing).
    io_uring_params params{};
    params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    int rc = io_uring_queue_init_params(depth, &ring_, &params);
    if (rc == -EINVAL) {
      params = {};
      rc = io_uring_queue_init_params(depth, &ring_, &params);
    }
    if (rc < 0) ThrowSystemError(-rc, StrCat("io_uring_queue_init (queue depth ", depth, ")"));
    refused_.reserve(depth);  // Submit must not fail for memory once requests are in flight
  }
  ~UringBackend() override { io_uring_queue_exit(&ring_); }

  std::string_view name() const noexcept override { return BackendName(BackendKind::kIoUring); }
  unsigned depth() const noexcept override { return depth_; }

  void Submit(std::span<const IoRequest> requests) override {
    // Every entry of a batch is taken before any is prepared: a batch that does not fit (the
    // caller broke the depth contract) leaves nothing in the ring.
    if (io_uring_sq_space_left(&ring_) < requests.size()) {
      ThrowSystemError(EBUSY, StrCat("io_uring: ", requests.size(),
                                     " requests do not fit the submission queue (",
                                     io_uring_sq_space_left(&ring_), " free)"));
    }
    for (const IoRequest& r : requests) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (r.op == IoOp::kRead) {
        io_uring_prep_read(sqe, r.fd, r.buf, static_cast<unsigned>(r.len), r.offset);
      } else {
        io_uring_prep_write(sqe, r.fd, r.buf, static_cast<unsigned>(r.len), r.offset);
      }
      io_uring_sqe_set_data64(sqe, r.user_data);
    }
    SubmitFault fault = TakeSubmitFault();
    // The kernel takes entries in order. A short count (a request it could not start, whose own
    // completion says why) leaves the rest for another call; a refusal (EAGAIN: out of
    // resources, EBUSY: completion queue overflow) says why none of the rest started: those
    // complete with it, through Reap, and are not submitted again.
    size_t started = 0;
    while (started < requests.size()) {
      int rc = fault.armed ? SubmitWithFault(fault) : io_uring_submit(&ring_);
      if (rc == -EINTR) continue;
      if (rc > 0) {
        started += std::min<size_t>(requests.size() - started, static_cast<size_t>(rc));
        continue;
      }
      const int64_t error = rc < 0 ? rc : -EAGAIN;  // none taken, no reason given
      TakeBackUnsubmitted();
      for (size_t i = started; i < requests.size(); ++i) {
        refused_.push_back({requests[i].user_data, error, /*refused=*/true});
      }
      return;
    }
  }

  size_t Reap(std::span<IoCompletion> out, unsigned min_wait) override {
    size_t n = 0;
    while (n < out.size() && !refused_.empty()) {
      out[n++] = refused_.back();
      refused_.pop_back();
    }
    while (n < out.size()) {
      io_uring_cqe* cqe = nullptr;
      int rc = n < min_wait ? io_uring_wait_cqe(&ring_, &cqe) : io_uring_peek_cqe(&ring_, &cqe);
      if (rc == -EAGAIN || (rc == -EINTR && n >= min_wait)) break;
      if (rc == -EINTR) continue;
      if (rc < 0) ThrowSystemError(-rc, "io_uring_wait_cqe");
      out[n++] = {io_uring_cqe_get_data64(cqe), cqe->res};
      io_uring_cqe_seen(&ring_, cqe);
    }
    return n;
  }

 private:
  struct SubmitFault {
    bool armed = false;
    unsigned accepted = 0;
    int error = 0;
  };

  // A test's fault for this submission (test_hooks.hpp), below the seam the fault-injecting
  // backend works at: liburing makes its system calls itself.
  static SubmitFault TakeSubmitFault() noexcept {
    TestHooks* hooks = InstalledTestHooks();
    SubmitFault fault;
    if (hooks != nullptr) fault.armed = hooks->TakeUringSubmitFault(&fault.accepted, &fault.error);
    return fault;
  }

  // io_uring_submit as a kernel that takes `fault.accepted` entries and then refuses the rest
  // with `fault.error` would answer: the entries are handed to the kernel (the tail moves) and
  // io_uring_enter is asked to take only that many, so the rest stay in the ring as a real
  // short or refused submission leaves them.
  int SubmitWithFault(SubmitFault& fault) {
    io_uring_sq& sq = ring_.sq;
    sq.sqe_head = sq.sqe_tail;
    io_uring_smp_store_release(sq.ktail, sq.sqe_tail);
    const unsigned pending = sq.sqe_tail - io_uring_smp_load_acquire(sq.khead);
    const unsigned take = std::min(fault.accepted, pending);
    fault.accepted = 0;
    if (take == 0) {
      fault.armed = false;
      return -fault.error;
    }
    return io_uring_enter(static_cast<unsigned>(ring_.ring_fd), take, 0, 0, nullptr);
  }

  // Entries the kernel was handed but did not take stay in the submission queue, and the next
  // submission would start them (requests already completed with an error, for buffers maybe
  // freed since). The queue's tail goes back to its head, which the kernel moved past what it
  // took: only the submitting thread moves the tail and the kernel reads it only inside
  // io_uring_enter (no SQPOLL thread), so nothing can have read the entries taken back.
  void TakeBackUnsubmitted() noexcept {
    io_uring_sq& sq = ring_.sq;
    const unsigned head = io_uring_smp_load_acquire(sq.khead);
    sq.sqe_head = head;
    sq.sqe_tail = head;
    io_uring_smp_store_release(sq.ktail, head);
  }

  unsigned depth_;
  io_uring ring_{};
  std::vector<IoCompletion> refused_;  // requests the kernel refused, completed for Reap()
};

}  // namespace

bool UringCompiledIn() {
  return true;
}
std::unique_ptr<Backend> MakeUringBackend(unsigned depth) {
  return std::make_unique<UringBackend>(depth);
}
#else
bool UringCompiledIn() {
  return false;
}
std::unique_ptr<Backend> MakeUringBackend(unsigned depth) {
  ThrowSystemError(ENOTSUP, StrCat("io_uring (queue depth ", depth,
                                   "): not built, liburing was not found at build time"));
}
#endif

}  // namespace tensortier
