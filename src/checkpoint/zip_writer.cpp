#include "tensortier/checkpoint/zip_writer.hpp"

#include <bit>
#include <stdexcept>

#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr uint64_t kMax32 = 0xFFFFFFFF;
constexpr uint16_t kPaddingId = 0x4246;  // "FB": the padding field torch's writer uses
constexpr uint16_t kVersionZip64 = 45;
constexpr uint16_t kVersionStored = 20;
constexpr uint16_t kDosDate1980 = (0 << 9) | (1 << 5) | 1;  // 1980-01-01: deterministic files

void Put16(std::string& s, uint64_t v) {
  for (int i = 0; i < 2; ++i) s += static_cast<char>((v >> (8 * i)) & 0xFF);
}
void Put32(std::string& s, uint64_t v) {
  for (int i = 0; i < 4; ++i) s += static_cast<char>((v >> (8 * i)) & 0xFF);
}
void Put64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s += static_cast<char>((v >> (8 * i)) & 0xFF);
}

// Local header size without padding: zip64 entries carry sizes in an extra field (4 + 16 bytes).
uint64_t LocalFixed(const ZipPlanEntry& e) {
  return 30 + e.name.size() + (e.zip64 ? 20 : 0);
}

}  // namespace

ZipPlanner::ZipPlanner(uint64_t alignment, bool force_zip64)
    : alignment_(alignment), force_zip64_(force_zip64) {
  if (alignment == 0 || !std::has_single_bit(alignment) || alignment > (1u << 20)) {
    throw std::invalid_argument(
        StrCat("zip alignment must be a power of two up to 1 MiB, not ", alignment));
  }
}

size_t ZipPlanner::Add(const std::string& name, uint64_t size, uint64_t alignment, uint64_t base) {
  if (alignment == 0) alignment = alignment_;
  if (!std::has_single_bit(alignment) || alignment > (1u << 20)) {
    throw std::invalid_argument(
        StrCat("zip alignment must be a power of two up to 1 MiB, not ", alignment));
  }
  if (name.size() > 0xFFFF) throw std::invalid_argument("zip entry name longer than 65535 bytes");
  if (names_.contains(name)) {
    throw std::invalid_argument(StrCat("zip entry '", name, "' added twice"));
  }
  ZipPlanEntry e;
  e.name = name;
  e.size = size;
  e.local_header_offset = end_;
  e.zip64 = force_zip64_ || size >= kMax32 || end_ >= kMax32;
  uint64_t data = end_ + LocalFixed(e);
  if ((base + data) % alignment != 0) {
    // Padding needs a 4-byte field header of its own.
    data = ((base + data + 4 + alignment - 1) / alignment) * alignment - base;
  }
  e.data_offset = data;
  end_ = data + size;
  names_.insert(name);
  entries_.push_back(std::move(e));
  return entries_.size() - 1;
}

void ZipPlanner::SetCrc(size_t index, uint32_t crc) {
  entries_.at(index).crc32 = crc;
}

std::string ZipPlanner::LocalHeader(size_t index) const {
  const ZipPlanEntry& e = entries_.at(index);
  uint64_t extra = e.data_offset - e.local_header_offset - 30 - e.name.size();
  std::string s;
  Put32(s, 0x04034b50);
  Put16(s, e.zip64 ? kVersionZip64 : kVersionStored);
  Put16(s, 0);  // flags
  Put16(s, 0);  // stored
  Put16(s, 0);  // time
  Put16(s, kDosDate1980);
  Put32(s, e.crc32);
  Put32(s, e.zip64 ? kMax32 : e.size);
  Put32(s, e.zip64 ? kMax32 : e.size);
  Put16(s, e.name.size());
  Put16(s, extra);
  s += e.name;
  if (e.zip64) {
    Put16(s, 1);
    Put16(s, 16);
    Put64(s, e.size);
    Put64(s, e.size);
    extra -= 20;
  }
  if (extra > 0) {
    Put16(s, kPaddingId);
    Put16(s, extra - 4);
    s.append(extra - 4, 'Z');
  }
  return s;
}

std::string ZipPlanner::Directory() const {
  std::string s;
  for (const auto& e : entries_) {
    Put32(s, 0x02014b50);
    Put16(s, e.zip64 ? kVersionZip64 : kVersionStored);  // made by (MS-DOS attributes)
    Put16(s, e.zip64 ? kVersionZip64 : kVersionStored);  // needed
    Put16(s, 0);
    Put16(s, 0);
    Put16(s, 0);
    Put16(s, kDosDate1980);
    Put32(s, e.crc32);
    Put32(s, e.zip64 ? kMax32 : e.size);
    Put32(s, e.zip64 ? kMax32 : e.size);
    Put16(s, e.name.size());
    Put16(s, e.zip64 ? 28 : 0);
    Put16(s, 0);  // comment
    Put16(s, 0);  // disk
    Put16(s, 0);  // internal attributes
    Put32(s, 0);  // external attributes
    Put32(s, e.zip64 ? kMax32 : e.local_header_offset);
    s += e.name;
    if (e.zip64) {
      Put16(s, 1);
      Put16(s, 24);
      Put64(s, e.size);
      Put64(s, e.size);
      Put64(s, e.local_header_offset);
    }
  }
  uint64_t cd_size = s.size();
  uint64_t count = entries_.size();
  bool zip64 = force_zip64_ || count >= 0xFFFF || end_ >= kMax32 || cd_size >= kMax32;
  for (const auto& e : entries_) zip64 = zip64 || e.zip64;
  if (zip64) {
    uint64_t end64 = end_ + cd_size;
    Put32(s, 0x06064b50);
    Put64(s, 44);  // size of the rest of the record
    Put16(s, kVersionZip64);
    Put16(s, kVersionZip64);
    Put32(s, 0);
    Put32(s, 0);
    Put64(s, count);
    Put64(s, count);
    Put64(s, cd_size);
    Put64(s, end_);
    Put32(s, 0x07064b50);
    Put32(s, 0);
    Put64(s, end64);
    Put32(s, 1);
  }
  Put32(s, 0x06054b50);
  Put16(s, 0);
  Put16(s, 0);
  Put16(s, zip64 ? 0xFFFF : count);
  Put16(s, zip64 ? 0xFFFF : count);
  Put32(s, zip64 ? kMax32 : cd_size);
  Put32(s, zip64 ? kMax32 : end_);
  Put16(s, 0);
  return s;
}

}  // namespace tensortier
