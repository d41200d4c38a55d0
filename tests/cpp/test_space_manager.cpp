// SpaceManager: alignment, best fit, coalescing, tail shrink and Free's validation, then a
// randomized run against a brute-force block-occupancy model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensortier/offload/space_manager.hpp"
#include "test_util.hpp"

namespace tensortier {

// For failure messages. Extent lives in tensortier, so ADL looks here; static keeps it private to
// this file.
static std::ostream& operator<<(std::ostream& os, const Extent& e) {
  return os << "{offset " << e.offset << ", length " << e.length << "}";
}

namespace {

constexpr uint64_t kBlock = 4096;
constexpr uint64_t kInt64Max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// Everything observable about a manager, for "changes nothing" checks.
struct Snapshot {
  uint64_t end, allocated, free_bytes;
  size_t free_extents;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

Snapshot Snap(const SpaceManager& sm) {
  return {sm.end(), sm.allocated_bytes(), sm.free_bytes(), sm.free_extent_count()};
}

std::ostream& operator<<(std::ostream& os, const Snapshot& s) {
  return os << "{end " << s.end << ", allocated " << s.allocated << ", free " << s.free_bytes
            << ", free extents " << s.free_extents << "}";
}

// The message of the std::invalid_argument `fn` throws ("" and a test failure if none).
using testing::InvalidArgumentMessage;

// Allocates `blocks` one-block extents back to back from an empty manager.
std::vector<Extent> AllocateBlocks(SpaceManager& sm, int blocks) {
  std::vector<Extent> out;
  for (int i = 0; i < blocks; ++i) out.push_back(sm.Allocate(kBlock));
  return out;
}

TEST(SpaceManagerTest, RejectsNonPowerOfTwoAlignment) {
  for (uint64_t bad : {uint64_t{0}, uint64_t{3}, uint64_t{4097}, uint64_t{6144},
                       std::numeric_limits<uint64_t>::max()}) {
    EXPECT_THROW(SpaceManager{bad}, std::invalid_argument) << bad;
  }
  for (uint64_t good : {uint64_t{1}, uint64_t{512}, uint64_t{4096}, uint64_t{1} << 63}) {
    EXPECT_EQ(SpaceManager{good}.alignment(), good);
  }
  EXPECT_EQ(SpaceManager{}.alignment(), 4096u);
}

TEST(SpaceManagerTest, RoundsLengthUpToAlignment) {
  SpaceManager sm(512);
  EXPECT_EQ(sm.Allocate(1), (Extent{0, 512}));
  EXPECT_EQ(sm.Allocate(512), (Extent{512, 512}));
  EXPECT_EQ(sm.Allocate(513), (Extent{1024, 1024}));
  EXPECT_EQ(sm.end(), 2048u);
  EXPECT_EQ(sm.allocated_bytes(), 2048u);
  EXPECT_EQ(sm.free_bytes(), 0u);
  EXPECT_EQ(sm.free_extent_count(), 0u);
}

TEST(SpaceManagerTest, ZeroLengthIsEmptyAndFreeIgnoresIt) {
  SpaceManager sm;
  Extent a = sm.Allocate(kBlock);
  Extent empty = sm.Allocate(0);
  EXPECT_EQ(empty, (Extent{0, 0}));
  EXPECT_EQ(Snap(sm), (Snapshot{kBlock, kBlock, 0, 0}));
  sm.Free(empty);
  sm.Free(empty);
  EXPECT_EQ(Snap(sm), (Snapshot{kBlock, kBlock, 0, 0}));
  sm.Free(a);
  sm.Free(empty);  // still fine on an empty manager
  EXPECT_EQ(Snap(sm), (Snapshot{0, 0, 0, 0}));
}

TEST(SpaceManagerTest, GrowsAtEndWhenNothingFits) {
  SpaceManager sm;
  auto b = AllocateBlocks(sm, 3);
  sm.Free(b[1]);  // a one-block hole
  EXPECT_EQ(sm.Allocate(2 * kBlock), (Extent{3 * kBlock, 2 * kBlock}));
  EXPECT_EQ(Snap(sm), (Snapshot{5 * kBlock, 4 * kBlock, kBlock, 1}));
}

TEST(SpaceManagerTest, BestFitPicksSmallestFittingExtent) {
  SpaceManager sm;
  // Holes of 3, 1 and 2 blocks, each followed by a live block.
  Extent h3 = sm.Allocate(3 * kBlock);
  sm.Allocate(kBlock);
  Extent h1 = sm.Allocate(kBlock);
  sm.Allocate(kBlock);
  Extent h2 = sm.Allocate(2 * kBlock);
  sm.Allocate(kBlock);
  sm.Free(h3);
  sm.Free(h1);
  sm.Free(h2);
  ASSERT_EQ(sm.free_extent_count(), 3u);
  EXPECT_EQ(sm.Allocate(2 * kBlock), h2);  // not the first hole that fits
  EXPECT_EQ(sm.Allocate(kBlock), h1);
  EXPECT_EQ(sm.Allocate(1), (Extent{h3.offset, kBlock}));  // only the 3-block hole is left
  EXPECT_EQ(sm.free_extent_count(), 1u);
}

TEST(SpaceManagerTest, BestFitPicksLowestOffsetAmongEquals) {
  SpaceManager sm;
  auto b = AllocateBlocks(sm, 8);
  // Two equal two-block holes, at blocks 5-6 and 1-2; the higher one is freed first, so it is
  // not merely the older entry that wins.
  sm.Free(b[5]);
  sm.Free(b[6]);
  sm.Free(b[1]);
  sm.Free(b[2]);
  ASSERT_EQ(sm.free_extent_count(), 2u);
  EXPECT_EQ(sm.Allocate(2 * kBlock), (Extent{1 * kBlock, 2 * kBlock}));
  EXPECT_EQ(sm.Allocate(2 * kBlock), (Extent{5 * kBlock, 2 * kBlock}));
  EXPECT_EQ(sm.free_extent_count(), 0u);
}

TEST(SpaceManagerTest, CarvesFromFrontOfChosenExtent) {
  SpaceManager sm;
  Extent hole = sm.Allocate(4 * kBlock);
  sm.Allocate(kBlock);
  sm.Free(hole);
  EXPECT_EQ(sm.Allocate(kBlock), (Extent{0, kBlock}));
  EXPECT_EQ(Snap(sm), (Snapshot{5 * kBlock, 2 * kBlock, 3 * kBlock, 1}));
  EXPECT_EQ(sm.Allocate(3 * kBlock), (Extent{kBlock, 3 * kBlock}));  // the remainder, exactly
  EXPECT_EQ(Snap(sm), (Snapshot{5 * kBlock, 5 * kBlock, 0, 0}));
}

TEST(SpaceManagerTest, CoalescesWithLeftNeighbour) {
  SpaceManager sm;
  auto b = AllocateBlocks(sm, 4);
  sm.Free(b[1]);
  sm.Free(b[2]);
  EXPECT_EQ(Snap(sm), (Snapshot{4 * kBlock, 2 * kBlock, 2 * kBlock, 1}));
  EXPECT_EQ(sm.Allocate(2 * kBlock), (Extent{kBlock, 2 * kBlock}));
}

TEST(SpaceManagerTest, CoalescesWithRightNeighbour) {
  SpaceManager sm;
  auto b = AllocateBlocks(sm, 4);
  sm.Free(b[2]);
  sm.Free(b[1]);
  EXPECT_EQ(Snap(sm), (Snapshot{4 * kBlock, 2 * kBlock, 2 * kBlock, 1}));
  EXPECT_EQ(sm.Allocate(2 * kBlock), (Extent{kBlock, 2 * kBlock}));
}

TEST(SpaceManagerTest, CoalescesWithBothNeighbours) {
  SpaceManager sm;
  auto b = AllocateBlocks(sm, 5);
  sm.Free(b[1]);
  sm.Free(b[3]);
  EXPECT_EQ(sm.free_extent_count(), 2u);
  sm.Free(b[2]);
  EXPECT_EQ(Snap(sm), (Snapshot{5 * kBlock, 2 * kBlock, 3 * kBlock, 1}));
  EXPECT_EQ(sm.Allocate(3 * kBlock), (Extent{kBlock, 3 * kBlock}));
}

TEST(SpaceManagerTest, CoalescesAtOffsetZero) {
  SpaceManager sm;
  auto b = AllocateBlocks(sm, 3);
  sm.Free(b[0]);
  sm.Free(b[1]);
  EXPECT_EQ(Snap(sm), (Snapshot{3 * kBlock, kBlock, 2 * kBlock, 1}));
  EXPECT_EQ(sm.Allocate(2 * kBlock), (Extent{0, 2 * kBlock}));
}

TEST(SpaceManagerTest, ShrinksWhenTailIsFreed) {
  SpaceManager sm;
  auto b = AllocateBlocks(sm, 3);
  sm.Free(b[2]);
  EXPECT_EQ(Snap(sm), (Snapshot{2 * kBlock, 2 * kBlock, 0, 0}));
  EXPECT_EQ(sm.Allocate(kBlock), b[2]);  // grows back at the end
  sm.Free(b[0]);
  sm.Free(b[1]);
  sm.Free(b[2]);
  EXPECT_EQ(Snap(sm), (Snapshot{0, 0, 0, 0}));
}

TEST(SpaceManagerTest, ShrinkCascadesThroughHoleFreedFirst) {
  SpaceManager sm;
  auto b = AllocateBlocks(sm, 5);
  sm.Free(b[2]);
  sm.Free(b[3]);  // one hole, blocks 2-3, below the live tail block 4
  EXPECT_EQ(Snap(sm), (Snapshot{5 * kBlock, 3 * kBlock, 2 * kBlock, 1}));
  sm.Free(b[4]);  // the tail and the hole before it all go
  EXPECT_EQ(Snap(sm), (Snapshot{2 * kBlock, 2 * kBlock, 0, 0}));
  sm.Free(b[0]);  // a hole at the front; freeing block 1 then empties everything
  EXPECT_EQ(Snap(sm), (Snapshot{2 * kBlock, kBlock, kBlock, 1}));
  sm.Free(b[1]);
  EXPECT_EQ(Snap(sm), (Snapshot{0, 0, 0, 0}));
}

TEST(SpaceManagerTest, RejectsDoubleFreeAndChangesNothing) {
  SpaceManager sm;
  auto b = AllocateBlocks(sm, 6);
  sm.Free(b[1]);
  sm.Free(b[3]);
  const Snapshot before = Snap(sm);
  const Extent bad[] = {
      b[1],                      // exact double free
      b[3],                      // exact double free, other hole
      {0, 2 * kBlock},           // live block 0 plus free block 1 (overlaps the predecessor)
      {2 * kBlock, 2 * kBlock},  // live block 2 plus free block 3 (overlaps the successor)
      {0, 6 * kBlock},           // spans both holes
      {3 * kBlock, 3 * kBlock},  // starts at a hole
  };
  for (const Extent& e : bad) {
    EXPECT_THROW(sm.Free(e), std::invalid_argument) << e;
    EXPECT_EQ(Snap(sm), before) << e;
  }
  // The holes are intact: best fit hands them back in order.
  EXPECT_EQ(sm.Allocate(kBlock), b[1]);
  EXPECT_EQ(sm.Allocate(kBlock), b[3]);
}

TEST(SpaceManagerTest, RejectsMisalignedExtentAndChangesNothing) {
  SpaceManager sm(512);
  sm.Allocate(8 * 512);
  const Snapshot before = Snap(sm);
  for (const Extent& e : {Extent{1, 512}, Extent{0, 511}, Extent{512, 513}, Extent{256, 1024}}) {
    EXPECT_THROW(sm.Free(e), std::invalid_argument) << e;
    EXPECT_EQ(Snap(sm), before) << e;
  }
}

TEST(SpaceManagerTest, RejectsExtentBeyondEndAndChangesNothing) {
  SpaceManager sm;
  AllocateBlocks(sm, 2);
  const Snapshot before = Snap(sm);
  const uint64_t huge = std::numeric_limits<uint64_t>::max() - kBlock + 1;  // aligned
  for (const Extent& e : {Extent{2 * kBlock, kBlock}, Extent{kBlock, 2 * kBlock},
                          Extent{0, 3 * kBlock}, Extent{kBlock, huge}, Extent{huge, kBlock}}) {
    EXPECT_THROW(sm.Free(e), std::invalid_argument) << e;
    EXPECT_EQ(Snap(sm), before) << e;
  }
  SpaceManager empty;
  EXPECT_THROW(empty.Free(Extent{0, kBlock}), std::invalid_argument);
  EXPECT_EQ(Snap(empty), (Snapshot{0, 0, 0, 0}));
}

TEST(SpaceManagerTest, ErrorMessagesNameOffsetAndLength) {
  SpaceManager sm;
  auto b = AllocateBlocks(sm, 3);
  sm.Free(b[1]);
  for (const Extent& e : {b[1], Extent{4097, 8192}, Extent{1 << 20, kBlock}}) {
    const std::string message = InvalidArgumentMessage([&] { sm.Free(e); });
    EXPECT_NE(message.find("offset " + std::to_string(e.offset)), std::string::npos) << message;
    EXPECT_NE(message.find("length " + std::to_string(e.length)), std::string::npos) << message;
  }
}

TEST(SpaceManagerTest, LengthErrorNearInt64Max) {
  SpaceManager sm;
  EXPECT_THROW(sm.Allocate(std::numeric_limits<uint64_t>::max()), std::length_error);
  EXPECT_THROW(sm.Allocate(kInt64Max + 1), std::length_error);
  EXPECT_THROW(sm.Allocate(kInt64Max), std::length_error);  // rounds up to 2^63
  EXPECT_EQ(Snap(sm), (Snapshot{0, 0, 0, 0}));

  const uint64_t largest = kInt64Max - (kInt64Max % kBlock);  // 2^63 - 4096
  Extent first = sm.Allocate(largest - kBlock);
  EXPECT_EQ(first, (Extent{0, largest - kBlock}));
  Extent last = sm.Allocate(1);  // exactly reaches the largest aligned end
  EXPECT_EQ(last, (Extent{largest - kBlock, kBlock}));
  EXPECT_EQ(sm.end(), largest);
  const Snapshot full = Snap(sm);
  EXPECT_THROW(sm.Allocate(1), std::length_error);
  EXPECT_EQ(Snap(sm), full);

  // Space freed below the end is still usable; the end is not.
  sm.Free(first);
  EXPECT_EQ(sm.Allocate(kBlock), (Extent{0, kBlock}));
  sm.Free(last);
  EXPECT_EQ(Snap(sm), (Snapshot{kBlock, kBlock, 0, 0}));

  SpaceManager coarse(uint64_t{1} << 63);  // every extent is 2^63 bytes: none fits
  EXPECT_THROW(coarse.Allocate(1), std::length_error);
  EXPECT_EQ(coarse.Allocate(0), (Extent{0, 0}));
}

// ---------------------------------------------------------------------------------------------
// Randomized comparison with a brute-force model

// One byte per block below end; the same best-fit policy by linear scan. (The scans use raw
// pointers because Debug+ASan makes vector::operator[] costly.)
class Model {
 public:
  explicit Model(uint64_t block) : block_(block) {}

