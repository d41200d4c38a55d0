#include "tensortier/shared/unix_socket.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <thread>

#include "tensortier/shared/shared_spec.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier::shared {
namespace {

socklen_t AbstractAddress(const std::string& name, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(addr->sun_path)) ThrowIoError(ENAMETOOLONG, "socket name", name);
  // Abstract namespace: a leading NUL, and the length says where the name ends.
  std::memcpy(addr->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

int RemainingMs(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return left.count() > INT32_MAX ? INT32_MAX : static_cast<int>(left.count());
}

// Waits until `fd` is ready for `events` or `deadline` passes (then IoError ETIMEDOUT).
void WaitReady(int fd, short events, Clock::time_point deadline, const std::string& what) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, RemainingMs(deadline));
    if (rc > 0) return;
    if (rc == 0) ThrowIoError(ETIMEDOUT, "wait for", what);
    if (errno != EINTR) ThrowIoError(errno, "poll", what);
  }
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

Clock::time_point DeadlineAfter(std::chrono::milliseconds timeout) {
  auto now = Clock::now();
  if (timeout >= kLongestWait) return Clock::time_point::max();
  return now + timeout;
}

std::string WithDescriptorLimit(std::string_view op, int err) {
  if (err == ENFILE) {
    return StrCat(op, " [the system has reached its limit on open files: raise fs.file-max]");
  }
  if (err != EMFILE) return std::string(op);
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return StrCat(op, " [this process has reached its limit on open descriptors: raise ulimit -n]");
  }
  return StrCat(op, " [this process has reached its limit of ", limit.rlim_cur,
                " open descriptors: raise ulimit -n]");
}

void SpareFd::Refill() {
  if (!fd_) fd_ = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
}

bool SpareFd::Release() {
  if (!fd_) return false;
  fd_ = UniqueFd();
  return true;
}

Accepted AcceptWithSpare(int listener, SpareFd& spare) {
  Accepted a;
  a.connection = UniqueFd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
  if (a.connection) return a;
  a.error = errno;
  if ((a.error == EMFILE || a.error == ENFILE) && spare.Release()) {
    // Another thread may take the freed number first: then nothing is accepted this time.
    a.connection = UniqueFd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
    if (!a.connection) spare.Refill();
  }
  return a;
}

UniqueFd ListenAbstract(const std::string& name) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) {
    const int err = errno;
    ThrowIoError(err, WithDescriptorLimit("socket", err), name);
  }
  sockaddr_un addr;
  socklen_t len = AbstractAddress(name, &addr);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    ThrowIoError(errno, "bind abstract socket", name);
  }
  if (::listen(fd.get(), 128) != 0) ThrowIoError(errno, "listen", name);
  return fd;
}

UniqueFd ConnectAbstract(const std::string& name, Clock::time_point deadline, bool retry) {
  sockaddr_un addr;
  socklen_t len = AbstractAddress(name, &addr);
  for (;;) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) {
      const int err = errno;
      ThrowIoError(err, WithDescriptorLimit("socket", err), name);
    }
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) == 0) return fd;
    int err = errno;
    if (err == EINTR) continue;
    bool absent = err == ECONNREFUSED || err == ENOENT;
    if (!retry || !absent || Clock::now() >= deadline) ThrowIoError(err, "connect", name);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool PeerIsSameUser(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
  return cred.uid == ::geteuid();
}

void RequireSameUser(int fd, const std::string& what) {
  if (!PeerIsSameUser(fd)) ThrowIoError(EACCES, "peer of another user (SO_PEERCRED)", what);
}

void SendAll(int fd, const void* data, size_t length, Clock::time_point deadline,
             const std::string& what) {
  const auto* p = static_cast<const char*>(data);
  while (length > 0) {
    ssize_t n = ::send(fd, p, length, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      length -= static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      WaitReady(fd, POLLOUT, deadline, what);
    } else if (n < 0 && errno != EINTR) {
      ThrowIoError(errno == EPIPE ? ECONNRESET : errno, "send to", what);
    }
  }
}

void RecvAll(int fd, void* data, size_t length, Clock::time_point deadline,
             const std::string& what) {
  auto* p = static_cast<char*>(data);
  while (length > 0) {
    ssize_t n = ::recv(fd, p, length, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      length -= static_cast<size_t>(n);
    } else if (n == 0) {
      ThrowIoError(ECONNRESET, "receive from (peer closed)", what);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      WaitReady(fd, POLLIN, deadline, what);
    } else if (errno != EINTR) {
      ThrowIoError(errno, "receive from", what);
    }
  }
}

void SendStatusAndFd(int fd, char status, int fd_to_pass, Clock::time_point deadline,
                     const std::string& what) {
  msghdr msg{};
  iovec iov{&status, 1};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd_to_pass >= 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd_to_pass, sizeof(int));
  }
  for (;;) {
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n == 1) return;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      WaitReady(fd, POLLOUT, deadline, what);
    } else if (n < 0 && errno != EINTR) {
      ThrowIoError(errno == EPIPE ? ECONNRESET : errno, "sendmsg to", what);
    }
  }
}

std::pair<char, UniqueFd> RecvStatusAndFd(int fd, Clock::time_point deadline,
                                          const std::string& what) {
  char status = 0;
  msghdr msg{};
  iovec iov{&status, 1};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  for (;;) {
    ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n == 1) break;
    if (n == 0) ThrowIoError(ECONNRESET, "receive descriptor from (peer closed)", what);
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      WaitReady(fd, POLLIN, deadline, what);
    } else if (errno != EINTR) {
      ThrowIoError(errno, "recvmsg from", what);
    }
  }
  UniqueFd received;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int passed;
      std::memcpy(&passed, CMSG_DATA(c), sizeof(int));
      received = UniqueFd(passed);
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) {
    // The control buffer holds one descriptor: a passed one is dropped only when this process
    // has no number free for it (the kernel says no more).
    ThrowIoError(EMFILE, WithDescriptorLimit("receive descriptor (dropped by the kernel)", EMFILE),
                 what);
  }
  return {status, std::move(received)};
}

void SendString(int fd, const std::string& s, Clock::time_point deadline, const std::string& what) {
  uint32_t len = static_cast<uint32_t>(s.size());
  SendAll(fd, &len, sizeof(len), deadline, what);
  SendAll(fd, s.data(), s.size(), deadline, what);
}

std::string RecvString(int fd, Clock::time_point deadline, const std::string& what,
                       size_t max_length) {
  uint32_t len = 0;
  RecvAll(fd, &len, sizeof(len), deadline, what);
  if (len > max_length) ThrowIoError(EMSGSIZE, "receive (message too long)", what, 0, len);
  std::string s(len, '\0');
  RecvAll(fd, s.data(), len, deadline, what);
  return s;
}

}  // namespace tensortier::shared
