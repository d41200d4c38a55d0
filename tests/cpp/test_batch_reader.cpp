// The batch reader: whole files into one arena per batch, read ahead, errors named.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>

#include "tensortier/data/batch_reader.hpp"
#include "tensortier/data/extent_map.hpp"
#include "tensortier/data/sample_list.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/error.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::MatchesPattern;
using testing::TempDir;
using testing::WritePatternFile;

// Sizes around the O_DIRECT and page boundaries, and empty.
const uint64_t kSizes[] = {0, 1, 511, 4095, 4096, 4097, 12288, 70001, 262144, 300000};

struct Tree {
  TempDir dir;
  std::vector<std::string> paths;
  std::vector<uint64_t> sizes;
  explicit Tree(size_t count) {
    for (size_t i = 0; i < count; ++i) {
      paths.push_back(dir.File(StrCat("f", i)));
      sizes.push_back(kSizes[i % std::size(kSizes)] + i);
      WritePatternFile(paths.back(), sizes.back(), i);
    }
  }
};

BatchReaderOptions Options(const std::string& backend = "auto") {
  BatchReaderOptions options;
  options.engine.backend = backend;
  options.open_threads = 4;
  return options;
}

void ExpectBatch(const Batch& batch, const Tree& tree, const std::vector<uint64_t>& want) {
  ASSERT_EQ(batch.indices(), want);
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(batch.sizes()[i], tree.sizes[want[i]]);
    ASSERT_EQ(batch.offsets()[i] % 4096, 0u);
    ASSERT_LE(batch.offsets()[i] + batch.sizes()[i], batch.size());
    ASSERT_TRUE(MatchesPattern(batch.data() + batch.offsets()[i], batch.sizes()[i], want[i]))
        << "file " << want[i];
  }
}

class BatchReaderBackendTest : public testing::BackendTest {};

