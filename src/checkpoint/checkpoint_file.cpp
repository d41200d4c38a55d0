#include "tensortier/checkpoint/checkpoint_file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <limits>
#include <mutex>
#include <new>
#include <set>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/directory_commit.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/process_identity.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// A file of the older form (no start time) is removed only once nobody wrote to it for this long,
// as the earlier versions did: a pid alone may now name another process.
constexpr time_t kOldFormStaleSeconds = 3600;

const char* KindOf(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

std::vector<std::string_view> SplitDashes(std::string_view s) {
  std::vector<std::string_view> parts;
  for (size_t start = 0;;) {
    const size_t dash = s.find('-', start);
    parts.push_back(s.substr(start, dash == std::string_view::npos ? dash : dash - start));
    if (dash == std::string_view::npos) return parts;
    start = dash + 1;
  }
}

bool IsDecimal(std::string_view s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
}

bool IsHex8(std::string_view s) {
  return s.size() == 8 && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

// The pid written in a temporary file's name, or nullopt where it is none a process can have.
std::optional<pid_t> ParsePid(std::string_view text) {
  if (!IsDecimal(text)) return std::nullopt;
  uint64_t pid = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), pid);
  if (ec != std::errc() || end != text.data() + text.size() || pid == 0 ||
      pid > static_cast<uint64_t>(std::numeric_limits<pid_t>::max())) {
    return std::nullopt;
  }
  return static_cast<pid_t>(pid);
}

// The bytes of the file `from` written over those of `to` (truncated first), then synced.
void CopyIntoFile(const FileSystem& fs, const std::string& from, const std::string& to) {
  const File in = fs.Open(from, OpenMode::kRead, /*direct=*/false);
  const File out = fs.Open(to, OpenMode::kWrite, /*direct=*/false);
  for (off_t at = 0;;) {
    const ssize_t n = sendfile(out.buffered_fd(), in.buffered_fd(), &at, 1 << 30);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) ThrowIoError(errno, "copy the checkpoint into the mounted file", to, at, 1 << 30);
    if (n == 0) break;
  }
  fs.DataSync(out);
}

bool IsStaleTemporary(int dir, const char* entry, std::string_view rest) {
  const std::vector<std::string_view> parts = SplitDashes(rest);
  if (parts.size() == 4) {  // PID-START-TAG-RANDOM: a process stamp, then the random part
    const auto stamp = SplitProcessStamp(rest);
    return stamp && IsHex8(stamp->second) && IsDeadProcessStamp(stamp->first);
  }
  if (parts.size() == 2) {  // PID-RANDOM, written before start times were in the name
    const std::optional<pid_t> pid = ParsePid(parts[0]);
    if (!pid || !IsHex8(parts[1])) return false;
    if (kill(*pid, 0) == 0 || errno != ESRCH) return false;  // alive, maybe another user's
    struct stat st{};
    if (fstatat(dir, entry, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) return false;
    return time(nullptr) - st.st_mtime >= kOldFormStaleSeconds;
  }
  return false;
}

// Local block filesystems, where freeing a big file's blocks is the cost: ext4, XFS, btrfs.
bool FreesBlocksInRename(const std::string& dir) {
  struct statfs st{};
  if (statfs(dir.c_str(), &st) != 0) return false;
  const auto magic = static_cast<uint64_t>(st.f_type);
  return magic == 0xEF53 || magic == 0x58465342 || magic == 0x9123683E;
}

// Replaced files whose last descriptor a thread is closing (freeing their blocks), process-wide.
// A child made by fork() while one is held would keep its blocks for its whole life: its copies
// of the held descriptors are closed there (the threads do not follow it into the child).
struct Releases {
  std::mutex mu;
  std::condition_variable finished;
  std::set<uint64_t> running;  // sequence numbers of releases not yet done
  uint64_t next = 0;
  std::set<int> held;  // their descriptors, until closed
};

void ForkPrepare();
void ForkParent();
void ForkChild();

Releases& TheReleases() {
  // Never destroyed: a release thread may still run while the process exits.
  static Releases* releases = [] {
    auto* r = new Releases;
    pthread_atfork(ForkPrepare, ForkParent, ForkChild);
    return r;
  }();
  return *releases;
}

void ForkPrepare() {
  TheReleases().mu.lock();
}
void ForkParent() {
  TheReleases().mu.unlock();
}
void ForkChild() {
  Releases& r = TheReleases();
  for (int fd : r.held) close(fd);
  r.held.clear();
  r.running.clear();
  // Only the forking thread exists here: no waiter can be on it, and a parent's waiter's state
  // must not be.
  new (&r.finished) std::condition_variable;
  r.mu.unlock();
}

// Closes `fd` (the last reference to a replaced file) on a thread of its own.
void ReleaseInBackground(const FileSystem& fs, int fd) {
  Releases& r = TheReleases();
  uint64_t id;
  {
    std::lock_guard lock(r.mu);
    id = r.next++;
    r.running.insert(id);
  }
  auto release = [fs, fd, id, &r] {
    // Unlisted right before the close: close() takes the descriptor out of the table at once
    // (the freeing comes after), while a number closed still listed could be reused by another
    // open, which a forked child would then close.
    fs.CloseReplaced(fd, [&] {
      std::lock_guard lock(r.mu);
      r.held.erase(fd);
    });
    std::lock_guard lock(r.mu);
    r.running.erase(id);
    r.finished.notify_all();
  };
  try {
    std::thread(release).detach();
  } catch (const std::system_error&) {
    release();  // no thread to be had: freed here, as the rename would have
  }
}

std::pair<std::string, std::string> SplitPath(const std::string& final_path) {
  const std::filesystem::path p(final_path);
  std::string dir = p.parent_path().string();
  return {dir.empty() ? "." : dir, p.filename().string()};
}

}  // namespace

