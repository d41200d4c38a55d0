#include "tensortier/data/open_gang.hpp"

namespace tensortier::detail {

OpenGang::OpenGang(unsigned threads)
    : threads_(
          threads, "file-opening threads (a limit on threads: pass a smaller open_threads)",
          [this] { Loop(); },
          [this] {
            {
              std::lock_guard<std::mutex> lock(mu_);
              stop_ = true;
            }
            cv_.notify_all();
          }) {}

size_t OpenGang::Drain(const std::function<void(size_t)>& fn, uint64_t generation) {
  size_t ran = 0;
  std::unique_lock<std::mutex> lock(mu_);
  // A late thread may find the next job already started: it takes nothing of it with `fn`.
  while (generation_ == generation && next_ < count_) {
    const size_t index = next_++;
    lock.unlock();
    fn(index);
    ++ran;
    lock.lock();
  }
  return ran;
}

void OpenGang::Run(size_t count, const std::function<void(size_t)>& fn) {
  if (count == 0) return;
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    count_ = count;
    next_ = 0;
    finished_ = 0;
    generation = ++generation_;
  }
  cv_.notify_all();
  const size_t ran = Drain(fn, generation);
  std::unique_lock<std::mutex> lock(mu_);
  finished_ += ran;
  cv_.wait(lock, [&] { return finished_ == count_; });
  job_ = nullptr;
}

void OpenGang::Loop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || (generation_ != seen && job_ != nullptr); });
    if (stop_) return;
    seen = generation_;
    const std::function<void(size_t)>* job = job_;
    lock.unlock();
    const size_t ran = Drain(*job, seen);
    lock.lock();
    finished_ += ran;
    if (finished_ == count_) cv_.notify_all();
  }
}

}  // namespace tensortier::detail
