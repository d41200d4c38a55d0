// DCP rank files (dcp_file.hpp): the plan's offsets and alignment, the zip each tensor item is
// (read back by the torch zip reader), the checks of reads (xxh64, CRC-32, truncation) and the
// removal of files a new metadata does not name.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/dcp_file.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/checkpoint/dcp_reads.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/checkpoint/zip_writer.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::Pattern;
using testing::TempDir;

struct Written {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<DcpItemPlace> places;
};

// A bytes item, a small tensor, a 2 MiB tensor (its own request), an empty tensor.
Written WriteSample(Engine& engine, const std::string& path) {
  Written w;
  w.bytes = {Pattern(100, 1), Pattern(40, 2), Pattern(2u << 20, 3), {}};
  std::vector<DcpWriteItem> items = {
      {"", {}, 100, nullptr, "blob"},
      {"F32", {2, 5}, 40, nullptr, "small"},
      {"BF16", {1024, 1024}, 2u << 20, nullptr, "big"},
      {"F32", {0, 3}, 0, nullptr, "empty"},
  };
  for (size_t i = 0; i < items.size(); ++i) {
    items[i].src = reinterpret_cast<const std::byte*>(w.bytes[i].data());
  }
  w.places = WriteDcpFile(engine, path, items);
  return w;
}

TEST(DcpFile, TheFilesOfACheckpointAreNamedAsTorchNamesThem) {
  EXPECT_EQ(DcpMetadataPath("d"), "d/.metadata");
  EXPECT_EQ(DcpMetadataPath("d", 3), "d/__3.metadata");
  for (const char* name : {"__0_0.distcp", "__1_abcdef.distcp", "__x.distcp"}) {
    EXPECT_TRUE(IsDcpDataFile(name)) << name;
  }
  for (const char* name : {"_0_0.distcp", "__0_0.distcp.tmp", ".__0_0.distcp.tmp-1", ".metadata"}) {
    EXPECT_FALSE(IsDcpDataFile(name)) << name;
  }
  EXPECT_TRUE(IsRankLocalDcpMetadata("__12.metadata"));
  for (const char* name : {"__.metadata", "__a.metadata", ".metadata", "__1.metadata.tmp"}) {
    EXPECT_FALSE(IsRankLocalDcpMetadata(name)) << name;
  }
  TempDir dir;
  for (const char* name : {"__1_b.distcp", "__0_a.distcp", "__0_old.distcp", ".metadata", "x"}) {
    std::ofstream(dir.File(name)) << "x";
  }
  EXPECT_EQ(UnnamedDcpDataFiles(dir.path(), {"__0_old.distcp"}),
            (std::vector<std::string>{"__0_a.distcp", "__1_b.distcp"}));
  EXPECT_TRUE(UnnamedDcpDataFiles(dir.File("missing"), {}).empty());
}

TEST(DcpFile, TensorItemsAreZipsOfOneTensorWithAlignedData) {
  TempDir dir;
  Engine engine;
  const std::string path = dir.path() + "/__0_x.distcp";
  const Written w = WriteSample(engine, path);
  EXPECT_EQ(w.places[0].offset, 0u);
  EXPECT_EQ(w.places[0].length, 100u);
  const File file = File::Open(path, OpenMode::kRead, false);
  for (size_t i = 1; i < w.places.size(); ++i) {
    const DcpItemPlace& p = w.places[i];
    EXPECT_EQ(p.offset, w.places[i - 1].offset + w.places[i - 1].length);
    const DcpTensorItem t = ReadDcpTensorItem(file, "t", p.offset, p.length);
    EXPECT_EQ(t.data_offset, p.data_offset);
    EXPECT_EQ(t.nbytes, w.bytes[i].size());
    EXPECT_FALSE(t.crc32.has_value());  // 0s: the xxh64 goes to the metadata instead
    EXPECT_EQ(t.storage_offset, 0);
  }
  EXPECT_EQ(w.places[2].data_offset % 4096, 0u);
  EXPECT_EQ(w.places[1].data_offset % 64, 0u);
  const DcpTensorItem big = ReadDcpTensorItem(file, "big", w.places[2].offset, w.places[2].length);
  EXPECT_EQ(big.dtype, "BF16");
  EXPECT_EQ(big.shape, (std::vector<int64_t>{1024, 1024}));
  EXPECT_EQ(big.stride, (std::vector<int64_t>{1024, 1}));
}

