#include "tensortier/checkpoint/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <set>
#include <utility>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr std::string_view kWhat = "safetensors header";
constexpr std::string_view kMetadataKey = "__metadata__";

std::string Quoted(std::string_view name) {
  // Names are shown as JSON strings so control characters and quotes stay visible.
  try {
    return JsonQuote(name);
  } catch (const std::invalid_argument&) {
    return "<name that is not UTF-8>";
  }
}

[[noreturn]] void TensorError(std::string_view name, std::string_view problem) {
  throw FormatError(StrCat(kWhat, ": tensor ", Quoted(name), ": ", problem));
}

SafetensorsMetadata ParseMetadata(JsonReader& r) {
  SafetensorsMetadata out;
  if (r.ConsumeNull()) return out;
  if (r.Peek() != '{') r.Fail("__metadata__ must be an object of strings");
  r.Expect('{');
  if (r.Consume('}')) return out;
  do {
    std::string key = r.ReadString();
    r.Expect(':');
    if (r.Peek() != '"') {
      r.Fail(StrCat("__metadata__ value of ", Quoted(key), " is not a string"));
    }
    std::string value = r.ReadString();
    auto [it, inserted] = out.emplace(std::move(key), std::move(value));
    if (!inserted) r.Fail(StrCat("duplicate __metadata__ key ", Quoted(it->first)));
  } while (r.Consume(','));
  r.Expect('}');
  return out;
}

void ParseEntry(JsonReader& r, SafetensorsEntry& e) {
  if (r.Peek() != '{') r.Fail(StrCat("tensor ", Quoted(e.name), " is not an object"));
  r.Expect('{');
  bool have_dtype = false, have_shape = false, have_offsets = false;
  if (!r.Consume('}')) {
    do {
      std::string field = r.ReadString();
      r.Expect(':');
      bool* seen;
      if (field == "dtype") {
        seen = &have_dtype;
        if (r.Peek() != '"') r.Fail(StrCat("tensor ", Quoted(e.name), ": dtype is not a string"));
        e.dtype = r.ReadString();
      } else if (field == "shape") {
        seen = &have_shape;
        e.shape.clear();
        r.Expect('[');
        if (!r.Consume(']')) {
          do {
            if (e.shape.size() == kSafetensorsMaxRank) {
              r.Fail(StrCat("tensor ", Quoted(e.name), ": more than ", kSafetensorsMaxRank,
                            " dimensions"));
            }
            e.shape.push_back(r.ReadUint());
          } while (r.Consume(','));
          r.Expect(']');
        }
      } else if (field == "data_offsets") {
        seen = &have_offsets;
        r.Expect('[');
        e.begin = r.ReadUint();
        r.Expect(',');
        e.end = r.ReadUint();
        if (r.Peek() != ']') {
          r.Fail(StrCat("tensor ", Quoted(e.name), ": data_offsets must be [begin, end]"));
        }
        r.Expect(']');
      } else {
        // Other writers may add fields; the safetensors package ignores them, and so do we.
        r.SkipValue();
        continue;
      }
      if (*seen) r.Fail(StrCat("tensor ", Quoted(e.name), ": duplicate field ", Quoted(field)));
      *seen = true;
    } while (r.Consume(','));
    r.Expect('}');
  }
  if (!have_dtype) TensorError(e.name, "missing dtype");
  if (!have_shape) TensorError(e.name, "missing shape");
  if (!have_offsets) TensorError(e.name, "missing data_offsets");
}

void CheckSize(const SafetensorsEntry& e) {
  unsigned bits = SafetensorsDtypeBits(e.dtype);
  if (bits == 0) TensorError(e.name, StrCat("unknown dtype ", Quoted(e.dtype)));
  uint64_t elements = 1;
  for (uint64_t d : e.shape) {
    if (d != 0 && elements > UINT64_MAX / d) TensorError(e.name, "shape product overflows");
    elements *= d;
  }
  if (elements > UINT64_MAX / bits) TensorError(e.name, "shape product overflows");
  uint64_t total_bits = elements * bits;
  if (total_bits % 8 != 0) {
    TensorError(e.name, StrCat(elements, " elements of ", e.dtype, " are not a whole byte count"));
  }
  if (e.begin > e.end) {
    TensorError(e.name, StrCat("data_offsets [", e.begin, ", ", e.end, "] has begin > end"));
  }
  if (e.end - e.begin != total_bits / 8) {
    TensorError(e.name, StrCat("shape and dtype need ", total_bits / 8, " bytes but data_offsets [",
                               e.begin, ", ", e.end, "] hold ", e.end - e.begin));
  }
}

}  // namespace

