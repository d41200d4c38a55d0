// The central directory of a zip archive, as torch.save writes it: where each entry's bytes start
// in the file, so stored (uncompressed) entries can be read in place by the engine.
//
// Reading is bounded: a backwards scan of at most 64 KiB + 22 bytes for the end record, zip64
// records followed only when present, every count, offset and size checked against the file size
// before anything is allocated or read. Compressed and encrypted entries are listed (their data
// offset is valid) but RequireStored() refuses them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"

namespace tensortier {

inline constexpr uint64_t kZipMaxEntries = 1u << 20;
inline constexpr uint64_t kZipMaxDirectoryBytes = 1ull << 30;

struct ZipEntry {
  std::string name;
  uint64_t central_header_offset = 0;  // its record in the central directory
  uint64_t local_header_offset = 0;
  uint64_t data_offset = 0;      // absolute file offset of the entry's (possibly compressed) bytes
  uint64_t compressed_size = 0;  // bytes at data_offset
  uint64_t size = 0;             // uncompressed size
  uint32_t crc32 = 0;
  uint16_t method = 0;  // 0: stored
  uint16_t flags = 0;   // bit 0: encrypted

  bool stored() const { return method == 0 && (flags & 1) == 0 && compressed_size == size; }
};

struct ZipDirectory {
  std::vector<ZipEntry> entries;  // in central directory order
  bool zip64 = false;             // the archive has zip64 end records
  uint64_t directory_offset = 0;  // where the central directory starts (entry data ends there)

  // The entry called `name`, or nullptr.
  const ZipEntry* Find(const std::string& name) const;
};

// Throws FormatError (message starting with source.name()) for anything that is not a valid,
// single-disk zip archive: no end record, truncation, bad signatures, ranges past the file,
// overlapping entries, duplicate names, counts over the limits above. IoError for read failures.
ZipDirectory ReadZipDirectory(const ByteSource& source);

// Throws FormatError naming the archive and entry unless `entry` is stored and unencrypted.
void RequireStored(const ZipEntry& entry, const std::string& archive);

}  // namespace tensortier
