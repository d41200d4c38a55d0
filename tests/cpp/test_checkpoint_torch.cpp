// The restricted torch pickle reader and the torch.save zip reader: real files from torch.save,
// and hand-made pickles for every refusal (disallowed globals, cycles, truncation, bad tensors).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/checkpoint/zip_writer.hpp"
#include "tensortier/util/format_error.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using namespace std::string_literals;  // pickles hold NUL bytes

std::string TorchFixture(const std::string& name) {
  return (std::filesystem::path(__FILE__).parent_path() / "../data/checkpoint" / name).string();
}

TorchCheckpoint ReadTorchFixture(const std::string& name) {
  return ReadTorchCheckpoint(FileSource(File::Open(TorchFixture(name), OpenMode::kRead, false)));
}

::testing::AssertionResult PickleRejects(const std::string& pickle, const std::string& needle) {
  try {
    ParseTorchPickle(pickle, "test.pkl");
  } catch (const FormatError& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "message '" << e.what() << "' lacks '" << needle << "'";
  }
  return ::testing::AssertionFailure() << "accepted (wanted '" << needle << "')";
}

const TorchTensor& Get(const TorchPickle& p, const std::string& path) {
  for (const auto& t : p.tensors) {
    if (t.path == path) return t;
  }
  throw std::runtime_error("no tensor " + path);
}

TEST(CheckpointTorch, ReadsTorchSaveFile) {
  TorchCheckpoint c = ReadTorchFixture("small.pt");
  EXPECT_EQ(c.prefix, "small");
  // The CRC-32 of the data.pkl bytes read, which torch.save recorded (nonzero).
  EXPECT_EQ(c.pickle_crc32, c.zip.Find("small/data.pkl")->crc32);
  EXPECT_NE(c.pickle_crc32, 0u);
  const TorchPickle& p = c.pickle;
  ASSERT_EQ(p.tensors.size(), 7u);
  const TorchTensor& w = Get(p, "model.layer.weight");
  EXPECT_EQ(w.dtype, "F32");
  EXPECT_EQ(w.shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(w.stride, (std::vector<int64_t>{3, 1}));
  EXPECT_TRUE(w.contiguous());
  EXPECT_EQ(Get(p, "model.layer.bias").dtype, "BF16");
  EXPECT_EQ(Get(p, "model.mask").dtype, "BOOL");
  const TorchTensor& base = Get(p, "shared.base");
  const TorchTensor& view = Get(p, "shared.view");
  EXPECT_EQ(base.storage_key, view.storage_key);
  EXPECT_EQ(view.storage_offset, 4);
  EXPECT_EQ(view.shape, (std::vector<int64_t>{2, 3}));
  const TorchTensor& param = Get(p, "param");
  EXPECT_TRUE(param.parameter);
  EXPECT_TRUE(param.requires_grad);
  EXPECT_EQ(param.dtype, "F64");
  EXPECT_EQ(Get(p, "list.4").dtype, "I32");
  EXPECT_EQ(p.other_values, 8u);  // step, lr, name, 1, 2, 3, None, True
  EXPECT_EQ(p.storages.size(), 6u);
  const TorchStorage& s = p.storages.at(base.storage_key);
  EXPECT_EQ(s.nbytes, 48u);
  EXPECT_EQ(s.location, "cpu");
  EXPECT_EQ(s.data_offset % 64, 0u);
}

TEST(CheckpointTorch, RefusesDisallowedGlobalsInAFile) {
  try {
    ReadTorchFixture("evil.pt");
    ADD_FAILURE() << "accepted a pickle calling os.system";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("global 'posix.system' is not allowed"), std::string::npos)
        << e.what();
  }
}

