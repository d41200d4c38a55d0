// The JSON form of an extent map (docs/extents.md), and its checks: a map comes from a
// file anyone may have edited, and its offsets become reads of a raw device.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>

#include "tensortier/util/error.hpp"
#include "tensortier/data/extent_map.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kFormat = "tensortier extent map";
constexpr uint64_t kMaxOffset = static_cast<uint64_t>(INT64_MAX);
constexpr uint64_t kMaxBlockSize = 1 << 20;
// A map file is read whole into memory; this bounds what a stray path can make us read
// (ImageNet's 1.28 M files make ~250 MB).
constexpr uint64_t kMaxMapBytes = uint64_t{16} << 30;

class MapParser {
 public:
  MapParser(std::string_view text, const std::string& what) : text_(text), r_(text, what) {}

  ExtentMap Parse() {
    ExtentMap map;
    Object("the map",
           [&](const std::string& key) {
             if (key == "format") {
               if (String(key) != kFormat) r_.Fail(StrCat("format is not '", kFormat, "'"));
             } else if (key == "version") {
               const uint64_t v = r_.ReadUint();
               if (v != ExtentMap::kVersion) {
                 r_.Fail(StrCat("version ", v, " (this tensortier reads version ",
                                ExtentMap::kVersion, ")"));
               }
             } else if (key == "root") {
               map.root = Path(key);
               if (!fs::path(map.root).is_absolute() ||
                   fs::path(map.root).lexically_normal().string() != map.root ||
                   map.root.find('\0') != std::string::npos) {
                 r_.Fail("root is not a normalised absolute path");
               }
             } else if (key == "devices") {
               Array([&] { map.devices.push_back(Device()); });
             } else if (key == "files") {
               Array([&] { map.files.push_back(File(map)); });
             } else if (key == "refused") {
               Array([&] { map.refused.push_back(Refused()); });
             } else {
               return false;
             }
             return true;
           },
           {"format", "version", "root", "devices", "files"});
    r_.ExpectEnd();
    // Sorted by path, each once: ExtentMap::Find searches by halves.
    for (size_t i = 1; i < map.files.size(); ++i) {
      if (map.files[i].path <= map.files[i - 1].path) {
        r_.Fail(StrCat("file ", JsonQuoteBytes(map.files[i].path),
                       " is out of order or listed twice (files are sorted by path)"));
      }
    }
    return map;
  }

 private:
  // Reads an object, calling `member` for each key (which returns false for keys it does not
  // know). Duplicate keys and missing `required` keys are errors.
  void Object(const std::string& what, const std::function<bool(const std::string&)>& member,
              std::initializer_list<std::string_view> required) {
    if (r_.Peek() != '{') r_.Fail(StrCat(what, " is not an object"));
    r_.Expect('{');
    std::set<std::string> seen;
    if (!r_.Consume('}')) {
      do {
        std::string key = r_.ReadString();
        r_.Expect(':');
        if (!seen.insert(key).second) r_.Fail(StrCat(what, ": key '", key, "' appears twice"));
        if (!member(key)) r_.Fail(StrCat(what, ": unknown key '", key, "'"));
      } while (r_.Consume(','));
      r_.Expect('}');
    }
    for (std::string_view k : required) {
      if (!seen.contains(std::string(k))) r_.Fail(StrCat(what, ": missing key '", k, "'"));
    }
  }

  void Array(const std::function<void()>& element) {
    r_.Expect('[');
    if (r_.Consume(']')) return;
    do {
      element();
    } while (r_.Consume(','));
    r_.Expect(']');
  }

  std::string String(const std::string& key) {
    if (r_.Peek() != '"') r_.Fail(StrCat(key, " is not a string"));
    return r_.ReadString();
  }

  // A file name: any bytes, those that are not UTF-8 written \udcXX (JsonStrings::kBytes).
  std::string Path(const std::string& key) {
    if (r_.Peek() != '"') r_.Fail(StrCat(key, " is not a string"));
    return r_.ReadString(JsonStrings::kBytes);
  }

  uint64_t Uint(const std::string& key, uint64_t max = kMaxOffset) {
    const uint64_t v = r_.ReadUint();
    if (v > max) r_.Fail(StrCat(key, " ", v, " is larger than ", max));
    return v;
  }

