// A fixed gang of threads that runs one indexed job at a time: Run(n, fn) calls fn(0..n-1) spread
// over the gang and the calling thread, and returns when all calls have. Used to open and size a
// batch's files together (an open of cold metadata waits for the disk). Internal to src/data.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>

#include "tensortier/util/thread_group.hpp"

namespace tensortier::detail {

class OpenGang {
 public:
  // Throws std::system_error (EAGAIN naming open_threads) when the threads cannot all start.
  explicit OpenGang(unsigned threads);
  OpenGang(const OpenGang&) = delete;
  OpenGang& operator=(const OpenGang&) = delete;

  // REQUIRES: `fn` does not throw; one Run() at a time.
  void Run(size_t count, const std::function<void(size_t)>& fn);

 private:
  void Loop();
  // Takes indices of the current job until none is left; returns how many it ran.
  size_t Drain(const std::function<void(size_t)>& fn, uint64_t generation);

  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t count_ = 0;
  size_t next_ = 0;
  size_t finished_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  ThreadGroup threads_;  // last: stopped and joined before the members they use go
};

}  // namespace tensortier::detail
