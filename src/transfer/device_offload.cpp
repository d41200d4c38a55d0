#include "tensortier/device_offload.hpp"

#include <cerrno>
#include <exception>
#include <vector>

#include "tensortier/error.hpp"

namespace tensortier {
namespace {

void Add(TransferResult& total, const TransferResult& part) {
  total.bytes += part.bytes;
  total.chunks += part.chunks;
  total.io += part.io;
  if (total.path.empty()) total.path = part.path;
  if (total.copier.empty()) total.copier = part.copier;
  if (total.gds_reason.empty()) total.gds_reason = part.gds_reason;
}

}  // namespace

TransferResult OffloadFromDevice(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                                 const DeviceSpan& span, uint64_t length) {
  const std::vector<OffloadExtent> extents = offloader.BeginWrite(key, length);
  TransferResult total;
  try {
    for (const OffloadExtent& e : extents) {
      DeviceSpan part = span;
      part.address += e.data_offset;
      Add(total, transfer.Write(part, e.length, e.file, e.file_offset));
    }
  } catch (...) {
    offloader.FinishWrite(key, std::current_exception());
    throw;
  }
  offloader.FinishWrite(key, nullptr);
  return total;
}

TransferResult RestoreToDevice(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                               const DeviceSpan& span, uint64_t length) {
  const std::vector<OffloadExtent> extents = offloader.BeginRead(key, length);
  TransferResult total;
  try {
    for (const OffloadExtent& e : extents) {
      DeviceSpan part = span;
      part.address += e.data_offset;
      const TransferResult r = transfer.Read(e.file, e.file_offset, e.length, part);
      if (r.bytes != e.length) {  // a backing file was cut short behind our back
        throw IoError(EIO, "offload read to device (backing file shorter than written)",
                      e.file.path(), e.file_offset + r.bytes, e.length - r.bytes);
      }
      Add(total, r);
    }
  } catch (...) {
    offloader.FinishRead(key, std::current_exception());
    throw;
  }
  offloader.FinishRead(key, nullptr);
  return total;
}

}  // namespace tensortier
