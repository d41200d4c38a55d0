// Linux native AIO backend (libaio). True async only with O_DIRECT; on buffered descriptors the
// kernel completes requests inside io_submit, which is correct but serial.
#include <cerrno>
#include <vector>

#include "tensortier/backend.hpp"
#include "tensortier/error.hpp"
#include "tensortier/strings.hpp"

#ifdef TENSORTIER_HAVE_LIBAIO
#include <libaio.h>
#include <poll.h>

#include <atomic>
#include <ctime>

#include "wake_event.hpp"
#endif

namespace tensortier {

#ifdef TENSORTIER_HAVE_LIBAIO
namespace {

class AioBackend final : public Backend {
 public:
  // One more event than `depth`: the poll of the wake event.
  explicit AioBackend(unsigned depth) : depth_(depth), iocbs_(depth), events_(depth + 1) {
    int rc = io_setup(static_cast<int>(depth + 1), &ctx_);
    if (rc < 0) ThrowSystemError(-rc, StrCat("libaio io_setup (queue depth ", depth, ")"));
    free_.reserve(depth);
    for (auto& cb : iocbs_) free_.push_back(&cb);
    rc = PollWake();
    if (rc == -EINVAL) {
      polls_ = false;  // a kernel before 4.18: waits are bounded instead
    } else if (rc < 0) {
      io_destroy(ctx_);
      ThrowSystemError(-rc, "libaio io_submit (poll of the wake event)");
    }
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
    size_t n = 0;
    bool woken = false;
    int rc;
    while (n < out.size()) {
      const bool wait = n < min_wait && !woken;
      if (wait && polls_ && !wake_polled_) {
        rc = PollWake();
        if (rc < 0) ThrowSystemError(-rc, "libaio io_submit (poll of the wake event)");
      }
      // Without IOCB_CMD_POLL a wait looks for a Wake() every millisecond.
      timespec zero{}, bounded{0, 1'000'000};
      const long max = static_cast<long>(std::min(out.size() - n, events_.size()));
      rc = io_getevents(ctx_, wait ? 1 : 0, max, events_.data(),
                        !wait    ? &zero
                        : polls_ ? nullptr
                                 : &bounded);
      if (rc == -EINTR) continue;
      if (rc < 0) ThrowSystemError(-rc, "libaio io_getevents");
      for (int i = 0; i < rc; ++i) {
        const io_event& ev = events_[i];
        if (ev.obj == &wake_iocb_) {
          wake_.Clear();  // before the next poll, which then fires for any later Wake()
          wake_polled_ = false;
          woken = true;
          continue;
        }
        // res is the byte count or -errno, carried in an unsigned long.
        out[n++] = {reinterpret_cast<uint64_t>(ev.data),
                    static_cast<int64_t>(static_cast<long>(ev.res))};
        free_.push_back(ev.obj);
      }
      if (!polls_ && wake_pending_.exchange(false)) woken = true;
      if (!wait || n >= min_wait || woken) break;
    }
    return n;
  }

  void Wake() noexcept override {
    if (polls_) {
      wake_.Signal();
    } else {
      wake_pending_.store(true);
    }
  }

 private:
  // Polls the wake event in this context (IOCB_CMD_POLL, one shot: polled again before the next
  // wait after it fires). Returns 0 or -errno (EINVAL: a kernel without IOCB_CMD_POLL).
  int PollWake() {
    io_prep_poll(&wake_iocb_, wake_.fd(), POLLIN);
    iocb* cb = &wake_iocb_;
    int rc;
    do {
      rc = io_submit(ctx_, 1, &cb);
    } while (rc == -EINTR);
    if (rc < 0) return rc;
    wake_polled_ = true;
    return 0;
  }

  unsigned depth_;
  io_context_t ctx_ = nullptr;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> free_;
  std::vector<io_event> events_;
  WakeEvent wake_;
  iocb wake_iocb_{};
  bool polls_ = true;         // the kernel takes IOCB_CMD_POLL (set by the constructor)
  bool wake_polled_ = false;  // a poll of wake_ is in the context
  std::atomic<bool> wake_pending_{false};  // without polls_: a Wake() not yet seen by Reap()
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
