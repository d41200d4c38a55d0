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
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

namespace tensortier {

// The Python module of the classes a .metadata pickle holds (Metadata, TensorStorageMetadata...).
inline constexpr std::string_view kDcpMetadataModule = "torch.distributed.checkpoint.metadata";

// One stored item.
struct DcpStoredItem {
  std::string name;  // "fqn", or "fqn at [8, 0]" for a chunk not at the origin
  std::string fqn;
  bool bytes = false;         // a pickled non-tensor value (BytesStorageMetadata)
  std::string relative_path;  // its data file, relative to the directory
  uint64_t offset = 0;
  uint64_t length = 0;
  std::optional<uint64_t> xxh64;  // of [offset, offset + length), where tensortier wrote it
  std::string block_xxh64;        // a tensor's data's block sums (dcp_file.hpp), where recorded
  bool transformed = false;       // stream transforms (compression...) applied: not readable here
  // A tensor chunk's sizes as the metadata records them (its chunk of the tensor's
  // TensorStorageMetadata), which the tensor stored in the file must have.
  std::optional<std::vector<int64_t>> chunk_sizes;
};

// The version of what tensortier's Writer stores beyond DCP's layout (the xxh64s, the items'
// layout), kept as the attribute "tensortier_format" of the metadata's StorageMeta. Files without
// one are torch's writer's. Readers refuse a newer format than theirs: it may place or check items
// in ways they would misread.
inline constexpr int64_t kDcpFormat = 1;

struct DcpMetadata {
  std::string version;               // DCP's layout version ("1.0.0"); empty in older files
  std::optional<int64_t> format;     // tensortier_format; none in torch's writer's files
  std::vector<DcpStoredItem> items;  // in the metadata's order
};

// Whether a .metadata may name global `module`.`name`: DCP's metadata classes, torch's value types
// (torch.Size, and the lowercase names of dtypes, layouts and memory formats: a reader that
// resolves them checks which they are), a layout by its name (torch.serialization._get_layout),
// collections.OrderedDict and pathlib's paths (a checkpoint id).
bool IsDcpMetadataGlobal(std::string_view module, std::string_view name);

// Whether `relative_path` (a _StorageInfo's) names a file inside the checkpoint directory: a plain
// file name, not empty, without '/', NUL or a leading '.' (no "..", no hidden files).
bool IsDcpDataFileName(std::string_view relative_path);

// Throws FormatError naming `what` (the .metadata file) and `relative_path` where it is not
// IsDcpDataFileName: the one rule of ParseDcpMetadata (verify, info) and the Python Reader.
void CheckDcpDataFileName(std::string_view relative_path, const std::string& what);

// Throws FormatError naming `what` (the .metadata file) for a tensortier_format this reader does
// not read: newer than kDcpFormat, or not a positive integer. None (torch's files) is accepted.
void CheckDcpFormat(std::optional<int64_t> format, const std::string& what);

// Parses the bytes of a `.metadata` file (`what` names it in errors). Throws FormatError for
// anything else: another pickle, a refused global, truncation, values past the bounds, a newer
// tensortier_format (CheckDcpFormat).
DcpMetadata ParseDcpMetadata(std::string_view data, const std::string& what);

// A DCP Metadata, field by field: what SerializeDcpMetadata writes, and what the index it puts
// before the pickle gives back (ReadDcpMetadataIndex).
struct DcpMetadataEntry {  // state_dict_metadata[fqn]
  std::string fqn;
  bool bytes = false;                    // BytesStorageMetadata; else a TensorStorageMetadata:
  std::string dtype;                     // torch's name ("float32")
  std::string layout = "torch.strided";  // as torch.serialization._get_layout takes it
  bool requires_grad = false;
  int64_t memory_format = 0;  // TensorProperties' _MEM_FORMAT_ENCODING value
  bool pin_memory = false;
  std::vector<int64_t> size;
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> chunks;  // offsets, sizes
};
struct DcpStorageEntry {  // storage_data[MetadataIndex(fqn, offset, index)]: a _StorageInfo
  std::string fqn;
  std::optional<std::vector<int64_t>> offset;
  std::optional<int64_t> index;
  std::string relative_path;
  uint64_t offset_in_file = 0;
  uint64_t length = 0;
  std::optional<uint64_t> xxh64;
  std::string block_xxh64;  // packed block sums (dcp_file.hpp); none where empty
};
// planner_data: each flattened key's path in the state dict (dict keys and list indices).
using DcpKeyPath = std::vector<std::variant<std::string, int64_t>>;
struct DcpMetadataContents {
  std::vector<DcpMetadataEntry> entries;
  std::optional<std::vector<std::pair<std::string, DcpKeyPath>>> planner_data;  // None: absent
  std::vector<DcpStorageEntry> storage;
  // storage_meta (a StorageMeta, with tensortier_format where set)
  std::string checkpoint_id;  // a path
  std::optional<std::string> save_id;
  std::optional<std::string> load_id;
  std::vector<std::string> modules;
  std::optional<int64_t> format;
  std::string version;
};

// The .metadata pickle of `md`: what pickle.dumps gives for the Metadata object it describes
// (not byte for byte; pickle.load and ParseDcpMetadata read it as the same objects), preceded by
// its index: a bytes value the pickle pushes and pops before the Metadata (readers of the pickle
// skip it), which ReadDcpMetadataIndex decodes in a fraction of the time a parse of the pickle
// takes. Throws std::invalid_argument for a string that is not UTF-8 or a dtype name that is not a
// plain identifier.
std::string SerializeDcpMetadata(const DcpMetadataContents& md);

// The contents of a .metadata from its index (SerializeDcpMetadata's; planner_data left out), or
// nullopt where the file has none (torch's writer's, pickle.dumps'). Throws FormatError naming
// `what` for an index that is damaged or does not match the pickle after it (both carry an
// xxh64), or of a newer tensortier_format (CheckDcpFormat).
std::optional<DcpMetadataContents> ReadDcpMetadataIndex(std::string_view data,
                                                        const std::string& what);

// A .metadata's contents with lookups by key: what a load plans and reads with, without the
// Metadata's Python objects.
class DcpMetadataTable {
 public:
  explicit DcpMetadataTable(DcpMetadataContents md);
  // The lookups point into the contents.
  DcpMetadataTable(const DcpMetadataTable&) = delete;
  DcpMetadataTable& operator=(const DcpMetadataTable&) = delete;

