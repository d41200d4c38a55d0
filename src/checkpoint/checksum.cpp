#include "tensortier/checksum.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

namespace tensortier {
namespace {

static_assert(std::endian::native == std::endian::little,
              "checksums read words in little-endian order; add byte swaps for big-endian hosts");

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;

inline uint64_t Load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t Load32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint64_t Round(uint64_t acc, uint64_t input) {
  acc += input * kP2;
  acc = std::rotl(acc, 31);
  return acc * kP1;
}

inline uint64_t MergeRound(uint64_t acc, uint64_t v) {
  acc ^= Round(0, v);
  return acc * kP1 + kP4;
}

// Consumes whole 32-byte stripes; returns the number of bytes consumed. Four independent lanes
// keep the multiplier pipelines busy: this loop is the whole cost for large inputs.
inline size_t Stripes(uint64_t v[4], const unsigned char* p, size_t len) {
  size_t done = 0;
  uint64_t a = v[0], b = v[1], c = v[2], d = v[3];
  for (; len - done >= 32; done += 32) {
    a = Round(a, Load64(p + done));
    b = Round(b, Load64(p + done + 8));
    c = Round(c, Load64(p + done + 16));
    d = Round(d, Load64(p + done + 24));
  }
  v[0] = a, v[1] = b, v[2] = c, v[3] = d;
  return done;
}

// The end of XXH64: folds in the lanes (when there were any stripes), the length, the tail.
uint64_t Finish(const uint64_t v[4], bool had_stripes, uint64_t seed, uint64_t total,
                const unsigned char* tail, size_t len) {
  uint64_t h;
  if (had_stripes) {
    h = std::rotl(v[0], 1) + std::rotl(v[1], 7) + std::rotl(v[2], 12) + std::rotl(v[3], 18);
    for (int i = 0; i < 4; ++i) h = MergeRound(h, v[i]);
  } else {
    h = seed + kP5;
  }
  h += total;
  for (; len >= 8; tail += 8, len -= 8) {
    h ^= Round(0, Load64(tail));
    h = std::rotl(h, 27) * kP1 + kP4;
  }
  if (len >= 4) {
    h ^= static_cast<uint64_t>(Load32(tail)) * kP1;
    h = std::rotl(h, 23) * kP2 + kP3;
    tail += 4, len -= 4;
  }
  for (; len > 0; ++tail, --len) {
    h ^= *tail * kP5;
    h = std::rotl(h, 11) * kP1;
  }
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

void InitLanes(uint64_t v[4], uint64_t seed) {
  v[0] = seed + kP1 + kP2;
  v[1] = seed + kP2;
  v[2] = seed;
  v[3] = seed - kP1;
}

// Slicing-by-8 tables for the reflected polynomial 0xEDB88320.
constexpr std::array<std::array<uint32_t, 256>, 8> MakeCrcTables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
  return t;
}
constexpr auto kCrcTables = MakeCrcTables();

}  // namespace

uint64_t Xxh64(const void* data, size_t len, uint64_t seed) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t v[4];
  InitLanes(v, seed);
  size_t done = Stripes(v, p, len);
  return Finish(v, len >= 32, seed, len, p + done, len - done);
}

Xxh64State::Xxh64State(uint64_t seed) noexcept : seed_(seed) {
  InitLanes(v_, seed);
}

void Xxh64State::Update(const void* data, size_t len) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += len;
  if (buffered_ > 0) {
    size_t take = std::min(len, sizeof(buf_) - buffered_);
    std::memcpy(buf_ + buffered_, p, take);
    buffered_ += take, p += take, len -= take;
    if (buffered_ < sizeof(buf_)) return;
    Stripes(v_, buf_, sizeof(buf_));
    buffered_ = 0;
  }
  size_t done = Stripes(v_, p, len);
  std::memcpy(buf_, p + done, len - done);
  buffered_ = len - done;
}

uint64_t Xxh64State::Digest() const noexcept {
  return Finish(v_, total_ >= 32, seed_, total_, buf_, buffered_);
}

uint32_t Crc32(const void* data, size_t len, uint32_t crc) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  const auto& t = kCrcTables;
  for (; len >= 8; p += 8, len -= 8) {
    uint32_t lo = Load32(p) ^ c;
    uint32_t hi = Load32(p + 4);
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; len > 0; ++p, --len) c = (c >> 8) ^ t[0][(c ^ *p) & 0xFF];
  return ~c;
}

}  // namespace tensortier
