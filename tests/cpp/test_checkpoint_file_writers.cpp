// The writers tensortier.save hands its tensors to: TorchFileWriter given torch's own pickle and
// written in steps (storages staged a few at a time), and SafetensorsFileWriter. Files are read
// back by the readers of src/checkpoint and verified with their own checksums.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/safetensors_writer.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"
#include "tensortier/checkpoint/torch_file_writer.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/strings.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::TempDir;

std::vector<std::byte> Bytes(size_t n, size_t seed) {
  std::vector<std::byte> out(n);
  for (size_t k = 0; k < n; ++k) out[k] = static_cast<std::byte>((seed * 131 + k * 7) & 0xFF);
  return out;
}

TEST(CheckpointFileWriters, TorchPickleGivenAndStoragesWrittenInSteps) {
  // The pickle of a plain dict, given as torch's pickler would hand it over: the file is the
  // one the plain-dict constructor writes, whether its storages come in one call or in groups.
  std::vector<TorchPickleTensor> tensors;
  std::vector<uint64_t> nbytes;
  std::vector<std::vector<std::byte>> data;
  for (size_t i = 0; i < 9; ++i) {
    const uint64_t n = i % 3 == 0 ? (1u << 20) + 4096 * i + 3 : 100 + i;  // direct and copied
    tensors.push_back({StrCat("t", i), "U8", {n}, StrCat(i)});
    nbytes.push_back(n);
    data.push_back(Bytes(n, i));
  }
  TempDir dir;
  Engine engine;
  auto write = [&](const std::string& name, bool steps) {
    TorchFileWriter writer(SerializeTorchPickle(tensors), nbytes);
    EXPECT_EQ(writer.size(), TorchFileWriter(tensors, nbytes).size());
    DurableFile out(dir.File(name));
    out.Reserve(writer.size());
    if (!steps) {
      std::vector<const std::byte*> all;
      for (const auto& d : data) all.push_back(d.data());
      HostTensorBytes bytes(all);
      writer.Write(engine, out.file(), bytes);
    } else {
      writer.Begin(engine, out.file());
      for (size_t first = 0; first < data.size(); first += 4) {
        std::vector<std::vector<std::byte>> staged;  // copies freed after each group
        std::vector<const std::byte*> group;
        for (size_t i = first; i < std::min(first + 4, data.size()); ++i) {
          staged.push_back(data[i]);
        }
        for (const auto& s : staged) group.push_back(s.data());
        HostTensorBytes bytes(group);
        writer.WriteStorages(bytes, group.size());
        for (auto& s : staged) std::memset(s.data(), 0xEE, s.size());  // no longer read
      }
      EXPECT_EQ(writer.storages_written(), data.size());
      writer.End();
    }
    out.Commit();
  };
  write("once.pt", false);
  write("steps.pt", true);
  for (const char* name : {"once.pt", "steps.pt"}) {
    FileSource source(OpenCheckpointForReading(dir.File(name), false));
    TorchCheckpoint c = ReadTorchCheckpoint(source);
    ASSERT_TRUE(c.plain_dict) << name;
    ASSERT_EQ(c.pickle.tensors.size(), data.size());
    for (size_t i = 0; i < data.size(); ++i) {
      const TorchStorage& s = c.pickle.storages.at(c.pickle.tensors[i].storage_key);
      EXPECT_EQ(s.data_offset % 4096, 0u);
      std::vector<std::byte> got(s.nbytes);
      source.ReadAt(s.data_offset, got.data(), got.size());
      ASSERT_EQ(got, data[i]) << name << " " << i;
    }
    const VerifyReport report =
        VerifyCheckpointData(dir.File(name), ReadCheckpointLayout(dir.File(name)));
    EXPECT_TRUE(report.problems.empty()) << name << ": " << report.problems.front();
  }
  TorchFileWriter writer(SerializeTorchPickle(tensors), nbytes);
  DurableFile out(dir.File("bad.pt"));
  HostTensorBytes none(std::vector<const std::byte*>{});
  EXPECT_THROW(writer.WriteStorages(none, 0), std::logic_error);  // before Begin
  writer.Begin(engine, out.file());
  EXPECT_THROW(writer.End(), std::logic_error);  // storages left
}

TEST(CheckpointFileWriters, SafetensorsLayoutHeaderAndChecksums) {
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::vector<std::byte>> data;
  for (size_t i = 0; i < 50; ++i) {
    const uint64_t count = i % 10 == 0 ? (1u << 19) + i : 1 + i;  // F32: 2 MiB ones past gathering
    tensors.push_back({StrCat("w", i), "F32", {count}, count * 4});
    data.push_back(Bytes(count * 4, i));
  }
  tensors.push_back({"empty", "BF16", {0, 3}, 0});
  data.emplace_back();
  TempDir dir;
  Engine engine;
  for (bool checksum : {false, true}) {
    const std::string path = dir.File(checksum ? "sum.safetensors" : "plain.safetensors");
    SafetensorsFileWriter writer(tensors, {{"step", "7"}}, checksum);
    EXPECT_EQ(writer.data_start() % 4096, 0u);
    DurableFile out(path);
    out.Reserve(writer.size());
    // In two calls, in any order: odd tensors, then even ones.
    for (size_t parity : {1u, 0u}) {
      std::vector<size_t> indices;
      std::vector<const std::byte*> addresses;
      for (size_t i = parity; i < data.size(); i += 2) {
        indices.push_back(i);
        addresses.push_back(data[i].data());
      }
      writer.WriteTensors(engine, out.file(), indices, addresses);
    }
    EXPECT_THROW(writer.WriteTensors(engine, out.file(), {0}, {data[0].data()}),
                 std::invalid_argument);  // written already
    writer.WriteHeader(engine, out.file());
    out.Commit();
    const CheckpointLayout layout = ReadCheckpointLayout(path);
    EXPECT_EQ(layout.st.header.metadata.at("format"), "pt");
    EXPECT_EQ(layout.st.header.metadata.at("step"), "7");
    EXPECT_EQ(layout.st.header.metadata.count(kTensorChecksumsKey), checksum ? 1u : 0u);
    FileSource source(OpenCheckpointForReading(path, false));
    for (const CheckpointItem& item : layout.items) {
      const size_t i = item.name == "empty" ? data.size() - 1 : std::stoul(item.name.substr(1));
      std::vector<std::byte> got(item.nbytes);
      if (item.nbytes) source.ReadAt(item.offset, got.data(), got.size());
      ASSERT_EQ(got, data[i]) << item.name;
      if (item.nbytes % 4096 == 0 && item.nbytes > 0) {
        EXPECT_EQ(item.offset % 4096, 0u);
      }
    }
    if (checksum) {
      const VerifyReport report = VerifyCheckpointData(path, layout);
      EXPECT_TRUE(report.problems.empty()) << report.problems.front();
      EXPECT_TRUE(report.header_checked);
    }
  }
  EXPECT_THROW(SafetensorsFileWriter(tensors, {{kTensorChecksumsKey, "{}"}}, false),
               std::invalid_argument);
  EXPECT_THROW(SafetensorsFileWriter({{"q", "QI8", {2}, 2}}, {}, false), std::invalid_argument);
  SafetensorsFileWriter unfinished(tensors, {}, false);
  DurableFile out(dir.File("unfinished.safetensors"));
  EXPECT_THROW(unfinished.WriteHeader(engine, out.file()), std::logic_error);
}

}  // namespace
}  // namespace tensortier
