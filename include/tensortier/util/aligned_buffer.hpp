// Page-aligned host memory owned by one object.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tensortier {

// The smallest page size of x86-64 and most arm64 kernels: what buffers and extents are aligned
// to. Where the kernel's page size matters for correctness (page-cache granularity: mincore,
// cachestat counts, whole-page writes) use SystemPageSize(), which is 16 or 64 KiB on some arm64
// kernels.
inline constexpr size_t kPageSize = 4096;
size_t SystemPageSize();

constexpr uint64_t AlignDown(uint64_t value, uint64_t alignment) {
  return value - value % alignment;
}
constexpr uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return AlignDown(value + alignment - 1, alignment);
}
inline bool IsAligned(const void* address, size_t alignment) {
  return reinterpret_cast<uintptr_t>(address) % alignment == 0;
}

// What a buffer is for, which decides the pages behind it (transparent huge pages, 4 MiB and
// larger buffers only):
//  kReused: bounce buffers, pinned pools, staging buffers: huge pages. The virtio disks we run on
//    split requests at physical-contiguity boundaries (measured: fio's default buffers went out
//    as 512-757 KiB pieces, one large mlocked buffer's as ~3.5 MiB), so fewer, larger physical
//    extents mean larger requests, and the first-touch cost is paid once.
//  kTouchedOnce: memory filled once and handed to the caller (loaded tensors): huge pages too,
//    except on VMs whose guest reports free memory to its host (virtio-balloon free page
//    reporting): there the first touch of a huge page that was free for a few seconds costs
//    ~1.1 s per GiB, of small pages ~0.2 s per GiB (BENCHMARKS.md), more than huge pages save.
// TENSORTIER_HUGE_PAGES=0 or 1 overrides both. Decided once per process, at the first buffer of
// 4 MiB or more or the first Engine (a malformed value throws std::invalid_argument there, and
// again at each later attempt). Buffers that do not ask get MADV_NOHUGEPAGE.
enum class Pages { kTouchedOnce, kReused };

// Whether buffers for `use` ask for huge pages in this process, and why (for `tensortier check`).
bool UsesHugePages(Pages use);
// Whether a buffer of `size` bytes for `use` asks for huge pages (4 MiB and larger only).
bool GetsHugePages(size_t size, Pages use);
std::string HugePagesPolicy();

// When the pages behind a buffer are faulted in:
//  kOnDemand: by the first access to each (nothing is paid for pages never used).
//  kUpFront: all of them at allocation, and mlock()ed where RLIMIT_MEMLOCK allows (best effort:
//    the limit is often 8 MiB, and a refused lock is not an error). This is what DeepNVMe's
//    locked tensors and CUDA pinned memory give: a staging buffer whose first transfer does not
//    pay the page faults (on VMs that report free pages, ~1.1 s per GiB of huge pages).
enum class Populate { kOnDemand, kUpFront };

// Tests only: the calls with which kUpFront buffers fault their pages in
// (madvise(MADV_POPULATE_WRITE)) and lock them (mlock), so that their failures can be injected.
// A null member restores the system call; returns the previous pair. Set it while no buffer is
// being made.
struct ResidencyCalls {
  int (*madvise)(void* address, size_t length, int advice) = nullptr;
  int (*mlock)(const void* address, size_t length) = nullptr;
};
ResidencyCalls SetResidencyCallsForTest(ResidencyCalls calls) noexcept;

// Anonymous mapping rounded up to whole pages; zero-filled. Move-only.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Throws std::bad_alloc if the mapping fails or a resident buffer's pages cannot all be had,
  // std::system_error if faulting them in fails otherwise, std::invalid_argument if
  // TENSORTIER_HUGE_PAGES is malformed (buffers of 4 MiB or more).
  explicit AlignedBuffer(size_t size, Pages use = Pages::kTouchedOnce,
                         Populate populate = Populate::kOnDemand);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  std::byte* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  bool locked() const noexcept { return locked_; }

 private:
  void MakeResident();
  void Release() noexcept;

  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
  bool locked_ = false;
};

}  // namespace tensortier
