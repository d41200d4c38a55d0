#include "tensortier/shared/shared_rows.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// Rows this far ahead are prefetched: enough misses in flight to cover memory latency.
constexpr size_t kPrefetchAhead = 8;
// Only a row's first cache lines: the hardware prefetcher follows a longer row by itself.
constexpr uint64_t kPrefetchBytes = 512;

template <bool kForWrite>
inline void PrefetchRow(const uint8_t* row, uint64_t row_bytes) {
  const uint64_t n = std::min(row_bytes, kPrefetchBytes);
  for (uint64_t b = 0; b < n; b += 64) __builtin_prefetch(row + b, kForWrite ? 1 : 0, 3);
}

void CheckIndices(const int64_t* indices, size_t count, uint64_t first_row, uint64_t rows,
                  const char* what) {
  for (size_t i = 0; i < count; ++i) {
    const int64_t v = indices[i];
    if (v < 0 || static_cast<uint64_t>(v) < first_row ||
        static_cast<uint64_t>(v) - first_row >= rows) {
      throw std::out_of_range(
          first_row == 0 ? StrCat("index ", v, " (position ", i, ") is out of range for ", what,
                                  " of ", rows, " rows")
                         : StrCat("index ", v, " (position ", i, ") is out of range for ", what,
                                  " holding rows [", first_row, ", ", first_row + rows, ")"));
    }
  }
}

// Copies row `indices[i]` (at address(indices[i])) to or from row i of `packed`, for i in
// [0, count), on one thread for small batches and several for large ones.
template <typename Address>
void CopyIndexedRows(Address address, const int64_t* indices, size_t count, uint64_t row_bytes,
                     uint8_t* packed, bool gather) {
  if (count == 0 || row_bytes == 0) return;
  auto run = [&](size_t begin, size_t end) {
    const size_t ahead = std::min(end, begin + kPrefetchAhead);
    for (size_t i = begin; i < ahead; ++i) {
      PrefetchRow<false>(address(static_cast<uint64_t>(indices[i])), row_bytes);
    }
    for (size_t i = begin; i < end; ++i) {
      if (i + kPrefetchAhead < end) {
        const uint8_t* next = address(static_cast<uint64_t>(indices[i + kPrefetchAhead]));
        if (gather) {
          PrefetchRow<false>(next, row_bytes);
        } else {
          PrefetchRow<true>(next, row_bytes);
        }
      }
      uint8_t* row = address(static_cast<uint64_t>(indices[i]));
      if (gather) {
        std::memcpy(packed + i * row_bytes, row, row_bytes);
      } else {
        std::memcpy(row, packed + i * row_bytes, row_bytes);
      }
    }
  };
  size_t threads = 1;
  if (count * row_bytes >= kParallelRowCopyBytes) {
    threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
    threads = std::min(threads, count);
  }
  if (threads == 1) return run(0, count);
  std::vector<std::thread> pool;
  size_t per = (count + threads - 1) / threads;
  for (size_t t = 1; t < threads; ++t) {
    size_t b = std::min(count, t * per), e = std::min(count, (t + 1) * per);
    pool.emplace_back(run, b, e);  // memcpy cannot throw: nothing to carry back
  }
  run(0, std::min(count, per));
  for (auto& th : pool) th.join();
}

}  // namespace

void GatherRows(const void* table, uint64_t table_rows, uint64_t row_bytes, uint64_t first_row,
                const int64_t* indices, size_t count, void* out) {
  CheckIndices(indices, count, first_row, table_rows, "a table");
  auto* base = static_cast<uint8_t*>(const_cast<void*>(table));
  CopyIndexedRows([&](uint64_t row) { return base + (row - first_row) * row_bytes; }, indices,
                  count, row_bytes, static_cast<uint8_t*>(out), true);
}

void ScatterRows(void* table, uint64_t table_rows, uint64_t row_bytes, uint64_t first_row,
                 const int64_t* indices, size_t count, const void* in) {
  CheckIndices(indices, count, first_row, table_rows, "a table");
  auto* base = static_cast<uint8_t*>(table);
  CopyIndexedRows([&](uint64_t row) { return base + (row - first_row) * row_bytes; }, indices,
                  count, row_bytes, static_cast<uint8_t*>(const_cast<void*>(in)), false);
}

RowRoute RouteRows(const int64_t* indices, size_t count, const std::vector<uint64_t>& ends,
                   int64_t* order) {
  RowRoute route;
  route.counts.assign(ends.size(), 0);
  if (ends.empty()) {
    if (count > 0) route.bad = 0;
    return route;
  }
  const uint64_t rows = ends.back();
  // Owners are found twice (count, then place) rather than stored: a batch's owners would be
  // one more array as large as the batch.
  auto owner = [&](uint64_t row) {
    return static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), row) - ends.begin());
  };
  for (size_t i = 0; i < count; ++i) {
    if (indices[i] < 0 || static_cast<uint64_t>(indices[i]) >= rows) {
      route.bad = static_cast<int64_t>(i);
      route.counts.assign(ends.size(), 0);
      return route;
    }
    route.counts[owner(static_cast<uint64_t>(indices[i]))]++;
  }
  std::vector<uint64_t> next(ends.size(), 0);
  for (size_t r = 1; r < ends.size(); ++r) next[r] = next[r - 1] + route.counts[r - 1];
  for (size_t i = 0; i < count; ++i) {
    order[next[owner(static_cast<uint64_t>(indices[i]))]++] = static_cast<int64_t>(i);
  }
  return route;
}

void CopyPieceRows(const std::vector<uint8_t*>& bases, const std::vector<uint64_t>& ends,
                   uint64_t row_bytes, const int64_t* indices, size_t count, uint8_t* packed,
                   bool gather, const char* what) {
  CheckIndices(indices, count, 0, ends.empty() ? 0 : ends.back(), what);
  if (bases.size() == 1) {
    uint8_t* base = bases[0];
    return CopyIndexedRows([&](uint64_t row) { return base + row * row_bytes; }, indices, count,
                           row_bytes, packed, gather);
  }
  CopyIndexedRows(
      [&](uint64_t row) {
        const size_t p = std::upper_bound(ends.begin(), ends.end(), row) - ends.begin();
        return bases[p] + (row - (p == 0 ? 0 : ends[p - 1])) * row_bytes;
      },
      indices, count, row_bytes, packed, gather);
}

}  // namespace tensortier
