// Hugging Face model directories as transformers saves them, for tensortier.hf: which file
// tensortier.load reads for a model, and whether its shards are in the page cache.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tensortier/checkpoint/directory_commit.hpp"
#include "tensortier/io/file_system.hpp"

namespace tensortier {

struct HfCheckpoint {
  std::string target;   // DIR/model.safetensors.index.json, else DIR/model.safetensors
  bool cached = false;  // HfFilesCached of DIR's *.safetensors files
};

// The weights files transformers' from_pretrained looks for in a model directory given no
// variant, in its order: it reads the first that is a file.
inline constexpr const char* kHfWeightsFiles[] = {
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json"};

// The file from_pretrained reads in the model directory `dir` given no variant (the first of
// kHfWeightsFiles that is a file); nullopt where `dir` is not a directory or holds no weights
// file at all. Throws FormatError where `dir` holds weights only under other names (a variant's
// model.fp16.safetensors, shards without their index), naming them: they are read by name.
std::optional<std::string> HfWeightsFile(const std::string& dir);

// Throws IoError where `dir` is not a local directory: ENOENT where nothing is there (a Hub model
// id), saying how to download one; ENOTDIR for a file (config.json, a shard).
void CheckHfModelDirectory(const std::string& dir);

// The checkpoint of the model in `dir`, the file transformers reads: its one safetensors file,
// else its shard index (a save sharded over a one-file model leaves both); nullopt
// where neither is a file, or config.json cannot be read, is not a JSON object or has a
// "quantization_config" member (a quantized model: transformers reads it itself).
std::optional<HfCheckpoint> FindHfCheckpoint(const std::string& dir);

// The shard index in `dir` whose weight map is `weight_map` (model.safetensors.index.json or a
// variant's model.safetensors.index.VARIANT.json, first in name order). Throws IoError (ENOENT)
// naming dir and `shard` where none is.
std::string HfShardIndexOf(const std::string& dir, const std::string& shard,
                           const std::map<std::string, std::string>& weight_map);

// Whether transformers reads `path` as safetensors: its name ends ".safetensors" (in that
// case; transformers' names and the variants' "model.fp16.safetensors").
bool IsHfSafetensorsFile(const std::string& path);

// The file tensortier.load reads for the checkpoint files transformers resolved: the one file
// where there is no shard index (`weight_map` nullopt), else the index in the shards' folder
// whose weight map is `weight_map` (HfShardIndexOf). nullopt where transformers reads the files
// itself: files other than safetensors ones (IsHfSafetensorsFile), several files without an
// index, files other than the index's shards, or a shard holding a tensor the index does not
// put there or lacking one it does (transformers loads every tensor of a file, and reports
// those none holds as missing keys).
// Reads each shard's header: FormatError for a malformed one.
std::optional<std::string> HfLoadTarget(
    const std::vector<std::string>& files,
    const std::optional<std::map<std::string, std::string>>& weight_map);

// Whether a save into `final_dir` can stage a new directory and swap it in with one rename: not
// where `final_dir` is a symbolic link, a file, a mount point, holds a mount point (a scratch
// volume mounted inside: a swap would leave it behind), or holds the working directory of this
// process or of another it can see in /proc (which would be left in the removed folder).
// Where it cannot, the save writes into it in place, as transformers does.
bool HfDirectorySwappable(const std::string& final_dir);

// The staging directory of a save into `final_dir` (CreateStagingDirectory, after creating
// final_dir's parent), holding what `final_dir` holds already, as transformers keeps it: the
// same files (hard links: a save replaces safetensors files by rename or removes them, and a log
// open there goes on being written), except copies of the files a save may rewrite in place,
// which must not reach the old directory before the swap: *.json, *.md and *.py files
// (transformers rewrites config.json in place; a model class's own save writes a README and an
// adapter's config), the top's *.bin files (torch.save shards), and any file on another file
// system; symbolic links as links; folders made anew with the owners, modes and times of the
// old ones. Returns the staging directory and final_dir's entries it holds, for
// CarryNewEntries. Throws IoError (ENOTDIR) where `final_dir` is not a directory, or naming the
// file that could not be linked or copied.
struct HfSaveStaging {
  std::string dir;
  KeptEntries kept;
};
HfSaveStaging StageHfSave(const std::string& final_dir);

// The end of a save staged by StageHfSave and written into staging.dir: CommitDirectory swaps it
// with final_dir, CarryNewEntries moves what final_dir gained meanwhile into the new directory,
// and the old one is removed, unless something in it could not move: then it is kept as
// `kept_dir` ("FINAL.previous-<UTC time>", which no removal of killed saves' files takes), and
// `left` names those paths (relative). `swapped` is false where final_dir stays and can be
// written in place instead (a bind mount: EBUSY, EXDEV; a file system without RENAME_EXCHANGE,
// as NFS, SMB and most FUSE ones: EINVAL, ENOSYS, EOPNOTSUPP); the staging directory is removed
// then. Other errors: IoError, after removing the staging directory, or, where the exchange
// happened before a later step failed (the parent's fsync), after carrying the old directory's
// new entries over as above. The system calls go through `fs` (where tests inject faults).
struct HfSaveCommit {
  bool swapped = false;
  std::vector<std::string> left;
  std::string kept_dir;
};
HfSaveCommit CommitHfSave(const HfSaveStaging& staging, const std::string& final_dir,
                          const FileSystem& fs = FileSystem());

// Puts the shard written at `written` where the symbolic link `link` is (a model directory's link
// into a Hub cache's blobs): renamed over the link, then the folder fsynced. The link's target is
// left as it was, as transformers leaves it. Throws IoError, after removing `written`.
void ReplaceLinkedShard(const std::string& written, const std::string& link,
                        const FileSystem& fs = FileSystem());

// Whether `files` are in the page cache, 9/10 of their bytes at least (a busy machine evicts a few
// pages at any moment): then tensortier.hf maps them rather than reading them.
bool HfFilesCached(const std::vector<std::string>& files);

}  // namespace tensortier
