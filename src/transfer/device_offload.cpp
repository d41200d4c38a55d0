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
  // "bounce" as soon as one part bounced: the whole range went through cuFile only if all did.
  if (total.path.empty() || part.path == "bounce") total.path = part.path;
  if (total.copier.empty()) total.copier = part.copier;
  if (total.gds_reason.empty()) total.gds_reason = part.gds_reason;
}

TransferResult WritePart(DeviceTransfer& transfer, OffloadDeviceFiles* files,
                         const DeviceSpan& span, const OffloadExtent& e) {
  if (files == nullptr) return transfer.Write(span, e.length, e.file, e.file_offset);
  return transfer.Write(span, e.length, files->For(e.file), e.file_offset);
}

TransferResult ReadPart(DeviceTransfer& transfer, OffloadDeviceFiles* files, const OffloadExtent& e,
                        const DeviceSpan& span) {
  if (files == nullptr) return transfer.Read(e.file, e.file_offset, e.length, span);
  return transfer.Read(files->For(e.file), e.file_offset, e.length, span);
}

}  // namespace

OffloadDeviceFiles::OffloadDeviceFiles(GdsMode mode, const CuFile* cufile)
    : mode_(mode), cufile_(cufile) {}

DeviceFile OffloadDeviceFiles::For(const File& file) {
  std::lock_guard lock(mu_);
  // By descriptor: the DeviceFile kept here holds it open, so no other file can reuse the number
  // while the entry lives (two Files of one path, opened apart, are two entries).
  auto it = files_.find(file.buffered_fd());
  if (it == files_.end()) {
    // Registering with cuFile under mu_: once per backing file, and callers need it anyway.
    DeviceFile made =
        cufile_ != nullptr ? DeviceFile(file, mode_, *cufile_) : DeviceFile(file, mode_);
    it = files_.emplace(file.buffered_fd(), std::move(made)).first;
  }
  return it->second;
}

TransferResult OffloadFromDevice(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                                 const DeviceSpan& span, uint64_t length,
                                 OffloadDeviceFiles* files) {
  const std::vector<OffloadExtent> extents = offloader.BeginWrite(key, length);
  TransferResult total;
  try {
    for (const OffloadExtent& e : extents) {
      DeviceSpan part = span;
      part.address += e.data_offset;
      Add(total, WritePart(transfer, files, part, e));
    }
  } catch (...) {
    offloader.FinishWrite(key, std::current_exception());
    throw;
  }
  offloader.FinishWrite(key, nullptr);
  return total;
}

TransferResult RestoreToDevice(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                               const DeviceSpan& span, uint64_t length, OffloadDeviceFiles* files) {
  const std::vector<OffloadExtent> extents = offloader.BeginRead(key, length);
  TransferResult total;
  try {
    for (const OffloadExtent& e : extents) {
      DeviceSpan part = span;
      part.address += e.data_offset;
      const TransferResult r = ReadPart(transfer, files, e, part);
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