bool IsMountPoint(const std::string& path) {
  struct statx stx{};
  if (statx(AT_FDCWD, path.c_str(), AT_SYMLINK_NOFOLLOW, STATX_BASIC_STATS, &stx) != 0) {
    return false;
  }
  return (stx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) != 0 &&
         (stx.stx_attributes & STATX_ATTR_MOUNT_ROOT) != 0;
}

// An existing file's canonical path; else the canonical directory plus the name, following a
// dangling symlink to the file it names. Saving then replaces a symlink's target, not the link.
std::string ResolveSavePath(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p = fs::absolute(path);
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code ec;
    fs::path canonical = fs::canonical(p, ec);
    if (!ec) return canonical.string();
    if (!fs::is_symlink(fs::symlink_status(p, ec))) {
      fs::path dir = fs::canonical(p.parent_path(), ec);
      if (ec) {
        ThrowIoError(ec.value(),
                     ec.value() == ENOENT ? "save (its directory does not exist: create it first)"
                                          : "save (its directory cannot be reached)",
                     path);
      }
      return (dir / p.filename()).string();
    }
    fs::path target = fs::read_symlink(p, ec);
    if (ec) ThrowIoError(ec.value(), "readlink", p.string());
    p = target.is_absolute() ? target : p.parent_path() / target;
  }
  ThrowIoError(ELOOP, "resolve", path);
}

File OpenCheckpointForReading(const std::string& path, bool direct, const FileSystem& fs) {
  // File::Open never blocks on a FIFO (its open is non-blocking); what it opened is checked here
  // before a byte is read: a FIFO's reads would wait for a writer forever.
  File file = [&] {
    try {
      return fs.Open(path, OpenMode::kRead, direct);
    } catch (const IoError& e) {
      if (e.error_code() != EISDIR) throw;
      // The rule tensortier.load and the CLI share: say what to pass instead.
      ThrowIoError(EISDIR,
                   "read a checkpoint (a directory: pass a checkpoint file or a shard .index.json)",
                   path);
    }
  }();
  struct stat st{};
  if (fstat(file.buffered_fd(), &st) != 0) ThrowIoError(errno, "fstat", path);
  if (!S_ISREG(st.st_mode)) {
    ThrowIoError(EINVAL,
                 StrCat("read a checkpoint (", KindOf(st.st_mode),
                        ", not a regular file: checkpoints are read from regular files)"),
                 path);
  }
  return file;
}

