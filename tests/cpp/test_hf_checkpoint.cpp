// The Hugging Face model directories tensortier.hf reads (hf_checkpoint.hpp).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tensortier/checkpoint/directory_commit.hpp"
#include "tensortier/checkpoint/hf_checkpoint.hpp"
#include "tensortier/io/fault_injection.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::TempDir;

TEST(HfCheckpoint, FindsTheIndexOrFileUnlessQuantized) {
  TempDir dir;
  const std::string d = dir.path();
  EXPECT_FALSE(FindHfCheckpoint(d).has_value());  // nothing there
  std::ofstream(d + "/model.safetensors") << "x";
  EXPECT_FALSE(FindHfCheckpoint(d).has_value());  // no config.json
  std::ofstream(d + "/config.json") << R"({"model_type": "llama", "n": [1, {"a": 2}]})";
  ASSERT_TRUE(FindHfCheckpoint(d).has_value());
  EXPECT_EQ(FindHfCheckpoint(d)->target, d + "/model.safetensors");
  std::ofstream(d + "/model.safetensors.index.json")
      << R"({"metadata": {}, "weight_map": {"w": "model.safetensors"}})";
  EXPECT_EQ(FindHfCheckpoint(d)->target, d + "/model.safetensors");  // transformers' choice too
  std::filesystem::rename(d + "/model.safetensors", d + "/shard.safetensors");
  EXPECT_EQ(FindHfCheckpoint(d)->target, d + "/model.safetensors.index.json");
  std::filesystem::rename(d + "/shard.safetensors", d + "/model.safetensors");
  EXPECT_EQ(HfShardIndexOf(d, "model.safetensors", {{"w", "model.safetensors"}}),
            d + "/model.safetensors.index.json");
  try {
    HfShardIndexOf(d, "model.safetensors", {{"v", "model.safetensors"}});
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
  }
  std::ofstream(d + "/config.json") << R"({"quantization_config": {"bits": 4}})";
  EXPECT_FALSE(FindHfCheckpoint(d).has_value());
  std::ofstream(d + "/config.json") << "{";  // malformed
  EXPECT_FALSE(FindHfCheckpoint(d).has_value());
}

TEST(HfCheckpoint, WeightsFileInFromPretrainedsOrderOrTheFilesToNameInstead) {
  TempDir dir;
  const std::string d = dir.path();
  EXPECT_FALSE(HfWeightsFile(d).has_value());  // no weights at all: not a model directory
  EXPECT_FALSE(HfWeightsFile(d + "/config.json").has_value());  // not a directory
  std::ofstream(d + "/config.json") << "{}";
  std::ofstream(d + "/model.fp16.safetensors") << "x";
  for (int shard = 1; shard <= 5; ++shard) {  // a sharded variant: its index is named first
    std::ofstream(StrCat(d, "/model-0000", shard, "-of-00005.bf16.safetensors")) << "x";
  }
  std::ofstream(d + "/model.safetensors.index.bf16.json") << "{}";
  try {
    HfWeightsFile(d);
    FAIL() << "no error";
  } catch (const FormatError& e) {  // a variant is read by name: say which names there are
    EXPECT_NE(std::string(e.what()).find(
                  "pass one of the weights files it holds: model.safetensors.index.bf16.json, "
                  "model-00001-of-00005.bf16.safetensors, model-00002-of-00005.bf16.safetensors, "
                  "model-00003-of-00005.bf16.safetensors and 3 more"),
              std::string::npos)
        << e.what();
  }
  std::vector<std::string> order(std::begin(kHfWeightsFiles), std::end(kHfWeightsFiles));
  for (auto it = order.rbegin(); it != order.rend(); ++it) {  // each one takes precedence
    std::ofstream(d + "/" + *it) << "x";
    EXPECT_EQ(HfWeightsFile(d), d + "/" + *it);
  }
  EXPECT_EQ(FindHfCheckpoint(d)->target, d + "/model.safetensors");
}

// A safetensors file at `path` holding one byte for each of `names`.
void WriteSafetensors(const std::string& path, const std::vector<std::string>& names) {
  std::string json = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    json += StrCat(i ? "," : "", "\"", names[i], "\":{\"dtype\":\"U8\",\"shape\":[1],",
                   "\"data_offsets\":[", i, ",", i + 1, "]}");
  }
  json += "}";
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = json.size();
  for (int k = 0; k < 8; ++k) out.put(static_cast<char>((n >> (8 * k)) & 0xff));
  out << json << std::string(names.size(), 'x');
}

