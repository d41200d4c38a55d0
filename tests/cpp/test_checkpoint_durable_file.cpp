// The durable file of a save (temporary file, engine writes, fallocate, fdatasync, rename,
// directory fsync, background release of the replaced file), each step failed in turn through
// the fault seam: the old checkpoint stays whole, no temporary file stays behind, and the error
// names the step, the errno and the path.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tensortier/io/fault_injection.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/io/file_system.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::TempDir;

// Names in `dir` other than the checkpoint's own (temporary files of saves).
std::vector<std::string> Leftovers(const std::string& dir, const std::string& keep) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name != keep) out.push_back(name);
  }
  return out;
}

FileSystem Failing(FileStep step, int error = EIO, uint64_t nth = 1) {
  FaultPlan plan;
  plan.kind = FaultPlan::Kind::kError;
  plan.error = error;
  plan.nth = nth;
  plan.reads = plan.writes = false;
  plan.steps = 1u << static_cast<unsigned>(step);
  return FileSystem(std::make_shared<FaultInjector>(plan));
}

// A save of `size` pattern bytes (seed) to `path`, written through an engine.
void Save(const std::string& path, uint64_t size, uint64_t seed, const FileSystem& fs = {},
          Engine* engine = nullptr) {
  Engine own(testing::SmallEngineOptions(BackendKind::kThreads));
  Engine& e = engine != nullptr ? *engine : own;
  const std::vector<uint8_t> data = testing::Pattern(size, seed);
  DurableFile out(path, true, fs);
  out.Reserve(size);
  e.Write(out.file(), data.data(), data.size(), 0).Wait();
  out.Commit();
}

constexpr uint64_t kSize = 3 * 65536 + 123;  // several chunks, unaligned

TEST(DurableFileTest, ReplacesTheOldFileWhole) {
  TempDir dir;
  const std::string path = dir.File("m.safetensors");
  Save(path, 1000, 1);
  Save(path, kSize, 2);
  EXPECT_TRUE(testing::MatchesPattern(testing::ReadWholeFile(path).data(), kSize, 2, 0));
  EXPECT_EQ(testing::ReadWholeFile(path).size(), kSize);
  WaitForReplacedFiles();
  EXPECT_EQ(Leftovers(dir.path(), "m.safetensors"), std::vector<std::string>{});
}

TEST(DurableFileTest, ZeroLengthSave) {
  TempDir dir;
  const std::string path = dir.File("empty.pt");
  DurableFile out(path);
  out.Reserve(0);
  out.Commit();
  EXPECT_TRUE(out.committed());
  EXPECT_EQ(std::filesystem::file_size(path), 0u);
  EXPECT_EQ(Leftovers(dir.path(), "empty.pt"), std::vector<std::string>{});
}

TEST(DurableFileTest, SavesToANameOfTheLongestLengthAFileMayHave) {
  TempDir dir;
  // 255 bytes, the most a name may have: its temporary file needs a shorter stem.
  std::string name(255 - 3, 'm');
  name.append(".pt");
  const std::string path = dir.File(name);
  Save(path, 1000, 1);
  Save(path, kSize, 2);
  EXPECT_TRUE(testing::MatchesPattern(testing::ReadWholeFile(path).data(), kSize, 2, 0));
  WaitForReplacedFiles();
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    names.push_back(e.path().filename().string());
  }
  EXPECT_EQ(names, std::vector<std::string>{name});
}

TEST(DurableFileTest, TemporaryNameStemsFitEveryNameAndKeepThemApart) {
  EXPECT_EQ(TemporaryNameStem("m.pt"), ".m.pt.tmp-");
  const std::string longest(200, 'a');  // the longest name kept whole
  EXPECT_EQ(TemporaryNameStem(longest), "." + longest + ".tmp-");
  // 20 digits of start time and 10 of pid: the most a temporary name can add to the stem
  const size_t after_stem = std::string("4294967295-18446744073709551615-0123abcd-0123abcd").size();
  for (size_t n = 190; n <= 255; ++n) {
    EXPECT_LE(TemporaryNameStem(std::string(n, 'x')).size() + after_stem, 255u) << n;
  }
  std::string a(254, 'x'), b(254, 'x');
  a.push_back('a');
  b.push_back('b');
  EXPECT_NE(TemporaryNameStem(a), TemporaryNameStem(b));  // cut alike, told apart by the hash
  // UTF-8 names are cut between characters (3 bytes each here), never inside one.
  std::string han;
  while (han.size() < 240) han += "\xe6\xa8\xa1";
  const std::string stem = TemporaryNameStem(han);
  const size_t kept = stem.find('~') - 1;
  EXPECT_EQ(kept % 3, 0u);
  EXPECT_EQ(stem.substr(1, kept), han.substr(0, kept));
}

