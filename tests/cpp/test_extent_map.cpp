// Extent maps: merging FIEMAP extents, refusal flags, the JSON form and its checks of untrusted
// input, and (as root, on an ext4 or XFS scratch folder) a real build and raw read.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fiemap.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/data/extent_map.hpp"
#include "tensortier/data/extent_reader.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

namespace fs = std::filesystem;

TEST(ExtentMapTest, AppendExtentMergesOnlyNeighboursOnTheDevice) {
  std::vector<FileExtent> out;
  AppendExtent(out, {0, 1 << 20, 4096});
  AppendExtent(out, {4096, (1 << 20) + 4096, 8192});  // continues on the device: merged
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0], (FileExtent{0, 1 << 20, 12288}));
  AppendExtent(out, {12288, 5 << 20, 4096});           // elsewhere on the device: kept apart
  AppendExtent(out, {20480, (5 << 20) + 4096, 4096});  // after a hole: kept apart
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[2], (FileExtent{20480, (5 << 20) + 4096, 4096}));
}

TEST(ExtentMapTest, AppendExtentRefusesOverlapsEmptyAndOverflow) {
  std::vector<FileExtent> out{{0, 0, 8192}};
  EXPECT_THROW(AppendExtent(out, {4096, 1 << 20, 4096}), FormatError);
  EXPECT_THROW(AppendExtent(out, {8192, 1 << 20, 0}), FormatError);
  EXPECT_THROW(AppendExtent(out, {UINT64_MAX - 100, 0, 4096}), FormatError);
  EXPECT_THROW(AppendExtent(out, {8192, UINT64_MAX - 100, 4096}), FormatError);
  EXPECT_EQ(out.size(), 1u);
}

TEST(ExtentMapTest, EveryFlagThatBreaksRawReadsIsRefused) {
  for (uint32_t flag :
       {FIEMAP_EXTENT_UNKNOWN, FIEMAP_EXTENT_DELALLOC, FIEMAP_EXTENT_ENCODED,
        FIEMAP_EXTENT_DATA_ENCRYPTED, FIEMAP_EXTENT_NOT_ALIGNED, FIEMAP_EXTENT_DATA_INLINE,
        FIEMAP_EXTENT_DATA_TAIL, FIEMAP_EXTENT_UNWRITTEN, FIEMAP_EXTENT_SHARED}) {
    EXPECT_NE(RefusalReason(flag), "") << flag;
    EXPECT_NE(RefusalReason(flag | FIEMAP_EXTENT_LAST), "") << flag;
  }
  EXPECT_EQ(RefusalReason(0), "");
  EXPECT_EQ(RefusalReason(FIEMAP_EXTENT_LAST | FIEMAP_EXTENT_MERGED), "");
  EXPECT_NE(RefusalReason(FIEMAP_EXTENT_DATA_INLINE | FIEMAP_EXTENT_NOT_ALIGNED).find("inline"),
            std::string::npos);
}

ExtentMap SampleMap() {
  ExtentMap map;
  map.root = "/data/set";
  map.devices.push_back({259, 1, "/dev/nvme0n1", 259, 0, 1 << 20, "ext4", 4096});
  map.files.push_back({"a/one.jpg", 0, {259, 1, 12, 10000, 1700000000123456789, -5}, {}, {}});
  map.files[0].extents = {{0, 4096 * 100, 8192}, {8192, 4096 * 300, 4096}};
  map.files[0].xxh64 = 0x0123456789abcdefull;
  map.files.push_back({"a/two \"q\" é.jpg", 0, {259, 1, 13, 0, 0, 0}, {}, {}});
  map.refused.push_back({"b/inline.txt", "data stored inline in the inode"});
  return map;
}

