#include "tensortier/checkpoint/dcp_reads.hpp"

#include <algorithm>
#include <cstring>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/small_pieces.hpp"

namespace tensortier {
namespace {

constexpr uint64_t kPage = 4096;
// Items of this size or more are not held: their data goes from the file to its destination.
constexpr uint64_t kLargeItem = 1u << 20;
// The most bytes one request of small items reads.
constexpr uint64_t kGroupBytes = 8u << 20;

// The file, its held ranges read from memory; counts the bytes read from the file.
class HeldSource : public ByteSource {
 public:
  HeldSource(const File& file, std::span<const DcpHeldBytes> held) : file_(file), held_(held) {}
  uint64_t size() const override { return file_.size(); }
  const std::string& name() const override { return file_.name(); }
  void ReadAt(uint64_t offset, void* buf, size_t len) const override {
    if (const std::byte* p = FindDcpHeldBytes(held_, offset, len)) {
      if (len > 0) std::memcpy(buf, p, len);
      return;
    }
    file_.ReadAt(offset, buf, len);
    from_file_ += len;
  }
  uint64_t from_file() const { return from_file_; }

 private:
  FileSource file_;
  std::span<const DcpHeldBytes> held_;
  mutable uint64_t from_file_ = 0;
};

}  // namespace

DcpFileReads::DcpFileReads(Engine& engine, const std::string& path, std::span<const Item> items) {
  std::vector<std::string> names;
  names.reserve(items.size());
  for (const Item& it : items) names.push_back(it.name);
  file_ = OpenDcpDataFile(path, names, /*direct=*/true);
  // The small items read whole, in file order, in groups of items kDcpCoalesceGap or less apart
  // (an item read in parts is not: its parts are read alone).
  std::vector<size_t> order;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].whole && items[i].length > 0 && items[i].length < kLargeItem) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return items[a].offset < items[b].offset; });
  std::vector<ScatteredRead> groups;
  uint64_t held = 0;
  for (size_t i : order) {
    const Item& it = items[i];
    const uint64_t end = it.offset + it.length;
    if (!groups.empty()) {
      ScatteredRead& g = groups.back();
      const uint64_t old_end = g.offset + g.length;
      if (it.offset <= old_end + kDcpCoalesceGap && end - g.offset <= kGroupBytes) {
        if (end > old_end) {
          if (held + (end - old_end) > kDcpHeldBytes) break;
          held += end - old_end;
          g.length = end - g.offset;
        }
        continue;
      }
    }
    if (held + it.length > kDcpHeldBytes) break;
    held += it.length;
    groups.push_back({it.offset, it.length, nullptr});
  }
  for (ScatteredRead& g : groups) {
    buffers_.push_back(std::make_unique_for_overwrite<std::byte[]>(g.length));
    g.dest = buffers_.back().get();
  }
  const std::vector<uint64_t> got = ReadScattered(engine, file_, groups, kPage, &bytes_read_);
  for (size_t k = 0; k < groups.size(); ++k) {  // short where the file ends early (truncated)
    held_.push_back({groups[k].offset, std::span<const std::byte>(groups[k].dest, got[k])});
  }
  const HeldSource source(file_, held_);
  for (const Item& it : items) {
    if (it.tensor) {
      tensors_.push_back(
          ReadDcpTensorItem(source, it.name, it.offset, it.length, it.expected_shape, it.fqn));
    }
  }
  bytes_read_ += source.from_file();
}

uint64_t DcpFileReads::Read(Engine& engine, std::span<const DcpRead> reads) const {
  return ReadDcpItems(engine, file_, reads, held_);
}

}  // namespace tensortier
