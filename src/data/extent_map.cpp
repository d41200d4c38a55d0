#include "tensortier/data/extent_map.hpp"

#include <fcntl.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kNsPerSecond = 1000000000;
// Filesystems whose FIEMAP fe_physical is a byte offset on the block device of st_dev. Elsewhere
// it may not be: btrfs reports addresses in its own logical space (spread over several devices),
// network and FUSE filesystems have no device at all. Others may well qualify but are not tested.
constexpr uint64_t kExt4Magic = 0xEF53;  // ext2, ext3 and ext4
constexpr uint64_t kXfsMagic = 0x58465342;

// `value` rounded up to a multiple of `alignment`, or the largest multiple when that overflows.
uint64_t AlignUpChecked(uint64_t value, uint64_t alignment) {
  const uint64_t rem = value % alignment;
  if (rem == 0) return value;
  if (value > UINT64_MAX - (alignment - rem)) return UINT64_MAX - UINT64_MAX % alignment;
  return value + (alignment - rem);
}

int64_t Nanoseconds(const struct timespec& t) {
  return static_cast<int64_t>(t.tv_sec) * kNsPerSecond + t.tv_nsec;
}

FileIdentity IdentityOf(const struct stat& st) {
  return {major(st.st_dev),
          minor(st.st_dev),
          static_cast<uint64_t>(st.st_ino),
          static_cast<uint64_t>(st.st_size),
          Nanoseconds(st.st_mtim),
          Nanoseconds(st.st_ctim)};
}

std::string DescribeChange(const FileIdentity& was, const FileIdentity& now) {
  if (was.major != now.major || was.minor != now.minor) {
    return StrCat("device ", was.major, ":", was.minor, " -> ", now.major, ":", now.minor);
  }
  if (was.inode != now.inode) return StrCat("inode ", was.inode, " -> ", now.inode);
  if (was.size != now.size) return StrCat("size ", was.size, " -> ", now.size);
  if (was.mtime_ns != now.mtime_ns) return "modified (mtime changed)";
  return "metadata changed (ctime changed)";
}

