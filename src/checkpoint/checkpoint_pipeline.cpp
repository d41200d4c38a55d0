// The pipeline's plan, stream and check steps (convert: checkpoint_convert.cpp).
#include "tensortier/checkpoint/checkpoint_pipeline.hpp"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <set>
#include <stdexcept>
#include <utility>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/checkpoint/piece_reader.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += StrCat(i ? ", " : "", shape[i]);
  return s + "]";
}

}  // namespace

CheckpointLayout ReadCheckpointLayout(const std::string& path, bool opaque_objects) {
  FileSource source(OpenCheckpointForReading(path, false));
  CheckpointLayout out;
  switch (DetectCheckpointKind(source)) {
    case CheckpointKind::kShardIndex:
      throw FormatError(StrCat(source.name(), ": a shard index, not a checkpoint file"));
    case CheckpointKind::kTorch:
      out.format = CheckpointFormat::kTorch;
      break;
    case CheckpointKind::kSafetensors:
      out.format = CheckpointFormat::kSafetensors;
      break;
  }
  if (out.format == CheckpointFormat::kSafetensors) {
    out.st = ReadSafetensorsHeader(source);
    out.items.reserve(out.st.header.entries.size());
    for (const auto& e : out.st.header.entries) {
      out.items.push_back({e.name, e.dtype, e.shape, out.st.data_start + e.begin, e.end - e.begin});
    }
    return out;
  }
  out.torch = ReadTorchCheckpoint(source, opaque_objects);
  // Every entry, not only the storages' (a damaged archive is refused whole, as
  // tensortier.load refuses it).
  for (const auto& e : out.torch.zip.entries) RequireStored(e, path);
  out.items.reserve(out.torch.pickle.tensors.size());
  for (const auto& t : out.torch.pickle.tensors) {
    std::vector<uint64_t> shape(t.shape.begin(), t.shape.end());
    if (t.meta) {
      out.items.push_back({t.path, t.dtype, std::move(shape), 0, 0, 0, false, true});
      continue;
    }
    const TorchStorage& s = out.torch.pickle.storages.at(t.storage_key);
    const uint64_t start = static_cast<uint64_t>(t.storage_offset) * TorchDtypeBytes(t.dtype);
    const unsigned width = out.torch.big_endian ? BigEndianSwapWidth(s.dtype) : 0;
    out.items.push_back({t.path, t.dtype, std::move(shape), s.data_offset + start, t.nbytes(),
                         width, width > 1 && (start % width != 0 || t.nbytes() % width != 0)});
  }
  return out;
}

uint64_t DataAlignment(const std::vector<CheckpointItem>& items) {
  uint64_t a = kCheckpointAlignment;
  for (const auto& it : items) {
    while (it.nbytes > 0 && it.offset % a != 0) a >>= 1;
  }
  return a;
}

std::vector<std::string> MissingTensorProblems(const CheckpointLayout& layout,
                                               const std::vector<std::string>& names) {
  std::set<std::string_view> held;
  for (const auto& item : layout.items) held.insert(item.name);
  std::vector<std::string> out;
  for (const auto& name : names) {
    if (!held.contains(name)) {
      out.push_back(StrCat("the index puts tensor '", name, "' in this file, which lacks it"));
    }
  }
  return out;
}

unsigned BigEndianSwapWidth(std::string_view storage_dtype) {
  unsigned bytes = TorchDtypeBytes(storage_dtype);
  if (storage_dtype.starts_with("C")) bytes /= 2;
  return storage_dtype == "U8" || bytes <= 1 ? 0 : bytes;
}

void ReverseUnits(std::byte* p, size_t n, unsigned width) noexcept {
  if (width < 2) return;
  for (size_t i = 0; i + width <= n; i += width) std::reverse(p + i, p + i + width);
}

std::vector<uint64_t> PlanSafetensorsLayout(const std::vector<uint64_t>& sizes,
                                            const std::vector<unsigned>& widths) {
  if (widths.size() != sizes.size()) {
    throw std::invalid_argument("PlanSafetensorsLayout: sizes and widths differ in length");
  }
  std::vector<size_t> order;
  order.reserve(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] % kCheckpointAlignment == 0) order.push_back(i);
  }
  const size_t whole = order.size();
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] % kCheckpointAlignment != 0) order.push_back(i);
  }
  std::stable_sort(order.begin() + static_cast<std::ptrdiff_t>(whole), order.end(),
                   [&](size_t a, size_t b) { return widths[a] > widths[b]; });
  std::vector<uint64_t> starts(sizes.size());
  uint64_t pos = 0;
  for (size_t i : order) {
    starts[i] = pos;
    pos += sizes[i];
  }
  return starts;
}

std::string TensorChecksumsJson(const std::vector<std::pair<std::string, uint64_t>>& sums) {
  std::string json = "{";
  for (const auto& [name, sum] : sums) {
    json += StrCat(json.size() > 1 ? "," : "", JsonQuote(name), ":\"", Hex16(sum), "\"");
  }
  return json + "}";
}

