#include "tensortier/shared/partition_server.hpp"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <exception>
#include <stdexcept>

#include "tensortier/shared/shared_spec.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier::shared {
namespace {

constexpr char kServed = 'k';
constexpr char kUnknown = 'n';
constexpr char kEmpty = 'z';
// The server's process had no descriptor free to take the connection (EMFILE, ENFILE); a string
// follows saying which limit.
constexpr char kOutOfDescriptors = 'm';
constexpr char kOutOfSystemFiles = 'f';

}  // namespace

std::string PartitionSocketName(const std::string& token, int rank) {
  return StrCat("tensortier.", token, ".", rank);
}

PartitionServer::PartitionServer(std::string socket_name)
    : name_(std::move(socket_name)), maker_() {
  listener_ = ListenAbstract(name_);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) ThrowIoError(errno, "pipe2", name_);
  wake_read_ = UniqueFd(fds[0]);
  wake_write_ = UniqueFd(fds[1]);
  thread_ = std::thread([this] { Run(); });
}

PartitionServer::~PartitionServer() {
  if (maker_.Forked()) {
    // The wake pipe is the parent's too: a byte written there would stop the parent's server.
    // The thread is the parent's: it can be neither joined nor detached here (pthread_detach
    // fails with EINVAL, and std::thread's throw would end the process), so its handle is left.
    new std::thread(std::move(thread_));
    for (auto& [key, fd] : served_) {
      if (fd >= 0) ::close(fd);
    }
    return;
  }
  char b = 0;
  while (::write(wake_write_.get(), &b, 1) < 0 && errno == EINTR) {
  }
  thread_.join();
  for (auto& [key, fd] : served_) {
    if (fd >= 0) ::close(fd);
  }
}

void PartitionServer::Serve(const std::string& key, UniqueFd fd) {
  std::lock_guard lock(mutex_);
  auto [it, inserted] = served_.emplace(key, fd.get());
  if (!inserted) throw std::invalid_argument(StrCat("a shared tensor named '", key, "' exists"));
  fd.release();
}

void PartitionServer::Unserve(const std::string& key) {
  // A child made by fork(): the server's thread is the parent's, and may have held the lock at
  // the fork (taking it would never end). What the child holds is closed with the server.
  if (maker_.Forked()) return;
  std::lock_guard lock(mutex_);
  auto it = served_.find(key);
  if (it == served_.end()) return;
  if (it->second >= 0) ::close(it->second);
  served_.erase(it);
}

void PartitionServer::Run() {
  bool pause = false;
  for (;;) {
    pollfd p[2] = {{wake_read_.get(), POLLIN, 0}, {listener_.get(), POLLIN, 0}};
    // After a connection that could not be taken at all (out of descriptors, the spare
    // gone), the listener, still ready, is left alone a moment: polling it would spin.
    if (::poll(p, pause ? 1 : 2, pause ? 50 : -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    pause = false;
    if (p[0].revents) return;
    if (p[1].revents == 0) continue;
    spare_.Refill();  // lost to another thread the last time descriptors ran out
    Accepted accepted = AcceptWithSpare(listener_.get(), spare_);
    UniqueFd c = std::move(accepted.connection);
    if (!c) {
      pause = accepted.error == EMFILE || accepted.error == ENFILE;
      continue;
    }
    if (!PeerIsSameUser(c.get())) {
      refused_.fetch_add(1);
      c = UniqueFd();
      spare_.Refill();
      continue;  // closed unanswered
    }
    if (accepted.error != 0) {
      // Taken with the spare descriptor: the peer learns at once why it cannot be served
      // (it would pass a descriptor it could not receive anyway) instead of waiting out its
      // timeout.
      try {
        auto deadline = DeadlineAfter(std::chrono::seconds(5));
        // The request is read first: closing a socket with unread data resets the peer's
        // end before it reads the answer.
        RecvString(c.get(), deadline, name_, kMaxSharedNameBytes);
        SendStatusAndFd(c.get(), accepted.error == ENFILE ? kOutOfSystemFiles : kOutOfDescriptors,
                        -1, deadline, name_);
        SendString(c.get(), WithDescriptorLimit("accept", accepted.error), deadline, name_);
      } catch (const std::exception&) {
      }
      c = UniqueFd();
      spare_.Refill();
      continue;
    }
    try {
      auto deadline = DeadlineAfter(std::chrono::seconds(5));
      std::string key = RecvString(c.get(), deadline, name_, kMaxSharedNameBytes);
      std::lock_guard lock(mutex_);
      auto it = served_.find(key);
      char status = it == served_.end() ? kUnknown : it->second < 0 ? kEmpty : kServed;
      SendStatusAndFd(c.get(), status, status == kServed ? it->second : -1, deadline, name_);
    } catch (const std::exception&) {
      // A peer that vanished mid-request: it sees its own error; keep serving the others.
    }
  }
}

UniqueFd FetchDescriptor(const std::string& peer, const std::string& key,
                         Clock::time_point deadline, const std::string& what) {
  UniqueFd c;
  try {
    c = ConnectAbstract(peer, deadline, false);
  } catch (const IoError& e) {
    if (e.error_code() != ECONNREFUSED && e.error_code() != ENOENT) throw;
    // Nothing listens under the rank's name: its process is gone.
    ThrowIoError(
        e.error_code(),
        StrCat("connect to ", what, ", which is gone (its process exited or closed its group),"),
        peer);
  }
  RequireSameUser(c.get(), what);
  SendString(c.get(), key, deadline, what);
  auto [status, fd] = RecvStatusAndFd(c.get(), deadline, what);
  if (status == kOutOfDescriptors || status == kOutOfSystemFiles) {
    const std::string why = RecvString(c.get(), deadline, what, 4096);
    ThrowIoError(
        status == kOutOfSystemFiles ? ENFILE : EMFILE,
        StrCat("fetch partition from ", what, ", which is out of descriptors (its ", why, ")"),
        key);
  }
  if (status != kServed || !fd) {
    ThrowIoError(ENOENT, StrCat("fetch partition from ", what, " (it closed the tensor)"), key);
  }
  return std::move(fd);
}

}  // namespace tensortier::shared