  const DcpMetadataContents& contents() const { return md_; }
  // The state_dict_metadata entry of `fqn`; null where there is none.
  const DcpMetadataEntry* Entry(std::string_view fqn) const;
  // The storage_data entry of MetadataIndex(fqn, offset) (offset: none for a bytes item); null
  // where there is none.
  const DcpStorageEntry* Storage(std::string_view fqn,
                                 const std::optional<std::vector<int64_t>>& offset) const;
  // The sizes of tensor `fqn`'s chunk at `offsets`; null where it has none.
  const std::vector<int64_t>* ChunkSizes(std::string_view fqn,
                                         const std::vector<int64_t>& offsets) const;
  // Whether tensor `fqn` is stored whole: one chunk at the origin of all its size.
  bool StoredWhole(const DcpMetadataEntry& entry) const;
  // The data files the storage entries name, in name order.
  std::vector<std::string> Files() const;
  // Throws FormatError naming `what` (the .metadata) for a tensor whose chunks lie outside it or
  // leave elements out (CheckDcpChunksCover), IoError for data files `dir` lacks
  // (CheckDcpDataFilesPresent).
  void Check(const std::string& dir, const std::string& what) const;

 private:
  static std::string Key(std::string_view fqn, const std::optional<std::vector<int64_t>>& offset);

  DcpMetadataContents md_;
  std::unordered_map<std::string_view, size_t> entry_of_;
  std::unordered_map<std::string, size_t> storage_of_;
  std::unordered_map<std::string, const std::vector<int64_t>*> chunk_of_;
};

// The names of a DCP checkpoint's files, as torch's FileSystemWriter gives them; every reader,
// writer, cleanup and CLI command of tensortier goes by these.
inline constexpr std::string_view kDcpMetadataName = ".metadata";
// "__*.distcp": a data file (each rank's, "__RANK_..." in the files tensortier writes).
bool IsDcpDataFile(std::string_view name);
// "__N.metadata", N a rank: the rank-local metadata of a save with use_collectives=False.
bool IsRankLocalDcpMetadata(std::string_view name);
// DIR/.metadata, or with `rank` DIR/__{rank}.metadata.
std::string DcpMetadataPath(const std::string& dir, std::optional<int64_t> rank = std::nullopt);
// The data files in `dir` (IsDcpDataFile) that `named` does not hold, in name order; none where
// `dir` cannot be listed.
std::vector<std::string> UnnamedDcpDataFiles(const std::string& dir,
                                             const std::set<std::string>& named);

// Whether `dir` is a DCP checkpoint directory: a directory holding `.metadata` (of any kind:
// reading it says what is wrong), or, without one, the data files (__*.distcp) or temporary files
// of a DCP save.
bool IsDcpDirectory(const std::string& dir);

// The bytes of DIR/.metadata. Throws IoError naming what is wrong and the path: no such
// directory (ENOENT), not a directory (ENOTDIR), a directory without .metadata (ENOENT; its
// message says whether data files of an unfinished save are there), a .metadata that is a
// directory (EISDIR), a read that fails. FormatError for a file over 1 GiB or not a regular file.
// With `rank`: DIR/__{rank}.metadata instead, the rank-local metadata torch's FileSystemWriter
// writes in a save with use_collectives=False (which dcp.load falls back to when .metadata is
// missing).
std::string ReadDcpMetadataBytes(const std::string& dir,
                                 std::optional<int64_t> rank = std::nullopt);

// Throws IoError (ENOENT) naming DIR/.metadata and the first missing file where data files it names
// (`relative_paths`) are not in DIR: the first missing ones and how many, and, where DIR holds data
// files (__*.distcp) that it does not name, that the .metadata is of another save (stale).
void CheckDcpDataFilesPresent(const std::string& dir,
                              const std::vector<std::string>& relative_paths);

// Throws FormatError naming `what` (the .metadata) and the tensor `name` where its chunks (offsets
// and sizes per chunk) do not lie inside its `size` or do not add up to all of its elements: data
// of the tensor that no file has (a rank's chunks left out of the metadata).
void CheckDcpChunksCover(const std::string& name, const std::vector<int64_t>& size,
                         const std::vector<std::vector<int64_t>>& offsets,
                         const std::vector<std::vector<int64_t>>& sizes, const std::string& what);

// Reads and parses DIR/.metadata. Throws IoError, FormatError.
DcpMetadata ReadDcpMetadata(const std::string& dir);

// ReadDcpMetadata, or, where DIR has no .metadata but the rank-local metadata files a save with
// use_collectives=False writes (__N.metadata, which dcp.load reads rank by rank), all of theirs
// together, in rank order; `rank_local` says how many were read (0: .metadata). Throws as
// ReadDcpMetadata does where there are neither.
DcpMetadata ReadDcpMetadataOfSave(const std::string& dir, size_t* rank_local = nullptr);

}  // namespace tensortier