TEST(HfCheckpoint, LoadTargetIsTheFileOrTheIndexOfExactlyTheShards) {
  TempDir dir;
  const std::string d = dir.path();
  EXPECT_EQ(HfLoadTarget({d + "/model.safetensors"}, std::nullopt), d + "/model.safetensors");
  EXPECT_FALSE(HfLoadTarget({d + "/a.safetensors", d + "/b.safetensors"}, std::nullopt));
  WriteSafetensors(d + "/a.safetensors", {"w"});
  WriteSafetensors(d + "/b.safetensors", {"v"});
  std::ofstream(d + "/model.safetensors.index.json")
      << R"({"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}})";
  const std::map<std::string, std::string> map{{"w", "a.safetensors"}, {"v", "b.safetensors"}};
  EXPECT_EQ(HfLoadTarget({d + "/a.safetensors", d + "/b.safetensors"}, map),
            d + "/model.safetensors.index.json");
  // A file beside the shards: transformers reads them itself.
  EXPECT_FALSE(
      HfLoadTarget({d + "/a.safetensors", d + "/b.safetensors", d + "/c.safetensors"}, map));
  // A shard holding a tensor the index leaves out (transformers loads it): transformers' too.
  WriteSafetensors(d + "/b.safetensors", {"v", "left_out"});
  EXPECT_FALSE(HfLoadTarget({d + "/a.safetensors", d + "/b.safetensors"}, map));
  // No index in the folder has the map transformers read (one naming a tensor twice, which
  // json.load reads as its last entry): transformers' too.
  const std::map<std::string, std::string> other{{"w", "a.safetensors"}};
  EXPECT_FALSE(HfLoadTarget({d + "/a.safetensors"}, other));
  try {
    HfShardIndexOf(d, d + "/a.safetensors", other);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
  }
}

struct stat StatOf(const std::string& path) {
  struct stat st{};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st;
}

std::string Contents(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(HfCheckpoint, StagedSaveLinksTheWeightsAndCopiesTheRest) {
  TempDir dir;
  const std::string m = dir.path() + "/models/m";
  // Nothing there yet: the parent is made, the staging directory is empty and beside `m`.
  const HfSaveStaging fresh = StageHfSave(m);
  EXPECT_EQ(fresh.dir.substr(0, fresh.dir.rfind('/')), dir.path() + "/models");
  EXPECT_TRUE(std::filesystem::is_empty(fresh.dir));
  EXPECT_TRUE(fresh.kept.empty());
  std::filesystem::remove(fresh.dir);
  std::filesystem::create_directories(m + "/sub");
  std::ofstream(m + "/model.safetensors") << "weights";
  std::ofstream(m + "/config.json") << "{}";
  std::ofstream(m + "/sub/tokenizer.model") << "tok";
  std::ofstream(m + "/sub/adapter_config.json") << "{}";
  std::ofstream(m + "/README.md") << "card";
  std::ofstream(m + "/train.log") << "log";
  std::ofstream(m + "/pytorch_model.bin") << "torch.save shard";
  std::filesystem::create_symlink("config.json", m + "/link.json");
  std::filesystem::create_symlink(".", m + "/self");  // followed, it would never end
  ASSERT_EQ(::mkfifo((m + "/events.json").c_str(), 0600), 0);  // linked: a FIFO has no copy
  ASSERT_EQ(::chmod((m + "/config.json").c_str(), 0640), 0);
  const struct timespec old[2] = {{1000, 0}, {2000, 5}};
  ASSERT_EQ(::utimensat(AT_FDCWD, (m + "/config.json").c_str(), old, 0), 0);
  const HfSaveStaging staging = StageHfSave(m);
  const std::string& staged = staging.dir;
  std::set<std::string> kept;
  for (const auto& [path, entry] : staging.kept) kept.insert(path);
  EXPECT_EQ(kept,
            (std::set<std::string>{"README.md", "config.json", "events.json", "link.json",
                                   "model.safetensors", "pytorch_model.bin", "self", "sub",
                                   "sub/adapter_config.json", "sub/tokenizer.model", "train.log"}));
  EXPECT_TRUE(staging.kept.at("train.log").staged_file.has_value());  // regular files' versions
  EXPECT_TRUE(staging.kept.at("train.log").linked);
  EXPECT_FALSE(staging.kept.at("config.json").linked);
  EXPECT_EQ(StatOf(staged + "/events.json").st_ino, StatOf(m + "/events.json").st_ino);
  EXPECT_FALSE(staging.kept.at("sub").staged_file.has_value());
  EXPECT_FALSE(staging.kept.at("link.json").staged_file.has_value());
  EXPECT_EQ(StatOf(staged + "/model.safetensors").st_ino, StatOf(m + "/model.safetensors").st_ino);
  const struct stat copy = StatOf(staged + "/config.json");
  EXPECT_NE(copy.st_ino, StatOf(m + "/config.json").st_ino);
  EXPECT_EQ(copy.st_mode & 07777, 0640u);
  EXPECT_EQ(copy.st_mtim.tv_sec, 2000);
  EXPECT_EQ(Contents(staged + "/config.json"), "{}");
  EXPECT_EQ(Contents(staged + "/sub/tokenizer.model"), "tok");
  // Besides what a save rewrites in place: the same files (a log goes on being written).
  EXPECT_EQ(StatOf(staged + "/sub/tokenizer.model").st_ino,
            StatOf(m + "/sub/tokenizer.model").st_ino);
  EXPECT_EQ(StatOf(staged + "/train.log").st_ino, StatOf(m + "/train.log").st_ino);
  // JSON files and model cards at any depth are copies (a model class's own save, PEFT's,
  // writes them in place: the old directory's stay as they are until the swap).
  for (const char* copied : {"/README.md", "/sub/adapter_config.json"}) {
    EXPECT_NE(StatOf(staged + copied).st_ino, StatOf(m + copied).st_ino) << copied;
    EXPECT_EQ(Contents(staged + copied), Contents(m + copied)) << copied;
  }
  EXPECT_NE(StatOf(staged + "/pytorch_model.bin").st_ino, StatOf(m + "/pytorch_model.bin").st_ino);
  EXPECT_EQ(std::filesystem::read_symlink(staged + "/link.json"), "config.json");
  EXPECT_EQ(std::filesystem::read_symlink(staged + "/self"), ".");
  std::ofstream(dir.path() + "/file") << "x";
  try {
    StageHfSave(dir.path() + "/file");
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOTDIR);
  }
}

