// The safetensors header parser, writer and file reader: every bad-header case gives a
// FormatError naming the problem; writer output parses back to its input and is aligned.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/util/strings.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

// 8-byte length + header + `data_bytes` zero bytes.
std::string MakeFile(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + std::string(data_bytes, '\0');
}

SafetensorsFileInfo ReadBytes(const std::string& bytes) {
  return ReadSafetensorsHeader(MemorySource(bytes.data(), bytes.size(), "mem.safetensors"));
}

// Success iff parsing `header` throws FormatError whose message contains `needle`.
::testing::AssertionResult Rejects(const std::string& header, uint64_t data_bytes,
                                   const std::string& needle) {
  try {
    ParseSafetensorsHeader(header, data_bytes);
  } catch (const FormatError& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "message '" << e.what() << "' lacks '" << needle << "'";
  }
  return ::testing::AssertionFailure() << "accepted: " << header;
}

const std::string kTwo = R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
                         R"("a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},)"
                         R"("__metadata__":{"format":"pt"}})";

TEST(CheckpointSafetensors, ParsesEntriesSortedByOffset) {
  SafetensorsHeader h = ParseSafetensorsHeader(kTwo, 16);
  ASSERT_EQ(h.entries.size(), 2u);
  EXPECT_EQ(h.entries[0].name, "a");
  EXPECT_EQ(h.entries[0].dtype, "BF16");
  EXPECT_EQ(h.entries[0].shape, (std::vector<uint64_t>{2, 2}));
  EXPECT_EQ(h.entries[0].begin, 0u);
  EXPECT_EQ(h.entries[0].end, 8u);
  EXPECT_EQ(h.entries[1].name, "b");
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

TEST(CheckpointSafetensors, AcceptsEmptyHeaderScalarsZeroSizeAndSubByteTypes) {
  EXPECT_TRUE(ParseSafetensorsHeader("{}", 0).entries.empty());
  EXPECT_TRUE(ParseSafetensorsHeader("{}    ", 0).entries.empty());
  EXPECT_TRUE(ParseSafetensorsHeader(R"({"__metadata__":null})", 0).metadata.empty());
  auto h = ParseSafetensorsHeader(R"({"s":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
                                  R"("z":{"dtype":"F16","shape":[0,5],"data_offsets":[8,8]},)"
                                  R"("q":{"dtype":"F4","shape":[3,2],"data_offsets":[8,11]}})",
                                  11);
  ASSERT_EQ(h.entries.size(), 3u);
  EXPECT_EQ(h.entries[0].name, "s");
  EXPECT_TRUE(h.entries[0].shape.empty());
}

TEST(CheckpointSafetensors, DecodesEscapesAndUtf8) {
  auto h = ParseSafetensorsHeader(
      R"({"a\"\\\/\n\u00e9\ud83d\ude00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1);
  EXPECT_EQ(h.entries[0].name, "a\"\\/\n\xC3\xA9\xF0\x9F\x98\x80");
}

// JSON's whitespace before the object, which the safetensors package reads (transformers then
// loads the shard).
TEST(CheckpointSafetensors, ReadsWhitespaceBeforeTheHeader) {
  const auto h = ParseSafetensorsHeader(
      " \t\r\n{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1);
  ASSERT_EQ(h.entries.size(), 1u);
  EXPECT_EQ(h.entries[0].name, "a");
}

TEST(CheckpointSafetensors, RejectsMalformedJson) {
  EXPECT_TRUE(Rejects("", 0, "does not start with '{'"));
  EXPECT_TRUE(Rejects(" ", 0, "does not start with '{'"));
  EXPECT_TRUE(Rejects(" x{}", 0, "does not start with '{'"));
  EXPECT_TRUE(Rejects("\v{}", 0, "does not start with '{'"));  // not JSON's whitespace
  EXPECT_TRUE(Rejects("{", 0, "expected a string"));
  EXPECT_TRUE(Rejects("{}x", 0, "unexpected text after"));
  EXPECT_TRUE(Rejects("{}{}", 0, "unexpected text after"));
  EXPECT_TRUE(
      Rejects(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},})", 1, "expected a string"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1,],"data_offsets":[0,1]}})", 1,
                      "non-negative integer"));
  EXPECT_TRUE(Rejects(R"({"a)", 0, "unterminated string"));
  EXPECT_TRUE(Rejects("{\"a\x01\":1}", 0, "control character"));
  EXPECT_TRUE(Rejects("{\"a\xFF\":1}", 0, "invalid UTF-8"));
  EXPECT_TRUE(Rejects("{\"a\xC0\x80\":1}", 0, "invalid UTF-8"));      // overlong
  EXPECT_TRUE(Rejects("{\"a\xED\xA0\x80\":1}", 0, "invalid UTF-8"));  // surrogate
  EXPECT_TRUE(Rejects(R"({"\ud800":1})", 0, "lone high surrogate"));
  EXPECT_TRUE(Rejects(R"({"\udc00":1})", 0, "lone low surrogate"));
  EXPECT_TRUE(Rejects(R"({"\x":1})", 0, "invalid escape"));
  EXPECT_TRUE(Rejects(R"({"\u12":1})", 0, "4 hex digits"));
  EXPECT_TRUE(
      Rejects(R"({"a":{"dtype":"U8","shape":[01],"data_offsets":[0,1]}})", 1, "leading zero"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}})", 1,
                      "fraction or exponent"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1,
                      "non-negative integer"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,18446744073709551616]}})",
                      1, "does not fit in 64 bits"));
  EXPECT_TRUE(Rejects(R"({"a":[]})", 0, "is not an object"));
}

