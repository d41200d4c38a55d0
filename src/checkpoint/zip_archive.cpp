#include "tensortier/checkpoint/zip_archive.hpp"

#include <algorithm>
#include <cstring>
#include <set>
#include <string_view>

#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kEnd64Sig = 0x06064b50;
constexpr uint32_t kLocator64Sig = 0x07064b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kLocalSig = 0x04034b50;
constexpr size_t kEndSize = 22;
constexpr size_t kLocator64Size = 20;
constexpr size_t kEnd64Size = 56;
constexpr size_t kCentralSize = 46;
constexpr size_t kLocalSize = 30;
constexpr size_t kMaxComment = 65535;

uint16_t Le16(const unsigned char* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}
uint32_t Le32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
uint64_t Le64(const unsigned char* p) {
  return Le32(p) | (static_cast<uint64_t>(Le32(p + 4)) << 32);
}

class Parser {
 public:
  explicit Parser(const ByteSource& source) : src_(source), size_(source.size()) {}

  ZipDirectory Run() {
    FindEnd();
    ReadCentral();
    ReadLocals();
    CheckOverlaps();
    return std::move(dir_);
  }

 private:
  [[noreturn]] void Fail(std::string_view problem) const {
    throw FormatError(StrCat(src_.name(), ": zip archive: ", problem));
  }
  [[noreturn]] void FailEntry(const std::string& name, std::string_view problem) const {
    throw FormatError(StrCat(src_.name(), ": zip entry '", name, "': ", problem));
  }

  void FindEnd() {
    if (size_ < kEndSize) Fail(StrCat("not a zip file (", size_, " bytes, no end record)"));
    uint64_t tail_len = std::min<uint64_t>(size_, kEndSize + kMaxComment);
    uint64_t tail_start = size_ - tail_len;
    std::vector<unsigned char> tail(tail_len);
    src_.ReadAt(tail_start, tail.data(), tail.size());
    // Backwards: the last record whose comment reaches exactly the end of the file. A signature
    // inside a comment cannot satisfy that unless the comment was forged to, which is harmless.
    int64_t found = -1;
    for (int64_t i = static_cast<int64_t>(tail_len - kEndSize); i >= 0; --i) {
      const unsigned char* p = tail.data() + i;
      if (Le32(p) == kEndSig && i + kEndSize + Le16(p + 20) == tail_len) {
        found = i;
        break;
      }
    }
    if (found < 0) {
      Fail("no end of central directory record (not a zip file, or truncated)");
    }
    const unsigned char* e = tail.data() + found;
    end_offset_ = tail_start + static_cast<uint64_t>(found);
    uint16_t disk = Le16(e + 4), cd_disk = Le16(e + 6);
    uint64_t disk_entries = Le16(e + 8);
    entries_ = Le16(e + 10);
    cd_size_ = Le32(e + 12);
    cd_offset_ = Le32(e + 16);
    uint64_t limit = end_offset_;  // the central directory ends where the end records start

    bool has_locator = false;
    unsigned char loc[kLocator64Size];
    if (end_offset_ >= kLocator64Size) {
      src_.ReadAt(end_offset_ - kLocator64Size, loc, sizeof(loc));
      has_locator = Le32(loc) == kLocator64Sig;
    }
    bool saturated = disk == 0xFFFF || cd_disk == 0xFFFF || disk_entries == 0xFFFF ||
                     entries_ == 0xFFFF || cd_size_ == 0xFFFFFFFF || cd_offset_ == 0xFFFFFFFF;
    if (saturated && !has_locator) {
      Fail("end record needs zip64 values but there is no zip64 end of central directory locator");
    }
    if (has_locator) {
      dir_.zip64 = true;
      uint32_t end64_disk = Le32(loc + 4);
      uint64_t end64_offset = Le64(loc + 8);
      uint32_t disks = Le32(loc + 16);
      if (end64_disk != 0 || disks > 1) Fail("multi-disk archives are not supported");
      uint64_t locator_offset = end_offset_ - kLocator64Size;
      if (end64_offset > locator_offset || locator_offset - end64_offset < kEnd64Size) {
        Fail(StrCat("zip64 end record offset ", end64_offset, " is outside the file"));
      }
      unsigned char r[kEnd64Size];
      src_.ReadAt(end64_offset, r, sizeof(r));
      if (Le32(r) != kEnd64Sig) Fail(StrCat("no zip64 end record at offset ", end64_offset));
      uint64_t record_size = Le64(r + 4);
      if (record_size < kEnd64Size - 12 || record_size > locator_offset - end64_offset - 12) {
        Fail(StrCat("zip64 end record size ", record_size, " is invalid"));
      }
      disk = Le32(r + 16) == 0 ? 0 : 1;
      cd_disk = Le32(r + 20) == 0 ? 0 : 1;
      disk_entries = Le64(r + 24);
      entries_ = Le64(r + 32);
      cd_size_ = Le64(r + 40);
      cd_offset_ = Le64(r + 48);
      limit = end64_offset;
    }
    if (disk != 0 || cd_disk != 0 || disk_entries != entries_) {
      Fail("multi-disk archives are not supported");
    }
    if (entries_ > kZipMaxEntries) {
      Fail(StrCat(entries_, " entries, more than the limit of ", kZipMaxEntries));
    }
    if (cd_offset_ > limit || cd_size_ > limit - cd_offset_) {
      Fail(StrCat("central directory [", cd_offset_, ", +", cd_size_, ") is outside the file (",
                  limit, " bytes before the end records)"));
    }
    if (cd_size_ > kZipMaxDirectoryBytes) Fail(StrCat("central directory of ", cd_size_, " bytes"));
    if (entries_ > cd_size_ / kCentralSize) {
      Fail(StrCat(entries_, " entries cannot fit in a central directory of ", cd_size_, " bytes"));
    }
    dir_.directory_offset = cd_offset_;
  }