// A commit whose exchange fails with `error` (0: none), into a model directory holding one file.
HfSaveCommit CommitWithExchangeFault(const std::string& m, int error) {
  std::filesystem::create_directories(m);
  std::ofstream(m + "/old.txt") << "old";
  const HfSaveStaging staging = StageHfSave(m);
  std::ofstream(staging.dir + "/new.txt") << "new";
  FaultPlan plan;
  plan.kind = error != 0 ? FaultPlan::Kind::kError : FaultPlan::Kind::kNone;
  plan.error = error;
  plan.reads = plan.writes = false;
  plan.steps = 1u << static_cast<unsigned>(FileStep::kExchange);
  const HfSaveCommit commit =
      CommitHfSave(staging, m, FileSystem(std::make_shared<FaultInjector>(plan)));
  EXPECT_FALSE(std::filesystem::exists(staging.dir)) << "the staging directory is removed";
  return commit;
}

TEST(HfCheckpoint, ACommitSwapsTheDirectoryOrSaysToWriteInPlaceWhereItCannot) {
  TempDir dir;
  const HfSaveCommit swapped = CommitWithExchangeFault(dir.path() + "/a", 0);
  EXPECT_TRUE(swapped.swapped);
  EXPECT_TRUE(swapped.left.empty());
  EXPECT_EQ(Contents(dir.path() + "/a/new.txt"), "new");
  EXPECT_EQ(Contents(dir.path() + "/a/old.txt"), "old");  // kept by the staging: linked
  // A bind mount (EBUSY, EXDEV) or a file system without RENAME_EXCHANGE: written in place.
  for (int error : {EBUSY, EXDEV, EINVAL, ENOSYS, EOPNOTSUPP}) {
    const std::string m = StrCat(dir.path(), "/e", error);
    const HfSaveCommit commit = CommitWithExchangeFault(m, error);
    EXPECT_FALSE(commit.swapped) << error;
    EXPECT_FALSE(std::filesystem::exists(m + "/new.txt")) << "the old directory stays";
  }
  try {
    CommitWithExchangeFault(dir.path() + "/eio", EIO);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EIO);
    EXPECT_EQ(e.path(), dir.path() + "/eio");
  }
  EXPECT_EQ(Contents(dir.path() + "/eio/old.txt"), "old");
}