std::vector<char> FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Items without a src (GPU tensors, views) are staged in groups of about the budget, after the
// resident ones: the same file and places as when every item is in host memory, whatever the
// budget; a stage that fails leaves no file.
TEST(DcpFile, StagedItemsGiveTheSameFileInGroupsOfTheBudget) {
  TempDir dir;
  Engine engine;
  const Written whole = WriteSample(engine, dir.path() + "/__0_whole.distcp");
  const std::vector<char> want = FileBytes(dir.path() + "/__0_whole.distcp");
  for (const uint64_t budget : {uint64_t{1}, uint64_t{64}, uint64_t{1} << 30}) {
    std::vector<DcpWriteItem> items = {
        {"", {}, 100, nullptr, "blob"},
        {"F32", {2, 5}, 40, nullptr, "small"},
        {"BF16", {1024, 1024}, 2u << 20, nullptr, "big"},
        {"F32", {0, 3}, 0, nullptr, "empty"},
    };
    items[0].src = reinterpret_cast<const std::byte*>(whole.bytes[0].data());  // resident
    std::vector<std::vector<size_t>> groups;
    std::vector<std::vector<uint8_t>> copies;  // what a stage made: freed at the next
    const DcpStageFn stage = [&](std::span<const size_t> group) {
      groups.emplace_back(group.begin(), group.end());
      copies.clear();
      std::vector<const std::byte*> srcs;
      for (const size_t i : group) {
        copies.push_back(whole.bytes[i]);
        srcs.push_back(reinterpret_cast<const std::byte*>(copies.back().data()));
      }
      return srcs;
    };
    const std::string path = StrCat(dir.path(), "/__0_", budget, ".distcp");
    const std::vector<DcpItemPlace> places =
        WriteDcpFile(engine, path, items, true, "rank 0", stage, budget);
    EXPECT_EQ(FileBytes(path), want) << budget;
    for (size_t i = 0; i < places.size(); ++i) {
      EXPECT_EQ(places[i].xxh64, whole.places[i].xxh64) << i;
      EXPECT_EQ(places[i].block_xxh64, whole.places[i].block_xxh64) << i;
    }
    // The empty tensor needs no bytes: staged are "small" and "big", alone or together.
    using Groups = std::vector<std::vector<size_t>>;
    // A group closes once it holds the budget: 40 bytes stay open below 64.
    const Groups expected = budget == 1 ? Groups{{1}, {2}} : Groups{{1, 2}};
    EXPECT_EQ(groups, expected) << budget;
  }
  std::vector<DcpWriteItem> items = {{"F32", {2, 5}, 40, nullptr, "small"}};
  const std::string path = dir.path() + "/__0_failed.distcp";
  EXPECT_THROW(WriteDcpFile(engine, path, items, true, "rank 0",
                            [](std::span<const size_t>) -> std::vector<const std::byte*> {
                              throw std::runtime_error("copy to host failed");
                            }),
               std::runtime_error);
  EXPECT_FALSE(std::filesystem::exists(path));
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_FALSE(e.path().filename().string().starts_with("__0_failed")) << e.path();
  }
  EXPECT_THROW(WriteDcpFile(engine, path, items), std::invalid_argument);  // no bytes, no stage
}