std::optional<ReplacedFile> CheckReplaceable(const std::string& final_path) {
  struct stat st{};
  if (stat(final_path.c_str(), &st) != 0) {
    if (errno == ENOENT) return std::nullopt;
    ThrowIoError(errno, "stat", final_path);
  }
  if (S_ISDIR(st.st_mode)) ThrowIoError(EISDIR, "save over a directory", final_path);
  if (!S_ISREG(st.st_mode)) {
    // The rename would replace it (as root: /dev/null) with a regular file.
    ThrowIoError(EINVAL,
                 StrCat("save over ", KindOf(st.st_mode),
                        ", not a regular file (the rename would replace it: save to a regular "
                        "file's path)"),
                 final_path);
  }
  // As open(final_path, O_WRONLY) decides (permission bits, ACLs, root's override, read-only
  // mounts): torch.save opens the file so, and a read-only checkpoint stays as it is.
  if (faccessat(AT_FDCWD, final_path.c_str(), W_OK, AT_EACCESS) != 0) {
    const int error = errno;
    ThrowIoError(error,
                 error == EROFS
                     ? "save (the file system is read-only: save elsewhere or remount it)"
                     : "save (the file may not be written by this user: make it writable to "
                       "replace it)",
                 final_path);
  }
  return ReplacedFile{st.st_mode & 07777, st.st_uid, st.st_gid};
}

void KeepAttributes(int fd, const ReplacedFile& old, const std::string& final_path) {
  // Owner first: fchown clears the set-user-ID and set-group-ID bits, which fchmod then restores.
  if (fchown(fd, old.uid, old.gid) != 0) {
    if (errno != EPERM) ThrowIoError(errno, "keep the owner of", final_path);
    // Not root: the caller stays the owner; the group is kept where the caller belongs to it.
    if (fchown(fd, static_cast<uid_t>(-1), old.gid) != 0 && errno != EPERM) {
      ThrowIoError(errno, "keep the group of", final_path);
    }
  }
  if (fchmod(fd, old.mode) != 0) ThrowIoError(errno, "keep the mode of", final_path);
  // After the mode: an ACL set now keeps its mask.
  CopyExtendedAttributes(final_path, fd, final_path);
}

void CopyExtendedAttributes(const std::string& from, int to_fd, const std::string& to) {
  ssize_t listed = listxattr(from.c_str(), nullptr, 0);
  if (listed <= 0) return;  // none, or a file system without them
  std::string names(static_cast<size_t>(listed), '\0');
  listed = listxattr(from.c_str(), names.data(), names.size());
  if (listed <= 0) return;  // gone meanwhile
  names.resize(static_cast<size_t>(listed));
  for (size_t at = 0; at < names.size(); at += std::strlen(names.c_str() + at) + 1) {
    const char* name = names.c_str() + at;
    // An integrity hash of the old bytes (IMA, EVM) would fail the new file's appraisal.
    if (std::strcmp(name, "security.ima") == 0 || std::strcmp(name, "security.evm") == 0) {
      continue;
    }
    std::string value(64, '\0');
    ssize_t size = getxattr(from.c_str(), name, value.data(), value.size());
    if (size < 0 && errno == ERANGE) {
      size = getxattr(from.c_str(), name, nullptr, 0);
      if (size >= 0) {
        value.resize(static_cast<size_t>(size));
        size = getxattr(from.c_str(), name, value.data(), value.size());
      }
    }
    if (size < 0) continue;  // removed meanwhile
    // One this file system or user cannot give the new file (or no room for it) is left out:
    // the checkpoint, written whole by now, matters more than an attribute.
    if (fsetxattr(to_fd, name, value.data(), static_cast<size_t>(size), 0) != 0 && errno != EPERM &&
        errno != EACCES && errno != ENOTSUP && errno != EINVAL && errno != E2BIG &&
        errno != ENOSPC && errno != EDQUOT) {
      ThrowIoError(errno, StrCat("keep the extended attribute ", name, " of"), to);
    }
  }
}

