// The files a training-data reader reads and their labels, from the inputs NVIDIA DALI's
// fn.readers.file takes: a root folder with one subfolder per class, a file list, or given lists.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tensortier {

struct SampleList {
  std::vector<std::string> paths;  // full paths, in DALI's order
  std::vector<int32_t> labels;     // one per path
};

// DALI's default `file_filters` of fn.readers.file: image and audio file name globs.
const std::vector<std::string>& DefaultFileFilters();

// Which file names of a class folder are samples: those matching at least one glob (fnmatch(3),
// no flags but FNM_CASEFOLD unless case_sensitive), as fn.readers.file's `file_filters` and
// `case_sensitive_filter`. No patterns: no file matches.
struct FileFilter {
  std::vector<std::string> patterns = DefaultFileFilters();
  bool case_sensitive = false;
  bool Matches(const std::string& name) const;
};

// DALI's rule for file_root: the subdirectories of `root` in sorted (byte) order are the classes,
// labelled 0, 1, ...; each class holds its regular files and symbolic links whose names pass
// `filter`, in sorted order (files directly under `root`, and subfolders, FIFOs, sockets and
// devices in a class, are not samples). `dir_filters` (fn.readers.file's): when given, only the
// subdirectories whose names match one of these globs are classes (fnmatch, case as
// `filter.case_sensitive`; a subdirectory several patterns match is one class). Throws IoError
// when `root` cannot be listed, std::invalid_argument when it holds no matching files or
// `dir_filters` is an empty list (as DALI).
SampleList ListFileRoot(const std::string& root, const FileFilter& filter = {},
                        const std::optional<std::vector<std::string>>& dir_filters = std::nullopt);

// DALI's file_list text format: one sample per line, "path label" (the label is the last run of
// digits, separated by white space; blank lines skipped). Relative paths are relative to `root`,
// or to the list's own folder when `root` is empty. Throws IoError when the list cannot be read:
// EISDIR for a folder, EINVAL for anything else that is not a regular file (a FIFO, a device; it
// is never read), EFBIG past 4 GiB; std::invalid_argument (naming the line) for a malformed line
// or an empty list.
SampleList ReadFileList(const std::string& list_path, const std::string& root = "");

// Throws IoError (ENOENT...) naming the first path that does not exist or cannot be reached.
void CheckFilesExist(const std::vector<std::string>& paths);

}  // namespace tensortier