  void ReadCentral() {
    std::vector<unsigned char> cd(cd_size_);
    src_.ReadAt(cd_offset_, cd.data(), cd.size());
    std::set<std::string_view> names;
    dir_.entries.reserve(entries_);
    size_t pos = 0;
    for (uint64_t i = 0; i < entries_; ++i) {
      if (cd.size() - pos < kCentralSize || Le32(cd.data() + pos) != kCentralSig) {
        Fail(StrCat("bad central directory record ", i, " at offset ", cd_offset_ + pos));
      }
      const unsigned char* c = cd.data() + pos;
      ZipEntry e;
      e.central_header_offset = cd_offset_ + pos;
      e.flags = Le16(c + 8);
      e.method = Le16(c + 10);
      e.crc32 = Le32(c + 16);
      e.compressed_size = Le32(c + 20);
      e.size = Le32(c + 24);
      size_t name_len = Le16(c + 28), extra_len = Le16(c + 30), comment_len = Le16(c + 32);
      uint32_t disk_start = Le16(c + 34);
      e.local_header_offset = Le32(c + 42);
      size_t record = kCentralSize + name_len + extra_len + comment_len;
      if (cd.size() - pos < record) {
        Fail(StrCat("central directory record ", i, " runs past the central directory"));
      }
      e.name.assign(reinterpret_cast<const char*>(c + kCentralSize), name_len);
      ApplyZip64Extra(e, c + kCentralSize + name_len, extra_len, disk_start);
      if (disk_start != 0) FailEntry(e.name, "starts on another disk (multi-disk archive)");
      pos += record;
      dir_.entries.push_back(std::move(e));
    }
    if (pos != cd.size()) {
      Fail(StrCat("central directory has ", cd.size() - pos, " bytes after its ", entries_,
                  " records"));
    }
    for (const auto& e : dir_.entries) {
      if (!names.insert(e.name).second) FailEntry(e.name, "appears twice");
    }
  }

  // Replaces saturated 32-bit fields by their zip64 extended-information values (extra field id
  // 1), which come in a fixed order and only for the fields that are saturated.
  void ApplyZip64Extra(ZipEntry& e, const unsigned char* extra, size_t len, uint32_t& disk) {
    bool need_size = e.size == 0xFFFFFFFF, need_csize = e.compressed_size == 0xFFFFFFFF;
    bool need_offset = e.local_header_offset == 0xFFFFFFFF, need_disk = disk == 0xFFFF;
    if (!need_size && !need_csize && !need_offset && !need_disk) return;
    for (size_t p = 0; p + 4 <= len;) {
      uint16_t id = Le16(extra + p), block = Le16(extra + p + 2);
      if (block > len - p - 4) FailEntry(e.name, "extra field runs past its record");
      if (id == 1) {
        const unsigned char* v = extra + p + 4;
        size_t left = block;
        auto take = [&](uint64_t& field, size_t bytes) {
          if (left < bytes) FailEntry(e.name, "zip64 extra field is too short");
          field = bytes == 8 ? Le64(v) : Le32(v);
          v += bytes, left -= bytes;
        };
        uint64_t d = disk;
        if (need_size) take(e.size, 8);
        if (need_csize) take(e.compressed_size, 8);
        if (need_offset) take(e.local_header_offset, 8);
        if (need_disk) take(d, 4);
        disk = static_cast<uint32_t>(d);
        return;
      }
      p += 4 + block;
    }
    FailEntry(e.name, "sizes or offset need a zip64 extra field and there is none");
  }

