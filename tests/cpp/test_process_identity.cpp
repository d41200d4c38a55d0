// The one rule for files of dead processes (util/process_identity): a stamp names a dead process
// only where it is of this boot and pid namespace, well formed, and no process with its pid and
// start time runs. Offloader backing files and checkpoint temporaries both follow it.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <limits>
#include <string>

#include "tensortier/util/process_identity.hpp"
#include "tensortier/util/strings.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

// A pid that named a process a moment ago and names none now (reaped).
using testing::DeadPid;

TEST(ProcessIdentityTest, StampNamesThisProcessAndSplitsOffWhatFollows) {
  const std::string stamp = ProcessStamp();
  EXPECT_EQ(stamp, StrCat(getpid(), "-", ProcessStartTime(getpid()), "-", PidNamespaceTag()));
  const std::string name = StrCat(stamp, "-7-0.bin");
  const auto split = SplitProcessStamp(name);
  ASSERT_TRUE(split.has_value());
  EXPECT_EQ(split->first, stamp);
  EXPECT_EQ(split->second, "7-0.bin");
  EXPECT_FALSE(SplitProcessStamp("1-2").has_value());
  EXPECT_FALSE(IsDeadProcessStamp(stamp)) << "this process runs";
}

TEST(ProcessIdentityTest, OnlyStampsOfThisNamespaceWithNoProcessAreDead) {
  const std::string tag = PidNamespaceTag();
  ASSERT_EQ(tag.size(), 8u);
  if (tag == "ffffffff") GTEST_SKIP() << "this machine's tag is the one standing for another's";
  const std::string start = ProcessStartTime(getpid());
  const pid_t dead = DeadPid();
  // Dead: a gone pid; this pid with another start time (an earlier process the pid named).
  EXPECT_TRUE(IsDeadProcessStamp(StrCat(dead, "-12345-", tag)));
  EXPECT_TRUE(IsDeadProcessStamp(StrCat(getpid(), "-", start, "0-", tag)));
  // Another machine's or container's pids and start times mean nothing here.
  EXPECT_FALSE(IsDeadProcessStamp(StrCat(dead, "-12345-ffffffff")));
  // Not stamps: no process wrote them.
  const auto too_big = static_cast<unsigned long long>(std::numeric_limits<pid_t>::max()) + 1;
  for (const std::string& text :
       {StrCat(dead, "-12345"), StrCat(dead, "--", tag), StrCat("x", dead, "-12345-", tag),
        StrCat("0-12345-", tag), StrCat(too_big, "-12345-", tag), StrCat(dead, "-12345-", tag, "0"),
        StrCat(dead, "-12345-FFFFFFFF"), std::string()}) {
    EXPECT_FALSE(IsDeadProcessStamp(text)) << text;
  }
}

// A /proc entry that cannot be read (hidepid, another user's process) is no proof of death: such a
// pid is dead only when no process has it (kill says ESRCH). A child hides this process's /proc
// entry from itself under a mount of its own (needs CAP_SYS_ADMIN; skipped without it).
TEST(ProcessIdentityTest, AnUnreadableProcEntryIsDeadOnlyWithoutAProcess) {
  const std::string tag = PidNamespaceTag();
  if (tag == "ffffffff") GTEST_SKIP() << "this machine's tag is the one standing for another's";
  const pid_t parent = getpid();
  const std::string live = StrCat(parent, "-", ProcessStartTime(parent), "-", tag);
  const std::string gone = StrCat(DeadPid(), "-12345-", tag);
  const pid_t child = fork();
  if (child == 0) {
    const std::string proc = StrCat("/proc/", parent);
    if (unshare(CLONE_NEWNS) != 0 || mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) ||
        mount("none", proc.c_str(), "tmpfs", 0, nullptr) != 0) {
      _exit(77);
    }
    if (!ProcessStartTime(parent).empty()) _exit(2);  // still readable
    if (IsDeadProcessStamp(live)) _exit(3);
    if (!IsDeadProcessStamp(gone)) _exit(4);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "cannot mount over /proc here";
  EXPECT_NE(WEXITSTATUS(status), 2) << "the hidden /proc entry was still read";
  EXPECT_NE(WEXITSTATUS(status), 3) << "a live process with an unreadable /proc entry was dead";
  EXPECT_NE(WEXITSTATUS(status), 4) << "a pid no process has was not dead";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace tensortier
