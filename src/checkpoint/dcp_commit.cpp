// The commit of a DCP checkpoint (dcp_file.hpp): the coordinator's durable .metadata, then the
// removal of the files it does not name.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dcp_naming.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/dcp_file.hpp"
#include "tensortier/io/file_system.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// An exclusive flock on DIR/.tensortier-dcp.lock, held while alive: commits into one directory
// (the rename of .metadata and the cleanup after it) take turns. The cleanup and readers ignore
// the file (not "__*.distcp", not ".__*").
class CommitLock {
 public:
  explicit CommitLock(const std::string& dir) : path_(StrCat(dir, "/.tensortier-dcp.lock")) {
    fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw IoError(errno, "open the commit lock", path_, 0, 0);
    while (flock(fd_, LOCK_EX) != 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      close(fd_);
      throw IoError(err, "lock the commit lock", path_, 0, 0);
    }
  }
  ~CommitLock() { close(fd_); }  // closing releases the flock
  CommitLock(const CommitLock&) = delete;
  CommitLock& operator=(const CommitLock&) = delete;

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace

size_t RemoveUnreferencedDcpFiles(const std::string& dir,
                                  const std::vector<std::string>& referenced) {
  const std::set<std::string> keep(referenced.begin(), referenced.end());
  std::vector<std::string> unreferenced;
  std::set<std::string> saved_names;  // NAME of each ".NAME.tmp-..." file
  {
    std::unique_ptr<DIR, int (*)(DIR*)> d(opendir(dir.c_str()), closedir);
    if (!d) throw IoError(errno, "opendir", dir, 0, 0);
    while (const dirent* e = readdir(d.get())) {
      const std::string name = e->d_name;
      if (IsDcpDataFile(name) && !keep.contains(name)) unreferenced.push_back(name);
      // An older save's rank-local metadata (__N.metadata, torch's writer without
      // collectives): it names data files going now, and dcp.load falls back to it.
      if (IsRankLocalDcpMetadata(name)) unreferenced.push_back(name);
      const size_t tmp = name.find(".tmp-");
      if (name.starts_with(".__") && tmp != std::string::npos) {
        saved_names.insert(name.substr(1, tmp - 1));
      }
    }
  }
  size_t removed = 0;
  for (const auto& name : unreferenced) {
    if (unlink(StrCat(dir, "/", name).c_str()) == 0) ++removed;
  }
  for (const auto& name : saved_names) removed += RemoveStaleTemporaryFiles(StrCat(dir, "/", name));
  FileSystem().SyncDirectory(dir, dir);
  return removed;
}

size_t CommitDcpCheckpoint(Engine& engine, const std::string& dir, std::string_view metadata,
                           const std::vector<std::string>& referenced, const std::string& who) {
  const std::string path = DcpMetadataPath(dir);
  bool replaced = false;  // the rename made the new metadata the directory's
  const CommitLock lock(dir);
  try {
    // A save that committed into the directory meanwhile removed the files its metadata does not
    // name: this one's, if they were written before its commit. Committing would name them.
    // Some there and some not, more likely: ranks that each saved into a directory of their
    // own under one path (each node's own disk), which is not one checkpoint.
    std::string first_missing;
    int missing_errno = 0;
    size_t missing = 0;
    for (const auto& name : referenced) {
      struct stat st;
      const std::string file = StrCat(dir, "/", name);
      if (stat(file.c_str(), &st) != 0) {
        if (missing++ == 0) {
          first_missing = file;
          missing_errno = errno;
        }
      }
    }
    if (missing != 0) {
      const std::string prefix = who.empty() ? "" : StrCat(who, ": ");
      throw IoError(
          missing_errno,
          missing < referenced.size()
              ? StrCat(prefix, "commit the DCP checkpoint (", missing, " of its ",
                       referenced.size(),
                       " data files are not in the directory as the coordinator sees it: every "
                       "rank must save into one directory all ranks share (a directory on each "
                       "node's own disk is not one checkpoint), or another save into this "
                       "directory committed meanwhile and removed them)")
              : StrCat(prefix,
                       "commit the DCP checkpoint (its data file is gone: another save into this "
                       "directory committed meanwhile and removed it; the directory keeps that "
                       "save's checkpoint)"),
          first_missing, 0, 0);
    }
    NamingWho(who.empty() ? who : StrCat(who, " committing the checkpoint"), path, [&] {
      DurableFile out(path, /*direct=*/false);
      try {
        if (!metadata.empty()) engine.Write(out.file(), metadata.data(), metadata.size(), 0).Wait();
        out.Commit();
      } catch (...) {
        replaced = out.committed();
        throw;
      }
    });
  } catch (...) {
    // The new checkpoint never became the directory's: its data files would only hold space
    // (on a full disk, the space the next save needs).
    if (!replaced) {
      for (const auto& name : referenced) unlink(StrCat(dir, "/", name).c_str());
    }
    throw;
  }
  return RemoveUnreferencedDcpFiles(dir, referenced);
}

}  // namespace tensortier
