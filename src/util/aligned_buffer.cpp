#include "tensortier/aligned_buffer.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <new>
#include <utility>

namespace tensortier {
namespace {
constexpr size_t kHugePageThreshold = 4u << 20;
}

size_t SystemPageSize() {
  static const size_t size = [] {
    long n = sysconf(_SC_PAGESIZE);
    return n > 0 ? static_cast<size_t>(n) : kPageSize;
  }();
  return size;
}

AlignedBuffer::AlignedBuffer(size_t size, bool lock) : size_(size) {
  if (size == 0) return;
  mapped_ = AlignUp(size, kPageSize);
  void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  data_ = static_cast<std::byte*>(p);
  if (mapped_ >= kHugePageThreshold) madvise(p, mapped_, MADV_HUGEPAGE);  // advisory only
  if (lock) locked_ = mlock(p, mapped_) == 0;
}

AlignedBuffer::~AlignedBuffer() {
  Release();
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      locked_(std::exchange(other.locked_, false)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    locked_ = std::exchange(other.locked_, false);
  }
  return *this;
}

void AlignedBuffer::Release() noexcept {
  if (data_ != nullptr) munmap(data_, mapped_);  // also drops any mlock
  data_ = nullptr;
  size_ = mapped_ = 0;
  locked_ = false;
}

}  // namespace tensortier
