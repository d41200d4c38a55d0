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
// the Python layer moves their rows through torch.distributed; here it only names the layout,
// so that ranks agree on it (Agree) and partition it (PartitionRows) the same way.
//
// Collective calls (the SharedGroup constructor, Create, Barrier) must be made by every rank in
// the same order. Ranks that disagree on a call, or make different calls at one point, all get
// std::invalid_argument naming who asked for what; a rank that dies or does not arrive makes the
// others throw IoError (ETIMEDOUT, or ECONNREFUSED/ECONNRESET) within the group's timeout.
// Nothing waits forever.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensortier/shared/shared_store.hpp"

namespace tensortier {

enum class SharedLayout { kContinuous, kChunked, kDistributed };
enum class SharedMemory { kHost, kDevice };

// "continuous" / "chunked" / "distributed"; Parse throws std::invalid_argument for anything else.
const char* SharedLayoutName(SharedLayout layout);
SharedLayout ParseSharedLayout(const std::string& name);
// "host" / "device"; Parse throws std::invalid_argument for anything else.
const char* SharedMemoryName(SharedMemory memory);
SharedMemory ParseSharedMemory(const std::string& name);

// How long collective calls wait for the other ranks unless told otherwise.
inline constexpr std::chrono::milliseconds kDefaultSharedTimeout{std::chrono::minutes(2)};
// The most bytes a shared tensor may span: more than any address space maps (x86-64 and arm64
// user space end below 2^57), and far enough from 2^64 that sizes rounded up never wrap.
inline constexpr uint64_t kMaxSharedTensorBytes = 1ull << 56;
// The most processes a tensor mapped in host memory can have: they run on one machine, which
// never runs more (Linux's PID_MAX_LIMIT on 64-bit).
inline constexpr int kMaxSharedWorldSize = 1 << 22;

// What a collective Create asks for. Row-major, dense; the first dimension is the row dimension
// partitioned across ranks (a 0-d tensor is one row).
struct SharedTensorSpec {
  std::string name;   // "" for an anonymous tensor (it cannot be attached by name)
  std::string dtype;  // compared between ranks, never interpreted ("float32")
  uint64_t element_size = 0;
  std::vector<int64_t> shape;
  SharedLayout layout = SharedLayout::kContinuous;
  SharedMemory memory = SharedMemory::kHost;

  uint64_t rows() const;
  uint64_t row_bytes() const;
  // One line naming every field: what ranks compare and what error messages show.
  std::string Describe() const;
  // The round trip of Describe (attach reads it back from the store). Throws invalid_argument
  // naming the field that is missing or not a number; the values are not checked (Validate).
  static SharedTensorSpec Parse(const std::string& described);
  // Throws std::invalid_argument naming the first field no tensor can have: a negative
  // dimension, element_size 0, more than kMaxSharedTensorBytes in all or in a row, an empty
  // dtype or one with a space, or a torch dtype ("torch.float32") of another element size.
  void Validate() const;
};

// One rank's rows [row_begin, row_begin + rows) at `address` in this process.
struct SharedPartition {
  int rank = 0;
  uint64_t row_begin = 0;
  uint64_t rows = 0;
  uint64_t bytes = 0;
  uint8_t* address = nullptr;  // nullptr when rows == 0; a device address for device memory
};

// Splits `rows` rows of `row_bytes` into `world_size` partitions in rank order. Every partition
// but the last non-empty one holds a multiple of `granule_bytes` (a page: the partitions of a
// continuous tensor are mapped back to back), so sizes can differ and some can be zero.
std::vector<SharedPartition> PartitionRows(uint64_t rows, uint64_t row_bytes, int world_size,
                                           uint64_t granule_bytes);

// Row copies by index: the loop under every gather and scatter of every layout. Rows
// `indices[i] - first_row` of `table` (`table_rows` rows of `row_bytes`) go to row i of `out`, or
// row i of `in` to them. Every index is checked first (std::out_of_range names the first bad
// one; nothing is copied). Rows ahead are prefetched (random rows miss the caches and the TLB);
// batches of at least kParallelRowCopyBytes run on several threads.
inline constexpr uint64_t kParallelRowCopyBytes = 4ull << 20;
void GatherRows(const void* table, uint64_t table_rows, uint64_t row_bytes, uint64_t first_row,
                const int64_t* indices, size_t count, void* out);
void ScatterRows(void* table, uint64_t table_rows, uint64_t row_bytes, uint64_t first_row,
                 const int64_t* indices, size_t count, const void* in);

// Routing of a batch of row indices to the ranks that own them (the distributed layout).
// `ends[r]` is the end row of rank r's partition (rank order, so ends ascend). Writes the stable
// permutation that groups the batch by owner to `order` (count entries) and returns how many
// rows each rank owns; `bad` is the position of the first index outside [0, ends.back()), or -1
// (the counts are then zero and `order` unspecified).
struct RowRoute {
  std::vector<uint64_t> counts;
  int64_t bad = -1;
};
RowRoute RouteRows(const int64_t* indices, size_t count, const std::vector<uint64_t>& ends,
                   int64_t* order);

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

class SharedGroup;

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

  SharedTensorSpec spec_;
  std::vector<SharedPartition> partitions_;
  SharedTensorStats stats_;
  int rank_ = 0;
  std::string key_;               // the name this rank serves its partition under
  std::shared_ptr<void> server_;  // the group's partition server (unregistered from on Close)
  mutable std::mutex mutex_;
  std::shared_ptr<Memory> memory_;
};

