// `tensortier info|verify|convert`: inspect, check and convert checkpoint files (safetensors and
// torch.save zip). Tensor bytes move through the engine; headers go through the parsers in
// src/checkpoint, which validate everything before any data is touched.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <unordered_map>

#include "cli.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checkpoint_format.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/util/strings.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"
#include "tensortier/checkpoint/torch_file_writer.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"

namespace tensortier::cli {
namespace {

constexpr uint64_t kChunk = 16u << 20;

using Format = CheckpointFormat;

// What `source` holds (DetectCheckpointKind's rule); an index here is one passed where a file is
// needed.
Format Detect(const FileSource& source) {
  switch (DetectCheckpointKind(source)) {
    case CheckpointKind::kTorch:
      return Format::kTorch;
    case CheckpointKind::kShardIndex:
      throw FormatError(StrCat(source.name(), ": a shard index, not a checkpoint file"));
    case CheckpointKind::kSafetensors:
      break;
  }
  return Format::kSafetensors;
}

// One tensor's bytes in a file, for info, verify and convert alike.
struct Item {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t offset = 0;  // absolute file offset of the first byte
  uint64_t nbytes = 0;
  // A big-endian torch file's tensor: the width of the units whose bytes to reverse for this
  // machine's order (0: none). torch.load swaps by the storage's type, each half of a complex
  // number on its own; untyped storages (_rebuild_tensor_v3) it leaves as they are.
  unsigned swap_width = 0;
  // ... and its bytes do not start and end on those units (a view as a dtype of another size,
  // which torch.save never writes): the stream cannot swap them.
  bool swap_misaligned = false;
  bool meta = false;  // a torch meta tensor: no data in the file (offset and nbytes 0)
};

unsigned SwapWidth(const TorchStorage& s) {
  unsigned bytes = TorchDtypeBytes(s.dtype);
  if (s.dtype.starts_with("C")) bytes /= 2;
  return s.dtype == "U8" || bytes <= 1 ? 0 : bytes;
}

// Reverses the bytes of each `width`-byte unit of p[0, n) (n a multiple of width).
void ReverseUnits(std::byte* p, size_t n, unsigned width) {
  for (size_t i = 0; i + width <= n; i += width) std::reverse(p + i, p + i + width);
}

std::string ShapeString(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += StrCat(i ? ", " : "", shape[i]);
  return s + "]";
}

// The largest power of two (up to 4096) dividing every non-empty tensor's file offset.
uint64_t DataAlignment(const std::vector<Item>& items) {
  uint64_t a = 4096;
  for (const auto& it : items) {
    while (it.nbytes > 0 && it.offset % a != 0) a >>= 1;
  }
  return a;
}

// Streams [offset, offset+length) through two buffers: the engine fills one while `consume`
// reads the other.
void Stream(Engine& engine, const File& file, uint64_t offset, uint64_t length,
            AlignedBuffer (&bufs)[2], const std::function<void(std::byte*, size_t)>& consume) {
  if (length == 0) return;
  auto submit = [&](uint64_t done, int slot) {
    uint64_t n = std::min<uint64_t>(kChunk, length - done);
    return std::pair(engine.Read(file, bufs[slot].data(), n, offset + done), n);
  };
  auto pending = submit(0, 0);
  // If `consume` (or a check) throws while the next chunk's read is in flight, wait for that read
  // before unwinding: the caller's buffers may be freed right after.
  struct WaitOnUnwind {
    std::pair<Future, uint64_t>& p;
    int uncaught = std::uncaught_exceptions();
    ~WaitOnUnwind() {
      if (std::uncaught_exceptions() > uncaught && p.first.valid()) {
        try {
          p.first.Wait();
        } catch (...) {  // the error in flight already is the one to report
        }
      }
    }
  } guard{pending};
  int slot = 0;
  for (uint64_t done = 0; done < length;) {
    IoResult r = pending.first.Wait();
    uint64_t n = pending.second;
    if (r.bytes != n) {
      throw FormatError(
          StrCat(file.path(), ": truncated: end of file at offset ", offset + done + r.bytes));
    }
    if (done + n < length) pending = submit(done + n, 1 - slot);
    consume(bufs[slot].data(), n);
    done += n;
    slot = 1 - slot;
  }
}

struct Loaded {
  Format format;
  std::vector<Item> items;
  SafetensorsFileInfo st;
  TorchCheckpoint torch;
};

Loaded Load(const std::string& path) {
  FileSource source(OpenCheckpointForReading(path, false));
  Loaded out;
  out.format = Detect(source);
  if (out.format == Format::kSafetensors) {
    out.st = ReadSafetensorsHeader(source);
    for (const auto& e : out.st.header.entries) {
      out.items.push_back({e.name, e.dtype, e.shape, out.st.data_start + e.begin, e.end - e.begin});
    }
    return out;
  }
  out.torch = ReadTorchCheckpoint(source);
  // Every entry, not only the storages' (a damaged archive is refused whole, as
  // tensortier.load refuses it).
  for (const auto& e : out.torch.zip.entries) RequireStored(e, path);
  for (const auto& t : out.torch.pickle.tensors) {
    if (t.meta) {
      out.items.push_back({t.path, t.dtype, std::vector<uint64_t>(t.shape.begin(), t.shape.end()),
                           0, 0, 0, false, true});
      continue;
    }
    const TorchStorage& s = out.torch.pickle.storages.at(t.storage_key);
    std::vector<uint64_t> shape(t.shape.begin(), t.shape.end());
    const uint64_t start = static_cast<uint64_t>(t.storage_offset) * TorchDtypeBytes(t.dtype);
    const unsigned width = out.torch.big_endian ? SwapWidth(s) : 0;
    out.items.push_back({t.path, t.dtype, shape, s.data_offset + start, t.nbytes(), width,
                         width > 1 && (start % width != 0 || t.nbytes() % width != 0)});
  }
  return out;
}

// Those of `names` (tensors a shard index puts in the file) that the file lacks.
std::vector<std::string> MissingNames(const Loaded& l, const std::vector<std::string>& names) {
  std::set<std::string> held;
  for (const auto& item : l.items) held.insert(item.name);
  std::vector<std::string> missing;
  for (const auto& name : names) {
    if (!held.contains(name)) missing.push_back(name);
  }
  return missing;
}

std::string IndexLacks(const std::string& name) {
  return StrCat("the index puts tensor '", name, "' in this file, which lacks it");
}

// `names`: tensors a shard index puts in this file (a missing one is an error, as for
// tensortier.load).
int InfoFile(const std::string& path, unsigned show, const std::vector<std::string>& names = {}) {
  Loaded l = Load(path);
  if (auto missing = MissingNames(l, names); !missing.empty()) {
    throw FormatError(StrCat(path, ": ", IndexLacks(missing.front())));
  }
  uint64_t total = 0;
  std::map<std::string, uint64_t> dtypes;
  for (const auto& it : l.items) {
    total += it.nbytes;
    ++dtypes[it.dtype];
  }
  std::printf("file:      %s\n", TerminalText(path).c_str());
  if (l.format == Format::kSafetensors) {
    std::printf("format:    safetensors (header %llu bytes, data at offset %llu)\n",
                static_cast<unsigned long long>(l.st.data_start - 8),
                static_cast<unsigned long long>(l.st.data_start));
  } else {
    std::printf("format:    torch.save zip (folder '%s', %s, %s%s%s)\n",
                TerminalText(l.torch.prefix).c_str(),
                Count(l.torch.pickle.storages.size(), "storage").c_str(),
                Count(l.torch.pickle.other_values, "non-tensor value").c_str(),
                l.torch.zip.zip64 ? ", zip64" : "", l.torch.big_endian ? ", big-endian" : "");
  }
  std::printf("tensors:   %zu\n", l.items.size());
  std::printf("bytes:     %llu\n", static_cast<unsigned long long>(total));
  std::string dt;
  for (const auto& [name, count] : dtypes) dt += StrCat(dt.empty() ? "" : ", ", name, " x", count);
  std::printf("dtypes:    %s\n", TerminalText(dt).c_str());
  std::printf("alignment: %llu (largest power of two dividing every tensor's offset, max 4096)\n",
              static_cast<unsigned long long>(DataAlignment(l.items)));
  if (l.format == Format::kSafetensors) {
    std::printf("metadata:  %zu keys\n", l.st.header.metadata.size());
    for (const auto& [k, v] : l.st.header.metadata) {
      std::string shown = v.size() > 200 ? v.substr(0, 200) + "..." : v;
      std::printf("  %s = %s\n", TerminalText(k).c_str(), TerminalText(shown).c_str());
    }
  }
  std::printf("shapes (%s):\n", l.items.size() > show ? StrCat("first ", show).c_str() : "all");
  for (size_t i = 0; i < l.items.size() && i < show; ++i) {
    const Item& it = l.items[i];
    std::printf("  %-40s %-6s %-20s %s\n", TerminalText(it.name).c_str(),
                TerminalText(it.dtype).c_str(), ShapeString(it.shape).c_str(),
                it.meta ? "meta (no data)" : StrCat("offset ", it.offset).c_str());
  }
  if (l.items.size() > show) {
    std::printf("  ... %zu more (--shapes N shows more)\n", l.items.size() - show);
  }
  return 0;
}

// What a safetensors file's own checksums (tensortier.save(..., checksum=True)) say: the xxh64
// each tensor's bytes must have, and what is wrong with the checksums themselves (a header that
// no longer matches its checksum, a tensor without one...). verify reports every problem;
// convert refuses the file at the first, before writing anything.
struct SafetensorsChecks {
  bool present = false;         // the file has per-tensor checksums
  bool header_checked = false;  // the file has a header checksum, compared
  std::vector<std::string> problems;
  std::vector<std::optional<uint64_t>> want;  // per item: its xxh64, if it has a usable one
};

SafetensorsChecks ReadSafetensorsChecks(const Loaded& l) {
  SafetensorsChecks c;
  c.want.resize(l.items.size());
  const SafetensorsMetadata& metadata = l.st.header.metadata;
  // What the header says (names, dtypes, shapes, offsets, metadata): its own checksum, compared
  // even where the tensors' checksums are missing (a damaged key name must not hide the damage
  // the header checksum sees), as load(verify=True) does.
  if (auto hh = metadata.find(kHeaderChecksumKey); hh != metadata.end()) {
    const uint64_t actual = SafetensorsHeaderDigest(l.st.header.entries, metadata);
    const std::optional<uint64_t> stored = ParseStoredChecksum(hh->second);
    if (!stored) {
      c.problems.push_back(StrCat("header checksum '", hh->second, "' is not 16 hex digits"));
    } else if (*stored != actual) {
      c.problems.push_back(StrCat("header: xxh64 mismatch (stored ", hh->second, ", header has ",
                                  Hex16(actual), ")"));
    }
    c.header_checked = true;
  }
  auto it = metadata.find(kTensorChecksumsKey);
  if (it == metadata.end()) return c;
  c.present = true;
  std::vector<std::string> names;
  for (const auto& item : l.items) names.push_back(item.name);
  TensorChecksums sums = ReadTensorChecksums(it->second, names);
  c.want = std::move(sums.want);
  c.problems.insert(c.problems.end(), sums.problems.begin(), sums.problems.end());
  return c;
}

std::string XxhMismatch(const Item& item, uint64_t stored, uint64_t actual) {
  return StrCat("tensor '", item.name, "': xxh64 mismatch (stored ", Hex16(stored), ", data has ",
                Hex16(actual), ")");
}

// torch.save with set_crc32_options(False) records 0 for every entry: nothing to check against.
// 0 means "none" only then; one entry in 2^32 really has the CRC-32 0.
bool RecordsCrcs(const ZipDirectory& zip) {
  return std::any_of(zip.entries.begin(), zip.entries.end(),
                     [](const ZipEntry& e) { return e.size > 0 && e.crc32 != 0; });
}

std::string CrcMismatch(const ZipEntry& e, uint32_t actual) {
  return StrCat("entry '", e.name, "': CRC-32 mismatch (stored ", Hex8(e.crc32), ", data has ",
                Hex8(actual), ")");
}

// The CRC-32 of zip entry `e` of `torch`'s file: data.pkl's from the read that parsed it, any
// other's streamed from `file`.
uint32_t EntryCrc(Engine& engine, const File& file, const TorchCheckpoint& torch, const ZipEntry& e,
                  AlignedBuffer (&bufs)[2]) {
  if (e.name == StrCat(torch.prefix, "/data.pkl")) return torch.pickle_crc32;
  uint32_t crc = 0;
  Stream(engine, file, e.data_offset, e.size, bufs,
         [&](const std::byte* p, size_t n) { crc = Crc32(p, n, crc); });
  return crc;
}

// convert's refusal of a file its own checksums say is damaged.
[[noreturn]] void RefuseDamaged(const std::string& in, const std::string& problem) {
  throw FormatError(StrCat(in, ": ", problem, ": the file is damaged; nothing was written"));
}

// `names`: tensors a shard index puts in this file (a missing one is a problem).
int VerifyFile(const std::string& path, const std::vector<std::string>& names = {}) {
  Loaded l = Load(path);  // throws on any structural problem
  const std::string shown_path = TerminalText(path);
  std::printf("%s: structure OK (%s, %s)\n", shown_path.c_str(),
              l.format == Format::kSafetensors ? "safetensors" : "torch.save zip",
              Count(l.items.size(), "tensor").c_str());
  std::vector<std::string> problems;
  for (const auto& name : MissingNames(l, names)) problems.push_back(IndexLacks(name));
  // Buffers before the engine: its destructor waits for reads still in flight into them.
  AlignedBuffer bufs[2] = {AlignedBuffer(kChunk, Pages::kReused),
                           AlignedBuffer(kChunk, Pages::kReused)};
  Engine engine;
  File file = OpenCheckpointForReading(path, true);
  uint64_t checked = 0;
  uint64_t unrecorded = 0;      // torch zip entries of an archive that records no CRC-32s
  bool header_checked = false;  // safetensors: tensortier.header_xxh64 compared
  const SafetensorsChecks sums =
      l.format == Format::kSafetensors ? ReadSafetensorsChecks(l) : SafetensorsChecks{};
  if (l.format == Format::kSafetensors && !sums.present) {
    // As load(verify=True): a file without checksums cannot be verified, which is not a pass.
    problems.insert(problems.end(), sums.problems.begin(), sums.problems.end());
    problems.push_back(StrCat("no checksums (metadata key ", kTensorChecksumsKey,
                              "): the data cannot be verified; save it with "
                              "tensortier.save(..., checksum=True) to verify it"));
  } else if (l.format == Format::kSafetensors) {
    if (!sums.header_checked) {
      std::printf(
          "%s: no header checksum (metadata key %s): names, shapes and metadata not "
          "checked\n",
          shown_path.c_str(), kHeaderChecksumKey);
    }
    header_checked = sums.header_checked;
    problems.insert(problems.end(), sums.problems.begin(), sums.problems.end());
    for (size_t i = 0; i < l.items.size(); ++i) {
      const Item& item = l.items[i];
      if (!sums.want[i]) continue;  // a problem above already
      Xxh64State h;
      Stream(engine, file, item.offset, item.nbytes, bufs,
             [&](const std::byte* p, size_t n) { h.Update(p, n); });
      if (h.Digest() != *sums.want[i])
        problems.push_back(XxhMismatch(item, *sums.want[i], h.Digest()));
      ++checked;
    }
  } else {
    const bool records_crcs = RecordsCrcs(l.torch.zip);
    for (const auto& e : l.torch.zip.entries) {
      RequireStored(e, path);
      if (!records_crcs && e.size > 0) {
        ++unrecorded;
        continue;
      }
      const uint32_t crc = EntryCrc(engine, file, l.torch, e, bufs);
      if (crc != e.crc32) problems.push_back(CrcMismatch(e, crc));
      ++checked;
    }
  }
  if (unrecorded > 0) {
    // As load(verify=True): a file saved without CRC-32s cannot be verified, which is not a pass.
    problems.push_back(
        StrCat(unrecorded, unrecorded == 1 ? " zip entry records" : " zip entries record",
               " no CRC-32 (saved with torch.serialization.set_crc32_options(False)):"
               " its data cannot be verified"));
  }
  std::fflush(stdout);  // keep the lines in order where both streams go to one pipe
  for (const auto& p : problems) {
    std::fprintf(stderr, "%s: %s\n", shown_path.c_str(), TerminalText(p).c_str());
  }
  if (!problems.empty()) {
    std::fprintf(stderr, "%s: verify FAILED (%zu %s)\n", shown_path.c_str(), problems.size(),
                 problems.size() == 1 ? "problem" : "problems");
    return 1;
  }
  std::printf("%s: data OK (%llu %s%s checked)\n", shown_path.c_str(),
              static_cast<unsigned long long>(checked),
              l.format == Format::kSafetensors ? "tensor checksums" : "zip entry CRCs",
              header_checked ? " and the header checksum" : "");
  return 0;
}

int ConvertTorchToSafetensors(const Loaded& l, const std::string& in, const std::string& out) {
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> sums;
  uint64_t data = 0;
  for (size_t index = 0; index < l.torch.pickle.tensors.size(); ++index) {
    const TorchTensor& t = l.torch.pickle.tensors[index];
    if (sums.contains(t.path)) {
      // Names are key paths joined by '.': {"a": {"b": x}} and {"a.b": y} meet, and keys that
      // are neither str nor int all read "<key>". A safetensors file names each tensor once.
      throw std::invalid_argument(
          StrCat("two tensors get the name '", t.path,
                 "' (safetensors names are the key paths joined by '.'; keys other than str "
                 "and int read '<key>'), and a safetensors file names each tensor once: give "
                 "them distinct string keys before torch.save"));
    }
    if (t.meta) {
      throw std::invalid_argument(StrCat("tensor '", t.path,
                                         "' is a meta tensor (no data): safetensors cannot "
                                         "store it without data"));
    }
    if (l.items[index].swap_misaligned) {
      throw std::invalid_argument(StrCat(
          "tensor '", t.path, "' of ", t.dtype, " views a big-endian ",
          l.torch.pickle.storages.at(t.storage_key).dtype,
          " storage off its elements' boundaries; convert cannot swap its bytes: load it with "
          "tensortier.load and save that"));
    }
    // A packed dtype (float4_e2m1fn_x2: safetensors' F4) counts its last dimension in elements
    // of several safetensors values.
    const Dtype* row = DtypeNamed(t.dtype);
    const std::string dtype(row != nullptr ? row->safetensors : std::string_view());
    if (dtype.empty()) {
      throw std::invalid_argument(StrCat("tensor '", t.path, "' has dtype ", t.dtype, " (torch.",
                                         TorchDtypeAttribute(t.dtype),
                                         "), which safetensors cannot store"));
    }
    if (t.conj || t.neg) {
      // Its bytes are not its values, and safetensors has no flag to say so.
      throw std::invalid_argument(StrCat(
          "tensor '", t.path, "' was saved as a ", t.conj ? "conjugate" : "negative",
          " view (its storage holds other numbers than its values); convert copies bytes: "
          "save it with .resolve_conj().resolve_neg() first, or load it with tensortier.load "
          "and save that"));
    }
    if (!t.contiguous()) {
      throw std::invalid_argument(StrCat("tensor '", t.path,
                                         "' is not contiguous; convert copies only contiguous "
                                         "tensors (call .contiguous() before torch.save)"));
    }
    std::vector<uint64_t> shape(t.shape.begin(), t.shape.end());
    if (row->packing > 1) {
      if (shape.empty()) {
        throw std::invalid_argument(
            StrCat("tensor '", t.path, "' is a ", row->torch, " scalar: safetensors' ", dtype,
                   " needs a last dimension to hold its ", row->packing, " values"));
      }
      shape.back() *= row->packing;
    }
    entries.push_back({t.path, dtype, std::move(shape), data, data + t.nbytes()});
    data += t.nbytes();
    sums[t.path] = "0000000000000000";  // fixed width: the header size does not change later
  }
  auto header_for = [&] {
    std::string json = "{";
    for (const auto& [k, v] : sums)
      json += StrCat(json.size() > 1 ? "," : "", JsonQuote(k), ":", JsonQuote(v));
    json += "}";
    SafetensorsMetadata metadata = {{"format", "pt"}, {kTensorChecksumsKey, json}};
    metadata[kHeaderChecksumKey] = Hex16(SafetensorsHeaderDigest(entries, metadata));
    return SerializeSafetensorsHeader(entries, metadata, 4096);
  };
  std::string header = header_for();
  uint64_t data_start = header.size();

  // Buffers before the engine: its destructor waits for I/O still in flight from them.
  AlignedBuffer bufs[2] = {AlignedBuffer(kChunk, Pages::kReused),
                           AlignedBuffer(kChunk, Pages::kReused)};
  Engine engine;
  File src = OpenCheckpointForReading(in, true);
  DurableFile out_file(out);
  const File& dst = out_file.file();
  out_file.Reserve(data_start + data);
  // Each zip entry is read once, start to end: its CRC-32 is checked from the same reads that copy
  // the tensors viewing it (several tensors may share an entry, or leave parts of it unviewed).
  const bool records_crcs = RecordsCrcs(l.torch.zip);
  std::unordered_map<std::string, std::vector<size_t>> views;  // entry name -> items, by offset
  for (size_t i = 0; i < l.items.size(); ++i) {
    if (l.items[i].nbytes == 0) continue;
    const TorchTensor& t = l.torch.pickle.tensors[i];
    views[StrCat(l.torch.prefix, "/data/", t.storage_key)].push_back(i);
  }
  std::vector<const ZipEntry*> order;
  for (const auto& e : l.torch.zip.entries) order.push_back(&e);
  std::sort(order.begin(), order.end(),
            [](const ZipEntry* a, const ZipEntry* b) { return a->data_offset < b->data_offset; });
  std::vector<Xxh64State> hashes(l.items.size());
  std::vector<Future> writes;
  for (const ZipEntry* e : order) {
    auto v = views.find(e->name);
    if (v == views.end() && !records_crcs) continue;
    RequireStored(*e, in);
    if (v == views.end()) {  // no tensor's bytes: only its CRC-32 to check
      const uint32_t crc = EntryCrc(engine, src, l.torch, *e, bufs);
      if (crc != e->crc32) RefuseDamaged(in, CrcMismatch(*e, crc));
      continue;
    }
    std::vector<size_t> pending = std::move(v->second);  // this entry's views, by start
    std::stable_sort(pending.begin(), pending.end(),
                     [&](size_t a, size_t b) { return l.items[a].offset < l.items[b].offset; });
    std::vector<size_t> active;  // views reaching into the current chunk
    size_t next = 0;
    uint64_t at = e->data_offset;
    uint32_t crc = 0;
    // Stream reads the next chunk into the other buffer meanwhile; this one is free again once
    // its writes complete, before Stream refills it.
    Stream(engine, src, e->data_offset, e->size, bufs, [&](std::byte* p, size_t n) {
      if (records_crcs) crc = Crc32(p, n, crc);  // the bytes as stored
      const uint64_t end = at + n;
      while (next < pending.size() && l.items[pending[next]].offset < end) {
        active.push_back(pending[next++]);
      }
      // A big-endian storage's units are swapped once per chunk (chunks hold whole units, and
      // every view of one storage has its width).
      if (!active.empty() && l.items[active.front()].swap_width > 1) {
        ReverseUnits(p, n, l.items[active.front()].swap_width);
      }
      for (size_t k = 0; k < active.size();) {
        const size_t i = active[k];
        const Item& item = l.items[i];
        const uint64_t lo = std::max(at, item.offset);
        const uint64_t hi = std::min(end, item.offset + item.nbytes);
        hashes[i].Update(p + (lo - at), hi - lo);
        writes.push_back(engine.Write(dst, p + (lo - at), hi - lo,
                                      data_start + entries[i].begin + (lo - item.offset)));
        if (item.offset + item.nbytes <= end) {
          active[k] = active.back();
          active.pop_back();
        } else {
          ++k;
        }
      }
      for (auto& w : writes) w.Wait();
      writes.clear();
      at = end;
    });
    if (records_crcs && crc != e->crc32) RefuseDamaged(in, CrcMismatch(*e, crc));
  }
  for (size_t i = 0; i < l.items.size(); ++i) sums[l.items[i].name] = Hex16(hashes[i].Digest());
  header = header_for();
  if (header.size() != data_start) throw std::logic_error("convert: header size changed");
  engine.Write(dst, header.data(), header.size(), 0).Wait();
  out_file.Commit();
  std::printf("%s -> %s: %s, %llu data bytes at offset %llu (xxh64 checksums in %s)\n",
              TerminalText(in).c_str(), TerminalText(out).c_str(),
              Count(entries.size(), "tensor").c_str(), static_cast<unsigned long long>(data),
              static_cast<unsigned long long>(data_start), kTensorChecksumsKey);
  if (l.torch.pickle.other_values > 0) {
    std::fflush(stdout);
    std::fprintf(stderr, "note: %s not converted (safetensors holds only tensors)\n",
                 Count(l.torch.pickle.other_values, "non-tensor value").c_str());
  }
  if (!records_crcs) {
    std::fflush(stdout);
    std::fprintf(stderr,
                 "note: %s records no CRC-32s (saved with "
                 "torch.serialization.set_crc32_options(False)): its data was not checked\n",
                 TerminalText(in).c_str());
  }
  return 0;
}

// The folder torch.save names its records under: the file's name without its last extension
// (as PyTorchStreamWriter does), or "archive" when that is empty or not printable ASCII.
std::string ArchiveName(const std::string& out) {
  std::string name = std::filesystem::path(out).filename().string();
  size_t dot = name.rfind('.');
  if (dot != std::string::npos) name.resize(dot);
  bool plain = !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return c >= 0x20 && c < 0x7f && c != '\\';
  });
  return plain ? name : "archive";
}