TEST_P(BatchReaderBackendTest, ReadsEveryFileExactlyInOrder) {
  Tree tree(40);
  BatchReader reader(tree.paths, Options(std::string(BackendName(GetParam()))));
  std::vector<std::vector<uint64_t>> batches = {{3, 1, 4, 1, 5}, {9, 2, 6}, {0}, {}, {39, 38}};
  for (int round = 0; round < 2; ++round) {
    reader.Start(batches);
    for (const auto& want : batches) {
      auto batch = reader.Next();
      ASSERT_NE(batch, nullptr);
      ExpectBatch(*batch, tree, want);
    }
    EXPECT_EQ(reader.Next(), nullptr);
    EXPECT_EQ(reader.Next(), nullptr);
  }
  BatchReaderStats stats = reader.stats();
  EXPECT_EQ(stats.batches, 10u);
  EXPECT_EQ(stats.files, 22u);
  EXPECT_EQ(stats.skipped, 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, BatchReaderBackendTest,
                         ::testing::ValuesIn(testing::CompiledBackends()),
                         testing::BackendParamName());

TEST(BatchReaderTest, BatchesOutliveTheReaderAndArenasAreReused) {
  Tree tree(12);
  std::vector<std::shared_ptr<const Batch>> kept;
  {
    BatchReader reader(tree.paths, Options());
    std::vector<std::vector<uint64_t>> batches;
    for (int i = 0; i < 20; ++i) batches.push_back({static_cast<uint64_t>(i % 12)});
    reader.Start(batches);
    const std::byte* first = nullptr;
    bool reused = false;
    for (int i = 0; i < 20; ++i) {
      auto batch = reader.Next();
      ASSERT_NE(batch, nullptr);
      ExpectBatch(*batch, tree, {static_cast<uint64_t>(i % 12)});
      if (i == 0) first = batch->data();
      if (i > 4 && batch->data() == first) reused = true;
      if (i == 19) kept.push_back(batch);
    }
    EXPECT_TRUE(reused || first == nullptr);
  }
  ExpectBatch(*kept[0], tree, {19 % 12});
}

TEST(BatchReaderTest, StartDropsWhatWasReadAhead) {
  Tree tree(30);
  BatchReaderOptions options = Options();
  options.prefetch = 4;
  BatchReader reader(tree.paths, options);
  std::vector<std::vector<uint64_t>> many;
  for (uint64_t i = 0; i < 30; ++i) many.push_back({i});
  reader.Start(many);
  ASSERT_NE(reader.Next(), nullptr);
  reader.Start({{7, 8}});
  auto batch = reader.Next();
  ASSERT_NE(batch, nullptr);
  ExpectBatch(*batch, tree, {7, 8});
  EXPECT_EQ(reader.Next(), nullptr);
}

// FileReader.close() from another thread that comes after an iteration decided to read and before
// its Next() took the lock: that Next() of the replaced batches returns null at once (it waited
// forever: the Start() it missed had already been counted, and nothing else would wake it).
TEST(BatchReaderTest, NextOfAReplacedStartReturnsNull) {
  Tree tree(6);
  BatchReader reader(tree.paths, Options());
  const uint64_t first = reader.Start({{0}, {1}, {2}});
  ASSERT_NE(reader.Next(first), nullptr);
  const uint64_t closed = reader.Start({});  // close()
  EXPECT_NE(closed, first);
  EXPECT_EQ(reader.Next(first), nullptr);
  const uint64_t again = reader.Start({{3}, {4}});  // another iteration took over
  EXPECT_EQ(reader.Next(first), nullptr);
  EXPECT_EQ(reader.Next(closed), nullptr);
  auto batch = reader.Next(again);
  ASSERT_NE(batch, nullptr);
  ExpectBatch(*batch, tree, {3});
}

// FileReader.close() from another thread, or two threads iterating one reader: Start() calls from
// several threads at once (each joins the producer the last one started) and a Next() waiting
// across them. The producer is replaced by one caller at a time, never joined twice.
TEST(BatchReaderTest, StartsFromSeveralThreadsAtOnce) {
  Tree tree(12);
  BatchReader reader(tree.paths, Options());
  std::vector<std::vector<uint64_t>> all;
  for (uint64_t i = 0; i < 12; ++i) all.push_back({i});
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&reader, &all, t] {
      for (int round = 0; round < 20; ++round) {
        if (t == 2) {
          reader.Start({});  // what close() does
          continue;
        }
        reader.Start(all);
        for (int i = 0; i < 3 && reader.Next() != nullptr; ++i) {
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  reader.Start({{5}});  // and the reader still reads
  auto batch = reader.Next();
  ASSERT_NE(batch, nullptr);
  ExpectBatch(*batch, tree, {5});
}

TEST(BatchReaderTest, MissingFileFailsItsBatchByNameAndReadingGoesOn) {
  Tree tree(6);
  BatchReader reader(tree.paths, Options());
  ASSERT_EQ(unlink(tree.paths[2].c_str()), 0);
  reader.Start({{0, 1}, {1, 2, 3}, {4, 5}});
  ExpectBatch(*reader.Next(), tree, {0, 1});
  try {
    reader.Next();
    FAIL() << "no error for a vanished file";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_EQ(e.path(), tree.paths[2]);
  }
  ExpectBatch(*reader.Next(), tree, {4, 5});
}

TEST(BatchReaderTest, SkipErrorsLeavesBadFilesOutAndCountsThem) {
  Tree tree(6);
  BatchReaderOptions options = Options();
  options.skip_errors = true;
  BatchReader reader(tree.paths, options);
  ASSERT_EQ(unlink(tree.paths[2].c_str()), 0);
  ASSERT_EQ(mkdir(tree.paths[2].c_str(), 0755), 0);  // now a directory
  ASSERT_EQ(unlink(tree.paths[4].c_str()), 0);
  ASSERT_EQ(mkfifo(tree.paths[4].c_str(), 0644), 0);  // opening it would block
  reader.Start({{0, 2, 1, 4, 3}});
  auto batch = reader.Next();
  ExpectBatch(*batch, tree, {0, 1, 3});
  ASSERT_EQ(batch->skipped().size(), 2u);
  EXPECT_EQ(batch->skipped()[0].index, 2u);
  EXPECT_NE(batch->skipped()[0].message.find(tree.paths[2]), std::string::npos);
  EXPECT_EQ(batch->skipped()[1].index, 4u);
  EXPECT_EQ(reader.stats().skipped, 2u);
}

TEST(BatchReaderTest, NonRegularFileFailsByName) {
  Tree tree(2);
  ASSERT_EQ(unlink(tree.paths[1].c_str()), 0);
  ASSERT_EQ(mkfifo(tree.paths[1].c_str(), 0644), 0);
  BatchReader reader(tree.paths, Options());
  reader.Start({{0, 1}});
  try {
    reader.Next();
    FAIL() << "no error for a FIFO";
  } catch (const IoError& e) {
    EXPECT_EQ(e.path(), tree.paths[1]);
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos);
  }
}

TEST(BatchReaderTest, UnreadableFileFailsByName) {
  if (geteuid() == 0) GTEST_SKIP() << "root reads files whatever their mode";
  Tree tree(2);
  ASSERT_EQ(chmod(tree.paths[1].c_str(), 0), 0);
  BatchReader reader(tree.paths, Options());
  reader.Start({{1}});
  EXPECT_THROW(reader.Next(), IoError);
}

TEST(BatchReaderTest, FileThatChangesSizeWhileReadFailsByName) {
  // A file that keeps growing: whenever it is read, its size is not the one it was opened with.
  TempDir dir;
  const std::string path = dir.File("growing");
  WritePatternFile(path, 1 << 20, 1);
  std::atomic<bool> stop{false};
  std::thread grower([&] {
    int fd = open(path.c_str(), O_WRONLY | O_APPEND);
    char bytes[4096] = {};
    while (!stop.load()) {
      if (write(fd, bytes, sizeof(bytes)) != static_cast<ssize_t>(sizeof(bytes))) break;
      // Bounded: back to 1 MiB now and then (a shrink is a change of size too).
      struct stat st;
      if (fstat(fd, &st) == 0 && st.st_size > (8 << 20) && ftruncate(fd, 1 << 20) != 0) break;
    }
    close(fd);
  });
  BatchReader reader({path}, Options());
  bool failed = false;
  // Attempts for up to 30 s rather than a count: on a loaded machine the grower may get no CPU
  // during a short run of reads.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!failed && std::chrono::steady_clock::now() < deadline) {
    reader.Start({{0}});
    try {
      reader.Next();
    } catch (const IoError& e) {
      EXPECT_EQ(e.path(), path);
      EXPECT_NE(std::string(e.what()).find("changed size"), std::string::npos) << e.what();
      failed = true;
    }
  }
  stop = true;
  grower.join();
  EXPECT_TRUE(failed);
}

// Cold files, so that their reads go through the engine's backend (cached ones are copied).
void DropFromCache(const std::vector<std::string>& paths) {
  for (const std::string& path : paths) {
    File file = File::Open(path, OpenMode::kRead, false);
    file.DataSync();  // dirty pages would stay cached
    file.DropCache();
  }
}

// A reader whose engine fails the `nth` read request with EIO.
BatchReaderOptions FailingRead(uint64_t nth, bool skip_errors) {
  BatchReaderOptions options = Options("threads");
  options.skip_errors = skip_errors;
  options.prefetch = 1;  // a batch's reads start after the previous one's: the fault lands in it
  FaultPlan plan;
  plan.kind = FaultPlan::Kind::kError;
  plan.error = EIO;
  plan.nth = nth;
  plan.writes = false;
  auto injector = std::make_shared<FaultInjector>(plan);
  options.backend_factory = [injector](unsigned depth) {
    return MakeFaultInjectingBackend(MakeBackend(BackendKind::kThreads, depth), injector);
  };
  return options;
}

TEST(BatchReaderTest, ReadErrorInTheMiddleOfABatchNamesTheFile) {
  Tree tree(10);
  DropFromCache(tree.paths);
  BatchReader reader(tree.paths, FailingRead(4, false));
  reader.Start({{1, 2, 3, 4, 5, 6, 7, 8}, {9, 0}});
  try {
    reader.Next();
    FAIL() << "no error for a failed read";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EIO);
    EXPECT_NE(std::find(tree.paths.begin() + 1, tree.paths.begin() + 9, e.path()),
              tree.paths.begin() + 9)
        << e.what();
  }
  ExpectBatch(*reader.Next(), tree, {9, 0});  // reading goes on
}

