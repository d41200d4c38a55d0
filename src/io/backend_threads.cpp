// pread/pwrite on a small pool of threads: works everywhere (any filesystem, seccomp that blocks
// io_uring, no libaio), at the cost of a thread per request in flight.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "tensortier/io/backend.hpp"
#include "tensortier/util/thread_group.hpp"

namespace tensortier {
namespace {

constexpr unsigned kMaxThreads = 32;

class ThreadPoolBackend final : public Backend {
 public:
  explicit ThreadPoolBackend(unsigned depth)
      : depth_(depth),
        threads_(
            std::min(depth, kMaxThreads),
            "I/O threads of the threads backend (one per queue entry, at most 32: "
            "TENSORTIER_QUEUE_DEPTH)",
            [this] { Serve(); }, [this] { Stop(); }) {}

  std::string_view name() const noexcept override { return BackendName(BackendKind::kThreads); }
  unsigned depth() const noexcept override { return depth_; }

  void Submit(std::span<const IoRequest> requests) override {
    {
      std::lock_guard lock(mu_);
      queue_.insert(queue_.end(), requests.begin(), requests.end());
    }
    if (requests.size() == 1) {
      work_cv_.notify_one();
    } else {
      work_cv_.notify_all();
    }
  }

  size_t Reap(std::span<IoCompletion> out, unsigned min_wait) override {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return done_.size() >= min_wait; });
    size_t n = std::min(out.size(), done_.size());
    std::copy_n(done_.begin(), n, out.begin());
    done_.erase(done_.begin(), done_.begin() + static_cast<ptrdiff_t>(n));
    return n;
  }

 private:
  void Stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    work_cv_.notify_all();
  }

  static int64_t Run(const IoRequest& r) {
    ssize_t rc;
    do {
      rc = r.op == IoOp::kRead ? pread(r.fd, r.buf, r.len, static_cast<off_t>(r.offset))
                               : pwrite(r.fd, r.buf, r.len, static_cast<off_t>(r.offset));
    } while (rc < 0 && errno == EINTR);
    return rc < 0 ? -errno : rc;
  }

  void Serve() {
    std::unique_lock lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping with nothing left
      IoRequest r = queue_.front();
      queue_.pop_front();
      lock.unlock();
      int64_t result = Run(r);
      lock.lock();
      done_.push_back({r.user_data, result});
      done_cv_.notify_one();
    }
  }

  unsigned depth_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<IoRequest> queue_;
  std::deque<IoCompletion> done_;
  bool stopping_ = false;
  ThreadGroup threads_;  // last: stopped and joined before the members they use go
};

}  // namespace

std::unique_ptr<Backend> MakeThreadPoolBackend(unsigned depth) {
  return std::make_unique<ThreadPoolBackend>(depth);
}

}  // namespace tensortier
