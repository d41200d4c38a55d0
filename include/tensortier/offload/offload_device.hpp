// DiskOffloader's device path: the bounce rings' DeviceTransfer and the backing files'
// DeviceFiles, made for the first device range, and the device operations in flight by kind
// (OffloadFromDeviceAsync / RestoreToDeviceAsync jobs). Their outcomes join the offloader's own
// at the wait, and the bytes moved are counted by path.
//
// Wait's rule: every job's outcome is reported once, whatever it is, and the job let go. A job
// applies its outcome to the offloader itself (device_offload.hpp), so one that returned is
// reported done, never failed: a caller would otherwise free a restored range whose key is gone.
//
// Not thread-safe: one caller at a time (DiskOffloader's lock); the jobs run on the transfer's
// threads.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensortier/offload/device_offload.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/transfer/device_jobs.hpp"
#include "tensortier/transfer/transfer.hpp"

namespace tensortier {

class OffloadDevice {
 public:
  // Makes the transfer on the offloader's engine (a DeviceTransfer with CUDA copies, or a test
  // copier); called once, by the first Transfer().
  using TransferFactory = std::function<std::unique_ptr<DeviceTransfer>(Engine&)>;

  // `offloader` must outlive this.
  OffloadDevice(Offloader& offloader, GdsMode gds, TransferFactory make_transfer);
  ~OffloadDevice();
  OffloadDevice(const OffloadDevice&) = delete;
  OffloadDevice& operator=(const OffloadDevice&) = delete;

  // The transfer, made on the first call (CudaError without a driver).
  DeviceTransfer& Transfer();
  const DeviceTransfer* transfer() const noexcept { return transfer_.get(); }

  // Starts moving `key`'s `length` bytes between `span` and the files on the transfer's job
  // queue (kWrite: to the files); Wait(kind) reports the outcome. The memory must outlive it.
  void Submit(OffloadKind kind, uint64_t key, const DeviceSpan& span, uint64_t length);

  // The jobs a Wait(kind, keys) waits for (all of `kind` without `keys`), to wait for first
  // where the wait must be interruptible.
  std::vector<DeviceJob> Jobs(OffloadKind kind,
                              const std::optional<std::vector<uint64_t>>& keys) const;

  // Waits for the operations of `kind` (those moving any of `keys`, when given): the device
  // jobs, then the offloader's own; returns every outcome, the offloader's first. Nothing is
  // taken before all are over.
  std::vector<OffloadOutcome> Wait(OffloadKind kind,
                                   const std::optional<std::vector<uint64_t>>& keys);

  // Bytes of the device moves reported done, by path ("gds", "bounce").
  const std::map<std::string, uint64_t>& device_bytes() const noexcept { return bytes_; }

  // Lets go of the operations without waiting (a child made by fork(): they are the parent's).
  void Forget() noexcept;
  // Lets go of the transfer's pinned memory and the files' cuFile registrations.
  void Close();

 private:
  struct Job {
    uint64_t key;
    DeviceJob job;
  };

  Offloader& offloader_;
  const GdsMode gds_;
  TransferFactory make_transfer_;
  std::unique_ptr<OffloadDeviceFiles> files_;
  std::unique_ptr<DeviceTransfer> transfer_;
  std::vector<Job> jobs_[2];  // writes, reads
  std::map<std::string, uint64_t> bytes_;
};

}  // namespace tensortier