// The parent directory's fsync fails after the exchange: the new directory stays in place, the
// file another process wrote into the old one meanwhile is carried over, the error reported.
TEST(HfCheckpoint, AFailureAfterTheExchangeKeepsTheNewDirectoryAndTheOldOnesNewFiles) {
  TempDir dir;
  const std::string m = dir.path() + "/m";
  std::filesystem::create_directories(m);
  std::ofstream(m + "/old.txt") << "old";
  const HfSaveStaging staging = StageHfSave(m);
  std::ofstream(staging.dir + "/new.txt") << "new";
  std::ofstream(m + "/late.txt") << "written during the save";
  FaultPlan plan;
  plan.kind = FaultPlan::Kind::kError;
  plan.nth = 2;  // the staged directory's own fsync, then its parent's after the exchange
  plan.reads = plan.writes = false;
  plan.steps = 1u << static_cast<unsigned>(FileStep::kSyncDirectory);
  EXPECT_THROW(CommitHfSave(staging, m, FileSystem(std::make_shared<FaultInjector>(plan))),
               IoError);
  EXPECT_EQ(Contents(m + "/new.txt"), "new");
  EXPECT_EQ(Contents(m + "/late.txt"), "written during the save");
  EXPECT_FALSE(std::filesystem::exists(staging.dir));
}

TEST(HfCheckpoint, ALinkedShardIsReplacedAndItsTargetLeftOrTheWrittenFileRemoved) {
  TempDir dir;
  std::ofstream(dir.File("blob")) << "cached";
  std::filesystem::create_symlink(dir.File("blob"), dir.File("model.safetensors"));
  std::ofstream(dir.File("written")) << "new";
  ReplaceLinkedShard(dir.File("written"), dir.File("model.safetensors"));
  EXPECT_FALSE(std::filesystem::is_symlink(dir.File("model.safetensors")));
  EXPECT_EQ(Contents(dir.File("model.safetensors")), "new");
  EXPECT_EQ(Contents(dir.File("blob")), "cached");
  std::filesystem::create_symlink(dir.File("blob"), dir.File("other.safetensors"));
  std::ofstream(dir.File("written")) << "new";
  FaultPlan plan;
  plan.kind = FaultPlan::Kind::kError;
  plan.error = EIO;
  plan.reads = plan.writes = false;
  plan.steps = 1u << static_cast<unsigned>(FileStep::kRename);
  EXPECT_THROW(ReplaceLinkedShard(dir.File("written"), dir.File("other.safetensors"),
                                  FileSystem(std::make_shared<FaultInjector>(plan))),
               IoError);
  EXPECT_TRUE(std::filesystem::is_symlink(dir.File("other.safetensors")));
  EXPECT_FALSE(std::filesystem::exists(dir.File("written")));
}

// Another process changes files of the model directory while a save runs: a file rewritten in
// place, one replaced by rename, one removed. The new directory has their changes (they used to
// come back as staged), except where the save wrote the file itself: the save's wins.
TEST(HfCheckpoint, FilesChangedInTheOldDirectoryDuringASaveAreChangedInTheNewOne) {
  TempDir dir;
  const std::string m = dir.path() + "/m";
  std::filesystem::create_directories(m + "/sub");
  for (const char* name :
       {"metrics.json", "status.txt", "old.txt", "sub/notes.md", "config.json", "gone-too.txt"}) {
    std::ofstream(m + "/" + name) << "before " << name;
  }
  std::ofstream(m + "/train.log") << "log";  // linked: one file in both
  const HfSaveStaging staging = StageHfSave(m);
  // The save rewrites config.json and removes gone-too.txt; another process, meanwhile:
  std::ofstream(staging.dir + "/config.json") << "the save's";
  std::filesystem::remove(staging.dir + "/gone-too.txt");
  std::ofstream(m + "/metrics.json") << "rewritten in place";
  std::ofstream(m + "/status.tmp") << "replaced by rename";
  std::filesystem::rename(m + "/status.tmp", m + "/status.txt");
  std::filesystem::remove(m + "/old.txt");
  std::ofstream(m + "/sub/notes.md") << "rewritten below the top";
  std::ofstream(m + "/config.json") << "another process's";  // the save's wins
  std::ofstream(m + "/train.log", std::ios::app) << "appended";
  const HfSaveCommit commit = CommitHfSave(staging, m);
  EXPECT_TRUE(commit.swapped);
  EXPECT_TRUE(commit.left.empty());
  EXPECT_EQ(Contents(m + "/metrics.json"), "rewritten in place");
  EXPECT_EQ(Contents(m + "/status.txt"), "replaced by rename");
  EXPECT_FALSE(std::filesystem::exists(m + "/old.txt"));
  EXPECT_EQ(Contents(m + "/sub/notes.md"), "rewritten below the top");
  EXPECT_EQ(Contents(m + "/config.json"), "the save's");
  EXPECT_FALSE(std::filesystem::exists(m + "/gone-too.txt"));
  EXPECT_EQ(Contents(m + "/train.log"), "logappended");
  EXPECT_FALSE(std::filesystem::exists(staging.dir));
}