// A sysfs attribute's first line, or nothing.
std::optional<std::string> ReadSysfs(const fs::path& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

std::optional<uint64_t> ParseDecimal(const std::string& s) {
  if (s.empty() || s.size() > 19) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

// "MAJ:MIN" -> (major, minor).
std::optional<std::pair<uint64_t, uint64_t>> ParseDevNumbers(const std::string& s) {
  auto colon = s.find(':');
  if (colon == std::string::npos) return std::nullopt;
  auto maj = ParseDecimal(s.substr(0, colon));
  auto min = ParseDecimal(s.substr(colon + 1));
  if (!maj || !min) return std::nullopt;
  return std::make_pair(*maj, *min);
}

// A partition (a `partition` file in its sysfs folder `dir`) lies in its whole disk (the
// parent folder) at its `start`; anything else is its own disk, at 0. False when the start
// cannot be read.
bool PartitionPlacement(const fs::path& dir, fs::path* disk_dir, uint64_t* offset) {
  std::error_code ec;
  *disk_dir = dir;
  *offset = 0;
  if (!fs::exists(dir / "partition", ec)) return true;
  auto start = ReadSysfs(dir / "start");
  auto sectors = start ? ParseDecimal(*start) : std::nullopt;
  if (!sectors || *sectors > UINT64_MAX / kSectorBytes) return false;
  *offset = *sectors * kSectorBytes;
  *disk_dir = dir.parent_path();
  return true;
}

// The device a filesystem lives on, from sysfs: a partition (a `partition` file) is reached
// through its whole disk (the parent folder) at its `start`; anything else is its own disk.
// Either the device, or why its files cannot be mapped.
struct DeviceLookup {
  std::optional<MappedDevice> device;
  std::string refusal;
};

DeviceLookup LookUpDevice(dev_t dev, int fd) {
  DeviceLookup out;
  struct statfs sfs {};
  if (fstatfs(fd, &sfs) != 0) {
    out.refusal = StrCat("statfs failed: ", std::strerror(errno));
    return out;
  }
  const auto magic = static_cast<uint64_t>(sfs.f_type);
  std::string filesystem;
  if (magic == kExt4Magic) {
    filesystem = "ext4";
  } else if (magic == kXfsMagic) {
    filesystem = "xfs";
  } else {
    // The usual others by name (statfs(2)'s magic numbers), any else by number.
    constexpr std::pair<uint64_t, const char*> kNames[] = {
        {0x01021994, "tmpfs"}, {0x858458f6, "ramfs"}, {0x9123683e, "btrfs"},
        {0x2fc12fc1, "zfs"},   {0x6969, "nfs"},       {0x794c7630, "overlayfs"},
        {0x65735546, "fuse"},  {0xff534d42, "cifs"},  {0x5346544e, "ntfs"},
        {0x4d44, "vfat"},      {0xf2f52010, "f2fs"},
    };
    char hex[32];
    std::snprintf(hex, sizeof(hex), "0x%llx", static_cast<unsigned long long>(magic));
    std::string type = hex;
    for (const auto& [number, name] : kNames) {
      if (number == magic) type = name;
    }
    out.refusal = StrCat("on a filesystem of type ", type,
                         ": only ext4 and XFS files are mapped (elsewhere FIEMAP's offsets need "
                         "not be offsets on one block device)");
    return out;
  }
  if (major(dev) == 0) {
    out.refusal =
        StrCat("on device ", major(dev), ":", minor(dev), ", which is not a block device");
    return out;
  }
  const fs::path link = StrCat("/sys/dev/block/", major(dev), ":", minor(dev));
  std::error_code ec;
  const fs::path dir = fs::canonical(link, ec);
  if (ec) {
    out.refusal = StrCat("its device ", major(dev), ":", minor(dev), " has no ", link.string(),
                         " (", ec.message(), ")");
    return out;
  }
  MappedDevice d;
  d.major = major(dev);
  d.minor = minor(dev);
  d.filesystem = filesystem;
  d.block_size = static_cast<uint64_t>(sfs.f_bsize);
  fs::path disk_dir = dir;
  if (!PartitionPlacement(dir, &disk_dir, &d.partition_offset)) {
    out.refusal = StrCat("cannot read the partition start ", (dir / "start").string());
    return out;
  }
  auto numbers = ReadSysfs(disk_dir / "dev");
  auto parsed = numbers ? ParseDevNumbers(*numbers) : std::nullopt;
  std::string devname;
  std::ifstream uevent(disk_dir / "uevent");
  for (std::string line; std::getline(uevent, line);) {
    if (line.starts_with("DEVNAME=")) devname = line.substr(8);
  }
  if (!parsed || devname.empty()) {
    out.refusal = StrCat("cannot read the disk of device ", d.major, ":", d.minor, " from ",
                         disk_dir.string());
    return out;
  }
  d.disk_major = parsed->first;
  d.disk_minor = parsed->second;
  d.disk = "/dev/" + devname;
  struct stat node {};
  if (stat(d.disk.c_str(), &node) != 0 || !S_ISBLK(node.st_mode) ||
      major(node.st_rdev) != d.disk_major || minor(node.st_rdev) != d.disk_minor) {
    out.refusal = StrCat("its disk's device node ", d.disk, " is missing or is not device ",
                         d.disk_major, ":", d.disk_minor);
    return out;
  }
  out.device = std::move(d);
  return out;
}

// Why `fd` (on an XFS filesystem) cannot be mapped, or "".
std::string XfsRefusal(int fd) {
  struct fsxattr attr {};
  if (ioctl(fd, FS_IOC_FSGETXATTR, &attr) == 0 && (attr.fsx_xflags & FS_XFLAG_REALTIME) != 0) {
    // Realtime files live on the realtime device, not on st_dev's: FIEMAP's offsets are there.
    return "on XFS's realtime device (not the filesystem's data device)";
  }
  return "";
}

// Outcome of mapping one open file: its extents, or why it is refused.
struct FileExtents {
  std::vector<FileExtent> extents;
  std::string refusal;
};

// Every extent of the file open at `fd` (of `size` bytes, on a filesystem of `block_size`
// blocks), by FIEMAP in batches until the last; extents past the end of the file are
// preallocation, not data, and are left out. Throws IoError for failures of the call itself.
FileExtents ReadExtents(int fd, const std::string& path, uint64_t size, uint64_t block_size) {
  constexpr uint32_t kBatch = 256;
  std::vector<uint64_t> storage(
      (sizeof(struct fiemap) + kBatch * sizeof(struct fiemap_extent)) / sizeof(uint64_t) + 1);
  auto* fm = reinterpret_cast<struct fiemap*>(storage.data());
  FileExtents out;
  const uint64_t mapped_end = AlignUpChecked(size, block_size);
  uint64_t start = 0;
  bool first = true;
  bool last = false;
  while (!last && start < size) {
    std::memset(storage.data(), 0, storage.size() * sizeof(uint64_t));
    fm->fm_start = start;
    fm->fm_length = FIEMAP_MAX_OFFSET - start;
    // The first call writes delayed allocations out so that every extent has its blocks.
    fm->fm_flags = first ? FIEMAP_FLAG_SYNC : 0;
    fm->fm_extent_count = kBatch;
    first = false;
    int rc;
    do {
      rc = ioctl(fd, FS_IOC_FIEMAP, fm);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      if (errno == EOPNOTSUPP || errno == ENOTTY) {
        out.refusal = "the filesystem does not report its extents (FIEMAP unsupported)";
        return out;
      }
      ThrowIoError(errno, "FIEMAP", path, start, 0);
    }
    if (fm->fm_mapped_extents == 0) break;
    const uint32_t n = std::min(fm->fm_mapped_extents, kBatch);
    for (uint32_t i = 0; i < n; ++i) {
      const struct fiemap_extent& e = fm->fm_extents[i];
      last = (e.fe_flags & FIEMAP_EXTENT_LAST) != 0;
      if (e.fe_logical >= size) continue;
      if (std::string why = RefusalReason(e.fe_flags); !why.empty()) {
        out.refusal = StrCat("extent at file offset ", e.fe_logical, ": ", why);
        return out;
      }
      if (e.fe_logical % kSectorBytes != 0 || e.fe_physical % kSectorBytes != 0 ||
          e.fe_length == 0 || e.fe_length % kSectorBytes != 0) {
        out.refusal =
            StrCat("extent at file offset ", e.fe_logical, " is not on whole sectors (physical ",
                   e.fe_physical, ", length ", e.fe_length, ")");
        return out;
      }
      FileExtent x{e.fe_logical, e.fe_physical, e.fe_length};
      if (x.length > mapped_end - x.logical) x.length = mapped_end - x.logical;
      try {
        AppendExtent(out.extents, x);
      } catch (const FormatError& error) {
        ThrowIoError(EIO, StrCat("FIEMAP (", error.what(), ")"), path, start, 0);
      }
    }
    const struct fiemap_extent& tail = fm->fm_extents[n - 1];
    if (tail.fe_length > UINT64_MAX - tail.fe_logical ||
        tail.fe_logical + tail.fe_length <= start) {
      ThrowIoError(EIO, "FIEMAP (extents do not advance)", path, start, 0);
    }
    start = tail.fe_logical + tail.fe_length;
  }
  // Holes are refused: a map promises that every byte of the file is on the listed blocks, and a
  // hole has none (the file reads zeros there by the filesystem's rule, not from the disk). Data
  // sets are not sparse; a file that is was likely being preallocated or written.
  uint64_t covered = 0;
  for (const FileExtent& x : out.extents) {
    if (x.logical != covered) {
      out.refusal = StrCat("sparse: no blocks for bytes [", covered, ", ", x.logical, ") (a hole)");
      return out;
    }
    covered = x.logical + x.length;
  }
  if (covered < size) {
    out.refusal = StrCat("sparse: no blocks for bytes [", covered, ", ", size, ") (a hole)");
  }
  return out;
}

// XXH64 of the first `size` bytes of the file open at `fd` (fewer when it ends sooner: the
// caller's identity check then sees it changed).
uint64_t ContentChecksum(int fd, const std::string& path, uint64_t size) {
  std::vector<std::byte> chunk(size_t{1} << 20);
  Xxh64State state;
  for (uint64_t done = 0; done < size;) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(chunk.size(), size - done));
    const ssize_t n = pread(fd, chunk.data(), want, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) ThrowIoError(errno, "read (for the extent map's checksum)", path, done, want);
    if (n == 0) break;
    state.Update(chunk.data(), static_cast<size_t>(n));
    done += static_cast<uint64_t>(n);
  }
  return state.Digest();
}

