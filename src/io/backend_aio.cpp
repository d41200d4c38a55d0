// Linux native AIO backend (libaio). True async only with O_DIRECT; on buffered descriptors the
// kernel completes requests inside io_submit, which is correct but serial.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "tensortier/io/backend.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

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

  std::string_view name() const noexcept override { return BackendName(BackendKind::kLibaio); }

  // A request io_submit refused with EINVAL, done by pread/pwrite: the file takes plain reads
  // and writes only (as io_uring does for it, falling back to its read and write handlers).
  // Arguments that are invalid in themselves fail there the same way. A byte count or -errno.
  static int64_t Synchronously(const iocb& cb) {
    const auto& c = cb.u.c;
    ssize_t n;
    do {
      n = cb.aio_lio_opcode == IO_CMD_PREAD
              ? pread(cb.aio_fildes, c.buf, c.nbytes, static_cast<off_t>(c.offset))
              : pwrite(cb.aio_fildes, c.buf, c.nbytes, static_cast<off_t>(c.offset));
    } while (n < 0 && errno == EINTR);
    return n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
  }
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
    // io_submit starts the batch up to the first request it refuses, and says why only for that
    // one (a file whose driver has no asynchronous read or write, such as /proc/self/cmdline:
    // EINVAL; a bad descriptor). Thrown, the error would fail requests already started, whose
    // completions then come for nothing. Refused requests complete here instead, and the rest
    // of the batch is submitted.
    size_t done = 0;
    while (done < batch.size()) {
      int rc = io_submit(ctx_, static_cast<long>(batch.size() - done), batch.data() + done);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        iocb* refused = batch[done++];
        if (rc == -EINVAL) {
          refused_.push_back({reinterpret_cast<uint64_t>(refused->data), Synchronously(*refused)});
        } else {
          refused_.push_back({reinterpret_cast<uint64_t>(refused->data), rc, /*refused=*/true});
        }
        free_.push_back(refused);
        continue;
      }
      done += static_cast<size_t>(rc);
    }
  }

  size_t Reap(std::span<IoCompletion> out, unsigned min_wait) override {
    size_t n = 0;
    while (n < out.size() && !refused_.empty()) {
      out[n++] = refused_.back();
      refused_.pop_back();
    }
    if (n == out.size()) return n;
    // Only what the kernel holds may be waited for.
    const long still = n >= min_wait ? 0 : static_cast<long>(min_wait - n);
    const long max = static_cast<long>(std::min<size_t>(out.size() - n, events_.size()));
    int rc;
    do {
      rc = io_getevents(ctx_, still, max, events_.data(), nullptr);
    } while (rc == -EINTR);
    if (rc < 0) {
      // The refused requests' completions are handed back with the next call.
      for (size_t i = n; i > 0; --i) refused_.push_back(out[i - 1]);
      ThrowSystemError(-rc, "libaio io_getevents");
    }
    for (int i = 0; i < rc; ++i) {
      const io_event& ev = events_[i];
      // res is the byte count or -errno, carried in an unsigned long.
      out[n++] = {reinterpret_cast<uint64_t>(ev.data),
                  static_cast<int64_t>(static_cast<long>(ev.res))};
      free_.push_back(ev.obj);
    }
    return n;
  }

 private:
  unsigned depth_;
  io_context_t ctx_ = nullptr;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> free_;
  std::vector<io_event> events_;
  std::vector<IoCompletion> refused_;  // requests io_submit refused, completed for Reap()
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
