// The Hugging Face model directories tensortier.hf reads (hf_checkpoint.hpp).
#include <gtest/gtest.h>

#include <cerrno>
#include <fstream>
#include <string>

#include "tensortier/checkpoint/hf_checkpoint.hpp"
#include "tensortier/util/error.hpp"
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
  EXPECT_EQ(FindHfCheckpoint(d)->target, d + "/model.safetensors.index.json");
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

}  // namespace
}  // namespace tensortier
