// ThreadGroup: all threads or none, stopped and joined on destruction, and a process out of
// threads gets std::system_error naming what could not start (checked in a pids cgroup: root is
// exempt from RLIMIT_NPROC).
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <system_error>

#include <gtest/gtest.h>

#include "tensortier/util/strings.hpp"
#include "tensortier/util/thread_group.hpp"

namespace tensortier {
namespace {

// Threads that wait on a condition variable until told to stop, counting how many ran and
// how many returned.
struct Sleepers {
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::atomic<int> started{0};
  std::atomic<int> returned{0};
  std::atomic<int> stops{0};

  void Body() {
    ++started;
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return stopping; });
    ++returned;
  }
  void Stop() {
    ++stops;
    {
      std::lock_guard lock(mu);
      stopping = true;
    }
    cv.notify_all();
  }
};

TEST(ThreadGroupTest, RunsEveryThreadAndStopsAndJoinsThemOnDestruction) {
  Sleepers s;
  {
    ThreadGroup group(
        4, "test threads", [&] { s.Body(); }, [&] { s.Stop(); });
  }
  EXPECT_EQ(s.started.load(), 4);
  EXPECT_EQ(s.returned.load(), 4);  // joined: every body has returned
  EXPECT_EQ(s.stops.load(), 1);
}

TEST(ThreadGroupTest, StopIsIdempotentAndTheDestructorDoesNotStopTwice) {
  Sleepers s;
  {
    ThreadGroup group(
        2, "test threads", [&] { s.Body(); }, [&] { s.Stop(); });
    group.Stop();
    EXPECT_EQ(s.returned.load(), 2);
    group.Stop();
  }
  EXPECT_EQ(s.stops.load(), 1);
}

TEST(ThreadGroupTest, NoThreadsStartsNothingAndNeverCallsStop) {
  Sleepers s;
  {
    ThreadGroup group(
        0, "test threads", [&] { s.Body(); }, [&] { s.Stop(); });
  }
  EXPECT_EQ(s.started.load(), 0);
  EXPECT_EQ(s.stops.load(), 0);
}

// The cgroup v1 pids hierarchy where this process may make groups, else "".
[[maybe_unused]] std::string PidsCgroupRoot() {
  const std::string root = "/sys/fs/cgroup/pids";
  if (geteuid() != 0 || access((root + "/cgroup.procs").c_str(), W_OK) != 0) return "";
  return root;
}

[[maybe_unused]] bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.flush();
  return static_cast<bool>(out);
}

// In a child allowed two more tasks than it has, a group of three starts two, stops and joins
// them (the child would die of std::terminate otherwise), and throws EAGAIN naming `what`.
TEST(ThreadGroupTest, AThreadThatCannotStartStopsThoseStartedAndThrowsEagainNamingThem) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "fork() under TSan";
#else
  const std::string root = PidsCgroupRoot();
  if (root.empty()) GTEST_SKIP() << "needs root and the cgroup v1 pids controller";
  const std::string group = StrCat(root, "/tensortier-thread-group-test-", getpid());
  if (mkdir(group.c_str(), 0755) != 0) {
    GTEST_SKIP() << "cannot make a pids cgroup: " << std::strerror(errno);
  }
  const pid_t child = fork();
  if (child == 0) {
    // 0 when every check passes, else the number of the first that failed.
    auto check = [&]() -> int {
      if (!WriteFile(group + "/cgroup.procs", std::to_string(getpid()))) return 1;
      std::ifstream current(group + "/pids.current");
      int tasks = 0;
      if (!(current >> tasks) || tasks < 1) return 2;
      if (!WriteFile(group + "/pids.max", std::to_string(tasks + 2))) return 3;
      Sleepers s;
      try {
        ThreadGroup threads(
            3, "test threads (TEST_SETTING)", [&] { s.Body(); }, [&] { s.Stop(); });
        return 4;  // all three started: the limit did not bite
      } catch (const std::system_error& e) {
        if (e.code().value() != EAGAIN) return 5;
        if (std::string(e.what()).find("start 3 test threads (TEST_SETTING)") ==
            std::string::npos) {
          return 6;
        }
      }
      if (s.started.load() != 2 || s.returned.load() != 2 || s.stops.load() != 1) return 7;
      return 0;
    };
    _exit(check());
  }
  ASSERT_GE(child, 0) << std::strerror(errno);
  int status = 0;
  const pid_t waited = waitpid(child, &status, 0);
  rmdir(group.c_str());
  ASSERT_EQ(waited, child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "1: cannot join the cgroup, 2: no pids.current, 3: cannot set pids.max, 4: no limit, "
         "5: not EAGAIN, 6: message does not name the threads, 7: started threads not stopped";
#endif
}

}  // namespace
}  // namespace tensortier
