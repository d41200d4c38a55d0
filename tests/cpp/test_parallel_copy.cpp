#include "tensortier/util/parallel_copy.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tensortier {
namespace {

std::vector<std::byte> CopyPattern(size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  return v;
}

TEST(ParallelCopyTest, CopiesLargeAndManySmallRangesOverThreads) {
  // One range over several pieces, many of a few bytes, an empty one, another large one.
  std::vector<std::vector<std::byte>> src;
  src.push_back(CopyPattern((9u << 20) + 3, 1));
  for (unsigned i = 0; i < 5000; ++i) src.push_back(CopyPattern(1 + i % 37, i));
  src.push_back({});
  src.push_back(CopyPattern(5u << 20, 7));
  for (unsigned threads : {0u, 1u, 3u, 64u}) {
    std::vector<std::vector<std::byte>> dst;
    std::vector<CopyRange> ranges;
    for (const auto& s : src) dst.emplace_back(s.size());
    for (size_t i = 0; i < src.size(); ++i) {
      ranges.push_back({dst[i].data(), src[i].data(), src[i].size()});
    }
    ParallelCopy(ranges, threads);
    for (size_t i = 0; i < src.size(); ++i) {
      ASSERT_EQ(dst[i], src[i]) << "range " << i << ", " << threads << " threads";
    }
  }
}

TEST(ParallelCopyTest, NothingToCopy) {
  ParallelCopy({}, 4);
  std::byte a{1}, b{2};
  const CopyRange empty{&a, &b, 0};
  ParallelCopy({&empty, 1}, 4);
  EXPECT_EQ(a, std::byte{1});
}

}  // namespace
}  // namespace tensortier
