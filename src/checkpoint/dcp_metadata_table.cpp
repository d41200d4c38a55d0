#include <algorithm>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

DcpMetadataTable::DcpMetadataTable(DcpMetadataContents md) : md_(std::move(md)) {
  entry_of_.reserve(md_.entries.size());
  for (size_t i = 0; i < md_.entries.size(); ++i) {
    const DcpMetadataEntry& e = md_.entries[i];
    entry_of_.emplace(e.fqn, i);
    for (const auto& [offsets, sizes] : e.chunks) chunk_of_.emplace(Key(e.fqn, offsets), &sizes);
  }
  storage_of_.reserve(md_.storage.size());
  for (size_t i = 0; i < md_.storage.size(); ++i) {
    storage_of_.emplace(Key(md_.storage[i].fqn, md_.storage[i].offset), i);
  }
}

std::string DcpMetadataTable::Key(std::string_view fqn,
                                  const std::optional<std::vector<int64_t>>& offset) {
  std::string key(fqn);
  key += '\0';
  if (!offset) return key + "none";
  for (int64_t v : *offset) key += StrCat(v, ",");
  return key;
}

const DcpMetadataEntry* DcpMetadataTable::Entry(std::string_view fqn) const {
  auto it = entry_of_.find(fqn);
  return it == entry_of_.end() ? nullptr : &md_.entries[it->second];
}

const DcpStorageEntry* DcpMetadataTable::Storage(
    std::string_view fqn, const std::optional<std::vector<int64_t>>& offset) const {
  auto it = storage_of_.find(Key(fqn, offset));
  return it == storage_of_.end() ? nullptr : &md_.storage[it->second];
}

const std::vector<int64_t>* DcpMetadataTable::ChunkSizes(
    std::string_view fqn, const std::vector<int64_t>& offsets) const {
  auto it = chunk_of_.find(Key(fqn, offsets));
  return it == chunk_of_.end() ? nullptr : it->second;
}

bool DcpMetadataTable::StoredWhole(const DcpMetadataEntry& entry) const {
  if (entry.bytes || entry.chunks.size() != 1) return false;
  const auto& [offsets, sizes] = entry.chunks[0];
  return sizes == entry.size && offsets.size() == sizes.size() &&
         std::all_of(offsets.begin(), offsets.end(), [](int64_t v) { return v == 0; });
}

std::vector<std::string> DcpMetadataTable::Files() const {
  std::set<std::string> files;
  for (const auto& s : md_.storage) files.insert(s.relative_path);
  return {files.begin(), files.end()};
}

void DcpMetadataTable::Check(const std::string& dir, const std::string& what) const {
  for (const auto& e : md_.entries) {
    if (e.bytes || StoredWhole(e)) continue;  // one chunk of all of it covers it
    std::vector<std::vector<int64_t>> offsets;
    std::vector<std::vector<int64_t>> sizes;
    for (const auto& [o, s] : e.chunks) {
      offsets.push_back(o);
      sizes.push_back(s);
    }
    CheckDcpChunksCover(e.fqn, e.size, offsets, sizes, what);
  }
  CheckDcpDataFilesPresent(dir, Files());
}

}  // namespace tensortier
