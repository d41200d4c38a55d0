// The partition server: one thread per group that hands this rank's partition descriptors to
// peers of the same user over an abstract-namespace Unix socket, and the client side that
// fetches them. No store traffic here: the token that names the sockets is agreed elsewhere.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "tensortier/shared/unix_socket.hpp"
#include "tensortier/util/process_identity.hpp"

namespace tensortier::shared {

// The abstract socket name rank `rank` of the group agreed on `token` serves under.
std::string PartitionSocketName(const std::string& token, int rank);

class PartitionServer {
 public:
  // Listens under `socket_name` and starts serving (nothing yet: see Serve).
  explicit PartitionServer(std::string socket_name);
  // Stops the thread and closes every descriptor still served. In a child made by fork() (which
  // holds a copy without the thread), closes the copy's descriptors only.
  ~PartitionServer();
  PartitionServer(const PartitionServer&) = delete;
  PartitionServer& operator=(const PartitionServer&) = delete;

  // Serves `fd` (an invalid one: an empty partition) under `key`; std::invalid_argument when
  // something is already served under it.
  void Serve(const std::string& key, UniqueFd fd);
  // Stops serving `key` (nothing when it is not served).
  void Unserve(const std::string& key);
  // Connections refused because the peer ran as another user.
  uint64_t refused() const { return refused_.load(); }

 private:
  void Run();

  std::string name_;
  UniqueFd listener_, wake_read_, wake_write_;
  std::mutex mutex_;
  std::map<std::string, int> served_;  // key -> descriptor (-1: an empty partition)
  std::atomic<uint64_t> refused_{0};
  // Opened here, before the thread: the group's descriptors are all open once it is made.
  SpareFd spare_;
  const MakerProcess maker_;  // the process whose thread serves (a fork()ed child holds a copy)
  std::thread thread_;
};

// The descriptor rank `what` serves under `key` at abstract socket `peer`. Throws IoError:
// ECONNREFUSED/ENOENT (gone), ENOENT (not served), EMFILE/ENFILE (either side out of
// descriptors, naming the limit), ETIMEDOUT.
UniqueFd FetchDescriptor(const std::string& peer, const std::string& key,
                         Clock::time_point deadline, const std::string& what);

}  // namespace tensortier::shared
