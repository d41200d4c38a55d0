#include "tensortier/checkpoint/directory_commit.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <set>
#include <string_view>
#include <system_error>
#include <vector>

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
      fs.DataSync(fs.Open(path, OpenMode::kRead, /*direct=*/false));
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

void CommitDirectory(const std::string& staged, const std::string& final_dir,
                     const FileSystem& fs) {
  SyncTree(fs, staged);
  struct stat st;
  if (lstat(final_dir.c_str(), &st) != 0) {
    if (errno != ENOENT) ThrowIoError(errno, "stat", final_dir);
    fs.Rename(staged, final_dir);
  } else {
    if (!S_ISDIR(st.st_mode)) ThrowIoError(ENOTDIR, "replace the directory", final_dir);
    fs.Exchange(staged, final_dir);
  }
  fs.SyncDirectory(ParentOf(final_dir), final_dir);
}

namespace {

// Moves what `old_root`/`rel` holds and `kept` does not name into `new_root`/`rel` (see
// CarryNewEntries), descending into the folders `kept` names.
void Carry(const std::string& old_root, const std::string& new_root, const std::string& rel,
           const KeptEntries& kept, CarriedEntries& out, std::set<std::string>& changed) {
  const std::string from_dir = rel.empty() ? old_root : StrCat(old_root, "/", rel);
  std::error_code ec;
  std::filesystem::directory_iterator it(from_dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::string child = rel.empty() ? name : StrCat(rel, "/", name);
    const std::string to = StrCat(new_root, "/", child);
    struct stat at_new;
    const bool taken = lstat(to.c_str(), &at_new) == 0;
    if (kept.contains(child)) {
      std::error_code dir_ec;
      if (taken && S_ISDIR(at_new.st_mode) && it->is_directory(dir_ec) && !it->is_symlink(dir_ec)) {
        Carry(old_root, new_root, child, kept, out, changed);
      }
      continue;
    }
    if (taken) continue;  // the save's own file wins, as a later write would
    // RENAME_NOREPLACE: a file made under `to` meanwhile is not replaced.
    if (syscall(SYS_renameat2, AT_FDCWD, it->path().c_str(), AT_FDCWD, to.c_str(),
                RENAME_NOREPLACE) == 0) {
      ++out.moved;
      changed.insert(rel);
    } else {
      out.left.push_back(child);
    }
  }
}

// The folder holding entry `rel` of a directory, relative to it ("" for the top).
std::string FolderOf(const std::string& rel) {
  const size_t slash = rel.rfind('/');
  return slash == std::string::npos ? "" : rel.substr(0, slash);
}

// Whether every folder on the way from `root` to its entry `rel` is a folder, not a symbolic
// link (one put there during the save would lead the carry into another directory's files).
bool FoldersOnTheWay(const std::string& root, const std::string& rel) {
  for (size_t slash = rel.find('/'); slash != std::string::npos; slash = rel.find('/', slash + 1)) {
    struct stat st;
    if (lstat(StrCat(root, "/", rel.substr(0, slash)).c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return false;
    }
  }
  return true;
}

// The kept files of `old_root` carried into `new_root` where the save left the staged file as it
// was (see CarryNewEntries): the old directory's file replaces a staged copy, whether another
// process changed it meanwhile or not (a log open there goes on being written, in the new
// directory), and one removed meanwhile is removed.
void CarryKeptFiles(const std::string& old_root, const std::string& new_root,
                    const KeptEntries& kept, CarriedEntries& out, std::set<std::string>& changed) {
  for (const auto& [rel, entry] : kept) {
    if (!entry.staged_file) continue;  // a folder or a link
    if (!FoldersOnTheWay(old_root, rel) || !FoldersOnTheWay(new_root, rel)) continue;
    const std::string from = StrCat(old_root, "/", rel);
    const std::string to = StrCat(new_root, "/", rel);
    const std::optional<FileVersion> staged = VersionOf(to);
    // Replaced or removed by the save, or a copy it wrote in place: the save's. A link's size
    // and time are another process's doing (a log appended to), never the save's. (Not the
    // ctime: a linked file's changes when the old directory's link to it goes.)
    if (!staged || staged->dev != entry.staged_file->dev || staged->ino != entry.staged_file->ino ||
        (!entry.linked && (staged->size != entry.staged_file->size ||
                           staged->mtime_ns != entry.staged_file->mtime_ns))) {
      continue;
    }
    const std::optional<FileVersion> old = VersionOf(from);
    if (!old) {
      // Removed meanwhile (an unreadable folder says nothing: left as staged).
      if (errno == ENOENT && unlink(to.c_str()) == 0) {
        ++out.moved;
        changed.insert(FolderOf(rel));
      }
      continue;
    }
    if (old->dev == staged->dev && old->ino == staged->ino) continue;  // one file (a link)
    if (rename(from.c_str(), to.c_str()) == 0) {
      ++out.moved;
      changed.insert(FolderOf(rel));
    } else {
      out.left.push_back(rel);
    }
  }
}

// A folder of the tree being removed, opened for reading without following a symbolic link and
// made writable by its owner where it was not (through its own descriptor: a folder swapped for
// a link meanwhile is not the one changed); -1 where it cannot be, or lies on another file
// system than `dev` (a mount point: what it holds is not the tree's).
int OpenFolderToEmpty(int parent, const char* name, dev_t dev) {
  const int path_fd = openat(parent, name, O_PATH | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC);
  if (path_fd < 0) return -1;
  struct stat st;
  int fd = -1;
  if (fstat(path_fd, &st) == 0 && st.st_dev == dev) {
    if ((st.st_mode & S_IRWXU) != S_IRWXU) {
      chmod(StrCat("/proc/self/fd/", path_fd).c_str(), (st.st_mode & 07777) | S_IRWXU);
    }
    fd = openat(path_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  }
  close(path_fd);
  return fd;
}

// Removes everything in the folder open as `fd` (which it closes); true when all of it went.
bool EmptyFolder(int fd, dev_t dev) {
  std::unique_ptr<DIR, int (*)(DIR*)> d(fdopendir(fd), closedir);
  if (!d) {
    close(fd);
    return false;
  }
  std::vector<std::string> names;
  while (const dirent* e = readdir(d.get())) {
    const std::string_view name(e->d_name);
    if (name != "." && name != "..") names.emplace_back(name);
  }
  bool all = true;
  for (const std::string& name : names) {
    struct stat st;
    if (fstatat(dirfd(d.get()), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      all = all && errno == ENOENT;
      continue;
    }
    if (S_ISDIR(st.st_mode)) {
      const int child = OpenFolderToEmpty(dirfd(d.get()), name.c_str(), dev);
      if (child < 0 || !EmptyFolder(child, dev) ||
          unlinkat(dirfd(d.get()), name.c_str(), AT_REMOVEDIR) != 0) {
        all = false;
      }
    } else if (unlinkat(dirfd(d.get()), name.c_str(), 0) != 0 && errno != ENOENT) {
      all = false;
    }
  }
  return all;
}

}  // namespace

std::optional<FileVersion> VersionOf(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return std::nullopt;
  return FileVersion{st.st_dev, st.st_ino, st.st_size,
                     int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec,
                     int64_t{st.st_ctim.tv_sec} * 1'000'000'000 + st.st_ctim.tv_nsec};
}

CarriedEntries CarryNewEntries(const std::string& old_dir, const std::string& new_dir,
                               const KeptEntries& kept) {
  CarriedEntries out;
  std::set<std::string> changed;  // the folders (relative, "" the top) entries moved into
  Carry(old_dir, new_dir, "", kept, out, changed);
  CarryKeptFiles(old_dir, new_dir, kept, out, changed);
  for (const std::string& rel : changed) {
    const std::string folder = rel.empty() ? new_dir : StrCat(new_dir, "/", rel);
    try {
      FileSystem().SyncDirectory(folder, folder);
    } catch (const std::exception&) {  // moved all the same; the next sync of it covers them
    }
  }
  return out;
}

void RemoveKeptEntries(const std::string& old_dir, const KeptEntries& kept,
                       const std::vector<std::string>& left) {
  const std::set<std::string> stay(left.begin(), left.end());
  // In reverse order a folder's entries ("sub/file") come before the folder ("sub").
  for (auto it = kept.rbegin(); it != kept.rend(); ++it) {
    const std::string& rel = it->first;
    if (stay.contains(rel) || !FoldersOnTheWay(old_dir, rel)) continue;
    const std::string path = StrCat(old_dir, "/", rel);
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      rmdir(path.c_str());  // only where empty: what stays in it stays
    } else {
      unlink(path.c_str());
    }
  }
}

bool RemoveDirectoryTree(const std::string& dir) {
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0) return errno == ENOENT;
  if (!S_ISDIR(st.st_mode)) return unlink(dir.c_str()) == 0;
  const int fd = OpenFolderToEmpty(AT_FDCWD, dir.c_str(), st.st_dev);
  return fd >= 0 && EmptyFolder(fd, st.st_dev) && rmdir(dir.c_str()) == 0;
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