// A torch.save zip file holding the safetensors file's tensors in a plain dict, in file order, each
// in its own storage ("<folder>/data/<i>") whose data starts on a 4 KiB boundary (TorchFileWriter:
// why there is no .format_version there).
int ConvertSafetensorsToTorch(const Loaded& l, const std::string& in, const std::string& out) {
  // The input's own checksums, checked as its bytes are copied: a damaged file is refused, not
  // passed on with fresh CRC-32s that would make it look sound.
  const SafetensorsChecks sums = ReadSafetensorsChecks(l);
  if (!sums.problems.empty()) RefuseDamaged(in, sums.problems.front());
  std::vector<TorchPickleTensor> tensors;
  std::vector<uint64_t> offsets, sizes;
  for (size_t i = 0; i < l.items.size(); ++i) {
    const Item& item = l.items[i];
    std::vector<uint64_t> shape = item.shape;
    const std::optional<TorchHeldDtype> held = TorchHeldDtypeOf(item.dtype);
    if (!held || !TorchSupportsDtype(held->name)) {
      throw std::invalid_argument(StrCat("tensor '", item.name, "' has dtype ", item.dtype,
                                         ", which torch has no dtype for: cannot convert"));
    }
    if (held->values_per_element > 1) {  // F4: two values per float4_e2m1fn_x2 element
      if (shape.empty() || shape.back() % held->values_per_element != 0) {
        throw std::invalid_argument(StrCat(
            "tensor '", item.name, "' of ", item.dtype, " has shape ", ShapeString(item.shape),
            ": torch's ", held->torch, " needs a last dimension that is a multiple of ",
            held->values_per_element, ": cannot convert"));
      }
      shape.back() /= held->values_per_element;
    }
    tensors.push_back({item.name, held->name, std::move(shape), std::to_string(i)});
    offsets.push_back(item.offset);
    sizes.push_back(item.nbytes);
  }
  const std::string prefix = ArchiveName(out);
  TorchFileWriter writer(tensors, sizes, {.folder = prefix, .crc32 = true});

  // The input's bytes, read front to back in large reads, the xxh64 of each tensor with one to
  // check computed as it is copied into the output (whose records are in the same order).
  struct CheckedBytes : FileTensorBytes {
    using FileTensorBytes::FileTensorBytes;
    const SafetensorsChecks* sums = nullptr;
    std::vector<Xxh64State> hashes;
    void Copy(size_t index, std::byte* dst, size_t n) override {
      FileTensorBytes::Copy(index, dst, n);
      if (sums->want[index]) hashes[index].Update(dst, n);
    }
  };
  Engine engine;
  File src = OpenCheckpointForReading(in, true);
  DurableFile out_file(out);
  out_file.Reserve(writer.size());
  {
    CheckedBytes source(engine, src, offsets, sizes);
    source.sums = &sums;
    source.hashes.resize(l.items.size());
    writer.Write(engine, out_file.file(), source);
    for (size_t i = 0; i < l.items.size(); ++i) {
      const uint64_t actual = source.hashes[i].Digest();
      if (sums.want[i] && actual != *sums.want[i]) {
        RefuseDamaged(in, XxhMismatch(l.items[i], *sums.want[i], actual));
      }
    }
  }
  out_file.Commit();
  const uint64_t data = std::accumulate(sizes.begin(), sizes.end(), uint64_t{0});
  std::printf(
      "%s -> %s: %s, %llu data bytes in torch.save zip format (folder '%s', "
      "storages 4096-byte aligned, CRC-32 recorded)\n",
      TerminalText(in).c_str(), TerminalText(out).c_str(), Count(l.items.size(), "tensor").c_str(),
      static_cast<unsigned long long>(data), TerminalText(prefix).c_str());
  if (!l.st.header.metadata.empty()) {
    std::fflush(stdout);
    std::fprintf(stderr, "note: %s not converted (torch.load returns only the tensors)\n",
                 Count(l.st.header.metadata.size(), "safetensors metadata key").c_str());
  }
  if (!sums.present) {
    std::fflush(stdout);
    std::fprintf(stderr, "note: %s has no checksums (metadata key %s): its data was not checked\n",
                 TerminalText(in).c_str(), kTensorChecksumsKey);
  }
  return 0;
}

