// The key-value store through which the processes of a job find each other before they share
// memory: torch.distributed's stores from Python, or the built-in Unix-socket store for C++
// programs. Only small control messages go through it (agreements, barriers, a random token);
// memory itself passes as file descriptors (shared_tensor.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace tensortier {

// A job-wide key-value store. Implementations are thread-compatible: one thread at a time.
class Store {
 public:
  virtual ~Store() = default;

  virtual void Set(const std::string& key, const std::string& value) = 0;
  // The value of `key`, waiting up to `timeout` for another process to set it. Throws IoError
  // (ETIMEDOUT, naming the key) when it does not appear in time.
  virtual std::string Get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Adds `delta` to the integer stored at `key` (0 when absent) and returns the new value.
  virtual int64_t Add(const std::string& key, int64_t delta) = 0;
  // Removes `key` (nothing where it is absent): keys no one reads again, so that a job's store
  // does not grow with every call. Throws IoError.
  virtual void Delete(const std::string& key) = 0;
};

// The built-in store: rank 0 serves it on an abstract-namespace Unix socket named after `job`
// (nothing in the filesystem; it vanishes with the process), every rank (rank 0 included)
// connects to it. Connections from processes of another user are refused (SO_PEERCRED), on
// both sides. One machine only: jobs spanning machines use torch.distributed's TCPStore.
class UnixSocketStore : public Store {
 public:
  // Connects to the store of `job` (serving it first when `serve`), retrying for up to
  // `timeout` while the server starts. Throws IoError.
  UnixSocketStore(const std::string& job, bool serve, std::chrono::milliseconds timeout);
  ~UnixSocketStore() override;
  UnixSocketStore(const UnixSocketStore&) = delete;
  UnixSocketStore& operator=(const UnixSocketStore&) = delete;

  void Set(const std::string& key, const std::string& value) override;
  void Delete(const std::string& key) override;
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t Add(const std::string& key, int64_t delta) override;

  // The socket's abstract name (without the leading NUL), e.g. for /proc/net/unix checks.
  const std::string& socket_name() const noexcept;

 private:
  struct Server;
  std::unique_ptr<Server> server_;
  int fd_ = -1;
  std::string name_;
};

}  // namespace tensortier
