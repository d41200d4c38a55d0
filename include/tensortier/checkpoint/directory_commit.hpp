// A directory of checkpoint files (a Hugging Face model directory) replaced as a whole: the new
// directory is written completely beside the old one, then the two trade places in one rename.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tensortier/io/file_system.hpp"

namespace tensortier {

// Makes `staged` durable (every file under it fdatasynced, every directory fsynced), then puts it
// at `final_dir` in one step: rename(2) where nothing is there, else
// renameat2(RENAME_EXCHANGE), after which `staged` names the old directory (for the caller to
// remove). The parent directory is fsynced last. A crash at any moment leaves `final_dir` the
// old directory or the new one, whole. `staged` and `final_dir` must be on one file system.
// Throws IoError naming the file or directory that failed (EINVAL or ENOSYS from the exchange:
// a file system without RENAME_EXCHANGE; `final_dir` is then left as it was). Its system calls go
// through `fs` (where tests inject faults).
void CommitDirectory(const std::string& staged, const std::string& final_dir,
                     const FileSystem& fs = FileSystem());

// Creates the directory a save into `final_dir` is staged in, beside it and named as a save's
// temporary file is ("DIR/.NAME.tmp-PID-START-TAG-RANDOM", TemporaryPathPrefix), with `mode`
// (less the umask), after removing those that killed saves into `final_dir` left behind
// (RemoveStaleTemporaryFiles: only of processes that no longer run). Returns its path. Throws
// IoError naming `final_dir`.
std::string CreateStagingDirectory(const std::string& final_dir, mode_t mode = 0777);

// One version of a file: another write, a change of its metadata or another file under its name
// gives another.
struct FileVersion {
  dev_t dev = 0;
  ino_t ino = 0;
  off_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  bool operator==(const FileVersion&) const = default;
};
// The version of the file at `path` (not following a last symbolic link); nullopt where there
// is none (errno says why).
std::optional<FileVersion> VersionOf(const std::string& path);

// An entry of the old directory the staged one was given: for a regular file, the version of its
// staged copy or link, as staged (a save that writes or removes it changes it); nullopt for
// folders and links. `linked`: the staged file is the old directory's file itself (a hard link,
// which a save replaces by rename and never writes in place), not a copy.
struct KeptEntry {
  std::optional<FileVersion> staged_file;
  bool linked = false;
};
using KeptEntries = std::map<std::string, KeptEntry>;  // by path relative to the directory

// After CommitDirectory exchanged the directories: what another process did in the old one
// (`old_dir`, at the staged name now) while the save ran, carried into the new one (`new_dir`).
// Entries it made move there where the name is free: a Trainer rank's rng_state_1.pth written
// into the checkpoint folder rank 0 saves into, a log file in a subfolder. Kept files replace
// their staged copies (as they are now: rewritten or replaced meanwhile, or not; a writer that
// holds one open goes on writing it there), and kept files it removed are removed, where the
// save left the staged one as it was (a file the save wrote is the save's). Nothing is carried
// through a folder made a symbolic link meanwhile. `kept` are the entries (paths relative to the
// directory, "sub/file") the staged directory was given of the old one; the folders among them are
// descended into. The new directory is fsynced when anything changed. Never throws: what cannot
// move is listed in `left` (the caller keeps the old directory then).
struct CarriedEntries {
  size_t moved = 0;  // entries moved or removed
  std::vector<std::string> left;
};
CarriedEntries CarryNewEntries(const std::string& old_dir, const std::string& new_dir,
                               const KeptEntries& kept);

// After CarryNewEntries left `left` in the old directory: the entries `kept` names (the old
// model, and files the new directory holds too) removed from it, folders where empty, so that it
// keeps only what could not move. Nothing is removed through a folder made a symbolic link
// meanwhile. Never throws.
void RemoveKeptEntries(const std::string& old_dir, const KeptEntries& kept,
                       const std::vector<std::string>& left);

// Removes `dir` and all it holds, giving each of its folders its owner's write permission first
// (a read-only folder copied from a model directory does not leave the rest behind). Symbolic
// links are removed, never followed; what lies on another file system (a mount point inside)
// is left. True when `dir` is gone; never throws.
bool RemoveDirectoryTree(const std::string& dir);

}  // namespace tensortier