// torch.save(model.state_dict()): state_dict() sets OrderedDict._metadata, which the pickle
// restores with BUILD. It is an attribute, not an item: no tensor and no value of it is listed.
TEST(CheckpointTorch, ReadsStateDictsWithMetadata) {
  TorchCheckpoint c = ReadTorchFixture("state_dict.pt");
  const TorchPickle& p = c.pickle;
  ASSERT_EQ(p.tensors.size(), 9u);
  EXPECT_EQ(p.tensors[0].path, "0.weight");
  EXPECT_EQ(p.tensors[0].shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(Get(p, "1.num_batches_tracked").dtype, "I64");
  EXPECT_EQ(p.tensors[8].path, "2.bias");
  EXPECT_EQ(p.other_values, 0u);

  TorchCheckpoint t = ReadTorchFixture("train_state.pt");
  ASSERT_EQ(t.pickle.tensors.size(), 9u + 18u);
  EXPECT_EQ(t.pickle.tensors[0].path, "model.0.weight");
  EXPECT_EQ(Get(t.pickle, "optimizer.state.5.exp_avg_sq").shape, (std::vector<int64_t>{2}));
  for (const auto& tensor : t.pickle.tensors) {
    EXPECT_EQ(tensor.path.find("_metadata"), std::string::npos) << tensor.path;
  }
  // step, and param_groups' 13 Adam options, its params list's 6 ints.
  EXPECT_GT(t.pickle.other_values, 6u);
}

TEST(CheckpointTorch, RefusesLegacyCompressedAndNonTorchFiles) {
  try {
    ReadTorchFixture("legacy.pt");
    ADD_FAILURE();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("legacy torch.save format"), std::string::npos);
  }
  try {
    ReadTorchFixture("deflated.zip");
    ADD_FAILURE();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("is compressed"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ReadTorchFixture("small.safetensors"), FormatError);
}

TEST(CheckpointTorch, RefusesMissingAndShortStorageEntries) {
  std::vector<uint8_t> bytes = testing::ReadWholeFile(TorchFixture("small.pt"));
  std::string s(bytes.begin(), bytes.end());
  // Rename every "small/data/3" (local and central) so the storage's entry is missing.
  for (size_t pos = 0; (pos = s.find("small/data/3", pos)) != std::string::npos; ++pos) {
    s[pos + 11] = '9';
  }
  try {
    ReadTorchCheckpoint(MemorySource(s.data(), s.size(), "renamed.pt"));
    ADD_FAILURE();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("missing entry 'small/data/3'"), std::string::npos)
        << e.what();
  }
}

// Protocol 2 pickles written by hand: "\x80\x02" ... "."
const std::string kProto = "\x80\x02"s;

TEST(CheckpointTorch, ParsesPlainContainers) {
  // {'a': [1, -2, 3.5, None, True], 'b': (b'x',)} with a BINPUT/BINGET pair.
  std::string p = kProto +
                  "}q\x00(X\x01\x00\x00\x00"s
                  "a]q\x01(K\x01J\xfe\xff\xff\xff" +
                  "G\x40\x0c\x00\x00\x00\x00\x00\x00"s +
                  "N\x88"
                  "eX\x01\x00\x00\x00"s
                  "bC\x01x\x85u.";
  TorchPickle r = ParseTorchPickle(p);
  EXPECT_TRUE(r.tensors.empty());
  EXPECT_EQ(r.other_values, 6u);
}

TEST(CheckpointTorch, RefusesDisallowedGlobalsAndCalls) {
  EXPECT_TRUE(PickleRejects(kProto + "cposix\nsystem\n.", "global 'posix.system' is not allowed"));
  EXPECT_TRUE(
      PickleRejects(kProto + "c__builtin__\neval\n.", "global '__builtin__.eval' is not allowed"));
  EXPECT_TRUE(PickleRejects(kProto + "cbuiltins\ngetattr\n.", "not allowed"));
  EXPECT_TRUE(PickleRejects(kProto + "ctorch\nload\n.", "global 'torch.load' is not allowed"));
  EXPECT_TRUE(PickleRejects(kProto + "ctorch._utils\n_rebuild_sparse_tensor\n.", "not allowed"));
  EXPECT_TRUE(PickleRejects(kProto + "ctorch\nfloat32\n)R.", "'torch.float32' cannot be called"));
  // Quantization schemes are values (torch.load allows them), not callables.
  EXPECT_EQ(ParseTorchPickle(kProto + "ctorch\nper_channel_affine\n.").other_values, 1u);
  EXPECT_TRUE(PickleRejects(kProto + "ctorch\nper_tensor_affine\n)R.", "cannot be called"));
  EXPECT_TRUE(PickleRejects(kProto + "ctorch\nper_tensor_nothing\n.", "is not allowed"));
  EXPECT_TRUE(PickleRejects(kProto + "X\x02\x00\x00\x00osX\x06\x00\x00\x00system\x93."s,
                            "global 'os.system' is not allowed"));
  // _rebuild_from_type_v2(func, type, args, state) calls only rebuild functions, never itself
  // (unbounded recursion), and rebuilds only Tensors and Parameters.
  const std::string from_type = "ctorch._tensor\n_rebuild_from_type_v2\n";
  EXPECT_TRUE(PickleRejects(kProto + from_type + "(" + from_type + "ctorch\nTensor\n)}tR.",
                            "not a rebuild function"));
  EXPECT_TRUE(PickleRejects(
      kProto + from_type + "(ctorch._utils\n_rebuild_tensor_v2\nctorch\nFloatStorage\n)}tR.",
      "tensor type 'torch.FloatStorage' is not supported"));
  EXPECT_TRUE(PickleRejects(kProto + from_type + "(ctorch\nSize\nctorch\nTensor\n)}tR.",
                            "wrong number of arguments to torch.Size"));
  EXPECT_TRUE(PickleRejects(kProto + "ccollections\nCounter\n(K\x01tR."s, "Counter argument"));
}