TEST(DcpFile, AnItemThatCannotBeWrittenIsNamedByItsKey) {
  const std::byte data[8] = {};
  // A quantized dtype (torch pickles no plain tensor of it), a size that does not match.
  for (const auto& [item, message] : std::vector<std::pair<DcpWriteItem, std::string>>{
           {{"QI8", {8}, 8, data, "model.q"}, "model.q"},
           {{"F32", {3}, 8, data, "opt.m"}, "opt.m: 8 bytes for 3 elements"},
           {{"F32", {3}, 8, data, ""}, "item 0: 8 bytes"}}) {
    try {
      DcpFilePlan plan({item});
      FAIL() << message;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

TEST(DcpFile, AShapeOtherThanTheMetadataChunksIsRefusedNamingBoth) {
  TempDir dir;
  Engine engine;
  const std::string path = dir.path() + "/__0_x.distcp";
  const Written w = WriteSample(engine, path);
  const File file = File::Open(path, OpenMode::kRead, false);
  const DcpItemPlace& p = w.places[1];
  EXPECT_EQ(ReadDcpTensorItem(file, "w", p.offset, p.length, std::vector<int64_t>{2, 5}).shape,
            (std::vector<int64_t>{2, 5}));
  try {
    ReadDcpTensorItem(file, "w", p.offset, p.length, std::vector<int64_t>{3, 5});
    FAIL() << "no error";
  } catch (const FormatError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("'w'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[3, 5]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[2, 5]"), std::string::npos) << msg;
  }
}

TEST(DcpFile, ReadsCheckEveryItemAndNameTheDamage) {
  TempDir dir;
  Engine engine;
  const std::string path = dir.path() + "/__0_x.distcp";
  const Written w = WriteSample(engine, path);
  auto read_all = [&](std::vector<std::vector<uint8_t>>& out) {
    const File file = File::Open(path, OpenMode::kRead, true);
    std::vector<DcpRead> reads;
    out.assign(w.places.size(), {});
    for (size_t i = 0; i < w.places.size(); ++i) {
      const DcpItemPlace& p = w.places[i];
      out[i].resize(w.bytes[i].size());
      reads.push_back({StrCat("item", i),
                       p.offset,
                       p.length,
                       p.data_offset,
                       w.bytes[i].size(),
                       reinterpret_cast<std::byte*>(out[i].data()),
                       p.xxh64,
                       std::nullopt,
                       std::nullopt,
                       {}});
    }
    ReadDcpItems(engine, file, reads);
  };
  std::vector<std::vector<uint8_t>> got;
  read_all(got);
  EXPECT_EQ(got, w.bytes);
  {  // a flipped bit in a zip record of the big tensor's item (before its data)
    const File file = File::Open(path, OpenMode::kReadWrite, false);
    const uint64_t at = w.places[2].offset + 3;
    char c;
    ASSERT_EQ(pread(file.buffered_fd(), &c, 1, static_cast<off_t>(at)), 1);
    c ^= 1;
    ASSERT_EQ(pwrite(file.buffered_fd(), &c, 1, static_cast<off_t>(at)), 1);
  }
  try {
    read_all(got);
    FAIL() << "no error";
  } catch (const FormatError& e) {
    const std::string range =
        StrCat("[", w.places[2].offset, ", ", w.places[2].offset + w.places[2].length, ")");
    EXPECT_NE(std::string(e.what()).find("'item2'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(range), std::string::npos) << e.what();
  }
  std::filesystem::resize_file(path, w.places[3].offset - 10);
  EXPECT_THROW(read_all(got), FormatError);
}

TEST(DcpFile, LargeItemsAreCheckedPieceByPieceAsTheyArrive) {
  // 20 MiB and a page of data after a 100-byte item: read in pieces that end at 8 MiB multiples
  // of the file, none of them aligned with the data's start, each hashed as it comes in.
  TempDir dir;
  Engine engine;
  const std::string path = dir.path() + "/__0_x.distcp";
  const std::vector<uint8_t> blob = Pattern(100, 1), data = Pattern((20u << 20) + 4096, 2);
  std::vector<DcpWriteItem> items = {
      {"", {}, blob.size(), reinterpret_cast<const std::byte*>(blob.data()), "blob"},
      {"U8", {data.size()}, data.size(), reinterpret_cast<const std::byte*>(data.data()), "w"}};
  const std::vector<DcpItemPlace> places = WriteDcpFile(engine, path, items);
  const DcpItemPlace& p = places[1];
  std::vector<uint8_t> out;
  auto read = [&](bool crc) {
    const File file = File::Open(path, OpenMode::kRead, true);
    out.assign(data.size(), 0);
    const DcpRead r{"w",
                    p.offset,
                    p.length,
                    p.data_offset,
                    data.size(),
                    reinterpret_cast<std::byte*>(out.data()),
                    crc ? std::nullopt : std::optional<uint64_t>(p.xxh64),
                    crc ? std::optional<uint32_t>(Crc32(data.data(), data.size())) : std::nullopt,
                    std::nullopt,
                    {}};
    ReadDcpItems(engine, file, std::span<const DcpRead>(&r, 1));
  };
  for (const bool crc : {false, true}) {
    read(crc);
    EXPECT_EQ(out, data);
  }
  auto flip = [&](uint64_t at) {
    const File file = File::Open(path, OpenMode::kReadWrite, false);
    char c;
    ASSERT_EQ(pread(file.buffered_fd(), &c, 1, static_cast<off_t>(at)), 1);
    c ^= 4;
    ASSERT_EQ(pwrite(file.buffered_fd(), &c, 1, static_cast<off_t>(at)), 1);
  };
  const std::string range = StrCat("[", p.offset, ", ", p.offset + p.length, ")");
  // In the first piece, a middle one, the last byte of the data; in the records after it (the
  // xxh64 alone covers them).
  for (const uint64_t at : {p.data_offset + 1, p.data_offset + (9u << 20) + 5,
                            p.data_offset + data.size() - 1, p.offset + p.length - 1}) {
    flip(at);
    for (const bool crc : {false, true}) {
      if (crc && at >= p.data_offset + data.size()) continue;
      try {
        read(crc);
        FAIL() << "no error for a flip at " << at << (crc ? " (CRC-32)" : " (xxh64)");
      } catch (const FormatError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(path), std::string::npos) << msg;
        EXPECT_NE(msg.find("'w'"), std::string::npos) << msg;
        EXPECT_NE(msg.find(range), std::string::npos) << msg;
        EXPECT_NE(msg.find(crc ? "CRC-32" : "xxh64"), std::string::npos) << msg;
      }
    }
    flip(at);
  }
  read(false);
  EXPECT_EQ(out, data);
  // A file that ends inside a middle piece.
  std::filesystem::resize_file(path, p.data_offset + (12u << 20));
  try {
    read(false);
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
}

TEST(DcpFile, SliceRunsAreTheContiguousPiecesOfABlock) {
  const DcpSlice rows{{8, 6}, 4, {2, 0}, {3, 6}};  // whole rows: one run
  auto runs = DcpSliceRuns(rows, 4096, "t");
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].offset, 4096u + 2 * 24);
  EXPECT_EQ(runs[0].length, 3u * 24);
  const DcpSlice cols{{4, 6}, 2, {1, 2}, {2, 3}};  // columns 2..4 of rows 1..2
  runs = DcpSliceRuns(cols, 0, "t");
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].offset, 12u + 4);
  EXPECT_EQ(runs[1].offset, 24u + 4);
  EXPECT_EQ(runs[1].length, 6u);
  EXPECT_EQ(runs[1].dest_offset, 6u);
  const DcpSlice cube{{2, 3, 4}, 1, {1, 0, 0}, {1, 3, 4}};  // the inner dims whole: one run
  ASSERT_EQ(DcpSliceRuns(cube, 0, "t").size(), 1u);
  EXPECT_EQ(DcpSliceRuns(cube, 0, "t")[0].offset, 12u);
  EXPECT_TRUE(DcpSliceRuns({{4, 6}, 4, {0, 0}, {0, 6}}, 0, "t").empty());
  EXPECT_EQ(DcpSliceRuns({{}, 8, {}, {}}, 64, "t")[0].length, 8u);  // a 0-d tensor
  EXPECT_THROW(DcpSliceRuns({{4, 6}, 4, {3, 0}, {2, 6}}, 0, "t"), FormatError);
  EXPECT_THROW(DcpSliceRuns({{4, 6}, 4, {0}, {2}}, 0, "t"), FormatError);
}

