#include "wake_event.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#include "tensortier/error.hpp"

namespace tensortier {

WakeEvent::WakeEvent() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (fd_ < 0) ThrowSystemError(errno, "eventfd (to wake a backend waiting for completions)");
}

WakeEvent::~WakeEvent() {
  close(fd_);
}

void WakeEvent::Signal() noexcept {
  const uint64_t one = 1;
  // Fails only with EAGAIN when the counter is full, which leaves it readable all the same.
  [[maybe_unused]] ssize_t rc = write(fd_, &one, sizeof(one));
}

void WakeEvent::Clear() noexcept {
  uint64_t count;
  // EAGAIN when already clear.
  [[maybe_unused]] ssize_t rc = read(fd_, &count, sizeof(count));
}

}  // namespace tensortier