bool IsShardIndexFile(const std::string& path) {
  return DetectCheckpointKind(path) == CheckpointKind::kShardIndex;
}

const char* FormatName(Format format) {
  return format == Format::kSafetensors ? "safetensors" : "a torch.save zip";
}

// convert writes the other format than IN's: an OUT that is IN (replaced by a file of another
// format), or whose suffix names IN's format (a .bin holding safetensors), is refused.
void RequireConvertibleOutput(const std::string& in, const std::string& out, Format writes) {
  struct stat in_st, out_st;
  if (stat(in.c_str(), &in_st) == 0 && stat(out.c_str(), &out_st) == 0 &&
      in_st.st_dev == out_st.st_dev && in_st.st_ino == out_st.st_ino) {
    throw std::invalid_argument(StrCat("convert: '", out, "' is the input file; convert writes ",
                                       FormatName(writes), ": name another output"));
  }
  if (auto named = FormatOfSuffix(out); named && *named != writes) {
    throw std::invalid_argument(
        StrCat("convert: '", in, "' is ",
               FormatName(writes == Format::kTorch ? Format::kSafetensors : Format::kTorch),
               ", so convert writes ", FormatName(writes), ", but '", out, "' names ",
               FormatName(*named), " by its suffix: name the output for what it will hold"));
  }
}