TEST(CheckpointTorch, RefusesMalformedPickles) {
  EXPECT_TRUE(PickleRejects("", "truncated"));
  EXPECT_TRUE(PickleRejects(kProto, "truncated"));
  EXPECT_TRUE(PickleRejects(kProto + "X\xff\xff\xff\x7f"
                                     "abc",
                            "truncated"));
  EXPECT_TRUE(PickleRejects(kProto + "a.", "stack underflow"));
  EXPECT_TRUE(PickleRejects(kProto + "(K\x01u.", "odd number"));
  EXPECT_TRUE(PickleRejects(kProto + "h\x05.", "memo key 5 was never set"));
  EXPECT_TRUE(PickleRejects(kProto + "K\x01K\x02.", "STOP with a malformed stack"));
  EXPECT_TRUE(PickleRejects(kProto + "o.", "unsupported pickle opcode 0x6f"));
  EXPECT_TRUE(PickleRejects(kProto + "c\n.", "bad GLOBAL operand"));
  EXPECT_TRUE(PickleRejects(kProto + "K\x00K\x01K\x02s."s, "not a dict"));
  EXPECT_TRUE(PickleRejects(kProto + "K\x01Q.", "persistent id is not"));
}

// A FRAME's bytes must follow it (pickle and torch.load refuse a longer one): a frame claiming
// 2^62 bytes in front of a small valid pickle was read as that pickle.
TEST(CheckpointTorch, RefusesAFrameLongerThanTheRestOfThePickle) {
  const std::string body = "}q\x00."s;  // {}: 4 bytes after the frame header
  auto framed = [&](uint64_t length) {
    std::string p = "\x80\x04\x95"s;
    for (int i = 0; i < 8; ++i) p += static_cast<char>((length >> (8 * i)) & 0xFF);
    return p + body;
  };
  EXPECT_TRUE(PickleRejects(framed(1ull << 62),
                            "FRAME of 4611686018427387904 bytes is longer than the 4 bytes left"));
  EXPECT_TRUE(PickleRejects(framed(5), "FRAME of 5 bytes is longer than the 4 bytes left"));
  EXPECT_TRUE(PickleRejects(framed(~0ull), "longer than the 4 bytes left"));
  EXPECT_EQ(ParseTorchPickle(framed(4)).other_values, 0u);  // exactly the rest: as pickle writes
  EXPECT_EQ(ParseTorchPickle(framed(0)).other_values, 0u);
}

// Python's unpickler decodes pickled strings as UTF-8 ("surrogatepass"): torch.load refuses a
// file holding other bytes in one, and so does this reader, naming where.
TEST(CheckpointTorch, RefusesStringsThatAreNotUtf8) {
  EXPECT_TRUE(PickleRejects(kProto + "}X\x01\x00\x00\x00\x92K\x01s."s,
                            "test.pkl: at byte 3: string is not valid UTF-8"));
  EXPECT_TRUE(PickleRejects(kProto + "\x8c\x02\xc3\x28."s, "string is not valid UTF-8"));
  EXPECT_TRUE(PickleRejects(kProto + "\x8c\x02\xc0\x80."s, "string is not valid UTF-8"));
  // A lone surrogate, as Python pickles "\ud800"; and bytes (C) are not text.
  EXPECT_NO_THROW(ParseTorchPickle(kProto + "\x8c\x03\xed\xa0\x80."s));
  EXPECT_NO_THROW(ParseTorchPickle(kProto + "C\x01\x92."s));
}

TEST(CheckpointTorch, RefusesCyclesAndDeepNesting) {
  // l = []; l.append(l)
  EXPECT_TRUE(PickleRejects(kProto + "]q\x00h\x00"s
                                     "a.",
                            "contains itself"));
  std::string deep = kProto;
  for (int i = 0; i < 300; ++i) deep += "]q\x00"s;
  for (int i = 0; i < 299; ++i) deep += "a";
  deep += ".";
  EXPECT_TRUE(PickleRejects(deep, "nesting deeper than 256"));
  // A million MARKs never reach the end: bounded, with a clear error.
  EXPECT_TRUE(PickleRejects(kProto + std::string(100000, '('), "too many nested MARKs"));
}

// ('storage', torch.FloatStorage, '0', 'cpu', numel) rebuilt as a tensor of `size`/`stride`.
std::string TensorPickle(int numel, int offset, int size, int stride) {
  std::string p = kProto + "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"s +
                  "ctorch\nFloatStorage\nX\x01\x00\x00\x00"s
                  "0X\x03\x00\x00\x00"s
                  "cpuK" +
                  static_cast<char>(numel) + "tQK" + static_cast<char>(offset) + "K" +
                  static_cast<char>(size) + "\x85K" + static_cast<char>(stride) +
                  "\x85\x89"
                  "ccollections\nOrderedDict\n)RtR.";
  return p;
}

