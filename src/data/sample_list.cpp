#include "tensortier/data/sample_list.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// A file list is read whole into memory: the largest one read (ImageNet-21k's 14 M lines of
// "path label" take ~1 GB).
constexpr uint64_t kMaxListBytes = uint64_t{4} << 30;

// open(2) read-only, non-blocking (a FIFO would block the open itself), retried on EINTR.
int RetryOpen(const std::string& path) {
  int fd;
  do {
    fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty() || name.front() == '/') return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

struct DirCloser {
  void operator()(DIR* dir) const noexcept { closedir(dir); }
};

// The subdirectories of `dir` (stat, following symbolic links, as DALI does) or the files DALI
// would take from it (names passing `filter`): regular files by the entry's type, with no stat
// (on cold metadata each would cost a disk read); links and entries of unknown type (a file
// system without d_type) by a stat of what they name, a link to nothing refused. Not "." and
// "..".
void ListDir(const std::string& dir, std::vector<std::string>* subdirs,
             std::vector<std::string>* files, const FileFilter* filter = nullptr) {
  std::unique_ptr<DIR, DirCloser> handle(opendir(dir.c_str()));
  if (!handle) ThrowIoError(errno, "opendir", dir);
  errno = 0;
  while (dirent* entry = readdir(handle.get())) {
    std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    if (files != nullptr) {
      bool file_type = entry->d_type == DT_REG;
      if ((entry->d_type == DT_LNK || entry->d_type == DT_UNKNOWN) &&
          (filter == nullptr || filter->Matches(name))) {
        // What a link names (a link to nothing is refused now, as files= refuses a missing
        // file, rather than when its batch is read); a file system without d_type, the same.
        const std::string full = JoinPath(dir, name);
        struct stat st{};
        if (stat(full.c_str(), &st) != 0) {
          // Removed since it was listed: not listed. A link to nothing: refused.
          if (errno == ENOENT && lstat(full.c_str(), &st) != 0) {
            errno = 0;  // readdir's errors are told by errno
            continue;
          }
          ThrowIoError(errno, "stat", full);
        }
        file_type = !S_ISDIR(st.st_mode);
      }
      if (file_type && (filter == nullptr || filter->Matches(name))) {
        files->push_back(std::move(name));
      }
    } else {
      const std::string full = JoinPath(dir, name);
      struct stat st{};
      if (stat(full.c_str(), &st) != 0) ThrowIoError(errno, "stat", full);
      if (S_ISDIR(st.st_mode)) subdirs->push_back(std::move(name));
    }
    errno = 0;
  }
  if (errno != 0) ThrowIoError(errno, "readdir", dir);
}

std::string Joined(const std::vector<std::string>& patterns) {
  std::string out;
  for (const std::string& p : patterns) out += (out.empty() ? "" : " ") + p;
  return out;
}

std::vector<std::string> FilterDirs(std::vector<std::string> dirs,
                                    const std::vector<std::string>& patterns, bool case_sensitive) {
  const int flags = case_sensitive ? 0 : FNM_CASEFOLD;
  std::erase_if(dirs, [&](const std::string& dir) {
    return std::none_of(patterns.begin(), patterns.end(), [&](const std::string& pattern) {
      return fnmatch(pattern.c_str(), dir.c_str(), flags) == 0;
    });
  });
  return dirs;
}

// The whole text of a file list. Only a regular file is read (looked at before any read: a FIFO
// would block, a device such as /dev/zero never ends), and only up to kMaxListBytes.
std::string ReadListText(const std::string& path) {
  const int fd = RetryOpen(path);
  if (fd < 0) ThrowIoError(errno, "open the file list", path);
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st{};
  if (fstat(fd, &st) != 0) ThrowIoError(errno, "fstat", path);
  if (S_ISDIR(st.st_mode)) ThrowIoError(EISDIR, "read the file list (a directory)", path);
  if (!S_ISREG(st.st_mode)) {
    ThrowIoError(EINVAL, "read the file list (not a regular file: a FIFO, socket or device)", path);
  }
  auto too_large = [&](uint64_t size) {
    ThrowIoError(EFBIG,
                 StrCat("read the file list (", size, " bytes or more; a file list may hold up to ",
                        kMaxListBytes, ")"),
                 path, 0, size);
  };
  if (static_cast<uint64_t>(st.st_size) > kMaxListBytes) too_large(st.st_size);
  // Read to its end, not to its stat size (which may be 0 or stale), but never past the bound.
  std::string text;
  std::vector<char> chunk(1 << 20);
  while (true) {
    const ssize_t n = read(fd, chunk.data(), chunk.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) ThrowIoError(errno, "read the file list", path, text.size(), chunk.size());
    if (n == 0) break;
    if (text.size() + static_cast<uint64_t>(n) > kMaxListBytes) too_large(text.size() + n);
    text.append(chunk.data(), static_cast<size_t>(n));
  }
  return text;
}
}  // namespace

