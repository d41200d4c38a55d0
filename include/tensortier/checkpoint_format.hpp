// What a checkpoint path names: the format a file name's suffix says (as a save picks its format
// and convert checks its output's name), and Hugging Face shard indexes
// (model.safetensors.index.json). tensortier.load and the CLI read both by these rules.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tensortier {

enum class CheckpointFormat { kSafetensors, kTorch };

// "safetensors" or "torch".
std::string_view CheckpointFormatName(CheckpointFormat format);

// The format the file name of `path` names, in either case: .safetensors and .st are
// safetensors; .pt, .pth, .bin, .ckpt and .tar are torch.save zips. nullopt for anything else.
std::optional<CheckpointFormat> FormatOfSuffix(std::string_view path);

// Whether `path` is a shard index: its name ends with ".index.json", or its content is JSON from
// the first byte (a safetensors file has its JSON header after an 8-byte length, whose bytes may
// be '{' or spaces themselves). Throws IoError naming `path`.
bool IsShardIndex(const std::string& path);

// One shard file of an index and the tensors the index puts in it, in the index's order.
struct Shard {
  std::string path;  // the index's directory joined with the name the index gives
  std::vector<std::string> names;
};

inline constexpr uint64_t kMaxShardIndexBytes = 64u << 20;

// Reads a shard index: a JSON object whose "weight_map" member maps each tensor name to the file
// holding it. Throws FormatError naming `path` for malformed JSON, a name listed twice, two
// "weight_map" members, none, one naming no tensors, a shard that is not a string or lies outside
// the index's directory (an absolute path, a ".." part, '/' or '\' separated), an index over
// kMaxShardIndexBytes; IoError for I/O failures.
std::vector<Shard> ReadShardIndex(const std::string& path);

}  // namespace tensortier