TEST(CheckpointTorch, ChecksTensorsAgainstTheirStorage) {
  TorchPickle ok = ParseTorchPickle(TensorPickle(10, 2, 4, 2));
  ASSERT_EQ(ok.tensors.size(), 1u);
  EXPECT_EQ(ok.tensors[0].path, "");
  EXPECT_FALSE(ok.tensors[0].contiguous());
  EXPECT_EQ(ok.storages.at("0").nbytes, 40u);
  EXPECT_TRUE(PickleRejects(TensorPickle(10, 2, 5, 2), "reaches past the end of storage '0'"));
  EXPECT_TRUE(PickleRejects(TensorPickle(10, 10, 1, 1), "reaches past the end"));
  EXPECT_NO_THROW(ParseTorchPickle(TensorPickle(10, 10, 0, 1)));  // empty tensors touch nothing
}

// {'np': numpy's _reconstruct(ndarray, (0,), b'b') given the state (1, tensor), 'n': 1}: what an
// HF Trainer's rng_state.pth holds (np.random.get_state()), with a tensor in the object's state.
TEST(CheckpointTorch, OtherObjectsAreOpaqueValuesForListingOnly) {
  std::string tensor = TensorPickle(10, 0, 10, 1);
  tensor = tensor.substr(kProto.size(), tensor.size() - kProto.size() - 1);
  const std::string p = kProto + "}(X\x02\x00\x00\x00np"s +
                        "cnumpy.core.multiarray\n_reconstruct\n(cnumpy\nndarray\nK\x00\x85"s +
                        "C\x01"
                        "btR(K\x01"s +
                        tensor + "tbX\x01\x00\x00\x00nK\x01u."s;
  EXPECT_TRUE(PickleRejects(p, "global 'numpy.core.multiarray._reconstruct' is not allowed"));
  const TorchPickle r = ParseTorchPickle(p, "test.pkl", /*opaque_objects=*/true);
  ASSERT_EQ(r.tensors.size(), 1u);
  EXPECT_EQ(r.tensors[0].path, "np.state.1");
  EXPECT_EQ(r.other_values, 2u);  // the object and 1; what rebuilds the object is no value
  // An instance of a class as pickle writes it (NEWOBJ, then BUILD with its __dict__): a
  // dataclass, an HF Trainer's training_args.bin.
  const std::string instance =
      kProto + "c__main__\nTrainState\n)\x81}X\x04\x00\x00\x00stepK\x03sb."s;
  EXPECT_TRUE(PickleRejects(instance, "global '__main__.TrainState' is not allowed"));
  EXPECT_EQ(ParseTorchPickle(instance, "test.pkl", true).other_values, 1u);
  // Globals torch.load allows keep their rules: a dtype is still no callable.
  EXPECT_THROW(ParseTorchPickle(kProto + "ctorch\nfloat32\n)R.", "test.pkl", true), FormatError);
}

// defaultdict(list, {'a': [tensor]}) and a list subclass [1, tensor], as pickle writes them: the
// items come by SETITEMS and APPENDS on the objects, listed under their keys and indices.
TEST(CheckpointTorch, DictAndListSubclassesTakeTheirItemsForListing) {
  std::string tensor = TensorPickle(10, 0, 10, 1);
  tensor = tensor.substr(kProto.size(), tensor.size() - kProto.size() - 1);
  const std::string dd = "ccollections\ndefaultdict\ncbuiltins\nlist\n\x85R(X\x01\x00\x00\x00"s +
                         "a](" + tensor + "eu"s;
  const std::string sub = "c__main__\nMyList\n)\x81(K\x01"s + tensor + "e"s;
  const std::string p = kProto + "}(X\x02\x00\x00\x00"s + "dd" + dd + "X\x03\x00\x00\x00sub"s +
                        sub + "X\x01\x00\x00\x00nK\x07u."s;
  EXPECT_TRUE(PickleRejects(p, "global 'collections.defaultdict' is not allowed"));
  const TorchPickle r = ParseTorchPickle(p, "test.pkl", /*opaque_objects=*/true);
  ASSERT_EQ(r.tensors.size(), 2u);
  EXPECT_EQ(r.tensors[0].path, "dd.a.0");
  EXPECT_EQ(r.tensors[1].path, "sub.1");
  EXPECT_EQ(r.other_values, 3u);  // the two objects and 7; their contents are theirs
  // An object given both items and elements is no dict or list.
  const std::string both = kProto + "c__main__\nOdd\n)\x81(K\x01K\x02uK\x03a."s;
  EXPECT_THROW(ParseTorchPickle(both, "test.pkl", true), FormatError);
  // Set subclasses take no items this way (their ADDITEMS is refused).
  try {
    ParseTorchPickle(kProto + "c__main__\nS\n)\x81(K\x01\x90.", "test.pkl", true);
    ADD_FAILURE() << "ADDITEMS on an object was taken";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("ADDITEMS to something that is not a set"),
              std::string::npos)
        << e.what();
  }
}

