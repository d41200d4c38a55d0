// A fixed set of threads that start together and stop together: all of them or none (a process
// out of threads gets an error naming what could not start, not std::terminate from a thread
// left unjoined), joined on destruction. Internal: used by the engine's copy threads and the
// threads backend's pool; not installed.
#pragma once

#include <functional>
#include <string_view>
#include <thread>
#include <vector>

namespace tensortier {

// Thread-compatible: made, stopped and destroyed by one thread. Declare it after the members its
// threads use, so that it stops them before those are destroyed.
class ThreadGroup {
 public:
  // Starts `count` threads, each running `body` until it returns. `stop` (called once, by Stop()
  // or the destructor, before the joins) must make every running `body` return soon: set a flag
  // under the lock the bodies wait with, and wake them all.
  // If a thread cannot start (EAGAIN under a pids cgroup or thread limit), stops and joins those
  // started, then throws std::system_error with its errno: "start <count> <what>", so `what`
  // should say which threads these are and which setting asks for them.
  ThreadGroup(unsigned count, std::string_view what, std::function<void()> body,
              std::function<void()> stop);
  ~ThreadGroup() { Stop(); }

  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  // Asks the threads to stop and joins them. Idempotent.
  void Stop();

 private:
  std::function<void()> stop_;
  std::vector<std::thread> threads_;
};

}  // namespace tensortier
