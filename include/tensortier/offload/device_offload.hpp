// Device memory parked in an Offloader's backing files and brought back, through a
// DeviceTransfer's bounce rings (disk I/O and host<->device copies overlap, the host memory used
// is the ring's reused pinned slots, never a copy of the whole range), or through GPUDirect
// Storage where an OffloadDeviceFiles asks for it and cuFile accepts the backing file.
//
// Both calls block until the bytes have moved (any thread; the GIL-free work of an async
// DiskOffloader operation) and apply the outcome to the offloader before returning or throwing:
//   OffloadFromDevice: on success the key is stored; on failure it is unknown, its space freed,
//     and the device memory is untouched.
//   RestoreToDevice: on success the key is gone (its space freed) and the device range holds its
//     bytes; on failure the key stays stored (read it again) and the device range is unspecified.
// Errors: those of Offloader::BeginWrite/BeginRead (std::invalid_argument for a bad key, IoError
// for no space) before anything moves; then IoError (with path, offset and length; EIO when a
// backing file was cut short), CudaError or the copier's error.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "tensortier/cuda/cufile.hpp"
#include "tensortier/transfer/device_jobs.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/transfer/transfer.hpp"

namespace tensortier {

// How an offloader's backing files take device memory: a DeviceFile per backing file under one
// GdsMode, made (and registered with cuFile) on first use and kept, so each file's decision and
// registration happen once. Thread-safe. kOff never loads cuFile.
class OffloadDeviceFiles {
 public:
  // `cufile`: null for CuFile::Get() (loaded only for kAuto/kRequire); tests pass a stand-in.
  explicit OffloadDeviceFiles(GdsMode mode, const CuFile* cufile = nullptr);
  // Under TENSORTIER_GDS (GdsModeFromEnvironment()).
  OffloadDeviceFiles();

  // The DeviceFile of `file` (by its open descriptor). Throws CuFileError for kRequire when cuFile
  // cannot serve it (as DeviceFile does).
  DeviceFile For(const File& file);
  GdsMode mode() const noexcept { return mode_; }

 private:
  GdsMode mode_;
  const CuFile* cufile_;
  std::mutex mu_;
  std::unordered_map<int, DeviceFile> files_;  // by buffered_fd(); guarded by mu_
};

// Copies are ordered on span.stream (the caller's stream, or one ordered after it): the bytes
// written are those left by the work queued there before the call (GDS waits for it first).
// The parts of a key striped over several files move at once, each through its own transfer.
// `files`: null for the bounce ring only. result.path is "gds" when every part went through cuFile.
TransferResult OffloadFromDevice(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                                 const DeviceSpan& span, uint64_t length,
                                 OffloadDeviceFiles* files = nullptr);
TransferResult RestoreToDevice(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                               const DeviceSpan& span, uint64_t length,
                               OffloadDeviceFiles* files = nullptr);

// The same, run on `transfer`'s job queue (DeviceTransfer::Submit): the outcome is applied to
// the offloader when the job is over, and DeviceJob::Wait() returns or throws what the call
// above would. `offloader`, `transfer`, `files` and the device memory must outlive the job.
DeviceJob OffloadFromDeviceAsync(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                                 const DeviceSpan& span, uint64_t length,
                                 OffloadDeviceFiles* files = nullptr);
DeviceJob RestoreToDeviceAsync(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                               const DeviceSpan& span, uint64_t length,
                               OffloadDeviceFiles* files = nullptr);

}  // namespace tensortier
