// The samples a training-data reader reads, from fn.readers.file's inputs given in any of their
// combinations, and the digest a reader's state names them by.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tensortier/data/sample_list.hpp"

namespace tensortier {

// fn.readers.file's inputs: a class-folder `root`, a `file_list`, or `files` (joined to `root`
// when relative) with optional `labels` (default: each file's position).
struct SampleInputs {
  std::optional<std::string> root;
  std::optional<std::string> file_list;
  std::optional<std::vector<std::string>> files;
  std::optional<std::vector<int64_t>> labels;
  bool check_files = true;  // that every file exists (a listed root's files just were)
  FileFilter filter;        // a root's file names, and its class folders' (dir_filters)
  std::optional<std::vector<std::string>> dir_filters;
};

// The labels of `count` files given as paths: `labels`, or each file's position. Throws
// std::invalid_argument for no files, another count of labels or a label outside int32.
std::vector<int32_t> FileLabels(size_t count, const std::optional<std::vector<int64_t>>& labels);

// The paths and labels the inputs name. Throws std::invalid_argument for a combination DALI
// refuses (files and file_list; labels without files; as many labels as files), an empty list,
// or a label outside int32; IoError from listing, reading the list or CheckFilesExist.
SampleList ResolveSampleInputs(SampleInputs inputs);

// SHA-256 (hex) of the paths, each NUL-terminated, then the labels as little-endian int32: what a
// reader's state is checked against. Unless `spelled`, each path counts as its folder's real path
// (os.path.realpath's: std::filesystem::weakly_canonical of the absolute path; "." for a bare
// name) joined with its name, so that a root spelled another way ("/a/b/", "/a/./b", relative
// from elsewhere, through a link) is the same, and another tree is not; each folder is resolved
// once.
std::string FilesDigest(const std::vector<std::string>& paths, const std::vector<int32_t>& labels,
                        bool spelled);

}  // namespace tensortier
