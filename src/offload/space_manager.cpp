#include "tensortier/offload/space_manager.hpp"

#include <cstdint>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <utility>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// The largest file offset (off_t is signed).
constexpr uint64_t kMaxEnd = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

}  // namespace

SpaceManager::SpaceManager(uint64_t alignment) : alignment_(alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    throw std::invalid_argument(
        StrCat("SpaceManager: alignment ", alignment, " is not a power of two"));
  }
}

Extent SpaceManager::Allocate(uint64_t length) {
  if (length == 0) return Extent{};
  // Once length <= INT64_MAX (and alignment_ <= 2^63), AlignUp cannot wrap.
  if (length > kMaxEnd || AlignUp(length, alignment_) > kMaxEnd) {
    throw std::length_error(StrCat("SpaceManager::Allocate: length ", length,
                                   " exceeds the maximum file offset ", kMaxEnd));
  }
  const uint64_t aligned = AlignUp(length, alignment_);
  // Best fit: the shortest free extent that holds `aligned`, lowest offset among equals.
  auto fit = by_size_.lower_bound({aligned, 0});
  if (fit == by_size_.end()) {
    // No free extent below end_ touches it, so the new extent starts exactly at end_.
    if (aligned > kMaxEnd - end_) {
      throw std::length_error(StrCat("SpaceManager::Allocate: length ", length, " at end ", end_,
                                     " exceeds the maximum file offset ", kMaxEnd));
    }
    const Extent extent{end_, aligned};
    end_ += aligned;
    allocated_ += aligned;
    return extent;
  }
  const auto [free_length, free_offset] = *fit;
  auto it = by_offset_.find(free_offset);
  if (free_length == aligned) {
    EraseFree(it);
  } else {
    // The remainder ends where the chosen extent ended, so it still does not touch end_.
    ResizeFree(it, free_offset + aligned, free_length - aligned);
  }
  allocated_ += aligned;
  return Extent{free_offset, aligned};
}

void SpaceManager::Free(Extent extent) {
  const uint64_t offset = extent.offset;
  const uint64_t length = extent.length;
  if (length == 0) return;
  if (offset % alignment_ != 0 || length % alignment_ != 0) {
    throw std::invalid_argument(StrCat("SpaceManager::Free: extent at offset ", offset, " length ",
                                       length, " is not aligned to ", alignment_));
  }
  if (length > end_ || offset > end_ - length) {
    throw std::invalid_argument(StrCat("SpaceManager::Free: extent at offset ", offset, " length ",
                                       length, " lies beyond end ", end_));
  }
  const uint64_t stop = offset + length;

  // The free extents either side: `next` starts after offset, `prev` at or before it.
  auto next = by_offset_.upper_bound(offset);
  auto prev = next == by_offset_.begin() ? by_offset_.end() : std::prev(next);
  if (prev != by_offset_.end() && prev->first + prev->second > offset) {
    throw std::invalid_argument(StrCat("SpaceManager::Free: extent at offset ", offset, " length ",
                                       length, " overlaps free extent at offset ", prev->first,
                                       " length ", prev->second, " (double free?)"));
  }
  if (next != by_offset_.end() && next->first < stop) {
    throw std::invalid_argument(StrCat("SpaceManager::Free: extent at offset ", offset, " length ",
                                       length, " overlaps free extent at offset ", next->first,
                                       " length ", next->second, " (double free?)"));
  }

  const bool merge_prev = prev != by_offset_.end() && prev->first + prev->second == offset;
  const bool merge_next = next != by_offset_.end() && next->first == stop;
  const uint64_t start = merge_prev ? prev->first : offset;
  const uint64_t finish = merge_next ? next->first + next->second : stop;

  if (finish == end_) {
    // Free space reaching the end shrinks the space instead (next cannot touch end_, so here
    // merge_next is false).
    if (merge_prev) EraseFree(prev);
    end_ = start;
  } else if (merge_prev) {
    if (merge_next) EraseFree(next);
    ResizeFree(prev, start, finish - start);
  } else if (merge_next) {
    ResizeFree(next, start, finish - start);
  } else {
    InsertFree(start, finish - start);  // the only step that allocates; may throw bad_alloc
  }
  allocated_ -= length;
}

void SpaceManager::InsertFree(uint64_t offset, uint64_t length) {
  const auto size_it = by_size_.emplace(length, offset).first;
  try {
    by_offset_.emplace(offset, length);
  } catch (...) {
    by_size_.erase(size_it);
    throw;
  }
}

void SpaceManager::EraseFree(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  by_offset_.erase(it);
}

void SpaceManager::ResizeFree(std::map<uint64_t, uint64_t>::iterator it, uint64_t offset,
                              uint64_t length) noexcept {
  // Reuses both nodes, so nothing is allocated and nothing can throw.
  auto size_node = by_size_.extract({it->second, it->first});
  size_node.value() = {length, offset};
  by_size_.insert(std::move(size_node));
  auto offset_node = by_offset_.extract(it);
  offset_node.key() = offset;
  offset_node.mapped() = length;
  by_offset_.insert(std::move(offset_node));
}

}  // namespace tensortier
