// `tensortier info|verify|convert`: inspect, check and convert checkpoint files (safetensors and
// torch.save zip). The work is the checkpoint pipeline's (checkpoint_pipeline.hpp); this file
// parses the command lines and prints what the pipeline reports.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "cli.hpp"
#include "tensortier/checkpoint/checkpoint_format.hpp"
#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/dcp_file.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/checkpoint/hf_checkpoint.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier::cli {
namespace {

using Format = CheckpointFormat;

std::string ShapeString(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += StrCat(i ? ", " : "", shape[i]);
  return s + "]";
}

// Prints a note on stderr after what stdout holds so far (the lines stay in order where both
// streams go to one pipe).
void Note(const std::string& text) {
  std::fflush(stdout);
  std::fprintf(stderr, "note: %s\n", text.c_str());
}

// A Hugging Face model directory (as save_pretrained writes it) is read through the file
// transformers' from_pretrained reads (HfWeightsFile); any other path is itself. A directory of
// no checkpoint (a config.json only: a download that did not finish) is refused saying what was
// looked for.
std::string ModelDirectoryFile(const std::string& path) {
  if (std::optional<std::string> weights = HfWeightsFile(path)) return *weights;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    // The library's refusal of a directory (EISDIR, what to pass), with what was looked for.
    ThrowIoError(EISDIR,
                 "read a checkpoint (a directory: pass a checkpoint file or a shard .index.json; "
                 "it holds no model.safetensors, model.safetensors.index.json, pytorch_model.bin "
                 "or pytorch_model.bin.index.json, nor a DCP .metadata)",
                 path);
  }
  return path;
}

// Notes the tensors that shard files hold and the index names for none of its spellings of the
// file: tensortier.load leaves them out, while from_pretrained loads every tensor of a file it
// reads. Files that cannot be read were reported already and are skipped.
void NoteUnindexedTensors(const std::string& index, const std::vector<Shard>& shards) {
  std::map<std::pair<dev_t, ino_t>, std::pair<std::string, std::set<std::string>>> files;
  for (const Shard& shard : shards) {
    struct stat st;
    if (stat(shard.path.c_str(), &st) != 0) continue;
    auto& [path, names] = files[{st.st_dev, st.st_ino}];
    if (path.empty()) path = shard.path;
    names.insert(shard.names.begin(), shard.names.end());
  }
  for (const auto& [id, file] : files) {
    std::vector<std::string> unindexed;
    try {
      for (const CheckpointItem& item :
           ReadCheckpointLayout(file.first, /*opaque_objects=*/true).items) {
        if (!file.second.contains(item.name)) unindexed.push_back(item.name);
      }
    } catch (const std::exception&) {
      continue;
    }
    if (unindexed.empty()) continue;
    Note(StrCat(TerminalText(file.first), " holds ", Count(unindexed.size(), "tensor"),
                " that the index ", TerminalText(index), " does not name (",
                unindexed.size() > 1 ? "first: " : "", TerminalText(unindexed.front()),
                "): tensortier.load leaves them out; transformers' from_pretrained loads them"));
  }
}