const std::vector<std::string>& DefaultFileFilters() {
  // fn.readers.file's default, DALI 2.4.
  static const std::vector<std::string> filters = {"*.jpg",  "*.jpeg", "*.png",  "*.bmp", "*.tif",
                                                   "*.tiff", "*.pnm",  "*.ppm",  "*.pgm", "*.pbm",
                                                   "*.jp2",  "*.webp", "*.flac", "*.ogg", "*.wav"};
  return filters;
}

bool FileFilter::Matches(const std::string& name) const {
  const int flags = case_sensitive ? 0 : FNM_CASEFOLD;
  for (const std::string& pattern : patterns) {
    if (fnmatch(pattern.c_str(), name.c_str(), flags) == 0) return true;
  }
  return false;
}

SampleList ListFileRoot(const std::string& root, const FileFilter& filter,
                        const std::optional<std::vector<std::string>>& dir_filters) {
  if (dir_filters && dir_filters->empty()) {
    // DALI refuses it too: an empty list would choose no folder, or read as "all" by mistake.
    throw std::invalid_argument(
        "dir_filters is an empty list: give globs, or none for all folders");
  }
  std::vector<std::string> classes;
  ListDir(root, &classes, nullptr);
  const size_t listed = classes.size();
  if (dir_filters) classes = FilterDirs(std::move(classes), *dir_filters, filter.case_sensitive);
  std::sort(classes.begin(), classes.end());
  SampleList list;
  for (size_t label = 0; label < classes.size(); ++label) {
    const std::string dir = JoinPath(root, classes[label]);
    std::vector<std::string> files;
    ListDir(dir, nullptr, &files, &filter);
    std::sort(files.begin(), files.end());
    for (const std::string& file : files) {
      list.paths.push_back(JoinPath(dir, file));
      list.labels.push_back(static_cast<int32_t>(label));
    }
  }
  if (list.paths.empty()) {
    throw std::invalid_argument(StrCat(
        "file_root '", root, "' holds no files matching file_filters (", Joined(filter.patterns),
        filter.case_sensitive ? ", case-sensitive" : "", ") in ", classes.size(),
        " class subdirectories",
        dir_filters
            ? StrCat(" (of ", listed, ", those matching dir_filters ", Joined(*dir_filters), ")")
            : std::string(),
        " (one per class is expected, each with its files)"));
  }
  return list;
}

SampleList ReadFileList(const std::string& list_path, const std::string& root) {
  std::istringstream in(ReadListText(list_path));
  std::string base = root;
  if (base.empty()) {
    const size_t slash = list_path.rfind('/');
    if (slash != std::string::npos) base = list_path.substr(0, slash);
  }
  SampleList list;
  std::string line;
  for (uint64_t number = 1; std::getline(in, line); ++number) {
    // Parsed from the end, as DALI does: trailing space, the label's digits, space, the path.
    int64_t i = static_cast<int64_t>(line.size()) - 1;
    while (i >= 0 && std::isspace(static_cast<unsigned char>(line[i]))) --i;
    if (i < 0) continue;
    const int64_t label_end = i + 1;
    while (i >= 0 && std::isdigit(static_cast<unsigned char>(line[i]))) --i;
    const int64_t label_start = i + 1;
    while (i >= 0 && std::isspace(static_cast<unsigned char>(line[i]))) --i;
    const int64_t name_end = i + 1;
    if (label_end > label_start && i >= 1 && line[i] == '-' &&
        std::isspace(static_cast<unsigned char>(line[i - 1]))) {
      throw std::invalid_argument(StrCat("file_list '", list_path, "' line ", number, ": label '",
                                         line.substr(i, label_end - i),
                                         "' is negative (labels are 0 or more)"));
    }
    if (name_end <= 0 || name_end >= label_start || label_end <= label_start) {
      throw std::invalid_argument(StrCat("file_list '", list_path, "' line ", number,
                                         ": expected a file name followed by a label, got '", line,
                                         "'"));
    }
    // Any number of digits (leading zeros included) up to int32's largest, as DALI takes them;
    // DALI wraps a larger label round to a negative one, which is refused here.
    int64_t label = 0;
    for (int64_t d = label_start; d < label_end; ++d) {
      label = label * 10 + (line[d] - '0');
      if (label > std::numeric_limits<int32_t>::max()) {
        throw std::invalid_argument(StrCat("file_list '", list_path, "' line ", number, ": label '",
                                           line.substr(label_start, label_end - label_start),
                                           "' does not fit in int32"));
      }
    }
    list.paths.push_back(JoinPath(base, line.substr(0, name_end)));
    list.labels.push_back(static_cast<int32_t>(label));
  }
  if (list.paths.empty()) {
    throw std::invalid_argument(StrCat("file_list '", list_path, "' names no files"));
  }
  return list;
}

void CheckFilesExist(const std::vector<std::string>& paths) {
  for (const std::string& path : paths) {
    struct stat st{};
    if (stat(path.c_str(), &st) != 0) ThrowIoError(errno, "stat", path);
  }
}

}  // namespace tensortier
