#include "tensortier/util/parallel_copy.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

namespace tensortier {
namespace {

// A thread's unit of work: large enough that taking it costs nothing next to the copy, small
// enough that the threads finish together.
constexpr size_t kPieceBytes = 4u << 20;

// Ranges [first, last) of the piece list, about kPieceBytes in all.
struct Batch {
  size_t first = 0;
  size_t last = 0;
};

}  // namespace

void ParallelCopy(std::span<const CopyRange> ranges, unsigned threads) noexcept {
  std::vector<CopyRange> pieces;
  std::vector<Batch> batches;
  size_t in_batch = 0;
  try {
    for (const CopyRange& r : ranges) {
      for (size_t done = 0; done < r.n;) {
        const size_t n = std::min(r.n - done, kPieceBytes - in_batch);
        if (batches.empty() || in_batch == 0) batches.push_back({pieces.size(), pieces.size()});
        pieces.push_back({r.dst + done, r.src + done, n});
        batches.back().last = pieces.size();
        done += n;
        in_batch += n;
        if (in_batch == kPieceBytes) in_batch = 0;
      }
    }
  } catch (...) {  // no memory for the plan: copy on this thread
    for (const CopyRange& r : ranges) {
      if (r.n != 0) std::memcpy(r.dst, r.src, r.n);
    }
    return;
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < batches.size();) {
      for (size_t i = batches[b].first; i < batches[b].last; ++i) {
        std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].n);
      }
    }
  };
  const size_t wanted = std::min<size_t>(std::max(threads, 1u), batches.size());
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < wanted; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {  // out of threads: those started share the work
      break;
    } catch (const std::bad_alloc&) {
      break;
    }
  }
  work();
  for (auto& h : helpers) h.join();
}

}  // namespace tensortier
