// An open file for the engine: a buffered descriptor always, plus an O_DIRECT descriptor when the
// filesystem accepts it. A refused O_DIRECT is never silent: direct() is false and
// direct_fallback_reason() says why.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "tensortier/io/block_device.hpp"

namespace tensortier {

enum class OpenMode {
  kRead,       // "r": existing file, read only
  kReadWrite,  // "r+": existing file, read and write
  kWrite,      // "w": create or truncate, write (and read)
  kCreate,     // "a": create if missing, keep contents, read and write
};

// Parses "r", "r+", "w", "w+", "a", "a+" (Python's open() letters; "b" is accepted and ignored).
// Throws std::invalid_argument otherwise.
OpenMode ParseOpenMode(const std::string& mode);

// Creates a new empty file at `path_for(n)` for a random `n`, exclusively and never through a
// symbolic link (O_EXCL | O_NOFOLLOW: in a shared directory a planted name is neither followed nor
// truncated); a name already taken is tried again with another `n`. Returns the path. Throws
// IoError for `what`, naming `error_path` (the path tried when empty).
std::string CreateUniqueFile(const std::function<std::string(uint32_t n)>& path_for, mode_t mode,
                             std::string_view what, const std::string& error_path = {});

// Cheap to copy: copies share the descriptors, which close when the last copy goes away, so an
// operation in flight keeps its file open. Thread-safe for concurrent I/O calls.
class File {
 public:
  File() = default;
  // Throws IoError (with the path and errno) if the file cannot be opened.
  // `direct`: try O_DIRECT (the default); false opens buffered only. `status`, when given,
  // receives the opened file's fstat (saving the caller another). `permissions`: the mode bits
  // of a file the open creates (less the umask); an existing file keeps its own.
  static File Open(const std::string& path, OpenMode mode, bool direct = true,
                   struct stat* status = nullptr, mode_t permissions = 0644);
  // Opens again the file the caller's descriptor `fd` refers to (through /proc/self/fd, so a
  // file renamed or unlinked since is still the one), as Open() does; `fd` stays the caller's.
  // The File, and its errors, are named by the descriptor's target when /proc can say it, else
  // "fd <n>". A descriptor not open is EBADF.
  static File OpenDescriptor(int fd, OpenMode mode, bool direct = true,
                             struct stat* status = nullptr);

  bool is_open() const noexcept { return impl_ != nullptr; }
  const std::string& path() const;
  bool writable() const;
  // False for a file opened for writing that we may not read (opened O_WRONLY then).
  bool readable() const;
  // False for a FIFO, socket or terminal (lseek gives ESPIPE): the engine's reads and writes of it
  // fail with ESPIPE, whichever backend.
  bool seekable() const;
  // Buffered descriptor (always valid while open).
  int buffered_fd() const;
  // O_DIRECT descriptor, or -1 when direct() is false.
  int direct_fd() const;
  bool direct() const { return direct_fd() >= 0; }
  // Empty when direct() is true or direct I/O was not asked for.
  const std::string& direct_fallback_reason() const;
  // O_DIRECT alignment rules (statx STATX_DIOALIGN, else 4096).
  uint32_t offset_alignment() const;
  uint32_t memory_alignment() const;
  // The queue limits of the block device holding the file (nothing for tmpfs, overlay, network
  // filesystems), read from sysfs on the first call and kept.
  const std::optional<BlockQueueLimits>& block_queue_limits() const;

  // Bytes in the file (of the device, for a block device).
  uint64_t Size() const;
  void Truncate(uint64_t size) const;
  // Reserves [offset, offset+length) on disk (posix fallocate mode 0). Throws IoError (ENOSPC...).
  void Allocate(uint64_t offset, uint64_t length) const;
  // Gives back the disk space of [offset, offset+length), which then reads as zeros; the size
  // stays (fallocate PUNCH_HOLE | KEEP_SIZE). Throws IoError (EOPNOTSUPP where the filesystem
  // cannot).
  void PunchHole(uint64_t offset, uint64_t length) const;
  void DataSync() const;
  // Writes the file's dirty pages back (fdatasync), then drops its page-cache pages
  // (posix_fadvise DONTNEED); used for cold reads.
  void DropCache() const;
  // Closes this handle's reference now (the descriptors close when no operation still uses them).
  void Close() noexcept { impl_.reset(); }

 private:
  struct Impl;
  explicit File(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  // Open() of `path`, named `name` (in path() and errors).
  static File OpenNamed(const std::string& path, const std::string& name, OpenMode mode,
                        bool direct, struct stat* status, mode_t permissions = 0644);
  std::shared_ptr<const Impl> impl_;
  const Impl& impl() const;
};

}  // namespace tensortier