// The processes of a job, rendezvoused through `store`. Serves this rank's partitions to peers
// from one thread (no store traffic there: all store calls happen on the calling thread).
class SharedGroup {
 public:
  // Collective. Rank 0 draws a random token and publishes it; every rank starts serving.
  // `store` must outlive nothing: the group keeps a reference. The group's keys in the store are
  // its own (the nth group of `world_size` processes each rank creates on this store, counted by
  // the store), so groups made one after another on one store never meet each other's keys:
  // every rank creates its groups on one store in the same order (std::invalid_argument when a
  // peer is seen to have created more), and processes that are not in one group but create
  // groups on one store at the same time (two jobs) must use distinct stores or key prefixes.
  SharedGroup(std::shared_ptr<Store> store, int rank, int world_size,
              std::chrono::milliseconds timeout = kDefaultSharedTimeout);
  ~SharedGroup();
  SharedGroup(const SharedGroup&) = delete;
  SharedGroup& operator=(const SharedGroup&) = delete;

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  // The abstract socket name this rank serves on (without the leading NUL).
  const std::string& socket_name() const noexcept;
  // Connections refused because the peer ran as another user.
  uint64_t refused_peers() const;

  // Collective: every rank passes an equal spec (else std::invalid_argument on all). The
  // layout is kContinuous or kChunked. `device` is this process's GPU: where its partition of a
  // device-memory tensor lives, and the context host memory is registered through. A failure on
  // any rank (CudaError, IoError) makes every rank throw: the failing rank its own error, the
  // others std::runtime_error naming it. Nothing stays allocated, mapped or served after a throw.
  std::shared_ptr<SharedTensor> Create(const SharedTensorSpec& spec, int device = 0);
  // Not collective: maps a named host-memory tensor (its owners must still hold it), waiting up
  // to the group's timeout for it to be created. One that this group created has this rank's
  // local() partition; one that another group created is attached as by AttachSharedTensor.
  // Device-memory tensors cannot be attached (std::invalid_argument).
  std::shared_ptr<SharedTensor> Attach(const std::string& name, int device = 0);
  // Collective: returns when every rank has called it (IoError ETIMEDOUT otherwise).
  void Barrier(const std::string& what);
  // Collective exchange of one string per rank (the control path of the layers above). `what`
  // names the call: when ranks make different calls at one point (one a barrier, another a
  // create), every rank throws std::invalid_argument naming which ranks called what.
  std::vector<std::string> AllGather(const std::string& what, const std::string& value);
  // Collective: returns when every rank passed an equal `value`; otherwise every rank throws
  // std::invalid_argument naming which ranks passed what (`what` starts the message).
  void Agree(const std::string& what, const std::string& value);
  // Collective: every rank reports whether its step `what` worked (`failure` null) or not. Returns
  // every rank's `value` when all did; otherwise rethrows `failure` on the failing ranks (even
  // when a peer never arrives) and throws std::runtime_error on the others naming each failing
  // rank, in rank order, with its error's text.
  std::vector<std::string> Settle(const std::string& what, std::exception_ptr failure,
                                  const std::string& value = "");

  // Closes every tensor this group created or attached and stops serving. Idempotent; not
  // collective (peers still mapping this rank's memory keep it).
  void Close();

 private:
  friend class SharedTensor;
  struct Server;
  std::shared_ptr<SharedTensor> Map(const SharedTensorSpec& spec, const std::string& key,
                                    bool own_partition, int device);
  std::shared_ptr<SharedTensor> MapDevice(const SharedTensorSpec& spec, const std::string& key,
                                          int device);
  // Keeps a weak reference to `tensor` (closed with the group), forgetting those dropped.
  void Remember(const std::shared_ptr<SharedTensor>& tensor);
  // The partitions of `spec` over `world_size` ranks and, for kContinuous, the reserved address
  // range they are mapped into (nothing mapped yet); `rank` is -1 outside the owning group.
  static std::shared_ptr<SharedTensor> Layout(const SharedTensorSpec& spec, const std::string& key,
                                              int world_size, int rank);
  // Maps descriptor `fd` as partition `r` of `t`; returns 0 or the errno of mmap.
  static int MapPartition(SharedTensor& t, int r, int fd, bool populate);
  // Fetches every non-empty partition but `skip_rank`'s from the ranks serving it under `token`.
  static void FetchPartitions(SharedTensor& t, const std::string& token, int skip_rank,
                              std::chrono::milliseconds timeout);
  friend std::shared_ptr<SharedTensor> AttachSharedTensor(Store& store, const std::string& name,
                                                          std::chrono::milliseconds timeout);

  std::shared_ptr<Store> store_;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::string prefix_;
  std::string token_;
  std::string socket_name_;
  uint64_t next_collective_ = 0;
  std::shared_ptr<Server> server_;
  std::vector<std::weak_ptr<SharedTensor>> tensors_;
};

// Maps the tensor that some group created under `name` in `store` from a process outside that
// group (started later, in another job step, an evaluation process): it needs only the store the
// group met through, not a group of its own. Not collective; waits up to `timeout` for the tensor
// to be created. The owners must still hold it (each rank serves its partition to peers of the
// same user until it closes the tensor or exits); once mapped, the memory stays valid here after
// they exit, until this process drops the tensor. Names are unique per store: the last group to
// create `name` is the one attached. The tensor has rank() -1 and no local() partition. Throws
// IoError: ETIMEDOUT (no such tensor in time), ECONNREFUSED/ENOENT (an owner exited or closed
// it), EACCES (an owner runs as another user), EMFILE (this process or an owner is out of
// descriptors); std::invalid_argument naming the field when the record in the store (which anyone
// who reaches the store can write) describes no tensor, or more memory than an owner serves.
std::shared_ptr<SharedTensor> AttachSharedTensor(Store& store, const std::string& name,
                                                 std::chrono::milliseconds timeout);

}  // namespace tensortier