// A log another process appends to and rotates during a save (renamed aside, a new one begun):
// the new directory has both. The appended link looked written by the save, so the new log was
// left in the old directory and removed with it.
TEST(HfCheckpoint, ALogRotatedDuringASaveIsCarriedWhole) {
  TempDir dir;
  const std::string m = dir.path() + "/m";
  std::filesystem::create_directories(m);
  std::ofstream(m + "/train.log") << "1\n";
  const HfSaveStaging staging = StageHfSave(m);
  EXPECT_TRUE(staging.kept.at("train.log").linked);
  std::ofstream(staging.dir + "/model.safetensors") << "the save's";
  std::ofstream(m + "/train.log", std::ios::app) << "2\n";
  std::filesystem::rename(m + "/train.log", m + "/train.log.1");
  std::ofstream(m + "/train.log") << "3\n";
  const HfSaveCommit commit = CommitHfSave(staging, m);
  EXPECT_TRUE(commit.swapped);
  EXPECT_TRUE(commit.left.empty());
  EXPECT_EQ(Contents(m + "/train.log.1"), "1\n2\n");
  EXPECT_EQ(Contents(m + "/train.log"), "3\n");
}

// What cannot move into the new directory (a kept file another process made a folder) is kept
// beside it, without the old model: a checkpoint loop would keep a whole model at each save.
TEST(HfCheckpoint, TheOldDirectoryKeptForWhatCouldNotMoveHoldsOnlyThat) {
  TempDir dir;
  const std::string m = dir.path() + "/m";
  std::filesystem::create_directories(m + "/sub");
  std::ofstream(m + "/model.safetensors") << "old weights";
  std::ofstream(m + "/config.json") << "old config";
  std::ofstream(m + "/sub/tokenizer.model") << "tok";
  std::ofstream(m + "/status") << "a file";
  const HfSaveStaging staging = StageHfSave(m);
  std::ofstream(staging.dir + "/model.safetensors.tmp") << "new weights";
  std::filesystem::rename(staging.dir + "/model.safetensors.tmp",
                          staging.dir + "/model.safetensors");
  std::filesystem::remove(m + "/status");
  std::filesystem::create_directories(m + "/status");
  std::ofstream(m + "/status/state") << "another process's";
  const HfSaveCommit commit = CommitHfSave(staging, m);
  EXPECT_TRUE(commit.swapped);
  EXPECT_EQ(commit.left, std::vector<std::string>{"status"});
  ASSERT_FALSE(commit.kept_dir.empty());
  std::set<std::string> kept;
  for (const auto& e : std::filesystem::recursive_directory_iterator(commit.kept_dir)) {
    kept.insert(e.path().lexically_relative(commit.kept_dir).string());
  }
  EXPECT_EQ(kept, (std::set<std::string>{"status", "status/state"}));
  EXPECT_EQ(Contents(m + "/model.safetensors"), "new weights");
  EXPECT_EQ(Contents(m + "/sub/tokenizer.model"), "tok");
  EXPECT_EQ(Contents(m + "/status"), "a file");
}

