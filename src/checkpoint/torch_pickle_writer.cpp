// Emits the data.pkl torch.save writes for a flat dict of tensors, opcode for opcode: Python's
// pickle (protocol 2) run by torch.serialization._save's persistent_id over
// Tensor.__reduce_ex__. The object identities Python's memo sees are mirrored here: the
// 'storage' and 'cpu' strings, the rebuild functions, storage classes, dtypes and the
// OrderedDict class are one object each (memoized once, then fetched), while keys, tuples and
// the empty OrderedDicts are new objects every time.
#include <algorithm>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "pickle_emitter.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// What torch.save pickles as a plain tensor: every dtype torch has but the quantized ones.
// torch.storage._dtype_to_storage_type_map() decides the rest: dtypes with a typed storage class
// pickle through _rebuild_tensor_v2, the others through v3 with an UntypedStorage counted in bytes.
const Dtype* FindDtype(std::string_view dtype) {
  const Dtype* d = DtypeNamed(dtype);
  return d != nullptr && !d->torch.empty() && !d->quantized ? d : nullptr;
}

void EmitTensor(Emitter& e, const TorchPickleTensor& t, const Dtype& d, uint64_t numel) {
  bool v3 = d.storage.empty();
  // Tensor.__reduce_ex__ -> (_rebuild_tensor_v2|v3, args); args > 3 items: MARK ... TUPLE.
  e.Global("torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
  e.Op('(');
  // The storage, by persistent id ('storage', type, key, location, numel).
  e.Op('(');
  e.SharedStr("storage");
  if (v3) {
    e.Global("torch.storage", "UntypedStorage");
  } else {
    e.Global("torch", d.storage);
  }
  e.Str(t.storage_key);
  e.SharedStr("cpu");
  e.Int(v3 ? numel * (d.bits / 8) : numel);
  e.Op('t');
  e.Put();
  e.Op('Q');  // BINPERSID
  e.Int(0);   // storage offset
  e.IntTuple(t.shape);
  e.IntTuple(ContiguousStrides(t.shape));
  e.Op('\x89');  // requires_grad: NEWFALSE
  // backward hooks: collections.OrderedDict(), a new object each time.
  e.Global("collections", "OrderedDict");
  e.Op(')');
  e.Op('R');
  e.Put();
  if (v3) e.Global("torch", d.torch);
  e.Op('t');
  e.Put();
  e.Op('R');
  e.Put();
}

// The elements of `t` (of dtype `d`), after checking what torch needs of it: a UTF-8 name, a
// plain storage key, sizes and byte counts within int64.
uint64_t CheckedNumel(const TorchPickleTensor& t, const Dtype& d) {
  try {
    JsonQuote(t.name);  // Python's unpickler decodes BINUNICODE strictly
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("a tensor name is not valid UTF-8");
  }
  if (t.storage_key.empty() || t.storage_key.size() > 64 ||
      t.storage_key.find_first_not_of(
          "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_") != std::string::npos) {
    throw std::invalid_argument(
        StrCat("tensor '", t.name, "': storage key '", t.storage_key, "' is not a plain name"));
  }
  // torch sizes, strides and byte counts are int64.
  constexpr uint64_t kMax = INT64_MAX;
  uint64_t numel = 1;
  bool empty = false;
  uint64_t padded = 1;  // product with zeros counted as 1: the largest stride
  for (uint64_t dim : t.shape) {
    if (dim > kMax) throw std::invalid_argument(StrCat("tensor '", t.name, "': size too large"));
    uint64_t eff = dim == 0 ? 1 : dim;
    if (padded > kMax / eff) {
      throw std::invalid_argument(StrCat("tensor '", t.name, "': shape too large for torch"));
    }
    padded *= eff;
    empty = empty || dim == 0;
  }
  numel = empty ? 0 : padded;
  if (numel > kMax / (d.bits / 8)) {
    throw std::invalid_argument(StrCat("tensor '", t.name, "': too many bytes for torch"));
  }
  return numel;
}

}  // namespace

std::vector<uint64_t> ContiguousStrides(const std::vector<uint64_t>& shape) {
  std::vector<uint64_t> stride(shape.size());
  uint64_t step = 1;
  for (size_t i = shape.size(); i > 0; --i) {
    stride[i - 1] = step;
    step *= shape[i - 1] == 0 ? 1 : shape[i - 1];
  }
  return stride;
}

bool TorchSupportsDtype(std::string_view dtype) {
  return FindDtype(dtype) != nullptr;
}

std::string SerializeTorchPickle(const std::vector<TorchPickleTensor>& tensors) {
  // Everything is checked before anything is emitted.
  std::vector<uint64_t> numels;
  std::set<std::string_view> names;
  std::set<std::string_view> keys;
  for (const auto& t : tensors) {
    const Dtype* d = FindDtype(t.dtype);
    if (d == nullptr) {
      throw std::invalid_argument(
          StrCat("tensor '", t.name, "' has dtype ", t.dtype, ", which torch has no dtype for"));
    }
    if (!names.insert(t.name).second) {
      throw std::invalid_argument(StrCat("tensor '", t.name, "' appears twice"));
    }
    if (!keys.insert(t.storage_key).second) {
      throw std::invalid_argument(
          StrCat("tensor '", t.name, "': storage key '", t.storage_key, "' used twice"));
    }
    const uint64_t numel = CheckedNumel(t, *d);
    numels.push_back(numel);
  }

  Emitter e;
  e.Op('\x80');  // PROTO 2
  e.Le(2, 1);
  e.Op('}');  // EMPTY_DICT
  e.Put();
  // The C pickler's batch_dict_exact.
  e.Items(tensors.size(), true, [&](size_t i) {
    e.Str(tensors[i].name);
    EmitTensor(e, tensors[i], *FindDtype(tensors[i].dtype), numels[i]);
  });
  e.Op('.');
  return e.Take();
}

std::string SerializeTorchTensorPickle(const TorchPickleTensor& tensor) {
  const Dtype* d = FindDtype(tensor.dtype);
  if (d == nullptr) {
    throw std::invalid_argument(StrCat("tensor '", tensor.name, "' has dtype ", tensor.dtype,
                                       ", which torch has no dtype for"));
  }
  const uint64_t numel = CheckedNumel(tensor, *d);
  Emitter e;
  e.Op('\x80');  // PROTO 2
  e.Le(2, 1);
  EmitTensor(e, tensor, *d, numel);
  e.Op('.');
  return e.Take();
}

}  // namespace tensortier