TEST(DcpFile, ReadsOfSlicesReadOnlyTheirRuns) {
  TempDir dir;
  Engine engine;
  const std::string path = dir.path() + "/__0_x.distcp";
  const Written w = WriteSample(engine, path);  // item 2: BF16 [1024, 1024]
  const File file = File::Open(path, OpenMode::kRead, true);
  const DcpItemPlace& p = w.places[2];
  // Columns [256, 768) of rows [0, 16): 16 runs of 1 KiB, 1 KiB apart, in one request.
  std::vector<uint8_t> got(16 * 512 * 2);
  DcpRead r{"big",
            p.offset,
            p.length,
            p.data_offset,
            2u << 20,
            reinterpret_cast<std::byte*>(got.data()),
            std::nullopt,
            std::nullopt,
            DcpSlice{{1024, 1024}, 2, {0, 256}, {16, 512}},
            {}};
  const uint64_t bytes = ReadDcpItems(engine, file, std::span<const DcpRead>(&r, 1));
  EXPECT_LE(bytes, 16u * 4096);
  for (size_t row = 0; row < 16; ++row) {
    ASSERT_EQ(0, std::memcmp(got.data() + row * 1024, w.bytes[2].data() + row * 2048 + 512, 1024))
        << row;
  }
  // Columns [0, 512) of every row: 1 KiB runs 2 KiB apart read a page or less apart, merged.
  got.assign(1024 * 512 * 2, 0);
  r.dest = reinterpret_cast<std::byte*>(got.data());
  r.slice = DcpSlice{{1024, 1024}, 2, {0, 0}, {1024, 512}};
  EXPECT_LE(ReadDcpItems(engine, file, std::span<const DcpRead>(&r, 1)), (2u << 20) + 4096);
  EXPECT_EQ(0, std::memcmp(got.data() + 1023 * 1024, w.bytes[2].data() + 1023 * 2048, 1024));
}

