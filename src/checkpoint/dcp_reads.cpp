#include "tensortier/checkpoint/dcp_reads.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/checkpoint/small_pieces.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

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

bool AllZero(const std::vector<int64_t>& v) {
  return std::all_of(v.begin(), v.end(), [](int64_t x) { return x == 0; });
}

// Whether `requests` are one for all of a tensor of `shape`.
bool AsksAll(const std::vector<DcpFileReads::Request>& requests,
             const std::vector<int64_t>& shape) {
  return requests.size() == 1 && AllZero(requests[0].offsets) && requests[0].lengths == shape;
}

// Whether `t` lies as one contiguous run from its storage's start, values as stored.
bool StoredContiguous(const DcpTensorItem& t) {
  if (t.storage_offset != 0 || t.conj || t.neg || t.stride.size() != t.shape.size()) return false;
  int64_t step = 1;
  for (size_t d = t.shape.size(); d-- > 0;) {
    if (t.stride[d] != step) return false;
    step *= std::max<int64_t>(t.shape[d], 1);
  }
  return true;
}

}  // namespace

DcpFileReads::DcpFileReads(Engine& engine, const std::string& path, std::span<const Item> wanted,
                           DcpVerify verify)
    : items_(wanted.begin(), wanted.end()), verify_(verify) {
  for (Item& it : items_) {
    it.whole = it.whole || !it.tensor || verify == DcpVerify::kFull ||
               (it.expected_shape && AsksAll(it.requests, *it.expected_shape));
  }
  const std::vector<Item>& items = items_;
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
  const std::vector<uint64_t> got = ReadScattered(engine, file_, groups, kPageSize, &bytes_read_);
  for (size_t k = 0; k < groups.size(); ++k) {  // short where the file ends early (truncated)
    held_.push_back({groups[k].offset, std::span<const std::byte>(groups[k].dest, got[k])});
  }
  const HeldSource source(file_, held_);
  for (const Item& it : items) {
    tensor_of_.push_back(it.tensor ? static_cast<int64_t>(tensors_.size()) : -1);
    how_.push_back(DcpItemRead::kWhole);
    if (!it.tensor) continue;
    const DcpTensorItem& t = tensors_.emplace_back(
        ReadDcpTensorItem(source, it.name, it.offset, it.length, it.expected_shape, it.fqn));
    if (AsksAll(it.requests, t.shape) && t.storage_offset == 0 && !t.conj && !t.neg) {
      how_.back() = DcpItemRead::kDirect;
    } else if (StoredContiguous(t) && verify != DcpVerify::kFull) {
      how_.back() = DcpItemRead::kParts;
    }
  }
  bytes_read_ += source.from_file();
}

DcpRead DcpFileReads::ReadOf(size_t i, std::optional<size_t> part, std::byte* dest) const {
  const Item& it = items_.at(i);
  const DcpTensorItem* t = tensor(i);
  const bool check = verify_ != DcpVerify::kNone;
  DcpRead r{it.name, it.offset, it.length, it.offset, it.length, dest, {}, {}, {}, {}};
  if (t != nullptr) {
    if (t->safetensors) r.offset = t->data_offset, r.length = t->nbytes;  // the data alone
    r.data_offset = t->data_offset;
    r.data_length = t->nbytes;
  }
  if (!part) {
    if (check) r.xxh64 = it.xxh64;
    if (check && t != nullptr) r.crc32 = t->crc32;
    r.zip_records = check && t == nullptr && !it.xxh64;
    return r;
  }
  if (how_[i] != DcpItemRead::kParts || *part >= it.requests.size()) {
    throw std::invalid_argument(StrCat(it.name, ": no part ", *part, " to read"));
  }
  const Dtype* dtype = DtypeNamed(t->dtype);
  if (dtype == nullptr || dtype->bits % 8 != 0) {
    throw FormatError(StrCat(it.name, ": a tensor of ", t->dtype, " is not read in parts"));
  }
  const Request& q = it.requests[*part];
  r.slice = DcpSlice{t->shape, dtype->bits / 8, q.offsets, q.lengths};
  if (check) r.blocks = it.blocks;
  return r;
}

uint64_t DcpFileReads::Read(Engine& engine, std::span<const DcpRead> reads) const {
  return ReadDcpItems(engine, file_, reads, held_);
}

}  // namespace tensortier
