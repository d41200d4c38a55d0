// The index before the pickle of a .metadata tensortier writes from lists: the file starts with
// PROTO 4, BINBYTES <index>, POP, then the Metadata's pickle. Unpicklers push the bytes and drop
// them; a reader that knows the index decodes it instead of the pickle (tens of thousands of
// objects). The index carries the xxh64 of the pickle after it and of its own contents, so that
// a reader never takes an index for a pickle it does not describe.
//
// The index: "TTDCPIX1", the pickle's xxh64, the xxh64 of what follows, then the contents in
// little-endian fields (u32 counts and lengths, i64/u64 values, strings as length and bytes).
#include "dcp_metadata_index.hpp"

#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr std::string_view kMagic = "TTDCPIX1";
constexpr std::string_view kHead(
    "\x80\x04"
    "B",
    3);                               // PROTO 4, BINBYTES
constexpr size_t kFixed = 8 + 8 + 8;  // magic, the two sums

enum EntryFlags : uint8_t { kBytes = 1, kRequiresGrad = 2, kPinned = 4 };
enum StorageFlags : uint8_t { kHasOffset = 1, kHasIndex = 2, kHasXxh64 = 4 };

class Encoder {
 public:
  void U8(uint8_t v) { out_ += static_cast<char>(v); }
  void U32(uint64_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void Str(std::string_view s) {
    U32(s.size());
    out_ += s;
  }
  void OptStr(const std::optional<std::string>& s) {
    U8(s ? 1 : 0);
    if (s) Str(*s);
  }
  void Dims(const std::vector<int64_t>& v) {
    U32(v.size());
    for (int64_t x : v) U64(static_cast<uint64_t>(x));
  }
  std::string Take() { return std::move(out_); }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xFF);
  }
  std::string out_;
};

class Decoder {
 public:
  Decoder(std::string_view data, const std::string& what) : data_(data), what_(what) {}

  // A string the writer took from Python: valid UTF-8.
  // UTF-8, lone surrogates allowed where `surrogates` (as the pickle's string it stands for).
  std::string Text(bool surrogates = false) {
    std::string s = Str();
    if (!IsUtf8(s, surrogates)) Fail("a string that is not UTF-8");
    return s;
  }
  std::optional<std::string> OptText() {
    if (U8() == 0) return std::nullopt;
    return Text();
  }
  // A name of `prefix` and lowercase letters, digits and '_' (a torch dtype or layout).
  std::string Name(std::string_view prefix) {
    std::string s = Str();
    if (!s.starts_with(prefix) || s.size() == prefix.size() ||
        s.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_", prefix.size()) !=
            std::string::npos) {
      Fail("a dtype or layout that is not a name");
    }
    return s;
  }

  uint8_t U8() { return static_cast<uint8_t>(Take(1)[0]); }
  uint64_t U32() { return Le(4); }
  uint64_t U64() { return Le(8); }
  int64_t I64() { return static_cast<int64_t>(Le(8)); }
  std::string Str() {
    const uint64_t n = U32();
    return std::string(Take(n));
  }
  std::optional<std::string> OptStr() {
    if (U8() == 0) return std::nullopt;
    return Str();
  }
  std::vector<int64_t> Dims() {
    const uint64_t n = Count(8);
    std::vector<int64_t> v(n);
    for (auto& x : v) x = I64();
    return v;
  }
  // A count of items of at least `min_bytes` each: never more than the bytes left allow.
  uint64_t Count(uint64_t min_bytes) {
    const uint64_t n = U32();
    if (n > (data_.size() - pos_) / min_bytes) Fail("a count past its end");
    return n;
  }
  bool done() const { return pos_ == data_.size(); }
  [[noreturn]] void Fail(std::string_view why) const {
    throw FormatError(StrCat(what_, ": a damaged tensortier index (", why, " at byte ", pos_,
                             " of it); the pickle after it may still load with torch's reader"));
  }

 private:
  std::string_view Take(uint64_t n) {
    if (n > data_.size() - pos_) Fail("truncated");
    std::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  uint64_t Le(int n) {
    std::string_view b = Take(n);
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<unsigned char>(b[i])} << (8 * i);
    return v;
  }

  std::string_view data_;
  size_t pos_ = 0;
  const std::string& what_;
};

}  // namespace

