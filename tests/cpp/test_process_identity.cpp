// The one rule for files of dead processes (util/process_identity): a stamp names a dead process
// only where it is of this boot and pid namespace, well formed, and no process with its pid and
// start time runs. Offloader backing files and checkpoint temporaries both follow it.
#include <gtest/gtest.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <limits>
#include <string>

#include "tensortier/util/process_identity.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// A pid that named a process a moment ago and names none now (reaped).
pid_t DeadPid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

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
        StrCat("0-12345-", tag), StrCat(too_big, "-12345-", tag),
        StrCat(dead, "-12345-", tag, "0"), StrCat(dead, "-12345-FFFFFFFF"), std::string()}) {
    EXPECT_FALSE(IsDeadProcessStamp(text)) << text;
  }
}

}  // namespace
}  // namespace tensortier