TEST(BatchReaderTest, SkipErrorsLeavesOutAFileWhoseReadFailed) {
  Tree tree(10);
  DropFromCache(tree.paths);
  BatchReader reader(tree.paths, FailingRead(4, true));
  const std::vector<uint64_t> order = {1, 2, 3, 4, 5, 6, 7, 8};
  reader.Start({order});
  auto batch = reader.Next();
  ASSERT_EQ(batch->skipped().size(), 1u);
  const uint64_t failed = batch->skipped()[0].index;
  EXPECT_NE(batch->skipped()[0].message.find(tree.paths[failed]), std::string::npos);
  std::vector<uint64_t> rest;
  for (uint64_t i : order) {
    if (i != failed) rest.push_back(i);
  }
  ASSERT_EQ(rest.size(), order.size() - 1);
  ExpectBatch(*batch, tree, rest);  // the others intact, in order
  EXPECT_EQ(reader.stats().skipped, 1u);
}

TEST(BatchReaderTest, CachedFilesAreReadBufferedAndColdOnesDirect) {
  Tree tree(8);
  BatchReader reader(tree.paths, Options());
  for (const std::string& path : tree.paths) {
    File file = File::Open(path, OpenMode::kRead, false);
    file.DataSync();  // dirty pages would stay cached
    file.DropCache();
  }
  reader.Start({{1, 2, 3, 4, 5, 6, 7}});
  ExpectBatch(*reader.Next(), tree, {1, 2, 3, 4, 5, 6, 7});
  const BatchReaderStats cold = reader.stats();
  if (!File::Open(tree.paths[1], OpenMode::kRead).direct()) {
    GTEST_SKIP() << "this filesystem refuses O_DIRECT";
  }
  EXPECT_GT(cold.direct_bytes, 0u);
  // Each cold file is one direct read of its size rounded up to the O_DIRECT alignment: its last
  // partial block does not go through the page cache (on a cold file, a second request).
  uint64_t rounded = 0;
  for (size_t i = 1; i < 8; ++i) {
    const uint64_t align = File::Open(tree.paths[i], OpenMode::kRead).offset_alignment();
    rounded += align <= 4096 ? AlignUp(tree.sizes[i], align) : tree.sizes[i];
  }
  EXPECT_EQ(cold.direct_bytes, rounded);
  EXPECT_EQ(cold.cached_bytes, 0u);
  // Now through the page cache: read once buffered, then again by the reader.
  for (size_t i = 1; i < 8; ++i) testing::ReadWholeFile(tree.paths[i]);
  reader.Start({{1, 2, 3, 4, 5, 6, 7}});
  ExpectBatch(*reader.Next(), tree, {1, 2, 3, 4, 5, 6, 7});
  const BatchReaderStats warm = reader.stats();
  EXPECT_EQ(warm.direct_bytes, cold.direct_bytes);
  uint64_t total = 0;
  for (size_t i = 1; i < 8; ++i) total += tree.sizes[i];
  EXPECT_EQ(warm.cached_bytes - cold.cached_bytes, total);
}