void SetChecksumMetadata(const std::vector<SafetensorsEntry>& entries,
                         const std::vector<std::pair<std::string, uint64_t>>& sums,
                         SafetensorsMetadata& metadata) {
  metadata[kTensorChecksumsKey] = TensorChecksumsJson(sums);
  metadata[kHeaderChecksumKey] = Hex16(SafetensorsHeaderDigest(entries, metadata));
}

std::vector<uint64_t> SafetensorsShape(std::string_view name, std::string_view dtype,
                                       std::vector<uint64_t> shape) {
  const Dtype* row = DtypeNamed(dtype);
  if (row == nullptr || row->packing <= 1) return shape;
  if (shape.empty()) {
    throw std::invalid_argument(
        StrCat("tensor '", name, "' is a 0-dimensional ", row->torch, " tensor: safetensors' ",
               row->safetensors, " needs a last dimension to hold its ", row->packing, " values"));
  }
  shape.back() *= row->packing;
  return shape;
}

std::vector<uint64_t> TorchShape(std::string_view name, std::string_view st_dtype,
                                 std::vector<uint64_t> shape) {
  const std::optional<TorchHeldDtype> held = TorchHeldDtypeOf(st_dtype);
  if (!held || held->values_per_element <= 1) return shape;
  if (shape.empty() || shape.back() % held->values_per_element != 0) {
    throw std::invalid_argument(StrCat(
        "tensor '", name, "' of ", st_dtype, " has shape ", ShapeText(shape), ": torch's ",
        held->torch, " needs a last dimension that is a multiple of ", held->values_per_element));
  }
  shape.back() /= held->values_per_element;
  return shape;
}

StreamBuffers::StreamBuffers(uint64_t largest)
    : size(std::min(largest, kCheckpointGroupBytes)),
      bufs{AlignedBuffer(size, Pages::kReused), AlignedBuffer(size, Pages::kReused)} {}

void StreamRange(Engine& engine, const File& file, uint64_t offset, uint64_t length,
                 StreamBuffers& buffers, const std::function<void(std::byte*, size_t)>& consume) {
  if (length == 0) return;
  auto submit = [&](uint64_t done, int slot) {
    uint64_t n = std::min<uint64_t>(buffers.size, length - done);
    return std::pair(engine.Read(file, buffers.bufs[slot].data(), n, offset + done), n);
  };
  auto pending = submit(0, 0);
  // If `consume` (or a check) throws while the next group's read is in flight, wait for that read
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
    consume(buffers.bufs[slot].data(), n);
    done += n;
    slot = 1 - slot;
  }
}

std::string ProgressLine(std::string_view label, uint64_t done, uint64_t total, double seconds) {
  constexpr int kWidth = 30;
  const double frac = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
  const int filled = std::clamp(static_cast<int>(frac * kWidth), 0, kWidth);
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  char tail[160];
  std::snprintf(tail, sizeof(tail), "] %5.1f%% %.2f/%.2f GiB %.2f GB/s", frac * 100,
                static_cast<double>(done) / kGiB, static_cast<double>(total) / kGiB,
                static_cast<double>(done) / std::max(seconds, 1e-9) / 1e9);
  return StrCat("\r", label, " [", std::string(filled, '#'), std::string(kWidth - filled, ' '),
                tail);
}

std::optional<std::string> HeaderChecksumProblem(const SafetensorsHeader& header) {
  const auto hh = header.metadata.find(kHeaderChecksumKey);
  if (hh == header.metadata.end()) {
    // tensortier writes no other key of its own: the checksum's key name damaged (a flipped
    // bit) would otherwise switch the header's check off. (Data checksums without a header
    // checksum, another writer's, still pass.)
    for (const auto& [key, value] : header.metadata) {
      if (key.starts_with("tensortier.") && key != kTensorChecksumsKey) {
        return StrCat("metadata key ", PyRepr(key),
                      " is none tensortier writes (a damaged name of its header checksum)");
      }
    }
    return std::nullopt;
  }
  const std::optional<uint64_t> stored = ParseStoredChecksum(hh->second);
  if (!stored) {
    return StrCat("malformed ", kHeaderChecksumKey, " metadata: ", PyRepr(hh->second),
                  " is not 16 hex digits");
  }
  const uint64_t actual = SafetensorsHeaderDigest(header.entries, header.metadata);
  if (*stored == actual) return std::nullopt;
  return StrCat("header checksum mismatch (stored ", hh->second, ", the header gives ",
                Hex16(actual), "): names, shapes, dtypes, offsets or metadata were changed");
}

