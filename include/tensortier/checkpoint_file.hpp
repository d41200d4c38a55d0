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

#include "tensortier/file.hpp"

namespace tensortier {

// Opens `path` to read a checkpoint from it. Never blocks: a FIFO, a device, a socket or a
// directory is refused (IoError naming the path: EINVAL, or EISDIR) before anything is read.
File OpenCheckpointForReading(const std::string& path, bool direct);

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

// Gives the new file `fd` the replaced file's owner, group and mode. Where the caller may not
// give it the owner (EPERM: not root), the new file keeps the caller as owner and gets the old
// group where the caller belongs to it; the mode is kept in any case. Throws IoError naming
// `final_path` for any other failure.
void KeepAttributes(int fd, const ReplacedFile& old, const std::string& final_path);

// "DIR/.NAME.tmp-PID-START-TAG-" for this process: a save's temporary file is this followed by
// 8 random hex digits.
std::string TemporaryPathPrefix(const std::string& final_path);

// Removes the temporary files that saves into `final_path` left behind when they were killed:
// those of this machine and pid namespace whose process (pid and start time) no longer runs.
// Files of the older ".NAME.tmp-PID-RANDOM" form carry no start time: each is removed only when
// no process has its pid and it was last written an hour ago or more. Files of other machines or
// containers are left alone, and so is anything that cannot be removed. Returns how many went.
size_t RemoveStaleTemporaryFiles(const std::string& final_path);

}  // namespace tensortier
