// What checkpoint paths name: suffix rules (either case) and shard indexes (path checks,
// duplicates, malformed JSON), as tensortier.load and the CLI both read them.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <string>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_format.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/util/format_error.hpp"
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
  for (const char* name : {"", "pt", "m.json", "m.safetensors.index.json", "m.ptx", "m.",
                           "m.tmp.tmp", "a.pt/m.tmp", "a.st\\m"}) {
    EXPECT_EQ(FormatOfSuffix(name), std::nullopt) << name;
  }
  // The suffix before one that names no format: a name written, then renamed.
  EXPECT_EQ(FormatOfSuffix("d/m.safetensors.tmp"), CheckpointFormat::kSafetensors);
  EXPECT_EQ(FormatOfSuffix("m.PT.partial"), CheckpointFormat::kTorch);
  EXPECT_EQ(FormatOfSuffix("m.pt.safetensors"), CheckpointFormat::kSafetensors);
  EXPECT_EQ(CheckpointFormatName(CheckpointFormat::kTorch), "torch");
}

TEST(CheckpointFormatTest, FormatAndKindNamesBothWays) {
  EXPECT_EQ(CheckpointFormatName(CheckpointFormat::kSafetensors), "safetensors");
  for (CheckpointFormat format : {CheckpointFormat::kSafetensors, CheckpointFormat::kTorch}) {
    EXPECT_EQ(ValueOf(kCheckpointFormatNames, CheckpointFormatName(format)), format);
  }
  for (CheckpointKind kind :
       {CheckpointKind::kSafetensors, CheckpointKind::kTorch, CheckpointKind::kShardIndex}) {
    EXPECT_EQ(ValueOf(kCheckpointKindNames, CheckpointKindName(kind)), kind);
  }
  EXPECT_EQ(ValueOf(kCheckpointKindNames, "zip"), std::nullopt);
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
  EXPECT_EQ(DetectCheckpointKind(path), CheckpointKind::kShardIndex);
  // One file spelled two ways is one shard, under the first spelling.
  const std::vector<Shard> merged = ReadShardIndex(
      WriteIndex(dir, R"({"weight_map": {"a": "./1.st", "b": "1.st", "c": "sub//3.st",
              "d": "sub/3.st"}})"));
  ASSERT_EQ(merged.size(), 2u);
  EXPECT_EQ(merged[0].path, dir.File("./1.st"));
  EXPECT_EQ(merged[0].names, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(merged[1].names, (std::vector<std::string>{"c", "d"}));
}

TEST(CheckpointFormatTest, ShardIndexFileNamesMayHoldBytesThatAreNotUtf8) {
  TempDir dir;
  // json.dumps(os.fsdecode(b"w\xff.st")): the byte 0xff as the escape \udcff. Tensor names are
  // text: the escape is refused there.
  const std::string path =
      WriteIndex(dir, R"({"weight_map": {"a": "w\udcff.st", "b": "\u00e9\udc80/x.st"}})");
  const std::vector<Shard> shards = ReadShardIndex(path);
  ASSERT_EQ(shards.size(), 2u);
  EXPECT_EQ(shards[0].path, dir.File("w\xff.st"));
  EXPECT_EQ(shards[1].path, dir.File("\xc3\xa9\x80/x.st"));
  EXPECT_NE(FormatErrorOf(WriteIndex(dir, R"({"weight_map": {"\udcff": "w.st"}})"))
                .find("lone low surrogate"),
            std::string::npos);
  EXPECT_NE(FormatErrorOf(WriteIndex(dir, R"({"weight_map": {"a": "../w\udcff.st"}})"))
                .find("outside the index's directory"),
            std::string::npos);
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
      {R"({"weight_map": {"a": "model.safetensors.index.json"}})", "is itself an index"},
      {R"({"weight_map": {"a": "sub/other.index.json"}})", "is itself an index"},
      {"{not json", "shard index JSON"},
  };
  for (const auto& [text, says] : cases) {
    const std::string message = FormatErrorOf(WriteIndex(dir, text));
    EXPECT_NE(message.find(says), std::string::npos) << text << " -> " << message;
  }
}

CheckpointKind KindOf(std::string_view bytes, std::string name = "m.bin") {
  return DetectCheckpointKind(MemorySource(bytes.data(), bytes.size(), std::move(name)));
}

