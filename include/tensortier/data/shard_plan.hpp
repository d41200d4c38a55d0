// Which files a reader returns in each epoch, and in which order: shards, padding and shuffling as
// NVIDIA DALI's fn.readers.file computes them, with a seeded global shuffle instead of DALI's
// shuffle buffer.
//
// Shard boundaries (DALI's loader.cc): shard k of n over `size` files starts at
// size * k / n; every shard is padded, when asked, to ceil(size / n) samples by repeating its
// last sample, then to a whole batch. Without stick_to_shard a reader moves to the next shard
// each epoch: in epoch e, shard_id reads shard (shard_id + e) % num_shards (DALI's virtual shard).
//
// Shuffle: every epoch the whole list is permuted by EpochPermutation(size, seed, epoch) before
// the shard is cut out of it. The permutation is a function of (size, seed, epoch) only, the same
// on every rank, so shards never overlap within an epoch. With stick_to_shard the shard keeps
// the files it has in epoch 0 (cut from EpochPermutation(size, seed, 0)), as a DALI reader stuck
// to its shard reads the same files every epoch; in a later epoch e they come in the order
// EpochPermutation(shard size, seed, e). Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

namespace tensortier {

// DALI's start_index(): first sample of shard `shard_id` of `num_shards` over `size` samples.
uint64_t ShardStart(uint64_t shard_id, uint64_t num_shards, uint64_t size);
// DALI's num_samples(): ceil(size / num_shards), the padded length of every shard.
uint64_t ShardPaddedSize(uint64_t num_shards, uint64_t size);

// The shuffle's rules, recorded in a reader's state dict so that a run resumes with the order
// it started with. 1: SplitMix64 started at seed ^ (0x9E3779B97F4A7C15 * (epoch + 1)), which for
// seed 0 makes epoch e + 1 draw epoch e's numbers shifted by one (consecutive epochs' orders
// correlated); kept only to resume states taken under it. 2: started at
// Mix64(Mix64(seed) + epoch), unrelated from epoch to epoch.
inline constexpr uint64_t kShuffleVersion = 2;

// A permutation of [0, size): Fisher-Yates from the last position down, drawing each position's
// partner with Lemire's bounded-integer method from SplitMix64 started as `version` says.
// Identical everywhere (no std:: distributions).
std::vector<uint64_t> EpochPermutation(uint64_t size, uint64_t seed, uint64_t epoch,
                                       uint64_t version = kShuffleVersion);

struct ShardSpec {
  uint64_t batch_size = 256;
  bool shuffle = true;
  uint64_t seed = 0;
  uint64_t shard_id = 0;
  uint64_t num_shards = 1;
  bool stick_to_shard = false;
  bool pad_last_batch = false;
  // Without padding, an epoch's last batch is short; drop_last leaves it out.
  bool drop_last = false;
  uint64_t shuffle_version = kShuffleVersion;  // EpochPermutation's rules
};

class ShardPlan {
 public:
  // Throws std::invalid_argument for a zero batch size or shard count, shard_id >= num_shards,
  // fewer files than shards (DALI's rule), or a pad_last_batch padding past what a list holds.
  ShardPlan(ShardSpec spec, uint64_t num_files);

  const ShardSpec& spec() const noexcept { return spec_; }
  uint64_t num_files() const noexcept { return num_files_; }
  // The shard read in `epoch`.
  uint64_t ShardOfEpoch(uint64_t epoch) const;
  // File indices returned in `epoch`, in order, padding included (padding repeats an index).
  std::vector<uint64_t> EpochSamples(uint64_t epoch) const;
  // EpochSamples cut into batches of batch_size (the last short one dropped with drop_last).
  std::vector<std::vector<uint64_t>> EpochBatches(uint64_t epoch) const;

 private:
  ShardSpec spec_;
  uint64_t num_files_;
  uint64_t padded_size_ = 0;  // samples of every epoch with pad_last_batch
};

}  // namespace tensortier
