#include "tensortier/checkpoint_file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <ctime>
#include <filesystem>
#include <limits>
#include <string_view>
#include <vector>

#include "tensortier/error.hpp"
#include "tensortier/process_identity.hpp"
#include "tensortier/strings.hpp"

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

// `rest` is what follows ".NAME.tmp-" in a directory entry; `dir` holds it.
bool IsStaleTemporary(int dir, const char* entry, std::string_view rest, const std::string& tag) {
  const std::vector<std::string_view> parts = SplitDashes(rest);
  if (parts.size() == 4) {  // PID-START-TAG-RANDOM
    const std::optional<pid_t> pid = ParsePid(parts[0]);
    // Another machine's or container's pids and start times mean nothing here.
    if (!pid || !IsDecimal(parts[1]) || tag.empty() || parts[2] != tag || !IsHex8(parts[3])) {
      return false;
    }
    return ProcessStartTime(*pid) != parts[1];
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

std::pair<std::string, std::string> SplitPath(const std::string& final_path) {
  const std::filesystem::path p(final_path);
  std::string dir = p.parent_path().string();
  return {dir.empty() ? "." : dir, p.filename().string()};
}

}  // namespace

File OpenCheckpointForReading(const std::string& path, bool direct) {
  // File::Open never blocks on a FIFO (its open is non-blocking); what it opened is checked here
  // before a byte is read: a FIFO's reads would wait for a writer forever.
  File file = File::Open(path, OpenMode::kRead, direct);
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
    ThrowIoError(errno,
                 "save (the file may not be written by this user: make it writable to replace it)",
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
}

std::string TemporaryPathPrefix(const std::string& final_path) {
  const auto [dir, name] = SplitPath(final_path);
  const pid_t pid = getpid();  // not cached: a forked child is another process
  return (std::filesystem::path(dir) /
          StrCat(".", name, ".tmp-", pid, "-", ProcessStartTime(pid), "-", PidNamespaceTag(), "-"))
      .string();
}

size_t RemoveStaleTemporaryFiles(const std::string& final_path) {
  const auto [dir, name] = SplitPath(final_path);
  // Without /proc no process can be told alive: nothing is removed.
  if (ProcessStartTime(getpid()).empty()) return 0;
  const std::string tag = PidNamespaceTag();
  const std::string prefix = StrCat(".", name, ".tmp-");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;  // the save itself reports what is wrong with the directory
  size_t removed = 0;
  while (const dirent* e = readdir(d)) {
    const std::string_view entry(e->d_name);
    if (!entry.starts_with(prefix)) continue;
    if (IsStaleTemporary(dirfd(d), e->d_name, entry.substr(prefix.size()), tag) &&
        unlinkat(dirfd(d), e->d_name, 0) == 0) {
      ++removed;
    }
  }
  closedir(d);
  return removed;
}

}  // namespace tensortier
