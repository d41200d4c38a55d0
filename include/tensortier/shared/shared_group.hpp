// The processes of a job that share tensors, and attaching a named tensor from outside them.
//
// Collective calls (the SharedGroup constructor, Create, Barrier) must be made by every rank in
// the same order. Ranks that disagree on a call, or make different calls at one point, all get
// std::invalid_argument naming who asked for what; a rank that dies or does not arrive makes the
// others throw IoError (ETIMEDOUT, or ECONNREFUSED/ECONNRESET) within the group's timeout.
// Nothing waits forever.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensortier/shared/shared_spec.hpp"
#include "tensortier/shared/shared_store.hpp"
#include "tensortier/util/process_identity.hpp"

namespace tensortier {

class SharedTensor;
namespace shared {
class PartitionServer;
}

// The processes of a job, rendezvoused through `store`. Serves this rank's partitions to peers
// from one thread (no store traffic there: all store calls happen on the calling thread).
class SharedGroup {
 public:
  // Collective. Rank 0 draws a random token and publishes it; every rank starts serving.
  // `store` must outlive nothing: the group keeps a reference. The group's keys in the store are
  // its own (the nth group of `world_size` processes each rank creates on this store, counted by
  // the store), so groups made one after another on one store never meet each other's keys:
  // every rank creates its groups on one store in the same order (std::invalid_argument when a
  // peer is seen to have created more), and processes that are not in one group but create
  // groups on one store at the same time (two jobs) must use distinct stores or key prefixes.
  SharedGroup(std::shared_ptr<Store> store, int rank, int world_size,
              std::chrono::milliseconds timeout = kDefaultSharedTimeout);
  ~SharedGroup();
  SharedGroup(const SharedGroup&) = delete;
  SharedGroup& operator=(const SharedGroup&) = delete;

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  // Whether the caller runs in a child made by fork() (which holds a copy of the group, not a
  // rank of it: its collective calls and Attach throw std::logic_error, see RequireRank).
  bool forked() const noexcept { return maker_.Forked(); }
  // std::logic_error "{what}: ..." in a child made by fork(): what a rank does (a collective
  // call, a use of the store) would stand in for its parent's, or use the parent's connection.
  void RequireRank(const std::string& what) const;
  // The abstract socket name this rank serves on (without the leading NUL).
  const std::string& socket_name() const noexcept;
  // Connections refused because the peer ran as another user.
  uint64_t refused_peers() const;

  // Collective: every rank passes an equal spec (else std::invalid_argument on all). The
  // layout is kContinuous or kChunked. `device` is this process's GPU: where its partition of a
  // device-memory tensor lives, and the context host memory is registered through. A failure on
  // any rank (CudaError, IoError) makes every rank throw: the failing rank its own error, the
  // others std::runtime_error naming it. Nothing stays allocated, mapped or served after a throw.
  std::shared_ptr<SharedTensor> Create(const SharedTensorSpec& spec, int device = 0);
  // Not collective: maps a named host-memory tensor (its owners must still hold it), waiting up
  // to the group's timeout for it to be created. One that this group created has this rank's
  // local() partition; one that another group created is attached as by AttachSharedTensor.
  // Device-memory tensors cannot be attached (std::invalid_argument).
  std::shared_ptr<SharedTensor> Attach(const std::string& name, int device = 0);
  // Collective: returns when every rank has called it (IoError ETIMEDOUT otherwise).
  void Barrier(const std::string& what);
  // Collective exchange of one string per rank (the control path of the layers above). `what`
  // names the call: when ranks make different calls at one point (one a barrier, another a
  // create), every rank throws std::invalid_argument naming which ranks called what.
  // `number`, where given, gets the call's number in the group's sequence of collective calls
  // (the same on every rank).
  std::vector<std::string> AllGather(const std::string& what, const std::string& value,
                                     uint64_t* number = nullptr);
  // Collective: returns when every rank passed an equal `value`, with the call's number (as
  // AllGather's); otherwise every rank throws std::invalid_argument naming which ranks passed
  // what (`what` starts the message).
  uint64_t Agree(const std::string& what, const std::string& value);
  // Collective: takes part in the call `what` (an Agree) for a rank that refused it before it
  // began (its arguments): the others throw std::invalid_argument naming this rank and `why`,
  // at once, rather than waiting out the timeout. Never throws (the caller raises its own error).
  void Refuse(const std::string& what, const std::string& why);
  // Collective: every rank reports whether its step `what` worked (`failure` null) or not. Returns
  // every rank's `value` when all did; otherwise rethrows `failure` on the failing ranks (even
  // when a peer never arrives) and throws std::runtime_error on the others naming each failing
  // rank, in rank order, with its error's text.
  std::vector<std::string> Settle(const std::string& what, std::exception_ptr failure,
                                  const std::string& value = "");

