// Fuzz target: a whole safetensors file through the header reader; accepted headers must survive
// a write/parse round trip unchanged.
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/checkpoint/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tensortier;
  SafetensorsFileInfo info;
  try {
    info = ReadSafetensorsHeader(MemorySource(data, size, "fuzz"));
  } catch (const FormatError&) {
    return 0;
  }
  std::string again = SerializeSafetensorsHeader(info.header.entries, info.header.metadata, 8);
  uint64_t data_bytes = info.file_size - info.data_start;
  SafetensorsHeader back = ParseSafetensorsHeader(std::string_view(again).substr(8), data_bytes);
  if (back.entries.size() != info.header.entries.size() || back.metadata != info.header.metadata) {
    std::abort();
  }
  for (size_t i = 0; i < back.entries.size(); ++i) {
    const auto& a = back.entries[i];
    const auto& b = info.header.entries[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.begin != b.begin ||
        a.end != b.end) {
      std::abort();
    }
  }
  return 0;
}
