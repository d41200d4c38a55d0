#include "tensortier/checkpoint/torch_pickle.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <optional>

#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/checkpoint/pickle_machine.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/checkpoint/torch_pickle_names.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

using torch_pickle_names::Allowed;
using torch_pickle_names::kUntypedStorage;
using torch_pickle_names::Readable;
using torch_pickle_names::StorageDtype;

constexpr size_t kMaxRank = 64;
constexpr size_t kMaxDepth = 256;
constexpr uint64_t kMaxVisits = 1u << 22;
constexpr size_t kMaxTensors = 1u << 20;  // shared subtrees can multiply tensors: bound the output
// A key path's length (torch.load takes any key; 64 KiB per level of the walk's stack) ...
constexpr size_t kMaxPath = 64u << 10;
// Memory is bounded by the input's size, not only by fixed caps: every opcode is at least a byte,
// but one byte can make a 72-byte Value, and a few bytes can rebuild (or, through shared subtrees,
// emit) a tensor with 64-dimension shape and stride vectors. The ratios leave room for anything
// torch.save writes: it memoizes every value it can with a 2-byte BINPUT, spends at least 2 bytes
// on an int, ~30 bytes on a tensor, and None/True/False/() cost no Value here (shared singletons).
constexpr size_t kMaxValues = 1u << 23;
constexpr size_t kMaxMemo = 1u << 23;   // memo indices (the memo is a vector: torch's are dense)
constexpr size_t kSlack = 1024;         // added to every input-relative cap: tiny pickles are fine
constexpr size_t kBytesPerTensor = 16;  // tensors rebuilt <= input bytes / 16
constexpr size_t kOutputBytesPerByte = 16;  // output tensors' estimated bytes <= 16 x input ...
constexpr size_t kOutputSlack = 4u << 20;   // ... + 4 MiB
// ... and the bytes of the key paths the walk builds, in all: bounded as the output is (long keys
// in shared subtrees walked many times would otherwise take time quadratic in the input).

using Kind = PickleKind;
using Value = PickleValue;

class Vm : public PickleMachine {
 public:
  // Listing opaque objects also takes the opcodes pickle writes for them (NEWOBJ for an
  // instance of a class, a dataclass's; sets) that torch.save does not write for state dicts.
  Vm(std::string_view data, const std::string& what, bool opaque_objects)
      : PickleMachine(data, std::min(kMaxValues, data.size() / 2 + kSlack),
                      std::min(kMaxMemo, data.size() / 2 + kSlack),
                      /*extended=*/opaque_objects),
        what_(what),
        opaque_objects_(opaque_objects),
        max_tensors_(std::min(kMaxTensors, data.size() / kBytesPerTensor + kSlack)),
        max_dims_(data.size() / 2 + kSlack),
        max_output_bytes_(static_cast<uint64_t>(data.size()) * kOutputBytesPerByte + kOutputSlack) {
  }

  TorchPickle Run() {
    uint32_t root = Execute();
    std::vector<bool> on_path(values_.size(), false);
    Walk(root, "", 0, on_path);
    return std::move(out_);
  }

 private:
  std::string Describe(std::string_view problem) const override {
    return StrCat(what_, ": at byte ", op_pos_, ": ", problem);
  }

  [[noreturn]] void WalkFail(std::string_view problem) const {
    throw FormatError(StrCat(what_, ": ", problem));
  }

  std::string_view OpcodeNote() const override {
    return " (not one torch.save emits for state dicts)";
  }

  // A dict or list subclass pickled by class (defaultdict, a user's dict subclass) gets its
  // items as a dict or a list does: listed, not refused.
  bool ObjectsTakeItems() const override { return opaque_objects_; }

  void CheckGlobal(const std::string& module, const std::string& name) override {
    if (!opaque_objects_ && !Allowed(module + "." + name)) {
      Fail(StrCat("global '", module, ".", name,
                  "' is not allowed (tensortier reads the tensor, storage, dtype and container "
                  "types of state dicts; torch.load(weights_only=True) may accept more)"));
    }
  }

  uint32_t Call(uint32_t callable, uint32_t args, bool) override { return Reduce(callable, args); }

