// Many host-to-host copies at once, split over several threads: staging a state dict into
// reused buffers (tensortier.dcp's async save) costs one pass over memory at the speed of
// several cores, not one.
#pragma once

#include <cstddef>
#include <span>

namespace tensortier {

struct CopyRange {
  std::byte* dst = nullptr;
  const std::byte* src = nullptr;
  size_t n = 0;
};

// Copies every range (none overlapping another's destination), the bytes split into pieces of
// a few MiB that up to `threads` threads (the caller's among them) take in turn. Ranges of a few
// bytes cost a few bytes: 20,000 small tensors are one pass, not 20,000 tasks. Where a thread
// cannot start, the threads that did (the caller at least) do its share. Never throws.
void ParallelCopy(std::span<const CopyRange> ranges, unsigned threads) noexcept;

}  // namespace tensortier
