// io_uring backend (liburing). Built only when liburing is found; otherwise creation reports
// ENOTSUP and `auto` moves on.
#include <cerrno>

#include "tensortier/backend.hpp"
#include "tensortier/error.hpp"
#include "tensortier/strings.hpp"

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
  }
  ~UringBackend() override { io_uring_queue_exit(&ring_); }

  std::string_view name() const noexcept override { return "io_uring"; }
  unsigned depth() const noexcept override { return depth_; }

  void Submit(std::span<const IoRequest> requests) override {
    for (const IoRequest& r : requests) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) ThrowSystemError(EBUSY, "io_uring_get_sqe: the submission queue is full");
      if (r.op == IoOp::kRead) {
        io_uring_prep_read(sqe, r.fd, r.buf, static_cast<unsigned>(r.len), r.offset);
      } else {
        io_uring_prep_write(sqe, r.fd, r.buf, static_cast<unsigned>(r.len), r.offset);
      }
      io_uring_sqe_set_data64(sqe, r.user_data);
    }
    unsigned left = static_cast<unsigned>(requests.size());
    while (left > 0) {
      int rc = io_uring_submit(&ring_);
      if (rc == -EINTR) continue;
      if (rc < 0) ThrowSystemError(-rc, StrCat("io_uring_submit (", left, " requests)"));
      left -= std::min<unsigned>(left, static_cast<unsigned>(rc));
    }
  }

  size_t Reap(std::span<IoCompletion> out, unsigned min_wait) override {
    size_t n = 0;
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
  unsigned depth_;
  io_uring ring_{};
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
