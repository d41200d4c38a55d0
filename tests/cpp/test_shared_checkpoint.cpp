// LocateTorchTensor: where a tensor of a real torch.save file lies, for in-place loads into a
// shared tensor (tests/data/checkpoint/make_fixtures.py writes the files).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/shared/shared_checkpoint.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"

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

}  // namespace
}  // namespace tensortier