TEST(DurableFileTest, AbandonedWithoutCommitLeavesNothing) {
  TempDir dir;
  const std::string path = dir.File("m.pt");
  {
    DurableFile out(path);
    EXPECT_TRUE(std::filesystem::exists(out.temporary_path()));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_EQ(Leftovers(dir.path(), "m.pt"), std::vector<std::string>{});
}

TEST(DurableFileTest, MissingDirectoryIsENOENT) {
  TempDir dir;
  try {
    DurableFile out(dir.File("no/m.pt"));
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_NE(std::string(e.what()).find("no/m.pt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("directory does not exist"), std::string::npos)
        << e.what();
  }
}

class DurableFileStepTest : public ::testing::TestWithParam<FileStep> {};

// Each system call of a save fails in turn: the old checkpoint is untouched and nothing is left
// but it; the error names the step, the errno and the path.
TEST_P(DurableFileStepTest, AFailedStepKeepsTheOldCheckpoint) {
  TempDir dir;
  const std::string path = dir.File("m.safetensors");
  Save(path, 5000, 7);
  const std::vector<uint8_t> before = testing::ReadWholeFile(path);
  const FileSystem fs = Failing(GetParam(), ENOSPC);
  try {
    Save(path, kSize, 8, fs);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOSPC);
    const std::string what = e.what();
    const std::string step = GetParam() == FileStep::kOpen       ? "save (creating"
                             : GetParam() == FileStep::kAllocate ? "fallocate"
                             : GetParam() == FileStep::kDataSync ? "fdatasync"
                                                                 : "rename";
    EXPECT_NE(what.find(step), std::string::npos) << what;
    EXPECT_NE(what.find("m.safetensors"), std::string::npos) << what;
  }
  EXPECT_EQ(fs.faults()->hits(), 1u);
  EXPECT_EQ(testing::ReadWholeFile(path), before);
  WaitForReplacedFiles();
  EXPECT_EQ(Leftovers(dir.path(), "m.safetensors"), std::vector<std::string>{});
}

INSTANTIATE_TEST_SUITE_P(Steps, DurableFileStepTest,
                         ::testing::Values(FileStep::kOpen, FileStep::kAllocate,
                                           FileStep::kDataSync, FileStep::kRename),
                         [](const auto& info) { return std::string(FileStepName(info.param)); });

TEST(DurableFileTest, OpeningTheTemporaryFileForTheEngineFails) {
  TempDir dir;
  const std::string path = dir.File("m.pt");
  Save(path, 100, 3);
  const std::vector<uint8_t> before = testing::ReadWholeFile(path);
  try {
    Save(path, kSize, 4, Failing(FileStep::kOpen, EMFILE, /*nth=*/2));
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EMFILE);
    EXPECT_NE(std::string(e.what()).find(".m.pt.tmp-"), std::string::npos) << e.what();
  }
  EXPECT_EQ(testing::ReadWholeFile(path), before);
  EXPECT_EQ(Leftovers(dir.path(), "m.pt"), std::vector<std::string>{});
}

TEST(DurableFileTest, AFailedEngineWriteKeepsTheOldCheckpoint) {
  TempDir dir;
  const std::string path = dir.File("m.pt");
  Save(path, 100, 3);
  const std::vector<uint8_t> before = testing::ReadWholeFile(path);
  FaultPlan plan = testing::Plan(FaultPlan::Kind::kError, false, true, /*nth=*/2);
  plan.error = ENOSPC;
  auto injector = std::make_shared<FaultInjector>(plan);
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads), [injector](unsigned depth) {
    return MakeFaultInjectingBackend(MakeBackend(BackendKind::kThreads, depth), injector);
  });
  try {
    Save(path, kSize, 4, {}, &engine);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOSPC);
    EXPECT_NE(std::string(e.what()).find(".m.pt.tmp-"), std::string::npos) << e.what();
  }
  EXPECT_EQ(testing::ReadWholeFile(path), before);
  EXPECT_EQ(Leftovers(dir.path(), "m.pt"), std::vector<std::string>{});
}

