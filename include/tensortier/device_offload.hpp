// Device memory parked in an Offloader's backing files and brought back, through a
// DeviceTransfer's bounce rings: disk I/O and host<->device copies overlap, the host memory used
// is the ring's reused pinned slots, never a copy of the whole range.
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

#include "tensortier/offloader.hpp"
#include "tensortier/transfer.hpp"

namespace tensortier {

// Copies are ordered on span.stream (the caller's current stream): the bytes written are those
// left by the work queued there before the call.
TransferResult OffloadFromDevice(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                                 const DeviceSpan& span, uint64_t length);
TransferResult RestoreToDevice(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                               const DeviceSpan& span, uint64_t length);

}  // namespace tensortier
