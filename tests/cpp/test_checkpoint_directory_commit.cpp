// CommitDirectory: a staged directory put in place in one rename, exchanged with the old one.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>

#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/directory_commit.hpp"
#include "tensortier/util/error.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::TempDir;

void Write(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(DirectoryCommit, PutsTheStagedDirectoryWhereNoneIs) {
  TempDir tmp;
  Write(tmp.File(".m.staged/config.json"), "new");
  Write(tmp.File(".m.staged/sub/shard"), "data");
  CommitDirectory(tmp.File(".m.staged"), tmp.File("m"));
  EXPECT_EQ(Read(tmp.File("m/config.json")), "new");
  EXPECT_EQ(Read(tmp.File("m/sub/shard")), "data");
  EXPECT_FALSE(std::filesystem::exists(tmp.File(".m.staged")));
}

TEST(DirectoryCommit, ExchangesWithTheOldDirectory) {
  TempDir tmp;
  Write(tmp.File("m/config.json"), "old");
  Write(tmp.File("m/old-only"), "x");
  Write(tmp.File(".m.staged/config.json"), "new");
  CommitDirectory(tmp.File(".m.staged"), tmp.File("m"));
  EXPECT_EQ(Read(tmp.File("m/config.json")), "new");
  EXPECT_FALSE(std::filesystem::exists(tmp.File("m/old-only")));
  EXPECT_EQ(Read(tmp.File(".m.staged/config.json")), "old");  // the old one, for the caller
}

TEST(DirectoryCommit, StagingRemovesTheDirectoriesOfDeadProcessesOnly) {
  TempDir tmp;
  const std::string final_dir = tmp.File("m");
  const std::string mine = CreateStagingDirectory(final_dir);
  EXPECT_EQ(mine.rfind(TemporaryPathPrefix(final_dir), 0), 0u) << mine;
  Write(mine + "/model.safetensors", "partial");
  // A process that staged a save and was killed: its directory is left, full.
  int out[2] = {-1, -1};
  ASSERT_EQ(pipe(out), 0);
  const pid_t child = fork();
  if (child == 0) {
    const std::string dead = CreateStagingDirectory(final_dir);
    Write(dead + "/sub/shard", "partial");
    (void)!write(out[1], dead.data(), dead.size());
    _exit(0);
  }
  close(out[1]);
  char buf[4096];
  const ssize_t n = read(out[0], buf, sizeof(buf));
  close(out[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_GT(n, 0);
  const std::string dead(buf, static_cast<size_t>(n));
  ASSERT_TRUE(std::filesystem::exists(dead + "/sub/shard"));
  const std::string next = CreateStagingDirectory(final_dir);
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_EQ(Read(mine + "/model.safetensors"), "partial");  // a running process's: kept
  EXPECT_TRUE(std::filesystem::is_directory(next));
  EXPECT_NE(next, mine);
}

TEST(DirectoryCommit, RefusesToReplaceAFileAndNamesWhatFailed) {
  TempDir tmp;
  Write(tmp.File("m"), "a file");
  Write(tmp.File(".m.staged/config.json"), "new");
  try {
    CommitDirectory(tmp.File(".m.staged"), tmp.File("m"));
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOTDIR);
    EXPECT_EQ(e.path(), tmp.File("m"));
  }
  EXPECT_EQ(Read(tmp.File("m")), "a file");
  try {
    CommitDirectory(tmp.File("missing"), tmp.File("n"));
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_EQ(e.path(), tmp.File("missing"));
  }
}

}  // namespace
}  // namespace tensortier
