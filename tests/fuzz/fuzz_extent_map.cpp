// Fuzz target: an extent map's JSON through the parser; accepted maps must survive a
// write/parse round trip unchanged.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "tensortier/data/extent_map.hpp"
#include "tensortier/util/format_error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tensortier;
  ExtentMap map;
  try {
    map = ParseExtentMap(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const FormatError&) {
    return 0;
  }
  if (ParseExtentMap(ExtentMapToJson(map), "again") != map) std::abort();
  return 0;
}
