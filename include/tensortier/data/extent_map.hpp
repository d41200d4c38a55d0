// Extent maps: where every byte of a set of files lies on its block device, so that a reader
// can fetch the files straight from the device (ExtentReader) without the filesystem in the way.
//
// A map is built with FIEMAP (FIEMAP_FLAG_SYNC: delayed allocations are written out first) over
// every extent of every file, and records each file's identity (device, inode, size, mtime and
// ctime in nanoseconds) so that a reader can tell a file that changed since and read that one
// through the filesystem instead. Files whose bytes the filesystem does not promise to keep at
// the reported blocks are refused by name (RefusalReason in extent_map.cpp says which and why).
// The JSON form is described in docs/extents.md.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tensortier {

// A sector: the unit of sysfs's partition offsets and sizes, the alignment of every FIEMAP extent
// a map may hold, and the smallest block size of a device.
inline constexpr uint64_t kSectorBytes = 512;

// One run of a file's bytes on its device, in bytes (space_manager.hpp's Extent is another thing:
// a range of an offload file).
struct FileExtent {
  uint64_t logical = 0;   // offset in the file
  uint64_t physical = 0;  // offset on the filesystem's block device (FIEMAP's fe_physical)
  uint64_t length = 0;
  bool operator==(const FileExtent&) const = default;
};

// What a file was when it was mapped; any difference means its extents may have moved.
struct FileIdentity {
  uint64_t major = 0;  // st_dev
  uint64_t minor = 0;
  uint64_t inode = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  bool operator==(const FileIdentity&) const = default;
};

// The block device one filesystem lives on, and how to reach its bytes: the whole disk's device
// node plus the partition's start on it (0 when the filesystem's device is a whole disk: a loop
// device, an NVMe namespace, a device-mapper volume).
struct MappedDevice {
  uint64_t major = 0;  // the filesystem's device (st_dev of its files)
  uint64_t minor = 0;
  std::string disk;  // the whole disk's node, e.g. /dev/nvme0n1
  uint64_t disk_major = 0;
  uint64_t disk_minor = 0;
  uint64_t partition_offset = 0;  // bytes: sysfs `start` (512-byte sectors) x 512
  std::string filesystem;         // "ext4", "xfs"
  uint64_t block_size = 0;        // the filesystem's block size (statfs f_bsize)
  bool operator==(const MappedDevice&) const = default;
};

struct MappedFile {
  std::string path;     // relative to ExtentMap::root
  uint32_t device = 0;  // index into ExtentMap::devices
  FileIdentity identity;
  // Sorted by `logical`, covering [0, size) without gaps; neighbours that continue each other on
  // the device are merged. The last may run past `size` to the end of its block.
  std::vector<FileExtent> extents;
  // XXH64 of the file's bytes when it was mapped: a raw read is checked against it, since tools
  // that move blocks (online defragmentation, deduplication) keep the file's identity. Absent
  // in maps made before maps carried checksums.
  std::optional<uint64_t> xxh64;
  bool operator==(const MappedFile&) const = default;
};

// A file left out of a map, and why.
struct RefusedFile {
  std::string path;  // relative to the root
  std::string reason;
  bool operator==(const RefusedFile&) const = default;
};

struct ExtentMap {
  static constexpr uint32_t kVersion = 1;
  std::string root;  // absolute
  std::vector<MappedDevice> devices;
  std::vector<MappedFile> files;     // sorted by path
  std::vector<RefusedFile> refused;  // sorted by path
  bool operator==(const ExtentMap&) const = default;

  // root/path of files[index].
  std::string FullPath(size_t index) const;
  // The index of the file at `path` (absolute, or relative to the root; compared lexically after
  // normalisation), or nothing when the map does not hold it.
  std::optional<size_t> Find(std::string_view path) const;
};

// Why device `d.major:d.minor` no longer lies on disk `d.disk_major:d.disk_minor` at
// `d.partition_offset` (from sysfs), or "" when it does. Raw reads at a wrong offset would
// return other bytes for every file, with every file's identity unchanged.
std::string DevicePlacementChange(const MappedDevice& d);

// Bytes of device `d.major:d.minor` (the filesystem's: a partition's own size), from sysfs, or
// nothing when sysfs does not say.
std::optional<uint64_t> DeviceBytes(const MappedDevice& d);

// Appends the extents of a FIEMAP reply to `out`, merging each with the previous one when it
// continues it both in the file and on the device. REQUIRES: `extent` starts at or after the end
// of out.back(). Throws FormatError when it overlaps or goes backwards, or its end overflows.
void AppendExtent(std::vector<FileExtent>& out, const FileExtent& extent);

// Why FIEMAP flags `flags` (of one extent) make its file unmappable, or "" when they do not.
std::string RefusalReason(uint32_t flags);

struct BuildOptions {
  // Refused files are listed in ExtentMap::refused; when false (the default) BuildExtentMap
  // throws instead, naming them.
  bool allow_refused = false;
  // A file under the root that is not mapped: the map itself, written inside the root (a new
  // map replaces it, so that the one mapped would no longer verify).
  std::string leave_out;
};

// Maps every regular file under `root` (recursively, in path order; symbolic links to files are
// followed, to directories not), reading each once for its checksum. Throws IoError when `root`
// cannot be walked or a file cannot be opened or mapped for a reason other than a refusal
// (EIO...), and IoError(EOPNOTSUPP) naming the refused files unless options.allow_refused.
ExtentMap BuildExtentMap(const std::string& root, const BuildOptions& options = {});

// The same for the files `paths` (absolute, or relative to `root`; under it, each once).
// Throws std::invalid_argument for a path outside the root or listed twice.
ExtentMap BuildExtentMap(const std::string& root, std::span<const std::string> paths,
                         const BuildOptions& options = {});

// One file of a map that no longer matches it.
struct ChangedFile {
  std::string path;  // relative to the root
  std::string what;  // "missing", "size 10 -> 12", "extents differ"...
};

// Checks each file of `map` against the filesystem: identity (stat), extents (FIEMAP, with
// FIEMAP_FLAG_SYNC) and content (its checksum, when the map has one). Returns the files that
// changed, in map order; empty when all match.
// Throws IoError only for failures other than a file gone missing or no longer mappable.
std::vector<ChangedFile> VerifyExtentMap(const ExtentMap& map);

// The map as JSON text (docs/extents.md).
std::string ExtentMapToJson(const ExtentMap& map);
// Parses and checks JSON text from an untrusted source: unknown keys, bad values, overflowing
// ranges, extents that do not cover their file, paths leaving the root and duplicates are all
// FormatError naming `what` (the file it came from) and the item.
ExtentMap ParseExtentMap(std::string_view json, const std::string& what);

// File helpers: written durably (temporary file, fsync, rename); read whole. IoError on failure.
// A map is a list of disk offsets to read with the rights of whoever reads it (root), so, as ssh
// does with its keys, LoadExtentMap refuses (IoError EPERM) a map owned by another user than the
// caller or root, or writable by its group or others; anything but a regular file is EINVAL.
void SaveExtentMap(const ExtentMap& map, const std::string& path);
ExtentMap LoadExtentMap(const std::string& path);

// stat(path) as a FileIdentity; nothing when the path is gone or not a regular file. Throws
// IoError for other failures (EACCES...).
std::optional<FileIdentity> StatIdentity(const std::string& path);

}  // namespace tensortier
