// The built-in store: a poll loop in rank 0 answering Set/Get/Add over an abstract-namespace
// Unix socket. Gets for missing keys wait in the server until the key is set (or the client gives
// up and disconnects), so no client polls.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "tensortier/shared/shared_store.hpp"
#include "tensortier/shared/unix_socket.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr char kSet = 'S';
constexpr char kGet = 'G';
constexpr char kAdd = 'A';
constexpr char kDelete = 'D';
// A client's request arrives whole within this time once its first byte has.
constexpr std::chrono::seconds kRequestTime{5};

}  // namespace

struct UnixSocketStore::Server {
  shared::UniqueFd listener;
  shared::UniqueFd wake_read, wake_write;
  // Opened here, before the thread: the store's descriptors are all open once it is made.
  shared::SpareFd spare;
  std::thread thread;
  std::string name;

  explicit Server(const std::string& socket_name) : name(socket_name) {
    listener = shared::ListenAbstract(name);
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) ThrowIoError(errno, "pipe2", name);
    wake_read = shared::UniqueFd(fds[0]);
    wake_write = shared::UniqueFd(fds[1]);
    thread = std::thread([this] { Run(); });
  }

  ~Server() {
    char b = 0;
    while (::write(wake_write.get(), &b, 1) < 0 && errno == EINTR) {
    }
    thread.join();
  }

  void Run() {
    std::map<std::string, std::string> values;
    std::map<std::string, std::vector<int>> waiters;  // key -> clients waiting in Get
    std::vector<shared::UniqueFd> clients;
    // Until then the listener is left alone: a connection this process has no descriptor for
    // keeps it ready, and polling it would spin.
    auto listen_again = shared::Clock::now();
    for (;;) {
      const bool listening = shared::Clock::now() >= listen_again;
      std::vector<pollfd> polls{{wake_read.get(), POLLIN, 0},
                                {listening ? listener.get() : -1, POLLIN, 0}};
      for (const auto& c : clients) polls.push_back({c.get(), POLLIN, 0});
      if (::poll(polls.data(), polls.size(), listening ? -1 : 50) < 0) {
        if (errno == EINTR) continue;
        return;  // nothing sensible left to do: clients see the connection close
      }
      if (polls[0].revents) return;
      if (polls[1].revents & POLLIN) {
        spare.Refill();  // lost to another thread the last time descriptors ran out
        shared::Accepted a = shared::AcceptWithSpare(listener.get(), spare);
        if (a.connection && a.error == 0 && shared::PeerIsSameUser(a.connection.get())) {
          clients.push_back(std::move(a.connection));
        } else if (a.connection) {
          // Another user's process, or one taken with the spare descriptor (this process has
          // none to keep it): a closed connection, at once, and nothing else.
          a.connection = shared::UniqueFd();
          spare.Refill();
        } else if (a.error == EMFILE || a.error == ENFILE) {
          listen_again = shared::Clock::now() + std::chrono::milliseconds(50);
        }
      }
      std::vector<int> dead;
      for (size_t i = 2; i < polls.size(); ++i) {
        if (polls[i].revents == 0) continue;
        int fd = polls[i].fd;
        try {
          Serve(fd, values, waiters);
        } catch (const std::exception&) {
          dead.push_back(fd);
        }
      }
      for (int fd : dead) {
        for (auto& [key, list] : waiters) std::erase(list, fd);
        std::erase_if(clients, [fd](const shared::UniqueFd& c) { return c.get() == fd; });
      }
    }
  }

  void Serve(int fd, std::map<std::string, std::string>& values,
             std::map<std::string, std::vector<int>>& waiters) {
    auto deadline = shared::DeadlineAfter(kRequestTime);
    char op = 0;
    shared::RecvAll(fd, &op, 1, deadline, name);
    std::string key = shared::RecvString(fd, deadline, name);
    if (op == kSet) {
      std::string value = shared::RecvString(fd, deadline, name);
      Put(key, std::move(value), values, waiters);
      char ok = 'k';
      shared::SendAll(fd, &ok, 1, deadline, name);
    } else if (op == kGet) {
      auto it = values.find(key);
      if (it != values.end()) {
        shared::SendString(fd, it->second, deadline, name);
      } else {
        waiters[key].push_back(fd);
      }
    } else if (op == kAdd) {
      int64_t delta = 0;
      shared::RecvAll(fd, &delta, sizeof(delta), deadline, name);
      int64_t now = 0;
      auto it = values.find(key);
      if (it != values.end()) now = std::stoll(it->second);
      now += delta;
      Put(key, std::to_string(now), values, waiters);
      shared::SendAll(fd, &now, sizeof(now), deadline, name);
    } else if (op == kDelete) {
      values.erase(key);
      char ok = 'k';
      shared::SendAll(fd, &ok, 1, deadline, name);
    } else {
      ThrowIoError(EPROTO, "store request", name);
    }
  }

  void Put(const std::string& key, std::string value, std::map<std::string, std::string>& values,
           std::map<std::string, std::vector<int>>& waiters) {
    values[key] = std::move(value);
    auto w = waiters.find(key);
    if (w == waiters.end()) return;
    std::vector<int> list = std::move(w->second);
    waiters.erase(w);
    for (int fd : list) {
      try {
        shared::SendString(fd, values[key], shared::DeadlineAfter(kRequestTime), name);
      } catch (const std::exception&) {
        // The waiter went away; its next poll sees the hang-up and drops it.
      }
    }
  }
};

