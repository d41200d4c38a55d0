// The mappings of one shared tensor in this process, and the kernel's policies for the pages
// behind them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tensortier/cuda/cuda_vmm.hpp"
#include "tensortier/shared/shared_tensor.hpp"

namespace tensortier {

inline constexpr uint64_t kHugePage = 2ull << 20;

struct SharedTensor::Memory {
  // Host memory.
  uint8_t* reserved = nullptr;  // kContinuous: the whole range, partitions mapped inside it
  uint64_t reserved_bytes = 0;
  std::vector<std::pair<void*, uint64_t>> mappings;  // kChunked: each partition
  std::vector<HostRegistration> registrations;       // of the partitions' mappings
  // Device memory, given back in reverse: mappings, then allocations, then the range.
  std::optional<DeviceAddressRange> device_range;
  std::vector<DeviceAllocation> device_allocations;
  std::vector<DeviceMapping> device_mappings;
  std::string name;  // the shared tensor's, for SharedTensorNameAt

  ~Memory();
  // Records [address, address + length) as this memory's, for SharedTensorNameAt.
  void Track(const void* address, uint64_t length);
  // Reserves a PROT_NONE range of at least `span` bytes, aligned to `align` (a multiple of the
  // page size), that partitions are then mapped into with MAP_FIXED. Throws IoError naming `key`.
  void Reserve(uint64_t span, uint64_t align, const std::string& key);
};

// The kernel's policy for transparent huge pages in shared memory: the bracketed word of
// shmem_enabled ("never", "advise", "always"...), or "" where it cannot be read.
std::string ShmemHugePolicy();
// Whether MADV_HUGEPAGE on a shared-memory mapping gets it huge pages under `policy`.
bool ShmemHugeOnAdvice(const std::string& policy);
// Faults in [address, address + length) for writing: MADV_POPULATE_WRITE, or one write per page
// on kernels without it (before 5.14). Returns 0, or the errno of a failure (ENOMEM...).
int PopulateForWrite(uint8_t* address, uint64_t length, uint64_t page);
// The machine's physical memory in bytes (UINT64_MAX where it cannot be told).
uint64_t PhysicalMemoryBytes();
// The memory this process may use: the machine's, or less where its cgroup (v2 memory.max, v1
// memory.limit_in_bytes) sets a limit; `what` says which, for errors.
struct MemoryLimit {
  uint64_t bytes = UINT64_MAX;
  std::string what;
};
MemoryLimit ProcessMemoryLimit();

}  // namespace tensortier