TEST(ExtentMapTest, JsonRoundTrip) {
  const ExtentMap map = SampleMap();
  const std::string json = ExtentMapToJson(map);
  EXPECT_EQ(ParseExtentMap(json, "test"), map);
  ExtentMap empty;
  empty.root = "/";
  EXPECT_EQ(ParseExtentMap(ExtentMapToJson(empty), "test"), empty);
}

TEST(ExtentMapTest, FindByRelativeOrAbsolutePath) {
  const ExtentMap map = SampleMap();
  EXPECT_EQ(map.Find("a/one.jpg"), 0u);
  EXPECT_EQ(map.Find("/data/set/a/one.jpg"), 0u);
  EXPECT_EQ(map.Find("/data/set/a/../a/one.jpg"), 0u);
  EXPECT_EQ(map.Find("/data/other/a/one.jpg"), std::nullopt);
  EXPECT_EQ(map.Find("a/missing.jpg"), std::nullopt);
  EXPECT_EQ(map.FullPath(0), "/data/set/a/one.jpg");
}

// The sample map's JSON with `from` replaced by `to` (which must occur).
std::string Edited(const std::string& from, const std::string& to) {
  std::string json = ExtentMapToJson(SampleMap());
  const size_t at = json.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at == std::string::npos) return json;
  return json.replace(at, from.size(), to);
}

void ExpectRefused(const std::string& json, const std::string& says) {
  try {
    ParseExtentMap(json, "map.json");
    ADD_FAILURE() << "accepted: " << json;
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("map.json"), std::string::npos) << e.what();
  }
}

TEST(ExtentMapTest, ParseRefusesBadMaps) {
  ExpectRefused(Edited("\"version\": 1", "\"version\": 2"), "version 2");
  ExpectRefused(Edited("\"format\": \"tensortier extent map\"", "\"format\": \"x\""), "format");
  ExpectRefused(Edited("\"version\": 1,", ""), "missing key 'version'");
  ExpectRefused(Edited("\"version\": 1,", "\"version\": 1, \"version\": 1,"), "twice");
  ExpectRefused(Edited("\"version\": 1,", "\"version\": 1, \"extra\": 1,"), "unknown key 'extra'");
  ExpectRefused(Edited("\"root\": \"/data/set\"", "\"root\": \"data/set\""), "root");
  ExpectRefused(Edited("\"root\": \"/data/set\"", "\"root\": \"/data/../set\""), "root");
  ExpectRefused(Edited("a/one.jpg", "../one.jpg"), "path");
  ExpectRefused(Edited("a/one.jpg", "/one.jpg"), "path");
  ExpectRefused(Edited("a/one.jpg", "a//one.jpg"), "path");
  ExpectRefused(Edited("a/one.jpg", "a/./one.jpg"), "path");
  ExpectRefused(Edited("a/one.jpg", "a/one\\u0000.jpg"), "path");
  ExpectRefused(Edited("a/one.jpg", "b/z.jpg"), "out of order");
  ExpectRefused(Edited("\"/dev/nvme0n1\"", "\"/tmp/disk\""), "/dev");
  ExpectRefused(Edited("\"ext4\"", "\"btrfs\""), "btrfs");
  ExpectRefused(Edited("\"block_size\": 4096", "\"block_size\": 3000"), "power of two");
  ExpectRefused(Edited("\"partition_offset\": 1048576", "\"partition_offset\": 1048577"),
                "whole sectors");
  ExpectRefused(Edited("\"device\": 0, \"inode\": 12", "\"device\": 1, \"inode\": 12"), "device 1");
  // Extents: gaps, overlaps, misalignment, zero length, too short, too long, overflow.
  ExpectRefused(Edited("[8192, 1228800, 4096]", "[12288, 1228800, 4096]"), "follow each other");
  ExpectRefused(Edited("[8192, 1228800, 4096]", "[4096, 1228800, 4096]"), "follow each other");
  ExpectRefused(Edited("[8192, 1228800, 4096]", "[8192, 1228801, 4096]"), "whole sectors");
  ExpectRefused(Edited("[8192, 1228800, 4096]", "[8192, 1228800, 0]"), "whole sectors");
  ExpectRefused(Edited("[8192, 1228800, 4096]", "[8192, 1228800, 1024]"), "cover 9216");
  ExpectRefused(Edited("[8192, 1228800, 4096]", "[8192, 1228800, 12288]"), "past the end");
  ExpectRefused(Edited("[8192, 1228800, 4096]", "[8192, 9223372036854771712, 4096]"), "overflows");
  ExpectRefused(Edited("[8192, 1228800, 4096]", "[8192, 18446744073709551615, 4096]"),
                "larger than");
  ExpectRefused(Edited("[8192, 1228800, 4096]", "[8192, 18446744073709551616, 4096]"), "64 bits");
  ExpectRefused(Edited("\"size\": 0, \"mtime_ns\": 0",
                       "\"size\": 0, \"mtime_ns\": 0"
                       ", \"extents\": [[0, 0, 512]]"),
                "twice");
  ExpectRefused(Edited("\"extents\": []", "\"extents\": [[0, 4096, 512]]"), "past the file");
  ExpectRefused(Edited("\"mtime_ns\": 1700000000123456789", "\"mtime_ns\": -x"), "digits");
  ExpectRefused(Edited("\"mtime_ns\": 1700000000123456789", "\"mtime_ns\": -9223372036854775809"),
                "64 bits");
  ExpectRefused(Edited("\"mtime_ns\": 1700000000123456789", "\"mtime_ns\": 1.5"), "fraction");
  ExpectRefused(Edited("\"0123456789abcdef\"", "\"0123456789ABCDEF\""), "hexadecimal");
  ExpectRefused(Edited("\"0123456789abcdef\"", "\"0123\""), "hexadecimal");
  ExpectRefused(Edited("\"0123456789abcdef\"", "81985529216486895"), "not a string");
  const std::string json = ExtentMapToJson(SampleMap());
  ExpectRefused(json.substr(0, json.size() / 2), "");
  ExpectRefused(json + "x", "");
}

