// Abstract-namespace Unix sockets (no file is ever created: the name lives in the kernel and goes
// with the last descriptor), same-user checks and descriptor passing (SCM_RIGHTS). Internal to
// src/shared.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>

namespace tensortier::shared {

using Clock = std::chrono::steady_clock;

// An owned file descriptor, closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  ~UniqueFd();
  int get() const noexcept { return fd_; }
  int release() noexcept { return std::exchange(fd_, -1); }
  explicit operator bool() const noexcept { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// A listening socket at abstract name `name` (without the leading NUL). Throws IoError
// (EADDRINUSE when another process serves that name).
UniqueFd ListenAbstract(const std::string& name);
// A socket connected to `name`, retrying ECONNREFUSED/ENOENT until `deadline` when `retry`.
// Throws IoError naming `name`.
UniqueFd ConnectAbstract(const std::string& name, Clock::time_point deadline, bool retry);

// Throws IoError (EACCES) unless the process at the other end of `fd` runs as this process's
// effective user. `what` names the peer for the message.
void RequireSameUser(int fd, const std::string& what);
// Whether the peer of `fd` runs as this process's effective user.
bool PeerIsSameUser(int fd);

// Sends or receives exactly `length` bytes before `deadline`. Throws IoError (ETIMEDOUT, or
// ECONNRESET when the peer closed, naming `what`).
void SendAll(int fd, const void* data, size_t length, Clock::time_point deadline,
             const std::string& what);
void RecvAll(int fd, void* data, size_t length, Clock::time_point deadline,
             const std::string& what);

// One byte of `status` plus, when `fd_to_pass` >= 0, a descriptor (SCM_RIGHTS).
void SendStatusAndFd(int fd, char status, int fd_to_pass, Clock::time_point deadline,
                     const std::string& what);
// Receives what SendStatusAndFd sent: the status byte and the descriptor (empty when none).
std::pair<char, UniqueFd> RecvStatusAndFd(int fd, Clock::time_point deadline,
                                          const std::string& what);

// Length-prefixed strings (u32 little-endian length, then the bytes).
void SendString(int fd, const std::string& s, Clock::time_point deadline, const std::string& what);
std::string RecvString(int fd, Clock::time_point deadline, const std::string& what,
                       size_t max_length = 1 << 24);

// Deadline `timeout` from now, saturating.
Clock::time_point DeadlineAfter(std::chrono::milliseconds timeout);

}  // namespace tensortier::shared
