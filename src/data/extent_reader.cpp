#include "tensortier/data/extent_reader.hpp"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "tensortier/data/open_files.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

std::string IdentityChange(const FileIdentity& was, const std::optional<FileIdentity>& now) {
  if (!now) return "missing, or no longer a regular file";
  if (now->major != was.major || now->minor != was.minor || now->inode != was.inode) {
    return "replaced by another file";
  }
  if (now->size != was.size) return StrCat("size ", was.size, " -> ", now->size);
  if (now->mtime_ns != was.mtime_ns) return "modified (mtime changed)";
  return "metadata changed (ctime changed)";
}

// The disk node the map names, checked to still be that disk, opened read-only O_DIRECT.
File OpenDisk(const MappedDevice& d) {
  struct stat st {};
  if (stat(d.disk.c_str(), &st) != 0) {
    ThrowIoError(errno, "open the disk for raw extent reads", d.disk);
  }
  if (!S_ISBLK(st.st_mode) || major(st.st_rdev) != d.disk_major ||
      minor(st.st_rdev) != d.disk_minor) {
    ThrowIoError(ENODEV,
                 StrCat("open the disk for raw extent reads (it is not block device ", d.disk_major,
                        ":", d.disk_minor, " any more: rebuild the extent map)"),
                 d.disk);
  }
  if (const std::string change = DevicePlacementChange(d); !change.empty()) {
    ThrowIoError(
        ENODEV, StrCat("open the disk for raw extent reads (", change, ": rebuild the extent map)"),
        d.disk);
  }
  File disk;
  try {
    disk = File::Open(d.disk, OpenMode::kRead, true);
  } catch (const IoError& e) {
    if (e.error_code() != EACCES && e.error_code() != EPERM) throw;
    ThrowIoError(e.error_code(),
                 "open the disk for raw extent reads (needs read access to the block device: "
                 "root, or a member of its group)",
                 d.disk);
  }
  if (!disk.direct()) {
    ThrowIoError(EOPNOTSUPP,
                 StrCat("open the disk for raw extent reads with O_DIRECT (",
                        disk.direct_fallback_reason(), ")"),
                 d.disk);
  }
  return disk;
}

// Refuses a map whose extents leave their filesystem's device: with root's right to read the
// whole disk, an edited offset would read any block of it (another partition, another user's
// files).
void CheckExtentsInside(const ExtentMap& map) {
  std::vector<std::optional<uint64_t>> bytes;
  for (const MappedDevice& d : map.devices) bytes.push_back(DeviceBytes(d));
  for (size_t i = 0; i < map.files.size(); ++i) {
    const MappedFile& f = map.files[i];
    const MappedDevice& d = map.devices.at(f.device);
    const std::optional<uint64_t>& limit = bytes[f.device];
    for (const FileExtent& x : f.extents) {
      if (!limit || x.physical > *limit || x.length > *limit - x.physical) {
        throw std::invalid_argument(StrCat(
            "the extent map's file '", map.FullPath(i), "' has an extent at device offset ",
            x.physical, " of ", x.length, " bytes, outside its filesystem's device ", d.major, ":",
            d.minor, limit ? StrCat(" (", *limit, " bytes)") : std::string(" (of unknown size)"),
            ": the map does not describe that filesystem (rebuild it)"));
      }
    }
  }
}

}  // namespace

// One batch in flight: the raw pieces of every file in one engine operation, the files read
// through the filesystem in one each, and the staged copies.
struct ExtentReader::Plan {
  // A device range read into the batch's staging buffer, then copied: a file's last partial
  // sector, or an extent off the device's O_DIRECT alignment.
  struct Staged {
    uint64_t staging_offset;  // where the aligned range starts in the staging buffer
    uint64_t skip;            // bytes of the aligned range before the wanted ones
    uint64_t length;          // wanted bytes
    std::byte* dest;
  };
  struct PerFile {
    bool raw = false;
    std::string fallback;
    uint64_t expected = 0;  // bytes of the file the raw pieces carry (its size in the map)
    size_t first_piece = 0;
    size_t piece_count = 0;
    std::vector<Staged> staged;
    File file;      // the file itself, for a read through the filesystem
    Future future;  // that read
  };
  std::vector<PerFile> files;
  std::vector<IoDesc> pieces;  // of every raw file, in request order
  std::vector<size_t> owner;   // per piece, its request
  Future raw;
  AlignedBuffer staging;