SafetensorsChecks ReadSafetensorsChecks(const CheckpointLayout& layout) {
  SafetensorsChecks c;
  c.want.resize(layout.items.size());
  const SafetensorsMetadata& metadata = layout.st.header.metadata;
  // What the header says (names, dtypes, shapes, offsets, metadata): its own checksum, compared
  // even where the tensors' checksums are missing (a damaged key name must not hide the damage
  // the header checksum sees), as load(verify=True) does.
  if (auto problem = HeaderChecksumProblem(layout.st.header)) c.problems.push_back(*problem);
  c.header_checked = metadata.contains(kHeaderChecksumKey);
  auto it = metadata.find(kTensorChecksumsKey);
  if (it == metadata.end()) return c;
  c.present = true;
  std::vector<std::string> names;
  names.reserve(layout.items.size());
  for (const auto& item : layout.items) names.push_back(item.name);
  TensorChecksums sums = ReadTensorChecksums(it->second, names);
  c.want = std::move(sums.want);
  c.problems.insert(c.problems.end(), sums.problems.begin(), sums.problems.end());
  return c;
}

void CheckSafetensorsHeaderChecksum(const std::string& path, const SafetensorsHeader& header) {
  if (auto problem = HeaderChecksumProblem(header)) throw FormatError(StrCat(path, ": ", *problem));
}

// 0 means "none" only when every entry records 0; one entry in 2^32 really has the CRC-32 0.
bool RecordsCrcs(const ZipDirectory& zip) {
  return std::any_of(zip.entries.begin(), zip.entries.end(),
                     [](const ZipEntry& e) { return e.size > 0 && e.crc32 != 0; });
}

std::string XxhMismatch(const std::string& name, uint64_t stored, uint64_t actual) {
  return ChecksumMismatch(PieceCheck::kXxh64, name, stored, actual);
}

std::string CrcMismatch(const ZipEntry& e, uint32_t actual) {
  return ChecksumMismatch(PieceCheck::kCrc32, e.name, e.crc32, actual);
}

uint32_t ZipEntryCrc(Engine& engine, const File& file, const TorchCheckpoint& torch,
                     const ZipEntry& e, StreamBuffers& buffers) {
  if (e.name == StrCat(torch.prefix, "/data.pkl")) return torch.pickle_crc32;
  uint32_t crc = 0;
  StreamRange(engine, file, e.data_offset, e.size, buffers,
              [&](const std::byte* p, size_t n) { crc = Crc32(p, n, crc); });
  return crc;
}

VerifyReport VerifyCheckpointData(const std::string& path, const CheckpointLayout& layout,
                                  const std::vector<std::string>& names) {
  VerifyReport report;
  report.problems = MissingTensorProblems(layout, names);
  std::vector<std::string>& problems = report.problems;
  uint64_t largest = 0;  // the longest range streamed: a tensor's, or a zip entry's
  for (const auto& item : layout.items) largest = std::max(largest, item.nbytes);
  for (const auto& e : layout.torch.zip.entries) largest = std::max(largest, e.size);
  StreamBuffers buffers(largest);  // before the engine: its destructor waits for reads into them
  Engine engine;
  File file = OpenCheckpointForReading(path, true);
  if (layout.format == CheckpointFormat::kSafetensors) {
    const SafetensorsChecks sums = ReadSafetensorsChecks(layout);
    problems.insert(problems.end(), sums.problems.begin(), sums.problems.end());
    if (!sums.present) {
      // As load(verify=True): a file without checksums cannot be verified, which is not a pass.
      problems.push_back(StrCat("no checksums (metadata key ", kTensorChecksumsKey,
                                "): the data cannot be verified; save it with "
                                "tensortier.save(..., checksum=True) to verify it"));
      return report;
    }
    report.header_unsumed = !sums.header_checked;
    report.header_checked = sums.header_checked;
    for (size_t i = 0; i < layout.items.size(); ++i) {
      const CheckpointItem& item = layout.items[i];
      if (!sums.want[i]) continue;  // a problem above already
      Xxh64State h;
      StreamRange(engine, file, item.offset, item.nbytes, buffers,
                  [&](const std::byte* p, size_t n) { h.Update(p, n); });
      if (h.Digest() != *sums.want[i]) {
        problems.push_back(XxhMismatch(item.name, *sums.want[i], h.Digest()));
      }
      ++report.checked;
    }
    return report;
  }
  const bool records_crcs = RecordsCrcs(layout.torch.zip);
  uint64_t unrecorded = 0;
  for (const auto& e : layout.torch.zip.entries) {
    RequireStored(e, path);
    if (!records_crcs && e.size > 0) {
      ++unrecorded;
      continue;
    }
    const uint32_t crc = ZipEntryCrc(engine, file, layout.torch, e, buffers);
    if (crc != e.crc32) problems.push_back(CrcMismatch(e, crc));
    ++report.checked;
  }
  if (unrecorded > 0) {
    // As load(verify=True): a file saved without CRC-32s cannot be verified, which is not a pass.
    problems.push_back(
        StrCat(unrecorded, unrecorded == 1 ? " zip entry records" : " zip entries record",
               " no CRC-32 (saved with torch.serialization.set_crc32_options(False)):"
               " its data cannot be verified"));
  }
  return report;
}

}  // namespace tensortier
