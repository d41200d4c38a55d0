#include "tensortier/data/sample_inputs.hpp"

#include <filesystem>
#include <limits>
#include <stdexcept>
#include <unordered_map>

#include "tensortier/util/sha256.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

std::vector<int32_t> FileLabels(size_t count, const std::optional<std::vector<int64_t>>& labels) {
  if (count == 0) throw std::invalid_argument("files= is an empty list");
  std::vector<int32_t> out;
  out.reserve(count);
  if (!labels) {  // DALI labels files by position
    for (size_t i = 0; i < count; ++i) out.push_back(static_cast<int32_t>(i));
    return out;
  }
  if (labels->size() != count) {
    throw std::invalid_argument(StrCat(labels->size(), " labels given for ", count, " files"));
  }
  for (const int64_t label : *labels) {
    if (label < std::numeric_limits<int32_t>::min() ||
        label > std::numeric_limits<int32_t>::max()) {
      throw std::invalid_argument("labels must fit in int32");
    }
    out.push_back(static_cast<int32_t>(label));
  }
  return out;
}

SampleList ResolveSampleInputs(SampleInputs in) {
  if (in.files && in.file_list) {
    throw std::invalid_argument("give file paths through files= or file_list=, not both");
  }
  if (in.labels && !in.files) throw std::invalid_argument("labels= is valid only with files=");
  SampleList list;
  if (in.files) {
    list.labels = FileLabels(in.files->size(), in.labels);
    list.paths = std::move(*in.files);
    if (in.root && !in.root->empty()) {
      const std::string& root = *in.root;
      for (std::string& p : list.paths) {
        if (p.empty() || p.front() != '/') p = root.back() == '/' ? root + p : root + "/" + p;
      }
    }
  } else if (in.file_list) {
    list = ReadFileList(*in.file_list, in.root.value_or(""));
  } else if (in.root) {
    list = ListFileRoot(*in.root, in.filter, in.dir_filters);
    in.check_files = false;  // just listed
  } else {
    throw std::invalid_argument("give file_root=, file_list= or files=");
  }
  if (in.check_files) CheckFilesExist(list.paths);
  return list;
}

std::string FilesDigest(const std::vector<std::string>& paths, const std::vector<int32_t>& labels,
                        bool spelled) {
  Sha256 digest;
  std::unordered_map<std::string, std::string> real_folders;  // a tree has few folders
  for (const std::string& path : paths) {
    if (spelled) {
      digest.Update(path.c_str(), path.size() + 1);
      continue;
    }
    const size_t slash = path.rfind('/');
    // "/x": the root; "x": the working directory.
    std::string folder = slash == std::string::npos ? "" : path.substr(0, slash == 0 ? 1 : slash);
    auto [it, added] = real_folders.try_emplace(folder);
    if (added) {
      // As os.path.realpath: what does not exist is kept, made absolute and normalized.
      std::error_code error;
      const auto absolute = std::filesystem::absolute(folder.empty() ? "." : folder, error);
      std::string real = std::filesystem::weakly_canonical(absolute, error).string();
      if (error) real = absolute.lexically_normal().string();
      while (!real.empty() && real.back() == '/') real.pop_back();
      it->second = real + "/";
    }
    const std::string full =
        it->second + (slash == std::string::npos ? path : path.substr(slash + 1));
    digest.Update(full.c_str(), full.size() + 1);
  }
  for (const int32_t label : labels) {
    const auto u = static_cast<uint32_t>(label);
    const uint8_t le[4] = {static_cast<uint8_t>(u), static_cast<uint8_t>(u >> 8),
                           static_cast<uint8_t>(u >> 16), static_cast<uint8_t>(u >> 24)};
    digest.Update(le, 4);
  }
  return digest.HexDigest();
}

}  // namespace tensortier
