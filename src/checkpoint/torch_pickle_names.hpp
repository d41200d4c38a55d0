// What a torch.save pickle may name, for the restricted reader (torch_pickle.cpp): the globals
// a state dict needs, and the storage classes and dtypes of the tensors this reader takes.
#pragma once

#include <cstdint>
#include <string_view>

#include "tensortier/checkpoint/dtypes.hpp"

namespace tensortier::torch_pickle_names {

// A storage value's type: its row in Dtypes(), or this for an UntypedStorage (bytes).
inline constexpr int64_t kUntypedStorage = -1;

// `d` when this reader takes tensors of it, else nullptr: not quint4x2 and quint2x4, quantized
// values packed several to a byte.
const Dtype* Readable(const Dtype* d);

// Our name of typed storage class `storage` ("FloatStorage" -> "F32"), "U8" for an
// UntypedStorage, empty when it is no storage class this reader takes.
std::string_view StorageDtype(std::string_view storage);

// Whether the pickle may name global "module.name": what a state dict needs (builtins spelled
// both ways: protocol 2 pickles name Python 3's builtins "__builtin__").
bool Allowed(std::string_view g);

}  // namespace tensortier::torch_pickle_names