// File names are bytes: what is not UTF-8 is written \udcXX, as Python's json.dumps writes a name
// os.fsdecode gave, and read back to the same bytes; text fields stay strict.
TEST(ExtentMapTest, JsonStringsOfBytes) {
  EXPECT_EQ(JsonQuoteBytes("a\xFF/b\x80"), R"("a\udcff/b\udc80")");
  EXPECT_EQ(JsonQuoteBytes("\xC3\xA9\xE6\xA8\xA1"), "\"\xC3\xA9\xE6\xA8\xA1\"");  // UTF-8 stays
  // The UTF-8 form of a surrogate, and a truncated sequence, are not UTF-8: each byte escaped.
  EXPECT_EQ(JsonQuoteBytes("\xED\xB3\xBF"), R"("\udced\udcb3\udcbf")");
  EXPECT_EQ(JsonQuoteBytes("x\xC3"), R"("x\udcc3")");
  EXPECT_EQ(JsonQuoteBytes("\x1B\xFF", JsonEscapes::kTerminalControls), R"("\u001b\udcff")");
  EXPECT_THROW(JsonQuote("a\xFF"), std::invalid_argument);
  for (const std::string& bytes : {std::string("a\xFF\x80z"), std::string("\xED\xB3\xBF"),
                                   std::string("\xC3\xA9\xC3"), std::string("\0\x7F\x80\"", 4)}) {
    const std::string quoted = JsonQuoteBytes(bytes);
    JsonReader r(quoted, "test");  // it reads the text in place: kept alive here
    EXPECT_EQ(r.ReadString(JsonStrings::kBytes), bytes);
    r.ExpectEnd();
  }
  // Escaped bytes that together are UTF-8 decode to those bytes (as os.fsencode does).
  EXPECT_EQ(JsonReader(R"("\udcc3\udca9")", "t").ReadString(JsonStrings::kBytes), "\xC3\xA9");
  // A pair is a character, in both modes.
  EXPECT_EQ(JsonReader(R"("\ud83d\ude00")", "t").ReadString(JsonStrings::kBytes),
            "\xF0\x9F\x98\x80");
  // Only U+DC80..U+DCFF stand for bytes; text strings take no lone surrogate at all.
  EXPECT_THROW(JsonReader(R"("\udcff")", "t").ReadString(), FormatError);
  EXPECT_THROW(JsonReader(R"("\udc7f")", "t").ReadString(JsonStrings::kBytes), FormatError);
  EXPECT_THROW(JsonReader(R"("\udd00")", "t").ReadString(JsonStrings::kBytes), FormatError);
  EXPECT_THROW(JsonReader(R"("\ud800")", "t").ReadString(JsonStrings::kBytes), FormatError);
  EXPECT_THROW(JsonReader("\"\xFF\"", "t").ReadString(JsonStrings::kBytes), FormatError);
}

