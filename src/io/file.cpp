#include "tensortier/io/file.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include "tensortier/util/strings.hpp"

#include "tensortier/util/error.hpp"

namespace tensortier {

struct File::Impl {
  std::string path;
  int buffered_fd = -1;
  int direct_fd = -1;
  bool writable = false;
  bool readable = true;
  // False for a FIFO, socket or terminal: no offsets. io_uring and libaio would read such a file
  // from wherever it is (waiting for a writer forever) and "write" to it bytes nobody reads.
  bool seekable = true;
  std::string fallback_reason;
  uint32_t offset_align = 4096;
  uint32_t memory_align = 4096;
  // Read when first asked for (most files never are): a few sysfs reads.
  mutable std::once_flag queue_limits_once;
  mutable std::optional<BlockQueueLimits> queue_limits;

  ~Impl() {
    if (direct_fd >= 0) close(direct_fd);
    if (buffered_fd >= 0) close(buffered_fd);
  }
};

std::string CreateUniqueFile(const std::function<std::string(uint32_t n)>& path_for, mode_t mode,
                             std::string_view what, const std::string& error_path) {
  std::random_device random;
  for (int attempt = 0;; ++attempt) {
    const std::string path = path_for(static_cast<uint32_t>(random()));
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd >= 0) {
      close(fd);
      return path;
    }
    if (errno != EEXIST || attempt == 16)
      ThrowIoError(errno, what, error_path.empty() ? path : error_path);
  }
}

OpenMode ParseOpenMode(const std::string& mode) {
  std::string m;
  for (char c : mode) {
    if (c != 'b') m += c;
  }
  if (m == "r") return OpenMode::kRead;
  if (m == "r+") return OpenMode::kReadWrite;
  if (m == "w" || m == "w+") return OpenMode::kWrite;
  if (m == "a" || m == "a+") return OpenMode::kCreate;
  throw std::invalid_argument(
      StrCat("mode '", mode, "' is not one of 'r', 'r+', 'w', 'w+', 'a' (as in open())"));
}

namespace {

int RetryOpen(const char* path, int flags, mode_t perm) {
  int fd;
  do {
    fd = open(path, flags, perm);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

}  // namespace

File File::Open(const std::string& path, OpenMode mode, bool direct, struct stat* status,
                mode_t permissions) {
  return OpenNamed(path, path, mode, direct, status, permissions);
}

File File::OpenDescriptor(int fd, OpenMode mode, bool direct, struct stat* status) {
  std::string name = StrCat("fd ", fd);
  if (fd < 0 || fcntl(fd, F_GETFD) == -1) ThrowIoError(EBADF, "open (a descriptor not open)", name);
  // Named once, by what the descriptor refers to now (where the file is if renamed).
  const std::string link = StrCat("/proc/self/fd/", fd);
  char target[4096];
  const ssize_t n = readlink(link.c_str(), target, sizeof(target));
  if (n > 0 && static_cast<size_t>(n) < sizeof(target)) name.assign(target, static_cast<size_t>(n));
  return OpenNamed(link, name, mode, direct, status);
}

File File::OpenNamed(const std::string& path, const std::string& name, OpenMode mode, bool direct,
                     struct stat* status, mode_t permissions) {
  auto impl = std::make_shared<Impl>();
  impl->path = name;
  int flags = O_CLOEXEC;
  switch (mode) {
    case OpenMode::kRead:
      flags |= O_RDONLY;
      break;
    case OpenMode::kReadWrite:
      flags |= O_RDWR;
      break;
    case OpenMode::kWrite:
      flags |= O_RDWR | O_CREAT | O_TRUNC;
      break;
    case OpenMode::kCreate:
      flags |= O_RDWR | O_CREAT;
      break;
  }
  impl->writable = mode != OpenMode::kRead;
  // Non-blocking for the open only: opening a FIFO would otherwise wait for its other end forever
  // (the engine's preads then fail on it at once, with ESPIPE).
  impl->buffered_fd = RetryOpen(path.c_str(), flags | O_NONBLOCK, permissions);
  if (impl->buffered_fd < 0 && errno == EACCES && impl->writable) {
    // A file we may write but not read (mode 0200, as DeepNVMe's O_WRONLY opens allow): opened
    // write-only; reads through it are refused by the engine with EBADF.
    const int access_error = errno;
    const int write_only = (flags & ~O_RDWR) | O_WRONLY;
    impl->buffered_fd = RetryOpen(path.c_str(), write_only | O_NONBLOCK, permissions);
    if (impl->buffered_fd >= 0) {
      flags = write_only;  // the O_DIRECT descriptor too
      impl->readable = false;
    } else {
      errno = access_error;
    }
  }
  if (impl->buffered_fd < 0) ThrowIoError(errno, "open", name);
  // The status flags are the open's, less O_NONBLOCK (F_SETFL ignores the access mode and the
  // creation flags): no F_GETFL needed.
  if (fcntl(impl->buffered_fd, F_SETFL, flags) != 0) ThrowIoError(errno, "fcntl", name);
  struct stat st {};
  if (fstat(impl->buffered_fd, &st) != 0) ThrowIoError(errno, "fstat", name);
  if (S_ISDIR(st.st_mode)) ThrowIoError(EISDIR, "open", name);
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
    // Asked of the file itself: some character devices (/dev/zero) have offsets, a tty has none.
    impl->seekable = lseek(impl->buffered_fd, 0, SEEK_CUR) != -1 || errno != ESPIPE;
  }
  if (status != nullptr) *status = st;
  if (!direct) return File{std::move(impl)};
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
    // A FIFO, socket or character device: no O_DIRECT (nor a second, blocking open of a FIFO).
    impl->fallback_reason = "not a regular file or block device: O_DIRECT not tried";
    return File{std::move(impl)};
  }

