// The `.metadata` of a torch.distributed.checkpoint (DCP) directory, read without Python: where
// each stored item lies (its _StorageInfo) and, for checkpoints tensortier wrote, its xxh64. The
// CLI's info and verify read DCP directories (tensortier's and torch's) through it.
//
// The reader is a restricted pickle machine (protocols 2 to 5): it calls nothing, names only
// DCP's metadata classes, torch's value types (torch.Size, dtypes, layouts by name, memory formats)
// and collections.OrderedDict and pathlib's paths (a checkpoint id), and is bounded by the input's
// size (values, memo, stack).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tensortier {

// One stored item.
struct DcpStoredItem {
  std::string name;           // "fqn", or "fqn at [8, 0]" for a chunk not at the origin
  bool bytes = false;         // a pickled non-tensor value (BytesStorageMetadata)
  std::string relative_path;  // its data file, relative to the directory
  uint64_t offset = 0;
  uint64_t length = 0;
  std::optional<uint64_t> xxh64;  // of [offset, offset + length), where tensortier wrote it
  bool transformed = false;       // stream transforms (compression...) applied: not readable here
};

struct DcpMetadata {
  std::string version;               // DCP's layout version ("1.0.0"); empty in older files
  std::vector<DcpStoredItem> items;  // in the metadata's order
};

// Parses the bytes of a `.metadata` file (`what` names it in errors). Throws FormatError for
// anything else: another pickle, a refused global, truncation, values past the bounds.
DcpMetadata ParseDcpMetadata(std::string_view data, const std::string& what);

// Whether `dir` is a DCP checkpoint directory (it holds a `.metadata` file).
bool IsDcpDirectory(const std::string& dir);

// Reads and parses DIR/.metadata. Throws IoError, FormatError.
DcpMetadata ReadDcpMetadata(const std::string& dir);

}  // namespace tensortier