  // 64 bits as 16 hexadecimal digits in a string (JSON numbers past 2^53 lose bits elsewhere).
  uint64_t Hex64(const std::string& key) {
    const std::string text = String(key);
    uint64_t v = 0;
    bool ok = text.size() == 16;
    for (char c : text) {
      if (c >= '0' && c <= '9') {
        v = v << 4 | static_cast<uint64_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v = v << 4 | static_cast<uint64_t>(c - 'a' + 10);
      } else {
        ok = false;
      }
    }
    if (!ok) r_.Fail(StrCat(key, " '", text, "' is not 16 lowercase hexadecimal digits"));
    return v;
  }

  // A signed integer: '-' directly followed by the digits ReadUint takes.
  int64_t Int(const std::string& key) {
    if (r_.Peek() == '-') {
      r_.Expect('-');
      const size_t at = r_.position();
      if (at >= text_.size() || text_[at] < '0' || text_[at] > '9') {
        r_.Fail(StrCat(key, ": expected digits after '-'"));
      }
      const uint64_t v = r_.ReadUint();
      if (v > kMaxOffset + 1) r_.Fail(StrCat(key, " does not fit in 64 bits"));
      return v == kMaxOffset + 1 ? INT64_MIN : -static_cast<int64_t>(v);
    }
    return static_cast<int64_t>(Uint(key));
  }

  MappedDevice Device() {
    MappedDevice d;
    Object("a device",
           [&](const std::string& key) {
             if (key == "major")
               d.major = Uint(key, UINT32_MAX);
             else if (key == "minor")
               d.minor = Uint(key, UINT32_MAX);
             else if (key == "disk")
               d.disk = String(key);
             else if (key == "disk_major")
               d.disk_major = Uint(key, UINT32_MAX);
             else if (key == "disk_minor")
               d.disk_minor = Uint(key, UINT32_MAX);
             else if (key == "partition_offset")
               d.partition_offset = Uint(key);
             else if (key == "filesystem")
               d.filesystem = String(key);
             else if (key == "block_size")
               d.block_size = Uint(key, kMaxBlockSize);
             else
               return false;
             return true;
           },
           {"major", "minor", "disk", "disk_major", "disk_minor", "partition_offset", "filesystem",
            "block_size"});
    if (!d.disk.starts_with("/dev/") || d.disk.find('\0') != std::string::npos) {
      r_.Fail(StrCat("device disk '", d.disk, "' is not a node under /dev"));
    }
    if (d.filesystem != "ext4" && d.filesystem != "xfs") {
      r_.Fail(StrCat("device filesystem '", d.filesystem, "' is not ext4 or xfs"));
    }
    if (d.block_size < kSectorBytes || (d.block_size & (d.block_size - 1)) != 0) {
      r_.Fail(StrCat("device block_size ", d.block_size, " is not a power of two >= 512"));
    }
    if (d.partition_offset % kSectorBytes != 0) {
      r_.Fail(StrCat("device partition_offset ", d.partition_offset, " is not whole sectors"));
    }
    return d;
  }

  static bool ValidRelativePath(const std::string& p) {
    if (p.empty() || p.front() == '/' || p.find('\0') != std::string::npos) return false;
    size_t begin = 0;
    while (begin <= p.size()) {
      size_t end = p.find('/', begin);
      if (end == std::string::npos) end = p.size();
      const std::string_view part(p.data() + begin, end - begin);
      if (part.empty() || part == "." || part == "..") return false;
      begin = end + 1;
    }
    return true;
  }

  MappedFile File(const ExtentMap& map) {
    MappedFile f;
    bool have_device = false;
    Object("a file",
           [&](const std::string& key) {
             if (key == "path") {
               f.path = Path(key);
             } else if (key == "device") {
               f.device = static_cast<uint32_t>(Uint(key, UINT32_MAX));
               have_device = true;
             } else if (key == "inode") {
               f.identity.inode = r_.ReadUint();
             } else if (key == "size") {
               f.identity.size = Uint(key);
             } else if (key == "mtime_ns") {
               f.identity.mtime_ns = Int(key);
             } else if (key == "ctime_ns") {
               f.identity.ctime_ns = Int(key);
             } else if (key == "xxh64") {
               f.xxh64 = Hex64(key);
             } else if (key == "extents") {
               Array([&] {
                 FileExtent x;
                 r_.Expect('[');
                 x.logical = Uint("extent logical offset");
                 r_.Expect(',');
                 x.physical = Uint("extent physical offset");
                 r_.Expect(',');
                 x.length = Uint("extent length");
                 r_.Expect(']');
                 f.extents.push_back(x);
               });
             } else {
               return false;
             }
             return true;
           },
           {"path", "device", "inode", "size", "mtime_ns", "ctime_ns", "extents"});
    const std::string name = StrCat("file ", JsonQuoteBytes(f.path));  // escaped: it may hold a NUL
    if (!ValidRelativePath(f.path)) {
      r_.Fail(StrCat(name, ": path is not relative to the root (or has '.', '..' or '//')"));
    }
    // Devices come before files in maps we write; one that refers to a later device is refused.
    if (!have_device || f.device >= map.devices.size()) {
      r_.Fail(StrCat(name, ": device ", f.device, " is not one of the ", map.devices.size(),
                     " listed before it"));
    }
    const MappedDevice& d = map.devices[f.device];
    f.identity.major = d.major;
    f.identity.minor = d.minor;
    CheckExtents(name, f, d);
    return f;
  }

