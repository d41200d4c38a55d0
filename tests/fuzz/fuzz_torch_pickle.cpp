// Fuzz target: bytes as a torch data.pkl through the restricted pickle reader.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "tensortier/util/format_error.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tensortier;
  try {
    TorchPickle p = ParseTorchPickle(std::string_view(reinterpret_cast<const char*>(data), size));
    for (const auto& t : p.tensors) {
      if (!t.meta && !p.storages.contains(t.storage_key)) std::abort();  // meta: no storage
    }
  } catch (const FormatError&) {
  }
  return 0;
}