  // BUILD: state_dict() sets OrderedDict._metadata, which torch.save pickles as BUILD's state.
  // torch.load(weights_only=True) accepts it on an OrderedDict or a tensor; it is an attribute,
  // not an item, so it is dropped here: it holds no tensors of the state dict.
  void Build(uint32_t target, uint32_t state) override {
    if (values_[target].kind == Kind::kObject) {  // opaque: its state may hold tensors
      values_[target].state = state;
      return;
    }
    if (values_[target].kind != Kind::kDict && values_[target].kind != Kind::kTensor) {
      Fail("BUILD on something that is not an OrderedDict or a tensor");
    }
    Kind k = values_[state].kind;
    if (k != Kind::kDict && k != Kind::kNone && k != Kind::kTuple) {
      Fail("BUILD state is not a dict, a tuple or None");
    }
  }

  const Value& Arg(const std::vector<uint32_t>& args, size_t i, Kind kind, std::string_view what) {
    const Value& v = values_[args[i]];
    if (v.kind != kind) Fail(StrCat(what, " has the wrong type"));
    return v;
  }

  std::vector<int64_t> IntTuple(uint32_t index, std::string_view what) {
    const Value& v = values_[index];
    if (v.kind != Kind::kTuple) Fail(StrCat(what, " is not a tuple"));
    if (v.items.size() > kMaxRank) Fail(StrCat(what, " has more than ", kMaxRank, " dimensions"));
    std::vector<int64_t> out;
    for (uint32_t item : v.items) {
      if (values_[item].kind != Kind::kInt || values_[item].i < 0) {
        Fail(StrCat(what, " holds something other than a non-negative int"));
      }
      out.push_back(values_[item].i);
    }
    return out;
  }

  uint32_t PersistentLoad(uint32_t pid) override {
    const Value& t = values_[pid];
    if (t.kind != Kind::kTuple || t.items.size() != 5) {
      Fail("persistent id is not a ('storage', type, key, location, numel) tuple");
    }
    const auto& a = t.items;
    if (values_[a[0]].kind != Kind::kStr || values_[a[0]].s != "storage") {
      Fail("persistent id does not start with 'storage'");
    }
    const Value& type = Arg(a, 1, Kind::kGlobal, "storage type");
    const Value& key = Arg(a, 2, Kind::kStr, "storage key");
    const Value& location = Arg(a, 3, Kind::kStr, "storage location");
    const Value& numel = Arg(a, 4, Kind::kInt, "storage size");
    std::string_view type_name = std::string_view(type.s).substr(type.s.rfind('.') + 1);
    std::string_view dtype = StorageDtype(type_name);
    if (dtype.empty()) Fail(StrCat("'", type.s, "' is not a storage type tensortier reads"));
    if (key.s.empty() || key.s.size() > 64 ||
        key.s.find_first_not_of(
            "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_") !=
            std::string::npos) {
      Fail("storage key is not a plain name");
    }
    if (numel.i < 0) Fail("negative storage size");
    if (location.s.size() > 64) Fail("storage location too long");
    unsigned itemsize = TorchDtypeBytes(dtype);
    auto n = static_cast<uint64_t>(numel.i);
    if (n > UINT64_MAX / itemsize) Fail("storage size overflows");
    TorchStorage s{key.s, std::string(dtype), n, n * itemsize, location.s};
    auto [it, inserted] = out_.storages.emplace(key.s, s);
    // torch.save names every empty storage after address 0 whatever its dtype (its check that a
    // storage keeps one dtype skips those), and torch.load makes each one anew: only storages
    // with bytes must be described alike.
    const bool both_empty = it->second.nbytes == 0 && s.nbytes == 0;
    if (!inserted && !both_empty &&
        (it->second.nbytes != s.nbytes || it->second.dtype != s.dtype)) {
      Fail(StrCat("storage '", key.s, "' is described twice, differently"));
    }
    // The value remembers this description's type: a tensor rebuilt on it (v2) has its dtype.
    const Dtype* row = DtypeOfStorage(type_name);
    const int64_t type_index = row != nullptr ? row - Dtypes().data() : kUntypedStorage;
    return Scalar(Kind::kStorage, type_index, key.s);
  }