// One file mapped from its path, or refused; IoError for failures that are not refusals.
struct MapOutcome {
  std::optional<MappedFile> file;
  std::string refusal;
};

class Mapper {
 public:
  explicit Mapper(ExtentMap& map) : map_(map) {}

  MapOutcome Map(const std::string& relative) {
    MapOutcome out;
    const std::string full = (fs::path(map_.root) / relative).string();
    // Looked at before it is opened: sockets cannot be opened, and devices and FIFOs should not be.
    struct stat first {};
    if (stat(full.c_str(), &first) != 0) ThrowIoError(errno, "stat", full);
    if (!S_ISREG(first.st_mode)) {
      out.refusal = "not a regular file";
      return out;
    }
    int fd;
    do {
      fd = open(full.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) ThrowIoError(errno, "open", full);
    struct CloseFd {
      int fd;
      ~CloseFd() { close(fd); }
    } closer{fd};
    struct stat before {};
    if (fstat(fd, &before) != 0) ThrowIoError(errno, "fstat", full);
    if (!S_ISREG(before.st_mode)) {
      out.refusal = "not a regular file";
      return out;
    }
    auto device = DeviceIndex(before.st_dev, fd);
    if (!device) {
      out.refusal = devices_[before.st_dev].refusal;
      return out;
    }
    const MappedDevice& d = map_.devices[*device];
    if (d.filesystem == "xfs") {
      if (std::string why = XfsRefusal(fd); !why.empty()) {
        out.refusal = why;
        return out;
      }
    }
    const auto size = static_cast<uint64_t>(before.st_size);
    FileExtents extents =
        ReadExtents(fd, full, size, std::max<uint64_t>(d.block_size, kSectorBytes));
    if (!extents.refusal.empty()) {
      out.refusal = extents.refusal;
      return out;
    }
    const uint64_t checksum = ContentChecksum(fd, full, size);
    struct stat after {};
    if (fstat(fd, &after) != 0) ThrowIoError(errno, "fstat", full);
    if (IdentityOf(after) != IdentityOf(before)) {
      out.refusal = "changed while being mapped";
      return out;
    }
    out.file =
        MappedFile{relative, *device, IdentityOf(before), std::move(extents.extents), checksum};
    return out;
  }

 private:
  // The index of `dev`'s entry in map_.devices (added on first sight), or nothing when files on
  // it cannot be mapped (devices_[dev].refusal says why).
  std::optional<uint32_t> DeviceIndex(dev_t dev, int fd) {
    auto [it, inserted] = devices_.try_emplace(dev);
    if (inserted) {
      DeviceLookup lookup = LookUpDevice(dev, fd);
      it->second.refusal = lookup.refusal;
      if (lookup.device) {
        it->second.index = static_cast<uint32_t>(map_.devices.size());
        map_.devices.push_back(std::move(*lookup.device));
      }
    }
    return it->second.index;
  }

  struct Known {
    std::optional<uint32_t> index;
    std::string refusal;
  };
  ExtentMap& map_;
  std::map<dev_t, Known> devices_;
};

std::string Absolute(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  if (ec) ThrowIoError(ec.value(), "resolve", path);
  return p.lexically_normal().string();
}

// `path` relative to `root` (both normalised), or nothing when it is not under it.
std::optional<std::string> RelativeTo(const std::string& root, std::string_view path) {
  fs::path p = fs::path(path).is_absolute() ? fs::path(path) : fs::path(root) / fs::path(path);
  fs::path rel = p.lexically_normal().lexically_relative(root);
  std::string s = rel.generic_string();
  if (s.empty() || s == "." || s == ".." || s.starts_with("../")) return std::nullopt;
  return s;
}

void ThrowRefused(const std::vector<RefusedFile>& refused) {
  std::string list;
  const size_t shown = std::min<size_t>(refused.size(), 10);
  for (size_t i = 0; i < shown; ++i) {
    list += StrCat(i == 0 ? "" : "; ", refused[i].path, ": ", refused[i].reason);
  }
  if (refused.size() > shown) list += StrCat("; and ", refused.size() - shown, " more");
  throw IoError(
      EOPNOTSUPP,
      StrCat("map (", refused.size(), refused.size() == 1 ? " file" : " files",
             " cannot be read from the device: ", list, "; allow refused files to map the rest)"),
      refused.front().path, 0, 0);
}

ExtentMap BuildFrom(const std::string& root, std::vector<std::string> relative,
                    const BuildOptions& options) {
  ExtentMap map;
  map.root = root;
  Mapper mapper(map);
  for (const std::string& rel : relative) {
    MapOutcome outcome = mapper.Map(rel);
    if (outcome.file) {
      map.files.push_back(std::move(*outcome.file));
    } else {
      map.refused.push_back({rel, outcome.refusal});
    }
  }
  if (!map.refused.empty() && !options.allow_refused) ThrowRefused(map.refused);
  return map;
}

}  // namespace

