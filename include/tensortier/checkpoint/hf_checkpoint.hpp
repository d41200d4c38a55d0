// Hugging Face model directories as transformers saves them, for tensortier.hf: which file
// tensortier.load reads for a model, and whether its shards are in the page cache.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace tensortier {

struct HfCheckpoint {
  std::string target;   // DIR/model.safetensors.index.json, else DIR/model.safetensors
  bool cached = false;  // HfFilesCached of DIR's *.safetensors files
};

// The checkpoint of the model in `dir`: its shard index, else its one safetensors file; nullopt
// where neither is a file, or config.json cannot be read, is not a JSON object or has a
// "quantization_config" member (a quantized model: transformers reads it itself).
std::optional<HfCheckpoint> FindHfCheckpoint(const std::string& dir);

// The shard index in `dir` whose weight map is `weight_map` (model.safetensors.index.json or a
// variant's model.safetensors.index.VARIANT.json, first in name order). Throws IoError (ENOENT)
// naming dir and `shard` where none is.
std::string HfShardIndexOf(const std::string& dir, const std::string& shard,
                           const std::map<std::string, std::string>& weight_map);

// Whether `files` are in the page cache, 9/10 of their bytes at least (a busy machine evicts a few
// pages at any moment): then tensortier.hf maps them rather than reading them.
bool HfFilesCached(const std::vector<std::string>& files);

}  // namespace tensortier