TEST(BatchReaderTest, BadArgumentsAreRefused) {
  Tree tree(2);
  EXPECT_THROW(BatchReader({}, Options()), std::invalid_argument);
  BatchReaderOptions options = Options();
  options.prefetch = 0;
  EXPECT_THROW(BatchReader(tree.paths, options), std::invalid_argument);
  BatchReader reader(tree.paths, Options());
  EXPECT_THROW(reader.Start({{0, 2}}), std::out_of_range);
}

// Raw block-device reads need root and a disk node the container lets it open; the loop-device
// tests in tests/python/test_data_extents.py cover them where loop devices can be had.
TEST(BatchReaderTest, ExtentMapReadsMappedFilesRawAndChangedOnesThroughTheFilesystem) {
  Tree tree(30);
  std::vector<std::string> mapped(tree.paths.begin(), tree.paths.begin() + 20);
  BatchReaderOptions options = Options();
  try {
    options.extent_map = BuildExtentMap(tree.dir.path(), mapped);
  } catch (const IoError& e) {
    GTEST_SKIP() << "the scratch folder cannot be mapped here: " << e.what();
  }
  // Rewritten with the same bytes after the map was built: its mtime (set a second on, as the
  // clock's tick may be coarser than the test) says it changed.
  WritePatternFile(tree.paths[5], tree.sizes[5], 5);
  struct stat st{};
  ASSERT_EQ(stat(tree.paths[5].c_str(), &st), 0);
  const timespec times[2] = {st.st_atim, {st.st_mtim.tv_sec + 1, st.st_mtim.tv_nsec}};
  ASSERT_EQ(utimensat(AT_FDCWD, tree.paths[5].c_str(), times, 0), 0);
  std::unique_ptr<BatchReader> opened;
  try {
    opened = std::make_unique<BatchReader>(tree.paths, options);
  } catch (const IoError& e) {
    GTEST_SKIP() << "the disk cannot be read raw here: " << e.what();
  }
  BatchReader& reader = *opened;
  std::vector<std::vector<uint64_t>> batches = {{0, 1, 2, 3, 4, 5, 6},
                                                {7, 8, 9, 10, 11, 12, 13},
                                                {14, 15, 16, 17, 18, 19, 5},
                                                {20, 25, 29, 19}};
  reader.Start(batches);
  for (const auto& want : batches) {
    auto batch = reader.Next();
    ASSERT_NE(batch, nullptr);
    ExpectBatch(*batch, tree, want);
  }
  EXPECT_EQ(reader.Next(), nullptr);
  BatchReaderStats stats = reader.stats();
  // Distinct files per batch: 7 + 7 + 7 + 4; file 5 twice through the filesystem, 20, 25 and
  // 29 are not in the map.
  EXPECT_EQ(stats.fallback_files, 2u);
  EXPECT_EQ(stats.raw_files, 25u - 2u - 3u);
  EXPECT_EQ(stats.skipped, 0u);
}