  // Ask the filesystem for its O_DIRECT rules; a zero alignment means it does not support it.
  struct statx stx {};
  bool have_dioalign = statx(impl->buffered_fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
                       (stx.stx_mask & STATX_DIOALIGN) != 0;
  if (have_dioalign && (stx.stx_dio_offset_align == 0 || stx.stx_dio_mem_align == 0)) {
    impl->fallback_reason = "filesystem does not support O_DIRECT for this file (statx DIOALIGN 0)";
    return File{std::move(impl)};
  }
  if (have_dioalign) {
    impl->offset_align = std::max<uint32_t>(stx.stx_dio_offset_align, 512);
    impl->memory_align = std::max<uint32_t>(stx.stx_dio_mem_align, 16);
  }
  // Creation and truncation were done by the first open. Reopen the same inode through /proc,
  // not the path: a file renamed over the path in between (an atomic checkpoint save) would give
  // two different files, and the engine reads one range through both descriptors.
  int direct_flags = (flags & ~(O_CREAT | O_TRUNC)) | O_DIRECT;
  impl->direct_fd = RetryOpen(StrCat("/proc/self/fd/", impl->buffered_fd).c_str(), direct_flags, 0);
  if (impl->direct_fd < 0 && errno == ENOENT) {  // no /proc: by path, then check it is the same
    impl->direct_fd = RetryOpen(path.c_str(), direct_flags, 0);
    struct stat direct_st {};
    if (impl->direct_fd >= 0 && (fstat(impl->direct_fd, &direct_st) != 0 ||
                                 direct_st.st_dev != st.st_dev || direct_st.st_ino != st.st_ino)) {
      ThrowIoError(ESTALE, "open (the file was replaced while being opened; open it again)", name);
    }
  }
  if (impl->direct_fd < 0) {
    impl->fallback_reason =
        StrCat("O_DIRECT refused by the filesystem (", strerror(errno), "); using buffered I/O");
  }
  return File{std::move(impl)};
}

const File::Impl& File::impl() const {
  if (!impl_)
    throw std::logic_error("tensortier::File: use of a closed or default-constructed File");
  return *impl_;
}

const std::string& File::path() const {
  return impl().path;
}
bool File::writable() const {
  return impl().writable;
}
bool File::readable() const {
  return impl().readable;
}
bool File::seekable() const {
  return impl().seekable;
}
int File::buffered_fd() const {
  return impl().buffered_fd;
}
int File::direct_fd() const {
  return impl().direct_fd;
}
const std::string& File::direct_fallback_reason() const {
  return impl().fallback_reason;
}
uint32_t File::offset_alignment() const {
  return impl().offset_align;
}
uint32_t File::memory_alignment() const {
  return impl().memory_align;
}

const std::optional<BlockQueueLimits>& File::block_queue_limits() const {
  const Impl& i = impl();
  std::call_once(i.queue_limits_once, [&i] { i.queue_limits = BlockQueueLimitsOf(i.buffered_fd); });
  return i.queue_limits;
}

uint64_t File::Size() const {
  struct stat st {};
  if (fstat(impl().buffered_fd, &st) != 0) ThrowIoError(errno, "fstat", impl().path);
  if (S_ISBLK(st.st_mode)) {  // st_size is 0 for a block device: the engine's reads stop at Size()
    uint64_t bytes = 0;
    if (ioctl(impl().buffered_fd, BLKGETSIZE64, &bytes) != 0) {
      ThrowIoError(errno, "ioctl(BLKGETSIZE64)", impl().path);
    }
    return bytes;
  }
  return static_cast<uint64_t>(st.st_size);
}

void File::Truncate(uint64_t size) const {
  if (ftruncate(impl().buffered_fd, static_cast<off_t>(size)) != 0) {
    ThrowIoError(errno, "ftruncate", impl().path, size, 0);
  }
}

void File::Allocate(uint64_t offset, uint64_t length) const {
  if (length == 0) return;
  int rc;
  do {
    rc = fallocate(impl().buffered_fd, 0, static_cast<off_t>(offset), static_cast<off_t>(length));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) ThrowIoError(errno, "fallocate", impl().path, offset, length);
}

void File::PunchHole(uint64_t offset, uint64_t length) const {
  if (length == 0) return;
  int rc;
  do {
    rc = fallocate(impl().buffered_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                   static_cast<off_t>(offset), static_cast<off_t>(length));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) ThrowIoError(errno, "fallocate(PUNCH_HOLE)", impl().path, offset, length);
}

void File::DataSync() const {
  int rc;
  do {
    rc = fdatasync(impl().buffered_fd);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) ThrowIoError(errno, "fdatasync", impl().path);
}

void File::DropCache() const {
  // Dirty pages are not dropped: written back first, so that a file another process has just
  // written is read cold too.
  if (fdatasync(impl().buffered_fd) != 0) ThrowIoError(errno, "fdatasync", impl().path);
  int rc = posix_fadvise(impl().buffered_fd, 0, 0, POSIX_FADV_DONTNEED);
  if (rc != 0) ThrowIoError(rc, "posix_fadvise(DONTNEED)", impl().path);
}

}  // namespace tensortier
