// XXH64 and CRC-32 against published test vectors, and streaming == one-shot for every split.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "tensortier/checkpoint/checksum.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

uint64_t Xxh(const std::string& s, uint64_t seed = 0) {
  return Xxh64(s.data(), s.size(), seed);
}

TEST(CheckpointChecksum, Xxh64KnownVectors) {
  // From the xxHash documentation and test suites.
  EXPECT_EQ(Xxh(""), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(Xxh("a"), 0xD24EC4F1A98C6E5Bull);
  EXPECT_EQ(Xxh("abc"), 0x44BC2CF5AD770999ull);
  EXPECT_EQ(Xxh("Nobody inspects the spammish repetition"), 0xFBCEA83C8A378BF1ull);
}

TEST(CheckpointChecksum, Xxh64SeedChangesTheHash) {
  EXPECT_NE(Xxh("abc", 1), Xxh("abc", 0));
  EXPECT_NE(Xxh(std::string(100, 'x'), 7), Xxh(std::string(100, 'x'), 0));
}

TEST(CheckpointChecksum, Xxh64StreamingMatchesOneShotForEverySplit) {
  std::vector<uint8_t> data = testing::Pattern(200, 3);
  for (size_t len : {0, 1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 65, 100, 200}) {
    uint64_t want = Xxh64(data.data(), len, 42);
    for (size_t split = 0; split <= len; ++split) {
      Xxh64State s(42);
      s.Update(data.data(), split);
      s.Update(data.data() + split, len - split);
      ASSERT_EQ(s.Digest(), want) << "len " << len << " split " << split;
    }
    // Byte by byte, and Digest() twice (it does not reset).
    Xxh64State s(42);
    for (size_t i = 0; i < len; ++i) s.Update(data.data() + i, 1);
    EXPECT_EQ(s.Digest(), want);
    EXPECT_EQ(s.Digest(), want);
  }
}

TEST(CheckpointChecksum, Crc32KnownVectors) {
  EXPECT_EQ(Crc32("", 0), 0u);
  EXPECT_EQ(Crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(Crc32("The quick brown fox jumps over the lazy dog", 43), 0x414FA339u);
}

TEST(CheckpointChecksum, Crc32Chains) {
  std::vector<uint8_t> data = testing::Pattern(1000, 5);
  uint32_t whole = Crc32(data.data(), data.size());
  for (size_t split : {0, 1, 7, 8, 9, 500, 999, 1000}) {
    uint32_t c = Crc32(data.data(), split);
    EXPECT_EQ(Crc32(data.data() + split, data.size() - split, c), whole) << split;
  }
}

// Bit at a time, straight from the definition: the reference for the fast paths.
uint32_t Crc32Bitwise(const uint8_t* p, size_t len, uint32_t crc = 0) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < len; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
  }
  return ~c;
}

// Each method this CPU has (the table, PCLMULQDQ folding, AVX-512 VPCLMULQDQ folding).
std::vector<detail::CrcMethod> AvailableCrcMethods() {
  std::vector<detail::CrcMethod> out;
  for (auto m :
       {detail::CrcMethod::kTable, detail::CrcMethod::kPclmul, detail::CrcMethod::kVpclmul}) {
    if (detail::CrcMethodAvailable(m)) out.push_back(m);
  }
  return out;
}

TEST(CheckpointChecksum, Crc32MatchesTheDefinitionForEveryLengthAndAlignment) {
  // Lengths around the folded paths' thresholds (256 and 1024 bytes, 256- and 64-byte strides,
  // 16-byte blocks) and unaligned starts: every length up to 2 KiB at four starting offsets.
  std::vector<uint8_t> data = testing::Pattern(4096 + 16, 11);
  for (auto method : AvailableCrcMethods()) {
    for (size_t start : {0, 1, 7, 13}) {
      for (size_t len = 0; len <= 2100; ++len) {
        ASSERT_EQ(detail::Crc32With(method, data.data() + start, len),
                  Crc32Bitwise(data.data() + start, len))
            << "method " << static_cast<int>(method) << " start " << start << " len " << len;
      }
    }
    EXPECT_EQ(detail::Crc32With(method, data.data(), 4096, 0x12345678u),
              Crc32Bitwise(data.data(), 4096, 0x12345678u));
  }
}

TEST(CheckpointChecksum, Crc32OfLargeBuffersChainsAcrossSplits) {
  // 1 MiB + 3 with all byte values and runs of zeros and ones (the folding must not depend on
  // content); split anywhere, the chained CRC equals the whole one and the definition.
  std::vector<uint8_t> data = testing::Pattern((1 << 20) + 3, 17);
  std::fill(data.begin() + 1000, data.begin() + 5000, 0);
  std::fill(data.begin() + 9000, data.begin() + 20000, 0xFF);
  const uint32_t want = Crc32Bitwise(data.data(), data.size());
  EXPECT_EQ(Crc32(data.data(), data.size()), want);
  for (auto method : AvailableCrcMethods()) {
    EXPECT_EQ(detail::Crc32With(method, data.data(), data.size()), want);
    for (size_t split :
         {size_t{1}, size_t{255}, size_t{256}, size_t{4097}, data.size() / 2, data.size() - 17}) {
      uint32_t c = detail::Crc32With(method, data.data(), split);
      EXPECT_EQ(detail::Crc32With(method, data.data() + split, data.size() - split, c), want)
          << "method " << static_cast<int>(method) << " split " << split;
    }
  }
}

TEST(CheckpointChecksum, Crc32HasAFoldedMethodOnX86) {
  // CI's and the GPU machine's CPUs have PCLMULQDQ: the fast path is the one that runs there.
#if defined(__x86_64__)
  EXPECT_TRUE(detail::CrcMethodAvailable(detail::CrcMethod::kPclmul));
#else
  GTEST_SKIP() << "folding is implemented for x86-64 only";
#endif
}

}  // namespace
}  // namespace tensortier