  Extent Allocate(uint64_t bytes) {
    if (bytes == 0) return {};
    const size_t n = (bytes + block_ - 1) / block_;
    const uint8_t* used = used_.data();
    const size_t size = used_.size();
    size_t best = size, best_length = SIZE_MAX;
    for (size_t i = 0; i < size;) {
      if (used[i]) {
        ++i;
        continue;
      }
      size_t j = i;
      while (j < size && !used[j]) ++j;
      if (j - i >= n && j - i < best_length) best = i, best_length = j - i;  // strict: lowest wins
      i = j;
    }
    if (best == size) used_.resize(size + n, 0);
    std::fill_n(used_.data() + best, n, 1);
    return {best * block_, n * block_};
  }

  void Free(const Extent& e) {
    std::fill_n(used_.data() + e.offset / block_, e.length / block_, 0);
    while (!used_.empty() && !used_.back()) used_.pop_back();
  }

  // Whether Free(e) must be rejected: some block of `e` is free or at/after end.
  bool TouchesFreeOrBeyond(const Extent& e) const {
    const uint64_t first = e.offset / block_, blocks = e.length / block_;
    if (first + blocks > used_.size()) return true;
    return std::find(used_.data() + first, used_.data() + first + blocks, 0) !=
           used_.data() + first + blocks;
  }

