// The files a training-data reader reads and their labels, from the inputs NVIDIA DALI's
// fn.readers.file takes: a root folder with one subfolder per class, a file list, or given lists.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tensortier {

struct SampleList {
  std::vector<std::string> paths;  // full paths, in DALI's order
  std::vector<int32_t> labels;     // one per path
};

// DALI's rule for file_root: the subdirectories of `root` in sorted (byte) order are the classes,
// labelled 0, 1, ...; each class holds its regular files and symbolic links, in sorted order
// (files directly under `root` are not samples). Unlike DALI no extension filter applies: every
// file is a sample. Throws IoError when `root` cannot be listed, std::invalid_argument when it
// holds no files.
SampleList ListFileRoot(const std::string& root);

// DALI's file_list text format: one sample per line, "path label" (the label is the last run of
// digits, separated by white space; blank lines skipped). Relative paths are relative to `root`,
// or to the list's own folder when `root` is empty. Throws IoError when the list cannot be read,
// std::invalid_argument (naming the line) for a malformed line or an empty list.
SampleList ReadFileList(const std::string& list_path, const std::string& root = "");

// Throws IoError (ENOENT...) naming the first path that does not exist or cannot be reached.
void CheckFilesExist(const std::vector<std::string>& paths);

}  // namespace tensortier
