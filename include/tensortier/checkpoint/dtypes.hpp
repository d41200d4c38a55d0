// The element types tensortier reads and writes, one row each: safetensors parsing, the torch
// pickle reader and writer, the CLI's convert, the shared tensors and the Python package (through
// its bindings) all take dtype facts from this table and from nowhere else.
#pragma once

#include <span>
#include <string_view>

namespace tensortier {

struct Dtype {
  // tensortier's name: safetensors' where it has one ("F32", "BF16", "F8_E4M3"), else one in its
  // style ("C128", "C32", "F4_X2" for float4_e2m1fn_x2, "BITS8", "QI8" for qint8, "QU4X2" for
  // quint4x2).
  std::string_view name;
  // The safetensors dtype a tensor of it is stored as: itself, "F4" for F4_X2; empty when
  // safetensors has none.
  std::string_view safetensors;
  // Values one element packs: 2 for F4_X2 (a byte of two F4 values of `safetensors`), 2 and 4 for
  // quint4x2 and quint2x4; else 1.
  unsigned packing;
  std::string_view torch;        // torch's dtype attribute ("float32"); empty when none (F4, F6_*)
  std::string_view torch_alias;  // torch's other attribute for it ("float"); empty when none
  // The typed storage class torch.save pickles it with (_rebuild_tensor_v2, "FloatStorage");
  // empty for the dtypes it pickles with an UntypedStorage (_rebuild_tensor_v3).
  std::string_view storage;
  unsigned bits;   // per element
  bool quantized;  // torch's quantized integers (_rebuild_qtensor): no plain tensor holds them
};

// Every row: the safetensors dtypes first, in the safetensors package's order (F4_X2 beside F4),
// then those only torch has.
std::span<const Dtype> Dtypes();

// The row named `name` (tensortier's name), or nullptr.
const Dtype* DtypeNamed(std::string_view name);

// The row of torch dtype attribute `torch` ("float32" or its alias "float"), or nullptr.
const Dtype* DtypeOfTorch(std::string_view torch);

// The row whose typed storage class is `storage` ("FloatStorage"), or nullptr.
const Dtype* DtypeOfStorage(std::string_view storage);

}  // namespace tensortier
