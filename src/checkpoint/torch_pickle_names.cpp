// What a torch.save pickle may name (torch_pickle_names.hpp), and the torch dtype facts of
// torch_pickle.hpp, all from the dtype table.
#include "tensortier/checkpoint/torch_pickle_names.hpp"

#include <algorithm>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"

namespace tensortier {
namespace torch_pickle_names {

const Dtype* Readable(const Dtype* d) {
  return d != nullptr && !(d->quantized && d->packing > 1) ? d : nullptr;
}

std::string_view StorageDtype(std::string_view storage) {
  if (storage == "UntypedStorage") return "U8";
  const Dtype* d = Readable(DtypeOfStorage(storage));
  return d != nullptr ? d->name : std::string_view();
}

bool Allowed(std::string_view g) {
  static constexpr std::string_view kCallables[] = {
      "collections.OrderedDict",
      "torch._utils._rebuild_tensor_v2",
      "torch._utils._rebuild_tensor_v3",
      "torch._utils._rebuild_parameter",
      "torch._utils._rebuild_parameter_with_state",
      "torch._utils._rebuild_qtensor",
      "torch._utils._rebuild_meta_tensor_no_storage",
      "torch.Size",
      "torch.device",
      "torch.Tensor",
      "torch.nn.parameter.Parameter",
      "torch._tensor._rebuild_from_type_v2",
      "torch.serialization._get_layout",
      "collections.Counter",
      "_codecs.encode",
      "builtins.set",
      "builtins.frozenset",
      "builtins.bytearray",
      "builtins.complex",
      "__builtin__.set",
      "__builtin__.frozenset",
      "__builtin__.bytearray",
      "__builtin__.complex",
  };
  for (auto c : kCallables) {
    if (c == g) return true;
  }
  // Values torch.load(weights_only=True) allows beside dtypes: quantization schemes (a
  // quantizer's settings in a state dict), not callable here (only kCallables are).
  constexpr std::string_view kQuantizationSchemes[] = {
      "per_tensor_affine",
      "per_channel_affine",
      "per_tensor_symmetric",
      "per_channel_symmetric",
      "per_channel_affine_float_qparams",
  };
  if (g.starts_with("torch.") && g.find('.', 6) == std::string_view::npos) {
    std::string_view attr = g.substr(6);
    // A dtype as a value (a config's torch.quint4x2) is fine even where its tensors are not.
    return !StorageDtype(attr).empty() || DtypeOfTorch(attr) != nullptr ||
           std::find(std::begin(kQuantizationSchemes), std::end(kQuantizationSchemes), attr) !=
               std::end(kQuantizationSchemes);
  }
  return g == "torch.storage.UntypedStorage";
}

}  // namespace torch_pickle_names

unsigned TorchDtypeBytes(std::string_view dtype) {
  const Dtype* d = DtypeNamed(dtype);
  return d != nullptr && !d->torch.empty() ? d->bits / 8 : 0;
}

std::string_view TorchDtypeAttribute(std::string_view dtype) {
  const Dtype* d = DtypeNamed(dtype);
  return d != nullptr ? d->torch : std::string_view();
}

std::optional<TorchHeldDtype> TorchHeldDtypeOf(std::string_view dtype) {
  if (SafetensorsDtypeBits(dtype) == 0) return std::nullopt;
  for (const Dtype& d : Dtypes()) {
    if (d.safetensors == dtype && !d.torch.empty()) {
      return TorchHeldDtype{std::string(dtype), std::string(d.name), d.torch, d.packing};
    }
  }
  return std::nullopt;
}

std::vector<TorchHeldDtype> SafetensorsDtypesForTorch() {
  std::vector<TorchHeldDtype> out;
  for (std::string_view dtype : SafetensorsDtypeNames()) {
    if (auto held = TorchHeldDtypeOf(dtype)) out.push_back(std::move(*held));
  }
  return out;
}

bool TorchTensor::contiguous() const {
  uint64_t expected = 1;  // unsigned: empty tensors may have absurd sizes that would overflow
  for (size_t i = shape.size(); i > 0; --i) {
    if (shape[i - 1] == 0) return true;
    if (shape[i - 1] != 1 && static_cast<uint64_t>(stride[i - 1]) != expected) return false;
    expected *= static_cast<uint64_t>(shape[i - 1]);
  }
  return true;
}

uint64_t TorchTensor::nbytes() const {
  if (meta) return 0;
  uint64_t n = TorchDtypeBytes(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace tensortier