UnixSocketStore::UnixSocketStore(const std::string& job, bool serve,
                                 std::chrono::milliseconds timeout)
    : name_(StrCat("tensortier.store.", job)) {
  if (serve) server_ = std::make_unique<Server>(name_);
  shared::UniqueFd fd = shared::ConnectAbstract(name_, shared::DeadlineAfter(timeout), true);
  shared::RequireSameUser(fd.get(), name_);
  fd_ = fd.release();
}

UnixSocketStore::~UnixSocketStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

const std::string& UnixSocketStore::socket_name() const noexcept {
  return name_;
}

void UnixSocketStore::Set(const std::string& key, const std::string& value) {
  auto deadline = shared::DeadlineAfter(kRequestTime);
  shared::SendAll(fd_, &kSet, 1, deadline, name_);
  shared::SendString(fd_, key, deadline, name_);
  shared::SendString(fd_, value, deadline, name_);
  char ok = 0;
  shared::RecvAll(fd_, &ok, 1, deadline, name_);
}

std::string UnixSocketStore::Get(const std::string& key, std::chrono::milliseconds timeout) {
  auto deadline = shared::DeadlineAfter(timeout);
  shared::SendAll(fd_, &kGet, 1, deadline, name_);
  shared::SendString(fd_, key, deadline, name_);
  try {
    return shared::RecvString(fd_, deadline, name_);
  } catch (const IoError& e) {
    // The answer may still come later and would be taken for the next request's: this
    // connection is done, the next request goes over a new one (the server drops the old
    // connection's wait when it closes).
    ::close(std::exchange(fd_, -1));
    try {
      shared::UniqueFd fresh =
          shared::ConnectAbstract(name_, shared::DeadlineAfter(kRequestTime), false);
      shared::RequireSameUser(fresh.get(), name_);
      fd_ = fresh.release();
    } catch (const IoError&) {
      // The server is gone too: later calls fail with EBADF; this one reports the first error.
    }
    if (e.error_code() == ETIMEDOUT) {
      ThrowIoError(ETIMEDOUT, StrCat("store get (waited ", timeout.count(), " ms)"), key);
    }
    throw;
  }
}

void UnixSocketStore::Delete(const std::string& key) {
  auto deadline = shared::DeadlineAfter(kRequestTime);
  shared::SendAll(fd_, &kDelete, 1, deadline, name_);
  shared::SendString(fd_, key, deadline, name_);
  char ok = 0;
  shared::RecvAll(fd_, &ok, 1, deadline, name_);
}

int64_t UnixSocketStore::Add(const std::string& key, int64_t delta) {
  auto deadline = shared::DeadlineAfter(kRequestTime);
  shared::SendAll(fd_, &kAdd, 1, deadline, name_);
  shared::SendString(fd_, key, deadline, name_);
  shared::SendAll(fd_, &delta, sizeof(delta), deadline, name_);
  int64_t now = 0;
  shared::RecvAll(fd_, &now, sizeof(now), deadline, name_);
  return now;
}

}  // namespace tensortier
