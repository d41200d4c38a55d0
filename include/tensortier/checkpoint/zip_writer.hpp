// Layout of a stored (uncompressed) zip archive whose entry data starts on aligned offsets, as
// torch.save writes it (torch pads the local header's extra field; so do we). The planner only
// computes bytes and offsets: the caller writes each entry's data at data_offset (with the engine)
// and the header bytes at their offsets, so no data is ever staged through the planner.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

namespace tensortier {

struct ZipPlanEntry {
  std::string name;
  uint64_t size = 0;
  uint32_t crc32 = 0;
  uint64_t local_header_offset = 0;
  uint64_t data_offset = 0;
  bool zip64 = false;  // sizes or offset need zip64 fields
};

// Not thread-safe. Entries are laid out in the order added.
class ZipPlanner {
 public:
  // `alignment`: power of two >= 1 for every entry's data offset. `force_zip64`: zip64 records
  // even when nothing needs them (tests; readers must accept both).
  explicit ZipPlanner(uint64_t alignment = 64, bool force_zip64 = false);

  // Plans an entry of `size` bytes; returns its index. `alignment` (0: the planner's) applies to
  // this entry's data at `base` + its offset: an archive stored at offset `base` of a larger file
  // aligns its data in that file. Throws std::invalid_argument for names longer than 65535
  // bytes, duplicates or a bad alignment.
  size_t Add(const std::string& name, uint64_t size, uint64_t alignment = 0, uint64_t base = 0);
  // The CRC-32 of entry `index`'s data (needed before LocalHeader() and Directory()).
  void SetCrc(size_t index, uint32_t crc);

  const std::vector<ZipPlanEntry>& entries() const { return entries_; }
  // The bytes of entry `index`'s local header: written at local_header_offset, they end at
  // data_offset.
  std::string LocalHeader(size_t index) const;
  // Where the central directory goes: right after the last entry's data.
  uint64_t directory_offset() const { return end_; }
  // Central directory and end records; written at directory_offset(), they end the file.
  std::string Directory() const;

 private:
  uint64_t alignment_;
  bool force_zip64_;
  uint64_t end_ = 0;
  std::vector<ZipPlanEntry> entries_;
  std::unordered_set<std::string> names_;  // duplicates found in constant time, not by a scan
};

}  // namespace tensortier