TEST(DcpFile, PartsAreCheckedByTheBlocksTheyTouch) {
  TempDir dir;
  Engine engine;
  const std::string path = dir.path() + "/__0_x.distcp";
  const Written w = WriteSample(engine, path);  // item 2: BF16 [1024, 1024], rows of 2 KiB
  const DcpItemPlace& p = w.places[2];
  ASSERT_EQ(p.block_xxh64.size(), 8 * ((2u << 20) / kDcpBlockBytes));
  EXPECT_EQ(w.places[1].block_xxh64.size(), 8u);  // one short block
  EXPECT_TRUE(w.places[0].block_xxh64.empty());   // a bytes item
  EXPECT_TRUE(w.places[3].block_xxh64.empty());   // no data
  // Columns [256, 768) of rows [20, 40): the blocks of rows [16, 48), whole.
  std::vector<uint8_t> got(20 * 512 * 2);
  DcpRead r{"big",         p.offset,     p.length,
            p.data_offset, 2u << 20,     reinterpret_cast<std::byte*>(got.data()),
            std::nullopt,  std::nullopt, DcpSlice{{1024, 1024}, 2, {20, 256}, {20, 512}},
            p.block_xxh64};
  {
    const File file = File::Open(path, OpenMode::kRead, true);
    EXPECT_EQ(ReadDcpItems(engine, file, std::span<const DcpRead>(&r, 1)), 2 * kDcpBlockBytes);
  }
  for (size_t row = 0; row < 20; ++row) {
    ASSERT_EQ(
        0, std::memcmp(got.data() + row * 1024, w.bytes[2].data() + (20 + row) * 2048 + 512, 1024))
        << row;
  }
  // A byte of row 17 (in a touched block, outside the part) flipped: named by its block.
  {
    const File rw = File::Open(path, OpenMode::kReadWrite, false);
    const uint8_t b = w.bytes[2][17 * 2048 + 3] ^ 0x40;
    ASSERT_EQ(pwrite(rw.buffered_fd(), &b, 1, static_cast<off_t>(p.data_offset + 17 * 2048 + 3)),
              1);
  }
  const File file = File::Open(path, OpenMode::kRead, true);
  try {
    ReadDcpItems(engine, file, std::span<const DcpRead>(&r, 1));
    FAIL() << "no error";
  } catch (const FormatError& e) {
    const std::string range =
        StrCat("bytes [", p.data_offset + kDcpBlockBytes, ", ", p.data_offset + 2 * kDcpBlockBytes);
    EXPECT_NE(std::string(e.what()).find(range), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'big'"), std::string::npos) << e.what();
  }
  got.assign(16 * 1024 * 2, 0);
  r.dest = reinterpret_cast<std::byte*>(got.data());
  r.slice = DcpSlice{{1024, 1024}, 2, {64, 0}, {16, 1024}};  // rows [64, 80): undamaged blocks
  EXPECT_NO_THROW(ReadDcpItems(engine, file, std::span<const DcpRead>(&r, 1)));
  r.blocks = std::string_view(p.block_xxh64).substr(8);  // not one sum per block
  EXPECT_THROW(ReadDcpItems(engine, file, std::span<const DcpRead>(&r, 1)), FormatError);
}

TEST(DcpFile, SmallItemsAreReadOnceForTheirRecordsAndTheirData) {
  TempDir dir;
  Engine engine;
  const std::string path = dir.path() + "/__0_x.distcp";
  constexpr size_t kItems = 500;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<DcpWriteItem> items;
  for (size_t i = 0; i < kItems; ++i) bytes.push_back(Pattern(1024, static_cast<int>(i)));
  for (size_t i = 0; i < kItems; ++i) {
    items.push_back(
        {"F32", {256}, 1024, reinterpret_cast<const std::byte*>(bytes[i].data()), StrCat("t", i)});
  }
  const std::vector<DcpItemPlace> places = WriteDcpFile(engine, path, items);
  std::vector<DcpFileReads::Item> wanted;
  for (size_t i = 0; i < kItems; ++i) {
    wanted.push_back({StrCat("t", i),
                      places[i].offset,
                      places[i].length,
                      true,
                      true,
                      std::vector<int64_t>{256},
                      StrCat("t", i),
                      {},
                      {},
                      {}});
  }
  const DcpFileReads reads(engine, path, wanted);
  const uint64_t size = std::filesystem::file_size(path);
  EXPECT_LE(reads.bytes_read(), size + 4096);  // the records parsed from the bytes held
  ASSERT_EQ(reads.tensors().size(), kItems);
  std::vector<std::vector<uint8_t>> out(kItems, std::vector<uint8_t>(1024));
  std::vector<DcpRead> r;
  for (size_t i = 0; i < kItems; ++i) {
    const DcpTensorItem& t = reads.tensors()[i];
    r.push_back({StrCat("t", i),
                 places[i].offset,
                 places[i].length,
                 t.data_offset,
                 t.nbytes,
                 reinterpret_cast<std::byte*>(out[i].data()),
                 places[i].xxh64,
                 std::nullopt,
                 std::nullopt,
                 {}});
  }
  EXPECT_EQ(reads.Read(engine, r), 0u);  // all of it held
  EXPECT_EQ(out, bytes);
  // The held bytes are checked as the file's are: an xxh64 the item does not have is refused.
  r[7].xxh64 = *r[7].xxh64 ^ 1;
  EXPECT_THROW(reads.Read(engine, r), FormatError);
}

TEST(DcpMetadata, ChunksMustHoldEveryElementAndFilesMustBeThere) {
  EXPECT_NO_THROW(CheckDcpChunksCover("w", {4, 6}, {{0, 0}, {2, 0}}, {{2, 6}, {2, 6}}, "m"));
  try {
    CheckDcpChunksCover("w", {4, 6}, {{0, 0}}, {{2, 6}}, "m");
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("'w' hold 12 of its 24"), std::string::npos) << e.what();
  }
  EXPECT_THROW(CheckDcpChunksCover("w", {4, 6}, {{3, 0}}, {{2, 6}}, "m"), FormatError);
  TempDir dir;
  std::ofstream(dir.path() + "/__0_new.distcp") << "x";
  EXPECT_NO_THROW(CheckDcpDataFilesPresent(dir.path(), {"__0_new.distcp"}));
  try {
    CheckDcpDataFilesPresent(dir.path(), {"__0_old.distcp"});
    FAIL() << "no error";
  } catch (const IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("stale"), std::string::npos) << msg;
    EXPECT_NE(msg.find("__0_new.distcp"), std::string::npos) << msg;
    EXPECT_NE(msg.find(dir.path() + "/__0_old.distcp"), std::string::npos) << msg;
  }
}

TEST(DcpFile, CommitRemovesOnlyWhatTheNewMetadataDoesNotName) {
  TempDir dir;
  Engine engine;
  // An older save's rank-local metadata (__N.metadata) goes too; names only like it stay.
  for (const char* name : {"__0_old.distcp", "__0_new.distcp", "other.bin", "__12.metadata",
                           "__x.metadata", "__.metadata", "a__0.metadata"}) {
    std::ofstream(dir.path() + "/" + name) << "x";
  }
  CommitDcpCheckpoint(engine, dir.path(), "metadata", {"__0_new.distcp"});
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/__0_old.distcp"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/__12.metadata"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/__0_new.distcp"));
  for (const char* name : {"other.bin", "__x.metadata", "__.metadata", "a__0.metadata"}) {
    EXPECT_TRUE(std::filesystem::exists(dir.path() + "/" + name)) << name;
  }
  EXPECT_EQ(std::filesystem::file_size(dir.path() + "/.metadata"), 8u);
}

