#include "tensortier/offload/device_offload.hpp"

#include <cerrno>
#include <exception>
#include <thread>
#include <vector>

#include "tensortier/transfer/device_jobs.hpp"
#include "tensortier/util/error.hpp"

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

OffloadDeviceFiles::OffloadDeviceFiles() : OffloadDeviceFiles(GdsModeFromEnvironment()) {}

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

// Begins `key` for `kind`, moves each of its extents, and finishes it with the outcome.
TransferResult MoveKey(OffloadKind kind, Offloader& offloader, DeviceTransfer& transfer,
                       uint64_t key, const DeviceSpan& span, uint64_t length,
                       OffloadDeviceFiles* files) {
  const bool write = kind == OffloadKind::kWrite;
  const std::vector<OffloadExtent> extents =
      write ? offloader.BeginWrite(key, length) : offloader.BeginRead(key, length);
  const auto finish = [&](std::exception_ptr error) {
    write ? offloader.FinishWrite(key, error) : offloader.FinishRead(key, error);
  };
  TransferResult total;
  try {
    std::vector<TransferResult> results(extents.size());
    std::vector<std::exception_ptr> errors(extents.size());
    const auto move_extent = [&](size_t i) noexcept {
      try {
        const OffloadExtent& e = extents[i];
        DeviceSpan part = span;
        part.address += e.data_offset;
        results[i] =
            write ? WritePart(transfer, files, part, e) : ReadPart(transfer, files, e, part);
        if (results[i].bytes != e.length) {  // a read of a backing file cut short
          throw IoError(EIO,
                        write ? "offload write from device (short)"
                              : "offload read to device (backing file shorter than written)",
                        e.file.path(), e.file_offset + results[i].bytes,
                        e.length - results[i].bytes);
        }
      } catch (...) {
        errors[i] = std::current_exception();
      }
    };
    {
      // A key striped over several files (drives) moves all its parts at once, each through a
      // transfer of its own (a ring each, as far as the DeviceTransfer has rings; the rest
      // wait for one). jthreads: joined even when starting a later one throws.
      std::vector<std::jthread> helpers;
      for (size_t i = 1; i < extents.size(); ++i) helpers.emplace_back(move_extent, i);
      if (!extents.empty()) move_extent(0);
    }
    for (size_t i = 0; i < extents.size(); ++i) {
      if (errors[i] != nullptr) std::rethrow_exception(errors[i]);
      Add(total, results[i]);
    }
  } catch (...) {
    finish(std::current_exception());
    throw;
  }
  finish(nullptr);
  return total;
}

TransferResult OffloadFromDevice(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                                 const DeviceSpan& span, uint64_t length,
                                 OffloadDeviceFiles* files) {
  return MoveKey(OffloadKind::kWrite, offloader, transfer, key, span, length, files);
}

TransferResult RestoreToDevice(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                               const DeviceSpan& span, uint64_t length, OffloadDeviceFiles* files) {
  return MoveKey(OffloadKind::kRead, offloader, transfer, key, span, length, files);
}

DeviceJob OffloadFromDeviceAsync(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                                 const DeviceSpan& span, uint64_t length,
                                 OffloadDeviceFiles* files) {
  return transfer.Submit([&offloader, &transfer, key, span, length, files] {
    return OffloadFromDevice(offloader, transfer, key, span, length, files);
  });
}

DeviceJob RestoreToDeviceAsync(Offloader& offloader, DeviceTransfer& transfer, uint64_t key,
                               const DeviceSpan& span, uint64_t length,
                               OffloadDeviceFiles* files) {
  return transfer.Submit([&offloader, &transfer, key, span, length, files] {
    return RestoreToDevice(offloader, transfer, key, span, length, files);
  });
}

}  // namespace tensortier
