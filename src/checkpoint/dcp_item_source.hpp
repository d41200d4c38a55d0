// What reading a DCP data file's items and checking them share (src/checkpoint only): an item's
// byte range as a source of its own, and the block sums of a stream of tensor data.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/dcp_file.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

// "bytes [offset, offset + length)", for messages.
inline std::string Range(uint64_t offset, uint64_t length) {
  return StrCat("bytes [", offset, ", ", offset + length, ")");
}

// [offset, offset + length) of another source, as a source of its own (offsets from 0).
class RangeSource : public ByteSource {
 public:
  RangeSource(const ByteSource& whole, const std::string& item, uint64_t offset, uint64_t length)
      : whole_(whole),
        offset_(offset),
        length_(length),
        name_(StrCat(whole.name(), ": item '", item, "' at ", Range(offset, length))) {
    if (offset > whole.size() || length > whole.size() - offset) {
      throw FormatError(StrCat(name_, " runs past the end of the file (", whole.size(),
                               " bytes): the file is truncated"));
    }
  }
  uint64_t size() const override { return length_; }
  const std::string& name() const override { return name_; }
  void ReadAt(uint64_t offset, void* buf, size_t len) const override {
    if (offset > length_ || len > length_ - offset) {
      throw FormatError(StrCat(name_, ": a read at ", Range(offset, len), " past the item"));
    }
    whole_.ReadAt(offset_ + offset, buf, len);
    bytes_read_ += len;
  }
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  const ByteSource& whole_;
  uint64_t offset_;
  uint64_t length_;
  std::string name_;
  mutable uint64_t bytes_read_ = 0;
};

// The block sums of a stream of tensor data, fed in pieces of any size.
class BlockHasher {
 public:
  void Update(const std::byte* p, uint64_t n) {
    while (n > 0) {
      const uint64_t take = std::min(n, kDcpBlockBytes - filled_);
      state_.Update(p, take);
      filled_ += take;
      p += take;
      n -= take;
      if (filled_ == kDcpBlockBytes) Emit();
    }
  }
  std::string Finish() {
    if (filled_ > 0) Emit();
    return std::move(out_);
  }

 private:
  void Emit() {
    const uint64_t v = state_.Digest();
    for (int k = 0; k < 8; ++k) out_.push_back(static_cast<char>(v >> (8 * k)));
    state_ = Xxh64State();
    filled_ = 0;
  }
  Xxh64State state_;
  uint64_t filled_ = 0;
  std::string out_;
};

}  // namespace tensortier