  // Reads still in flight write into the callers' buffers and the staging buffer: an error
  // thrown for one file waits for the others before anything is freed.
  ~Plan() {
    auto wait = [](const Future& f) {
      if (!f.valid()) return;
      try {
        f.Wait();
      } catch (...) {  // the error thrown to the caller is the first one; the rest are moot
      }
    };
    wait(raw);
    for (PerFile& f : files) wait(f.future);
  }
};

ExtentReader::ExtentReader(ExtentMap map, EngineOptions options, bool verify_checksums)
    : ExtentReader(std::move(map), std::move(options), BackendFactory{}, verify_checksums) {}

ExtentReader::ExtentReader(ExtentMap map, EngineOptions options, BackendFactory factory,
                           bool verify_checksums)
    : map_(std::move(map)),
      verify_checksums_(verify_checksums),
      fallback_window_(detail::OpenFileWindow()) {
  options.page_cache_check = false;
  for (const MappedDevice& d : map_.devices) devices_.push_back(OpenDisk(d));
  CheckExtentsInside(map_);
  engine_ = factory ? std::make_unique<Engine>(options, std::move(factory))
                    : std::make_unique<Engine>(options);
}

ExtentReader::~ExtentReader() = default;

ExtentBatch ExtentReader::ReadBatch(std::span<const ExtentReadRequest> requests) {
  Plan plan;
  plan.files.resize(requests.size());
  // Identity first: stat each file by its path (cheap) against the map.
  for (size_t i = 0; i < requests.size(); ++i) {
    const ExtentReadRequest& r = requests[i];
    if (r.file >= map_.files.size()) {
      throw std::out_of_range(StrCat("file index ", r.file, " is not in the extent map (",
                                     map_.files.size(), " files)"));
    }
    const MappedFile& f = map_.files[r.file];
    if (r.capacity < f.identity.size) {
      throw std::invalid_argument(StrCat("a buffer of ", r.capacity, " bytes for '",
                                         map_.FullPath(r.file), "' of ", f.identity.size,
                                         " bytes"));
    }
    if (f.identity.size > 0 && r.dest == nullptr) {
      throw std::invalid_argument(StrCat("null buffer for '", map_.FullPath(r.file), "'"));
    }
    std::optional<FileIdentity> now = StatIdentity(map_.FullPath(r.file));
    Plan::PerFile& p = plan.files[i];
    p.raw = now && *now == f.identity;
    if (!p.raw) {
      p.fallback = IdentityChange(f.identity, now);
    } else if (verify_checksums_ && !f.xxh64) {
      p.raw = false;
      p.fallback = "the map has no checksum of it to check raw reads by (an older map: rebuild it)";
    }
  }
  // Raw pieces: each extent (trimmed to the file's size) at its place on the disk. What is not on
  // the device's O_DIRECT alignment (a last partial sector, odd extents) is read whole-aligned
  // into the staging buffer and copied.
  uint64_t staging_bytes = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    Plan::PerFile& p = plan.files[i];
    if (!p.raw) continue;
    const MappedFile& f = map_.files[requests[i].file];
    const MappedDevice& d = map_.devices[f.device];
    const File& disk = devices_[f.device];
    const uint64_t align = std::max<uint64_t>(disk.offset_alignment(), disk.memory_alignment());
    auto* dest = static_cast<std::byte*>(requests[i].dest);
    p.first_piece = plan.pieces.size();
    for (const FileExtent& x : f.extents) {
      const uint64_t length = std::min(x.length, f.identity.size - x.logical);
      const uint64_t at = d.partition_offset + x.physical;
      uint64_t direct = 0;
      if (at % align == 0) direct = AlignDown(length, align);
      if (direct > 0) plan.pieces.push_back({disk, dest + x.logical, at, direct});
      if (direct < length) {
        const uint64_t begin = AlignDown(at + direct, align);
        const uint64_t end = AlignUp(at + length, align);
        p.staged.push_back(
            {staging_bytes, at + direct - begin, length - direct, dest + x.logical + direct});
        plan.pieces.push_back({disk, nullptr, begin, end - begin});  // buffer set below
        staging_bytes += end - begin;
      }
      p.expected += length;
    }
    p.piece_count = plan.pieces.size() - p.first_piece;
    plan.owner.resize(plan.pieces.size(), i);
  }
  if (staging_bytes > 0) plan.staging = AlignedBuffer(staging_bytes);
  // The raw pieces of the whole batch go in one operation (one planning pass, the engine's
  // workers kept full); the files read through the filesystem alongside.
  for (Plan::PerFile& p : plan.files) {
    size_t staged = 0;
    for (size_t k = p.first_piece; k < p.first_piece + p.piece_count; ++k) {
      if (plan.pieces[k].buf == nullptr) {
        plan.pieces[k].buf = plan.staging.data() + p.staged[staged++].staging_offset;
      }
    }
  }
  if (!plan.pieces.empty()) plan.raw = engine_->Submit(IoOp::kRead, plan.pieces);
  ExtentBatch batch;
  batch.files.resize(requests.size());
  // Files read through the filesystem: opened and sized now (they changed since the map).
  auto read_file = [&](size_t i) {
    Plan::PerFile& p = plan.files[i];
    const std::string path = map_.FullPath(requests[i].file);
    p.file = File::Open(path, OpenMode::kRead, true);
    const uint64_t size = p.file.Size();
    if (size > requests[i].capacity) {
      ThrowIoError(EFBIG,
                   StrCat("read (the file changed since the extent map was built: ", p.fallback,
                          "; it is now larger than its ", requests[i].capacity, "-byte buffer)"),
                   path, 0, size);
    }
    p.future = engine_->Read(p.file, requests[i].dest, size, 0);
  };
  // A window of them at a time (opened, read, closed): however many changed, the files open at
  // once stay bounded.
  auto read_files = [&](const std::vector<size_t>& which) {
    for (size_t at = 0; at < which.size(); at += fallback_window_) {
      const size_t end = std::min(which.size(), at + fallback_window_);
      for (size_t k = at; k < end; ++k) read_file(which[k]);
      for (size_t k = at; k < end; ++k) {
        Plan::PerFile& p = plan.files[which[k]];
        IoResult r = p.future.Wait();
        p.future = Future();
        p.file.Close();
        batch.io += r.stats;
        batch.files[which[k]].bytes = r.bytes;
        batch.files[which[k]].fallback = p.fallback;
      }
    }
  };
  std::vector<size_t> changed_before;  // read while the raw pieces are in flight
  for (size_t i = 0; i < requests.size(); ++i) {
    if (!plan.files[i].raw) changed_before.push_back(i);
  }
  read_files(changed_before);
  IoResult raw;
  if (plan.raw.valid()) {
    try {
      raw = plan.raw.Wait();
    } catch (const IoError& e) {
      // Name the file whose piece failed: the error names the disk and the offset.
      for (size_t k = 0; k < plan.pieces.size(); ++k) {
        const IoDesc& piece = plan.pieces[k];
        if (piece.file.path() == e.path() && e.offset() >= piece.offset &&
            e.offset() - piece.offset < piece.length) {
          throw IoError(
              e.error_code(),
              StrCat("raw read of '", map_.FullPath(requests[plan.owner[k]].file), "': ", e.op()),
              e.path(), e.offset(), e.length());
        }
      }
      throw;
    }
    batch.io += raw.stats;
  }
  std::vector<size_t> changed_after;  // changed while read raw, or not the map's bytes
  for (size_t i = 0; i < requests.size(); ++i) {
    Plan::PerFile& p = plan.files[i];
    ExtentReadResult& out = batch.files[i];
    const std::string path = map_.FullPath(requests[i].file);
    if (!p.raw) continue;  // read above
    uint64_t wanted = 0;
    uint64_t got = 0;
    for (size_t k = p.first_piece; k < p.first_piece + p.piece_count; ++k) {
      wanted += plan.pieces[k].length;
      got += raw.segment_bytes[k];
    }
    if (got != wanted) {
      ThrowIoError(EIO,
                   StrCat("raw read of '", path, "' (the disk ended ", wanted - got,
                          " bytes before the file's extents: a wrong map or disk)"),
                   devices_[map_.files[requests[i].file].device].path());
    }
    for (const Plan::Staged& s : p.staged) {
      std::memcpy(s.dest, plan.staging.data() + s.staging_offset + s.skip, s.length);
    }
    // A file changed while it was read may have had blocks moved or rewritten under the read:
    // its bytes come from the filesystem instead.
    const MappedFile& f = map_.files[requests[i].file];
    std::optional<FileIdentity> now = StatIdentity(path);
    const bool changed = !now || *now != f.identity;
    if (changed || (verify_checksums_ && Xxh64(requests[i].dest, p.expected) != *f.xxh64)) {
      p.raw = false;
      p.fallback =
          changed ? StrCat("changed while read raw: ", IdentityChange(f.identity, now))
                  : "its blocks on the disk no longer hold its bytes (they differ from the map's "
                    "checksum: moved by defragmentation or deduplication?): rebuild the map";
      changed_after.push_back(i);
      continue;
    }
    out.raw = true;
    out.bytes = p.expected;
  }
  read_files(changed_after);
  return batch;
}

}  // namespace tensortier
