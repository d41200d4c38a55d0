#include "tensortier/checkpoint/hf_checkpoint.hpp"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tensortier/checkpoint/checkpoint_format.hpp"
#include "tensortier/io/page_cache.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

namespace fs = std::filesystem;

bool IsFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// Whether config.json in `dir` is unreadable, not a JSON object, or names a quantization_config.
bool QuantizedOrUnreadable(const fs::path& dir) {
  std::ifstream in(dir / "config.json", std::ios::binary);
  if (!in) return true;
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return true;
  try {
    const std::string s = text.str();
    JsonReader r(s, "config.json");
    r.Expect('{');
    if (r.Consume('}')) return false;
    do {
      if (r.ReadString() == "quantization_config") return true;
      r.Expect(':');
      r.SkipValue();
    } while (r.Consume(','));
    r.Expect('}');
    r.ExpectEnd();
    return false;
  } catch (const FormatError&) {
    return true;
  }
}

}  // namespace

std::optional<HfCheckpoint> FindHfCheckpoint(const std::string& dir) {
  const fs::path d(dir);
  const fs::path index = d / "model.safetensors.index.json";
  const fs::path target = IsFile(index) ? index : d / "model.safetensors";
  if (!IsFile(target) || QuantizedOrUnreadable(d)) return std::nullopt;
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(d, ec)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  }
  return HfCheckpoint{target.string(), HfFilesCached(files)};
}

std::string HfShardIndexOf(const std::string& dir, const std::string& shard,
                           const std::map<std::string, std::string>& weight_map) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("model.safetensors.index") && name.ends_with(".json")) {
      names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  const std::string prefix = StrCat(dir, "/");
  for (const std::string& name : names) {
    const std::string path = StrCat(prefix, name);
    std::map<std::string, std::string> map;
    try {
      for (const Shard& s : ReadShardIndex(path)) {
        const std::string file = s.path.starts_with(prefix) ? s.path.substr(prefix.size()) : s.path;
        for (const std::string& tensor : s.names) map.emplace(tensor, file);
      }
    } catch (const FormatError&) {
      continue;  // another kind of file, or an index naming no tensors: not the one
    }
    if (map == weight_map) return path;
  }
  throw IoError(ENOENT, StrCat("find a shard index naming the shards of ", shard), dir, 0, 0);
}

bool HfFilesCached(const std::vector<std::string>& files) {
  const Residency r = QueryFilesResidency(files);
  return r.resident_bytes * 10 >= r.checked_bytes * 9;
}

}  // namespace tensortier
