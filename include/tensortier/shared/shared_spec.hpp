// What a shared tensor is, before any memory: its spec (shape, dtype, layout, memory), how its
// rows are partitioned between ranks, and the record its owners publish so that other processes
// can attach it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "tensortier/util/enum_names.hpp"

namespace tensortier {

enum class SharedLayout { kContinuous, kChunked, kDistributed };
enum class SharedMemory { kHost, kDevice };

inline constexpr EnumName<SharedLayout> kSharedLayoutNames[] = {
    {SharedLayout::kContinuous, "continuous"},
    {SharedLayout::kChunked, "chunked"},
    {SharedLayout::kDistributed, "distributed"},
};
inline constexpr EnumName<SharedMemory> kSharedMemoryNames[] = {
    {SharedMemory::kHost, "host"},
    {SharedMemory::kDevice, "device"},
};

// "continuous" / "chunked" / "distributed"; Parse throws std::invalid_argument for anything else.
const char* SharedLayoutName(SharedLayout layout);
SharedLayout ParseSharedLayout(const std::string& name);
// "host" / "device"; Parse throws std::invalid_argument for anything else.
const char* SharedMemoryName(SharedMemory memory);
SharedMemory ParseSharedMemory(const std::string& name);

// How long collective calls wait for the other ranks unless told otherwise.
inline constexpr std::chrono::milliseconds kDefaultSharedTimeout{std::chrono::minutes(2)};
// The longest wait a timeout asks for: what is longer waits without end (no deadline).
inline constexpr std::chrono::milliseconds kLongestWait{std::chrono::hours(24 * 365)};
// The most bytes a shared tensor may span: more than any address space maps (x86-64 and arm64
// user space end below 2^57), and far enough from 2^64 that sizes rounded up never wrap.
inline constexpr uint64_t kMaxSharedTensorBytes = 1ull << 56;
// The most processes a tensor mapped in host memory can have: they run on one machine, which
// never runs more (Linux's PID_MAX_LIMIT on 64-bit).
inline constexpr int kMaxSharedWorldSize = 1 << 22;

// The longest name a tensor may have, in bytes: what a partition server reads of a request
// that names the tensor it asks for.
inline constexpr size_t kMaxSharedNameBytes = 4096;

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

// Whether a tensor is big enough per rank for huge-page partitions (kHugePartitionThreshold
// bytes per rank and more): every process that maps it decides alike, from the spec and the
// owners' world size only.
inline constexpr uint64_t kHugePartitionThreshold = 64ull << 20;
bool IsHugeSharedTensor(const SharedTensorSpec& spec, int world_size);

// What the owners of a named tensor publish in the store (under SharedTensorRecordKey(name)):
// the socket token they serve under, their world size and the spec.
struct SharedTensorRecord {
  std::string token;
  int world_size = 0;
  SharedTensorSpec spec;

  std::string Format() const;
  // What attach reads back: the store has no authentication, so every field is checked before
  // anything is mapped (std::invalid_argument naming the field; the served memory's size is
  // checked as it arrives).
  static SharedTensorRecord Parse(const std::string& name, const std::string& value);
};

// Named tensors are published store-wide (not under a group's prefix) so that processes outside
// the group can find them.
std::string SharedTensorRecordKey(const std::string& name);

}  // namespace tensortier