// The rename happened: the path holds the new checkpoint whole, only its durability is unknown.
TEST(DurableFileTest, AFailedDirectoryFsyncIsReportedAfterTheRename) {
  TempDir dir;
  const std::string path = dir.File("m.pt");
  Save(path, 100, 3);
  try {
    Save(path, kSize, 4, Failing(FileStep::kSyncDirectory));
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EIO);
    EXPECT_NE(std::string(e.what()).find("fsync the directory of"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("m.pt"), std::string::npos) << e.what();
  }
  const std::vector<uint8_t> after = testing::ReadWholeFile(path);
  ASSERT_EQ(after.size(), kSize);
  EXPECT_TRUE(testing::MatchesPattern(after.data(), kSize, 4, 0));
  WaitForReplacedFiles();
  EXPECT_EQ(Leftovers(dir.path(), "m.pt"), std::vector<std::string>{});
}

TEST(DurableFileTest, AFailedOpenForReadingNamesThePath) {
  TempDir dir;
  const std::string path = dir.File("m.pt");
  Save(path, 100, 3);
  try {
    OpenCheckpointForReading(path, true, Failing(FileStep::kOpen, EACCES));
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EACCES);
    EXPECT_NE(std::string(e.what()).find("open failed on '" + path + "'"), std::string::npos)
        << e.what();
  }
}

bool FreesBlocksInRename(const std::string& dir) {
  struct statfs st {};
  if (statfs(dir.c_str(), &st) != 0) return false;
  const auto magic = static_cast<uint64_t>(st.f_type);
  return magic == 0xEF53 || magic == 0x58465342 || magic == 0x9123683E;
}

// Descriptors of this process open on a deleted `path`.
int HeldDeleted(const std::string& path) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(e.path(), ec).string() == path + " (deleted)") ++n;
  }
  return n;
}

// The replaced file is freed after the commit returns (a delayed release holds it) and before
// the next save into any path starts.
TEST(DurableFileTest, TheReplacedFileIsFreedInTheBackgroundBeforeTheNextSave) {
  TempDir dir;
  if (!FreesBlocksInRename(dir.path())) GTEST_SKIP() << "the rename frees replaced files here";
  const std::string path = dir.File("m.pt");
  Save(path, 100, 3);
  FaultPlan plan;
  plan.kind = FaultPlan::Kind::kDelay;
  plan.delay = std::chrono::seconds(2);
  plan.reads = plan.writes = false;
  plan.steps = 1u << static_cast<unsigned>(FileStep::kRelease);
  Save(path, 1000, 4, FileSystem(std::make_shared<FaultInjector>(plan)));
  EXPECT_EQ(HeldDeleted(path), 1);    // the commit returned while the old file is held
  Save(dir.File("other.pt"), 10, 5);  // waits for it first
  EXPECT_EQ(HeldDeleted(path), 0);
}

// A child made by fork() while a replaced file is held does not keep it (it would hold the old
// file's blocks for its whole life).
TEST(DurableFileTest, AChildForkedWhileAReplacedFileIsHeldDoesNotKeepIt) {
  TempDir dir;
  if (!FreesBlocksInRename(dir.path())) GTEST_SKIP() << "the rename frees replaced files here";
  const std::string path = dir.File("m.pt");
  Save(path, 100, 3);
  FaultPlan plan;
  plan.kind = FaultPlan::Kind::kDelay;
  plan.delay = std::chrono::seconds(3);
  plan.reads = plan.writes = false;
  plan.steps = 1u << static_cast<unsigned>(FileStep::kRelease);
  Save(path, 1000, 4, FileSystem(std::make_shared<FaultInjector>(plan)));
  ASSERT_EQ(HeldDeleted(path), 1);
  const pid_t child = fork();
  if (child == 0) _exit(HeldDeleted(path) == 0 ? 0 : 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  WaitForReplacedFiles();
  EXPECT_EQ(HeldDeleted(path), 0);
}

}  // namespace
}  // namespace tensortier
