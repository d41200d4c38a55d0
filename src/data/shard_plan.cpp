#include "tensortier/data/shard_plan.hpp"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

// SplitMix64's output function: a bijection whose outputs for nearby inputs look unrelated.
uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t SplitMix64(uint64_t& state) {
  return Mix64(state += kGamma);
}

// A uniform integer in [0, bound), bound > 0 (Lemire, "Fast random integer generation in an
// interval", 2019): no modulo bias.
uint64_t Bounded(uint64_t& state, uint64_t bound) {
  unsigned __int128 m = static_cast<unsigned __int128>(SplitMix64(state)) * bound;
  auto low = static_cast<uint64_t>(m);
  if (low < bound) {
    const uint64_t threshold = -bound % bound;
    while (low < threshold) {
      m = static_cast<unsigned __int128>(SplitMix64(state)) * bound;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

}  // namespace

uint64_t ShardStart(uint64_t shard_id, uint64_t num_shards, uint64_t size) {
  return static_cast<uint64_t>(static_cast<unsigned __int128>(size) * shard_id / num_shards);
}

uint64_t ShardPaddedSize(uint64_t num_shards, uint64_t size) {
  return size / num_shards + (size % num_shards != 0 ? 1 : 0);
}

std::vector<uint64_t> EpochPermutation(uint64_t size, uint64_t seed, uint64_t epoch,
                                       uint64_t version) {
  if (version != 1 && version != 2) {
    throw std::invalid_argument(StrCat("shuffle_version ", version, " is not one of 1, 2"));
  }
  std::vector<uint64_t> order(size);
  for (uint64_t i = 0; i < size; ++i) order[i] = i;
  uint64_t state = version == 1 ? seed ^ (kGamma * (epoch + 1)) : Mix64(Mix64(seed) + epoch);
  for (uint64_t i = size; i > 1; --i) {
    std::swap(order[i - 1], order[Bounded(state, i)]);
  }
  return order;
}

ShardPlan::ShardPlan(ShardSpec spec, uint64_t num_files) : spec_(spec), num_files_(num_files) {
  if (spec_.batch_size == 0) throw std::invalid_argument("batch_size must be at least 1");
  if (spec_.num_shards == 0) throw std::invalid_argument("num_shards must be at least 1");
  if (spec_.shuffle_version != 1 && spec_.shuffle_version != 2) {
    throw std::invalid_argument(
        StrCat("shuffle_version ", spec_.shuffle_version, " is not one of 1, 2"));
  }
  if (spec_.shard_id >= spec_.num_shards) {
    throw std::invalid_argument(
        StrCat("shard_id ", spec_.shard_id, " is out of range for ", spec_.num_shards, " shards"));
  }
  if (num_files_ < spec_.num_shards) {
    throw std::invalid_argument(StrCat("there are ", num_files_, " files, fewer than the ",
                                       spec_.num_shards, " shards asked for"));
  }
  if (spec_.pad_last_batch) {
    // DALI pads to ceil(size / num_shards), then on to the end of the batch. Every epoch lists
    // its padded samples, so a padding past what a list can hold is refused here, not wrapped.
    const uint64_t shard = ShardPaddedSize(spec_.num_shards, num_files_);
    const unsigned __int128 batches = shard / spec_.batch_size + (shard % spec_.batch_size != 0);
    const unsigned __int128 padded = batches * spec_.batch_size;
    if (padded > std::vector<uint64_t>().max_size()) {
      throw std::invalid_argument(StrCat(
          "batch_size ", spec_.batch_size, " with pad_last_batch pads each shard of up to ", shard,
          " files to a whole batch, more samples than an epoch can list: use a batch "
          "size near the shard's file count, or pad_last_batch=False"));
    }
    padded_size_ = static_cast<uint64_t>(padded);
  }
}

uint64_t ShardPlan::ShardOfEpoch(uint64_t epoch) const {
  if (spec_.stick_to_shard) return spec_.shard_id;
  return (spec_.shard_id + epoch % spec_.num_shards) % spec_.num_shards;
}

std::vector<uint64_t> ShardPlan::EpochSamples(uint64_t epoch) const {
  const uint64_t shard = ShardOfEpoch(epoch);
  const uint64_t begin = ShardStart(shard, spec_.num_shards, num_files_);
  const uint64_t end = ShardStart(shard + 1, spec_.num_shards, num_files_);
  std::vector<uint64_t> samples;
  if (spec_.shuffle && spec_.stick_to_shard) {
    // The shard keeps its files in every epoch, as DALI's does (a node reads, and may cache,
    // only its shard): cut from epoch 0's permutation, then put in a new order each epoch.
    std::vector<uint64_t> order =
        EpochPermutation(num_files_, spec_.seed, 0, spec_.shuffle_version);
    const std::vector<uint64_t> files(order.begin() + static_cast<ptrdiff_t>(begin),
                                      order.begin() + static_cast<ptrdiff_t>(end));
    if (epoch == 0) {
      samples = files;
    } else {
      for (uint64_t i : EpochPermutation(files.size(), spec_.seed, epoch, spec_.shuffle_version)) {
        samples.push_back(files[i]);
      }
    }
  } else if (spec_.shuffle) {
    std::vector<uint64_t> order =
        EpochPermutation(num_files_, spec_.seed, epoch, spec_.shuffle_version);
    samples.assign(order.begin() + static_cast<ptrdiff_t>(begin),
                   order.begin() + static_cast<ptrdiff_t>(end));
  } else {
    for (uint64_t i = begin; i < end; ++i) samples.push_back(i);
  }
  if (spec_.pad_last_batch) {
    const uint64_t last = samples.back();  // shards are never empty: num_files >= num_shards
    samples.resize(padded_size_, last);
  }
  return samples;
}

std::vector<std::vector<uint64_t>> ShardPlan::EpochBatches(uint64_t epoch) const {
  std::vector<uint64_t> samples = EpochSamples(epoch);
  std::vector<std::vector<uint64_t>> batches;
  for (size_t begin = 0; begin < samples.size(); begin += spec_.batch_size) {
    const size_t end = std::min<size_t>(samples.size(), begin + spec_.batch_size);
    if (end - begin < spec_.batch_size && spec_.drop_last) break;
    batches.emplace_back(samples.begin() + static_cast<ptrdiff_t>(begin),
                         samples.begin() + static_cast<ptrdiff_t>(end));
  }
  return batches;
}

}  // namespace tensortier
