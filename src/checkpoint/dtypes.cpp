#include "tensortier/checkpoint/dtypes.hpp"

#include <iterator>

namespace tensortier {
namespace {

// safetensors 0.8 and torch 2.x. torch dtypes left out: int1..int7 and uint1..uint7 (sub-byte
// integers no tensor can be made of).
constexpr Dtype kDtypes[] = {
    // name, safetensors, packing, torch, torch_alias, storage, bits, quantized
    {"BOOL", "BOOL", 1, "bool", "", "BoolStorage", 8, false},
    {"F4", "F4", 1, "", "", "", 4, false},
    {"F4_X2", "F4", 2, "float4_e2m1fn_x2", "", "", 8, false},
    {"F6_E2M3", "F6_E2M3", 1, "", "", "", 6, false},
    {"F6_E3M2", "F6_E3M2", 1, "", "", "", 6, false},
    {"U8", "U8", 1, "uint8", "", "ByteStorage", 8, false},
    {"I8", "I8", 1, "int8", "", "CharStorage", 8, false},
    {"F8_E5M2", "F8_E5M2", 1, "float8_e5m2", "", "", 8, false},
    {"F8_E4M3", "F8_E4M3", 1, "float8_e4m3fn", "", "", 8, false},
    {"F8_E8M0", "F8_E8M0", 1, "float8_e8m0fnu", "", "", 8, false},
    {"F8_E4M3FNUZ", "F8_E4M3FNUZ", 1, "float8_e4m3fnuz", "", "", 8, false},
    {"F8_E5M2FNUZ", "F8_E5M2FNUZ", 1, "float8_e5m2fnuz", "", "", 8, false},
    {"I16", "I16", 1, "int16", "short", "ShortStorage", 16, false},
    {"U16", "U16", 1, "uint16", "", "", 16, false},
    {"F16", "F16", 1, "float16", "half", "HalfStorage", 16, false},
    {"BF16", "BF16", 1, "bfloat16", "", "BFloat16Storage", 16, false},
    {"I32", "I32", 1, "int32", "int", "IntStorage", 32, false},
    {"U32", "U32", 1, "uint32", "", "", 32, false},
    {"F32", "F32", 1, "float32", "float", "FloatStorage", 32, false},
    {"C64", "C64", 1, "complex64", "cfloat", "ComplexFloatStorage", 64, false},
    {"F64", "F64", 1, "float64", "double", "DoubleStorage", 64, false},
    {"I64", "I64", 1, "int64", "long", "LongStorage", 64, false},
    {"U64", "U64", 1, "uint64", "", "", 64, false},
    // Only torch has these.
    {"C128", "", 1, "complex128", "cdouble", "ComplexDoubleStorage", 128, false},
    {"C32", "", 1, "complex32", "chalf", "", 32, false},
    {"BITS8", "", 1, "bits8", "", "", 8, false},
    {"BITS16", "", 1, "bits16", "", "", 16, false},
    {"BITS1X8", "", 1, "bits1x8", "", "", 8, false},
    {"BITS2X4", "", 1, "bits2x4", "", "", 8, false},
    {"BITS4X2", "", 1, "bits4x2", "", "", 8, false},
    {"QI8", "", 1, "qint8", "", "QInt8Storage", 8, true},
    {"QU8", "", 1, "quint8", "", "QUInt8Storage", 8, true},
    {"QI32", "", 1, "qint32", "", "QInt32Storage", 32, true},
    {"QU4X2", "", 2, "quint4x2", "", "QUInt4x2Storage", 8, true},
    {"QU2X4", "", 4, "quint2x4", "", "QUInt2x4Storage", 8, true},
};

}  // namespace

std::span<const Dtype> Dtypes() {
  return kDtypes;
}

const Dtype* DtypeNamed(std::string_view name) {
  for (const Dtype& d : kDtypes) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

const Dtype* DtypeOfTorch(std::string_view torch) {
  if (torch.empty()) return nullptr;
  for (const Dtype& d : kDtypes) {
    if (d.torch == torch || d.torch_alias == torch) return &d;
  }
  return nullptr;
}

const Dtype* DtypeOfStorage(std::string_view storage) {
  if (storage.empty()) return nullptr;
  for (const Dtype& d : kDtypes) {
    if (d.storage == storage) return &d;
  }
  return nullptr;
}

}  // namespace tensortier
