// Page-aligned host memory owned by one object.
#pragma once

#include <cstddef>
#include <cstdint>

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

// Anonymous mapping rounded up to whole pages; zero-filled. Large buffers ask for transparent huge
// pages because the virtio disks we run on split requests at physical-contiguity boundaries (see
// DESIGN.md), so fewer, larger physical extents mean larger requests. Move-only.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Throws std::bad_alloc if the mapping fails. `lock` asks mlock() for it (best effort: a refused
  // lock is not an error, as RLIMIT_MEMLOCK is often small).
  explicit AlignedBuffer(size_t size, bool lock = false);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  std::byte* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  bool locked() const noexcept { return locked_; }

 private:
  void Release() noexcept;

  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
  bool locked_ = false;
};

}  // namespace tensortier