TEST(ExtentMapTest, PathsThatAreNotUtf8RoundTrip) {
  ExtentMap map = SampleMap();
  map.root = "/data/s\xE9t";
  map.files[0].path = "a/one\xFF.jpg";  // still before "a/two..."
  map.refused.push_back({"\x80\xED\xB3\xBF", "not a regular file"});
  const std::string json = ExtentMapToJson(map);
  EXPECT_NE(json.find(R"("root": "/data/s\udce9t")"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("a/one\udcff.jpg")"), std::string::npos) << json;
  EXPECT_TRUE(IsUtf8(json));
  EXPECT_EQ(ParseExtentMap(json, "test"), map);
  EXPECT_EQ(map.FullPath(0), "/data/s\xE9t/a/one\xFF.jpg");
  // Other strings stay text, and other lone surrogates stay refused.
  ExpectRefused(Edited("\"ext4\"", "\"ext\\udcff\""), "lone low surrogate");
  ExpectRefused(Edited("a/one.jpg", "a/one\\udc41.jpg"), "lone low surrogate");
  ExpectRefused(Edited("\"reason\"", "\"\\udcffreason\""), "lone low surrogate");
}

TEST(ExtentMapTest, ParseTakesTheSmallestTime) {
  const ExtentMap map =
      ParseExtentMap(Edited("\"ctime_ns\": -5", "\"ctime_ns\": -9223372036854775808"), "map.json");
  EXPECT_EQ(map.files[0].identity.ctime_ns, INT64_MIN);
}

// A scratch folder on the repository's disk (ext4 or XFS where the tests run), as root only:
// raw reads need the disk.
class ExtentMapDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* base = std::getenv("TENSORTIER_TEST_DIR");
    dir_ = fs::path(base != nullptr ? base : fs::temp_directory_path().string()) /
           StrCat("tensortier-extents-", getpid(), "-",
                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& bytes) {
    const fs::path p = dir_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return name;
  }

  fs::path dir_;
};

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(gen());
  return s;
}