// A staged copy the save did not write is replaced by the old directory's file itself: a
// notes.md held open goes on being written, into the new directory, after the swap.
TEST(HfCheckpoint, AFileHeldOpenGoesOnBeingWrittenAfterTheSwap) {
  TempDir dir;
  const std::string m = dir.path() + "/m";
  std::filesystem::create_directories(m + "/sub");
  std::ofstream(m + "/sub/notes.md") << "a\n";
  const int fd = ::open((m + "/sub/notes.md").c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const HfSaveStaging staging = StageHfSave(m);
  EXPECT_NE(StatOf(staging.dir + "/sub/notes.md").st_ino, StatOf(m + "/sub/notes.md").st_ino);
  EXPECT_TRUE(CommitHfSave(staging, m).swapped);
  ASSERT_EQ(::write(fd, "b\n", 2), 2);
  ::close(fd);
  EXPECT_EQ(Contents(m + "/sub/notes.md"), "a\nb\n");
}

// A kept folder made a symbolic link to another directory during the save: nothing is carried
// through it (its target's files stay where they are), the staged folder stays.
TEST(HfCheckpoint, NothingIsCarriedThroughAFolderMadeALinkDuringTheSave) {
  TempDir dir;
  const std::string m = dir.path() + "/m";
  const std::string other = dir.path() + "/other";
  std::filesystem::create_directories(m + "/best");
  std::filesystem::create_directories(other);
  std::ofstream(m + "/best/config.json") << "best";
  std::ofstream(other + "/config.json") << "other's";
  const HfSaveStaging staging = StageHfSave(m);
  std::filesystem::remove_all(m + "/best");
  std::filesystem::create_directory_symlink(other, m + "/best");
  EXPECT_TRUE(CommitHfSave(staging, m).swapped);
  EXPECT_EQ(Contents(other + "/config.json"), "other's");
  EXPECT_FALSE(std::filesystem::is_symlink(m + "/best"));
  EXPECT_EQ(Contents(m + "/best/config.json"), "best");
}

TEST(HfCheckpoint, EntriesMadeInTheOldDirectoryDuringASaveMoveIntoTheNewOne) {
  TempDir dir;
  const std::string old_dir = dir.path() + "/old", new_dir = dir.path() + "/new";
  std::filesystem::create_directories(old_dir + "/made/deep");
  std::filesystem::create_directories(old_dir + "/runs");
  std::filesystem::create_directories(new_dir + "/runs");
  for (const char* name : {"kept.json", "stale-00002-of-00002.safetensors", "rng_state_1.pth",
                           "both.txt", "made/deep/x", "runs/old.log", "runs/new.log"}) {
    std::ofstream(old_dir + "/" + name) << "old " << name;
  }
  std::ofstream(new_dir + "/kept.json") << "new";
  std::ofstream(new_dir + "/both.txt") << "the save's";
  std::ofstream(new_dir + "/runs/old.log") << "kept copy";
  const KeptEntries kept = {{"kept.json", {}},
                            {"stale-00002-of-00002.safetensors", {}},
                            {"runs", {}},
                            {"runs/old.log", {}}};
  const CarriedEntries carried = CarryNewEntries(old_dir, new_dir, kept);
  EXPECT_EQ(carried.moved, 3u);  // rng_state_1.pth, made/, runs/new.log
  EXPECT_TRUE(carried.left.empty());
  EXPECT_EQ(Contents(new_dir + "/rng_state_1.pth"), "old rng_state_1.pth");
  EXPECT_EQ(Contents(new_dir + "/made/deep/x"), "old made/deep/x");
  EXPECT_EQ(Contents(new_dir + "/runs/new.log"), "old runs/new.log");  // inside a kept folder
  EXPECT_EQ(Contents(new_dir + "/runs/old.log"), "kept copy");
  EXPECT_EQ(Contents(new_dir + "/kept.json"), "new");        // kept: the save's copy
  EXPECT_EQ(Contents(new_dir + "/both.txt"), "the save's");  // the save's own file wins
  EXPECT_FALSE(std::filesystem::exists(new_dir + "/stale-00002-of-00002.safetensors"));
  EXPECT_EQ(CarryNewEntries(dir.path() + "/missing", new_dir, kept).moved, 0u);
  // The old directory goes, read-only folders and all; links are removed, not followed.
  std::filesystem::create_directories(old_dir + "/ro/inner");
  std::ofstream(old_dir + "/ro/inner/f") << "x";
  std::filesystem::create_directories(dir.path() + "/outside");
  std::ofstream(dir.path() + "/outside/keep") << "x";
  std::filesystem::create_directory_symlink(dir.path() + "/outside", old_dir + "/ro/link");
  ASSERT_EQ(::chmod((old_dir + "/ro/inner").c_str(), 0555), 0);
  ASSERT_EQ(::chmod((old_dir + "/ro").c_str(), 0555), 0);
  EXPECT_TRUE(RemoveDirectoryTree(old_dir));
  EXPECT_FALSE(std::filesystem::exists(old_dir));
  EXPECT_EQ(Contents(dir.path() + "/outside/keep"), "x");
  EXPECT_TRUE(RemoveDirectoryTree(old_dir));  // gone already
}

}  // namespace
}  // namespace tensortier
