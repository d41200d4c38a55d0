#include "tensortier/checkpoint/checksum.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdio>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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
  if (len == 0) return;  // an empty tensor's address may be null: memcpy must not see it
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

namespace {

// CRC-32 without the pre- and post-inversion: the table loop alone. Linear in `c` and the data,
// which is what lets the folding below hand it a shorter message with the same remainder.
uint32_t CrcRaw(const unsigned char* p, size_t len, uint32_t c) noexcept {
  const auto& t = kCrcTables;
  for (; len >= 8; p += 8, len -= 8) {
    uint32_t lo = Load32(p) ^ c;
    uint32_t hi = Load32(p + 4);
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; len > 0; ++p, --len) c = (c >> 8) ^ t[0][(c ^ *p) & 0xFF];
  return c;
}

#if defined(__x86_64__)

// x^n mod P in the reflected representation (bit i is the coefficient of x^(31-i)).
constexpr uint32_t XPowModP(unsigned n) {
  uint32_t r = 0x80000000u;  // x^0
  for (unsigned i = 0; i < n; ++i) r = (r & 1) ? (r >> 1) ^ 0xEDB88320u : r >> 1;
  return r;
}

// The multipliers that move a 16-byte block `bits` further along the message: its first 8
// bytes (the higher-degree half) by x^(bits+64), its last 8 by x^bits. A carry-less product of
// two reflected 64-bit values comes out one degree low, hence the -1; the constant sits in the
// upper half of its 64-bit lane, where reflected degrees 31..0 live.
constexpr uint64_t FoldConstant(unsigned bits) {
  return static_cast<uint64_t>(XPowModP(bits - 1)) << 32;
}

// The pairs (first 8 bytes, last 8 bytes) for moving a block 16, 64 and 256 bytes along,
// computed at compile time (as calls, GCC evaluated them on every call: 4 us per CRC).
struct FoldPair {
  long long first, last;
};
constexpr FoldPair MakeFoldPair(unsigned bits) {
  return {static_cast<long long>(FoldConstant(bits + 64)),
          static_cast<long long>(FoldConstant(bits))};
}
constexpr FoldPair kFold16 = MakeFoldPair(128);
constexpr FoldPair kFold64 = MakeFoldPair(512);
constexpr FoldPair kFold256 = MakeFoldPair(2048);

__attribute__((target("pclmul,sse2"))) inline __m128i Fold(__m128i block, __m128i by,
                                                           __m128i into) {
  __m128i high = _mm_clmulepi64_si128(block, by, 0x00);
  __m128i low = _mm_clmulepi64_si128(block, by, 0x11);
  return _mm_xor_si128(_mm_xor_si128(high, low), into);
}

// Fold()'s multipliers in each 128-bit lane. (_mm512_broadcast_i32x4 would trip GCC 12's
// -Wuninitialized: its pass-through operand is undefined.)
__attribute__((target("avx512f"))) inline __m512i FoldConstants4(FoldPair k) {
  return _mm512_set_epi64(k.last, k.first, k.last, k.first, k.last, k.first, k.last, k.first);
}

// Fold() on four 16-byte blocks at once. (0x96: the truth table of a three-way XOR.)
__attribute__((target("avx512f,vpclmulqdq"))) inline __m512i Fold4(__m512i blocks, __m512i by,
                                                                   __m512i into) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(blocks, by, 0x00),
                                   _mm512_clmulepi64_epi128(blocks, by, 0x11), into, 0x96);
}

