// Many small pieces of one file moved to or from memory of their own (the tensors of a checkpoint
// with thousands of small ones): pieces close together in the file go through a staging buffer in
// one large request, so the cost is that of a few large reads or writes, not of one request per
// piece.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"

namespace tensortier {

struct ScatteredRead {
  uint64_t offset = 0;  // in the file
  uint64_t length = 0;
  std::byte* dest = nullptr;  // `length` bytes of the caller's, alive until ReadScattered returns
};

// Ranges at most this far apart share a request by default (the bytes between are read and
// dropped).
inline constexpr uint64_t kScatterMaxGap = 64u << 10;

// Reads every range of `reads` (in any order; ranges may overlap) of `file` into its `dest` with
// `engine`, through staging buffers of a few MiB, reading the next one while the last is copied
// out; ranges at most `max_gap` bytes apart share a request. Returns the bytes each range got: its
// length, fewer where the file ends before its end. Adds the bytes its requests asked the file for
// (page-aligned spans, gaps included) to `*bytes_read` where given. Throws IoError (after every
// read in flight has finished).
std::vector<uint64_t> ReadScattered(Engine& engine, const File& file,
                                    std::span<const ScatteredRead> reads,
                                    uint64_t max_gap = kScatterMaxGap,
                                    uint64_t* bytes_read = nullptr);

struct GatheredWrite {
  uint64_t offset = 0;  // in the file
  uint64_t length = 0;
  const std::byte* src = nullptr;  // `length` bytes, alive until WriteGathered returns
};

// Writes every piece of `writes` (in any order, not overlapping) to `file` with `engine`: pieces
// that meet end to end in the file are copied into staging buffers of a few MiB, each written with
// one request while the next fills. With `xxh64`, returns each piece's XXH64 (computed as it is
// copied); else an empty vector. Throws IoError (after every write in flight has finished).
std::vector<uint64_t> WriteGathered(Engine& engine, const File& file,
                                    std::span<const GatheredWrite> writes, bool xxh64 = false);

// Where the small tensors of a load go: tensors of fewer than kSharedChunkMax bytes share chunks
// of up to kSharedChunkBytes of memory (each at a 64-byte aligned position), so that a chunk is one
// allocation and one read, not one per tensor; a tensor kept alive keeps at most its chunk. Empty
// and larger tensors get memory of their own (chunk -1).
inline constexpr uint64_t kSharedChunkMax = 64 << 10;
inline constexpr uint64_t kSharedChunkBytes = 1 << 20;
struct ChunkPlan {
  std::vector<uint64_t> chunk_bytes;  // each chunk's size
  std::vector<int64_t> chunk;         // per tensor: its chunk, or -1
  std::vector<uint64_t> position;     // per tensor: its byte position in its chunk
};
ChunkPlan PlanSharedChunks(std::span<const uint64_t> sizes);

}  // namespace tensortier