std::vector<std::string_view> SafetensorsDtypeNames() {
  std::vector<std::string_view> names;
  for (const Dtype& d : Dtypes()) {
    if (d.name == d.safetensors) names.push_back(d.name);
  }
  return names;
}

unsigned SafetensorsDtypeBits(std::string_view dtype) {
  const Dtype* d = DtypeNamed(dtype);
  return d != nullptr && d->name == d->safetensors ? d->bits : 0;
}

SafetensorsHeader ParseSafetensorsHeader(std::string_view json, uint64_t data_bytes) {
  if (json.size() > kSafetensorsMaxHeader) {
    throw FormatError(
        StrCat(kWhat, ": ", json.size(), " bytes, more than the limit of ", kSafetensorsMaxHeader));
  }
  // Like the safetensors package (its JSON parser's): the object, after JSON's whitespace only.
  const size_t start = json.find_first_not_of(" \t\n\r");
  if (start == std::string_view::npos || json[start] != '{') {
    throw FormatError(StrCat(kWhat, ": does not start with '{'"));
  }
  json.remove_prefix(start);
  JsonReader r(json, std::string(kWhat));
  SafetensorsHeader out;
  bool have_metadata = false;
  std::set<std::string> seen;  // owned copies: entries move as the vector grows
  r.Expect('{');
  if (!r.Consume('}')) {
    do {
      std::string key = r.ReadString();
      r.Expect(':');
      if (key == kMetadataKey) {
        if (have_metadata) r.Fail("duplicate __metadata__");
        have_metadata = true;
        out.metadata = ParseMetadata(r);
        continue;
      }
      if (!seen.insert(key).second) r.Fail(StrCat("duplicate tensor name ", Quoted(key)));
      SafetensorsEntry& e = out.entries.emplace_back();
      e.name = std::move(key);
      ParseEntry(r, e);
    } while (r.Consume(','));
    r.Expect('}');
  }
  r.ExpectEnd();

  for (const auto& e : out.entries) CheckSize(e);
  std::stable_sort(out.entries.begin(), out.entries.end(), [](const auto& a, const auto& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  // The ranges must tile [0, data_bytes): the safetensors package rejects gaps and trailing bytes
  // too, so a file we accept is one it accepts.
  uint64_t expected = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const auto& e : out.entries) {
    if (e.end > data_bytes) {
      TensorError(e.name, StrCat("data_offsets [", e.begin, ", ", e.end,
                                 "] go past the end of the data section (", data_bytes, " bytes)"));
    }
    if (e.begin < expected) {
      TensorError(e.name,
                  StrCat("data_offsets [", e.begin, ", ", e.end, "] overlap tensor ",
                         Quoted(previous->name), " [", previous->begin, ", ", previous->end, "]"));
    }
    if (e.begin > expected) {
      TensorError(e.name, StrCat("gap before data_offsets [", e.begin, ", ", e.end, "]: bytes [",
                                 expected, ", ", e.begin, ") belong to no tensor"));
    }
    expected = e.end;
    previous = &e;
  }
  if (expected != data_bytes) {
    throw FormatError(StrCat(kWhat, ": the data section has ", data_bytes,
                             " bytes but the tensors cover ", expected,
                             " (trailing bytes belong to no tensor)"));
  }
  return out;
}

std::string SerializeSafetensorsHeader(const std::vector<SafetensorsEntry>& entries,
                                       const SafetensorsMetadata& metadata, uint64_t alignment) {
  if (alignment < 8 || !std::has_single_bit(alignment) || alignment > (1u << 20)) {
    throw std::invalid_argument(
        StrCat("alignment must be a power of two between 8 and 1 MiB, not ", alignment));
  }
  std::string json = "{";
  bool first = true;
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    for (const auto& [key, value] : metadata) {
      if (!first) json += ',';
      first = false;
      json += JsonQuote(key);
      json += ':';
      json += JsonQuote(value);
    }
    json += '}';
    first = false;
  }
  uint64_t data_bytes = 0;
  for (const auto& e : entries) {
    if (e.name == kMetadataKey) TensorError(e.name, "the name is reserved for metadata");
    if (!first) json += ',';
    first = false;
    json += JsonQuote(e.name);
    json += ":{\"dtype\":";
    json += JsonQuote(e.dtype);
    json += ",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) {
      if (i > 0) json += ',';
      json += std::to_string(e.shape[i]);
    }
    json += "],\"data_offsets\":[";  // appended: StrCat's stream costs per tensor
    json += std::to_string(e.begin);
    json += ',';
    json += std::to_string(e.end);
    json += "]}";
    data_bytes = std::max(data_bytes, e.end);
  }
  json += '}';
  uint64_t total = AlignUp(8 + json.size(), alignment);
  json.append(total - 8 - json.size(), ' ');
  // Validates everything (dtypes, sizes, overlaps, gaps, UTF-8) the way a reader will.
  ParseSafetensorsHeader(json, data_bytes);
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + json;
}