  // The conj and neg bits of _rebuild_tensor_v2/_v3's metadata argument (a dict, or None):
  // a tensor saved with one set holds, in its storage, other numbers than its values.
  void ReadTensorFlags(uint32_t metadata, TorchTensor& t) {
    const Value& m = values_[metadata];
    if (m.kind == Kind::kNone) return;
    if (m.kind != Kind::kDict) Fail("tensor metadata is not a dict");
    for (size_t i = 0; i + 1 < m.items.size(); i += 2) {
      const Value& key = values_[m.items[i]];
      const Value& value = values_[m.items[i + 1]];
      if (key.kind != Kind::kStr || value.kind != Kind::kBool) continue;
      if (key.s == "conj") t.conj = value.i != 0;
      if (key.s == "neg") t.neg = value.i != 0;
    }
  }

  // The size and stride tuples of a tensor being rebuilt, within the pickle's bounds.
  void ReadShape(TorchTensor& t, uint32_t size, uint32_t stride) {
    if (tensors_.size() >= max_tensors_) {
      Fail(StrCat("more than ", max_tensors_, " tensors rebuilt in a ", data_.size(),
                  "-byte pickle"));
    }
    t.shape = IntTuple(size, "tensor size");
    t.stride = IntTuple(stride, "tensor stride");
    if (t.shape.size() != t.stride.size()) Fail("tensor size and stride differ in length");
    dims_ += 2 * t.shape.size();
    if (dims_ > max_dims_) {
      Fail(StrCat("tensor sizes and strides hold more than ", max_dims_, " values in a ",
                  data_.size(), "-byte pickle"));
    }
  }

  // Our name of the torch dtype global a[i] (torch.float32 -> "F32").
  std::string DtypeArg(const std::vector<uint32_t>& a, size_t i) {
    const Value& dtype = Arg(a, i, Kind::kGlobal, "tensor dtype");
    std::string_view name = std::string_view(dtype.s).substr(dtype.s.rfind('.') + 1);
    const Dtype* ours = Readable(DtypeOfTorch(name));
    if (ours == nullptr) Fail(StrCat("'", dtype.s, "' is not a supported dtype"));
    return std::string(ours->name);
  }

  // _rebuild_meta_tensor_no_storage(dtype, size, stride, requires_grad): no data.
  uint32_t MakeMetaTensor(const std::vector<uint32_t>& a) {
    TorchTensor t;
    t.meta = true;
    t.dtype = DtypeArg(a, 0);
    ReadShape(t, a[1], a[2]);
    t.requires_grad = Arg(a, 3, Kind::kBool, "requires_grad").i != 0;
    tensors_.push_back(std::move(t));
    return Scalar(Kind::kTensor, static_cast<int64_t>(tensors_.size() - 1));
  }

  uint32_t MakeTensor(const std::vector<uint32_t>& a, std::string dtype,
                      std::optional<uint32_t> metadata = std::nullopt) {
    const Value& storage = Arg(a, 0, Kind::kStorage, "tensor storage");
    const Value& offset = Arg(a, 1, Kind::kInt, "tensor storage offset");
    TorchTensor t;
    t.storage_key = storage.s;
    t.storage_offset = offset.i;
    if (t.storage_offset < 0) Fail("negative storage offset");
    ReadShape(t, a[2], a[3]);
    t.requires_grad = Arg(a, 4, Kind::kBool, "requires_grad").i != 0;
    if (metadata) ReadTensorFlags(*metadata, t);
    const TorchStorage& s = out_.storages.at(storage.s);
    if (dtype.empty()) {  // the storage's, as described
      dtype = storage.i == kUntypedStorage ? "U8" : Dtypes()[storage.i].name;
    }
    t.dtype = std::move(dtype);
    // The furthest element the tensor touches must lie inside its storage. Empty tensors touch
    // nothing (whatever their other sizes). Otherwise every dimension that moves (size > 1,
    // stride > 0) has size and stride at most the storage's element count n, and the running
    // sum stays below n: each step adds at most n * n, so the 128-bit sum never wraps.
    unsigned itemsize = TorchDtypeBytes(t.dtype);
    using U = unsigned __int128;
    const uint64_t n = s.nbytes / itemsize;  // elements of the tensor's dtype in the storage
    bool empty = std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end();
    auto past_end = [&] {
      Fail(StrCat("tensor reaches past the end of storage '", s.key, "' (", s.nbytes, " bytes)"));
    };
    if (!empty) {
      U last = static_cast<U>(t.storage_offset);
      if (last >= n) past_end();
      for (size_t i = 0; i < t.shape.size(); ++i) {
        if (t.shape[i] <= 1 || t.stride[i] == 0) continue;
        auto size = static_cast<uint64_t>(t.shape[i]);
        auto stride = static_cast<uint64_t>(t.stride[i]);
        if (size > n || stride > n) past_end();
        last += static_cast<U>(size - 1) * stride;
        if (last >= n) past_end();
      }
    }
    tensors_.push_back(std::move(t));
    return Scalar(Kind::kTensor, static_cast<int64_t>(tensors_.size() - 1));
  }

