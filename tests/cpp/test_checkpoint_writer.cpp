// TorchFileWriter (the .pt files of plain dicts that tensortier.save and `tensortier convert`
// write) and the small-piece reads and writes of many small tensors: files read back by the
// readers of src/checkpoint, bytes and CRC-32s checked, across the writer's buffer boundaries.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/checkpoint/small_pieces.hpp"
#include "tensortier/util/strings.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"
#include "tensortier/checkpoint/torch_file_writer.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::TempDir;

struct Tensors {
  std::vector<TorchPickleTensor> pickled;
  std::vector<uint64_t> nbytes;
  std::vector<std::vector<std::byte>> data;
  std::vector<const std::byte*> addresses() const {
    std::vector<const std::byte*> out;
    for (const auto& d : data) out.push_back(d.data());
    return out;
  }
};

// `count` U8 tensors of `size(i)` bytes, each byte a function of its tensor and position.
template <typename Size>
Tensors Make(size_t count, Size size) {
  Tensors t;
  for (size_t i = 0; i < count; ++i) {
    const uint64_t n = size(i);
    t.pickled.push_back({StrCat("t", i), "U8", {n}, StrCat(i)});
    t.nbytes.push_back(n);
    std::vector<std::byte> bytes(n);
    for (uint64_t k = 0; k < n; ++k) bytes[k] = static_cast<std::byte>((i * 131 + k * 7) & 0xFF);
    t.data.push_back(std::move(bytes));
  }
  return t;
}

// Reads `path` back as torch.load would find it and checks every tensor's bytes and CRC-32.
void ExpectFile(const std::string& path, const Tensors& t, bool crcs = true) {
  FileSource source(OpenCheckpointForReading(path, false));
  TorchCheckpoint c = ReadTorchCheckpoint(source);
  EXPECT_TRUE(c.plain_dict);
  EXPECT_EQ(c.prefix, "archive");
  ASSERT_EQ(c.pickle.tensors.size(), t.pickled.size());
  for (size_t i = 0; i < t.pickled.size(); ++i) {
    const TorchStorage& s = c.pickle.storages.at(c.pickle.tensors[i].storage_key);
    ASSERT_EQ(s.nbytes, t.nbytes[i]) << i;
    EXPECT_EQ(s.data_offset % 4096, 0u) << i;
    std::vector<std::byte> got(s.nbytes);
    if (!got.empty()) source.ReadAt(s.data_offset, got.data(), got.size());
    ASSERT_EQ(got, t.data[i]) << "tensor " << i;
  }
  for (const ZipEntry& e : c.zip.entries) {
    std::string bytes(e.size, '\0');
    if (e.size) source.ReadAt(e.data_offset, bytes.data(), bytes.size());
    const uint32_t want = crcs || e.size == 0 ? Crc32(bytes.data(), bytes.size()) : 0;
    if (crcs || e.name.find("/data/") != std::string::npos) {
      EXPECT_EQ(e.crc32, want) << e.name;
    }
  }
  EXPECT_EQ(source.size(), TorchFileWriter(t.pickled, t.nbytes).size());
}

void Write(const std::string& path, const Tensors& t, TensorBytes& bytes,
           TorchFileOptions options = {}) {
  TorchFileWriter writer(t.pickled, t.nbytes, options);
  Engine engine;
  DurableFile out(path);
  out.Reserve(writer.size());
  writer.Write(engine, out.file(), bytes);
  out.Commit();
}

TEST(CheckpointWriter, ThousandsOfSmallTensorsAcrossBufferBoundaries) {
  // 4000 tensors of 1 KiB: the directory straddles the end of the first 16 MiB buffer.
  TempDir dir;
  for (size_t count : {1u, 3u, 4000u, 5000u}) {
    Tensors t = Make(count, [](size_t i) { return 1000 + i % 50; });
    HostTensorBytes bytes(t.addresses());
    Write(dir.File("m.pt"), t, bytes);
    ExpectFile(dir.File("m.pt"), t);
  }
}

TEST(CheckpointWriter, LargeTensorsAreWrittenFromTheirMemoryTailsIncluded) {
  // Past the direct-write threshold, with sizes that end off a page, between small ones.
  TempDir dir;
  Tensors t = Make(7, [](size_t i) -> uint64_t {
    return i % 2 ? (1u << 20) + 4096 * i + 17 * i : 100 + i;
  });
  HostTensorBytes bytes(t.addresses());
  Write(dir.File("m.pt"), t, bytes);
  ExpectFile(dir.File("m.pt"), t);
}

