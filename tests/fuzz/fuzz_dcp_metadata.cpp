// Fuzz target: bytes as a DCP .metadata, through the restricted pickle reader and through the
// index tensortier puts before the pickle (its two xxh64s fixed up first, so that mutations reach
// the decoder), then the lookups of the table a load plans with.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/util/format_error.hpp"

namespace {

void PutLe64(std::string& d, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) d[at + i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}

// The index's sums made to match what follows them (layout: dcp_metadata_index.cpp).
void FixSums(std::string& d) {
  constexpr size_t kStart = 7;  // PROTO 4, BINBYTES and its length
  if (d.size() < kStart + 24 ||
      d.compare(0, 3,
                std::string("\x80\x04"
                            "B",
                            3)) != 0 ||
      d.compare(kStart, 8, "TTDCPIX1") != 0) {
    return;
  }
  uint64_t n = 0;
  for (int i = 0; i < 4; ++i) n |= uint64_t{static_cast<unsigned char>(d[3 + i])} << (8 * i);
  if (n < 24 || n > d.size() - kStart - 1) return;
  const std::string body = d.substr(kStart + n + 1);
  const std::string payload = d.substr(kStart + 24, n - 24);
  PutLe64(d, kStart + 8, tensortier::Xxh64(body.data(), body.size()));
  PutLe64(d, kStart + 16, tensortier::Xxh64(payload.data(), payload.size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tensortier;
  std::string d(reinterpret_cast<const char*>(data), size);
  try {
    ParseDcpMetadata(d, "m");
  } catch (const FormatError&) {
  }
  FixSums(d);
  try {
    auto md = ReadDcpMetadataIndex(d, "m");
    if (!md) return 0;
    const DcpMetadataTable table(std::move(*md));
    for (const auto& e : table.contents().entries) {
      if (table.Entry(e.fqn) == nullptr) std::abort();
      table.StoredWhole(e);
      for (const auto& chunk : e.chunks) {
        if (table.ChunkSizes(e.fqn, chunk.first) == nullptr) std::abort();
      }
    }
    for (const auto& s : table.contents().storage) {
      if (table.Storage(s.fqn, s.offset) == nullptr) std::abort();
    }
    table.Files();
  } catch (const FormatError&) {
  }
  return 0;
}
