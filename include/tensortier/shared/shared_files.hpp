// A shared tensor's rows to and from files, each rank reading or writing only its own rows
// through the engine (O_DIRECT where the filesystem allows, in parallel): the ranks' parts of
// SharedTensor.load_files, load_checkpoint and store_files in Python.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "tensortier/io/engine.hpp"
#include "tensortier/shared/shared_spec.hpp"

namespace tensortier {

// `length` bytes at `offset` of `path`: one piece of a tensor's bytes.
struct RowSource {
  std::string path;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// A checkpoint holds no tensor of the key asked for (KeyError in Python); the message lists the
// keys it has (the first 20).
class MissingTensorError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Where tensor `key` of checkpoint `path` lies (safetensors, or torch.save found without running
// its pickle: LocateTorchTensor), once it is known to be of torch dtype `dtype` ("float32") and
// `shape`. Throws MissingTensorError; FormatError for another shape or dtype, a shard index or a
// file that is no checkpoint; IoError when the file cannot be read.
RowSource CheckpointRowSource(const std::string& path, const std::string& key,
                              std::string_view dtype, const std::vector<uint64_t>& shape);

// A tensor of torch dtype `dtype`, `element_size` bytes each, and `shape` is the concatenation of
// `sources`; reads its rows [begin, end) into `dest`, all pieces in flight together on a new
// engine. Returns the engine's stats (none when this rank reads nothing). Throws FormatError,
// prefixed with `what`, when the sources do not hold exactly the tensor's bytes; IoError when a
// file cannot be read or holds fewer bytes than it did.
std::optional<IoStats> ReadRows(const std::vector<RowSource>& sources, std::string_view what,
                                std::string_view dtype, uint64_t element_size,
                                const std::vector<uint64_t>& shape, uint64_t begin, uint64_t end,
                                void* dest);

// Writes `nbytes` at `data` to `{prefix}_part_{rank}_of_{world}` at `offset` through a new
// engine: at offset 0 the file is replaced, past it written into (a part written in pieces, in
// order); `last` syncs it. Returns every rank's file name in rank order. Throws IoError.
std::vector<std::string> WriteRowFile(const std::string& prefix, int rank, int world,
                                      const void* data, uint64_t nbytes, uint64_t offset = 0,
                                      bool last = true);

// This rank's rows of a shared tensor (`spec`), partition `part`, read from `sources` as ReadRows
// does: into host memory directly, or, for a partition in the memory of GPU `device` (>= 0),
// through a page-locked slab of at most kDeviceSlabBytes, so that a rank never holds a host copy
// of all its rows. Returns the engine's stats summed over the slabs. Throws CudaError too.
inline constexpr uint64_t kDeviceSlabBytes = 256ull << 20;
std::optional<IoStats> ReadPartitionRows(const std::vector<RowSource>& sources,
                                         std::string_view what, const SharedTensorSpec& spec,
                                         const SharedPartition& part, int device);
// WriteRowFile of partition `part`; from the memory of GPU `device` (>= 0) through a page-locked
// slab of at most kDeviceSlabBytes, written in pieces.
std::vector<std::string> WritePartitionRows(const std::string& prefix, int world,
                                            const SharedPartition& part, int device);

}  // namespace tensortier
