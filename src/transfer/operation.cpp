#include "tensortier/transfer/operation.hpp"

#include <algorithm>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <utility>

namespace tensortier {

struct Operation::State {
  Future host;
  std::vector<DeviceJob> jobs;
  std::vector<bool> device_piece;
  std::mutex mu;       // guards what follows
  bool taken = false;  // the outcome below is known
  std::optional<OperationResult> result;
  std::exception_ptr error;
  bool delivered = false;

  // Waits for every part and keeps the outcome. REQUIRES: mu held.
  void Take() {
    if (taken) return;
    IoResult host_result;
    std::exception_ptr first;
    if (host.valid()) {
      try {
        host_result = host.Wait();
      } catch (...) {
        first = std::current_exception();
      }
    }
    OperationResult r;
    for (const DeviceJob& job : jobs) {  // each waited for, failed or not
      try {
        r.device.push_back(job.Wait());
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    taken = true;
    if (first) {
      error = first;
      return;
    }
    r.host = host.valid();
    r.stats = std::move(host_result.stats);
    size_t host_index = 0;
    size_t device_index = 0;
    for (bool on_device : device_piece) {
      const uint64_t bytes = on_device ? r.device.at(device_index++).bytes
                                       : host_result.segment_bytes.at(host_index++);
      r.segment_bytes.push_back(bytes);
      r.bytes += bytes;
    }
    result = std::move(r);
  }
};

Operation::Operation(Future host, std::vector<DeviceJob> jobs, std::vector<bool> device_piece)
    : state_(std::make_shared<State>()) {
  state_->host = std::move(host);
  state_->jobs = std::move(jobs);
  state_->device_piece = std::move(device_piece);
}

bool Operation::done() const {
  if (state_->host.valid() && !state_->host.done()) return false;
  for (const DeviceJob& job : state_->jobs) {
    if (!job.done()) return false;
  }
  return true;
}

bool Operation::WaitFor(std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto left = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()),
                    std::chrono::milliseconds(0));
  };
  if (state_->host.valid() && !state_->host.WaitFor(left())) return false;
  for (const DeviceJob& job : state_->jobs) {
    if (!job.WaitFor(left())) return false;
  }
  return true;
}

OperationResult Operation::Wait() const {
  std::lock_guard lock(state_->mu);
  state_->Take();
  if (state_->error) {
    state_->delivered = true;
    std::rethrow_exception(state_->error);
  }
  return *state_->result;
}

std::exception_ptr Operation::TakeUndeliveredError() const {
  std::lock_guard lock(state_->mu);
  state_->Take();
  if (!state_->error || state_->delivered) return nullptr;
  state_->delivered = true;
  return state_->error;
}

void Operation::ReturnError() const {
  std::lock_guard lock(state_->mu);
  state_->delivered = false;
}

bool Operation::HasUndeliveredError() const {
  std::lock_guard lock(state_->mu);
  state_->Take();
  return state_->error && !state_->delivered;
}

}  // namespace tensortier