// Whether `name` is a shard file of the weights an index named `index_name` maps, in transformers'
// naming: model.safetensors.index.json maps model-00001-of-00003.safetensors, and its variant
// model.safetensors.index.fp16.json maps model.fp16-00001-of-00003.safetensors.
bool IsShardNameOfIndex(const std::string& name, const std::string& index_name) {
  const size_t index_at = index_name.find(".index");
  const std::string weights = index_name.substr(0, index_at);  // model.safetensors
  const size_t dot = weights.rfind('.');
  if (index_at == std::string::npos || !index_name.ends_with(".json") || dot == std::string::npos ||
      dot == 0) {
    return false;
  }
  // ".fp16" for model.safetensors.index.fp16.json, "" for model.safetensors.index.json.
  const size_t variant_at = index_at + std::string_view(".index").size();
  const std::string variant = index_name.substr(
      variant_at, index_name.size() - variant_at - std::string_view(".json").size());
  const std::string prefix = StrCat(weights.substr(0, dot), variant, "-");
  const std::string ext = weights.substr(dot);
  if (!name.starts_with(prefix) || !name.ends_with(ext) ||
      name.size() <= prefix.size() + ext.size()) {
    return false;
  }
  const std::string middle = name.substr(prefix.size(), name.size() - prefix.size() - ext.size());
  const size_t of = middle.find("-of-");
  const auto digits = [](std::string_view d) {
    return !d.empty() &&
           std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return of != std::string::npos && digits(std::string_view(middle).substr(0, of)) &&
         digits(std::string_view(middle).substr(of + 4));
}

// Notes the shard files beside an index that it names none of (a shard of an earlier save with
// more shards, left by a copy or an interrupted save): neither tensortier.load nor
// from_pretrained reads them, and they take space.
void NoteUnreferencedShards(const std::string& index, const std::vector<Shard>& shards) {
  const std::filesystem::path index_path(index);
  const std::filesystem::path dir =
      index_path.has_parent_path() ? index_path.parent_path() : std::filesystem::path(".");
  std::set<std::pair<dev_t, ino_t>> named;
  for (const Shard& shard : shards) {
    struct stat st;
    if (stat(shard.path.c_str(), &st) == 0) named.insert({st.st_dev, st.st_ino});
  }
  std::vector<std::string> unreferenced;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    struct stat st;
    if (!IsShardNameOfIndex(entry.path().filename().string(), index_path.filename().string()) ||
        stat(entry.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode) ||
        named.contains({st.st_dev, st.st_ino})) {
      continue;
    }
    unreferenced.push_back(entry.path().string());
  }
  std::sort(unreferenced.begin(), unreferenced.end());
  for (const std::string& file : unreferenced) {
    Note(StrCat(TerminalText(file), " is a shard file beside the index ", TerminalText(index),
                ", which names none of its tensors: neither tensortier.load nor transformers' "
                "from_pretrained reads it"));
  }
}

bool IsShardIndexFile(const std::string& path) {
  return DetectCheckpointKind(path) == CheckpointKind::kShardIndex;
}

// `names`: tensors a shard index puts in this file (a missing one is an error, as for
// tensortier.load).
int InfoFile(const std::string& path, unsigned show, const std::vector<std::string>& names = {}) {
  const CheckpointLayout l = ReadCheckpointLayout(path, /*opaque_objects=*/true);
  if (auto missing = MissingTensorProblems(l, names); !missing.empty()) {
    throw FormatError(StrCat(path, ": ", missing.front()));
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
    const CheckpointItem& it = l.items[i];
    std::printf("  %-40s %-6s %-20s %s\n", TerminalText(it.name).c_str(),
                TerminalText(it.dtype).c_str(), ShapeString(it.shape).c_str(),
                it.meta ? "meta (no data)" : StrCat("offset ", it.offset).c_str());
  }
  if (l.items.size() > show) {
    std::printf("  ... %zu more (--shapes N shows more)\n", l.items.size() - show);
  }
  return 0;
}

// `names`: tensors a shard index puts in this file (a missing one is a problem).
int VerifyFile(const std::string& path, const std::vector<std::string>& names = {}) {
  // Throws on any structural problem.
  const CheckpointLayout l = ReadCheckpointLayout(path, /*opaque_objects=*/true);
  const bool st = l.format == Format::kSafetensors;
  const std::string shown_path = TerminalText(path);
  std::printf("%s: structure OK (%s, %s)\n", shown_path.c_str(),
              st ? "safetensors" : "torch.save zip", Count(l.items.size(), "tensor").c_str());
  const VerifyReport r = VerifyCheckpointData(path, l, names);
  if (r.header_unsumed) {
    std::printf(
        "%s: no header checksum (metadata key %s): names, shapes and metadata not "
        "checked\n",
        shown_path.c_str(), kHeaderChecksumKey);
  }
  std::fflush(stdout);  // keep the lines in order where both streams go to one pipe
  for (const auto& p : r.problems) {
    std::fprintf(stderr, "%s: %s\n", shown_path.c_str(), TerminalText(p).c_str());
  }
  if (!r.problems.empty()) {
    std::fprintf(stderr, "%s: verify FAILED (%zu %s)\n", shown_path.c_str(), r.problems.size(),
                 r.problems.size() == 1 ? "problem" : "problems");
    return 1;
  }
  std::printf("%s: data OK (%llu %s%s checked)\n", shown_path.c_str(),
              static_cast<unsigned long long>(r.checked),
              st ? "tensor checksums" : "zip entry CRCs",
              r.header_checked ? " and the header checksum" : "");
  return 0;
}

