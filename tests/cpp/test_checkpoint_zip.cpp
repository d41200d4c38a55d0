// The zip directory reader on archives from ZipPlanner and torch.save, and on corrupted ones:
// each corruption gives a FormatError naming the problem, never a crash or a huge allocation.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/checkpoint/zip_archive.hpp"
#include "tensortier/checkpoint/zip_writer.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

struct Built {
  std::string bytes;
  std::vector<ZipPlanEntry> plan;
};

// An archive with entries named `names`, entry i holding i*37+5 pattern bytes.
Built Build(const std::vector<std::string>& names, uint64_t alignment, bool zip64) {
  ZipPlanner z(alignment, zip64);
  std::vector<std::vector<uint8_t>> data;
  for (size_t i = 0; i < names.size(); ++i) {
    data.push_back(testing::Pattern(i * 37 + 5, i));
    size_t k = z.Add(names[i], data.back().size());
    z.SetCrc(k, Crc32(data.back().data(), data.back().size()));
  }
  std::string out(z.directory_offset(), '\0');
  for (size_t i = 0; i < names.size(); ++i) {
    const ZipPlanEntry& e = z.entries()[i];
    std::string h = z.LocalHeader(i);
    EXPECT_EQ(e.local_header_offset + h.size(), e.data_offset);
    out.replace(e.local_header_offset, h.size(), h);
    std::copy(data[i].begin(), data[i].end(), out.begin() + static_cast<ptrdiff_t>(e.data_offset));
  }
  return {out + z.Directory(), z.entries()};
}

ZipDirectory ReadZip(const std::string& bytes) {
  return ReadZipDirectory(MemorySource(bytes.data(), bytes.size(), "mem.zip"));
}

