// Abstract-namespace Unix sockets (no file is ever created: the name lives in the kernel and goes
// with the last descriptor), same-user checks and descriptor passing (SCM_RIGHTS). Internal to
// src/shared.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>
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

// `op` with, for EMFILE/ENFILE, which limit on open descriptors was reached and how to raise it
// (ulimit -n, or the system's fs.file-max): the text an IoError of `err` starts with.
std::string WithDescriptorLimit(std::string_view op, int err);

// A descriptor kept in reserve by a server, so that when its process is out of descriptors
// (EMFILE/ENFILE) it can still take a pending connection long enough to say so, instead of
// leaving it queued (the peer would wait out its timeout) while poll reports it ready (a busy
// loop). Empty when /dev/null could not be opened, or while lent out.
class SpareFd {
 public:
  SpareFd() { Refill(); }
  // Opens /dev/null again if the spare is lent out (no-op when held; stays empty if it fails).
  void Refill();
  // Gives the descriptor back to the kernel so that the next open/accept may take its number.
  // Whether there was one to give.
  bool Release();

 private:
  UniqueFd fd_;
};

// A connection accepted from `listener`, and 0; or the errno of the refusal with no connection;
// or, when the process was out of descriptors and the spare let one be taken, the connection and
// EMFILE/ENFILE: the caller answers that it cannot serve, closes it, and refills the spare.
struct Accepted {
  UniqueFd connection;
  int error = 0;
};
Accepted AcceptWithSpare(int listener, SpareFd& spare);

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