SafetensorsFileInfo ReadSafetensorsHeader(const ByteSource& source) {
  SafetensorsFileInfo info;
  info.file_size = source.size();
  const std::string& path = source.name();
  if (info.file_size < 8) {
    throw FormatError(StrCat(path, ": not a safetensors file: ", info.file_size,
                             " bytes, shorter than the 8-byte header length"));
  }
  unsigned char len_bytes[8];
  source.ReadAt(0, len_bytes, 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  if (n > kSafetensorsMaxHeader) {
    throw FormatError(StrCat(path, ": safetensors header length ", n,
                             " is larger than the limit of ", kSafetensorsMaxHeader,
                             " bytes (not a safetensors file?)"));
  }
  if (n > info.file_size - 8) {
    throw FormatError(StrCat(path, ": safetensors header length ", n,
                             " is larger than the rest of the file (", info.file_size - 8,
                             " bytes): truncated or not a safetensors file"));
  }
  std::string json(n, '\0');
  source.ReadAt(8, json.data(), n);
  info.data_start = 8 + n;
  try {
    info.header = ParseSafetensorsHeader(json, info.file_size - info.data_start);
  } catch (const FormatError& e) {
    throw FormatError(StrCat(path, ": ", e.what()));
  }
  return info;
}

SafetensorsFileInfo ReadSafetensorsHeader(const File& file) {
  return ReadSafetensorsHeader(FileSource(file));
}

std::optional<uint64_t> ParseStoredChecksum(std::string_view text) {
  if (text.size() != 16) return std::nullopt;
  uint64_t value = 0;
  for (const char c : text) {
    unsigned digit;
    if (c >= '0' && c <= '9') {
      digit = static_cast<unsigned>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      digit = static_cast<unsigned>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      digit = static_cast<unsigned>(c - 'A' + 10);
    } else {
      return std::nullopt;
    }
    value = value << 4 | digit;
  }
  return value;
}

std::map<std::string, std::string> ParseTensorChecksums(std::string_view text) {
  return ParseJsonStringMap(text, kTensorChecksumsKey);
}

TensorChecksums ReadTensorChecksums(std::string_view text, const std::vector<std::string>& names) {
  const std::map<std::string, std::string> sums = ParseTensorChecksums(text);
  TensorChecksums out;
  out.want.resize(names.size());
  const std::set<std::string_view> held(names.begin(), names.end());
  for (const auto& [name, hex] : sums) {
    if (!held.contains(name)) {
      out.problems.push_back(StrCat("checksum for unknown tensor '", name, "'",
                                    " (the file holds no tensor of that name: the checksums are "
                                    "not this file's)"));
    }
  }
  for (size_t i = 0; i < names.size(); ++i) {
    auto s = sums.find(names[i]);
    if (s == sums.end()) {
      out.problems.push_back(StrCat("tensor '", names[i], "' has no checksum"));
    } else if (const std::optional<uint64_t> stored = ParseStoredChecksum(s->second); !stored) {
      out.problems.push_back(
          StrCat("tensor '", names[i], "': checksum '", s->second, "' is not 16 hex digits"));
    } else {
      out.want[i] = *stored;
    }
  }
  return out;
}

uint64_t SafetensorsHeaderDigest(const std::vector<SafetensorsEntry>& entries,
                                 const SafetensorsMetadata& metadata) {
  std::vector<const SafetensorsEntry*> by_name;
  by_name.reserve(entries.size());
  for (const auto& e : entries) by_name.push_back(&e);
  std::sort(by_name.begin(), by_name.end(),
            [](const SafetensorsEntry* a, const SafetensorsEntry* b) { return a->name < b->name; });
  Xxh64State h;
  auto add = [&h](std::string_view text) { h.Update(text.data(), text.size()); };
  for (const SafetensorsEntry* e : by_name) {
    std::string dims;
    for (size_t i = 0; i < e->shape.size(); ++i) dims += StrCat(i ? "," : "", e->shape[i]);
    add(StrCat("T", e->name.size(), ":", e->name, e->dtype.size(), ":", e->dtype, dims, ":",
               e->begin, ":", e->end, "\n"));
  }
  for (const auto& [key, value] : metadata) {  // std::map: sorted by key
    if (key == kTensorChecksumsKey || key == kHeaderChecksumKey) continue;
    add(StrCat("M", key.size(), ":", key, value.size(), ":", value, "\n"));
  }
  return h.Digest();
}

SafetensorsFileInfo ReadSafetensorsHeader(const std::string& path) {
  return ReadSafetensorsHeader(OpenCheckpointForReading(path, /*direct=*/false));
}

}  // namespace tensortier