std::string DetectErrorOf(std::string_view bytes) {
  try {
    KindOf(bytes);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(CheckpointFormatTest, DetectsKindByContent) {
  using std::string_literals::operator""s;
  EXPECT_EQ(KindOf("PK\x03\x04rest of a zip"s), CheckpointKind::kTorch);
  // An empty zip: its end record alone, 22 bytes. Built by resize, not operator+, which GCC 12's
  // -Warray-bounds misreads at -O2.
  std::string empty_zip = "PK\x05\x06"s;
  empty_zip.resize(22, '\0');
  EXPECT_EQ(KindOf(empty_zip), CheckpointKind::kTorch);
  EXPECT_EQ(KindOf("\x02\0\0\0\0\0\0\0{}"s), CheckpointKind::kSafetensors);
  // A header length whose bytes are '{' and spaces: byte 8 decides.
  EXPECT_EQ(KindOf("{   \0\0\0\0{\"a\":1}"s), CheckpointKind::kSafetensors);
  EXPECT_EQ(KindOf(" \n\t{\"weight_map\": {}}"s), CheckpointKind::kShardIndex);
  EXPECT_EQ(KindOf("{}"s), CheckpointKind::kShardIndex);
  // The name says index whatever the content (an index that is not JSON is diagnosed as one).
  EXPECT_EQ(KindOf("\x02\0\0\0\0\0\0\0{}"s, "m.index.json"), CheckpointKind::kShardIndex);
  // Neither, too short to tell, or named .safetensors: the safetensors parser diagnoses it
  // (too short, bad length...).
  EXPECT_EQ(KindOf("abc"s), CheckpointKind::kSafetensors);
  EXPECT_EQ(KindOf(std::string(20, ' '), "m.safetensors"), CheckpointKind::kSafetensors);
  EXPECT_EQ(KindOf("\x93NUMPY\x01\0v\0{'descr'"s, "d.pt.tmp.ST"), CheckpointKind::kSafetensors);
  // Named otherwise, another format: said so, with its first bytes.
  EXPECT_NE(DetectErrorOf("\x93NUMPY\x01\0v\0{'descr'"s)
                .find("m.bin: not a checkpoint: neither a torch.save zip nor a safetensors file "
                      "(its first bytes are 93 4e 55 4d 50 59 01 00)"),
            std::string::npos);
  EXPECT_NE(DetectErrorOf(std::string(20, ' ')).find("not a checkpoint"), std::string::npos);
  EXPECT_NE(DetectErrorOf("").find("m.bin: empty file (0 bytes)"), std::string::npos);
  EXPECT_NE(DetectErrorOf("\x80\x02}q\0"s).find("m.bin: legacy torch.save format"),
            std::string::npos);
  EXPECT_EQ(CheckpointKindName(CheckpointKind::kShardIndex), "index");
  EXPECT_EQ(CheckpointKindName(CheckpointKind::kTorch), "torch");
  EXPECT_EQ(CheckpointKindName(CheckpointKind::kSafetensors), "safetensors");
}

// The one table tensortier.load, save and convert read safetensors dtypes by.
TEST(CheckpointFormatTest, SafetensorsDtypesAsTorchHoldsThem) {
  std::map<std::string, std::pair<std::string, unsigned>> held;
  for (const TorchHeldDtype& d : SafetensorsDtypesForTorch()) {
    EXPECT_TRUE(TorchSupportsDtype(d.name)) << d.name;
    EXPECT_EQ(TorchDtypeBytes(d.name) * 8,
              SafetensorsDtypeBits(d.safetensors) * d.values_per_element)
        << d.safetensors;
    held[d.safetensors] = {std::string(d.torch), d.values_per_element};
  }
  EXPECT_EQ(held["F32"], std::make_pair(std::string("float32"), 1u));
  EXPECT_EQ(held["BF16"], std::make_pair(std::string("bfloat16"), 1u));
  EXPECT_EQ(held["F8_E8M0"], std::make_pair(std::string("float8_e8m0fnu"), 1u));
  EXPECT_EQ(held["F4"], std::make_pair(std::string("float4_e2m1fn_x2"), 2u));
  EXPECT_EQ(held.size(), 20u);  // safetensors' 22 less F6_E2M3 and F6_E3M2
  EXPECT_EQ(held.count("F6_E2M3"), 0u);
  EXPECT_EQ(TorchHeldDtypeOf("F4")->name, "F4_X2");
  EXPECT_EQ(TorchHeldDtypeOf("F6_E3M2"), std::nullopt);
  EXPECT_EQ(TorchHeldDtypeOf("nope"), std::nullopt);
}

}  // namespace
}  // namespace tensortier