std::string DevicePlacementChange(const MappedDevice& d) {
  const fs::path link = StrCat("/sys/dev/block/", d.major, ":", d.minor);
  std::error_code ec;
  const fs::path dir = fs::canonical(link, ec);
  fs::path disk_dir;
  uint64_t offset = 0;
  if (ec || !PartitionPlacement(dir, &disk_dir, &offset)) {
    return StrCat("device ", d.major, ":", d.minor, " is not in ", link.string());
  }
  auto numbers = ReadSysfs(disk_dir / "dev");
  auto parsed = numbers ? ParseDevNumbers(*numbers) : std::nullopt;
  if (!parsed || parsed->first != d.disk_major || parsed->second != d.disk_minor ||
      offset != d.partition_offset) {
    return StrCat("device ", d.major, ":", d.minor, " lies on disk ",
                  parsed ? StrCat(parsed->first, ":", parsed->second) : std::string("?"), " at ",
                  offset, ", not on ", d.disk_major, ":", d.disk_minor, " at ", d.partition_offset,
                  " as the map says");
  }
  return "";
}

std::optional<uint64_t> DeviceBytes(const MappedDevice& d) {
  auto sectors = ReadSysfs(StrCat("/sys/dev/block/", d.major, ":", d.minor, "/size"));
  auto parsed = sectors ? ParseDecimal(*sectors) : std::nullopt;
  if (!parsed || *parsed > UINT64_MAX / kSectorBytes) return std::nullopt;
  return *parsed * kSectorBytes;  // sysfs counts 512-byte sectors whatever the device's block size
}