// torch.load takes keys of any length: one of 5,000 bytes is read, one past 64 KiB refused.
TEST(CheckpointTorch, LongKeysAreRead) {
  std::string tensor = TensorPickle(10, 0, 10, 1);
  tensor = tensor.substr(kProto.size(), tensor.size() - kProto.size() - 1);
  auto keyed = [&](size_t n) {
    std::string len(4, '\0');
    for (int i = 0; i < 4; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return kProto + "}X"s + len + std::string(n, 'k') + tensor + "s.";
  };
  const TorchPickle r = ParseTorchPickle(keyed(5000));
  ASSERT_EQ(r.tensors.size(), 1u);
  EXPECT_EQ(r.tensors[0].path, std::string(5000, 'k'));
  EXPECT_TRUE(PickleRejects(keyed(70000), "key path longer than 65536 bytes"));
  // 300,000 ints under a 90-byte key: the scalars' paths are never built, so not charged.
  std::string many = kProto + "}X\x5a\x00\x00\x00"s + std::string(90, 'k') + "](";
  for (int i = 0; i < 300000; ++i) many += "K\x01";
  many += "es.";
  EXPECT_EQ(ParseTorchPickle(many).other_values, 300000u);
}

TEST(CheckpointTorch, BuildOnlyOnDictsAndTensors) {
  // OrderedDict() with BUILD state {'_metadata': {}} (what torch.save emits), then None, ((), {}).
  const std::string od = "ccollections\nOrderedDict\n)R"s;
  EXPECT_NO_THROW(ParseTorchPickle(kProto + od + "}X\x09\x00\x00\x00_metadata}sb."s));
  EXPECT_NO_THROW(ParseTorchPickle(kProto + od + "Nb."s));
  EXPECT_NO_THROW(ParseTorchPickle(kProto + od + ")}\x86"s + "b."));
  EXPECT_TRUE(PickleRejects(kProto + "]}b.", "BUILD on something that is not an OrderedDict"));
  EXPECT_TRUE(PickleRejects(kProto + od + "K\x01"s + "b.", "BUILD state is not a dict"));
  EXPECT_TRUE(PickleRejects(kProto + "}b.", "stack underflow"));
}

// A LONG1 int (8 bytes, little-endian).
std::string Long8(uint64_t v) {
  std::string out = "\x8a\x08"s;
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

// A float tensor over a 4-element storage with `rank` dimensions of size `size` and `stride`.
std::string RankTensorPickle(int rank, uint64_t size, uint64_t stride) {
  std::string shape = "(", strides = "(";
  for (int i = 0; i < rank; ++i) {
    shape += Long8(size);
    strides += Long8(stride);
  }
  return kProto + "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"s +
         "ctorch\nFloatStorage\nX\x01\x00\x00\x00"s + "0X\x03\x00\x00\x00"s + "cpuK\x04tQK\x00"s +
         shape + "t" + strides +
         "t\x89"
         "ccollections\nOrderedDict\n)RtR.";
}

// 16 dimensions of size 2^62 + 1 and stride 2^62 reach 16 * 2^124 = 2^128 elements past the
// offset: a 128-bit sum wraps to 0, which looked like a tensor inside a 4-element storage.
TEST(CheckpointTorch, RefusesSizesAndStridesThatWouldWrapTheBoundsCheck) {
  const uint64_t big = uint64_t{1} << 62;
  EXPECT_TRUE(PickleRejects(RankTensorPickle(16, big + 1, big), "reaches past the end"));
  EXPECT_TRUE(PickleRejects(RankTensorPickle(5, big + 1, 1), "reaches past the end"));
  EXPECT_TRUE(PickleRejects(RankTensorPickle(5, 2, big), "reaches past the end"));
  EXPECT_TRUE(PickleRejects(RankTensorPickle(2, 3, 1), "reaches past the end"));  // 5 elements
  EXPECT_NO_THROW(ParseTorchPickle(RankTensorPickle(2, 2, 1)));                   // 3 elements
  EXPECT_NO_THROW(ParseTorchPickle(RankTensorPickle(1, 4, 1)));
  // Expanded tensors (stride 0) may be larger than their storage; size-1 dims' strides are moot.
  EXPECT_NO_THROW(ParseTorchPickle(RankTensorPickle(16, big, 0)));
  EXPECT_NO_THROW(ParseTorchPickle(RankTensorPickle(16, 1, big)));
  // Empty tensors touch nothing, whatever their other sizes.
  std::string empty = RankTensorPickle(5, big + 1, big);
  empty.replace(empty.find(Long8(big + 1)), 10, Long8(0));
  EXPECT_NO_THROW(ParseTorchPickle(empty));
}

// _rebuild_tensor_v3 of 8 bytes of an UntypedStorage as torch.<dtype> (the shape `size`).
std::string V3TensorPickle(const std::string& dtype, int size) {
  return kProto + "ctorch._utils\n_rebuild_tensor_v3\n((X\x07\x00\x00\x00storage"s +
         "ctorch\nUntypedStorage\nX\x01\x00\x00\x00"s
         "0X\x03\x00\x00\x00"s
         "cpuK\x08tQK\x00K" +
         static_cast<char>(size) +
         "\x85K\x01\x85\x89"
         "ccollections\nOrderedDict\n)Rctorch\n" +
         dtype + "\ntR.";
}

TEST(CheckpointTorch, ReadsDtypesSafetensorsHasNoNameFor) {
  struct Case {
    const char* torch;
    const char* ours;
    int size;  // elements in 8 bytes
  };
  for (const Case& c :
       {Case{"complex32", "C32", 2}, Case{"chalf", "C32", 2}, Case{"float4_e2m1fn_x2", "F4_X2", 8},
        Case{"bits8", "BITS8", 8}, Case{"bits16", "BITS16", 4}, Case{"bits1x8", "BITS1X8", 8},
        Case{"bits2x4", "BITS2X4", 8}, Case{"bits4x2", "BITS4X2", 8}}) {
    TorchPickle p = ParseTorchPickle(V3TensorPickle(c.torch, c.size));
    ASSERT_EQ(p.tensors.size(), 1u) << c.torch;
    EXPECT_EQ(p.tensors[0].dtype, c.ours) << c.torch;
    EXPECT_EQ(p.tensors[0].nbytes(), 8u) << c.torch;
    EXPECT_EQ(p.storages.at("0").dtype, "U8") << c.torch;
    // One element more than the storage holds is out of bounds at this element size.
    EXPECT_TRUE(PickleRejects(V3TensorPickle(c.torch, c.size + 1), "reaches past the end"))
        << c.torch;
  }
  EXPECT_EQ(TorchDtypeAttribute("C32"), "complex32");
  EXPECT_EQ(TorchDtypeAttribute("F32"), "float32");
  EXPECT_EQ(TorchDtypeAttribute("F4"), "");  // safetensors' F4 is not a torch dtype
  EXPECT_TRUE(TorchSupportsDtype("F4_X2"));
  EXPECT_FALSE(TorchSupportsDtype("F4"));
  EXPECT_TRUE(PickleRejects(V3TensorPickle("float6_e2m3", 8), "is not allowed"));
}

// [storage as FloatStorage of `numel1`, the same key as IntStorage of `numel2`], as tensors.
std::string TwoDescriptionsPickle(int numel1, int numel2) {
  auto tensor = [](const std::string& type, int numel) {
    return "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"s + "ctorch\n" + type +
           "\nX\x01\x00\x00\x00"s
           "0X\x03\x00\x00\x00"s
           "cpuK" +
           static_cast<char>(numel) + "tQK\x00K"s + static_cast<char>(numel) +
           "\x85K\x01\x85\x89"s + "ccollections\nOrderedDict\n)RtR";
  };
  return kProto + "](" + tensor("FloatStorage", numel1) + tensor("IntStorage", numel2) + "e.";
}

TEST(CheckpointTorch, OnlyEmptyStoragesMayBeDescribedWithTwoTypes) {
  // torch.save names a storage of no bytes viewed as two dtypes once, with each dtype.
  TorchPickle p = ParseTorchPickle(TwoDescriptionsPickle(0, 0));
  ASSERT_EQ(p.tensors.size(), 2u);
  EXPECT_EQ(p.tensors[0].dtype, "F32");
  EXPECT_EQ(p.tensors[1].dtype, "I32");  // the second description's, not the storage's first
  EXPECT_TRUE(PickleRejects(TwoDescriptionsPickle(2, 2), "storage '0' is described twice"));
  EXPECT_TRUE(PickleRejects(TwoDescriptionsPickle(0, 2), "storage '0' is described twice"));
}

// _rebuild_qtensor of 4 elements of a `type` storage with quantizer parameters `params`.
std::string QTensorPickle(const std::string& type, const std::string& params) {
  return kProto + "ctorch._utils\n_rebuild_qtensor\n((X\x07\x00\x00\x00storage"s + "ctorch\n" +
         type + "\nX\x01\x00\x00\x00"s + "0X\x03\x00\x00\x00"s +
         "cpuK\x04tQK\x00K\x04\x85K\x01\x85"s + params +
         "\x89"
         "ccollections\nOrderedDict\n)RtR."s;
}

TEST(CheckpointTorch, ReadsQuantizedTensors) {
  const std::string per_tensor =
      "(ctorch\nper_tensor_affine\nG\x3f\xb9\x99\x99\x99\x99\x99\x9aK\x03t"s;
  TorchPickle p = ParseTorchPickle(QTensorPickle("QInt8Storage", per_tensor));
  ASSERT_EQ(p.tensors.size(), 1u);
  EXPECT_EQ(p.tensors[0].dtype, "QI8");
  EXPECT_EQ(p.tensors[0].nbytes(), 4u);
  EXPECT_EQ(TorchDtypeAttribute("QI32"), "qint32");
  EXPECT_EQ(ParseTorchPickle(QTensorPickle("QInt32Storage", per_tensor)).tensors[0].nbytes(), 16u);
  EXPECT_TRUE(PickleRejects(QTensorPickle("FloatStorage", per_tensor),
                            "quantized tensor on a FloatStorage"));
  EXPECT_TRUE(PickleRejects(QTensorPickle("QInt8Storage", "(K\x01t"s),
                            "do not start with a quantization scheme"));
  EXPECT_TRUE(PickleRejects(QTensorPickle("QUInt4x2Storage", per_tensor), "is not allowed"));
}

TEST(CheckpointTorch, ReadsMetaTensors) {
  // {'m': _rebuild_meta_tensor_no_storage(torch.float32, (2, 3), (3, 1), False)}
  const std::string meta = kProto + "}X\x01\x00\x00\x00"s +
                           "mctorch._utils\n_rebuild_meta_tensor_no_storage\n(ctorch\nfloat32\n"
                           "K\x02K\x03\x86K\x03K\x01\x86\x89tRs."s;
  TorchPickle p = ParseTorchPickle(meta);
  ASSERT_EQ(p.tensors.size(), 1u);
  EXPECT_TRUE(p.tensors[0].meta);
  EXPECT_EQ(p.tensors[0].path, "m");
  EXPECT_EQ(p.tensors[0].dtype, "F32");
  EXPECT_EQ(p.tensors[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(p.tensors[0].nbytes(), 0u);  // no data
  EXPECT_TRUE(p.tensors[0].storage_key.empty());
  EXPECT_TRUE(p.storages.empty());
  std::string bad = meta;
  bad.replace(bad.find("float32"), 7, "float99");
  EXPECT_TRUE(PickleRejects(bad, "is not allowed"));
}

// A zip archive of `records` (full name, value), stored, with their CRC-32s.
std::string TorchZipOf(const std::vector<std::pair<std::string, std::string>>& records) {
  ZipPlanner z;
  for (const auto& [name, value] : records) z.Add(name, value.size());
  std::string out(z.directory_offset(), '\0');
  for (size_t i = 0; i < records.size(); ++i) {
    const std::string& value = records[i].second;
    z.SetCrc(i, Crc32(value.data(), value.size()));
    const ZipPlanEntry& e = z.entries()[i];
    std::string h = z.LocalHeader(i);
    out.replace(e.local_header_offset, h.size(), h);
    out.replace(e.data_offset, value.size(), value);
  }
  return out + z.Directory();
}

// A torch.save zip holding {} and the records `records` (name under "a/", value).
std::string ZipWithRecords(const std::vector<std::pair<std::string, std::string>>& records) {
  std::vector<std::pair<std::string, std::string>> all = {{"a/data.pkl", kProto + "}q\x00."s}};
  for (const auto& [name, value] : records) all.emplace_back("a/" + name, value);
  return TorchZipOf(all);
}

// A torch.save zip holding {} and one more record, `name` (under "a/"), holding `value`, with
// the format version record torch.save writes unless `name` is a version record itself.
std::string ZipWithRecord(const std::string& name, const std::string& value) {
  if (name == "version" || name == ".data/version") return ZipWithRecords({{name, value}});
  return ZipWithRecords({{"version", "3\n"}, {name, value}});
}

// A torch.save zip holding {} whose byteorder record says `order`.
std::string ZipWithByteOrder(const std::string& order) {
  return ZipWithRecord("byteorder", order);
}

TEST(CheckpointTorch, ReadsTheByteOrderRecord) {
  for (const char* order : {"little", "big"}) {
    std::string zip = ZipWithByteOrder(order);
    TorchCheckpoint c = ReadTorchCheckpoint(MemorySource(zip.data(), zip.size(), "order.pt"));
    EXPECT_EQ(c.big_endian, std::string(order) == "big") << order;
    EXPECT_EQ(c.prefix, "a");
  }
  EXPECT_FALSE(ReadTorchFixture("small.pt").big_endian);
  std::string zip = ZipWithByteOrder("middle");
  try {
    ReadTorchCheckpoint(MemorySource(zip.data(), zip.size(), "order.pt"));
    ADD_FAILURE();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("order.pt: byte order 'middle' is neither"),
              std::string::npos)
        << e.what();
  }
}

TEST(CheckpointTorch, RefusesFormatVersionsTorchDoesNotRead) {
  // torch.save writes "3\n"; torch's reader takes 1 to 10, read as std::stoull reads them.
  for (const char* ok : {"3\n", "1", "10", " +7x"}) {
    for (const char* record : {"version", ".data/version"}) {
      std::string zip = ZipWithRecord(record, ok);
      EXPECT_NO_THROW(ReadTorchCheckpoint(MemorySource(zip.data(), zip.size(), "v.pt")))
          << record << " " << ok;
    }
  }
  EXPECT_EQ(ReadTorchFixture("small.pt").prefix, "small");  // version 3
  for (const char* bad : {"11\n", "0", "99999999999999999999999", "-1", "x3", ""}) {
    std::string zip = ZipWithRecord("version", bad);
    try {
      ReadTorchCheckpoint(MemorySource(zip.data(), zip.size(), "v.pt"));
      ADD_FAILURE() << "accepted version '" << bad << "'";
    } catch (const FormatError& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind("v.pt: ", 0), 0u) << what;
      EXPECT_NE(what.find("'a/version'"), std::string::npos) << what;
    }
  }
  // .data/version wins over version, as in torch's reader
  std::string zip = ZipWithRecords({{"version", "3"}, {".data/version", "11"}});
  EXPECT_THROW(ReadTorchCheckpoint(MemorySource(zip.data(), zip.size(), "v.pt")), FormatError);
  zip = ZipWithRecords({{"version", "11"}, {".data/version", "3"}});
  EXPECT_NO_THROW(ReadTorchCheckpoint(MemorySource(zip.data(), zip.size(), "v.pt")));
}

TEST(CheckpointTorch, RefusesAnArchiveWithoutAFormatVersion) {
  // torch's reader requires "version" or ".data/version" (PyTorchStreamReader::init).
  for (const std::string& zip : {ZipWithRecords({}), ZipWithRecords({{"byteorder", "little"}})}) {
    try {
      ReadTorchCheckpoint(MemorySource(zip.data(), zip.size(), "v.pt"));
      ADD_FAILURE() << "accepted an archive without a version record";
    } catch (const FormatError& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind("v.pt: ", 0), 0u) << what;
      EXPECT_NE(what.find("'a/version' or 'a/.data/version'"), std::string::npos) << what;
    }
  }
  std::string zip = ZipWithRecords({});
  MemorySource source(zip.data(), zip.size(), "v.pt");
  EXPECT_THROW(CheckTorchFileVersion(source, ReadZipDirectory(source), "a"), FormatError);
  EXPECT_THROW(CheckTorchFileVersion(source, ReadZipDirectory(source), ""), FormatError);
}

TEST(CheckpointTorch, TheArchiveFolderIsThatOfItsOneDataPkl) {
  const std::string pickle = kProto + "}q\x00."s;
  auto prefix_of = [](const std::string& zip) {
    MemorySource source(zip.data(), zip.size(), "p.pt");
    return TorchArchivePrefix(ReadZipDirectory(source), source.name());
  };
  auto refusal = [&](const std::string& zip) -> std::string {
    try {
      prefix_of(zip);
    } catch (const FormatError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(prefix_of(TorchZipOf({{"x/version", "3"}, {"x/data.pkl", pickle}})), "x");
  EXPECT_EQ(prefix_of(TorchZipOf({{"x/data/data.pkl", "0"}, {"y/data.pkl", pickle}})), "y");
  // torch's reader takes records only inside a folder.
  EXPECT_NE(refusal(TorchZipOf({{"version", "3"}, {"data.pkl", pickle}})).find("<folder>/data.pkl"),
            std::string::npos);
  EXPECT_NE(refusal(TorchZipOf({{"x/data.pkl", pickle}, {"y/data.pkl", pickle}}))
                .find("p.pt: more than one data.pkl ('x/data.pkl', 'y/data.pkl')"),
            std::string::npos);
  const std::string script =
      TorchZipOf({{"m/version", "3"}, {"m/data.pkl", pickle}, {"m/constants.pkl", pickle}});
  EXPECT_NE(refusal(script).find("TorchScript archive"), std::string::npos);
  EXPECT_THROW(ReadTorchCheckpoint(MemorySource(script.data(), script.size(), "p.pt")),
               FormatError);
}

}  // namespace
}  // namespace tensortier
