#include "tensortier/checkpoint/state_dict_checks.hpp"

#include <algorithm>
#include <cstdint>
#include <set>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// torch.Size as Python prints it: "torch.Size([])", "torch.Size([2, 3])".
std::string TorchSize(const std::vector<int64_t>& shape) {
  std::string out = "torch.Size([";
  for (size_t i = 0; i < shape.size(); ++i) out += StrCat(i ? ", " : "", shape[i]);
  return out + "])";
}

// `names` quoted and joined as load_state_dict lists them: "a", "b".
std::string QuotedList(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += StrCat(i ? ", " : "", "\"", names[i], "\"");
  return out;
}

}  // namespace

std::vector<std::vector<std::string>> OverlappingGroups(std::vector<MemoryArea> areas) {
  std::erase_if(areas, [](const MemoryArea& a) { return a.size == 0; });
  std::sort(areas.begin(), areas.end(), [](const MemoryArea& a, const MemoryArea& b) {
    return std::tie(a.device, a.address, a.size, a.name) <
           std::tie(b.device, b.address, b.size, b.name);
  });
  std::vector<std::vector<std::string>> groups;
  std::vector<std::string> current;
  const std::string* device = nullptr;
  uint64_t stop = 0;
  for (const MemoryArea& a : areas) {
    if (!current.empty() && a.device == *device && a.address < stop) {
      current.push_back(a.name);
      stop = std::max(stop, a.address + a.size);
      continue;
    }
    if (current.size() > 1) groups.push_back(std::move(current));
    current = {a.name};
    device = &a.device;
    stop = a.address + a.size;
  }
  if (current.size() > 1) groups.push_back(std::move(current));
  return groups;
}

std::pair<uint64_t, uint64_t> SpanInFile(const std::string& path, uint64_t file_size,
                                         const std::vector<FileRange>& ranges) {
  uint64_t begin = UINT64_MAX;
  uint64_t end = 0;
  for (const FileRange& r : ranges) {
    if (r.offset < 0 || r.size < 0 || r.offset > INT64_MAX - r.size) {
      throw FormatError(
          StrCat(path, ": ", PyRepr(r.name), " has offset ", r.offset, " and length ", r.size));
    }
    const auto offset = static_cast<uint64_t>(r.offset);
    const auto size = static_cast<uint64_t>(r.size);
    if (offset + size > file_size) {
      throw FormatError(StrCat(path, ": file ended early: ", PyRepr(r.name), " needs ", size,
                               " bytes at offset ", offset, ", the file has ", file_size,
                               " (truncated file?)"));
    }
    if (size == 0) continue;
    begin = std::min(begin, offset);
    end = std::max(end, offset + size);
  }
  return end == 0 ? std::pair<uint64_t, uint64_t>{0, 0} : std::pair{begin, end};
}

StateDictMatch MatchStateDict(const std::vector<NamedTensor>& targets,
                              const std::vector<NamedTensor>& saved, bool strict) {
  std::unordered_map<std::string_view, const NamedTensor*> saved_by_name;
  for (const NamedTensor& s : saved) saved_by_name.emplace(s.name, &s);
  std::unordered_set<std::string_view> target_names;
  using Memory = std::tuple<uint64_t, uint64_t, std::string_view, std::vector<int64_t>>;
  std::set<Memory> loaded;  // the memory of the targets the checkpoint holds
  for (const NamedTensor& t : targets) {
    target_names.insert(t.name);
    if (saved_by_name.contains(t.name)) loaded.emplace(t.address, t.size, t.dtype, t.shape);
  }
  StateDictMatch m;
  for (const NamedTensor& t : targets) {
    if (saved_by_name.contains(t.name)) continue;
    if (t.size == 0 || !loaded.contains(Memory(t.address, t.size, t.dtype, t.shape))) {
      m.missing.push_back(t.name);
    }
  }
  for (const NamedTensor& s : saved) {
    if (!target_names.contains(s.name)) m.unexpected.push_back(s.name);
  }
  if (strict && !m.missing.empty()) {
    m.errors.push_back(StrCat("Missing key(s) in state_dict: ", QuotedList(m.missing), ". "));
  }
  if (strict && !m.unexpected.empty()) {
    m.errors.push_back(StrCat("Unexpected key(s) in state_dict: ", QuotedList(m.unexpected), ". "));
  }
  // In the model's order, as load_state_dict visits its modules (not the file's).
  for (const NamedTensor& t : targets) {
    const auto s = saved_by_name.find(t.name);
    // load_state_dict's rule for what older versions saved 1-dim: a [1] entry fills a 0-dim one.
    if (s != saved_by_name.end() && s->second->shape != t.shape &&
        !(t.shape.empty() && s->second->shape == std::vector<int64_t>{1})) {
      m.errors.push_back(StrCat("size mismatch for ", t.name, ": copying a param with shape ",
                                TorchSize(s->second->shape),
                                " from checkpoint, the shape in current model is ",
                                TorchSize(t.shape), "."));
    }
  }
  return m;
}

}  // namespace tensortier