  uint32_t Reduce(uint32_t callable, uint32_t args_index) {
    if (values_[callable].kind != Kind::kGlobal) Fail("REDUCE of something that is not a global");
    if (values_[args_index].kind != Kind::kTuple) Fail("REDUCE arguments are not a tuple");
    const std::string& f = values_[callable].s;
    std::vector<uint32_t> a = values_[args_index].items;  // copy: New() may move values_
    auto need = [&](size_t lo, size_t hi) {
      if (a.size() < lo || a.size() > hi) Fail(StrCat("wrong number of arguments to ", f));
    };
    if (f == "collections.OrderedDict") {
      need(0, 0);
      Value v;
      v.kind = Kind::kDict;
      return New(std::move(v));
    }
    if (f == "collections.Counter") {  // Counter(dict) or Counter(): a dict
      need(0, 1);
      if (a.empty()) {
        Value v;
        v.kind = Kind::kDict;
        return New(std::move(v));
      }
      Arg(a, 0, Kind::kDict, "Counter argument");
      return a[0];
    }
    if (f == "torch._tensor._rebuild_from_type_v2") {
      // A tensor with Python attributes (or of a Tensor/Parameter type): func(*args) rebuilds
      // it; the type and the attributes (the state) do not change its data.
      need(4, 4);
      if (values_[a[0]].kind != Kind::kGlobal || values_[a[0]].s == f) {
        Fail("_rebuild_from_type_v2 of something that is not a rebuild function");
      }
      const std::string& type = Arg(a, 1, Kind::kGlobal, "tensor type").s;
      if (type != "torch.Tensor" && type != "torch.nn.parameter.Parameter") {
        Fail(StrCat("tensor type '", type, "' is not supported"));
      }
      return Reduce(a[0], a[2]);
    }
    if (f == "torch.serialization._get_layout") {  // torch.strided and the other layouts
      need(1, 1);
      return Scalar(Kind::kStr, 0, Arg(a, 0, Kind::kStr, "layout name").s);
    }
    if (f == "torch._utils._rebuild_tensor_v2") {
      need(6, 7);
      return MakeTensor(a, "", a.size() == 7 ? std::optional<uint32_t>(a[6]) : std::nullopt);
    }
    if (f == "torch._utils._rebuild_tensor_v3") {
      need(7, 8);
      return MakeTensor(a, DtypeArg(a, 6),
                        a.size() == 8 ? std::optional<uint32_t>(a[7]) : std::nullopt);
    }
    if (f == "torch._utils._rebuild_meta_tensor_no_storage") {
      need(4, 4);
      return MakeMetaTensor(a);
    }
    if (f == "torch._utils._rebuild_qtensor") {
      // (storage, offset, size, stride, quantizer parameters, requires_grad, hooks): the typed
      // storage holds the quantized integers; the parameters (scheme, scale and zero point, or
      // per-channel tensors and axis) say how to read them, not where they are.
      need(7, 7);
      const Value& storage = Arg(a, 0, Kind::kStorage, "quantized tensor storage");
      if (storage.i == kUntypedStorage || !Dtypes()[storage.i].quantized) {
        Fail(StrCat("quantized tensor on a ",
                    storage.i == kUntypedStorage ? "UntypedStorage" : Dtypes()[storage.i].storage));
      }
      const Value& params = Arg(a, 4, Kind::kTuple, "quantizer parameters");
      if (params.items.empty() || values_[params.items[0]].kind != Kind::kGlobal ||
          !values_[params.items[0]].s.starts_with("torch.per_")) {
        Fail("quantizer parameters do not start with a quantization scheme");
      }
      return MakeTensor({a[0], a[1], a[2], a[3], a[5], a[6]}, "");
    }
    if (f == "torch._utils._rebuild_parameter" ||
        f == "torch._utils._rebuild_parameter_with_state") {
      need(f.ends_with("state") ? 4 : 3, f.ends_with("state") ? 4 : 3);
      // Shares the data's TorchTensor: copying it would let `h h R` repeated copy 64-dimension
      // vectors for 5 bytes each.
      Value v;
      v.kind = Kind::kTensor;
      v.i = Arg(a, 0, Kind::kTensor, "parameter data").i;
      v.parameter = true;
      v.requires_grad = Arg(a, 1, Kind::kBool, "requires_grad").i != 0;
      return New(std::move(v));
    }
    if (f == "torch.Size") {
      need(1, 1);
      IntTuple(a[0], "torch.Size argument");
      return a[0];
    }
    if (f == "torch.device") {
      need(1, 2);
      if (Arg(a, 0, Kind::kStr, "device type").s.size() > 64) Fail("device name too long");
      std::string d = values_[a[0]].s;
      if (a.size() == 2) d += StrCat(":", Arg(a, 1, Kind::kInt, "device index").i);
      return Scalar(Kind::kStr, 0, std::move(d));
    }
    if (f.ends_with(".complex")) {  // a Python complex number: complex(real, imag)
      need(1, 2);
      for (uint32_t part : a) {
        Kind k = values_[part].kind;
        if (k != Kind::kFloat && k != Kind::kInt && k != Kind::kBigInt) {
          Fail("complex() of something that is not a number");
        }
      }
      return Scalar(Kind::kFloat);
    }
    if (f == "_codecs.encode") {
      need(2, 2);
      Arg(a, 0, Kind::kStr, "bytes text");
      return Scalar(Kind::kBytes);  // content unused: not copying it keeps memory linear
    }
    if (f.ends_with(".set") || f.ends_with(".frozenset") || f.ends_with(".bytearray")) {
      need(0, 1);
      bool bytes = f.ends_with(".bytearray");
      if (a.empty()) {
        Value v;
        v.kind = bytes ? Kind::kBytes : Kind::kList;
        return New(std::move(v));
      }
      // The argument itself stands for the result: copying it would let a short pickle that
      // calls set(big_list) many times allocate quadratically.
      if (values_[a[0]].kind != (bytes ? Kind::kBytes : Kind::kList)) {
        Fail(StrCat(f, " argument has the wrong type"));
      }
      return a[0];
    }
    if (opaque_objects_ && !Allowed(f)) {
      Value v;
      v.kind = Kind::kObject;
      v.s = f;
      v.items = std::move(a);
      return New(std::move(v));
    }
    Fail(StrCat("'", f, "' cannot be called"));
  }