TEST_F(ExtentMapDiskTest, BuildVerifyAndReadRaw) {
  for (size_t size : {0ul, 1ul, 511ul, 4096ul, 4097ul, 300000ul}) {
    Write(StrCat("d/f", size), RandomBytes(size, static_cast<uint32_t>(size)));
  }
  ExtentMap map;
  try {
    map = BuildExtentMap(dir_.string());
  } catch (const IoError& e) {
    GTEST_SKIP() << "the scratch folder cannot be mapped here: " << e.what();
  }
  ASSERT_EQ(map.files.size(), 6u);
  EXPECT_EQ(map.files[0].path, "d/f0");
  EXPECT_TRUE(map.files[0].extents.empty());
  for (const MappedFile& f : map.files) {
    uint64_t covered = 0;
    for (const FileExtent& x : f.extents) covered += x.length;
    EXPECT_GE(covered, f.identity.size) << f.path;
  }
  for (const MappedFile& f : map.files) {
    const std::string bytes = RandomBytes(f.identity.size, static_cast<uint32_t>(f.identity.size));
    EXPECT_EQ(f.xxh64, Xxh64(bytes.data(), bytes.size())) << f.path;
  }
  EXPECT_EQ(ParseExtentMap(ExtentMapToJson(map), "x"), map);
  EXPECT_TRUE(VerifyExtentMap(map).empty());
  std::unique_ptr<ExtentReader> opened;
  try {
    opened = std::make_unique<ExtentReader>(map);
  } catch (const IoError& e) {
    // Not root, or a container that keeps its disks from root (the loop-device tests in
    // tests/python cover raw reads there).
    if (e.error_code() == EACCES || e.error_code() == EPERM) GTEST_SKIP() << e.what();
    throw;
  }
  ExtentReader& reader = *opened;
  std::vector<std::string> out(map.files.size());
  std::vector<ExtentReadRequest> requests;
  for (size_t i = 0; i < map.files.size(); ++i) {
    out[i].assign(map.files[i].identity.size + 7, '\0');
    // Unaligned destinations on purpose: the engine bounces them.
    requests.push_back({i, out[i].data() + 3, map.files[i].identity.size});
  }
  ExtentBatch batch = reader.ReadBatch(requests);
  for (size_t i = 0; i < map.files.size(); ++i) {
    const size_t size = map.files[i].identity.size;
    EXPECT_TRUE(batch.files[i].raw) << batch.files[i].fallback;
    EXPECT_EQ(batch.files[i].bytes, size);
    EXPECT_EQ(out[i].substr(3, size), RandomBytes(size, static_cast<uint32_t>(size)));
    EXPECT_EQ(out[i].substr(0, 3), std::string(3, '\0'));
    EXPECT_EQ(out[i].substr(3 + size), std::string(4, '\0')) << "wrote past the file";
  }
  EXPECT_EQ(batch.io.buffered_bytes, 0u) << "a device read went through the page cache";
  // A rewritten file is read through the filesystem, and verify names it.
  Write("d/f4097", RandomBytes(4097, 99));
  std::string again(4097, '\0');
  const ExtentReadRequest one{*map.Find("d/f4097"), again.data(), again.size()};
  batch = reader.ReadBatch({&one, 1});
  EXPECT_FALSE(batch.files[0].raw);
  EXPECT_NE(batch.files[0].fallback, "");
  EXPECT_EQ(again, RandomBytes(4097, 99));
  auto changed = VerifyExtentMap(map);
  ASSERT_EQ(changed.size(), 1u);
  EXPECT_EQ(changed[0].path, "d/f4097");
  // Too small a buffer is the caller's error; an unknown index too.
  const ExtentReadRequest small{*map.Find("d/f300000"), out[0].data(), 10};
  EXPECT_THROW(reader.ReadBatch({&small, 1}), std::invalid_argument);
  const ExtentReadRequest bad{map.files.size(), out[0].data(), 10};
  EXPECT_THROW(reader.ReadBatch({&bad, 1}), std::out_of_range);
}

TEST_F(ExtentMapDiskTest, NamesThatAreNotUtf8AreMapped) {
  Write("c\xFF/\xE9.bin", RandomBytes(5000, 7));
  Write("ok", RandomBytes(100, 8));
  ExtentMap map;
  try {
    map = BuildExtentMap(dir_.string());
  } catch (const IoError& e) {
    GTEST_SKIP() << "the scratch folder cannot be mapped here: " << e.what();
  }
  ASSERT_EQ(map.files.size(), 2u);
  EXPECT_TRUE(map.refused.empty());
  EXPECT_EQ(map.files[0].path, "c\xFF/\xE9.bin");
  EXPECT_EQ(map.Find((dir_ / "c\xFF/\xE9.bin").string()), 0u);
  EXPECT_EQ(ParseExtentMap(ExtentMapToJson(map), "x"), map);
  EXPECT_TRUE(VerifyExtentMap(map).empty());
}