TEST(CheckpointWriter, ZeroCrcsWhenAskedNot) {
  TempDir dir;
  Tensors t = Make(3, [](size_t) { return 10; });
  HostTensorBytes bytes(t.addresses());
  Write(dir.File("m.pt"), t, bytes, {.folder = "archive", .crc32 = false});
  FileSource source(OpenCheckpointForReading(dir.File("m.pt"), false));
  for (const ZipEntry& e : ReadZipDirectory(source).entries) EXPECT_EQ(e.crc32, 0u) << e.name;
}

TEST(CheckpointWriter, BytesFromAFileInOrder) {
  // FileTensorBytes: tensors of a file, read front to back in large reads (across them).
  TempDir dir;
  Tensors t = Make(3000, [](size_t i) { return i % 7 == 0 ? 9000 : 1 + i % 3; });
  std::vector<uint64_t> offsets;
  {
    File f = File::Open(dir.File("in"), OpenMode::kWrite, false);
    uint64_t at = 123;  // not page aligned
    std::string all(at, 'x');
    for (const auto& d : t.data) {
      offsets.push_back(at);
      all.append(reinterpret_cast<const char*>(d.data()), d.size());
      at += d.size();
    }
    ASSERT_EQ(pwrite(f.buffered_fd(), all.data(), all.size(), 0),
              static_cast<ssize_t>(all.size()));
  }
  Engine engine;
  File in = File::Open(dir.File("in"), OpenMode::kRead);
  {
    FileTensorBytes bytes(engine, in, offsets, t.nbytes);
    Write(dir.File("m.pt"), t, bytes);
  }
  ExpectFile(dir.File("m.pt"), t);
  // A file that ends early is named as truncated.
  ASSERT_EQ(truncate(dir.File("in").c_str(), static_cast<off_t>(offsets.back())), 0);
  File cut = File::Open(dir.File("in"), OpenMode::kRead);
  FileTensorBytes bytes(engine, cut, offsets, t.nbytes);
  EXPECT_THROW(Write(dir.File("cut.pt"), t, bytes), FormatError);
}

TEST(CheckpointWriter, ScatteredReadsAndGatheredWritesRoundTrip) {
  TempDir dir;
  std::mt19937 rng(7);
  // Pieces of 1 B to 100 KiB end to end from offset 5, written in a shuffled order.
  std::vector<std::vector<std::byte>> data;
  std::vector<GatheredWrite> writes;
  uint64_t at = 5;
  for (size_t i = 0; i < 3000; ++i) {
    const size_t n = i % 100 == 0 ? 100000 : 1 + rng() % 2000;
    std::vector<std::byte> d(n);
    for (auto& b : d) b = static_cast<std::byte>(rng());
    data.push_back(std::move(d));
    writes.push_back({at, n, data.back().data()});
    at += n;
  }
  std::vector<size_t> order(writes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<GatheredWrite> shuffled;
  for (size_t i : order) shuffled.push_back(writes[i]);
  Engine engine;
  {
    File out = File::Open(dir.File("f"), OpenMode::kWrite);
    std::vector<uint64_t> hashes = WriteGathered(engine, out, shuffled, true);
    ASSERT_EQ(hashes.size(), shuffled.size());
    for (size_t k = 0; k < shuffled.size(); ++k) {
      EXPECT_EQ(hashes[k], Xxh64(shuffled[k].src, shuffled[k].length));
    }
    EXPECT_TRUE(WriteGathered(engine, out, shuffled, false).empty());
  }
  File in = File::Open(dir.File("f"), OpenMode::kRead);
  std::vector<std::vector<std::byte>> back(data.size());
  std::vector<ScatteredRead> reads;
  for (size_t i : order) {
    back[i].resize(data[i].size());
    reads.push_back({writes[i].offset, writes[i].length, back[i].data()});
  }
  // And one range that overlaps others, one past the end of the file.
  std::vector<std::byte> overlap(300), past(10);
  reads.push_back({writes[1].offset, overlap.size(), overlap.data()});
  reads.push_back({at - 4, past.size(), past.data()});
  std::vector<uint64_t> got = ReadScattered(engine, in, reads);
  for (size_t k = 0; k < order.size(); ++k) EXPECT_EQ(got[k], reads[k].length);
  for (size_t i = 0; i < data.size(); ++i) ASSERT_EQ(back[i], data[i]) << i;
  EXPECT_EQ(got[order.size() + 1], 4u);  // the file ends 4 bytes into it
  EXPECT_EQ(std::memcmp(past.data(), data.back().data() + data.back().size() - 4, 4), 0);
}

}  // namespace
}  // namespace tensortier
