#include "tensortier/checkpoint/checkpoint_format.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <set>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

bool EndsWithIgnoringCase(std::string_view text, std::string_view suffix) {
  if (text.size() < suffix.size()) return false;
  text.remove_prefix(text.size() - suffix.size());
  return std::equal(text.begin(), text.end(), suffix.begin(), [](char a, char b) {
    return std::tolower(static_cast<unsigned char>(a)) == b;
  });
}

// An absolute name, or one with a ".." part ('/' or '\' separated: an index written on Windows).
bool LeavesTheDirectory(std::string_view name) {
  if (name.starts_with('/') || name.starts_with('\\')) return true;
  size_t start = 0;
  for (;;) {
    const size_t end = name.find_first_of("/\\", start);
    if (name.substr(start, end == std::string_view::npos ? end : end - start) == "..") return true;
    if (end == std::string_view::npos) return false;
    start = end + 1;
  }
}

}  // namespace

std::string_view CheckpointFormatName(CheckpointFormat format) {
  return NameOf(kCheckpointFormatNames, format, "torch");
}

namespace {

std::optional<CheckpointFormat> FormatOfLastSuffix(std::string_view path) {
  for (const char* suffix : {".safetensors", ".st"}) {
    if (EndsWithIgnoringCase(path, suffix)) return CheckpointFormat::kSafetensors;
  }
  for (const char* suffix : {".pt", ".pth", ".bin", ".ckpt", ".tar"}) {
    if (EndsWithIgnoringCase(path, suffix)) return CheckpointFormat::kTorch;
  }
  return std::nullopt;
}

}  // namespace

std::optional<CheckpointFormat> FormatOfSuffix(std::string_view path) {
  if (auto named = FormatOfLastSuffix(path)) return named;
  // "model.safetensors.tmp": a name written, then renamed to the one its format is named by.
  const size_t dot = path.rfind('.');
  const size_t slash = path.find_last_of("/\\");
  if (dot == std::string_view::npos || (slash != std::string_view::npos && dot < slash)) {
    return std::nullopt;
  }
  return FormatOfLastSuffix(path.substr(0, dot));
}

std::string_view CheckpointKindName(CheckpointKind kind) {
  return NameOf(kCheckpointKindNames, kind);
}

CheckpointKind DetectCheckpointKind(const ByteSource& source) {
  if (source.name().ends_with(".index.json")) return CheckpointKind::kShardIndex;
  if (source.size() == 0) {
    throw FormatError(StrCat(source.name(),
                             ": empty file (0 bytes): not a checkpoint (tried safetensors and "
                             "torch.save zip)"));
  }
  if (LooksLikeZip(source)) return CheckpointKind::kTorch;
  unsigned char head[16] = {};
  const uint64_t n = std::min<uint64_t>(source.size(), sizeof(head));
  source.ReadAt(0, head, n);
  // A safetensors file's JSON header follows its 8-byte length, whose bytes may be '{' or white
  // space themselves: byte 8 decides first.
  if (n >= 9 && head[8] == '{') return CheckpointKind::kSafetensors;
  for (uint64_t i = 0; i < n; ++i) {
    if (head[i] == ' ' || head[i] == '\n' || head[i] == '\r' || head[i] == '\t') continue;
    if (head[i] == '{') return CheckpointKind::kShardIndex;
    break;
  }
  if (head[0] == 0x80) ThrowLegacyTorchFile(source.name());
  // Not the '{' a safetensors header starts with: a file named for safetensors is a damaged one
  // (its reader says what is wrong), any other is of another format (.npy, .gz, text).
  if (n < 9 || FormatOfSuffix(source.name()) == CheckpointFormat::kSafetensors) {
    return CheckpointKind::kSafetensors;
  }
  std::string first;
  for (uint64_t i = 0; i < 8; ++i) {
    static constexpr char kDigits[] = "0123456789abcdef";
    first += i ? " " : "";
    first += kDigits[head[i] >> 4];
    first += kDigits[head[i] & 15];
  }
  throw FormatError(StrCat(source.name(),
                           ": not a checkpoint: neither a torch.save zip nor a safetensors file "
                           "(its first bytes are ",
                           first, ")"));
}

CheckpointKind DetectCheckpointKind(const std::string& path) {
  return DetectCheckpointKind(FileSource(OpenCheckpointForReading(path, false)));
}

std::vector<Shard> ReadShardIndex(const std::string& path) {
  FileSource source(OpenCheckpointForReading(path, false));
  if (source.size() > kMaxShardIndexBytes) {
    throw FormatError(
        StrCat(path, ": larger than ", FormatSize(kMaxShardIndexBytes), ": not a shard index"));
  }
  std::string text(source.size(), '\0');
  source.ReadAt(0, text.data(), text.size());
  JsonReader r(text, StrCat(path, ": shard index JSON"));
  std::vector<Shard> shards;
  std::map<std::string, size_t> by_file;
  std::set<std::string> names;
  bool has_map = false;
  r.Expect('{');
  if (!r.Consume('}')) {
    do {
      std::string key = r.ReadString();
      r.Expect(':');
      if (key != "weight_map") {
        r.SkipValue();
        continue;
      }
      if (has_map) r.Fail("two 'weight_map' members");
      has_map = true;
      r.Expect('{');
      if (r.Consume('}')) continue;
      do {
        std::string name = r.ReadString();
        if (!names.insert(name).second) r.Fail(StrCat("tensor '", name, "' is listed twice"));
        r.Expect(':');
        if (r.Peek() != '"') r.Fail(StrCat("the shard of '", name, "' is not a string"));
        // A file name: any bytes, those that are not UTF-8 written \udcXX, as extent maps
        // store theirs (JsonStrings::kBytes).
        std::string file = r.ReadString(JsonStrings::kBytes);
        if (LeavesTheDirectory(file)) {
          throw FormatError(
              StrCat(path, ": shard '", file, "' lies outside the index's directory"));
        }
        if (file.ends_with(".index.json")) {  // DetectCheckpointKind's rule; also stops a loop
          throw FormatError(StrCat(path, ": shard '", file, "' is itself an index"));
        }
        // One file however the index spells it ("a.safetensors", "./a.safetensors").
        auto [it, added] =
            by_file.emplace(std::filesystem::path(file).lexically_normal().string(), shards.size());
        if (added) {
          shards.push_back({(std::filesystem::path(path).parent_path() / file).string(), {}});
        }
        shards[it->second].names.push_back(std::move(name));
      } while (r.Consume(','));
      r.Expect('}');
    } while (r.Consume(','));
    r.Expect('}');
  }
  r.ExpectEnd();
  if (!has_map) throw FormatError(StrCat(path, ": not a shard index: no 'weight_map'"));
  if (shards.empty()) throw FormatError(StrCat(path, ": a shard index naming no tensors"));
  return shards;
}

}  // namespace tensortier