std::string EncodeDcpMetadataIndex(const DcpMetadataContents& md, std::string_view body) {
  Encoder e;
  e.Str(md.version);
  e.Str(md.checkpoint_id);
  e.OptStr(md.save_id);
  e.OptStr(md.load_id);
  e.U32(md.modules.size());
  for (const auto& m : md.modules) e.Str(m);
  e.U8(md.format ? 1 : 0);
  if (md.format) e.U64(static_cast<uint64_t>(*md.format));
  e.U32(md.entries.size());
  for (const auto& entry : md.entries) {
    e.Str(entry.fqn);
    e.U8((entry.bytes ? kBytes : 0) | (entry.requires_grad ? kRequiresGrad : 0) |
         (entry.pin_memory ? kPinned : 0));
    if (entry.bytes) continue;
    e.Str(entry.dtype);
    e.Str(entry.layout);
    e.U64(static_cast<uint64_t>(entry.memory_format));
    e.Dims(entry.size);
    e.U32(entry.chunks.size());
    for (const auto& [offsets, sizes] : entry.chunks) {
      e.Dims(offsets);
      e.Dims(sizes);
    }
  }
  std::unordered_map<std::string_view, uint32_t> file_of;
  std::vector<std::string_view> files;
  for (const auto& s : md.storage) {
    if (file_of.try_emplace(s.relative_path, files.size()).second) files.push_back(s.relative_path);
  }
  e.U32(files.size());
  for (std::string_view f : files) e.Str(f);
  e.U32(md.storage.size());
  for (const auto& s : md.storage) {
    e.Str(s.fqn);
    e.U8((s.offset ? kHasOffset : 0) | (s.index ? kHasIndex : 0) | (s.xxh64 ? kHasXxh64 : 0));
    if (s.offset) e.Dims(*s.offset);
    if (s.index) e.U64(static_cast<uint64_t>(*s.index));
    e.U32(file_of.at(s.relative_path));
    e.U64(s.offset_in_file);
    e.U64(s.length);
    if (s.xxh64) e.U64(*s.xxh64);
    e.Str(s.block_xxh64);
  }
  const std::string payload = e.Take();
  Encoder head;
  head.U64(Xxh64(body.data(), body.size()));
  head.U64(Xxh64(payload.data(), payload.size()));
  return StrCat(kMagic, head.Take(), payload);
}

std::optional<DcpMetadataContents> ReadDcpMetadataIndex(std::string_view data,
                                                        const std::string& what) {
  if (!data.starts_with(kHead) || data.size() < kHead.size() + 4 + kMagic.size() ||
      data.substr(kHead.size() + 4, kMagic.size()) != kMagic) {
    return std::nullopt;
  }
  uint64_t n = 0;
  for (int i = 0; i < 4; ++i) {
    n |= uint64_t{static_cast<unsigned char>(data[kHead.size() + i])} << (8 * i);
  }
  const size_t start = kHead.size() + 4;
  if (n < kFixed || n > data.size() - start - 1 || data[start + n] != '0') {
    throw FormatError(
        StrCat(what, ": a damaged tensortier index (its length, ", n, ", does not fit the file)"));
  }
  const std::string_view index = data.substr(start, n);
  const std::string_view body = data.substr(start + n + 1);
  Decoder d(index.substr(kMagic.size()), what);
  const uint64_t body_sum = d.U64();
  const uint64_t payload_sum = d.U64();
  const std::string_view payload = index.substr(kFixed);
  if (Xxh64(payload.data(), payload.size()) != payload_sum) d.Fail("its checksum differs");
  if (Xxh64(body.data(), body.size()) != body_sum) {
    throw FormatError(StrCat(what,
                             ": the pickle after tensortier's index is not the one it "
                             "describes (its xxh64 differs): the file is damaged"));
  }
  Decoder p(payload, what);
  DcpMetadataContents md;
  md.version = p.Text();
  md.checkpoint_id = p.Text(/*surrogates=*/true);  // a path
  md.save_id = p.OptText();
  md.load_id = p.OptText();
  md.modules.resize(p.Count(4));
  for (auto& m : md.modules) m = p.Text();
  if (p.U8() != 0) md.format = static_cast<int64_t>(p.U64());
  CheckDcpFormat(md.format, what);
  md.entries.resize(p.Count(5));
  for (auto& entry : md.entries) {
    entry.fqn = p.Text();
    const uint8_t flags = p.U8();
    entry.bytes = (flags & kBytes) != 0;
    entry.requires_grad = (flags & kRequiresGrad) != 0;
    entry.pin_memory = (flags & kPinned) != 0;
    if (entry.bytes) continue;
    entry.dtype = p.Name("");
    entry.layout = p.Name("torch.");
    entry.memory_format = p.I64();
    if (entry.memory_format < 0 || entry.memory_format > 2) p.Fail("a memory format past 2");
    entry.size = p.Dims();
    entry.chunks.resize(p.Count(8));
    for (auto& [offsets, sizes] : entry.chunks) {
      offsets = p.Dims();
      sizes = p.Dims();
    }
  }
  std::vector<std::string> files(p.Count(4));
  for (auto& f : files) {
    f = p.Text();
    CheckDcpDataFileName(f, what);
  }
  md.storage.resize(p.Count(4 + 1 + 4 + 8 + 8 + 4));
  for (auto& s : md.storage) {
    s.fqn = p.Text();
    const uint8_t flags = p.U8();
    if (flags & kHasOffset) s.offset = p.Dims();
    if (flags & kHasIndex) s.index = p.I64();
    const uint64_t file = p.U32();
    if (file >= files.size()) p.Fail("a data file past the list");
    s.relative_path = files[file];
    s.offset_in_file = p.U64();
    s.length = p.U64();
    if (flags & kHasXxh64) s.xxh64 = p.U64();
    s.block_xxh64 = p.Str();
  }
  if (!p.done()) p.Fail("bytes after its end");
  return md;
}

}  // namespace tensortier