// Fields other writers add are passed over, as the safetensors package does (its TensorInfo
// ignores them), whatever their JSON value; a malformed value is still an error.
TEST(CheckpointSafetensors, PassesOverOtherFieldsOfATensor) {
  SafetensorsHeader h = ParseSafetensorsHeader(
      R"({"a":{"x":1,"dtype":"U8","y":{"k":[1,-2.5e+3,true,false,null,"s",{},[]]},)"
      R"("shape":[1],"z":[[[]]],"data_offsets":[0,1],"w":"é"}})",
      1);
  ASSERT_EQ(h.entries.size(), 1u);
  EXPECT_EQ(h.entries[0].dtype, "U8");
  EXPECT_EQ(h.entries[0].end, 1u);
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":01}})", 1,
                      "leading zero"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":tru}})", 1,
                      "invalid literal"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":[1,]}})", 1,
                      "expected a number"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":{1:2}}})", 1,
                      "expected a string key"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":[1}})", 1,
                      "expected ']'"));
  // Nesting is bounded (and walked without recursion).
  std::string deep =
      std::string(JsonReader::kMaxSkipDepth, '[') + std::string(JsonReader::kMaxSkipDepth, ']');
  EXPECT_EQ(
      ParseSafetensorsHeader(
          StrCat(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":)", deep, "}}"), 1)
          .entries.size(),
      1u);
  EXPECT_TRUE(
      Rejects(StrCat(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":[)", deep, "]}}"),
              1, "nested too deep"));
}

TEST(CheckpointSafetensors, RejectsDuplicates) {
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                      R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                      2, "duplicate tensor name \"a\""));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1,
                      "duplicate field \"dtype\""));
  EXPECT_TRUE(Rejects(R"({"__metadata__":{},"__metadata__":{}})", 0, "duplicate __metadata__"));
  EXPECT_TRUE(Rejects(R"({"__metadata__":{"k":"a","k":"b"}})", 0, "duplicate __metadata__ key"));
  EXPECT_TRUE(Rejects(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", 1, "missing dtype"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", 1, "missing shape"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1]}})", 1, "missing data_offsets"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", 1,
                      "must be [begin, end]"));
}

