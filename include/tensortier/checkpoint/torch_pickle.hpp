// A restricted reader for the pickle (data.pkl) inside torch.save zip files. It runs no Python and
// calls nothing: it understands the opcodes torch.save emits (protocol 2, plus the protocol 4
// framing opcodes) and only the globals torch.load(weights_only=True) allows for plain state dicts
// (tensor rebuild functions, storage types, dtypes, OrderedDict, Size, device, set, bytes).
// Anything else (posix.system, builtins.eval...) is a FormatError naming the global.
//
// Bounded: values, stack, memo and the walk over the result are limited by the input size and
// fixed caps; nothing recurses on the input's nesting; cycles built through the memo are refused.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tensortier {

// A storage named by a persistent id ('storage', type, key, location, numel).
struct TorchStorage {
  std::string key;       // "0", "1"...: the zip entry is "<prefix>/data/<key>"
  std::string dtype;     // safetensors-style name of the storage's element type ("U8" if untyped)
  uint64_t numel = 0;    // elements of dtype
  uint64_t nbytes = 0;   // numel * element size
  std::string location;  // "cpu", "cuda:0"...
  uint64_t data_offset = 0;  // absolute file offset of its bytes (set by ReadTorchCheckpoint)
};

struct TorchTensor {
  std::string path;  // dotted key path in the pickled object ("model.layer.weight", "list.4")
  // safetensors-style name ("F32", "BF16", "C128"...); for torch dtypes safetensors lacks: "C32"
  // (complex32), "F4_X2" (float4_e2m1fn_x2: one byte of two F4 values), "BITS8", "BITS16",
  // "BITS1X8", "BITS2X4", "BITS4X2".
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;  // in elements
  int64_t storage_offset = 0;   // in elements
  std::string storage_key;
  bool requires_grad = false;
  bool parameter = false;  // an nn.Parameter
  // Saved as a conjugate / negative view: the storage holds the conjugates / negatives of the
  // tensor's values (torch sets the bit again on load).
  bool conj = false;
  bool neg = false;
  // A meta tensor (_rebuild_meta_tensor_no_storage): dtype, shape and strides, no data and no
  // storage (storage_key empty).
  bool meta = false;
  bool contiguous() const;
  uint64_t nbytes() const;  // elements * element size (0 for meta tensors)
};

struct TorchPickle {
  std::vector<TorchTensor> tensors;  // in pickle order
  std::map<std::string, TorchStorage> storages;
  uint64_t other_values = 0;  // non-tensor leaves (ints, strings, None...) kept by torch.load
};

// Bytes per element of a safetensors-style dtype name used above; 0 when unknown.
unsigned TorchDtypeBytes(std::string_view dtype);

// torch's name for a dtype name used above ("float32" for F32, "complex32" for C32); empty when
// unknown.
std::string_view TorchDtypeAttribute(std::string_view dtype);

// A safetensors dtype as torch holds it.
struct TorchHeldDtype {
  std::string safetensors;      // "F32", "F4"...
  std::string name;             // the name used above: "F32", "F4_X2"
  std::string_view torch;       // torch's dtype attribute: "float32", "float4_e2m1fn_x2"
  unsigned values_per_element;  // safetensors values one torch element packs: 2 for F4, else 1
};

// Every safetensors dtype torch 2.x has a dtype for, in safetensors' order: those of a byte or
// more as themselves, those of fewer bits packed into bytes (F4 as float4_e2m1fn_x2; not F6_*).
std::vector<TorchHeldDtype> SafetensorsDtypesForTorch();

// The entry above for safetensors dtype `dtype`, or nullopt.
std::optional<TorchHeldDtype> TorchHeldDtypeOf(std::string_view dtype);

// One tensor of a flat state dict to pickle: contiguous, alone in its storage `storage_key`, which
// holds exactly its elements (storage offset 0, contiguous strides, requires_grad False).
struct TorchPickleTensor {
  std::string name;   // the dict key
  std::string dtype;  // safetensors-style name ("F32", "BF16", "F8_E4M3"...)
  std::vector<uint64_t> shape;
  std::string storage_key;  // "0", "1"...: a plain name (letters, digits, '_')
};

// True when torch (2.x) pickles a plain tensor of `dtype` (a name of dtypes.hpp): every torch
// dtype but the quantized ones; not F4 (torch packs two values per element), F6_*, unknowns.
bool TorchSupportsDtype(std::string_view dtype);

// The strides torch gives a contiguous tensor of `shape` (sizes of 0 count as 1), in elements:
// those SerializeTorchPickle writes. A tensor with other strides (a size-1 dimension's may be
// anything in a tensor torch calls contiguous) is pickled with its own.
std::vector<uint64_t> ContiguousStrides(const std::vector<uint64_t>& shape);

// The data.pkl that torch.save writes for a plain dict {name: tensor} of `tensors` (in order, all
// on the CPU): protocol 2, byte for byte what torch 2.x emits (its memo, its batching of items,
// _rebuild_tensor_v2 with typed storages, _rebuild_tensor_v3 with an UntypedStorage for the
// dtypes without one: uint16/32/64, float8 types...). Throws std::invalid_argument naming the
// tensor for a dtype torch cannot hold, a duplicate name, a shape too large, or a bad storage key.
std::string SerializeTorchPickle(const std::vector<TorchPickleTensor>& tensors);

// The data.pkl torch.save writes for the one tensor `tensor` (not in a dict; its name only
// names it in errors): what torch.distributed.checkpoint stores for each tensor item. Throws
// std::invalid_argument as SerializeTorchPickle does.
std::string SerializeTorchTensorPickle(const TorchPickleTensor& tensor);

// Parses `data` (the bytes of data.pkl). `what` names it in errors. Throws FormatError.
// Every tensor is checked to lie inside its storage. With `opaque_objects`, for listing and
// checking a file rather than loading it, an object of another type (a numpy array, a class
// pickled by reference: what torch.load(weights_only=True) may refuse) is read as an opaque
// non-tensor value, never called; tensors in its arguments or state are listed. Without, its
// global is refused as tensortier.load refuses it.
TorchPickle ParseTorchPickle(std::string_view data, const std::string& what = "data.pkl",
                             bool opaque_objects = false);

}  // namespace tensortier
