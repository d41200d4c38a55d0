#include "tensortier/checkpoint/directory_commit.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <random>
#include <system_error>

#include "tensortier/checkpoint/checkpoint_file.hpp"

#include "tensortier/io/file.hpp"
#include "tensortier/io/file_system.hpp"
#include "tensortier/util/error.hpp"

namespace tensortier {
namespace {

// Every regular file under `dir` fdatasynced, then every directory (children first) fsynced.
void SyncTree(const FileSystem& fs, const std::string& dir) {
  std::error_code ec;
  for (std::filesystem::recursive_directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string path = it->path().string();
    if (it->is_directory(ec)) {
      fs.SyncDirectory(path, path);
    } else if (it->is_regular_file(ec)) {
      File::Open(path, OpenMode::kRead, /*direct=*/false).DataSync();
    }
  }
  if (ec) ThrowIoError(ec.value(), "list the directory", dir);
  fs.SyncDirectory(dir, dir);
}

std::string ParentOf(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? "." : parent.string();
}

}  // namespace

void CommitDirectory(const std::string& staged, const std::string& final_dir) {
  const FileSystem fs;
  SyncTree(fs, staged);
  struct stat st;
  if (lstat(final_dir.c_str(), &st) != 0) {
    if (errno != ENOENT) ThrowIoError(errno, "stat", final_dir);
    fs.Rename(staged, final_dir);
  } else {
    if (!S_ISDIR(st.st_mode)) ThrowIoError(ENOTDIR, "replace the directory", final_dir);
    if (syscall(SYS_renameat2, AT_FDCWD, staged.c_str(), AT_FDCWD, final_dir.c_str(),
                RENAME_EXCHANGE) != 0) {
      ThrowIoError(errno, "exchange with the new directory", final_dir);
    }
  }
  fs.SyncDirectory(ParentOf(final_dir), final_dir);
}

std::string CreateStagingDirectory(const std::string& final_dir, mode_t mode) {
  RemoveStaleTemporaryFiles(final_dir);
  const std::string prefix = TemporaryPathPrefix(final_dir);
  std::random_device random;
  for (int attempt = 0;; ++attempt) {
    char suffix[9];
    std::snprintf(suffix, sizeof(suffix), "%08x", static_cast<uint32_t>(random()));
    const std::string path = prefix + suffix;
    if (mkdir(path.c_str(), mode) == 0) return path;
    if (errno != EEXIST || attempt == 16)
      ThrowIoError(errno, "create the staging directory of", final_dir);
  }
}

}  // namespace tensortier
