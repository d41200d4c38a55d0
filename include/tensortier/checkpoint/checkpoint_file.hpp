// Checkpoint files on disk: the rules tensortier.load/save and the CLI's info, verify and convert
// share for opening a checkpoint to read it and for replacing one by a save.
//
// A save writes "DIR/.NAME.tmp-PID-START-TAG-RANDOM" next to DIR/NAME, syncs it and renames it
// over DIR/NAME. PID, START (its start time) and TAG (PidNamespaceTag) name the writing process
// even after its pid is reused, so that a later save can tell a killed save's file from a
// running one's.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "tensortier/io/file.hpp"
#include "tensortier/io/file_system.hpp"

namespace tensortier {

// Opens `path` to read a checkpoint from it. Never blocks: a FIFO, a device, a socket or a
// directory is refused (IoError naming the path: EINVAL, or EISDIR) before anything is read.
// The open goes through `fs` (step kOpen).
File OpenCheckpointForReading(const std::string& path, bool direct,
                              const FileSystem& fs = FileSystem());

// The file a save is about to replace.
struct ReplacedFile {
  mode_t mode = 0;  // permission bits (07777)
  uid_t uid = 0;
  gid_t gid = 0;
};

// Checks that a save may replace `final_path` (its symlinks resolved) and describes the file
// there, nullopt when there is none. Throws IoError naming `final_path`: EISDIR for a directory,
// EINVAL for a file that is not regular (the rename would replace a FIFO or a device), and the
// error open(final_path, O_WRONLY) would give when the caller may not write it (EACCES for a
// read-only checkpoint; root passes, as its open() does): torch.save refuses those files so.
std::optional<ReplacedFile> CheckReplaceable(const std::string& final_path);

// Gives the new file `fd` the replaced file's owner, group and mode, and the extended attributes
// of the file now at `final_path` (user.*, an ACL, security labels: what an in-place write, as
// torch.save's, keeps). Where the caller may not give it the owner (EPERM: not root), the new
// file keeps the caller as owner and gets the old group where the caller belongs to it; the mode
// is kept in any case; an extended attribute this file system or user cannot set is left out.
// Throws IoError naming `final_path` for any other failure.
void KeepAttributes(int fd, const ReplacedFile& old, const std::string& final_path);

// Whether `path` (not followed through a link) is the root of a mount: a file bind-mounted into a
// container, a folder with a file system mounted on it. False where it cannot be told.
bool IsMountPoint(const std::string& path);

// Gives `to_fd` (a file or directory named `to` in errors) the extended attributes of `from`:
// every one but an integrity hash of the old bytes (security.ima, security.evm); one this file
// system or user cannot set (or has no room for) is left out. Throws IoError for other failures.
void CopyExtendedAttributes(const std::string& from, int to_fd, const std::string& to);

// ".NAME.tmp-", the start of the names of the temporary files of saves into DIR/NAME. A NAME
// too long for the whole temporary name (PID-START-TAG-RANDOM follow) to fit in 255 bytes, the
// limit of a file name, is cut to its first whole UTF-8 characters plus "~" and the xxh64 of the
// whole NAME: every name a file may have can be saved to, as with torch.save.
std::string TemporaryNameStem(std::string_view name);

// "DIR/.NAME.tmp-PID-START-TAG-" for this process (TemporaryNameStem): a save's temporary file
// is this followed by 8 random hex digits.
std::string TemporaryPathPrefix(const std::string& final_path);

// Removes the temporary files that saves into `final_path` left behind when they were killed:
// those of this machine and pid namespace whose process (pid and start time) no longer runs, and
// so named staging directories (CreateStagingDirectory) with all they hold.
// Files of the older ".NAME.tmp-PID-RANDOM" form carry no start time: each is removed only when
// no process has its pid and it was last written an hour ago or more. Files of other machines or
// containers are left alone, and so is anything that cannot be removed. Returns how many went.
size_t RemoveStaleTemporaryFiles(const std::string& final_path);

// The same for the saves into any name in `dir` (".NAME.tmp-PID-START-TAG-RANDOM" files, and
// staging directories, of processes that no longer run), once per directory and process: a job
// saving to a new name each time (ckpt_step{N}.pt) and killed meanwhile leaves its temporary
// file under a name no later save takes. Returns how many went (0 after the first call).
size_t RemoveStaleTemporaryFilesOnce(const std::string& dir);

// The path a save into `path` replaces: `path` with its symlinks resolved (a dangling one to
// its target's name), as open(path, O_WRONLY | O_CREAT) would write it. Throws IoError naming
// `path` (ENOENT: its directory does not exist; ELOOP).
std::string ResolveSavePath(const std::string& path);

// A save's new file, made durable the way a database commits: the data goes to a temporary
// file next to the final path (see TemporaryPathPrefix), which Commit() syncs (fdatasync),
// renames over the final path and makes durable in its directory (fsync). Until Commit()
// returns, the final path holds what it held before; Abort() or the destructor removes the
// temporary file. Only a file this object created is ever removed. Every system call goes
// through `fs`, so tests can fail each step.
class DurableFile {
 public:
  // Resolves `path` (ResolveSavePath), checks it may be replaced (CheckReplaceable), waits for
  // the files earlier saves replaced to be freed (WaitForReplacedFiles), removes temporary files
  // killed saves into it left (RemoveStaleTemporaryFiles), creates the temporary file and opens
  // it for the engine (read and write; O_DIRECT where `direct` and the filesystem allow).
  // Throws IoError naming the step and the path.
  // `free_in_background` false: the rename frees the replaced file (for comparisons).
  explicit DurableFile(const std::string& path, bool direct = true, FileSystem fs = {},
                       bool free_in_background = true);
  ~DurableFile();
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;

  const std::string& final_path() const noexcept { return final_; }
  const std::string& temporary_path() const noexcept { return temp_; }
  // The temporary file, for the engine's writes. Closed by Commit() and Abort().
  const File& file() const;
  // Reserves `size` bytes up front (fallocate): ENOSPC now rather than mid-write, contiguous
  // extents. A filesystem that cannot (EOPNOTSUPP, EINVAL, ENOSYS) is no failure.
  void Reserve(uint64_t size);
  // Gives the file the replaced file's owner, group and mode (KeepAttributes), fdatasyncs it,
  // renames it over the final path and fsyncs the directory. The replaced file's blocks are
  // freed by a background thread on local block filesystems (ext4, XFS, btrfs: freeing a big
  // file took a third of a save's time inside rename()); the next DurableFile waits for it. On
  // failure the temporary file is removed (unless the rename happened: then the final path
  // holds the new file and only the directory's fsync failed).
  void Commit();
  // Removes the temporary file (unless committed). Idempotent.
  void Abort() noexcept;
  bool committed() const noexcept { return committed_; }

 private:
  // A descriptor keeping the replaced file alive past the rename, or -1 where there is none or
  // the rename should free it (other filesystems; on NFS an open replaced file would linger as
  // a ".nfsXXXX" entry).
  int HoldReplaced();

  FileSystem fs_;
  std::string final_;
  std::string temp_;
  std::optional<ReplacedFile> old_;
  File file_;
  bool free_in_background_;
  bool created_ = false;
  bool committed_ = false;
};

// Waits until the files earlier commits replaced (up to now) are freed. Any thread.
void WaitForReplacedFiles();

}  // namespace tensortier