TEST(CheckpointSafetensors, RejectsNonStringMetadata) {
  EXPECT_TRUE(Rejects(R"({"__metadata__":{"k":1}})", 0, "value of \"k\" is not a string"));
  EXPECT_TRUE(Rejects(R"({"__metadata__":{"k":{"x":"y"}}})", 0, "is not a string"));
  EXPECT_TRUE(Rejects(R"({"__metadata__":[]})", 0, "must be an object of strings"));
  EXPECT_TRUE(Rejects(R"({"__metadata__":"x"})", 0, "must be an object of strings"));
}

TEST(CheckpointSafetensors, RejectsUnknownDtypeAndShapeSizeMismatch) {
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", 16,
                      "tensor \"a\": unknown dtype \"F128\""));
  EXPECT_TRUE(
      Rejects(R"({"a":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", 4, "unknown dtype"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20,
                      "need 24 bytes but data_offsets [0, 20] hold 20"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2,
                      "not a whole byte count"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],)"
                      R"("data_offsets":[0,8]}})",
                      8, "overflows"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"F64","shape":[2305843009213693952],)"
                      R"("data_offsets":[0,8]}})",
                      8, "overflows"));
  std::string deep = R"({"a":{"dtype":"U8","shape":[)";
  for (int i = 0; i < 65; ++i) deep += "1,";
  deep += R"(1],"data_offsets":[0,1]}})";
  EXPECT_TRUE(Rejects(deep, 1, "more than 64 dimensions"));
}

TEST(CheckpointSafetensors, RejectsBadOffsets) {
  EXPECT_TRUE(
      Rejects(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", 4, "begin > end"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                      6, "tensor \"b\": data_offsets [2, 6] overlap tensor \"a\""));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                      4, "overlap"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
                      10, "gap before"));
  EXPECT_TRUE(Rejects(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 3,
                      "past the end of the data section (3 bytes)"));
  EXPECT_TRUE(
      Rejects(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 5, "trailing bytes"));
}

TEST(CheckpointSafetensors, WriterRoundTripsAndAligns) {
  std::vector<SafetensorsEntry> entries = {
      {"w \"quoted\"\n\xC3\xA9", "F32", {2, 3}, 0, 24},
      {"b", "BF16", {3}, 24, 30},
      {"scalar", "I64", {}, 30, 38},
      {"empty", "U8", {0}, 38, 38},
  };
  SafetensorsMetadata md = {{"format", "pt"}, {"ctl\x01", "tab\tquote\"back\\"}};
  for (uint64_t alignment : {8u, 64u, 4096u, 65536u}) {
    std::string bytes = SerializeSafetensorsHeader(entries, md, alignment);
    EXPECT_EQ(bytes.size() % alignment, 0u) << alignment;
    std::string file = bytes + std::string(38, '\0');
    SafetensorsFileInfo info = ReadBytes(file);
    EXPECT_EQ(info.data_start, bytes.size());
    EXPECT_EQ(info.header.metadata, md);
    ASSERT_EQ(info.header.entries.size(), entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      EXPECT_EQ(info.header.entries[i].name, entries[i].name);
      EXPECT_EQ(info.header.entries[i].dtype, entries[i].dtype);
      EXPECT_EQ(info.header.entries[i].shape, entries[i].shape);
      EXPECT_EQ(info.header.entries[i].begin, entries[i].begin);
      EXPECT_EQ(info.header.entries[i].end, entries[i].end);
    }
  }
  EXPECT_EQ(SerializeSafetensorsHeader({}, {}, 8), MakeFile("{}      ", 0));
}