TEST_F(ExtentMapDiskTest, RefusalsNameTheFile) {
  Write("ok", RandomBytes(10000, 1));
  {
    const int fd = open((dir_ / "unwritten").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(fallocate(fd, 0, 0, 1 << 20), 0);
    close(fd);
  }
  try {
    BuildExtentMap(dir_.string());
    GTEST_SKIP() << "the filesystem here maps fallocated files as written";
  } catch (const IoError& e) {
    if (e.error_code() != EOPNOTSUPP) GTEST_SKIP() << "cannot map here: " << e.what();
    EXPECT_EQ(e.path(), "unwritten");
    EXPECT_NE(std::string(e.what()).find("unwritten (preallocated)"), std::string::npos);
  }
  BuildOptions options;
  options.allow_refused = true;
  const ExtentMap map = BuildExtentMap(dir_.string(), options);
  ASSERT_EQ(map.files.size(), 1u);
  ASSERT_EQ(map.refused.size(), 1u);
  EXPECT_EQ(map.refused[0].path, "unwritten");
  const std::vector<std::string> listed{(dir_ / "ok").string()};
  EXPECT_EQ(BuildExtentMap(dir_.string(), listed).files.size(), 1u);
  const std::vector<std::string> outside{"/etc/hostname"};
  EXPECT_THROW(BuildExtentMap(dir_.string(), outside), std::invalid_argument);
}

}  // namespace
}  // namespace tensortier

namespace tensortier {
namespace {

// A map is a list of disk offsets read with root's rights: as ssh with its keys, only a map its
// user (or root) owns and nobody else may write is loaded.
TEST_F(ExtentMapDiskTest, LoadRefusesAMapOthersCanWriteOrOwn) {
  const std::string path = (dir_ / "map.json").string();
  SaveExtentMap(SampleMap(), path);
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  EXPECT_EQ(LoadExtentMap(path), SampleMap());
  for (mode_t mode : {0664, 0646, 0666}) {
    ASSERT_EQ(chmod(path.c_str(), mode), 0);
    try {
      LoadExtentMap(path);
      ADD_FAILURE() << "loaded a map of mode " << mode;
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_code(), EPERM);
      EXPECT_EQ(e.path(), path);
      EXPECT_NE(std::string(e.what()).find("chmod go-w"), std::string::npos) << e.what();
    }
  }
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  if (geteuid() == 0) {
    ASSERT_EQ(chown(path.c_str(), 4321, 4321), 0);
    try {
      LoadExtentMap(path);
      ADD_FAILURE() << "loaded another user's map";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_code(), EPERM);
      EXPECT_NE(std::string(e.what()).find("uid 4321"), std::string::npos) << e.what();
    }
  }
  const std::string fifo = (dir_ / "map.fifo").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  try {
    LoadExtentMap(fifo);  // refused before any read: it would wait for a writer
    ADD_FAILURE() << "loaded a FIFO";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EINVAL);
  }
}

TEST(ExtentReaderTest, RefusesADiskNodeThatIsNotTheMapsDisk) {
  ExtentMap map = SampleMap();
  map.devices[0].disk = "/dev/null";  // a character device
  try {
    ExtentReader reader(map);
    ADD_FAILURE() << "opened /dev/null as a disk";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENODEV);
    EXPECT_EQ(e.path(), "/dev/null");
    EXPECT_NE(std::string(e.what()).find("rebuild the extent map"), std::string::npos);
  }
  map.devices[0].disk = "/dev/tensortier-no-such-disk";
  try {
    ExtentReader reader(map);
    ADD_FAILURE() << "opened a missing disk";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_EQ(e.path(), "/dev/tensortier-no-such-disk");
  }
}

}  // namespace
}  // namespace tensortier