void AppendExtent(std::vector<FileExtent>& out, const FileExtent& x) {
  if (x.length == 0) throw FormatError(StrCat("empty extent at file offset ", x.logical));
  if (x.length > UINT64_MAX - x.logical || x.length > UINT64_MAX - x.physical) {
    throw FormatError(StrCat("extent at file offset ", x.logical, " overflows"));
  }
  if (!out.empty()) {
    FileExtent& prev = out.back();
    const uint64_t prev_end = prev.logical + prev.length;
    if (x.logical < prev_end) {
      throw FormatError(StrCat("extent at file offset ", x.logical, " overlaps the previous one"));
    }
    if (x.logical == prev_end && x.physical == prev.physical + prev.length) {
      prev.length += x.length;
      return;
    }
  }
  out.push_back(x);
}

std::string RefusalReason(uint32_t flags) {
  // Each of these says the blocks FIEMAP reports do not hold the file's bytes as they read:
  // - UNWRITTEN: allocated but never written (fallocate); the file reads zeros there while the
  //   disk holds whatever was there before.
  if (flags & FIEMAP_EXTENT_UNWRITTEN) return "unwritten (preallocated) blocks";
  // - DELALLOC / UNKNOWN: no location yet (FIEMAP_FLAG_SYNC should have settled it; a file being
  //   written meanwhile can still show them).
  if (flags & FIEMAP_EXTENT_DELALLOC) return "delayed allocation (no blocks on the device yet)";
  if (flags & FIEMAP_EXTENT_UNKNOWN) return "location unknown to the filesystem";
  // - ENCODED / DATA_ENCRYPTED: the disk holds compressed or encrypted bytes, not the file's.
  if (flags & FIEMAP_EXTENT_DATA_ENCRYPTED) return "encrypted data";
  if (flags & FIEMAP_EXTENT_ENCODED) return "encoded (compressed) data";
  // - DATA_INLINE / DATA_TAIL / NOT_ALIGNED: the bytes are packed inside metadata blocks (ext4
  //   inline data, tail packing) at offsets O_DIRECT cannot read, next to other files' bytes.
  if (flags & FIEMAP_EXTENT_DATA_INLINE) return "data stored inline in the inode";
  if (flags & FIEMAP_EXTENT_DATA_TAIL) return "data packed into a shared tail block";
  if (flags & FIEMAP_EXTENT_NOT_ALIGNED) return "data not aligned to blocks";
  // - SHARED: blocks owned by several files (reflinks, deduplication). Deduplication tools remap
  //   such files to other blocks without changing their times, so a file's identity could not
  //   tell that its extents moved.
  if (flags & FIEMAP_EXTENT_SHARED) return "shared (reflinked or deduplicated) blocks";
  return "";
}