  // The extents must cover [0, size) in order without gaps or overlaps, end within the last
  // block, lie on whole sectors, and stay inside 63-bit offsets on the disk (partition included).
  void CheckExtents(const std::string& name, const MappedFile& f, const MappedDevice& d) {
    const uint64_t size = f.identity.size;
    uint64_t covered = 0;
    for (const FileExtent& x : f.extents) {
      const std::string at = StrCat(name, ": extent at file offset ", x.logical);
      if (x.logical != covered) {
        r_.Fail(StrCat(at, ": expected one at ", covered, " (extents must follow each other)"));
      }
      if (x.length == 0 || x.length % kSectorBytes != 0 || x.physical % kSectorBytes != 0) {
        r_.Fail(StrCat(at, ": physical offset and length must be whole sectors, length > 0"));
      }
      if (x.logical >= size) r_.Fail(StrCat(at, ": starts at or past the file's size ", size));
      if (x.length > kMaxOffset - x.logical || x.length > kMaxOffset - x.physical ||
          x.physical + x.length > kMaxOffset - d.partition_offset) {
        r_.Fail(StrCat(at, ": its end overflows"));
      }
      covered = x.logical + x.length;
    }
    if (covered < size) r_.Fail(StrCat(name, ": extents cover ", covered, " of ", size, " bytes"));
    if (covered - size >= d.block_size) {
      r_.Fail(StrCat(name, ": extents run ", covered - size, " bytes past the end of the file"));
    }
  }

  RefusedFile Refused() {
    RefusedFile f;
    Object("a refused file",
           [&](const std::string& key) {
             if (key == "path")
               f.path = Path(key);
             else if (key == "reason")
               f.reason = String(key);
             else
               return false;
             return true;
           },
           {"path", "reason"});
    if (!ValidRelativePath(f.path))
      r_.Fail(StrCat("refused file ", JsonQuoteBytes(f.path), ": bad path"));
    return f;
  }

  std::string_view text_;
  JsonReader r_;
};

}  // namespace

std::string ExtentMapToJson(const ExtentMap& map) {
  std::string out;
  out += StrCat("{\n  \"format\": ", JsonQuote(kFormat), ",\n  \"version\": ", ExtentMap::kVersion,
                ",\n  \"root\": ", JsonQuoteBytes(map.root), ",\n  \"devices\": [");
  for (size_t i = 0; i < map.devices.size(); ++i) {
    const MappedDevice& d = map.devices[i];
    out += StrCat(
        i == 0 ? "\n" : ",\n", "    {\"major\": ", d.major, ", \"minor\": ", d.minor,
        ", \"disk\": ", JsonQuote(d.disk), ", \"disk_major\": ", d.disk_major,
        ", \"disk_minor\": ", d.disk_minor, ", \"partition_offset\": ", d.partition_offset,
        ", \"filesystem\": ", JsonQuote(d.filesystem), ", \"block_size\": ", d.block_size, "}");
  }
  out += map.devices.empty() ? "],\n  \"files\": [" : "\n  ],\n  \"files\": [";
  for (size_t i = 0; i < map.files.size(); ++i) {
    const MappedFile& f = map.files[i];
    out += StrCat(i == 0 ? "\n" : ",\n", "    {\"path\": ", JsonQuoteBytes(f.path),
                  ", \"device\": ", f.device, ", \"inode\": ", f.identity.inode,
                  ", \"size\": ", f.identity.size, ", \"mtime_ns\": ", f.identity.mtime_ns,
                  ", \"ctime_ns\": ", f.identity.ctime_ns);
    if (f.xxh64) {
      char hex[17];
      std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(*f.xxh64));
      out += StrCat(", \"xxh64\": \"", hex, "\"");
    }
    out += ", \"extents\": [";
    for (size_t j = 0; j < f.extents.size(); ++j) {
      const FileExtent& x = f.extents[j];
      out += StrCat(j == 0 ? "[" : ", [", x.logical, ", ", x.physical, ", ", x.length, "]");
    }
    out += "]}";
  }
  out += map.files.empty() ? "],\n  \"refused\": [" : "\n  ],\n  \"refused\": [";
  for (size_t i = 0; i < map.refused.size(); ++i) {
    out += StrCat(i == 0 ? "\n" : ",\n", "    {\"path\": ", JsonQuoteBytes(map.refused[i].path),
                  ", \"reason\": ", JsonQuote(map.refused[i].reason), "}");
  }
  out += map.refused.empty() ? "]\n}\n" : "\n  ]\n}\n";
  return out;
}

