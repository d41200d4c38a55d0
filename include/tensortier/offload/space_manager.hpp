// Free-space bookkeeping for one offload backing file.
//
// Extents are multiples of `alignment` (the O_DIRECT block), so every stored tensor starts on an
// aligned file offset and its aligned middle goes direct. Allocation is best fit (the smallest free
// extent that holds the request, lowest offset among equals), carving from the front of the chosen
// extent; when nothing fits the managed space grows at its end. Freed extents coalesce with free
// neighbours, and free space that reaches the end shrinks the space, so the owner can truncate the
// file. Allocate and Free are O(log n) in the number of free extents.
//
// Not thread-safe: the owner serialises calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <utility>

namespace tensortier {

struct Extent {
  uint64_t offset = 0;
  uint64_t length = 0;  // a multiple of the manager's alignment; 0 for an empty extent

  friend bool operator==(const Extent&, const Extent&) = default;
};

class SpaceManager {
 public:
  // Throws std::invalid_argument unless alignment is a power of two.
  explicit SpaceManager(uint64_t alignment = 4096);

  // An extent of AlignUp(length, alignment) bytes. Allocate(0) returns an empty extent (offset 0,
  // length 0) that Free accepts and ignores. Throws std::length_error when the space would exceed
  // the maximum file offset (INT64_MAX).
  Extent Allocate(uint64_t length);

  // Returns an extent from Allocate. Throws std::invalid_argument (and changes nothing) for an
  // extent that is misaligned, beyond end(), or overlaps free space (a double free).
  void Free(Extent extent);

  uint64_t alignment() const noexcept { return alignment_; }
  // Bytes the backing file must hold: the end of the last allocated extent.
  uint64_t end() const noexcept { return end_; }
  uint64_t allocated_bytes() const noexcept { return allocated_; }
  // Free bytes below end() (holes between allocated extents).
  uint64_t free_bytes() const noexcept { return end_ - allocated_; }
  size_t free_extent_count() const noexcept { return by_offset_.size(); }

 private:
  void InsertFree(uint64_t offset, uint64_t length);
  void EraseFree(std::map<uint64_t, uint64_t>::iterator it);
  // Gives the free extent at `it` a new offset and length in both indexes without allocating.
  void ResizeFree(std::map<uint64_t, uint64_t>::iterator it, uint64_t offset,
                  uint64_t length) noexcept;

  uint64_t alignment_;
  uint64_t end_ = 0;
  uint64_t allocated_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;           // free extents: offset -> length
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // free extents: (length, offset)
};

}  // namespace tensortier