TEST(DcpFile, ACommitMissingSomeRanksFilesSaysTheDirectoryMustBeShared) {
  // Rank 1 saved into a directory of its own (another node's disk under the same path): the
  // coordinator sees its own file only, and commits nothing.
  TempDir dir;
  Engine engine;
  std::ofstream(dir.path() + "/__0_new.distcp") << "x";
  try {
    CommitDcpCheckpoint(engine, dir.path(), "metadata", {"__0_new.distcp", "__1_new.distcp"},
                        "rank 0");
    FAIL() << "no error";
  } catch (const IoError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_NE(msg.find("1 of its 2 data files"), std::string::npos) << msg;
    EXPECT_NE(msg.find("one directory all ranks share"), std::string::npos) << msg;
    EXPECT_NE(msg.find(dir.path() + "/__1_new.distcp"), std::string::npos) << msg;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/.metadata"));
}

TEST(DcpFile, AFailedCommitRemovesTheNewSavesFiles) {
  TempDir dir;
  Engine engine;
  std::filesystem::create_directory(dir.path() + "/.metadata");  // cannot be replaced by a file
  std::ofstream(dir.path() + "/__0_old.distcp") << "x";
  std::ofstream(dir.path() + "/__0_new.distcp") << "x";
  try {
    CommitDcpCheckpoint(engine, dir.path(), "metadata", {"__0_new.distcp"}, "rank 0");
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 committing the checkpoint: "), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/__0_old.distcp"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/__0_new.distcp"));
}

TEST(DcpMetadata, RefusesGlobalsOutsideDcpAndTruncatedPickles) {
  const std::string system(
      "\x80\x02"
      "cos\nsystem\n"
      "X\x02\x00\x00\x00ls\x85R.",
      23);
  try {
    ParseDcpMetadata(system, "m");
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("os.system is not allowed"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ParseDcpMetadata(std::string("\x80\x04\x95", 3), "m"), FormatError);
  EXPECT_THROW(ParseDcpMetadata("", "m"), FormatError);
  // A dict is not Metadata.
  EXPECT_THROW(ParseDcpMetadata(std::string("\x80\x02}.", 4), "m"), FormatError);
}

// One opcode reader serves both restricted unpicklers: the metadata's takes the opcodes
// pickle.dumps emits (a set here), torch.save's refuses them, each in its own words.
TEST(DcpMetadata, SharesTheOpcodeReaderWithTorchPickles) {
  auto error = [](auto parse, const std::string& pickle) {
    try {
      parse(pickle);
    } catch (const FormatError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto dcp = [](const std::string& p) { ParseDcpMetadata(p, "m"); };
  auto torch = [](const std::string& p) { ParseTorchPickle(p, "data.pkl"); };
  const std::string set("\x80\x04\x8f\x94(K\x01\x90.", 9);
  EXPECT_NE(error(dcp, set).find("m: not DCP metadata this reader accepts (expected a "),
            std::string::npos)
      << error(dcp, set);
  EXPECT_NE(error(torch, set).find("data.pkl: at byte 2: unsupported pickle opcode 0x8f"),
            std::string::npos)
      << error(torch, set);
  EXPECT_NE(error(dcp, std::string("\x80\x02N\x51.", 5)).find("unsupported pickle opcode 0x51"),
            std::string::npos);
  const std::string wide("\x80\x02\x8a\x09\x01\x00\x00\x00\x00\x00\x00\x00\x01.", 14);
  EXPECT_NE(error(dcp, wide).find("an integer wider than 64 bits"), std::string::npos);
}

// A pickled DCP Metadata with no items whose StorageMeta holds tensortier_format `format`.
std::string MetadataOfFormat(int format) {
  auto str = [](const std::string& v) {
    const auto n = static_cast<uint32_t>(v.size());
    return StrCat("X", std::string(reinterpret_cast<const char*>(&n), 4), v);
  };
  const std::string md = "ctorch.distributed.checkpoint.metadata\n";
  return StrCat("\x80\x02", md, "Metadata\n)\x81}(", str("state_dict_metadata"), "}",
                str("storage_data"), "}", str("storage_meta"), md, "StorageMeta\n)\x81}(",
                str("tensortier_format"), "K", std::string(1, static_cast<char>(format)), "ub",
                "ub.");
}

TEST(DcpMetadata, ANewerFormatIsRefusedNamingItsVersion) {
  EXPECT_EQ(ParseDcpMetadata(MetadataOfFormat(1), "m").format, 1);
  try {
    ParseDcpMetadata(MetadataOfFormat(2), "ckpt/.metadata");
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt/.metadata: written in tensortier's DCP format 2; "
                                         "this tensortier reads format 1"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(CheckDcpFormat(0, "m"), FormatError);
  EXPECT_NO_THROW(CheckDcpFormat(std::nullopt, "m"));  // torch's files
}

TEST(DcpMetadata, AWrittenMetadataReadsBackWithEveryItem) {
  DcpMetadataContents md;
  DcpMetadataEntry w;
  w.fqn = "model.w";
  w.dtype = "bfloat16";
  w.requires_grad = true;
  w.size = {4, 8};
  w.chunks = {{{0, 0}, {2, 8}}, {{2, 0}, {2, 8}}};
  DcpMetadataEntry scalar;
  scalar.fqn = "s";
  scalar.dtype = "int8";
  scalar.chunks = {{{}, {}}};
  DcpMetadataEntry note;
  note.fqn = "note";
  note.bytes = true;
  md.entries = {w, scalar, note};
  md.planner_data.emplace();
  md.planner_data->push_back({"model.w", {std::string("model"), std::string("w")}});
  md.planner_data->push_back({"s", {std::string("s")}});
  md.planner_data->push_back({"note", {std::string("l"), int64_t{3}, int64_t{-1}}});
  const uint64_t big_sum = 0xF123456789ABCDEFull;  // bit 63 set: nine bytes in LONG1
  md.storage = {{"model.w", std::vector<int64_t>{0, 0}, 0, "__0_a.distcp", 0, 600, big_sum,
                 std::string(8, 'x')},
                {"model.w", std::vector<int64_t>{2, 0}, 1, "__1_b.distcp", 64, 600, 7, ""},
                {"s", std::vector<int64_t>{}, 0, "__0_a.distcp", 4096, 500, 0, ""},
                {"note", std::nullopt, std::nullopt, "__0_a.distcp", 8192, 70, 70000, ""}};
  md.checkpoint_id = "/ckpt/step-1";
  md.save_id = "abc";
  md.format = kDcpFormat;
  md.version = "1.0.0";
  const DcpMetadata got = ParseDcpMetadata(SerializeDcpMetadata(md), "m");
  EXPECT_EQ(got.version, "1.0.0");
  EXPECT_EQ(got.format, kDcpFormat);
  ASSERT_EQ(got.items.size(), 4u);
  EXPECT_EQ(got.items[0].name, "model.w");
  EXPECT_EQ(got.items[0].xxh64, big_sum);
  EXPECT_EQ(got.items[0].block_xxh64, std::string(8, 'x'));
  EXPECT_EQ(got.items[0].chunk_sizes, (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(got.items[1].name, "model.w at [2, 0]");
  EXPECT_EQ(got.items[1].relative_path, "__1_b.distcp");
  EXPECT_EQ(got.items[1].offset, 64u);
  EXPECT_EQ(got.items[2].chunk_sizes, (std::vector<int64_t>{}));
  EXPECT_TRUE(got.items[3].bytes);
  EXPECT_EQ(got.items[3].xxh64, 70000u);
  EXPECT_EQ(got.items[3].length, 70u);

  // The index before the pickle gives the same contents back, without running the pickle.
  const std::string file = SerializeDcpMetadata(md);
  const auto index = ReadDcpMetadataIndex(file, "m");
  ASSERT_TRUE(index.has_value());
  EXPECT_EQ(index->version, "1.0.0");
  EXPECT_EQ(index->checkpoint_id, "/ckpt/step-1");
  EXPECT_EQ(index->save_id, "abc");
  EXPECT_EQ(index->format, kDcpFormat);
  ASSERT_EQ(index->entries.size(), 3u);
  EXPECT_EQ(index->entries[0].dtype, "bfloat16");
  EXPECT_TRUE(index->entries[0].requires_grad);
  EXPECT_EQ(index->entries[0].chunks, md.entries[0].chunks);
  EXPECT_TRUE(index->entries[2].bytes);
  ASSERT_EQ(index->storage.size(), 4u);
  EXPECT_EQ(index->storage[0].xxh64, big_sum);
  EXPECT_EQ(index->storage[1].relative_path, "__1_b.distcp");
  EXPECT_EQ(index->storage[3].offset, std::nullopt);
  const DcpMetadataTable table(*index);
  ASSERT_NE(table.Entry("s"), nullptr);
  EXPECT_TRUE(table.StoredWhole(*table.Entry("s")));
  EXPECT_FALSE(table.StoredWhole(*table.Entry("model.w")));  // two chunks
  EXPECT_EQ(table.Entry("nope"), nullptr);
  EXPECT_EQ(table.Storage("model.w", std::vector<int64_t>{2, 0})->offset_in_file, 64u);
  EXPECT_EQ(table.Storage("note", std::nullopt)->length, 70u);
  EXPECT_EQ(table.Storage("note", std::vector<int64_t>{}), nullptr);
  EXPECT_EQ(*table.ChunkSizes("model.w", {2, 0}), (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(table.Files(), (std::vector<std::string>{"__0_a.distcp", "__1_b.distcp"}));
  // Files without an index (pickle.dumps'), and damage to either half.
  EXPECT_FALSE(ReadDcpMetadataIndex(MetadataOfFormat(1), "m").has_value());
  for (size_t at : {size_t{30}, file.size() - 2}) {
    std::string damaged = file;
    damaged[at] ^= 0x10;
    EXPECT_THROW(ReadDcpMetadataIndex(damaged, "m"), FormatError) << at;
  }
  EXPECT_THROW(ReadDcpMetadataIndex(file.substr(0, 40), "m"), FormatError);

  md.entries[0].fqn = "bad\xff";
  EXPECT_THROW(SerializeDcpMetadata(md), std::invalid_argument);
  md.entries[0].fqn = "model.w";
  md.entries[0].dtype = "float32\nos.system";  // a dtype is a name, never a second global
  EXPECT_THROW(SerializeDcpMetadata(md), std::invalid_argument);
}

TEST(DcpMetadata, AMissingOrForeignDirectoryIsNamed) {
  TempDir dir;
  auto error = [](const std::string& d) -> std::pair<int, std::string> {
    try {
      ReadDcpMetadataBytes(d);
    } catch (const IoError& e) {
      return {e.error_code(), e.what()};
    }
    return {0, ""};
  };
  const auto missing = error(dir.path() + "/nope");
  EXPECT_EQ(missing.first, ENOENT);
  EXPECT_NE(missing.second.find(dir.path() + "/nope'"), std::string::npos) << missing.second;
  const auto empty = error(dir.path());
  EXPECT_EQ(empty.first, ENOENT);
  EXPECT_NE(empty.second.find("not a DCP checkpoint directory"), std::string::npos) << empty.second;
  EXPECT_NE(empty.second.find(dir.path() + "/.metadata'"), std::string::npos) << empty.second;
  std::ofstream(dir.path() + "/__0_x.distcp") << "x";
  const auto unfinished = error(dir.path());
  EXPECT_NE(unfinished.second.find("a save that did not finish"), std::string::npos)
      << unfinished.second;
  EXPECT_NE(unfinished.second.find("a DCP checkpoint directory whose .metadata is missing"),
            std::string::npos)
      << unfinished.second;
  EXPECT_TRUE(IsDcpDirectory(dir.path()));  // info and verify say what is missing
  EXPECT_EQ(error(dir.path() + "/__0_x.distcp").first, ENOTDIR);
  std::filesystem::create_directory(dir.path() + "/.metadata");
  const auto is_dir = error(dir.path());
  EXPECT_EQ(is_dir.first, EISDIR);
  EXPECT_NE(is_dir.second.find(".metadata is a directory"), std::string::npos) << is_dir.second;
  std::filesystem::remove(dir.path() + "/.metadata");
  std::ofstream(dir.path() + "/.metadata") << "meta";
  EXPECT_EQ(ReadDcpMetadataBytes(dir.path()), "meta");
}

TEST(DcpFile, AMissingDataFileIsNamedWithItsItems) {
  TempDir dir;
  const std::vector<std::string> items = {"w", "b", "note"};
  try {
    OpenDcpDataFile(dir.path() + "/__1_x.distcp", items, true);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_EQ(e.path(), dir.path() + "/__1_x.distcp");
    EXPECT_NE(std::string(e.what()).find("item 'w' and 2 more"), std::string::npos) << e.what();
  }
}

TEST(DcpFile, AFailedWriteNamesTheWriterAndTheFinalPath) {
  TempDir dir;
  Engine engine;
  const std::string path = dir.path() + "/gone/__3_x.distcp";  // its directory is missing
  const std::vector<uint8_t> bytes(10, 1);
  try {
    WriteDcpFile(engine, path,
                 {{"", {}, 10, reinterpret_cast<const std::byte*>(bytes.data()), "blob"}}, true,
                 "rank 3");
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_NE(std::string(e.what()).find("rank 3 saving its DCP data file: "), std::string::npos)
        << e.what();
  }
}

TEST(DcpFile, DataFileNamesStayInsideTheDirectory) {
  EXPECT_TRUE(IsDcpDataFileName("__0_0.distcp"));
  for (const char* bad : {"", "../other/__0_x.distcp", "a/b", "/abs", ".hidden", ".."}) {
    EXPECT_FALSE(IsDcpDataFileName(bad)) << bad;
    EXPECT_THROW(CheckDcpDataFileName(bad, "d/.metadata"), FormatError) << bad;
  }
  EXPECT_FALSE(IsDcpDataFileName(std::string_view("a\0b", 3)));
  try {
    CheckDcpDataFileName("../x", "d/.metadata");
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("d/.metadata: names the data file '../x'"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace

}  // namespace tensortier

namespace tensortier {
namespace {

// A stored zip of `records` (name, data) with their CRC-32s, as torch.save writes one.
std::string ZipOf(const std::vector<std::pair<std::string, std::string>>& records) {
  ZipPlanner plan(1);
  for (const auto& [name, data] : records) {
    const size_t i = plan.Add(name, data.size());
    plan.SetCrc(i, Crc32(data.data(), data.size()));
  }
  std::string out(plan.directory_offset(), '\0');
  for (size_t i = 0; i < records.size(); ++i) {
    const ZipPlanEntry& e = plan.entries()[i];
    const std::string header = plan.LocalHeader(i);
    out.replace(e.local_header_offset, header.size(), header);
    out.replace(e.data_offset, records[i].second.size(), records[i].second);
  }
  return out + plan.Directory();
}

TEST(DcpZipRecordsTest, AStockBytesItemIsCheckedByItsRecordsCrcs) {
  std::string zip = ZipOf({{"archive/data.pkl", "pickled value"}, {"archive/version", "3"}});
  EXPECT_EQ(DcpZipRecordsProblem(MemorySource(zip.data(), zip.size())), "");
  zip[zip.find("pickled")] = 'k';
  const std::optional<std::string> problem =
      DcpZipRecordsProblem(MemorySource(zip.data(), zip.size()));
  ASSERT_TRUE(problem.has_value());
  EXPECT_NE(problem->find("its zip record 'archive/data.pkl' has the CRC-32"), std::string::npos)
      << *problem;
  // Not a torch.save zip (a planner's own bytes, a zip among them): nothing to check.
  const std::string raw = "raw bytes of a planner's own";
  EXPECT_FALSE(DcpZipRecordsProblem(MemorySource(raw.data(), raw.size())).has_value());
  std::string other = ZipOf({{"notes.txt", "x"}});
  other.back() ^= 1;  // even a damaged one
  EXPECT_FALSE(DcpZipRecordsProblem(MemorySource(other.data(), other.size())).has_value());
  const std::string pk = "PK\x03\x04 and then nothing like a zip";
  EXPECT_FALSE(DcpZipRecordsProblem(MemorySource(pk.data(), pk.size())).has_value());
}

}  // namespace
}  // namespace tensortier
