// Arguments of the offloader's bindings, read the same way by each: an operation's kind ('write'
// or 'read') and host pieces, (key, address, length) tuples.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "tensortier/offload/offloader.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

using OffloadPieceTuple = std::tuple<uint64_t, uintptr_t, uint64_t>;

inline OffloadKind ParseOffloadKind(const std::string& kind) {
  if (const auto parsed = ValueOf(kOffloadKindNames, kind)) return *parsed;
  throw std::invalid_argument(StrCat(
      "kind must be ", JoinNames(kOffloadKindNames, ", ", " or ", "'"), ", not '", kind, "'"));
}

inline std::vector<OffloadPiece> ToPieces(const std::vector<OffloadPieceTuple>& pieces) {
  std::vector<OffloadPiece> out;
  out.reserve(pieces.size());
  for (const auto& [key, address, length] : pieces) {
    out.push_back({key, reinterpret_cast<void*>(address), length});
  }
  return out;
}

}  // namespace tensortier