// A torch.distributed.checkpoint directory: its metadata's items, per data file.
// Notes the data files in `dir` that its metadata does not name (a save that died before its
// commit, whose files the next save removes, or files copied in): loads never read them.
void NoteUnnamedDcpFiles(const std::string& dir, const DcpMetadata& md) {
  std::set<std::string> named;
  for (const auto& it : md.items) named.insert(it.relative_path);
  const std::vector<std::string> others = UnnamedDcpDataFiles(dir, named);
  if (others.empty()) return;
  Note(StrCat(TerminalText(dir), " holds ", Count(others.size(), "data file"),
              " its .metadata does not name (first: ", TerminalText(others.front()),
              "), which loads never read: left by a save that did not commit, or copied in"));
}

int InfoDcp(const std::string& dir, unsigned show) {
  size_t rank_local = 0;
  const DcpMetadata md = ReadDcpMetadataOfSave(dir, &rank_local);
  std::map<std::string, std::pair<size_t, uint64_t>> files;  // items, bytes
  size_t summed = 0;
  for (const auto& it : md.items) {
    auto& f = files[it.relative_path];
    ++f.first;
    f.second += it.length;
    summed += it.xxh64.has_value();
  }
  std::printf("directory: %s\n", TerminalText(dir).c_str());
  std::printf("format:    torch.distributed.checkpoint (version %s)\n",
              md.version.empty() ? "unset" : TerminalText(md.version).c_str());
  if (rank_local > 0) {
    std::printf("metadata:  %s (a save with use_collectives=False: no .metadata)\n",
                Count(rank_local, "rank-local file").c_str());
  }
  std::printf("items:     %zu (%zu with an xxh64)\n", md.items.size(), summed);
  std::printf("files:     %zu\n", files.size());
  for (const auto& [name, f] : files) {
    std::printf("  %-40s %s, %llu bytes\n", TerminalText(name).c_str(),
                Count(f.first, "item").c_str(), static_cast<unsigned long long>(f.second));
  }
  std::printf("items (%s):\n", md.items.size() > show ? StrCat("first ", show).c_str() : "all");
  for (size_t i = 0; i < md.items.size() && i < show; ++i) {
    const DcpStoredItem& it = md.items[i];
    std::printf("  %-40s %-5s %s offset %llu length %llu\n", TerminalText(it.name).c_str(),
                it.bytes ? "bytes" : "tensor", TerminalText(it.relative_path).c_str(),
                static_cast<unsigned long long>(it.offset),
                static_cast<unsigned long long>(it.length));
  }
  if (md.items.size() > show) {
    std::printf("  ... %zu more (--shapes N shows more)\n", md.items.size() - show);
  }
  // What the listing shows must be there to load (verify reads it too): a missing data file is
  // an error, named with the metadata (and when the files are another save's).
  std::vector<std::string> names;
  for (const auto& [name, f] : files) names.push_back(name);
  std::fflush(stdout);
  CheckDcpDataFilesPresent(dir, names);
  NoteUnnamedDcpFiles(dir, md);
  return 0;
}

int VerifyDcp(const std::string& dir) {
  const DcpMetadata md = ReadDcpMetadataOfSave(dir);
  Engine engine;
  const DcpVerifyReport r = VerifyDcpCheckpoint(engine, dir, md);
  const std::string shown = TerminalText(dir);
  NoteUnnamedDcpFiles(dir, md);
  std::fflush(stdout);
  for (const auto& p : r.problems) std::fprintf(stderr, "%s\n", TerminalText(p).c_str());
  if (!r.problems.empty()) {
    std::fprintf(stderr, "%s: verify FAILED (%zu %s)\n", shown.c_str(), r.problems.size(),
                 r.problems.size() == 1 ? "problem" : "problems");
    return 1;
  }
  std::printf("%s: DCP checkpoint OK (%s checked, %llu without a checksum%s)\n", shown.c_str(),
              Count(r.checked, "item").c_str(), static_cast<unsigned long long>(r.unchecked),
              r.transformed == 0
                  ? ""
                  : StrCat(", ", r.transformed,
                           " stored through stream transforms (compressed) and not read")
                        .c_str());
  return 0;
}

