// XXH64 and CRC-32 against published test vectors, and streaming == one-shot for every split.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tensortier/checksum.hpp"
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

}  // namespace
}  // namespace tensortier
