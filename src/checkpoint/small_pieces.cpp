#include "tensortier/checkpoint/small_pieces.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/util/aligned_buffer.hpp"

namespace tensortier {
namespace {

// A staging buffer's size: ranges are read in requests of up to this many bytes.
constexpr uint64_t kRunBytes = 8u << 20;
constexpr int kSlots = 2;

// Consecutive ranges (in file order) read with one request: [begin, end) of the file, and the
// indexes [first, last) of the ranges in the sorted order.
struct Run {
  uint64_t begin = 0;
  uint64_t end = 0;
  size_t first = 0;
  size_t last = 0;
};

}  // namespace

std::vector<uint64_t> ReadScattered(Engine& engine, const File& file,
                                    std::span<const ScatteredRead> reads, uint64_t max_gap,
                                    uint64_t* bytes_read) {
  std::vector<uint64_t> got(reads.size(), 0);
  std::vector<size_t> order(reads.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::erase_if(order, [&](size_t i) { return reads[i].length == 0; });
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return reads[a].offset < reads[b].offset; });
  std::vector<Run> runs;
  for (size_t k = 0; k < order.size(); ++k) {
    const ScatteredRead& r = reads[order[k]];
    // Requests start on a page: the engine then reads O_DIRECT with no bounce of its own.
    if (!runs.empty() && r.offset <= runs.back().end + max_gap &&
        std::max(runs.back().end, r.offset + r.length) - runs.back().begin <= kRunBytes) {
      runs.back().end = std::max(runs.back().end, r.offset + r.length);
      runs.back().last = k + 1;
      continue;
    }
    runs.push_back({AlignDown(r.offset, kPageSize), r.offset + r.length, k, k + 1});
  }
  if (runs.empty()) return got;
  uint64_t largest = 0;
  for (const Run& run : runs) {
    largest = std::max(largest, run.end - run.begin);
    if (bytes_read != nullptr) *bytes_read += run.end - run.begin;
  }
  // A range longer than a run's limit is a run alone: its buffer is as large as it is.
  const size_t size =
      static_cast<size_t>(AlignUp(std::max<uint64_t>(largest, kPageSize), kPageSize));
  AlignedBuffer bufs[kSlots];
  for (auto& b : bufs) b = AlignedBuffer(size, Pages::kReused);
  Future pending[kSlots];
  // Reads in flight write into the buffers: wait for them before the buffers go (on an error).
  struct Settle {
    Future* futures;
    ~Settle() {
      for (int s = 0; s < kSlots; ++s) {
        if (!futures[s].valid()) continue;
        try {
          futures[s].Wait();
        } catch (...) {  // the error being thrown already is the one to report
        }
      }
    }
  } settle{pending};
  auto submit = [&](size_t r) {
    const Run& run = runs[r];
    pending[r % kSlots] =
        engine.Read(file, bufs[r % kSlots].data(), run.end - run.begin, run.begin);
  };
  for (size_t r = 0; r < runs.size() && r < kSlots; ++r) submit(r);
  for (size_t r = 0; r < runs.size(); ++r) {
    Future f = std::move(pending[r % kSlots]);
    pending[r % kSlots] = Future();
    const uint64_t bytes = f.Wait().bytes;
    const Run& run = runs[r];
    const std::byte* base = bufs[r % kSlots].data();
    for (size_t k = run.first; k < run.last; ++k) {
      const size_t i = order[k];
      const ScatteredRead& read = reads[i];
      const uint64_t skip = read.offset - run.begin;
      const uint64_t n = bytes > skip ? std::min(read.length, bytes - skip) : 0;
      std::memcpy(read.dest, base + skip, n);
      got[i] = n;
    }
    if (r + kSlots < runs.size()) submit(r + kSlots);
  }
  return got;
}

std::vector<uint64_t> WriteGathered(Engine& engine, const File& file,
                                    std::span<const GatheredWrite> writes, bool xxh64) {
  std::vector<uint64_t> hashes(xxh64 ? writes.size() : 0, Xxh64("", 0));
  std::vector<size_t> order(writes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::erase_if(order, [&](size_t i) { return writes[i].length == 0; });
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return writes[a].offset < writes[b].offset; });
  std::vector<Run> runs;
  for (size_t k = 0; k < order.size(); ++k) {
    const GatheredWrite& w = writes[order[k]];
    if (!runs.empty() && w.offset == runs.back().end &&
        w.offset + w.length - runs.back().begin <= kRunBytes) {
      runs.back().end += w.length;
      runs.back().last = k + 1;
      continue;
    }
    runs.push_back({w.offset, w.offset + w.length, k, k + 1});
  }
  if (runs.empty()) return hashes;
  uint64_t largest = 0;
  for (const Run& run : runs) largest = std::max(largest, run.end - run.begin);
  const size_t size =
      static_cast<size_t>(AlignUp(std::max<uint64_t>(largest, kPageSize), kPageSize));
  AlignedBuffer bufs[kSlots];
  for (auto& b : bufs) b = AlignedBuffer(size, Pages::kReused);
  Future pending[kSlots];
  // Writes in flight read from the buffers: wait for them before the buffers go (on an error).
  struct Settle {
    Future* futures;
    ~Settle() {
      for (int s = 0; s < kSlots; ++s) {
        if (!futures[s].valid()) continue;
        try {
          futures[s].Wait();
        } catch (...) {  // the error being thrown already is the one to report
        }
      }
    }
  } settle{pending};
  for (size_t r = 0; r < runs.size(); ++r) {
    const int slot = static_cast<int>(r % kSlots);
    if (pending[slot].valid()) {  // its earlier write read from this buffer
      Future f = std::move(pending[slot]);
      pending[slot] = Future();
      f.Wait();
    }
    const Run& run = runs[r];
    std::byte* base = bufs[slot].data();
    for (size_t k = run.first; k < run.last; ++k) {
      const size_t i = order[k];
      const GatheredWrite& w = writes[i];
      std::memcpy(base + (w.offset - run.begin), w.src, w.length);
      if (xxh64) hashes[i] = Xxh64(w.src, w.length);
    }
    pending[slot] = engine.Write(file, base, run.end - run.begin, run.begin);
  }
  for (auto& f : pending) {
    if (!f.valid()) continue;
    Future done = std::move(f);
    f = Future();
    done.Wait();
  }
  return hashes;
}

ChunkPlan PlanSharedChunks(std::span<const uint64_t> sizes) {
  ChunkPlan plan;
  plan.chunk.reserve(sizes.size());
  plan.position.reserve(sizes.size());
  for (const uint64_t n : sizes) {
    if (n == 0 || n >= kSharedChunkMax) {
      plan.chunk.push_back(-1);
      plan.position.push_back(0);
      continue;
    }
    if (plan.chunk_bytes.empty() || plan.chunk_bytes.back() + n > kSharedChunkBytes) {
      plan.chunk_bytes.push_back(0);
    }
    plan.chunk.push_back(static_cast<int64_t>(plan.chunk_bytes.size()) - 1);
    plan.position.push_back(plan.chunk_bytes.back());
    plan.chunk_bytes.back() += (n + 63) & ~uint64_t{63};
  }
  return plan;
}

}  // namespace tensortier