  uint64_t end_blocks() const { return used_.size(); }

  Snapshot Snap() const {
    Snapshot s{used_.size() * block_, 0, 0, 0};
    const uint8_t* used = used_.data();
    const size_t size = used_.size();
    uint64_t free_blocks = 0;
    for (size_t i = 0; i < size; ++i) {
      if (!used[i]) {
        ++free_blocks;
        if (i == 0 || used[i - 1]) ++s.free_extents;
      }
    }
    s.free_bytes = free_blocks * block_;
    s.allocated = s.end - s.free_bytes;
    return s;
  }

 private:
  uint64_t block_;
  std::vector<uint8_t> used_;
};

// Whether `e` lies below `end` and overlaps none of `live` (checked as each extent is handed out,
// which keeps every pair of live extents disjoint).
::testing::AssertionResult Disjoint(const Extent& e, const std::vector<Extent>& live,
                                    uint64_t end) {
  if (e.offset + e.length > end) {
    return ::testing::AssertionFailure() << e << " reaches past end " << end;
  }
  for (const Extent& other : live) {
    if (e.offset < other.offset + other.length && other.offset < e.offset + e.length) {
      return ::testing::AssertionFailure() << e << " overlaps live " << other;
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(SpaceManagerTest, MatchesBruteForceModel) {
  constexpr int kSeeds = 20;
  constexpr int kSteps = 3000;
  constexpr int kPhase = 400;  // steps per growing or shrinking phase
  for (int seed = 0; seed < kSeeds; ++seed) {
    const uint64_t block = seed % 2 == 0 ? 4096 : 512;
    std::mt19937_64 rng(seed);
    auto uniform = [&](uint64_t lo, uint64_t hi) {  // inclusive
      return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
    };
    SpaceManager sm(block);
    Model model(block);
    std::vector<Extent> live;
    Extent last_freed{};
    for (int step = 0; step < kSteps; ++step) {
      const bool growing = (step / kPhase) % 2 == 0;
      const uint64_t roll = uniform(0, 99);
      if (roll < 4) {
        // A Free the model says must fail: a recent double free or a random aligned range.
        Extent probe = last_freed;
        if (roll >= 2 || probe.length == 0) {
          probe = {uniform(0, model.end_blocks() + 2) * block, uniform(1, 8) * block};
        }
        if (!model.TouchesFreeOrBeyond(probe)) continue;
        const Snapshot before = Snap(sm);
        ASSERT_THROW(sm.Free(probe), std::invalid_argument)
            << "seed " << seed << " step " << step << " " << probe;
        ASSERT_EQ(Snap(sm), before) << "seed " << seed << " step " << step;
      } else if (live.empty() || roll < (growing ? 70u : 30u)) {
        uint64_t blocks = 0;
        const uint64_t kind = uniform(0, 99);
        if (kind < 5) {
          blocks = 0;
        } else if (kind < 70) {
          blocks = uniform(1, 4);
        } else if (kind < 95) {
          blocks = uniform(5, 16);
        } else {
          blocks = uniform(17, 64);
        }
        // Any byte count that rounds up to `blocks` blocks.
        const uint64_t bytes = blocks == 0 ? 0 : blocks * block - uniform(0, block - 1);
        const Extent expected = model.Allocate(bytes);
        const Extent got = sm.Allocate(bytes);
        ASSERT_EQ(got, expected) << "seed " << seed << " step " << step << " bytes " << bytes;
        if (got.length != 0) {
          ASSERT_TRUE(Disjoint(got, live, sm.end())) << "seed " << seed << " step " << step;
          live.push_back(got);
        }
      } else {
        const size_t i = uniform(0, live.size() - 1);
        const Extent e = live[i];
        live[i] = live.back();
        live.pop_back();
        sm.Free(e);
        model.Free(e);
        last_freed = e;
      }
      ASSERT_EQ(Snap(sm), model.Snap()) << "seed " << seed << " step " << step;
    }
    // Freeing everything left, in random order, empties the space.
    std::shuffle(live.begin(), live.end(), rng);
    for (const Extent& e : live) {
      sm.Free(e);
      model.Free(e);
      ASSERT_EQ(Snap(sm), model.Snap()) << "seed " << seed;
    }
    ASSERT_EQ(Snap(sm), (Snapshot{0, 0, 0, 0})) << "seed " << seed;
  }
}

}  // namespace
}  // namespace tensortier
