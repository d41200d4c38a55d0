// The torch pickle writer behind `tensortier convert` (safetensors -> torch.save zip): byte for
// byte what torch.save emits for a plain dict (tests/data/checkpoint/dict.pkl), read back by our
// restricted reader, and refusing what torch cannot hold. The CLI itself, end to end with torch,
// is tested in tests/python/test_cli_convert.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/util/strings.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"

namespace tensortier {
namespace {

std::string ReadFixture(const std::string& name) {
  std::filesystem::path path =
      std::filesystem::path(__FILE__).parent_path() / "../data/checkpoint" / name;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The tensors of make_fixtures.py's DICT_TENSORS, in order, with keys "0", "1"... as torch.save
// numbers storages.
std::vector<TorchPickleTensor> DictTensors() {
  std::vector<TorchPickleTensor> out = {
      {"f64", "F64", {2}, ""},
      {"f32", "F32", {4, 3}, ""},
      {"f16", "F16", {2, 3, 4, 5}, ""},
      {"bf16", "BF16", {3}, ""},
      {"i64", "I64", {}, ""},
      {"i32", "I32", {300}, ""},
      {"i16", "I16", {0, 3}, ""},
      {"i8", "I8", {70000}, ""},
      {"u8", "U8", {1}, ""},
      {"bool", "BOOL", {2, 2}, ""},
      {"c64", "C64", {1}, ""},
      {"c128", "C128", {1}, ""},
      {"u16", "U16", {2}, ""},
      {"u32", "U32", {3, 0, 2}, ""},
      {"u64", "U64", {1}, ""},
      {"f8_e4m3fn", "F8_E4M3", {2}, ""},
      {"f8_e5m2", "F8_E5M2", {2}, ""},
      {"f8_e4m3fnuz", "F8_E4M3FNUZ", {2}, ""},
      {"f8_e5m2fnuz", "F8_E5M2FNUZ", {2}, ""},
      {"f8_e8m0fnu", "F8_E8M0", {2}, ""},
      {"\xc3\xbcn\xc3\xaf"
       "code.weight",
       "F32",
       {1, 1, 1, 1, 1},
       ""},
  };
  for (uint64_t i = 0; i < 20; ++i) out.push_back({StrCat("extra.", i), "F32", {i + 1}, ""});
  for (size_t i = 0; i < out.size(); ++i) out[i].storage_key = std::to_string(i);
  return out;
}

std::vector<int64_t> ContiguousStride(const std::vector<uint64_t>& shape) {
  std::vector<int64_t> stride(shape.size());
  int64_t step = 1;
  for (size_t i = shape.size(); i > 0; --i) {
    stride[i - 1] = step;
    step *= shape[i - 1] == 0 ? 1 : static_cast<int64_t>(shape[i - 1]);
  }
  return stride;
}

// Parses `pickle` and checks every tensor against `want`.
void ExpectReadsBack(const std::string& pickle, const std::vector<TorchPickleTensor>& want) {
  TorchPickle p = ParseTorchPickle(pickle, "written.pkl");
  ASSERT_EQ(p.tensors.size(), want.size());
  EXPECT_EQ(p.storages.size(), want.size());
  EXPECT_EQ(p.other_values, 0u);
  for (size_t i = 0; i < want.size(); ++i) {
    const TorchTensor& t = p.tensors[i];
    const TorchPickleTensor& w = want[i];
    SCOPED_TRACE(w.name);
    EXPECT_EQ(t.path, w.name);
    EXPECT_EQ(t.dtype, w.dtype);
    EXPECT_EQ(std::vector<uint64_t>(t.shape.begin(), t.shape.end()), w.shape);
    EXPECT_EQ(t.stride, ContiguousStride(w.shape));
    EXPECT_TRUE(t.contiguous());
    EXPECT_EQ(t.storage_offset, 0);
    EXPECT_EQ(t.storage_key, w.storage_key);
    EXPECT_FALSE(t.requires_grad);
    EXPECT_FALSE(t.parameter);
    const TorchStorage& s = p.storages.at(w.storage_key);
    EXPECT_EQ(s.location, "cpu");
    EXPECT_EQ(s.nbytes, t.nbytes());  // each tensor fills its storage exactly
  }
}

TEST(CheckpointConvert, PickleIsWhatTorchSaveWrites) {
  std::string want = ReadFixture("dict.pkl");
  std::string got = SerializeTorchPickle(DictTensors());
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(static_cast<int>(static_cast<unsigned char>(got[i])),
              static_cast<int>(static_cast<unsigned char>(want[i])))
        << "first difference at byte " << i;
  }
}

TEST(CheckpointConvert, PickleReadsBack) {
  ExpectReadsBack(SerializeTorchPickle(DictTensors()), DictTensors());
}

TEST(CheckpointConvert, PickleOfEmptyAndSingleEntryDicts) {
  // No items: EMPTY_DICT alone; one item: SETITEM instead of MARK ... SETITEMS.
  std::string empty = SerializeTorchPickle({});
  EXPECT_EQ(empty, std::string("\x80\x02}q\x00.", 6));
  EXPECT_TRUE(ParseTorchPickle(empty).tensors.empty());
  std::vector<TorchPickleTensor> one = {{"w", "F32", {2, 3}, "0"}};
  std::string pickle = SerializeTorchPickle(one);
  EXPECT_EQ(pickle.substr(pickle.size() - 2), "s.");
  ExpectReadsBack(pickle, one);
}

TEST(CheckpointConvert, PickleOfManyAndHugeTensors) {
  // Past pickle's batches of 1000 items and 256 memo slots; sizes and strides beyond 32 bits
  // (LONG1), and zero-element tensors whose strides count empty dimensions as 1.
  std::vector<TorchPickleTensor> tensors;
  for (size_t i = 0; i < 2500; ++i) {
    tensors.push_back({StrCat("layer.", i), i % 2 ? "BF16" : "U32", {i % 4, 3}, StrCat(i)});
  }
  tensors.push_back({"huge", "F8_E5M2", {1ull << 40}, "huge"});
  tensors.push_back({"wide", "I64", {0, 1ull << 33, 3}, "wide"});
  tensors.push_back({"big_u64", "U64", {1ull << 59}, "big_u64"});  // 2^62 bytes
  std::string pickle = SerializeTorchPickle(tensors);
  ExpectReadsBack(pickle, tensors);
  TorchPickle p = ParseTorchPickle(pickle);
  EXPECT_EQ(p.storages.at("huge").nbytes, 1ull << 40);
  EXPECT_EQ(p.storages.at("big_u64").nbytes, 1ull << 62);
  EXPECT_EQ(p.tensors[2501].stride, (std::vector<int64_t>{3ll << 33, 3, 1}));
}

void ExpectRefused(const std::vector<TorchPickleTensor>& tensors, const std::string& needle) {
  try {
    SerializeTorchPickle(tensors);
    ADD_FAILURE() << "accepted (wanted '" << needle << "')";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' lacks '" << needle << "'";
  }
}

TEST(CheckpointConvert, PickleRefusesWhatTorchCannotHold) {
  // Every safetensors dtype torch has a dtype for is accepted; the sub-byte ones are not.
  for (const char* dtype : {"F4", "F6_E2M3", "F6_E3M2"}) {
    ASSERT_NE(SafetensorsDtypeBits(dtype), 0u);
    EXPECT_FALSE(TorchSupportsDtype(dtype));
    ExpectRefused({{"ok", "F32", {1}, "0"}, {"packed.weight", dtype, {4}, "1"}},
                  StrCat("tensor 'packed.weight' has dtype ", dtype));
  }
  for (const char* dtype :
       {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16",
        "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"}) {
    EXPECT_TRUE(TorchSupportsDtype(dtype)) << dtype;
  }
  ExpectRefused({{"x", "Q7", {1}, "0"}}, "tensor 'x' has dtype Q7");
  ExpectRefused({{"x", "F32", {1}, "0"}, {"x", "F32", {1}, "1"}}, "tensor 'x' appears twice");
  ExpectRefused({{"x", "F32", {1}, "0"}, {"y", "F32", {1}, "0"}}, "storage key '0' used twice");
  ExpectRefused({{"x", "F32", {1}, "../0"}}, "not a plain name");
  ExpectRefused({{"x", "F32", {1}, ""}}, "not a plain name");
  ExpectRefused({{"x", "F32", {1ull << 62, 4}, "0"}}, "tensor 'x': shape too large");
  ExpectRefused({{"x", "F64", {1ull << 61}, "0"}}, "tensor 'x': too many bytes");
  ExpectRefused({{std::string("bad\xff", 4), "F32", {1}, "0"}}, "not valid UTF-8");
}

}  // namespace
}  // namespace tensortier