TEST(BatchReaderTest, DestroyedWhileReadingAhead) {
  Tree tree(40);
  for (int i = 0; i < 5; ++i) {
    BatchReaderOptions options = Options();
    options.prefetch = 3;
    BatchReader reader(tree.paths, options);
    std::vector<std::vector<uint64_t>> batches;
    for (uint64_t b = 0; b < 10; ++b) batches.push_back({b, b + 10, b + 20, b + 30});
    reader.Start(batches);
    if (i % 2 == 0) reader.Next();
  }
}

TEST(SampleListTest, FileRootClassesInSortedOrder) {
  TempDir dir;
  for (const char* cls : {"b", "a", "c"}) {
    ASSERT_EQ(mkdir(dir.File(cls).c_str(), 0755), 0);
  }
  WritePatternFile(dir.File("b/2.jpg"), 3, 0);
  WritePatternFile(dir.File("b/1.jpg"), 3, 0);
  WritePatternFile(dir.File("a/z.JPEG"), 3, 0);            // DALI's filters ignore case
  WritePatternFile(dir.File("a/notes.txt"), 3, 0);         // not an image: not a sample
  WritePatternFile(dir.File("loose.jpg"), 3, 0);           // not in a class: not a sample
  ASSERT_EQ(mkdir(dir.File("b/sub").c_str(), 0755), 0);    // nor a folder in a class
  ASSERT_EQ(mkfifo(dir.File("a/pipe").c_str(), 0644), 0);  // nor a FIFO
  SampleList list = ListFileRoot(dir.path());
  EXPECT_EQ(list.paths, (std::vector<std::string>{dir.File("a/z.JPEG"), dir.File("b/1.jpg"),
                                                  dir.File("b/2.jpg")}));
  EXPECT_EQ(list.labels, (std::vector<int32_t>{0, 1, 1}));
}

TEST(SampleListTest, FileFiltersAreGlobsMatchedAsDaliDoes) {
  TempDir dir;
  ASSERT_EQ(mkdir(dir.File("a").c_str(), 0755), 0);
  for (const char* name : {"x.TXT", "y.txt", "z.txt.jpg", ".hidden.txt", "w.wav", "v"}) {
    WritePatternFile(dir.File(StrCat("a/", name)), 1, 0);
  }
  auto names = [&](const FileFilter& filter) {
    std::vector<std::string> out;
    for (const std::string& p : ListFileRoot(dir.path(), filter).paths) {
      out.push_back(p.substr(dir.File("a/").size()));
    }
    return out;
  };
  EXPECT_EQ(names({}), (std::vector<std::string>{"w.wav", "z.txt.jpg"}));
  // fnmatch without FNM_PERIOD: a leading dot is matched by '*'.
  EXPECT_EQ(names({{"*.txt"}, false}), (std::vector<std::string>{".hidden.txt", "x.TXT", "y.txt"}));
  EXPECT_EQ(names({{"*.txt"}, true}), (std::vector<std::string>{".hidden.txt", "y.txt"}));
  EXPECT_EQ(names({{"?", "*.wav", "[xy].*"}, true}),
            (std::vector<std::string>{"v", "w.wav", "x.TXT", "y.txt"}));
  EXPECT_THROW(ListFileRoot(dir.path(), {{"*.png"}, false}), std::invalid_argument);
  EXPECT_THROW(ListFileRoot(dir.path(), {{}, false}), std::invalid_argument);
}

