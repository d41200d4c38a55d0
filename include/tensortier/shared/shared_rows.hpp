// Row copies by index and the routing of row indices to their owners: the loops under every
// gather and scatter of every layout of shared tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tensortier {

// Row copies by index: the loop under every gather and scatter of every layout. Rows
// `indices[i] - first_row` of `table` (`table_rows` rows of `row_bytes`) go to row i of `out`, or
// row i of `in` to them. Every index is checked first (std::out_of_range names the first bad
// one; nothing is copied). Rows ahead are prefetched (random rows miss the caches and the TLB);
// batches of at least kParallelRowCopyBytes run on several threads.
inline constexpr uint64_t kParallelRowCopyBytes = 4ull << 20;
void GatherRows(const void* table, uint64_t table_rows, uint64_t row_bytes, uint64_t first_row,
                const int64_t* indices, size_t count, void* out);
void ScatterRows(void* table, uint64_t table_rows, uint64_t row_bytes, uint64_t first_row,
                 const int64_t* indices, size_t count, const void* in);

// Routing of a batch of row indices to the ranks that own them (the distributed layout).
// `ends[r]` is the end row of rank r's partition (rank order, so ends ascend). Writes the stable
// permutation that groups the batch by owner to `order` (count entries) and returns how many
// rows each rank owns; `bad` is the position of the first index outside [0, ends.back()), or -1
// (the counts are then zero and `order` unspecified).
struct RowRoute {
  std::vector<uint64_t> counts;
  int64_t bad = -1;
};
RowRoute RouteRows(const int64_t* indices, size_t count, const std::vector<uint64_t>& ends,
                   int64_t* order);

// Rows of a table held in pieces: piece p holds rows [ends[p - 1], ends[p]) (the first from row
// 0; ends ascend) at bases[p]. Copies rows `indices[0..count)` to `packed` (count x row_bytes)
// when `gather`, else `packed` to those rows. Every index is checked first against
// [0, ends.back()) (std::out_of_range names the first bad one and `what` the table; nothing is
// copied). Large batches run on several threads, as GatherRows.
void CopyPieceRows(const std::vector<uint8_t*>& bases, const std::vector<uint64_t>& ends,
                   uint64_t row_bytes, const int64_t* indices, size_t count, uint8_t* packed,
                   bool gather, const char* what);

}  // namespace tensortier
