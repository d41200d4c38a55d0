// LocateTorchTensor: where a tensor of a real torch.save file lies, for in-place loads into a
// shared tensor (tests/data/checkpoint/make_fixtures.py writes the files); a rank's rows read
// from and written to files (shared_files.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/shared/shared_checkpoint.hpp"
#include "tensortier/shared/shared_files.hpp"
#include "tensortier/util/format_error.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

std::string Fixture(const std::string& name) {
  return (std::filesystem::path(__FILE__).parent_path() / "../data/checkpoint" / name).string();
}

std::vector<float> ReadFloats(const std::string& path, uint64_t offset, uint64_t nbytes) {
  std::vector<float> out(nbytes / sizeof(float));
  FileSource(File::Open(path, OpenMode::kRead, false)).ReadAt(offset, out.data(), nbytes);
  return out;
}

TEST(SharedCheckpoint, LocatesATensorAndAViewWithAStorageOffset) {
  const std::string path = Fixture("small.pt");
  TorchTensorLookup weight = LocateTorchTensor(path, "model.layer.weight");
  ASSERT_TRUE(weight.found.has_value());
  EXPECT_EQ(weight.found->dtype, "float32");
  EXPECT_EQ(weight.found->shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(weight.found->nbytes, 48u);

  TorchCheckpoint c = ReadTorchCheckpoint(FileSource(File::Open(path, OpenMode::kRead, false)));
  const TorchTensor* base = nullptr;
  for (const auto& t : c.pickle.tensors) {
    if (t.path == "shared.base") base = &t;
  }
  ASSERT_NE(base, nullptr);
  const uint64_t base_offset = c.pickle.storages.at(base->storage_key).data_offset;
  TorchTensorLookup view = LocateTorchTensor(path, "shared.view");  // base[4:10].view(2, 3)
  ASSERT_TRUE(view.found.has_value());
  EXPECT_EQ(view.found->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(view.found->offset, base_offset + 4 * sizeof(float));
  EXPECT_EQ(ReadFloats(path, view.found->offset, view.found->nbytes),
            (std::vector<float>{4, 5, 6, 7, 8, 9}));

  TorchTensorLookup bias = LocateTorchTensor(path, "model.layer.bias");
  ASSERT_TRUE(bias.found.has_value());
  EXPECT_EQ(bias.found->dtype, "bfloat16");
  EXPECT_TRUE(bias.keys.empty());
}

TEST(SharedCheckpoint, AMissingKeyListsEveryKey) {
  TorchTensorLookup none = LocateTorchTensor(Fixture("small.pt"), "model.layer");
  EXPECT_FALSE(none.found.has_value());
  EXPECT_EQ(none.keys.size(), 7u);
  EXPECT_NE(std::find(none.keys.begin(), none.keys.end(), "list.4"), none.keys.end());
}

TEST(SharedCheckpoint, RefusesLegacyAndNonTorchFilesNamingTheKey) {
  for (const char* name : {"legacy.pt", "small.safetensors"}) {
    try {
      LocateTorchTensor(Fixture(name), "x");
      ADD_FAILURE() << name << " accepted";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("'x'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

TEST(SharedFiles, ARanksRowsComeFromAnyCutOfTheFilesAndGoBackToItsPart) {
  testing::TempDir dir;
  std::vector<float> all(30);  // 10 rows of 3
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<float>(i);
  const std::vector<float> part = {all.begin() + 12, all.begin() + 21};  // rows 4..7 of rank 1
  const std::vector<std::string> names =
      WriteRowFile(dir.File("rows"), 1, 3, part.data(), part.size() * sizeof(float));
  ASSERT_EQ(names.size(), 3u);
  EXPECT_EQ(names[1], dir.File("rows") + "_part_1_of_3");
  WriteRowFile(dir.File("rows"), 0, 3, all.data(), 12 * sizeof(float));
  // Rank 2's part in two pieces, as device rows go through a bounded host slab; a longer part
  // written there before is replaced.
  WriteRowFile(dir.File("rows"), 2, 3, all.data(), 30 * sizeof(float));
  WriteRowFile(dir.File("rows"), 2, 3, all.data() + 21, 4 * sizeof(float), 0, false);
  WriteRowFile(dir.File("rows"), 2, 3, all.data() + 25, 5 * sizeof(float), 4 * sizeof(float));
  EXPECT_EQ(std::filesystem::file_size(names[2]), 36u);
  const std::vector<RowSource> sources = {{names[0], 0, 48}, {names[1], 0, 36}, {names[2], 0, 36}};
  std::vector<float> rows(3 * 3);
  const auto stats = ReadRows(sources, "load_files", "float32", 4, {10, 3}, 3, 6, rows.data());
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(rows, (std::vector<float>{all.begin() + 9, all.begin() + 18}));
  EXPECT_FALSE(ReadRows(sources, "load_files", "float32", 4, {10, 3}, 5, 5, rows.data()));
  try {
    ReadRows(sources, "load_files", "float32", 4, {11, 3}, 0, 1, rows.data());
    ADD_FAILURE() << "sources of the wrong size accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("shape (11, 3) and dtype torch.float32 needs 132"),
              std::string::npos)
        << e.what();
  }
}

TEST(SharedFiles, ACheckpointSourceIsCheckedAgainstTheTensor) {
  const RowSource s =
      CheckpointRowSource(Fixture("small.pt"), "model.layer.weight", "float32", {4, 3});
  EXPECT_EQ(s.length, 48u);
  try {
    CheckpointRowSource(Fixture("small.pt"), "model.layer.weight", "float32", {12});
    ADD_FAILURE() << "another shape accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("is float32 of shape (4, 3); this shared tensor is "
                                         "float32 of shape (12,)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(CheckpointRowSource(Fixture("small.pt"), "nope", "float32", {1}),
               MissingTensorError);
}

}  // namespace
}  // namespace tensortier
