// The checks of DCP checkpoints: every item of a directory against its metadata (tensortier
// verify), and a stock bytes item's zip records' CRC-32s (the Reader's too).
#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dcp_item_source.hpp"
#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/dcp_file.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/checkpoint/zip_archive.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

std::optional<std::string> DcpZipRecordsProblem(const ByteSource& item) {
  // A torch.save zip: its first record (local header: 30 bytes, then the name) is
  // "<folder>/data.pkl". Other bytes, zips among them, are a planner's own: not checked.
  constexpr size_t kLocalHeader = 30;
  constexpr std::string_view kPickle = "/data.pkl";
  unsigned char head[kLocalHeader];
  if (item.size() < kLocalHeader) return std::nullopt;
  item.ReadAt(0, head, kLocalHeader);
  const size_t name_length = head[26] | (size_t{head[27]} << 8);
  if (std::memcmp(head, "PK\x03\x04", 4) != 0 || name_length < kPickle.size() ||
      name_length > item.size() - kLocalHeader) {
    return std::nullopt;
  }
  std::string name(name_length, '\0');
  item.ReadAt(kLocalHeader, name.data(), name_length);
  if (!name.ends_with(kPickle)) return std::nullopt;
  const ZipDirectory zip = ReadZipDirectory(item);
  if (!RecordsCrcs(zip)) return std::nullopt;
  std::vector<std::byte> buf;
  for (const ZipEntry& e : zip.entries) {
    if (!e.stored() || e.size == 0) continue;  // compressed: torch.save writes none
    buf.resize(std::min<uint64_t>(e.size, 1 << 20));
    uint32_t crc = 0;
    for (uint64_t at = 0; at < e.size;) {
      const size_t n = std::min<uint64_t>(buf.size(), e.size - at);
      item.ReadAt(e.data_offset + at, buf.data(), n);
      crc = Crc32(buf.data(), n, crc);
      at += n;
    }
    if (crc != e.crc32) {
      return StrCat("its zip record '", e.name, "' has the CRC-32 ", Hex8(crc),
                    ", the zip records ", Hex8(e.crc32));
    }
  }
  return "";
}

namespace {

// One item of an open data file, its problems added to `report`.
void CheckDcpItem(Engine& engine, const std::string& path, const File& file,
                  const DcpStoredItem& item, DcpVerifyReport& report) {
  const std::string where =
      StrCat(path, ": item '", item.name, "' at ", Range(item.offset, item.length));
  try {
    if (item.offset > file.Size() || item.length > file.Size() - item.offset) {
      report.problems.push_back(StrCat(where, ": past the end of the file (", file.Size(),
                                       " bytes): the file is truncated"));
      return;
    }
    if (item.transformed) {  // compressed, say: torch's reader with its extensions reads it
      ++report.transformed;
      return;
    }
    // A tensor's shape must be its chunk's as the metadata records it (the Reader's rule).
    std::optional<DcpTensorItem> t;
    if (!item.bytes) {
      t = ReadDcpTensorItem(file, item.name, item.offset, item.length, item.chunk_sizes, item.fqn);
    }
    if (item.xxh64) {
      // One pass: the item's xxh64, and its data's block sums where the metadata has them.
      const bool blocks = t && !item.block_xxh64.empty();
      StreamBuffers buffers(std::max<uint64_t>(1, std::min(item.length, kCheckpointGroupBytes)));
      Xxh64State h;
      BlockHasher block_sums;
      uint64_t at = item.offset;
      StreamRange(engine, file, item.offset, item.length, buffers, [&](std::byte* p, size_t n) {
        h.Update(p, n);
        if (blocks) {  // the part of [at, at + n) inside the data
          const uint64_t begin = std::max(at, t->data_offset);
          const uint64_t end = std::min(at + n, t->data_offset + t->nbytes);
          if (begin < end) block_sums.Update(p + (begin - at), end - begin);
        }
        at += n;
      });
      const uint64_t actual = h.Digest();
      ++report.checked;
      // A damaged block of the data is named by its range (the Reader's rule), before the
      // item's sum (which also covers the zip records around the data).
      if (blocks) {
        CheckDcpBlockXxh64s(where, item.block_xxh64, 0, block_sums.Finish(), t->data_offset,
                            t->nbytes);
      }
      if (actual != *item.xxh64) {
        report.problems.push_back(StrCat(where, ": its xxh64 is ", Hex16(actual),
                                         ", the metadata records ", Hex16(*item.xxh64)));
      }
    } else if (t && t->crc32) {
      StreamBuffers buffers(std::max<uint64_t>(1, std::min(t->nbytes, kCheckpointGroupBytes)));
      uint32_t crc = 0;
      StreamRange(engine, file, t->data_offset, t->nbytes, buffers,
                  [&](std::byte* p, size_t n) { crc = Crc32(p, n, crc); });
      ++report.checked;
      if (crc != *t->crc32) {
        report.problems.push_back(StrCat(where, ": its data's CRC-32 is ", Hex8(crc),
                                         ", its zip records ", Hex8(*t->crc32)));
      }
    } else if (const std::optional<std::string> problem =
                   item.bytes ? DcpZipRecordsProblem(RangeSource(FileSource(file), item.name,
                                                                 item.offset, item.length))
                              : std::nullopt) {
      ++report.checked;
      if (!problem->empty()) report.problems.push_back(StrCat(where, ": ", *problem));
    } else {
      ++report.unchecked;
    }
  } catch (const FormatError& e) {
    report.problems.push_back(e.what());
  }
}

}  // namespace

DcpVerifyReport VerifyDcpCheckpoint(Engine& engine, const std::string& dir,
                                    const DcpMetadata& metadata) {
  DcpVerifyReport report;
  // One file open at a time, its items in the metadata's order: a job of many ranks has more
  // files than a low descriptor limit lets one hold open together.
  std::vector<std::string> file_order;
  std::map<std::string, std::vector<const DcpStoredItem*>> items_of;
  for (const DcpStoredItem& item : metadata.items) {
    std::vector<const DcpStoredItem*>& items = items_of[item.relative_path];
    if (items.empty()) file_order.push_back(item.relative_path);
    items.push_back(&item);
  }
  for (const std::string& relative_path : file_order) {
    const std::vector<const DcpStoredItem*>& items = items_of[relative_path];
    const std::string path = StrCat(dir, "/", relative_path);
    std::optional<File> file;
    try {
      const std::string names[] = {items.front()->name};
      file = OpenDcpDataFile(path, names, /*direct=*/true);
    } catch (const IoError& e) {
      report.problems.push_back(e.what());
      continue;
    }
    for (const DcpStoredItem* item : items) CheckDcpItem(engine, path, *file, *item, report);
  }
  return report;
}

}  // namespace tensortier