std::string ExtentMap::FullPath(size_t index) const {
  return (fs::path(root) / files.at(index).path).string();
}

std::optional<size_t> ExtentMap::Find(std::string_view path) const {
  auto rel = RelativeTo(root, path);
  if (!rel) return std::nullopt;
  auto it = std::lower_bound(files.begin(), files.end(), *rel,
                             [](const MappedFile& f, const std::string& p) { return f.path < p; });
  if (it != files.end() && it->path == *rel) return static_cast<size_t>(it - files.begin());
  return std::nullopt;
}

namespace {

// Whether `path` is the file `leave_out` names: the same path, or the same file reached another
// way (the root or the map named through a symbolic link).
bool IsLeftOut(const fs::path& path, const fs::path& leave_out) {
  if (path.lexically_normal() == leave_out) return true;
  if (path.filename() != leave_out.filename()) return false;  // a stat only for likely ones
  struct stat a{}, b{};
  return stat(path.c_str(), &a) == 0 && stat(leave_out.c_str(), &b) == 0 && a.st_dev == b.st_dev &&
         a.st_ino == b.st_ino;
}

}  // namespace

ExtentMap BuildExtentMap(const std::string& root, const BuildOptions& options) {
  const std::string abs_root = Absolute(root);
  std::error_code ec;
  if (!fs::is_directory(abs_root, ec)) ThrowIoError(ec ? ec.value() : ENOTDIR, "map", abs_root);
  std::vector<std::string> relative;
  fs::recursive_directory_iterator it(abs_root, fs::directory_options::none, ec);
  if (ec) ThrowIoError(ec.value(), "list", abs_root);
  // The directory the next step opens or reads: a failed step names it, not the root (the
  // iterator is at its end by then).
  std::string listing = abs_root;
  const fs::path leave_out = options.leave_out.empty()
                                 ? fs::path()
                                 : fs::path(Absolute(options.leave_out)).lexically_normal();
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) break;
    // Directories are walked (symbolic links to them are not: no cycles); everything else is
    // listed, and Mapper refuses what is not a regular file.
    std::error_code type_error;
    if (it->is_directory(type_error)) {
      listing = it->path().string();
      continue;
    }
    listing = it->path().parent_path().string();
    if (!leave_out.empty() && IsLeftOut(it->path(), leave_out)) continue;
    relative.push_back(fs::path(it->path()).lexically_relative(abs_root).generic_string());
  }
  if (ec) ThrowIoError(ec.value(), "list", listing);
  std::sort(relative.begin(), relative.end());
  return BuildFrom(abs_root, std::move(relative), options);
}