::testing::AssertionResult Rejects(const std::string& bytes, const std::string& needle) {
  try {
    ReadZip(bytes);
  } catch (const FormatError& e) {
    std::string msg = e.what();
    if (msg.find(needle) != std::string::npos && msg.find("mem.zip") != std::string::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "message '" << msg << "' lacks '" << needle << "'";
  }
  return ::testing::AssertionFailure() << "accepted a bad archive (wanted '" << needle << "')";
}

void Put32At(std::string& s, size_t pos, uint32_t v) {
  for (int i = 0; i < 4; ++i) s[pos + i] = static_cast<char>(v >> (8 * i));
}

const std::vector<std::string> kNames = {"arch/data.pkl", "arch/data/0", "arch/data/1",
                                         "arch/version"};

TEST(CheckpointZip, ReadsPlannedArchivesWithAlignedData) {
  for (bool zip64 : {false, true}) {
    for (uint64_t alignment : {1u, 64u, 4096u}) {
      Built b = Build(kNames, alignment, zip64);
      ZipDirectory d = ReadZip(b.bytes);
      EXPECT_EQ(d.zip64, zip64);
      ASSERT_EQ(d.entries.size(), kNames.size());
      for (size_t i = 0; i < kNames.size(); ++i) {
        const ZipEntry& e = d.entries[i];
        EXPECT_EQ(e.name, kNames[i]);
        EXPECT_EQ(e.data_offset, b.plan[i].data_offset);
        EXPECT_EQ(e.data_offset % alignment, 0u);
        EXPECT_EQ(e.size, i * 37 + 5);
        EXPECT_TRUE(e.stored());
        EXPECT_TRUE(testing::MatchesPattern(b.bytes.data() + e.data_offset, e.size, i));
        EXPECT_EQ(e.crc32, Crc32(b.bytes.data() + e.data_offset, e.size));
      }
      EXPECT_NE(d.Find("arch/data/1"), nullptr);
      EXPECT_EQ(d.Find("arch/data/9"), nullptr);
    }
  }
}

TEST(CheckpointZip, ReadsArchiveWithCommentAndEmptyArchive) {
  Built b = Build(kNames, 64, false);
  std::string with_comment = b.bytes;
  with_comment[with_comment.size() - 2] = 5;
  with_comment += "hello";
  EXPECT_EQ(ReadZip(with_comment).entries.size(), kNames.size());
  Built empty = Build({}, 64, false);
  EXPECT_TRUE(ReadZip(empty.bytes).entries.empty());
}

TEST(CheckpointZip, RejectsTruncatedArchives) {
  Built b = Build(kNames, 64, false);
  EXPECT_TRUE(Rejects("", "not a zip file"));
  EXPECT_TRUE(Rejects(std::string(100, 'x'), "no end of central directory record"));
  for (size_t cut : {size_t{1}, size_t{10}, size_t{30}, b.bytes.size() / 2}) {
    EXPECT_TRUE(Rejects(b.bytes.substr(0, b.bytes.size() - cut), "")) << cut;
  }
  // Only the head of the file: the end record is gone.
  EXPECT_TRUE(Rejects(b.bytes.substr(0, 200), "no end of central directory record"));
}

TEST(CheckpointZip, RejectsOutOfRangeDirectoryAndEntries) {
  Built b = Build(kNames, 64, false);
  size_t end = b.bytes.size() - 22;
  std::string s = b.bytes;
  Put32At(s, end + 16, static_cast<uint32_t>(s.size()));  // directory offset past the end
  EXPECT_TRUE(Rejects(s, "is outside the file"));
  s = b.bytes;
  Put32At(s, end + 12, 0x7FFFFFFF);  // directory size
  EXPECT_TRUE(Rejects(s, "is outside the file"));
  s = b.bytes;
  s[end + 8] = s[end + 10] = 100;  // more entries than the directory can hold
  EXPECT_TRUE(Rejects(s, "100 entries cannot fit"));
  s = b.bytes;
  s[end + 8] = s[end + 10] = 5;  // one more entry than there is
  EXPECT_TRUE(Rejects(s, "bad central directory record 4"));
  s = b.bytes;
  s[end + 8] = s[end + 10] = 3;  // one fewer
  EXPECT_TRUE(Rejects(s, "bytes after its 3 records"));
  s = b.bytes;
  size_t cd = b.plan.back().data_offset + b.plan.back().size;
  Put32At(s, cd + 42, static_cast<uint32_t>(cd - 10));  // local header offset into the directory
  EXPECT_TRUE(Rejects(s, "is not before the central directory"));
  s = b.bytes;
  Put32At(s, cd + 20, 1 << 30);  // compressed size runs into the directory
  EXPECT_TRUE(Rejects(s, "runs into the central directory"));
  s = b.bytes;
  Put32At(s, cd + 42,
          static_cast<uint32_t>(b.plan[1].local_header_offset));  // two entries, same bytes
  EXPECT_TRUE(Rejects(s, "local header names a different entry"));
  s = b.bytes;
  s[b.plan[2].local_header_offset] = 'X';
  EXPECT_TRUE(Rejects(s, "no local header"));
  s = b.bytes;
  s[cd] = 'X';
  EXPECT_TRUE(Rejects(s, "bad central directory record 0"));
}

TEST(CheckpointZip, RejectsOverlapsDuplicatesAndMultiDisk) {
  Built b = Build({"a", "b"}, 1, false);
  std::string s = b.bytes;
  size_t cd = b.plan.back().data_offset + b.plan.back().size;
  // Entry "a" claims to be long enough to cover "b".
  Put32At(s, cd + 20, static_cast<uint32_t>(b.plan[0].size + 10));
  Put32At(s, cd + 24, static_cast<uint32_t>(b.plan[0].size + 10));
  EXPECT_TRUE(Rejects(s, "overlaps entry 'a'"));
  Built d = Build({"x", "y"}, 1, false);
  s = d.bytes;
  cd = d.plan.back().data_offset + d.plan.back().size;
  size_t second_name = cd + 46 + 1 + 46;
  s[second_name] = 'x';
  s[d.plan[1].local_header_offset + 30] = 'x';
  EXPECT_TRUE(Rejects(s, "appears twice"));
  s = b.bytes;
  s[s.size() - 22 + 4] = 1;
  EXPECT_TRUE(Rejects(s, "multi-disk"));
}

TEST(CheckpointZip, RejectsBrokenZip64Records) {
  Built b = Build(kNames, 64, true);
  size_t locator = b.bytes.size() - 22 - 20;
  std::string s = b.bytes;
  for (int i = 0; i < 8; ++i) s[locator + 8 + i] = '\xFF';  // zip64 end record offset
  EXPECT_TRUE(Rejects(s, "zip64 end record offset"));
  s = b.bytes;
  s[locator] = 'X';  // locator gone while the end record is saturated
  EXPECT_TRUE(Rejects(s, "no zip64 end of central directory locator"));
  s = b.bytes;
  size_t end64 = locator - 56;
  s[end64] = 'X';
  EXPECT_TRUE(Rejects(s, "no zip64 end record"));
  s = b.bytes;
  s[end64 + 32 + 7] = 0x40;               // 2^62 entries
  EXPECT_TRUE(Rejects(s, "multi-disk"));  // disk_entries != entries
  s[end64 + 24 + 7] = 0x40;
  EXPECT_TRUE(Rejects(s, "more than the limit"));
  // A saturated entry field without its zip64 extra field.
  s = b.bytes;
  size_t cd = b.plan.back().data_offset + b.plan.back().size;
  s[cd + 30] = 0;                       // extra length 0...
  s[cd + 46 + kNames[0].size()] = 'Q';  // ...and the old extra bytes no longer parse as one
  EXPECT_TRUE(Rejects(s, ""));
}

TEST(CheckpointZip, ListsButRefusesCompressedAndEncryptedEntries) {
  auto dir = std::filesystem::path(__FILE__).parent_path() / "../data/checkpoint";
  ZipDirectory d = ReadZipDirectory(
      FileSource(File::Open((dir / "deflated.zip").string(), OpenMode::kRead, false)));
  const ZipEntry* e = d.Find("deflated/data.pkl");
  ASSERT_NE(e, nullptr);
  EXPECT_FALSE(e->stored());
  try {
    RequireStored(*e, "deflated.zip");
    ADD_FAILURE() << "accepted a compressed entry";
  } catch (const FormatError& err) {
    EXPECT_NE(std::string(err.what()).find("'deflated/data.pkl' is compressed (method 8)"),
              std::string::npos)
        << err.what();
  }
  ZipEntry enc;
  enc.name = "x";
  enc.flags = 1;
  EXPECT_THROW(RequireStored(enc, "a.zip"), FormatError);
}

// Method 0 with two different sizes is a damaged directory, not compression: the message says
// which (it used to call such an entry "compressed (method 0)").
TEST(CheckpointZip, StoredEntryWithTwoSizesIsCalledDamagedNotCompressed) {
  ZipEntry e;
  e.name = "archive/version";
  e.method = 0;
  e.size = 2;
  e.compressed_size = 2 + (1u << 16);
  try {
    RequireStored(e, "a.pt");
    ADD_FAILURE() << "accepted a stored entry with two sizes";
  } catch (const FormatError& err) {
    const std::string what = err.what();
    EXPECT_EQ(what.find("compressed (method"), std::string::npos) << what;
    EXPECT_NE(what.find("a.pt: zip entry 'archive/version' is stored (method 0, uncompressed) but "
                        "the directory gives it 65538 bytes in the file and 2 bytes of data"),
              std::string::npos)
        << what;
  }
  e.compressed_size = 2;
  EXPECT_NO_THROW(RequireStored(e, "a.pt"));
  e.method = 8;
  try {
    RequireStored(e, "a.pt");
    ADD_FAILURE() << "accepted a deflated entry";
  } catch (const FormatError& err) {
    EXPECT_NE(std::string(err.what()).find("is compressed (method 8)"), std::string::npos);
  }
}

TEST(CheckpointZip, ReadsTorchSaveArchive) {
  auto dir = std::filesystem::path(__FILE__).parent_path() / "../data/checkpoint";
  std::string path = (dir / "small.pt").string();
  std::vector<uint8_t> bytes = testing::ReadWholeFile(path);
  ZipDirectory d = ReadZipDirectory(FileSource(File::Open(path, OpenMode::kRead, false)));
  ASSERT_NE(d.Find("small/data.pkl"), nullptr);
  ASSERT_NE(d.Find("small/data/0"), nullptr);
  for (const auto& e : d.entries) {
    EXPECT_TRUE(e.stored()) << e.name;
    EXPECT_EQ(Crc32(bytes.data() + e.data_offset, e.size), e.crc32) << e.name;
    if (e.name.starts_with("small/data/")) {
      EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
    }
  }
}

}  // namespace
}  // namespace tensortier