TEST(SampleListTest, DirFiltersChooseTheClassFoldersAsDaliDoes) {
  TempDir dir;
  for (const char* cls : {"train_b", "Train_a", "val", "train_c"}) {
    ASSERT_EQ(mkdir(dir.File(cls).c_str(), 0755), 0);
    WritePatternFile(dir.File(StrCat(cls, "/1.jpg")), 3, 0);
  }
  WritePatternFile(dir.File("train_x.jpg"), 3, 0);  // a file, not a folder: never a class
  // No globs: no dir_filters.
  auto classes = [&](const std::vector<std::string>& globs, bool case_sensitive) {
    std::optional<std::vector<std::string>> dir_filters;
    if (!globs.empty()) dir_filters = globs;
    const SampleList list =
        ListFileRoot(dir.path(), {DefaultFileFilters(), case_sensitive}, dir_filters);
    std::vector<std::string> out;
    for (size_t i = 0; i < list.paths.size(); ++i) {
      out.push_back(StrCat(list.labels[i], ":", list.paths[i].substr(dir.path().size() + 1)));
    }
    return out;
  };
  using Names = std::vector<std::string>;
  EXPECT_EQ(classes({}, false),
            (Names{"0:Train_a/1.jpg", "1:train_b/1.jpg", "2:train_c/1.jpg", "3:val/1.jpg"}));
  // The case rule is case_sensitive_filter's; labels count the chosen folders only.
  EXPECT_EQ(classes({"train*"}, false),
            (Names{"0:Train_a/1.jpg", "1:train_b/1.jpg", "2:train_c/1.jpg"}));
  EXPECT_EQ(classes({"train*"}, true), (Names{"0:train_b/1.jpg", "1:train_c/1.jpg"}));
  EXPECT_EQ(classes({"val", "*_c"}, true), (Names{"0:train_c/1.jpg", "1:val/1.jpg"}));
  // A folder two patterns match is one class.
  EXPECT_EQ(classes({"*_b", "train_?"}, true), (Names{"0:train_b/1.jpg", "1:train_c/1.jpg"}));
  EXPECT_THROW(ListFileRoot(dir.path(), {}, std::vector<std::string>{}), std::invalid_argument);
  try {
    ListFileRoot(dir.path(), {}, std::vector<std::string>{"test*"});
    ADD_FAILURE() << "no folder matches: expected a refusal";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("of 4, those matching dir_filters test*"),
              std::string::npos)
        << e.what();
  }
}

TEST(SampleListTest, EmptyOrMissingRootIsRefused) {
  TempDir dir;
  EXPECT_THROW(ListFileRoot(dir.path()), std::invalid_argument);
  ASSERT_EQ(mkdir(dir.File("empty_class").c_str(), 0755), 0);
  EXPECT_THROW(ListFileRoot(dir.path()), std::invalid_argument);
  EXPECT_THROW(ListFileRoot(dir.File("nope")), IoError);
}

