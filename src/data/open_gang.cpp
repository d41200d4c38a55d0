#include "open_gang.hpp"

#include <system_error>

#include "tensortier/strings.hpp"

namespace tensortier::detail {

OpenGang::OpenGang(unsigned threads) {
  threads_.reserve(threads);
  try {
    for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
  } catch (const std::system_error& e) {
    // A thread the system refused (EAGAIN: a process or memory limit): the destructor does not
    // run for a half-made gang, and a joinable std::thread destroyed would terminate the process.
    const size_t started = threads_.size();
    Stop();
    throw std::system_error(e.code(),
                            StrCat("start file-opening thread ", started + 1, " of ", threads,
                                   " (a limit on threads: pass a smaller open_threads)"));
  }
}

OpenGang::~OpenGang() {
  Stop();
}

void OpenGang::Stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

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
