// The pipeline's convert step: a checkpoint file rewritten in the other format, its bytes
// streamed once from the input to the output and checked on the way.
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string_view>
#include <unordered_map>

#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/checkpoint/torch_file_writer.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// convert's refusal of a file its own checksums say is damaged.
[[noreturn]] void RefuseDamaged(const std::string& in, const std::string& problem) {
  throw FormatError(StrCat(in, ": ", problem, ": the file is damaged; nothing was written"));
}

// The safetensors entry of torch tensor `t` (item `item` of its file), or std::invalid_argument
// for what safetensors cannot hold.
SafetensorsEntry SafetensorsEntryOf(const TorchCheckpoint& torch, const TorchTensor& t,
                                    const CheckpointItem& item) {
  if (t.meta) {
    throw std::invalid_argument(StrCat("tensor '", t.path,
                                       "' is a meta tensor (no data): safetensors cannot "
                                       "store it without data"));
  }
  if (item.swap_misaligned) {
    throw std::invalid_argument(
        StrCat("tensor '", t.path, "' of ", t.dtype, " views a big-endian ",
               torch.pickle.storages.at(t.storage_key).dtype,
               " storage off its elements' boundaries; convert cannot swap its bytes: load it with "
               "tensortier.load and save that"));
  }
  const Dtype* row = DtypeNamed(t.dtype);
  const std::string dtype(row != nullptr ? row->safetensors : std::string_view());
  if (dtype.empty()) {
    throw std::invalid_argument(StrCat("tensor '", t.path, "' has dtype ", t.dtype, " (torch.",
                                       TorchDtypeAttribute(t.dtype),
                                       "), which safetensors cannot store"));
  }
  if (t.conj || t.neg) {
    // Its bytes are not its values, and safetensors has no flag to say so.
    throw std::invalid_argument(
        StrCat("tensor '", t.path, "' was saved as a ", t.conj ? "conjugate" : "negative",
               " view (its storage holds other numbers than its values); convert copies bytes: "
               "save it with .resolve_conj().resolve_neg() first, or load it with tensortier.load "
               "and save that"));
  }
  if (!t.contiguous()) {
    throw std::invalid_argument(StrCat("tensor '", t.path,
                                       "' is not contiguous; convert copies only contiguous "
                                       "tensors (call .contiguous() before torch.save)"));
  }
  return {t.path, dtype, SafetensorsShape(t.path, t.dtype, item.shape), 0, t.nbytes()};
}