int RunConvertImpl(const std::vector<std::string>& argv) {
  Args args(argv, {}, {});
  if (args.positionals().size() != 2) {
    throw UsageError("convert takes IN and OUT");
  }
  const std::string& in = args.positionals()[0];
  const std::string& out = args.positionals()[1];
  const ConvertReport r = ConvertCheckpoint(in, out);
  const std::string shown_in = TerminalText(in);
  if (r.written == Format::kSafetensors) {
    std::printf("%s -> %s: %s, %llu data bytes at offset %llu (xxh64 checksums in %s)\n",
                shown_in.c_str(), TerminalText(out).c_str(), Count(r.tensors, "tensor").c_str(),
                static_cast<unsigned long long>(r.data_bytes),
                static_cast<unsigned long long>(r.data_start), kTensorChecksumsKey);
    if (r.dropped_values > 0) {
      Note(StrCat(Count(r.dropped_values, "non-tensor value"),
                  " not converted (safetensors holds only tensors)"));
    }
    if (r.unchecked) {
      Note(StrCat(shown_in,
                  " records no CRC-32s (saved with "
                  "torch.serialization.set_crc32_options(False)): its data was not checked"));
    }
    return 0;
  }
  std::printf(
      "%s -> %s: %s, %llu data bytes in torch.save zip format (folder '%s', "
      "storages 4096-byte aligned, CRC-32 recorded)\n",
      shown_in.c_str(), TerminalText(out).c_str(), Count(r.tensors, "tensor").c_str(),
      static_cast<unsigned long long>(r.data_bytes), TerminalText(r.folder).c_str());
  if (r.dropped_metadata > 0) {
    Note(StrCat(Count(r.dropped_metadata, "safetensors metadata key"),
                " not converted (torch.load returns only the tensors)"));
  }
  if (r.unchecked) {
    Note(StrCat(shown_in, " has no checksums (metadata key ", kTensorChecksumsKey,
                "): its data was not checked"));
  }
  return 0;
}

// A DCP checkpoint's .metadata, rank-local metadata or data file is checked with its directory
// (its items' checksums are in the metadata): FormatError naming the directory to give instead.
void RefuseFileOfDcpDirectory(const std::string& path, const char* command) {
  const std::filesystem::path p(path);
  const std::string name = p.filename().string();
  const bool dcp_name =
      name == kDcpMetadataName || IsDcpDataFile(name) || IsRankLocalDcpMetadata(name);
  if (!dcp_name || !std::filesystem::is_regular_file(p)) return;
  const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
  if (!IsDcpDirectory(dir)) return;
  throw FormatError(StrCat(path, ": a file of the DCP checkpoint ", dir,
                           " (torch.distributed.checkpoint), read through its directory: "
                           "tensortier ",
                           command, " ", dir));
}

int RunInfoImpl(const std::vector<std::string>& argv) {
  Args args(argv, {}, {"shapes"});
  if (args.positionals().size() != 1) throw UsageError("info takes one FILE");
  const unsigned show = args.Unsigned("shapes", 20);
  if (IsDcpDirectory(args.positionals()[0])) return InfoDcp(args.positionals()[0], show);
  RefuseFileOfDcpDirectory(args.positionals()[0], "info");
  const std::string path = ModelDirectoryFile(args.positionals()[0]);
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
  NoteUnindexedTensors(path, shards);
  NoteUnreferencedShards(path, shards);
  return 0;
}

int RunVerifyImpl(const std::vector<std::string>& argv) {
  Args args(argv, {}, {});
  if (args.positionals().size() != 1) throw UsageError("verify takes one FILE");
  if (IsDcpDirectory(args.positionals()[0])) return VerifyDcp(args.positionals()[0]);
  RefuseFileOfDcpDirectory(args.positionals()[0], "verify");
  const std::string path = ModelDirectoryFile(args.positionals()[0]);
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
  NoteUnindexedTensors(path, shards);
  NoteUnreferencedShards(path, shards);
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