  void ReadLocals() {
    std::vector<unsigned char> buf;
    for (ZipEntry& e : dir_.entries) {
      uint64_t off = e.local_header_offset;
      if (off > cd_offset_ || cd_offset_ - off < kLocalSize + e.name.size()) {
        FailEntry(e.name, StrCat("local header offset ", off,
                                 " is not before the central directory at ", cd_offset_));
      }
      buf.resize(kLocalSize + e.name.size());
      src_.ReadAt(off, buf.data(), buf.size());
      if (Le32(buf.data()) != kLocalSig) FailEntry(e.name, StrCat("no local header at ", off));
      uint16_t name_len = Le16(buf.data() + 26), extra_len = Le16(buf.data() + 28);
      if (name_len != e.name.size() ||
          std::memcmp(buf.data() + kLocalSize, e.name.data(), name_len) != 0) {
        FailEntry(e.name, "local header names a different entry");
      }
      if (Le16(buf.data() + 8) != e.method) {
        FailEntry(e.name, "local header and central directory disagree on the method");
      }
      e.data_offset = off + kLocalSize + name_len + extra_len;
      if (e.data_offset > cd_offset_ || e.compressed_size > cd_offset_ - e.data_offset) {
        FailEntry(e.name, StrCat("data [", e.data_offset, ", +", e.compressed_size,
                                 ") runs into the central directory at ", cd_offset_));
      }
    }
  }

  // Entries whose bytes overlap are how zip bombs and parser confusion start; torch never
  // writes them.
  void CheckOverlaps() {
    std::vector<const ZipEntry*> order;
    order.reserve(dir_.entries.size());
    for (const auto& e : dir_.entries) order.push_back(&e);
    std::sort(order.begin(), order.end(), [](const ZipEntry* a, const ZipEntry* b) {
      return a->local_header_offset < b->local_header_offset;
    });
    for (size_t i = 1; i < order.size(); ++i) {
      const ZipEntry* prev = order[i - 1];
      if (order[i]->local_header_offset < prev->data_offset + prev->compressed_size) {
        FailEntry(order[i]->name, StrCat("overlaps entry '", prev->name, "'"));
      }
    }
  }

  const ByteSource& src_;
  uint64_t size_;
  uint64_t end_offset_ = 0;
  uint64_t entries_ = 0;
  uint64_t cd_size_ = 0;
  uint64_t cd_offset_ = 0;
  ZipDirectory dir_;
};

}  // namespace

const ZipEntry* ZipDirectory::Find(const std::string& name) const {
  for (const auto& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

ZipDirectory ReadZipDirectory(const ByteSource& source) {
  return Parser(source).Run();
}

void RequireStored(const ZipEntry& entry, const std::string& archive) {
  if (entry.flags & 1) {
    throw FormatError(StrCat(archive, ": zip entry '", entry.name,
                             "' is encrypted; tensortier reads only stored, unencrypted entries"));
  }
  if (entry.method != 0) {
    throw FormatError(StrCat(archive, ": zip entry '", entry.name, "' is compressed (method ",
                             entry.method,
                             "); torch.save stores entries uncompressed and tensortier reads only "
                             "those"));
  }
  // Stored, yet the directory gives two sizes: one of them is damaged.
  if (entry.compressed_size != entry.size) {
    throw FormatError(StrCat(archive, ": zip entry '", entry.name,
                             "' is stored (method 0, uncompressed) but the directory gives it ",
                             entry.compressed_size, " bytes in the file and ", entry.size,
                             " bytes of data: the archive is damaged"));
  }
}

}  // namespace tensortier