ExtentMap ParseExtentMap(std::string_view json, const std::string& what) {
  return MapParser(json, what).Parse();
}

void SaveExtentMap(const ExtentMap& map, const std::string& path) {
  const std::string text = ExtentMapToJson(map);
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  // A temporary file in the same folder, renamed over the target once its bytes are durable:
  // a crash leaves the old map or the new one, never half of one.
  const std::string temp = CreateUniqueFile(
      [&](uint32_t n) {
        char suffix[9];
        std::snprintf(suffix, sizeof(suffix), "%08x", n);
        return (dir / StrCat(".", target.filename().string(), ".tmp-", getpid(), "-", suffix))
            .string();
      },
      0644, "create", path);
  try {
    tensortier::File f = tensortier::File::Open(temp, OpenMode::kReadWrite, false);
    for (size_t done = 0; done < text.size();) {
      const ssize_t n =
          pwrite(f.buffered_fd(), text.data() + done, text.size() - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) ThrowIoError(n < 0 ? errno : EIO, "write", temp, done, text.size() - done);
      done += static_cast<size_t>(n);
    }
    f.DataSync();
    // The error names the map the user asked for (a directory there, say), not the temporary.
    if (rename(temp.c_str(), path.c_str()) != 0) {
      ThrowIoError(errno, "save the extent map (renaming its temporary file into place)", path);
    }
  } catch (...) {
    unlink(temp.c_str());
    throw;
  }
}

ExtentMap LoadExtentMap(const std::string& path) {
  tensortier::File f = tensortier::File::Open(path, OpenMode::kRead, false);
  struct stat st {};
  if (fstat(f.buffered_fd(), &st) != 0) ThrowIoError(errno, "fstat", path);
  if (!S_ISREG(st.st_mode)) ThrowIoError(EINVAL, "load the extent map (not a regular file)", path);
  // Its offsets become reads of a raw disk with the reader's rights: only a map its user (or
  // root) owns and nobody else may change is trusted, as ssh trusts its keys.
  if (st.st_uid != geteuid() && st.st_uid != 0) {
    ThrowIoError(EPERM,
                 StrCat("load the extent map (owned by uid ", st.st_uid, ", not by this user (uid ",
                        geteuid(), ") or root: a map names disk blocks to read, so only its "
                        "user's own maps are trusted; rebuild it or chown it)"),
                 path);
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    ThrowIoError(EPERM,
                 StrCat("load the extent map (mode ", mode, ": writable by ",
                        (st.st_mode & S_IWOTH) != 0 ? "others" : "its group",
                        "; a map names disk blocks to read, so only one nobody else may change "
                        "is trusted: chmod go-w it)"),
                 path);
  }
  const uint64_t size = f.Size();
  if (size > kMaxMapBytes) {
    throw FormatError(StrCat(path, ": ", size, " bytes is too large for an extent map"));
  }
  std::string text(size, '\0');
  for (size_t done = 0; done < text.size();) {
    const ssize_t n =
        pread(f.buffered_fd(), text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) ThrowIoError(errno, "read", path, done, text.size() - done);
    if (n == 0) {
      text.resize(done);
      break;
    }
    done += static_cast<size_t>(n);
  }
  return ParseExtentMap(text, StrCat("extent map ", path));
}

}  // namespace tensortier