std::string TemporaryNameStem(std::string_view name) {
  // After the stem at most: PID (10 digits), START (20), TAG (8), RANDOM (8) and 3 dashes.
  constexpr size_t kNameMax = 255;
  constexpr size_t kAfterStem = 10 + 20 + 8 + 8 + 3;
  constexpr size_t kRoom = kNameMax - kAfterStem - std::string_view("..tmp-").size();
  if (name.size() <= kRoom) return StrCat(".", name, ".tmp-");
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016llx",
                static_cast<unsigned long long>(Xxh64(name.data(), name.size())));
  size_t keep = kRoom - 1 - 16;
  // Whole characters: a UTF-8 continuation byte (10xxxxxx) must not start the cut-off part.
  while (keep > 0 && (static_cast<unsigned char>(name[keep]) & 0xC0) == 0x80) --keep;
  return StrCat(".", name.substr(0, keep), "~", hash, ".tmp-");
}

std::string TemporaryPathPrefix(const std::string& final_path) {
  const auto [dir, name] = SplitPath(final_path);
  // ProcessStamp() is not cached: a forked child is another process.
  return (std::filesystem::path(dir) / StrCat(TemporaryNameStem(name), ProcessStamp(), "-"))
      .string();
}

size_t RemoveStaleTemporaryFiles(const std::string& final_path) {
  const auto [dir, name] = SplitPath(final_path);
  // Without /proc no process can be told alive: nothing is removed.
  if (ProcessStartTime(getpid()).empty()) return 0;
  const std::string prefix = TemporaryNameStem(name);
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;  // the save itself reports what is wrong with the directory
  size_t removed = 0;
  while (const dirent* e = readdir(d)) {
    const std::string_view entry(e->d_name);
    if (!entry.starts_with(prefix)) continue;
    if (!IsStaleTemporary(dirfd(d), e->d_name, entry.substr(prefix.size()))) continue;
    if (unlinkat(dirfd(d), e->d_name, 0) == 0) {
      ++removed;
    } else if (errno == EISDIR) {  // a directory save's staging directory (CommitDirectory)
      if (RemoveDirectoryTree((std::filesystem::path(dir) / e->d_name).string())) ++removed;
    }
  }
  closedir(d);
  return removed;
}

size_t RemoveStaleTemporaryFilesOnce(const std::string& dir) {
  static std::mutex mu;
  static std::set<std::string>* swept = new std::set<std::string>;  // leaked: used until exit
  {
    std::lock_guard lock(mu);
    if (swept->contains(dir)) return 0;
  }
  if (ProcessStartTime(getpid()).empty()) return 0;
  const std::unique_ptr<DIR, int (*)(DIR*)> handle(opendir(dir.c_str()), &closedir);
  if (!handle) return 0;  // the save itself reports what is wrong with the directory
  {
    std::lock_guard lock(mu);
    // Bounded: a process saving into ever new directories (a file object's staging) sweeps
    // some again rather than growing without end.
    if (swept->size() >= 4096) swept->clear();
    swept->insert(dir);
  }
  DIR* d = handle.get();
  size_t removed = 0;
  while (const dirent* e = readdir(d)) {
    // ".NAME.tmp-" then a process stamp: the stamped form only (the older form needs its name's
    // own save to be told apart from a user's file).
    const std::string_view entry(e->d_name);
    const size_t tmp = entry.rfind(".tmp-");
    if (!entry.starts_with('.') || tmp == std::string_view::npos || tmp == 0) continue;
    const std::string_view rest = entry.substr(tmp + 5);
    if (SplitDashes(rest).size() != 4 || !IsStaleTemporary(dirfd(d), e->d_name, rest)) continue;
    if (unlinkat(dirfd(d), e->d_name, 0) == 0) {
      ++removed;
    } else if (errno == EISDIR) {
      if (RemoveDirectoryTree((std::filesystem::path(dir) / e->d_name).string())) ++removed;
    }
  }
  return removed;
}

