// The safetensors format: an 8-byte little-endian header length N, N bytes of JSON, then the data
// section. The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the data section) plus an optional "__metadata__" string->string map.
//
// The parser accepts the files the `safetensors` package accepts (fields of a tensor other than
// these three are passed over, as there), with tighter limits: no duplicate keys (the package
// keeps the last of a duplicate tensor name: a file naming a tensor twice is refused here), byte
// ranges that tile the data section (no overlap, no gap, no byte past its end), at most kMaxRank
// dimensions. It never allocates more than a small multiple of the header size and never
// recurses.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/io/file.hpp"

namespace tensortier {

inline constexpr uint64_t kSafetensorsMaxHeader = 100'000'000;  // as the safetensors package
inline constexpr size_t kSafetensorsMaxRank = 64;

// Bits per element of a safetensors dtype name ("F32" -> 32, "F4" -> 4), 0 when unknown.
unsigned SafetensorsDtypeBits(std::string_view dtype);

// Every safetensors dtype name, in the safetensors package's order.
std::vector<std::string_view> SafetensorsDtypeNames();

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // safetensors name: "F32", "BF16", "F8_E4M3"...
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // [begin, end) relative to the data section
  uint64_t end = 0;
};

using SafetensorsMetadata = std::map<std::string, std::string>;

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // sorted by begin (file order)
  SafetensorsMetadata metadata;
};

// Parses and validates the JSON header of a file whose data section is `data_bytes` long.
// Throws FormatError naming the tensor (or the JSON position) and the problem.
SafetensorsHeader ParseSafetensorsHeader(std::string_view json, uint64_t data_bytes);

// The 8-byte length and the JSON for `entries` and `metadata`, padded with spaces so the result's
// size is a multiple of `alignment` (a power of two, >= 8): data written right after it starts
// aligned. Entries are validated as the parser would (the result always parses back to them);
// throws FormatError / std::invalid_argument otherwise.
std::string SerializeSafetensorsHeader(const std::vector<SafetensorsEntry>& entries,
                                       const SafetensorsMetadata& metadata,
                                       uint64_t alignment = 4096);

// Metadata keys of tensortier's checksums: per-tensor xxh64 of the data (a JSON object of name ->
// 16 hex digits), and the xxh64 of everything else the header says (SafetensorsHeaderDigest).
inline constexpr const char* kTensorChecksumsKey = "tensortier.xxh64";
inline constexpr const char* kHeaderChecksumKey = "tensortier.header_xxh64";

// A stored checksum's text: exactly 16 hex digits (either case), as tensortier.save writes them.
// nullopt for anything else: "0x", "_", spaces, signs, another length.
std::optional<uint64_t> ParseStoredChecksum(std::string_view text);

// The kTensorChecksumsKey metadata value: a JSON object of tensor name -> checksum text (each
// for ParseStoredChecksum). Throws FormatError (message starting with the key) for anything but
// a JSON object of strings, or a name given twice.
std::map<std::string, std::string> ParseTensorChecksums(std::string_view text);

// What kTensorChecksumsKey metadata `text` says of a file holding the tensors `names`: the one
// rule tensortier.load(verify=True), `tensortier verify` and `convert` follow. A checksum for a
// name the file does not hold means the metadata is not this file's: a problem, as is a tensor
// without a checksum or with one that is not 16 hex digits. Throws as ParseTensorChecksums.
struct TensorChecksums {
  std::vector<std::optional<uint64_t>> want;  // per tensor of `names`: its xxh64, if usable
  // Every problem, one sentence each: the names the file does not hold (sorted), then the
  // tensors' own in the order of `names`.
  std::vector<std::string> problems;
};
TensorChecksums ReadTensorChecksums(std::string_view text, const std::vector<std::string>& names);

// xxh64 of a canonical form of what a header says: each entry (sorted by name) as
// "T<len>:<name><len>:<dtype><dims comma-separated>:<begin>:<end>\n", then each metadata item
// (sorted by key) except the two checksum keys as "M<len>:<key><len>:<value>\n" (lengths in
// bytes). Independent of JSON layout, key order and padding; covers names, dtypes, shapes,
// offsets and user metadata, which the per-tensor data checksums do not.
uint64_t SafetensorsHeaderDigest(const std::vector<SafetensorsEntry>& entries,
                                 const SafetensorsMetadata& metadata);

struct SafetensorsFileInfo {
  uint64_t file_size = 0;
  uint64_t data_start = 0;  // 8 + N: absolute offset of the data section
  SafetensorsHeader header;
};

// Reads (pread) and parses the header of an open file. Throws IoError for I/O failures and
// FormatError (message starting with the path) for content problems, truncation included.
SafetensorsFileInfo ReadSafetensorsHeader(const ByteSource& source);
SafetensorsFileInfo ReadSafetensorsHeader(const File& file);
SafetensorsFileInfo ReadSafetensorsHeader(const std::string& path);

}  // namespace tensortier
