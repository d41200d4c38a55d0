// What a checkpoint path names: the format a file name's suffix says (as a save picks its format
// and convert checks its output's name), and Hugging Face shard indexes
// (model.safetensors.index.json). tensortier.load and the CLI read both by these rules.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/util/enum_names.hpp"

namespace tensortier {

enum class CheckpointFormat { kSafetensors, kTorch };

inline constexpr EnumName<CheckpointFormat> kCheckpointFormatNames[] = {
    {CheckpointFormat::kSafetensors, "safetensors"},
    {CheckpointFormat::kTorch, "torch"},
};

// "safetensors" or "torch".
std::string_view CheckpointFormatName(CheckpointFormat format);

// The format the file name of `path` names by its suffix, in either case: .safetensors and .st
// are safetensors; .pt, .pth, .bin, .ckpt and .tar are torch.save zips. A suffix that names none
// is the format of the suffix before it, where one names it ("x.safetensors.tmp" is
// safetensors). nullopt for anything else. Save and convert write by this rule.
std::optional<CheckpointFormat> FormatOfSuffix(std::string_view path);

// What a checkpoint file holds.
enum class CheckpointKind { kSafetensors, kTorch, kShardIndex };

inline constexpr EnumName<CheckpointKind> kCheckpointKindNames[] = {
    {CheckpointKind::kSafetensors, "safetensors"},
    {CheckpointKind::kTorch, "torch"},
    {CheckpointKind::kShardIndex, "index"},
};

// "safetensors", "torch" or "index".
std::string_view CheckpointKindName(CheckpointKind kind);

// What `source` (named by source.name()) holds, the one rule tensortier.load and the CLI follow:
// a name ending with ".index.json" is a shard index; then by content: a zip is a torch.save file,
// a JSON object after the 8-byte header length is safetensors, JSON from the first byte (after
// white space) is a shard index, anything else goes to the safetensors parser for its diagnosis.
// Throws FormatError for an empty file and for a legacy (non-zip, PyTorch < 1.6) torch.save file.
CheckpointKind DetectCheckpointKind(const ByteSource& source);

// The same for the checkpoint file at `path`; IoError naming `path` for anything but a regular
// file (a FIFO is refused, never waited on).
CheckpointKind DetectCheckpointKind(const std::string& path);

// One shard file of an index and the tensors the index puts in it, in the index's order.
struct Shard {
  // The index's directory joined with the name the index first gives the file (names that are
  // one file, "a.safetensors" and "./a.safetensors", are one shard).
  std::string path;
  std::vector<std::string> names;
};

inline constexpr uint64_t kMaxShardIndexBytes = 64u << 20;

// Reads a shard index: a JSON object whose "weight_map" member maps each tensor name to the file
// holding it. A file name may hold any bytes: those that are not UTF-8 are written \udcXX, as
// Python's json.dumps(os.fsdecode(name)) writes them (JsonStrings::kBytes, the rule extent maps
// follow too). Throws FormatError naming `path` for malformed JSON, a name listed twice, two
// "weight_map" members, none, one naming no tensors, a shard that is not a string, is itself an
// index (.index.json) or lies outside the index's directory (an absolute path, a ".." part, '/'
// or '\' separated), an index over kMaxShardIndexBytes; IoError for I/O failures. Package and
// CLI read indexes through this alone.
std::vector<Shard> ReadShardIndex(const std::string& path);

}  // namespace tensortier
