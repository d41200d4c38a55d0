// What checkpoint paths name: suffix rules (either case) and shard indexes (path checks,
// duplicates, malformed JSON), as tensortier.load and the CLI both read them.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "tensortier/checkpoint_format.hpp"
#include "tensortier/format_error.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::TempDir;

TEST(CheckpointFormatTest, SuffixesInEitherCase) {
  EXPECT_EQ(FormatOfSuffix("a/m.safetensors"), CheckpointFormat::kSafetensors);
  EXPECT_EQ(FormatOfSuffix("M.SafeTensors"), CheckpointFormat::kSafetensors);
  EXPECT_EQ(FormatOfSuffix("m.ST"), CheckpointFormat::kSafetensors);
  for (const char* name : {"m.pt", "m.PT", "m.pth", "m.bin", "M.BIN", "m.ckpt", "m.tar"}) {
    EXPECT_EQ(FormatOfSuffix(name), CheckpointFormat::kTorch) << name;
  }
  for (const char* name : {"", "pt", "m.json", "m.safetensors.index.json", "m.ptx", "m."}) {
    EXPECT_EQ(FormatOfSuffix(name), std::nullopt) << name;
  }
  EXPECT_EQ(CheckpointFormatName(CheckpointFormat::kTorch), "torch");
}

std::string WriteIndex(const TempDir& dir, const std::string& text) {
  const std::string path = dir.File("model.safetensors.index.json");
  std::ofstream(path) << text;
  return path;
}

std::string FormatErrorOf(const std::string& path) {
  try {
    ReadShardIndex(path);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(CheckpointFormatTest, ShardIndexGroupsNamesByShardInOrder) {
  TempDir dir;
  const std::string path =
      WriteIndex(dir, R"({"metadata": {"total_size": 8}, "weight_map": {"b": "2.st", "a": "1.st",
              "c": "2.st", "d": "sub/3.st"}})");
  const std::vector<Shard> shards = ReadShardIndex(path);
  ASSERT_EQ(shards.size(), 3u);
  EXPECT_EQ(shards[0].path, dir.File("2.st"));
  EXPECT_EQ(shards[0].names, (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(shards[1].names, std::vector<std::string>{"a"});
  EXPECT_EQ(shards[2].path, dir.File("sub/3.st"));
  EXPECT_TRUE(IsShardIndex(path));
}

TEST(CheckpointFormatTest, ShardIndexRefusals) {
  TempDir dir;
  const std::pair<const char*, const char*> cases[] = {
      {R"({"weight_map": {"a": "../x.st"}})", "outside the index's directory"},
      {R"({"weight_map": {"a": "..\\x.st"}})", "outside the index's directory"},
      {R"({"weight_map": {"a": "sub/../../x.st"}})", "outside the index's directory"},
      {R"({"weight_map": {"a": "/abs/x.st"}})", "outside the index's directory"},
      {R"({"weight_map": {"a": "x.st", "a": "y.st"}})", "listed twice"},
      {R"({"weight_map": {"a": "x.st"}, "weight_map": {}})", "two 'weight_map'"},
      {R"({"weight_map": {}})", "naming no tensors"},
      {R"({"other": 1})", "no 'weight_map'"},
      {R"({"weight_map": {"a": 1}})", "is not a string"},
      {"{not json", "shard index JSON"},
  };
  for (const auto& [text, says] : cases) {
    const std::string message = FormatErrorOf(WriteIndex(dir, text));
    EXPECT_NE(message.find(says), std::string::npos) << text << " -> " << message;
  }
}

}  // namespace
}  // namespace tensortier
