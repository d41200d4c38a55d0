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
#include <set>
#include <system_error>

#include "tensortier/checkpoint/checkpoint_file.hpp"

#include "tensortier/io/file.hpp"
#include "tensortier/io/file_system.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

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

size_t CarryNewEntries(const std::string& old_dir, const std::string& new_dir,
                       const std::set<std::string>& kept) {
  size_t moved = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(old_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (kept.contains(name)) continue;
    const std::string to = StrCat(new_dir, "/", name);
    struct stat st;
    if (lstat(to.c_str(), &st) == 0 || errno != ENOENT) continue;  // the save's own file wins
    // RENAME_NOREPLACE: a file made under `to` meanwhile is not replaced.
    if (syscall(SYS_renameat2, AT_FDCWD, e.path().c_str(), AT_FDCWD, to.c_str(),
                RENAME_NOREPLACE) == 0) {
      ++moved;
    }
  }
  if (moved > 0) {
    try {
      FileSystem().SyncDirectory(new_dir, new_dir);
    } catch (const std::exception&) {  // moved all the same; the next sync of it covers them
    }
  }
  return moved;
}

bool RemoveDirectoryTree(const std::string& dir) {
  std::error_code ec;
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0) return errno == ENOENT;
  if (S_ISDIR(st.st_mode)) {
    if ((st.st_mode & S_IRWXU) != S_IRWXU) chmod(dir.c_str(), (st.st_mode & 07777) | S_IRWXU);
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      if (e.is_directory(ec) && !e.is_symlink(ec)) {
        RemoveDirectoryTree(e.path().string());
      } else {
        unlink(e.path().c_str());
      }
    }
    return rmdir(dir.c_str()) == 0;
  }
  return unlink(dir.c_str()) == 0;
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
