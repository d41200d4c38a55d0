// Page-cache residency of a file range: O_DIRECT would fetch resident data from the disk again,
// so the engine reads resident ranges through the page cache instead.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tensortier {

enum class ResidencyMethod { kCachestat, kMincore, kUnknown };
std::string_view ResidencyMethodName(ResidencyMethod method);

struct Residency {
  uint64_t resident_bytes = 0;  // bytes of [offset, offset+length) in the page cache (page units)
  uint64_t checked_bytes = 0;   // bytes of the range that exist in the file
  ResidencyMethod method = ResidencyMethod::kUnknown;
};

// Never throws: on failure returns method kUnknown (and the caller reads directly).
// Uses cachestat(2) (Linux 6.5+), else mincore(2) on a temporary mapping; `method` forces one
// (tests use it to reach the mincore path on new kernels). `file_size`: the file's size when the
// caller knows it (no fstat then).
Residency QueryResidency(int fd, uint64_t offset, uint64_t length,
                         ResidencyMethod method = ResidencyMethod::kUnknown,
                         std::optional<uint64_t> file_size = std::nullopt);

// QueryResidency of the whole of each file at `paths`, summed: whether a load of them would find
// them in the page cache (read them warm). A file that cannot be opened counts as none of it
// cached. Never throws.
Residency QueryFilesResidency(const std::vector<std::string>& paths);

// The method QueryResidency uses on this kernel (probed once).
ResidencyMethod ResidencyMethodInUse();

// Bytes of this process's memory [address, address + length) that are faulted in (page units,
// at most `length`), by mincore(2). Memory never touched since it was mapped counts as absent. 0
// when the query fails (part of the range unmapped). Never throws.
uint64_t ResidentMemoryBytes(const void* address, uint64_t length);

// A range of this process's memory: `length` bytes at `address`.
struct MemoryRange {
  const void* address = nullptr;
  uint64_t length = 0;
};

// Maps the pages of `ranges` (file mappings) into this process's page tables now
// (MADV_POPULATE_READ, in pieces of all the ranges together over up to `threads` threads): the
// first reads of them then take no page faults, and pages not in the page cache are read from
// the file. A hint: where the kernel cannot (before Linux 5.14), a piece fails or no thread can
// start, nothing more is done. Never throws.
void PopulateForReading(std::span<const MemoryRange> ranges, unsigned threads) noexcept;

// Whether this process may write [address, address + length): false for read-only or unmapped
// memory and for a shared file mapping past the end of its file, so that a copy on an engine
// thread can fail with EFAULT instead of killing the process. Asked of the kernel with
// MADV_POPULATE_WRITE, which faults the range in as the write would. True where the kernel cannot
// tell: before Linux 5.14, and for driver mappings (VM_IO/VM_PFNMAP, such as CUDA's pinned host
// memory), which refuse both populate requests. Never throws.
bool MemoryIsWritable(void* address, uint64_t length);

}  // namespace tensortier
