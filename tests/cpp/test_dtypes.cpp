// The dtype table (dtypes.hpp): each fact once, and every reader and writer agreeing with it.
#include "tensortier/checkpoint/dtypes.hpp"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"

namespace tensortier {
namespace {

TEST(DtypesTest, EveryNameFindsItsOwnRow) {
  std::set<std::string_view> names, torch_names, storages;
  for (const Dtype& d : Dtypes()) {
    EXPECT_TRUE(names.insert(d.name).second) << d.name;
    EXPECT_EQ(DtypeNamed(d.name), &d) << d.name;
    if (!d.torch.empty()) {
      EXPECT_TRUE(torch_names.insert(d.torch).second) << d.torch;
      EXPECT_EQ(DtypeOfTorch(d.torch), &d) << d.torch;
    }
    if (!d.torch_alias.empty()) {
      EXPECT_FALSE(d.torch.empty()) << d.name;
      EXPECT_TRUE(torch_names.insert(d.torch_alias).second) << d.torch_alias;
      EXPECT_EQ(DtypeOfTorch(d.torch_alias), &d) << d.torch_alias;
    }
    if (!d.storage.empty()) {
      EXPECT_FALSE(d.torch.empty()) << d.name;
      EXPECT_TRUE(storages.insert(d.storage).second) << d.storage;
      EXPECT_EQ(DtypeOfStorage(d.storage), &d) << d.storage;
    }
  }
  EXPECT_EQ(DtypeNamed("nope"), nullptr);
  EXPECT_EQ(DtypeNamed(""), nullptr);
  EXPECT_EQ(DtypeOfTorch(""), nullptr);
  EXPECT_EQ(DtypeOfStorage(""), nullptr);
  EXPECT_EQ(DtypeOfStorage("UntypedStorage"), nullptr);
}

TEST(DtypesTest, SizesAndPackingAgree) {
  for (const Dtype& d : Dtypes()) {
    ASSERT_GE(d.packing, 1u) << d.name;
    if (!d.torch.empty()) {
      // torch elements are whole bytes: packed values count in elements of a byte or more.
      EXPECT_EQ(d.bits % 8, 0u) << d.name;
      EXPECT_EQ(TorchDtypeBytes(d.name) * 8, d.bits) << d.name;
      EXPECT_EQ(TorchDtypeAttribute(d.name), d.torch) << d.name;
    } else {
      EXPECT_EQ(TorchDtypeBytes(d.name), 0u) << d.name;
      EXPECT_FALSE(d.safetensors.empty()) << d.name << " is in neither torch nor safetensors";
    }
    if (d.safetensors.empty()) continue;
    const Dtype* stored = DtypeNamed(d.safetensors);
    ASSERT_NE(stored, nullptr) << d.name;
    EXPECT_EQ(stored->safetensors, stored->name) << d.name;
    EXPECT_EQ(stored->packing, 1u) << d.name;
    EXPECT_EQ(d.bits, SafetensorsDtypeBits(d.safetensors) * d.packing) << d.name;
  }
}

TEST(DtypesTest, SafetensorsNamesAreTheTablesInItsOrder) {
  const std::vector<std::string_view> want = {
      "BOOL",    "F4",          "F6_E2M3",     "F6_E3M2", "U8",  "I8",  "F8_E5M2", "F8_E4M3",
      "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16",     "U16", "F16", "BF16",    "I32",
      "U32",     "F32",         "C64",         "F64",     "I64", "U64"};
  EXPECT_EQ(SafetensorsDtypeNames(), want);
  EXPECT_EQ(SafetensorsDtypeBits("F4_X2"), 0u);  // torch's name for packed F4, not safetensors'
  EXPECT_EQ(SafetensorsDtypeBits("C128"), 0u);
  EXPECT_EQ(SafetensorsDtypeBits("F6_E2M3"), 6u);
}

// The pickle writer emits every dtype it supports as the reader reads it back: same name, same
// size, typed storages where the table names one.
TEST(DtypesTest, PickleWriterAndReaderRoundTripEveryDtype) {
  size_t written = 0;
  for (const Dtype& d : Dtypes()) {
    const bool plain = !d.torch.empty() && !d.quantized;
    EXPECT_EQ(TorchSupportsDtype(d.name), plain) << d.name;
    if (!plain) continue;
    ++written;
    TorchPickle p = ParseTorchPickle(SerializeTorchPickle({{"t", std::string(d.name), {3}, "0"}}));
    ASSERT_EQ(p.tensors.size(), 1u) << d.name;
    EXPECT_EQ(p.tensors[0].dtype, d.name);
    EXPECT_EQ(p.tensors[0].nbytes(), 3 * d.bits / 8) << d.name;
    EXPECT_EQ(p.storages.at("0").dtype, d.storage.empty() ? "U8" : d.name) << d.name;
    EXPECT_EQ(p.storages.at("0").nbytes, 3 * d.bits / 8) << d.name;
  }
  EXPECT_EQ(written, 27u);
}

}  // namespace
}  // namespace tensortier