  // Collects tensors depth-first with their key paths. Shared subtrees are walked each time they
  // appear (bounded by kMaxVisits); cycles are an error.
  void Walk(uint32_t index, const std::string& path, size_t depth, std::vector<bool>& on_path) {
    if (++visits_ > kMaxVisits) WalkFail("object graph too large to walk");
    if (path.size() > kMaxPath) WalkFail(StrCat("key path longer than ", kMaxPath, " bytes"));
    path_bytes_ += path.size();
    if (path_bytes_ > max_output_bytes_) {
      WalkFail(StrCat("the key paths walked would take more than ", max_output_bytes_,
                      " bytes (shared subtrees repeat them) for a ", data_.size(), "-byte pickle"));
    }
    if (depth > kMaxDepth) WalkFail(StrCat("nesting deeper than ", kMaxDepth, " at '", path, "'"));
    const Value& v = values_[index];
    auto child = [&](const std::string& key) { return path.empty() ? key : path + "." + key; };
    switch (v.kind) {
      case Kind::kTensor: {
        if (out_.tensors.size() >= kMaxTensors) WalkFail("more than 1048576 tensors");
        TorchTensor t = tensors_[static_cast<size_t>(v.i)];
        if (v.parameter) {
          t.parameter = true;
          t.requires_grad = v.requires_grad;
        }
        // Shared subtrees emit a tensor per appearance, with its full key path: bound the sum.
        output_bytes_ += sizeof(TorchTensor) + path.size() + t.storage_key.size() +
                         sizeof(int64_t) * (t.shape.size() + t.stride.size());
        if (output_bytes_ > max_output_bytes_) {
          WalkFail(StrCat("the tensors listed would take more than ", max_output_bytes_,
                          " bytes (shared subtrees repeat them) for a ", data_.size(),
                          "-byte pickle"));
        }
        t.path = path;
        out_.tensors.push_back(std::move(t));
        return;
      }
      case Kind::kList:
      case Kind::kTuple:
      case Kind::kDict:
        break;
      case Kind::kObject:  // opaque: a value of its own, and tensors in what rebuilds it
        if (inside_object_ == 0) ++out_.other_values;
        break;
      case Kind::kStorage:
        WalkFail(StrCat("a bare storage at '", path, "' (only tensors are supported)"));
      default:
        if (inside_object_ == 0) ++out_.other_values;
        return;
    }
    if (on_path[index]) WalkFail(StrCat("the object at '", path, "' contains itself"));
    on_path[index] = true;
    inside_object_ += v.kind == Kind::kObject;     // what rebuilds it is no value of the file's
    // values_ does not change during the walk
    // A scalar child is counted without building its key path: only tensors and containers
    // need theirs (and pay for them in path_bytes_).
    auto scalar = [&](uint32_t item) {
      switch (values_[item].kind) {
        case Kind::kTensor:
        case Kind::kList:
        case Kind::kTuple:
        case Kind::kDict:
        case Kind::kObject:
        case Kind::kStorage:
          return false;
        default:
          if (++visits_ > kMaxVisits) WalkFail("object graph too large to walk");
          if (inside_object_ == 0) ++out_.other_values;
          return true;
      }
    };
    auto walk_items = [&](const std::vector<uint32_t>& items, bool keyed) {
      if (keyed) {
        for (size_t i = 0; i + 1 < items.size(); i += 2) {
          if (scalar(items[i + 1])) continue;
          const Value& k = values_[items[i]];
          std::string key = k.kind == Kind::kStr   ? k.s
                            : k.kind == Kind::kInt ? std::to_string(k.i)
                                                   : std::string("<key>");
          Walk(items[i + 1], child(key), depth + 1, on_path);
        }
      } else {
        for (size_t i = 0; i < items.size(); ++i) {
          if (!scalar(items[i])) Walk(items[i], child(std::to_string(i)), depth + 1, on_path);
        }
      }
    };
    if (v.kind == Kind::kObject) {  // what made it, its state, its contents as a dict or list
      walk_items(v.items, false);
      if (v.state != UINT32_MAX) Walk(v.state, child("state"), depth + 1, on_path);
      if (auto found = contents_.find(index); found != contents_.end()) {
        walk_items(found->second.items, found->second.keyed);
      }
    } else {
      walk_items(v.items, v.kind == Kind::kDict);
    }
    inside_object_ -= v.kind == Kind::kObject;
    on_path[index] = false;
  }

  std::string what_;
  const bool opaque_objects_;
  const size_t max_tensors_;
  const size_t max_dims_;
  const uint64_t max_output_bytes_;
  std::vector<TorchTensor> tensors_;  // every tensor built, by kTensor value
  size_t dims_ = 0;                   // sizes and strides held by tensors_
  uint64_t output_bytes_ = 0;         // estimated size of out_.tensors
  uint64_t path_bytes_ = 0;           // key path bytes built by the walk
  uint64_t visits_ = 0;
  size_t inside_object_ = 0;  // opaque objects being walked (their parts are not values)
  TorchPickle out_;
};

}  // namespace

TorchPickle ParseTorchPickle(std::string_view data, const std::string& what, bool opaque_objects) {
  return Vm(data, what, opaque_objects).Run();
}

}  // namespace tensortier
