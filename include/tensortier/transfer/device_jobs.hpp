// The job queue of asynchronous device transfers: a few threads that run transfers (file <->
// device through a DeviceTransfer, offloader keys to and from device memory) while the caller
// goes on, and handles to wait for each one's outcome. IOHandle's and DiskOffloader's device
// pieces run here; no Python runs on these threads (a job is C++ only, and waiting is done with
// the GIL released by the bindings).
//
// DeviceJobQueue: `threads` threads, started on the first Submit; jobs run in submission order
//   as threads free up. Thread-safe. Its destructor runs every job submitted, then joins; in a
//   child made by fork() (whose copy has no threads) it leaves everything in place instead.
// DeviceJob: a handle on one job's outcome, shared by its copies. Wait() returns the job's
//   TransferResult or throws its exception, as often as it is called.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "tensortier/transfer/transfer.hpp"
#include "tensortier/util/process_identity.hpp"

namespace tensortier {

class DeviceJob {
 public:
  // A job that has no work: done, with an empty result.
  DeviceJob();
  // A job done already, with `result` as its outcome.
  explicit DeviceJob(TransferResult result);

  bool done() const;
  // Waits up to `timeout`; true once the job is over.
  bool WaitFor(std::chrono::milliseconds timeout) const;
  // Blocks until the job is over; its result, or its exception thrown again.
  TransferResult Wait() const;

 private:
  friend class DeviceJobQueue;
  struct State;
  explicit DeviceJob(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

class DeviceJobQueue {
 public:
  // `threads` >= 1 (std::invalid_argument otherwise); `what` names them in errors ("start 4
  // <what>" when the process has no thread to give).
  DeviceJobQueue(unsigned threads, std::string what);
  ~DeviceJobQueue();
  DeviceJobQueue(const DeviceJobQueue&) = delete;
  DeviceJobQueue& operator=(const DeviceJobQueue&) = delete;

  // Queues `work`; its result or exception becomes the job's outcome. Throws std::system_error
  // when the threads cannot start (nothing is queued then).
  DeviceJob Submit(std::function<TransferResult()> work);

  unsigned threads() const noexcept { return threads_; }

 private:
  struct Impl;
  unsigned threads_;
  std::string what_;
  MakerProcess maker_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensortier
