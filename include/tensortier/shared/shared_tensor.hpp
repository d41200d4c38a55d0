// Shared tensors: one tensor whose rows every process of a job sees, in shared host memory or in
// the memory of the job's GPUs.
//
// Each rank owns a partition of the rows: it creates the partition's memory (an anonymous
// memfd, mode 0600, size sealed), faults it in first (so the pages sit near it) and hands the
// descriptor to its peers over an abstract-namespace Unix socket whose name carries a random
// token agreed through the job's Store. Peers must run as the same user (SO_PEERCRED). Nothing is
// ever created in a filesystem (/dev/shm, /tmp): when the last process holding a partition exits,
// however it exits, the memory goes back to the kernel.
//
// Device memory (SharedMemory::kDevice): each rank's partition is physical memory on its own GPU
// (cuMemCreate, rounded up to the allocation granularity), exported as a POSIX descriptor and
// passed the same way; every process imports its peers' partitions and maps them all into one
// range of device addresses it reserved (cuMemAddressReserve, cuMemMap), readable and writable by
// every GPU of the group this process can see (cuMemSetAccess). Partition addresses are then
// device addresses: host code must not dereference them (Gather/Scatter throw; copy through
// CUDA, or take a CUDA view from Python). Host memory is registered with CUDA (page-locked,
// portable) when a driver is present, so copies to and from GPUs run at full speed.
//
// Layouts: kContinuous maps every partition, in rank order, into one reserved address range, so
// each process sees the whole tensor as one array; kChunked maps each partition on its own.
// kDistributed partitions are never mapped by other processes (they may be on other machines):
// the Python layer moves their rows through torch.distributed's all-to-alls, which
// SharedRowExchange (shared_exchange.hpp) plans; here it only names the layout, so that ranks
// agree on it (Agree) and partition it (PartitionRows) the same way.
//
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tensortier/shared/shared_group.hpp"
#include "tensortier/shared/shared_rows.hpp"
#include "tensortier/shared/shared_spec.hpp"

namespace tensortier {

namespace shared {
class PartitionServer;
class UniqueFd;
}  // namespace shared

struct SharedTensorStats {
  uint64_t local_bytes = 0;       // this rank's partition
  bool huge_pages = false;        // the local partition is on hugetlb pages
  std::string huge_pages_reason;  // why not, when not
  // Host memory: every partition's mapping in this process is registered with CUDA (page-locked,
  // portable); false without a CUDA driver, or when registering failed (then the reason says why).
  bool cuda_registered = false;
  std::string cuda_registered_reason;
  int device = -1;           // device memory: this process's GPU (else -1)
  uint64_t granularity = 0;  // device memory: what every partition's allocation is rounded up to
  // Otherwise: MADV_HUGEPAGE was given on the partition's mappings, where the kernel's
  // shmem_enabled policy lets shared memory have transparent huge pages on advice.
  bool shmem_huge_pages = false;
  std::string shmem_huge_pages_reason;  // why not, when not
};

// A shared tensor as this process sees it. Thread-safe: Gather/Scatter may run concurrently with
// each other and with Close (they then either finish on memory that stays mapped or throw).
class SharedTensor {
 public:
  const SharedTensorSpec& spec() const noexcept { return spec_; }
  const std::vector<SharedPartition>& partitions() const noexcept { return partitions_; }
  // This process's rank in the group that owns the tensor; -1 when attached from outside it.
  int rank() const noexcept { return rank_; }
  // This rank's partition. Throws std::logic_error when attached from outside the group.
  const SharedPartition& local() const;
  const SharedTensorStats& stats() const noexcept { return stats_; }
  // The whole tensor as one array (kContinuous only; throws std::logic_error otherwise). A device
  // address for device memory.
  uint8_t* data() const;
  // Keeps every mapping of this tensor alive while held (views handed to Python hold one).
  // Throws std::logic_error after Close.
  std::shared_ptr<void> memory() const;

  // Copies rows `indices[0..count)` (any order, repeats allowed) to `out` (count x row_bytes),
  // or `in` to those rows. Every index is checked first (std::out_of_range names the first bad
  // one, nothing is copied); large batches run on several threads.
  void Gather(const int64_t* indices, size_t count, void* out) const;
  void Scatter(const int64_t* indices, size_t count, const void* in);

  // Stops serving this rank's partition to peers and drops this object's hold on the memory
  // (views still held keep theirs). Later calls throw std::logic_error. Idempotent.
  void Close();
  bool closed() const;

  ~SharedTensor();

 private:
  friend class SharedGroup;
  friend std::shared_ptr<SharedTensor> AttachSharedTensor(Store& store, const std::string& name,
                                                          std::chrono::milliseconds timeout);
  struct Memory;
  SharedTensor() = default;
  std::shared_ptr<Memory> Hold() const;
  void CopyRows(const int64_t* indices, size_t count, uint8_t* buffer, bool gather) const;
  // Registers every partition's host mapping with CUDA through `device`'s context, when a
  // driver is present; the stats say whether it did.
  void RegisterWithCuda(int device);

  // Host memory. The partitions of `spec` over `world_size` ranks and, for kContinuous, the
  // reserved address range they are mapped into (nothing mapped yet); `rank` is -1 outside the
  // owning group.
  static std::shared_ptr<SharedTensor> Layout(const SharedTensorSpec& spec, const std::string& key,
                                              int world_size, int rank);
  // Creates this rank's partition (a sealed memfd: hugetlb pages for huge tensors where the
  // kernel has them, else ordinary pages with transparent huge pages on advice where the kernel
  // gives them) and maps it, faulted in; returns the descriptor to serve (invalid for an empty
  // partition). `shmem_policy` is the kernel's shmem_enabled word ("" for small tensors).
  shared::UniqueFd CreateLocalPartition(bool huge, const std::string& shmem_policy);
  // Maps descriptor `fd` as partition `r`; returns 0 or the errno of mmap.
  int MapPartition(int r, int fd, bool populate);
  // Fetches every non-empty partition but `skip_rank`'s from the ranks serving it under `token`.
  void FetchPartitions(const std::string& token, int skip_rank, std::chrono::milliseconds timeout);

  SharedTensorSpec spec_;
  std::vector<SharedPartition> partitions_;
  SharedTensorStats stats_;
  int rank_ = 0;
  std::string key_;  // the name this rank serves its partition under
  // The group's partition server (unregistered from on Close).
  std::shared_ptr<shared::PartitionServer> server_;
  mutable std::mutex mutex_;
  std::shared_ptr<Memory> memory_;
};

// The name of the shared tensor whose host memory in this process holds `address` (while that
// memory is mapped), or nullopt: what must not be copied away from it by torch's pickling.
std::optional<std::string> SharedTensorNameAt(const void* address);

}  // namespace tensortier
