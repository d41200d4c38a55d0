// Checksums for checkpoint data: XXH64 (per-tensor checksums we write into safetensors metadata)
// and CRC-32 (the one zip stores for every entry, checked on torch.save files).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tensortier {

// XXH64 of `len` bytes, as specified by the xxHash project (XXH64 in xxhash.h, version 0.8).
uint64_t Xxh64(const void* data, size_t len, uint64_t seed = 0) noexcept;

// Streaming XXH64: Update() any number of times, Digest() at any point (does not reset).
// Gives the same value as Xxh64() over the concatenation. Not thread-safe.
class Xxh64State {
 public:
  explicit Xxh64State(uint64_t seed = 0) noexcept;
  void Update(const void* data, size_t len) noexcept;
  uint64_t Digest() const noexcept;

 private:
  uint64_t v_[4];
  uint64_t seed_;
  uint64_t total_ = 0;
  unsigned char buf_[32];
  size_t buffered_ = 0;
};

// CRC-32 (ISO-HDLC: zlib's crc32(), the one zip uses). `crc` chains calls: Crc32(b, n, Crc32(a, m))
// equals the CRC of a followed by b.
// The fastest method this CPU has: carry-less multiply folding (AVX-512 VPCLMULQDQ, else
// PCLMULQDQ) for the bulk, slicing-by-8 tables for the rest.
uint32_t Crc32(const void* data, size_t len, uint32_t crc = 0) noexcept;

// 8 lowercase hex digits, as CRC-32s are shown.
std::string Hex8(uint32_t v);
// 16 lowercase hex digits, as xxh64 checksums are stored in safetensors metadata.
std::string Hex16(uint64_t v);

namespace detail {
// The ways Crc32() can compute (tests check each one the CPU has against the others).
enum class CrcMethod { kTable, kPclmul, kVpclmul };
bool CrcMethodAvailable(CrcMethod method) noexcept;
// Crc32() by `method`, which must be available.
uint32_t Crc32With(CrcMethod method, const void* data, size_t len, uint32_t crc = 0) noexcept;
}  // namespace detail

}  // namespace tensortier