// A safetensors file of the torch file's tensors (laid out by PlanSafetensorsLayout), each zip
// entry read once, start to end: its
// CRC-32 is checked from the same reads that copy the tensors viewing it (several tensors may
// share an entry, or leave parts of it unviewed).
ConvertReport TorchToSafetensors(const CheckpointLayout& l, const std::string& in,
                                 const std::string& out) {
  std::vector<SafetensorsEntry> entries;
  std::vector<std::pair<std::string, uint64_t>> sums;
  std::set<std::string_view> named;
  std::vector<uint64_t> sizes;
  std::vector<unsigned> widths;
  uint64_t data = 0;
  for (size_t index = 0; index < l.torch.pickle.tensors.size(); ++index) {
    const TorchTensor& t = l.torch.pickle.tensors[index];
    if (!named.insert(t.path).second) {
      // Names are key paths joined by '.': {"a": {"b": x}} and {"a.b": y} meet, and keys that
      // are neither str nor int all read "<key>". A safetensors file names each tensor once.
      throw std::invalid_argument(
          StrCat("two tensors get the name '", t.path,
                 "' (safetensors names are the key paths joined by '.'; keys other than str "
                 "and int read '<key>'), and a safetensors file names each tensor once: give "
                 "them distinct string keys before torch.save"));
    }
    entries.push_back(SafetensorsEntryOf(l.torch, t, l.items[index]));
    sizes.push_back(t.nbytes());
    widths.push_back(TorchDtypeBytes(t.dtype));
    sums.emplace_back(t.path, 0);  // fixed width: the header size does not change later
  }
  const std::vector<uint64_t> starts = PlanSafetensorsLayout(sizes, widths);
  for (size_t i = 0; i < entries.size(); ++i) {
    entries[i].begin = starts[i];
    entries[i].end = starts[i] + sizes[i];
    data += sizes[i];
  }
  SafetensorsMetadata metadata = {{"format", "pt"}};
  SetChecksumMetadata(entries, sums, metadata);
  std::string header = SerializeSafetensorsHeader(entries, metadata, kCheckpointAlignment);
  const uint64_t data_start = header.size();

  uint64_t largest = 0;  // the longest zip entry streamed
  for (const auto& e : l.torch.zip.entries) largest = std::max(largest, e.size);
  StreamBuffers buffers(largest);  // before the engine: it waits for I/O still in flight
  Engine engine;
  File src = OpenCheckpointForReading(in, true);
  DurableFile out_file(out);
  const File& dst = out_file.file();
  out_file.Reserve(data_start + data);
  const bool records_crcs = RecordsCrcs(l.torch.zip);
  std::unordered_map<std::string, std::vector<size_t>> views;  // entry name -> items
  for (size_t i = 0; i < l.items.size(); ++i) {
    if (l.items[i].nbytes == 0) continue;
    views[StrCat(l.torch.prefix, "/data/", l.torch.pickle.tensors[i].storage_key)].push_back(i);
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
      const uint32_t crc = ZipEntryCrc(engine, src, l.torch, *e, buffers);
      if (crc != e->crc32) RefuseDamaged(in, CrcMismatch(*e, crc));
      continue;
    }
    std::vector<size_t> pending = std::move(v->second);  // this entry's views, by start
    std::stable_sort(pending.begin(), pending.end(),
                     [&](size_t a, size_t b) { return l.items[a].offset < l.items[b].offset; });
    std::vector<size_t> active;  // views reaching into the current group
    size_t next = 0;
    uint64_t at = e->data_offset;
    uint32_t crc = 0;
    // StreamRange reads the next group into the other buffer meanwhile; this one is free again
    // once its writes complete, before StreamRange refills it.
    StreamRange(engine, src, e->data_offset, e->size, buffers, [&](std::byte* p, size_t n) {
      if (records_crcs) crc = Crc32(p, n, crc);  // the bytes as stored
      const uint64_t end = at + n;
      while (next < pending.size() && l.items[pending[next]].offset < end) {
        active.push_back(pending[next++]);
      }
      // A big-endian storage's units are swapped once per group (groups hold whole units, and
      // every view of one storage has its width).
      if (!active.empty()) ReverseUnits(p, n, l.items[active.front()].swap_width);
      for (size_t k = 0; k < active.size();) {
        const size_t i = active[k];
        const CheckpointItem& item = l.items[i];
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
  for (size_t i = 0; i < l.items.size(); ++i) sums[i].second = hashes[i].Digest();
  SetChecksumMetadata(entries, sums, metadata);
  header = SerializeSafetensorsHeader(entries, metadata, kCheckpointAlignment);
  if (header.size() != data_start) throw std::logic_error("convert: header size changed");
  engine.Write(dst, header.data(), header.size(), 0).Wait();
  out_file.Commit();
  ConvertReport report;
  report.written = CheckpointFormat::kSafetensors;
  report.tensors = entries.size();
  report.data_bytes = data;
  report.data_start = data_start;
  report.dropped_values = l.torch.pickle.other_values;
  report.unchecked = !records_crcs;
  return report;
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

// A torch.save zip file holding the safetensors file's tensors in a plain dict, in file order,
// each in its own storage ("<folder>/data/<i>") whose data starts on a 4 KiB boundary
// (TorchFileWriter: why there is no .format_version there).
ConvertReport SafetensorsToTorch(const CheckpointLayout& l, const std::string& in,
                                 const std::string& out) {
  // The input's own checksums, checked as its bytes are copied: a damaged file is refused, not
  // passed on with fresh CRC-32s that would make it look sound.
  const SafetensorsChecks sums = ReadSafetensorsChecks(l);
  if (!sums.problems.empty()) RefuseDamaged(in, sums.problems.front());
  std::vector<TorchPickleTensor> tensors;
  std::vector<uint64_t> offsets, sizes;
  for (size_t i = 0; i < l.items.size(); ++i) {
    const CheckpointItem& item = l.items[i];
    const std::optional<TorchHeldDtype> held = TorchHeldDtypeOf(item.dtype);
    if (!held || !TorchSupportsDtype(held->name)) {
      throw std::invalid_argument(StrCat("tensor '", item.name, "' has dtype ", item.dtype,
                                         ", which torch has no dtype for: cannot convert"));
    }
    std::vector<uint64_t> shape;
    try {
      shape = TorchShape(item.name, item.dtype, item.shape);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(StrCat(e.what(), ": cannot convert"));
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
        RefuseDamaged(in, XxhMismatch(l.items[i].name, *sums.want[i], actual));
      }
    }
  }
  out_file.Commit();
  ConvertReport report;
  report.written = CheckpointFormat::kTorch;
  report.tensors = l.items.size();
  report.data_bytes = std::accumulate(sizes.begin(), sizes.end(), uint64_t{0});
  report.folder = prefix;
  report.dropped_metadata = l.st.header.metadata.size();
  report.unchecked = !sums.present;
  return report;
}

// Each format as convert's messages say it.
constexpr EnumName<CheckpointFormat> kFormatPhrases[] = {
    {CheckpointFormat::kSafetensors, "safetensors"},
    {CheckpointFormat::kTorch, "a torch.save zip"},
};

std::string_view FormatPhrase(CheckpointFormat format) {
  return NameOf(kFormatPhrases, format, "a torch.save zip");
}

// convert writes the other format than IN's: an OUT that is IN (replaced by a file of another
// format), or whose suffix names IN's format (a .bin holding safetensors), is refused.
void RequireConvertibleOutput(const std::string& in, const std::string& out,
                              CheckpointFormat writes) {
  struct stat in_st, out_st;
  if (stat(in.c_str(), &in_st) == 0 && stat(out.c_str(), &out_st) == 0 &&
      in_st.st_dev == out_st.st_dev && in_st.st_ino == out_st.st_ino) {
    throw std::invalid_argument(StrCat("convert: '", out, "' is the input file; convert writes ",
                                       FormatPhrase(writes), ": name another output"));
  }
  if (auto named = FormatOfSuffix(out); named && *named != writes) {
    const CheckpointFormat reads = writes == CheckpointFormat::kTorch
                                       ? CheckpointFormat::kSafetensors
                                       : CheckpointFormat::kTorch;
    throw std::invalid_argument(StrCat("convert: '", in, "' is ", FormatPhrase(reads),
                                       ", so convert writes ", FormatPhrase(writes), ", but '", out,
                                       "' names ", FormatPhrase(*named),
                                       " by its suffix: name the output for what it will hold"));
  }
}

}  // namespace

ConvertReport ConvertCheckpoint(const std::string& in, const std::string& out) {
  if (DetectCheckpointKind(in) == CheckpointKind::kShardIndex) {
    throw std::invalid_argument(
        StrCat("convert: '", in, "' is a shard index: convert each shard file it names"));
  }
  // Other objects (an argparse.Namespace, numpy state, a dataclass) are dropped as every
  // non-tensor value is, never called: read as opaque, as info and verify read them.
  const CheckpointLayout l = ReadCheckpointLayout(in, /*opaque_objects=*/true);
  RequireConvertibleOutput(in, out,
                           l.format == CheckpointFormat::kTorch ? CheckpointFormat::kSafetensors
                                                                : CheckpointFormat::kTorch);
  try {
    if (l.format == CheckpointFormat::kTorch) return TorchToSafetensors(l, in, out);
    return SafetensorsToTorch(l, in, out);
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

}  // namespace tensortier
