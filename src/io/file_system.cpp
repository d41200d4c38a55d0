#include "tensortier/io/file_system.hpp"

#include <fcntl.h>
#include <linux/fs.h>  // RENAME_EXCHANGE
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include "tensortier/util/error.hpp"

namespace tensortier {

void FileSystem::Inject(FileStep step, std::string_view what, const std::string& path) const {
  if (!faults_) return;
  if (const int error = faults_->Before(step); error != 0) ThrowIoError(error, what, path);
}

std::string FileSystem::CreateUniqueFile(const std::function<std::string(uint32_t n)>& path_for,
                                         mode_t mode, std::string_view what,
                                         const std::string& error_path) const {
  Inject(FileStep::kOpen, what, error_path.empty() ? path_for(0) : error_path);
  return tensortier::CreateUniqueFile(path_for, mode, what, error_path);
}

File FileSystem::Open(const std::string& path, OpenMode mode, bool direct) const {
  Inject(FileStep::kOpen, "open", path);
  return File::Open(path, mode, direct);
}

void FileSystem::Allocate(const File& file, uint64_t offset, uint64_t length) const {
  if (length != 0) Inject(FileStep::kAllocate, "fallocate", file.path());
  file.Allocate(offset, length);
}

void FileSystem::DataSync(const File& file) const {
  Inject(FileStep::kDataSync, "fdatasync", file.path());
  file.DataSync();
}

void FileSystem::Rename(const std::string& from, const std::string& to) const {
  Inject(FileStep::kRename, "rename", from);
  if (rename(from.c_str(), to.c_str()) != 0) ThrowIoError(errno, "rename", from);
}

void FileSystem::Exchange(const std::string& from, const std::string& to) const {
  Inject(FileStep::kExchange, "exchange with the new directory", to);
  if (syscall(SYS_renameat2, AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) != 0) {
    ThrowIoError(errno, "exchange with the new directory", to);
  }
}

void FileSystem::SyncDirectory(const std::string& dir, const std::string& error_path) const {
  Inject(FileStep::kSyncDirectory, "fsync the directory of", error_path);
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) ThrowIoError(errno, "open the directory of", error_path);
  int rc;
  do {
    rc = fsync(fd);
  } while (rc != 0 && errno == EINTR);
  const int fsync_errno = errno;
  close(fd);
  if (rc != 0 && fsync_errno != EINVAL && fsync_errno != ENOTSUP && fsync_errno != EBADF) {
    ThrowIoError(fsync_errno, "fsync the directory of", error_path);
  }
}

void FileSystem::CloseReplaced(int fd, const std::function<void()>& before_close) const noexcept {
  try {
    Inject(FileStep::kRelease, "close", "");
  } catch (const IoError&) {
    // Nothing waits for this close to report to: the descriptor goes in any case.
  }
  before_close();
  close(fd);
}

}  // namespace tensortier