TEST(CheckpointSafetensors, HeaderDigestCoversWhatTheHeaderSaysAndNothingElse) {
  const std::vector<SafetensorsEntry> entries = {{"w", "F32", {2, 3}, 0, 24},
                                                 {"b", "BF16", {3}, 24, 30}};
  const SafetensorsMetadata md = {{"format", "pt"}};
  const uint64_t base = SafetensorsHeaderDigest(entries, md);
  // Entry order, the checksum keys and JSON layout (padding) do not count.
  EXPECT_EQ(SafetensorsHeaderDigest({entries[1], entries[0]}, md), base);
  SafetensorsMetadata with_sums = md;
  with_sums[kTensorChecksumsKey] = "{\"w\":\"0123456789abcdef\"}";
  with_sums[kHeaderChecksumKey] = "0000000000000000";
  EXPECT_EQ(SafetensorsHeaderDigest(entries, with_sums), base);
  const std::string padded = SerializeSafetensorsHeader(entries, with_sums, 65536);
  SafetensorsFileInfo info = ReadBytes(padded + std::string(30, '\0'));
  EXPECT_EQ(SafetensorsHeaderDigest(info.header.entries, info.header.metadata), base);
  // Every field does.
  auto changed = [&](auto edit) {
    std::vector<SafetensorsEntry> e = entries;
    SafetensorsMetadata m = md;
    edit(e, m);
    return SafetensorsHeaderDigest(e, m);
  };
  using E = std::vector<SafetensorsEntry>;
  using M = SafetensorsMetadata;
  EXPECT_NE(changed([](E& e, M&) { e[0].shape = {3, 2}; }), base);
  EXPECT_NE(changed([](E& e, M&) { e[0].shape = {6}; }), base);
  EXPECT_NE(changed([](E& e, M&) { e[1].dtype = "F16"; }), base);
  EXPECT_NE(changed([](E& e, M&) { e[1].name = "c"; }), base);
  EXPECT_NE(changed([](E& e, M&) {
              std::swap(e[0].begin, e[1].begin);
              e[1].end = 6;
              e[0].begin = 6;
              e[0].end = 30;
            }),
            base);
  EXPECT_NE(changed([](E&, M& m) { m["format"] = "np"; }), base);
  EXPECT_NE(changed([](E&, M& m) { m["extra"] = ""; }), base);
  // Length prefixes: moving a character between adjacent fields changes the digest.
  EXPECT_NE(SafetensorsHeaderDigest({}, {{"ab", "c"}}), SafetensorsHeaderDigest({}, {{"a", "bc"}}));
}

TEST(CheckpointSafetensors, WriterRejectsWhatTheParserWould) {
  EXPECT_THROW(SerializeSafetensorsHeader({{"a", "F33", {1}, 0, 4}}, {}), FormatError);
  EXPECT_THROW(SerializeSafetensorsHeader({{"a", "F32", {2}, 0, 4}}, {}), FormatError);
  EXPECT_THROW(SerializeSafetensorsHeader({{"a", "U8", {4}, 0, 4}, {"b", "U8", {4}, 2, 6}}, {}),
               FormatError);
  EXPECT_THROW(SerializeSafetensorsHeader({{"__metadata__", "U8", {1}, 0, 1}}, {}), FormatError);
  EXPECT_THROW(SerializeSafetensorsHeader({{"bad\xFF", "U8", {1}, 0, 1}}, {}),
               std::invalid_argument);
  EXPECT_THROW(SerializeSafetensorsHeader({}, {}, 100), std::invalid_argument);
  EXPECT_THROW(SerializeSafetensorsHeader({}, {}, 4), std::invalid_argument);
}

