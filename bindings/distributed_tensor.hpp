// The distributed layout's tensor as the package holds it (tensortier.shared builds the layout on
// torch.distributed; the C++ group maps the other layouts).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <vector>

#include "tensortier/shared/shared_exchange.hpp"
#include "tensortier/shared/shared_spec.hpp"

namespace tensortier {

// A distributed tensor as this rank holds it: its rows in private memory (zero-filled), the other
// ranks' rows reached only through the exchange's rounds (torch.distributed in Python).
class DistributedTensor {
 public:
  DistributedTensor(const SharedTensorSpec& spec, int rank, int world_size)
      : spec_(spec),
        rank_(rank),
        partitions_(PartitionRows(spec.rows(), spec.row_bytes(), world_size, 1)),
        exchange_(Ends(partitions_), rank, spec.row_bytes()) {
    SharedPartition& mine = partitions_.at(static_cast<size_t>(rank));
    memory_.reset(std::calloc(mine.bytes == 0 ? 1 : mine.bytes, 1), std::free);
    if (!memory_) throw std::bad_alloc();
    mine.address = mine.bytes == 0 ? nullptr : static_cast<uint8_t*>(memory_.get());
  }

  const SharedTensorSpec& spec() const { return spec_; }
  const std::vector<SharedPartition>& partitions() const { return partitions_; }
  int rank() const { return rank_; }
  SharedRowExchange& exchange() { return exchange_; }
  uint8_t* data() const {
    throw std::logic_error("a distributed tensor has no single address: use its partitions");
  }
  bool closed() const {
    std::lock_guard lock(mutex_);
    return !memory_;
  }
  std::shared_ptr<void> memory() const {
    std::lock_guard lock(mutex_);
    if (!memory_) throw std::runtime_error("the shared tensor was closed (finalized)");
    return memory_;
  }
  void Close() {
    std::lock_guard lock(mutex_);
    memory_.reset();
  }

 private:
  static std::vector<uint64_t> Ends(const std::vector<SharedPartition>& parts) {
    std::vector<uint64_t> ends;
    for (const auto& p : parts) ends.push_back(p.row_begin + p.rows);
    return ends;
  }

  SharedTensorSpec spec_;
  int rank_;
  std::vector<SharedPartition> partitions_;
  SharedRowExchange exchange_;
  mutable std::mutex mutex_;
  std::shared_ptr<void> memory_;
};

}  // namespace tensortier