  // Closes every tensor this group created or attached and stops serving. Idempotent; not
  // collective (peers still mapping this rank's memory keep it).
  void Close();

  // Leaving a job whose store one rank serves: every other rank counts itself out (CountOut)
  // once it is done with the store, and the serving rank keeps serving until all have
  // (WaitForOthersToLeave, at most `timeout`: a dead rank never counts; true once all have, or
  // once the store is gone). Neither throws: a store that is gone has nobody left to wait for.
  // The key is the group's own (leave_key).
  const std::string& leave_key() const noexcept { return leave_key_; }
  void CountOut() noexcept;
  // Records in the store that this rank closed its group, so that ranks waiting for it in a
  // collective call fail at once (IoError ECONNABORTED naming it) rather than at the timeout.
  // Never throws (a store that is gone has no one waiting).
  void MarkClosed() noexcept;
  static bool WaitForOthersToLeave(Store& store, const std::string& leave_key, int world_size,
                                   std::chrono::milliseconds timeout) noexcept;

 private:
  // Creates (when `own_partition`) and maps the host-memory partitions of `spec`; `key` names
  // them on every rank's server.
  std::shared_ptr<SharedTensor> Map(const SharedTensorSpec& spec, const std::string& key,
                                    bool own_partition, int device);
  // The same in device memory (shared_device.cpp).
  std::shared_ptr<SharedTensor> MapDevice(const SharedTensorSpec& spec, const std::string& key,
                                          int device);
  // The value of rank `r`'s entry `key` of the collective call `what`, waiting until
  // `deadline`: IoError ETIMEDOUT then, or ECONNABORTED as soon as rank `r` has closed its
  // group (MarkClosed), looked at every kClosedCheck.
  std::string GetUnlessClosed(const std::string& what, const std::string& key, int r,
                              std::chrono::steady_clock::time_point deadline);
  // Keeps a weak reference to `tensor` (closed with the group), forgetting those dropped.
  void Remember(const std::shared_ptr<SharedTensor>& tensor);

  // The process that is the rank: a child made by fork() holds a copy of the group, and a
  // collective call there would stand in for its parent's.
  MakerProcess maker_;
  std::shared_ptr<Store> store_;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::string prefix_;
  std::string token_;
  std::string socket_name_;
  std::string leave_key_;
  // Atomic: threads of one rank may each make calls (a rank of one, say); each takes its own
  // number.
  std::atomic<uint64_t> next_collective_{0};
  bool deletes_keys_ = true;  // false once the store failed to remove a key
  // How long a collective call waits for a rank's entry before it looks whether that rank has
  // closed its group.
  static constexpr std::chrono::milliseconds kClosedCheck{1000};
  // The partition server, null once closed (std::logic_error naming `what` then). A copy:
  // Close() from another thread leaves a call under way the server it serves from.
  std::shared_ptr<shared::PartitionServer> Server(const std::string& what) const;
  // Guards server_ and tensors_: Close() may come from another thread than the calls.
  mutable std::mutex members_mu_;
  std::shared_ptr<shared::PartitionServer> server_;
  std::vector<std::weak_ptr<SharedTensor>> tensors_;
};

// Maps the tensor that some group created under `name` in `store` from a process outside that
// group (started later, in another job step, an evaluation process): it needs only the store the
// group met through, not a group of its own. Not collective; waits up to `timeout` for the tensor
// to be created. The owners must still hold it (each rank serves its partition to peers of the
// same user until it closes the tensor or exits); once mapped, the memory stays valid here after
// they exit, until this process drops the tensor. Names are unique per store: the last group to
// create `name` is the one attached. The tensor has rank() -1 and no local() partition. Throws
// IoError: ETIMEDOUT (no such tensor in time), ECONNREFUSED/ENOENT (an owner exited or closed
// it), EACCES (an owner runs as another user), EMFILE (this process or an owner is out of
// descriptors); std::invalid_argument naming the field when the record in the store (which anyone
// who reaches the store can write) describes no tensor, or more memory than an owner serves.
std::shared_ptr<SharedTensor> AttachSharedTensor(Store& store, const std::string& name,
                                                 std::chrono::milliseconds timeout);

}  // namespace tensortier