// The rule load(verify=True), verify and convert share: every tensor has a checksum of 16 hex
// digits, and every checksum names a tensor of the file.
TEST(CheckpointSafetensors, TensorChecksumsBelongToTheFile) {
  const std::string a = "00000000000000aB", b = "0123456789abcdef";
  TensorChecksums ok =
      ReadTensorChecksums(R"({"a":")" + a + R"(","b":")" + b + R"("})", {"b", "a"});
  EXPECT_TRUE(ok.problems.empty());
  ASSERT_EQ(ok.want.size(), 2u);
  EXPECT_EQ(ok.want[0], 0x0123456789abcdefu);
  EXPECT_EQ(ok.want[1], 0xabu);

  TensorChecksums other =
      ReadTensorChecksums(R"({"a":")" + a + R"(","z":")" + b + R"(","y":"1"})", {"a", "b"});
  ASSERT_EQ(other.problems.size(), 3u);
  EXPECT_EQ(other.problems[0].rfind("checksum for unknown tensor 'y'", 0), 0u) << other.problems[0];
  EXPECT_EQ(other.problems[1].rfind("checksum for unknown tensor 'z'", 0), 0u) << other.problems[1];
  EXPECT_EQ(other.problems[2], "tensor 'b' has no checksum");
  EXPECT_EQ(other.want[0], 0xabu);
  EXPECT_EQ(other.want[1], std::nullopt);

  TensorChecksums bad = ReadTensorChecksums(R"({"a":"0xab"})", {"a"});
  ASSERT_EQ(bad.problems.size(), 1u);
  EXPECT_EQ(bad.problems[0], "tensor 'a': checksum '0xab' is not 16 hex digits");
  EXPECT_EQ(bad.want[0], std::nullopt);

  EXPECT_TRUE(ReadTensorChecksums("{}", {}).problems.empty());  // a file without tensors
  EXPECT_EQ(ReadTensorChecksums(R"({"a":")" + a + R"("})", {}).problems.size(), 1u);
  EXPECT_THROW(ReadTensorChecksums(R"({"a":")" + a + R"(","a":")" + a + R"("})", {"a"}),
               FormatError);
  EXPECT_THROW(ReadTensorChecksums("[1]", {"a"}), FormatError);
}

TEST(CheckpointSafetensors, RejectsTruncatedAndOversizedFiles) {
  auto expect_error = [](const std::string& bytes, const std::string& needle) {
    try {
      ReadBytes(bytes);
      ADD_FAILURE() << "accepted a bad file (wanted '" << needle << "')";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("mem.safetensors"), std::string::npos) << e.what();
    }
  };
  expect_error("", "shorter than the 8-byte header length");
  expect_error(std::string(7, '\0'), "shorter than the 8-byte header length");
  std::string good = MakeFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 4);
  expect_error(good.substr(0, 20), "larger than the rest of the file");
  expect_error(good.substr(0, good.size() - 1), "past the end of the data section");
  std::string huge(8, '\0');
  huge[4] = 1;  // 2^32 bytes
  expect_error(huge + "{}", "larger than the limit");
  std::string lie = good;
  lie[0] = static_cast<char>(lie[0] + 4);  // length covers part of the data
  expect_error(lie, "unexpected text after");
  EXPECT_NO_THROW(ReadBytes(good));
}

TEST(CheckpointSafetensors, ReadsFilesAndReportsIoErrors) {
  testing::TempDir dir;
  std::string path = dir.File("t.safetensors");
  std::string bytes = SerializeSafetensorsHeader({{"x", "I32", {3}, 0, 12}}, {{"k", "v"}}) +
                      std::string(12, '\x07');
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  SafetensorsFileInfo info = ReadSafetensorsHeader(path);
  EXPECT_EQ(info.data_start, 4096u);
  EXPECT_EQ(info.file_size, 4096u + 12);
  EXPECT_EQ(info.header.entries.at(0).name, "x");
  EXPECT_THROW(ReadSafetensorsHeader(dir.File("missing")), IoError);
  std::filesystem::resize_file(path, 4000);
  EXPECT_THROW(ReadSafetensorsHeader(path), FormatError);
}

// Files written by the safetensors package (tests/data/checkpoint, made by make_fixtures.py).
TEST(CheckpointSafetensors, ParsesFilesWrittenBySafetensors) {
  auto dir = std::filesystem::path(__FILE__).parent_path() / "../data/checkpoint";
  SafetensorsFileInfo info = ReadSafetensorsHeader((dir / "small.safetensors").string());
  EXPECT_EQ(info.header.metadata.at("source"), "make_fixtures.py");
  std::map<std::string, std::string> dtypes;
  for (const auto& e : info.header.entries) dtypes[e.name] = e.dtype;
  EXPECT_EQ(dtypes.at("layer.weight"), "F32");
  EXPECT_EQ(dtypes.at("layer.bias"), "BF16");
  EXPECT_EQ(dtypes.at("step"), "I64");
  EXPECT_EQ(dtypes.at("mask"), "BOOL");
  EXPECT_EQ(dtypes.at("empty"), "F16");
}

}  // namespace
}  // namespace tensortier
