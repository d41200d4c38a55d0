// ReadPieces, CheckPieces and CheckRecords: a load's pieces read into the caller's memory and
// checked as they arrive, small ones gathered, large ones in groups; every failure names the file
// and the piece.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/piece_reader.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::TempDir;

// A file of `sizes` pieces end to end from offset 3, random bytes.
struct PieceFile {
  std::string path;
  std::vector<std::vector<std::byte>> data;
  std::vector<uint64_t> offsets;
};

PieceFile Make(const TempDir& dir, const std::vector<uint64_t>& sizes) {
  PieceFile f{dir.File("pieces"), {}, {}};
  std::mt19937 rng(11);
  std::vector<std::byte> all(3);
  for (uint64_t n : sizes) {
    std::vector<std::byte> d(n);
    for (auto& b : d) b = static_cast<std::byte>(rng());
    f.offsets.push_back(all.size());
    all.insert(all.end(), d.begin(), d.end());
    f.data.push_back(std::move(d));
  }
  File out = File::Open(f.path, OpenMode::kWrite);
  Engine engine;
  engine.Write(out, all.data(), all.size(), 0).Wait();
  return f;
}

// What the message of `fn`'s FormatError says.
template <typename Fn>
std::string ErrorOf(Fn fn) {
  try {
    fn();
  } catch (const FormatError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(PieceReader, ReadsSmallAndLargePiecesInGroupsAndChecksThem) {
  TempDir dir;
  const std::vector<uint64_t> sizes = {5, 3 << 20, 0, 4000, 2 << 20, 1 << 20, 17};
  PieceFile f = Make(dir, sizes);
  std::vector<std::vector<std::byte>> back(sizes.size());
  std::vector<PieceRead> pieces;
  for (size_t i = 0; i < sizes.size(); ++i) {
    back[i].resize(sizes[i]);
    pieces.push_back({StrCat("t", i), f.offsets[i], sizes[i], back[i].data(), PieceCheck::kXxh64,
                      Xxh64(f.data[i].data(), sizes[i])});
  }
  Engine engine;
  File in = File::Open(f.path, OpenMode::kRead);
  uint64_t reported = 0;
  std::vector<IoStats> stats =
      ReadPieces(engine, in, "m.safetensors", pieces,
                 PieceReadOptions{.group_bytes = 3 << 20, .gather_below = 1 << 20},
                 [&](uint64_t n) { reported += n; });
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(back[i], f.data[i]) << i;
  uint64_t total = 0;
  for (uint64_t n : sizes) total += n;
  EXPECT_EQ(reported, total);
  // Large pieces (3 MiB, 0 B, 2 MiB, 1 MiB): groups of >= 3 MiB: {3 MiB}, {0 B, 2 MiB, 1 MiB}.
  EXPECT_EQ(stats.size(), 2u);
}

TEST(PieceReader, AMismatchNamesTheFileThePieceAndBothChecksums) {
  TempDir dir;
  PieceFile f = Make(dir, {100, 2 << 20});
  std::vector<std::byte> a(100), b(2 << 20);
  const uint64_t good_a = Xxh64(f.data[0].data(), 100);
  const uint64_t good_b = Xxh64(f.data[1].data(), 2 << 20);
  Engine engine;
  File in = File::Open(f.path, OpenMode::kRead);
  std::vector<PieceRead> pieces = {
      {"a", f.offsets[0], 100, a.data(), PieceCheck::kXxh64, good_a},
      {"victim", f.offsets[1], 2 << 20, b.data(), PieceCheck::kXxh64, good_b ^ 1}};
  EXPECT_EQ(ErrorOf([&] { ReadPieces(engine, in, "m.safetensors", pieces); }),
            StrCat("m.safetensors: tensor 'victim': xxh64 checksum mismatch (stored ",
                   Hex16(good_b ^ 1), ", data has ", Hex16(good_b), "): the file is corrupt"));
  pieces[1].expected.reset();
  EXPECT_EQ(ErrorOf([&] { ReadPieces(engine, in, "m.safetensors", pieces); }),
            "m.safetensors: verify=True but tensor 'victim' has no stored checksum");
  const uint32_t crc = Crc32(f.data[0].data(), 100);
  std::vector<PieceRead> record = {
      {"archive/data/0", f.offsets[0], 100, a.data(), PieceCheck::kCrc32, crc ^ 0x10u}};
  EXPECT_EQ(ErrorOf([&] { ReadPieces(engine, in, "m.pt", record); }),
            StrCat("m.pt: entry 'archive/data/0': CRC-32 checksum mismatch (stored ",
                   Hex8(crc ^ 0x10u), ", data has ", Hex8(crc), "): the file is corrupt"));
  record[0].expected = crc;
  EXPECT_NO_THROW(CheckPieces("m.pt", record));
  record[0].expected = crc ^ 1u;
  EXPECT_NE(ErrorOf([&] { CheckPieces("m.pt", record); }).find("entry 'archive/data/0'"),
            std::string::npos);
}

TEST(PieceReader, AFileThatEndsEarlyNamesThePiece) {
  TempDir dir;
  PieceFile f = Make(dir, {10, 2 << 20});
  std::vector<std::byte> small(20), large(3 << 20);
  Engine engine;
  File in = File::Open(f.path, OpenMode::kRead);
  const uint64_t end = f.offsets[1] + (2 << 20);
  std::vector<PieceRead> tail = {{"z", end - 6, 20, small.data(), PieceCheck::kNone, {}}};
  EXPECT_EQ(ErrorOf([&] { ReadPieces(engine, in, "p", tail); }),
            StrCat("p: file ended early: tensor 'z' needs 20 bytes at offset ", end - 6,
                   ", got 6 (truncated file?)"));
  std::vector<PieceRead> big = {
      {"it's", f.offsets[1], 3 << 20, large.data(), PieceCheck::kNone, {}}};
  EXPECT_EQ(ErrorOf([&] { ReadPieces(engine, in, "p", big); }),
            StrCat("p: file ended early: tensor \"it's\" needs ", 3 << 20, " bytes at offset ",
                   f.offsets[1], ", got ", 2 << 20, " (truncated file?)"));
}

TEST(PieceReader, RecordsAreStreamedAndChecked) {
  TempDir dir;
  PieceFile f = Make(dir, {1000, 5 << 20});
  Engine engine;
  File in = File::Open(f.path, OpenMode::kRead);
  const uint32_t a = Crc32(f.data[0].data(), 1000);
  const uint32_t b = Crc32(f.data[1].data(), 5 << 20);
  std::vector<RecordCheck> records = {{"x/.format_version", f.offsets[0], 1000, a},
                                      {"x/data/1", f.offsets[1], 5 << 20, b}};
  EXPECT_NO_THROW(CheckRecords(engine, in, "m.pt", records));
  records[1].crc32 = b ^ 4u;
  EXPECT_EQ(ErrorOf([&] { CheckRecords(engine, in, "m.pt", records); }),
            StrCat("m.pt: entry 'x/data/1': CRC-32 checksum mismatch (stored ", Hex8(b ^ 4u),
                   ", data has ", Hex8(b), "): the file is corrupt"));
  records[1] = {"x/data/1", f.offsets[1], (5 << 20) + 1, b};
  EXPECT_NE(ErrorOf([&] {
              CheckRecords(engine, in, "m.pt", records);
            }).find("m.pt: record x/data/1 is truncated"),
            std::string::npos);
}

}  // namespace
}  // namespace tensortier