// Four 512-bit lanes 256 bytes apart, each folding four blocks per instruction; then the
// lanes fold into one. Leaves the 64 bytes with the remainder of the `*consumed` bytes (a
// multiple of 64) in `state`. Needs len >= 256.
__attribute__((target("avx512f,vpclmulqdq"))) void FoldWide(const unsigned char* p, size_t len,
                                                            uint32_t c, unsigned char* state,
                                                            size_t* consumed) {
  const __m512i by256 = FoldConstants4(kFold256);
  const __m512i by64 = FoldConstants4(kFold64);
  __m512i z0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, c));
  __m512i z1 = _mm512_loadu_si512(p + 64), z2 = _mm512_loadu_si512(p + 128),
          z3 = _mm512_loadu_si512(p + 192);
  size_t done = 256;
  for (; len - done >= 256; done += 256) {
    z0 = Fold4(z0, by256, _mm512_loadu_si512(p + done));
    z1 = Fold4(z1, by256, _mm512_loadu_si512(p + done + 64));
    z2 = Fold4(z2, by256, _mm512_loadu_si512(p + done + 128));
    z3 = Fold4(z3, by256, _mm512_loadu_si512(p + done + 192));
  }
  z0 = Fold4(Fold4(Fold4(z0, by64, z1), by64, z2), by64, z3);
  for (; len - done >= 64; done += 64) z0 = Fold4(z0, by64, _mm512_loadu_si512(p + done));
  _mm512_storeu_si512(state, z0);
  *consumed = done;
}

bool HasVpclmul() noexcept {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
  return has;
}

// Folds whole 16-byte blocks into one: four lanes 64 bytes apart while the data lasts (four
// independent multiply chains keep the carry-less multiplier busy), then one lane. The 16
// bytes left have the same remainder modulo P as the `len` bytes they replace, so the table
// loop finishes the CRC from them. `wide`: start with FoldWide() (the CPU has it). Needs
// len >= 64.
__attribute__((target("pclmul,sse2"))) uint32_t CrcFolded(const unsigned char* p, size_t len,
                                                          uint32_t c, bool wide, size_t* consumed) {
  const __m128i by4 = _mm_set_epi64x(kFold64.last, kFold64.first);
  const __m128i by1 = _mm_set_epi64x(kFold16.last, kFold16.first);
  auto load = [](const unsigned char* q) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  };
  __m128i x0, x1, x2, x3;
  size_t done;
  if (wide && len >= 1024) {
    // The wide path leaves the same 64-byte state the loop below keeps, further along.
    alignas(64) unsigned char state[64];
    FoldWide(p, len, c, state, &done);
    x0 = load(state), x1 = load(state + 16), x2 = load(state + 32), x3 = load(state + 48);
  } else {
    x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(c)));
    x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
    done = 64;
  }
  for (; len - done >= 64; done += 64) {
    x0 = Fold(x0, by4, load(p + done));
    x1 = Fold(x1, by4, load(p + done + 16));
    x2 = Fold(x2, by4, load(p + done + 32));
    x3 = Fold(x3, by4, load(p + done + 48));
  }
  x0 = Fold(Fold(Fold(x0, by1, x1), by1, x2), by1, x3);
  for (; len - done >= 16; done += 16) x0 = Fold(x0, by1, load(p + done));
  alignas(16) unsigned char rest[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(rest), x0);
  *consumed = done;
  return CrcRaw(rest, sizeof(rest), 0);
}

bool HasPclmul() noexcept {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse2");
  return has;
}

#endif

}  // namespace

namespace detail {

bool CrcMethodAvailable(CrcMethod method) noexcept {
  switch (method) {
    case CrcMethod::kTable:
      return true;
#if defined(__x86_64__)
    case CrcMethod::kPclmul:
      return HasPclmul();
    case CrcMethod::kVpclmul:
      return HasPclmul() && HasVpclmul();
#endif
    default:
      return false;
  }
}

uint32_t Crc32With(CrcMethod method, const void* data, size_t len, uint32_t crc) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  // Below a few hundred bytes the table loop is as fast and needs no setup.
  if (method != CrcMethod::kTable && len >= 256) {
    size_t done = 0;
    c = CrcFolded(p, len, c, method == CrcMethod::kVpclmul, &done);
    p += done, len -= done;
  }
#else
  (void)method;
#endif
  return ~CrcRaw(p, len, c);
}

}  // namespace detail

uint32_t Crc32(const void* data, size_t len, uint32_t crc) noexcept {
  using detail::CrcMethod;
  static const CrcMethod best =
      detail::CrcMethodAvailable(CrcMethod::kVpclmul)  ? CrcMethod::kVpclmul
      : detail::CrcMethodAvailable(CrcMethod::kPclmul) ? CrcMethod::kPclmul
                                                       : CrcMethod::kTable;
  return detail::Crc32With(best, data, len, crc);
}

std::string Hex8(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

std::string Hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace tensortier