void WaitForReplacedFiles() {
  Releases& r = TheReleases();
  std::unique_lock lock(r.mu);
  const uint64_t upto = r.next;
  r.finished.wait(lock, [&] { return r.running.empty() || *r.running.begin() >= upto; });
}

DurableFile::DurableFile(const std::string& path, bool direct, FileSystem fs,
                         bool free_in_background)
    : fs_(std::move(fs)), final_(ResolveSavePath(path)), free_in_background_(free_in_background) {
  // Refused here: a directory, a FIFO or device (the rename would replace it), a file this user
  // may not write (a read-only checkpoint, as torch.save refuses it).
  old_ = CheckReplaceable(final_);
  // At most two copies (old and new) take disk space at once.
  WaitForReplacedFiles();
  RemoveStaleTemporaryFiles(final_);
  RemoveStaleTemporaryFilesOnce(SplitPath(final_).first);
  // Writable by its owner: from a 0444 file's mode it could not be opened for writing (root
  // may replace such a file, as its open() may write it). The old mode is given at Commit.
  const mode_t mode = old_ ? 0600 : 0666;
  const std::string prefix = TemporaryPathPrefix(final_);
  temp_ = fs_.CreateUniqueFile(
      [&](uint32_t n) {
        char suffix[9];
        std::snprintf(suffix, sizeof(suffix), "%08x", n);
        return prefix + suffix;
      },
      mode, "save (creating its temporary file)", final_);
  created_ = true;
  try {
    file_ = fs_.Open(temp_, OpenMode::kReadWrite, direct);
  } catch (...) {
    Abort();
    throw;
  }
}

DurableFile::~DurableFile() {
  Abort();
}

const File& DurableFile::file() const {
  if (!file_.is_open()) {
    throw std::logic_error(StrCat("the temporary file of '", final_, "' is closed"));
  }
  return file_;
}

void DurableFile::Reserve(uint64_t size) {
  try {
    fs_.Allocate(file(), 0, size);
  } catch (const IoError& e) {
    const int code = e.error_code();
    if (code != EOPNOTSUPP && code != ENOTSUP && code != EINVAL && code != ENOSYS) throw;
  }
}

void DurableFile::Commit() {
  if (committed_) return;
  try {
    if (old_) KeepAttributes(file().buffered_fd(), *old_, final_);
    fs_.DataSync(file());
  } catch (...) {
    Abort();
    throw;
  }
  file_.Close();
  const int old = HoldReplaced();
  try {
    fs_.Rename(temp_, final_);
  } catch (const IoError& e) {
    if (old >= 0) ReleaseInBackground(fs_, old);
    if (e.error_code() == EBUSY && IsMountPoint(final_)) {
      // A file that is a mount point itself (a container's bind mount of one file: docker -v
      // host.pt:/ckpt.pt, a Kubernetes subPath) refuses the rename: the bytes are copied into
      // it, as torch.save writes any file. Not atomic: a crash meanwhile leaves it torn.
      try {
        CopyIntoFile(fs_, temp_, final_);
      } catch (...) {
        Abort();
        throw;
      }
      Abort();  // the temporary file, copied
      committed_ = true;
      return;
    }
    Abort();
    throw;
  } catch (...) {
    if (old >= 0) ReleaseInBackground(fs_, old);
    Abort();
    throw;
  }
  committed_ = true;
  if (old >= 0) ReleaseInBackground(fs_, old);
  fs_.SyncDirectory(SplitPath(final_).first, final_);
}

int DurableFile::HoldReplaced() {
  if (!old_ || !free_in_background_ || !FreesBlocksInRename(SplitPath(final_).first)) return -1;
  Releases& r = TheReleases();
  std::lock_guard lock(r.mu);  // listed before a fork can copy it
  // O_PATH: no read permission needed. Gone meanwhile, or not ours to hold: the rename frees it.
  const int fd = open(final_.c_str(), O_PATH | O_CLOEXEC);
  if (fd >= 0) r.held.insert(fd);
  return fd;
}

void DurableFile::Abort() noexcept {
  file_.Close();
  if (created_ && !committed_) {
    unlink(temp_.c_str());
    created_ = false;
  }
}

}  // namespace tensortier
