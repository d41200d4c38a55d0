// Opening checkpoints for reading (never blocking on a FIFO) and the rules of replacing one:
// permissions, owner and group kept, temporary files of killed saves removed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/process_identity.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::TempDir;

using testing::WriteText;

int ErrnoOf(const std::function<void()>& body) {
  try {
    body();
  } catch (const IoError& e) {
    return e.error_code();
  }
  return 0;
}

// The base name of a temporary file `final_path`'s saves by this process would write.
std::string OwnTemporaryName(const std::string& final_path, const std::string& random) {
  return std::filesystem::path(TemporaryPathPrefix(final_path) + random).filename().string();
}

// The pid of a process that ran and is gone (reaped).
using testing::DeadPid;

void SetMtime(const std::string& path, time_t seconds_ago) {
  const timespec times[2] = {{time(nullptr) - seconds_ago, 0}, {time(nullptr) - seconds_ago, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
}

TEST(CheckpointFileTest, OpenForReadingRefusesAFifoWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.File("f.safetensors");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  for (bool direct : {false, true}) {
    try {
      OpenCheckpointForReading(fifo, direct);
      ADD_FAILURE() << "a FIFO was opened";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_code(), EINVAL);
      EXPECT_EQ(e.path(), fifo);
      EXPECT_NE(std::string(e.what()).find("FIFO"), std::string::npos) << e.what();
    }
  }
}

TEST(CheckpointFileTest, OpenForReadingRefusesDevicesAndDirectories) {
  TempDir dir;
  EXPECT_EQ(ErrnoOf([] { OpenCheckpointForReading("/dev/null", false); }), EINVAL);
  for (bool direct : {false, true}) {
    try {
      OpenCheckpointForReading(dir.path(), direct);
      ADD_FAILURE() << "a directory was opened";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_code(), EISDIR);
      EXPECT_EQ(e.path(), dir.path());
      EXPECT_NE(std::string(e.what()).find("a directory: pass a checkpoint file or a shard"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(ErrnoOf([&] { OpenCheckpointForReading(dir.File("missing"), false); }), ENOENT);
  WriteText(dir.File("ok"), "");  // zero bytes: opened, the parsers judge the content
  EXPECT_EQ(OpenCheckpointForReading(dir.File("ok"), true).Size(), 0u);
}

TEST(CheckpointFileTest, CheckReplaceableDescribesWhatIsThere) {
  TempDir dir;
  EXPECT_FALSE(CheckReplaceable(dir.File("new.pt")).has_value());
  WriteText(dir.File("ck.pt"), "x");
  ASSERT_EQ(chmod(dir.File("ck.pt").c_str(), 0640), 0);
  const auto old = CheckReplaceable(dir.File("ck.pt"));
  ASSERT_TRUE(old.has_value());
  EXPECT_EQ(old->mode, 0640u);
  EXPECT_EQ(old->uid, geteuid());
  EXPECT_EQ(ErrnoOf([&] { CheckReplaceable(dir.path()); }), EISDIR);
  ASSERT_EQ(mkfifo(dir.File("fifo.pt").c_str(), 0644), 0);
  EXPECT_EQ(ErrnoOf([&] { CheckReplaceable(dir.File("fifo.pt")); }), EINVAL);
}

// What open(O_WRONLY) decides: refused for a user without write permission; root may write.
TEST(CheckpointFileTest, CheckReplaceableRefusesAReadOnlyFileAsOpenWould) {
  TempDir dir;
  const std::string ro = dir.File("ro.pt");
  WriteText(ro, "x");
  ASSERT_EQ(chmod(ro.c_str(), 0444), 0);
  const bool may_open = [&] {
    const int fd = open(ro.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd >= 0) close(fd);
    return fd >= 0;
  }();
  EXPECT_EQ(ErrnoOf([&] { CheckReplaceable(ro); }), may_open ? 0 : EACCES);
  if (geteuid() != 0) return;
  // As root, also as another user (a child that gives up root): refused then.
  ASSERT_EQ(chmod(dir.path().c_str(), 0755), 0);
  const pid_t child = fork();
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    _exit(ErrnoOf([&] { CheckReplaceable(ro); }) == EACCES ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

TEST(CheckpointFileTest, KeepAttributesGivesTheOldOwnerGroupAndMode) {
  if (geteuid() != 0) GTEST_SKIP() << "giving a file another user's ownership needs root";
  TempDir dir;
  WriteText(dir.File("new"), "x");
  const int fd = open(dir.File("new").c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  KeepAttributes(fd, ReplacedFile{02750, 65534, 65534}, dir.File("ck.pt"));
  struct stat st{};
  ASSERT_EQ(fstat(fd, &st), 0);
  close(fd);
  EXPECT_EQ(st.st_uid, 65534u);
  EXPECT_EQ(st.st_gid, 65534u);
  EXPECT_EQ(st.st_mode & 07777, 02750u);  // the set-group-ID bit survives the chown
}

TEST(CheckpointFileTest, TemporaryNamesCarryPidStartTimeAndTag) {
  TempDir dir;
  const std::string prefix = TemporaryPathPrefix(dir.File("ck.safetensors"));
  const std::string expected = StrCat(dir.File(".ck.safetensors.tmp-"), getpid(), "-",
                                      ProcessStartTime(getpid()), "-", PidNamespaceTag(), "-");
  EXPECT_EQ(prefix, expected);
  EXPECT_FALSE(ProcessStartTime(getpid()).empty());
  EXPECT_EQ(PidNamespaceTag().size(), 8u);
  EXPECT_EQ(ProcessStartTime(DeadPid()), "");
}

TEST(CheckpointFileTest, RemovesTemporaryFilesOfGoneProcessesOnly) {
  TempDir dir;
  const std::string final_path = dir.File("ck.pt");
  const std::string tag = PidNamespaceTag();
  const pid_t dead = DeadPid();
  const std::string me = std::to_string(getpid());
  const std::string start = ProcessStartTime(getpid());
  // Removed: a gone pid; this pid with another start time (an earlier process the pid named).
  const std::string gone = StrCat(".ck.pt.tmp-", dead, "-12345-", tag, "-0000abcd");
  const std::string reused = StrCat(".ck.pt.tmp-", me, "-", start, "0-", tag, "-0000abce");
  // Kept: a live process's own file; another machine's or container's; an old-form file of a
  // live pid, or a recent one; other names.
  const std::string live = OwnTemporaryName(final_path, "0000abcf");
  const std::string other_tag = StrCat(".ck.pt.tmp-", dead, "-12345-", "ffffffff", "-0000abd0");
  const std::string old_live_pid = StrCat(".ck.pt.tmp-", me, "-0000abd1");
  const std::string old_recent = StrCat(".ck.pt.tmp-", dead, "-0000abd2");
  const std::string old_stale = StrCat(".ck.pt.tmp-", dead, "-0000abd3");
  const std::string other_file = StrCat(".other.pt.tmp-", dead, "-12345-", tag, "-0000abd4");
  const std::string odd = StrCat(".ck.pt.tmp-", dead, "-12345-", tag, "-xyz");
  for (const auto& name :
       {gone, reused, live, other_tag, old_live_pid, old_recent, old_stale, other_file, odd}) {
    WriteText(dir.File(name), "partial");
  }
  SetMtime(dir.File(old_live_pid), 7200);
  SetMtime(dir.File(old_stale), 7200);
  if (tag == "ffffffff") GTEST_SKIP() << "this machine's tag is the one standing for another's";
  EXPECT_EQ(RemoveStaleTemporaryFiles(final_path), 3u);
  for (const auto& name : {gone, reused, old_stale}) {
    EXPECT_FALSE(std::filesystem::exists(dir.File(name))) << name;
  }
  for (const auto& name : {live, other_tag, old_live_pid, old_recent, other_file, odd}) {
    EXPECT_TRUE(std::filesystem::exists(dir.File(name))) << name;
  }
  EXPECT_EQ(RemoveStaleTemporaryFiles(dir.File("missing-dir/ck.pt")), 0u);
}

// A job saving to a new name each time and killed meanwhile leaves temporary files under names
// no later save takes: the first save into the directory removes them, whatever their names.
TEST(CheckpointFileTest, TheFirstSaveIntoADirectoryRemovesDeadSavesFilesOfEveryName) {
  TempDir dir;
  const std::string tag = PidNamespaceTag();
  if (tag == "ffffffff") GTEST_SKIP() << "this machine's tag is the one standing for another's";
  const pid_t dead = DeadPid();
  const std::string step1 = StrCat(".ck_step1.pt.tmp-", dead, "-12345-", tag, "-0000abcd");
  const std::string odd_name = StrCat(".a.tmp-b.tmp-", dead, "-12345-", tag, "-0000abce");
  std::filesystem::create_directory(dir.File(StrCat(".m.tmp-", dead, "-12345-", tag, "-0000abcf")));
  // Kept: a live process's, another machine's, the older unstamped form, a user's own files.
  const std::string live = OwnTemporaryName(dir.File("ck_step2.pt"), "0000abd0");
  const std::string other_tag = StrCat(".x.pt.tmp-", dead, "-12345-ffffffff-0000abd1");
  const std::string old_form = StrCat(".x.pt.tmp-", dead, "-0000abd2");
  for (const auto& name : {step1, odd_name, live, other_tag, old_form,
                           std::string("notes.tmp-1-2-3-4"), std::string(".tmp-1-2-3-4")}) {
    WriteText(dir.File(name), "partial");
  }
  SetMtime(dir.File(old_form), 7200);
  EXPECT_EQ(RemoveStaleTemporaryFilesOnce(dir.path()), 3u);
  EXPECT_FALSE(std::filesystem::exists(dir.File(step1)));
  EXPECT_FALSE(std::filesystem::exists(dir.File(odd_name)));
  for (const auto& name :
       {live, other_tag, old_form, std::string("notes.tmp-1-2-3-4"), std::string(".tmp-1-2-3-4")}) {
    EXPECT_TRUE(std::filesystem::exists(dir.File(name))) << name;
  }
  WriteText(dir.File(step1), "partial");
  EXPECT_EQ(RemoveStaleTemporaryFilesOnce(dir.path()), 0u) << "once per directory";
}

}  // namespace
}  // namespace tensortier