int RunConvertImpl(const std::vector<std::string>& argv) {
  Args args(argv, {}, {});
  if (args.positionals().size() != 2) {
    throw UsageError("convert takes IN and OUT");
  }
  const std::string& in = args.positionals()[0];
  const std::string& out = args.positionals()[1];
  if (IsShardIndexFile(in)) {
    throw std::invalid_argument(
        StrCat("convert: '", in, "' is a shard index: convert each shard file it names"));
  }
  Loaded l = Load(in);
  RequireConvertibleOutput(in, out,
                           l.format == Format::kTorch ? Format::kSafetensors : Format::kTorch);
  try {
    if (l.format == Format::kTorch) return ConvertTorchToSafetensors(l, in, out);
    return ConvertSafetensorsToTorch(l, in, out);
  } catch (const FormatError&) {
    throw;
  } catch (const std::invalid_argument& e) {
    // What IN holds that OUT's format cannot (a name that is not UTF-8 for a JSON header).
    const std::string what = e.what();
    if (what.find(in) != std::string::npos) throw;
    throw FormatError(StrCat(in, ": ", what));
  } catch (const IoError& e) {
    // A failure on the hidden temporary file is one of writing OUT: named so first.
    const std::string name = std::filesystem::path(e.path()).filename().string();
    const std::string out_name = std::filesystem::path(out).filename().string();
    if (!name.starts_with(TemporaryNameStem(out_name))) throw;
    throw IoError(e.error_code(), StrCat("write '", out, "': ", e.op()), e.path(), e.offset(),
                  e.length());
  }
}