TEST(SampleListTest, FileListInDalisFormat) {
  TempDir dir;
  {
    std::ofstream out(dir.File("list.txt"));
    out << "a b.jpg 3\n\n  sub/c.jpg\t17  \n/abs/d 0\n";
  }
  SampleList list = ReadFileList(dir.File("list.txt"));
  EXPECT_EQ(list.paths,
            (std::vector<std::string>{dir.File("a b.jpg"), dir.File("  sub/c.jpg"), "/abs/d"}));
  EXPECT_EQ(list.labels, (std::vector<int32_t>{3, 17, 0}));
  EXPECT_EQ(ReadFileList(dir.File("list.txt"), "/root").paths[0], "/root/a b.jpg");
  for (const char* bad : {"nolabel\n", "12\n", "x y\n"}) {
    std::ofstream(dir.File("bad.txt")) << bad;
    EXPECT_THROW(ReadFileList(dir.File("bad.txt")), std::invalid_argument) << bad;
  }
  for (const auto& [line, says] : {std::pair{"a.jpg -1\n", "label '-1' is negative"},
                                   std::pair{"file-1\n", "expected a file name followed by"}}) {
    std::ofstream(dir.File("bad.txt")) << line;
    try {
      ReadFileList(dir.File("bad.txt"));
      ADD_FAILURE() << "no error for " << line;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
  std::ofstream(dir.File("empty.txt")) << "\n\n";
  EXPECT_THROW(ReadFileList(dir.File("empty.txt")), std::invalid_argument);
  EXPECT_THROW(ReadFileList(dir.File("missing.txt")), IoError);
  EXPECT_THROW(CheckFilesExist({dir.File("list.txt"), dir.File("missing")}), IoError);
}

// A child made by fork() while the parent's reader reads ahead (a DataLoader worker given a
// reader made before the workers started): its copy has no producer or open threads. Using it
// is refused by name and dropping it returns, where both used to wait forever on the threads;
// so is asking its counters, behind the lock the parent's producer may have held at the fork.
TEST(BatchReaderTest, AForkedChildsCopyRefusesToReadAndDoesNotHang) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "fork() of a process with running threads under TSan";
#endif
  Tree tree(6);
  auto reader = std::make_unique<BatchReader>(tree.paths, Options());
  reader->Start({{0, 1}, {2, 3}, {4, 5}});
  ASSERT_NE(reader->Next(), nullptr);  // the producer is reading the next batches
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    alarm(20);  // a hang ends as SIGALRM, seen by the parent
    int code = 0;
    try {
      reader->Start({{0}});
      code = 1;  // accepted: nobody would read it
    } catch (const std::logic_error& e) {
      if (std::string(e.what()).find("fork()") == std::string::npos) code = 2;
    } catch (...) {
      code = 2;
    }
    try {
      reader->Next();
      code = code != 0 ? code : 1;
    } catch (const std::logic_error&) {
    } catch (...) {
      code = 2;
    }
    try {
      reader->stats();  // the parent's counters, behind a lock its producer may hold
      code = code != 0 ? code : 1;
    } catch (const std::logic_error&) {
    } catch (...) {
      code = 2;
    }
    reader.reset();
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child hung (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: a read accepted, 2: another error";
  // The parent's reader is untouched.
  auto batch = reader->Next();
  ASSERT_NE(batch, nullptr);
  ExpectBatch(*batch, tree, {2, 3});
  reader->Start({{5, 0}});
  batch = reader->Next();
  ASSERT_NE(batch, nullptr);
  ExpectBatch(*batch, tree, {5, 0});
}

}  // namespace
}  // namespace tensortier

namespace tensortier {
namespace {

// Files open at once follow RLIMIT_NOFILE, not batch size x (prefetch + 1): in a child allowed
// 64 descriptors, batches of 100 files read 3 ahead are read whole, nothing skipped; running out
// of descriptors later is the batch's error even with skip_errors, never a file to leave out.
TEST(BatchReaderTest, OpenFilesFollowRlimitNofileAndRunningOutIsNeverSkipped) {
  Tree tree(210);
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    alarm(120);  // a hang ends as SIGALRM, seen by the parent
    int code = 0;
    try {
      struct rlimit limit{};
      getrlimit(RLIMIT_NOFILE, &limit);
      limit.rlim_cur = 64;
      if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(10);
      BatchReaderOptions options = Options();
      options.prefetch = 3;
      options.skip_errors = true;
      BatchReader reader(tree.paths, options);
      std::vector<std::vector<uint64_t>> batches(3);
      for (uint64_t i = 0; i < 100; ++i) batches[0].push_back(i);
      for (uint64_t i = 100; i < 200; ++i) batches[1].push_back(209 - (i - 100));
      batches[2] = {5, 5, 200, 201, 5};
      reader.Start(batches);
      for (const auto& want : batches) {
        auto batch = reader.Next();
        if (batch == nullptr || !batch->skipped().empty()) _exit(3);
        ExpectBatch(*batch, tree, want);
        if (::testing::Test::HasFailure()) _exit(4);
      }
#if !defined(__SANITIZE_ADDRESS__)
      // (Not under ASan+UBSan: UBSan checks the new producer thread's vptr by writing its
      // memory to a pipe, which needs descriptors.)
      limit.rlim_cur = 0;  // no descriptor can be opened now
      if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(10);
      reader.Start({{1, 2, 3}});
      try {
        reader.Next();
        code = 5;  // read, or the files skipped
      } catch (const IoError& e) {
        if (e.error_code() != EMFILE) code = 6;
      }
#endif
    } catch (...) {
      code = 7;
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child hung (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "3: a batch short or with skipped files, 4: wrong bytes, 5: EMFILE skipped, "
         "6: another errno, 7: another error";
}

}  // namespace
}  // namespace tensortier
