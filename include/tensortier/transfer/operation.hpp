// One operation of an IOHandle: its pieces in host memory, submitted to the engine together (one
// Future), and its pieces in device memory, each a DeviceJob, with the order the caller gave them
// in. The outcome merges the parts: bytes per piece in the caller's order, the engine's stats and
// each device piece's result. Its error is the engine's, else the first failed device piece's,
// known once every part is over (no memory is in use then).
//
// An error is delivered once: whoever takes it first (Wait() throwing it, or
// TakeUndeliveredError() for a handle's wait over all its operations) counts it as raised, so a
// handle raises each failure once whether its future was waited for or dropped.
//
// Thread-safe; copies share the outcome.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "tensortier/io/engine.hpp"
#include "tensortier/transfer/device_jobs.hpp"
#include "tensortier/transfer/transfer.hpp"

namespace tensortier {

struct OperationResult {
  uint64_t bytes = 0;                   // over all pieces
  std::vector<uint64_t> segment_bytes;  // per piece, in the caller's order
  bool host = false;                    // a host part ran (pieces on the host, or none at all)
  IoStats stats;                        // the engine's
  std::vector<TransferResult> device;   // per device piece, in order
};

class Operation {
 public:
  // `device_piece[i]`: whether the caller's piece i is a device piece (the next of `jobs`), or
  // the next segment of `host` (invalid when no piece is on the host).
  Operation(Future host, std::vector<DeviceJob> jobs, std::vector<bool> device_piece);

  // Whether every part is over; never blocks.
  bool done() const;
  // Waits up to `timeout` for every part; whether all are over.
  bool WaitFor(std::chrono::milliseconds timeout) const;
  // Blocks until every part is over; the merged result, or the error thrown (then delivered).
  OperationResult Wait() const;
  // Blocks until every part is over; the error if nobody was given it yet (it is delivered now),
  // else null.
  std::exception_ptr TakeUndeliveredError() const;
  // Undoes TakeUndeliveredError() (its taker could not raise it).
  void ReturnError() const;
  // REQUIRES: done(). Whether the operation failed and nobody was given the error yet.
  bool HasUndeliveredError() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace tensortier