int RunInfoImpl(const std::vector<std::string>& argv) {
  Args args(argv, {}, {"shapes"});
  if (args.positionals().size() != 1) throw UsageError("info takes one FILE");
  const std::string& path = args.positionals()[0];
  const unsigned show = args.Unsigned("shapes", 20);
  if (!IsShardIndexFile(path)) return InfoFile(path, show);
  const std::vector<Shard> shards = ReadShardIndex(path);
  size_t tensors = 0;
  for (const auto& shard : shards) tensors += shard.names.size();
  std::printf("index:     %s (%s, %s)\n", TerminalText(path).c_str(),
              Count(shards.size(), "shard").c_str(), Count(tensors, "tensor").c_str());
  for (const auto& shard : shards) {
    std::printf("\n");
    if (int rc = InfoFile(shard.path, show, shard.names); rc != 0) return rc;
  }
  return 0;
}

int RunVerifyImpl(const std::vector<std::string>& argv) {
  Args args(argv, {}, {});
  if (args.positionals().size() != 1) throw UsageError("verify takes one FILE");
  const std::string& path = args.positionals()[0];
  if (!IsShardIndexFile(path)) return VerifyFile(path);
  const std::vector<Shard> shards = ReadShardIndex(path);
  size_t failed = 0;
  for (const auto& shard : shards) {
    try {
      failed += VerifyFile(shard.path, shard.names) != 0;
    } catch (const std::exception& e) {  // FormatError, IoError: one bad shard does not hide
                                         // the others' state
      std::fflush(stdout);
      std::fprintf(stderr, "tensortier verify: %s\n", TerminalText(e.what()).c_str());
      ++failed;
    }
  }
  std::fflush(stdout);
  if (failed > 0) {
    std::fprintf(stderr, "%s: verify FAILED (%zu of %zu shards)\n", TerminalText(path).c_str(),
                 failed, shards.size());
    return 1;
  }
  std::printf("%s: all %zu shards OK\n", TerminalText(path).c_str(), shards.size());
  return 0;
}

// Format errors are the user's file, not a crash: one line, exit status 1.
int Guard(const char* command, const std::function<int()>& body) {
  try {
    return body();
  } catch (const FormatError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "tensortier %s: %s\n", command, TerminalText(e.what()).c_str());
    return 1;
  }
}

}  // namespace

std::string Hex8(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

std::string Hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

int RunInfo(const std::vector<std::string>& argv) {
  return Guard("info", [&] { return RunInfoImpl(argv); });
}
int RunVerify(const std::vector<std::string>& argv) {
  return Guard("verify", [&] { return RunVerifyImpl(argv); });
}
int RunConvert(const std::vector<std::string>& argv) {
  return Guard("convert", [&] { return RunConvertImpl(argv); });
}

}  // namespace tensortier::cli
