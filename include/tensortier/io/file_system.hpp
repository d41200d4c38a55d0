// The system calls a durable save and a checkpoint load make outside the engine (creating and
// opening files, fallocate, fdatasync, rename, the directory's fsync, closing a replaced file),
// behind one seam so that tests can fail each of them in turn, as LevelDB's Env lets them. The
// engine's reads and writes have their seam in the backend (BackendFactory, engine.hpp). The
// faults themselves (one FaultInjector serving both seams) are built into the test targets and
// the test-only Python module only, not into the library.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "tensortier/io/file.hpp"

namespace tensortier {

// The system calls outside the engine that a save or a load makes, each a place a fault can be
// injected.
enum class FileStep : uint8_t {
  kOpen,           // creating or opening a file
  kAllocate,       // fallocate
  kDataSync,       // fdatasync
  kRename,         // rename over the final name
  kSyncDirectory,  // fsync of the directory
  kRelease,        // closing a replaced file's last descriptor (frees its blocks)
  kExchange,       // renameat2(RENAME_EXCHANGE) of a staged directory with the old one
};

// Where faults are injected into the steps: consulted before each step's system call.
class FileStepFaults {
 public:
  virtual ~FileStepFaults() = default;
  // Before the system call of `step`: the errno the call fails with (FileSystem throws the
  // step's IoError without making the call), or 0 to let it go ahead. May wait first.
  virtual int Before(FileStep step) = 0;
  // Faults injected so far.
  virtual uint64_t hits() const noexcept = 0;
};

// Without an injector every call goes straight to the kernel. With one, a call whose step the
// injector picks fails with the plan's errno (IoError naming the step and the path) without
// reaching the kernel, or is delayed by the plan's delay first. Thread-safe; cheap to copy.
class FileSystem {
 public:
  FileSystem() = default;
  explicit FileSystem(std::shared_ptr<FileStepFaults> faults) : faults_(std::move(faults)) {}

  // CreateUniqueFile (file.hpp) as step kOpen.
  std::string CreateUniqueFile(const std::function<std::string(uint32_t n)>& path_for, mode_t mode,
                               std::string_view what, const std::string& error_path) const;
  // File::Open as step kOpen.
  File Open(const std::string& path, OpenMode mode, bool direct) const;
  // File::Allocate as step kAllocate.
  void Allocate(const File& file, uint64_t offset, uint64_t length) const;
  // File::DataSync as step kDataSync.
  void DataSync(const File& file) const;
  // rename(2) as step kRename; the IoError names `from`.
  void Rename(const std::string& from, const std::string& to) const;
  // renameat2(RENAME_EXCHANGE) of `from` and `to` as step kExchange; the IoError names `to`.
  void Exchange(const std::string& from, const std::string& to) const;
  // Makes `dir`'s entries durable (open, fsync) as step kSyncDirectory. Filesystems that cannot
  // sync a directory say so (EINVAL, ENOTSUP, EBADF): that is no failure. The IoError names
  // `error_path` ("fsync the directory of").
  void SyncDirectory(const std::string& dir, const std::string& error_path) const;
  // close(2) of a replaced file's last descriptor, as step kRelease (a fault there only delays:
  // the descriptor is closed in any case, as nothing could report a failure). `before_close`
  // runs right before the close, after any injected delay.
  void CloseReplaced(int fd, const std::function<void()>& before_close) const noexcept;

  const std::shared_ptr<FileStepFaults>& faults() const noexcept { return faults_; }

 private:
  // Throws the injected error for `step`, or sleeps the injected delay.
  void Inject(FileStep step, std::string_view what, const std::string& path) const;
  std::shared_ptr<FileStepFaults> faults_;
};

}  // namespace tensortier
