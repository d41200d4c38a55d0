// Linux native AIO backend (libaio). True async only with O_DIRECT; on buffered descriptors the
// kernel completes requests inside io_submit, which is correct but serial.
#include <cerrno>
#include <vector>

#include "tensortier/backend.hpp"
#include "tensortier/error.hpp"
#include "tensortier/strings.hpp"

#ifdef TENSORTIER_HAVE_LIBAIO
#include <libaio.h>
#endif

namespace tensortier {

#ifdef TENSORTIER_HAVE_LIBAIO
namespace {

class AioBackend final : public Backend {
 public:
  explicit AioBackend(unsigned depth) : depth_(depth), iocbs_(depth), events_(depth) {
    int rc = io_setup(static_cast<int>(depth), &ctx_);
    if (rc < 0) ThrowSystemError(-rc, StrCat("libaio io_setup (queue depth ", depth, ")"));
    free_.reserve(depth);
    for (auto& cb : iocbs_) free_.push_back(&cb);
  }
  ~AioBackend() override { io_destroy(ctx_); }

  std::string_view name() const noexcept override { return "libaio"; }
  unsigned depth() const noexcept override { return depth_; }

  void Submit(std::span<const IoRequest> requests) override {
    std::vector<iocb*> batch;
    batch.reserve(requests.size());
    for (const IoRequest& r : requests) {
      if (free_.empty()) ThrowSystemError(EBUSY, "libaio io_submit: no free iocb");
      iocb* cb = free_.back();
      free_.pop_back();
      if (r.op == IoOp::kRead) {
        io_prep_pread(cb, r.fd, r.buf, r.len, static_cast<long long>(r.offset));
      } else {
        io_prep_pwrite(cb, r.fd, r.buf, r.len, static_cast<long long>(r.offset));
      }
      cb->data = reinterpret_cast<void*>(r.user_data);
      batch.push_back(cb);
    }
    size_t done = 0;
    while (done < batch.size()) {
      int rc = io_submit(ctx_, static_cast<long>(batch.size() - done), batch.data() + done);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        // The rest was not started: give its control blocks back before reporting.
        for (size_t i = done; i < batch.size(); ++i) free_.push_back(batch[i]);
        ThrowSystemError(-rc, StrCat("libaio io_submit (", batch.size() - done, " requests)"));
      }
      done += static_cast<size_t>(rc);
    }
  }

  size_t Reap(std::span<IoCompletion> out, unsigned min_wait) override {
    long max = static_cast<long>(std::min<size_t>(out.size(), events_.size()));
    int rc;
    do {
      rc = io_getevents(ctx_, min_wait, max, events_.data(), nullptr);
    } while (rc == -EINTR);
    if (rc < 0) ThrowSystemError(-rc, "libaio io_getevents");
    for (int i = 0; i < rc; ++i) {
      const io_event& ev = events_[i];
      // res is the byte count or -errno, carried in an unsigned long.
      out[i] = {reinterpret_cast<uint64_t>(ev.data),
                static_cast<int64_t>(static_cast<long>(ev.res))};
      free_.push_back(ev.obj);
    }
    return static_cast<size_t>(rc);
  }

 private:
  unsigned depth_;
  io_context_t ctx_ = nullptr;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> free_;
  std::vector<io_event> events_;
};

}  // namespace

bool AioCompiledIn() {
  return true;
}
std::unique_ptr<Backend> MakeAioBackend(unsigned depth) {
  return std::make_unique<AioBackend>(depth);
}
#else
bool AioCompiledIn() {
  return false;
}
std::unique_ptr<Backend> MakeAioBackend(unsigned depth) {
  ThrowSystemError(ENOTSUP, StrCat("libaio (queue depth ", depth,
                                   "): not built, libaio was not found at build time"));
}
#endif

}  // namespace tensortier
