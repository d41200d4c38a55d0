// An eventfd that any thread signals to end a backend's wait for completions: the io_uring and
// libaio backends poll it in their own ring. Internal to src/io.
#pragma once

namespace tensortier {

class WakeEvent {
 public:
  // Throws std::system_error (EMFILE, ENOMEM) when no eventfd can be had.
  WakeEvent();
  ~WakeEvent();
  WakeEvent(const WakeEvent&) = delete;
  WakeEvent& operator=(const WakeEvent&) = delete;

  // Readable (POLLIN) from Signal() until Clear().
  int fd() const noexcept { return fd_; }
  // Any thread.
  void Signal() noexcept;
  // Once its poll has fired, before polling it again: signals after this fire the next poll.
  void Clear() noexcept;

 private:
  int fd_;
};

}  // namespace tensortier