ExtentMap BuildExtentMap(const std::string& root, std::span<const std::string> paths,
                         const BuildOptions& options) {
  const std::string abs_root = Absolute(root);
  std::vector<std::string> relative;
  std::set<std::string> seen;
  for (const std::string& p : paths) {
    auto rel = RelativeTo(abs_root, p);
    if (!rel) throw std::invalid_argument(StrCat("'", p, "' is not under the root ", abs_root));
    if (!seen.insert(*rel).second) {
      throw std::invalid_argument(StrCat("'", p, "' is listed twice"));
    }
    relative.push_back(std::move(*rel));
  }
  std::sort(relative.begin(), relative.end());
  return BuildFrom(abs_root, std::move(relative), options);
}

std::optional<FileIdentity> StatIdentity(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return std::nullopt;
    ThrowIoError(errno, "stat", path);
  }
  if (!S_ISREG(st.st_mode)) return std::nullopt;
  return IdentityOf(st);
}

std::vector<ChangedFile> VerifyExtentMap(const ExtentMap& map) {
  std::vector<ChangedFile> changed;
  ExtentMap scratch;
  scratch.root = map.root;
  Mapper mapper(scratch);
  for (size_t i = 0; i < map.files.size(); ++i) {
    const MappedFile& f = map.files[i];
    const std::string full = map.FullPath(i);
    auto now = StatIdentity(full);
    if (!now) {
      changed.push_back({f.path, "missing, or no longer a regular file"});
      continue;
    }
    if (*now != f.identity) {
      changed.push_back({f.path, DescribeChange(f.identity, *now)});
      continue;
    }
    MapOutcome outcome;
    try {
      outcome = mapper.Map(f.path);
    } catch (const IoError& e) {
      if (e.error_code() != ENOENT) throw;
      changed.push_back({f.path, "missing"});
      continue;
    }
    if (!outcome.file) {
      changed.push_back({f.path, StrCat("no longer mappable: ", outcome.refusal)});
      continue;
    }
    const MappedDevice& was = map.devices.at(f.device);
    const MappedDevice& is = scratch.devices.at(outcome.file->device);
    if (was.disk != is.disk || was.disk_major != is.disk_major || was.disk_minor != is.disk_minor ||
        was.partition_offset != is.partition_offset) {
      changed.push_back({f.path, StrCat("device moved: ", was.disk, " at ", was.partition_offset,
                                        " -> ", is.disk, " at ", is.partition_offset)});
    } else if (outcome.file->identity != f.identity) {
      changed.push_back({f.path, DescribeChange(f.identity, outcome.file->identity)});
    } else if (outcome.file->extents != f.extents) {
      changed.push_back({f.path, "extents differ (the file's blocks moved)"});
    } else if (f.xxh64 && outcome.file->xxh64 != f.xxh64) {
      changed.push_back({f.path, "content differs from the map's checksum"});
    }
  }
  return changed;
}

}  // namespace tensortier
