#include "tensortier/checkpoint/dcp_metadata.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <tuple>

#include "tensortier/checkpoint/pickle_machine.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr uint64_t kMaxMetadataBytes = 1ull << 30;
constexpr const char* kFilesystemModule = "torch.distributed.checkpoint.filesystem";

using Kind = PickleKind;
using Node = PickleValue;

// The restricted pickle machine of the metadata (pickle_machine.hpp): it builds an object for
// each call of an allowed class and keeps what BUILD gives it as its state.
class Machine : public PickleMachine {
 public:
  // Every value costs at least one byte of input: their count is bounded by the input's size.
  Machine(std::string_view data, const std::string& what)
      : PickleMachine(data, data.size() + 16, data.size() + 16, /*extended=*/true), what_(what) {}

  uint32_t Run() { return Execute(); }

 private:
  std::string Describe(std::string_view why) const override {
    return StrCat(what_, ": not DCP metadata this reader accepts (", why, " at byte ", op_pos_,
                  ")");
  }
  void CheckGlobal(const std::string& module, const std::string& name) override {
    if (!IsDcpMetadataGlobal(module, name)) {
      Fail(StrCat("global ", module, ".", name, " is not allowed"));
    }
  }
  uint32_t Call(uint32_t cls, uint32_t args, bool) override {
    if (values_[cls].kind != Kind::kGlobal || values_[args].kind != Kind::kTuple) {
      Fail("a call of something not a class");
    }
    Node n;
    n.kind = Kind::kObject;
    n.s = values_[cls].s;
    n.items = values_[args].items;
    return New(std::move(n));
  }
  void Build(uint32_t target, uint32_t state) override {
    if (values_[target].kind != Kind::kObject) Fail("BUILD of something not an object");
    values_[target].state = state;
  }
  // 9 bytes: an unsigned 64-bit value (an xxh64) and its sign byte, kept as its bits.
  uint32_t WideInt(std::string_view b) override {
    if (b.size() != 9 || b[8] != 0) Fail("an integer wider than 64 bits");
    uint64_t v = 0;
    for (size_t k = 0; k < 8; ++k) v |= uint64_t{static_cast<unsigned char>(b[k])} << (8 * k);
    return Scalar(Kind::kInt, static_cast<int64_t>(v));
  }

  const std::string& what_;
};

// Reads the values the metadata's objects hold.
class Walker {
 public:
  explicit Walker(const Machine& m) : m_(m) {}

  // The value of attribute `key` of object `obj` of class `cls` (its BUILD state, a dict), or
  // nullopt where it has none.
  std::optional<uint32_t> Attr(uint32_t obj, const std::string& cls, const std::string& key) {
    const Node& o = m_.at(obj);
    if (o.kind != Kind::kObject || o.s != cls) m_.Fail(StrCat("expected a ", cls));
    if (o.state == UINT32_MAX) return std::nullopt;
    const Node& state = m_.at(o.state);
    if (state.kind != Kind::kDict) m_.Fail(StrCat("a ", cls, " without a dict of attributes"));
    for (size_t k = 0; k + 1 < state.items.size(); k += 2) {
      const Node& name = m_.at(state.items[k]);
      if (name.kind == Kind::kStr && name.s == key) return state.items[k + 1];
    }
    return std::nullopt;
  }
  const Node& Need(std::optional<uint32_t> v, Kind kind, const std::string& what) {
    if (!v || m_.at(*v).kind != kind) m_.Fail(StrCat(what, " missing or of the wrong type"));
    return m_.at(*v);
  }
  uint64_t Unsigned(std::optional<uint32_t> v, const std::string& what) {
    const Node& n = Need(v, Kind::kInt, what);
    if (n.i < 0) m_.Fail(StrCat(what, " is negative"));
    return static_cast<uint64_t>(n.i);
  }
  // A torch.Size's values.
  std::vector<int64_t> SizeValues(uint32_t v) {
    const Node& size = m_.at(v);
    if (size.kind != Kind::kObject || size.s != "torch.Size" || size.items.size() != 1) {
      m_.Fail("a chunk size that is not a torch.Size");
    }
    std::vector<int64_t> out;
    for (uint32_t e : m_.at(size.items[0]).items) out.push_back(m_.at(e).i);
    return out;
  }
  // A torch.Size's values ("[0, 8]"); empty when all are 0.
  std::string SizeText(uint32_t v) {
    const Node& size = m_.at(v);
    if (size.kind != Kind::kObject || size.s != "torch.Size" || size.items.size() != 1) {
      m_.Fail("a chunk offset that is not a torch.Size");
    }
    std::string out = "[";
    bool zeros = true;
    for (uint32_t e : m_.at(size.items[0]).items) {
      out += StrCat(out.size() > 1 ? ", " : "", m_.at(e).i);
      zeros = zeros && m_.at(e).i == 0;
    }
    return zeros ? "" : out + "]";
  }

 private:
  const Machine& m_;
};

}  // namespace

bool IsDcpMetadataGlobal(std::string_view module, std::string_view name) {
  static const std::set<std::string_view> kClasses = {
      "Metadata",         "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
      "TensorProperties", "_MEM_FORMAT_ENCODING",  "MetadataIndex",        "StorageMeta"};
  return (module == kDcpMetadataModule && kClasses.contains(name)) ||
         (module == kFilesystemModule && name == "_StorageInfo") ||
         // Where torch 2.0 to 2.2 pickled a tensor's properties from (torch keeps them there).
         (module == "torch.distributed._shard.sharded_tensor.metadata" &&
          (name == "TensorProperties" || name == "MEM_FORMAT_ENCODING")) ||
         (module == "collections" && name == "OrderedDict") ||
         (module == "torch" &&
          name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") == std::string::npos) ||
         (module == "torch" && name == "Size") ||
         (module == "torch.serialization" && name == "_get_layout") ||
         // FileSystemWriter's checkpoint id; Python 3.13 and later pickle it from pathlib._local.
         ((module == "pathlib" || module == "pathlib._local") &&
          (name == "PosixPath" || name == "PurePosixPath"));
}

bool IsDcpDataFileName(std::string_view relative_path) {
  return !relative_path.empty() && relative_path.find('/') == std::string_view::npos &&
         relative_path.find('\0') == std::string_view::npos && !relative_path.starts_with(".");
}

void CheckDcpDataFileName(std::string_view relative_path, const std::string& what) {
  if (!IsDcpDataFileName(relative_path)) {
    throw FormatError(StrCat(what, ": names the data file '", relative_path,
                             "', outside the checkpoint directory (a data file is named by a plain "
                             "file name in the directory, as DCP's writers store it)"));
  }
}

void CheckDcpFormat(std::optional<int64_t> format, const std::string& what) {
  if (!format) return;
  if (*format < 1) {
    throw FormatError(StrCat(what, ": tensortier_format ", *format, " is not a format version"));
  }
  if (*format > kDcpFormat) {
    throw FormatError(StrCat(what, ": written in tensortier's DCP format ", *format,
                             "; this tensortier reads format ", kDcpFormat,
                             " and torch's files: load it with a newer tensortier"));
  }
}

DcpMetadata ParseDcpMetadata(std::string_view data, const std::string& what) {
  // tensortier's index, where the file has one: its sums say first whether either half is
  // damaged, and it must describe the pickle (checked below).
  const auto index = ReadDcpMetadataIndex(data, what);
  Machine m(data, what);
  const uint32_t root = m.Run();
  Walker w(m);
  const std::string md = StrCat(kDcpMetadataModule, ".Metadata");
  DcpMetadata out;
  if (auto v = w.Attr(root, md, "version"); v && m.at(*v).kind == Kind::kStr) {
    out.version = m.at(*v).s;
  }
  if (auto sm = w.Attr(root, md, "storage_meta"); sm && m.at(*sm).kind == Kind::kObject) {
    if (auto f = w.Attr(*sm, StrCat(kDcpMetadataModule, ".StorageMeta"), "tensortier_format"); f) {
      if (m.at(*f).kind != Kind::kInt) m.Fail("a tensortier_format that is not an integer");
      out.format = m.at(*f).i;
    }
  }
  CheckDcpFormat(out.format, what);
  std::set<std::string> bytes_items;
  std::map<std::string, std::vector<int64_t>> chunk_sizes;  // "fqn at [offsets]" -> sizes
  const std::string tensor_cls = StrCat(kDcpMetadataModule, ".TensorStorageMetadata");
  const std::string chunk_cls = StrCat(kDcpMetadataModule, ".ChunkStorageMetadata");
  const Node& sdm =
      w.Need(w.Attr(root, md, "state_dict_metadata"), Kind::kDict, "state_dict_metadata");
  for (size_t k = 0; k + 1 < sdm.items.size(); k += 2) {
    const Node& fqn = m.at(sdm.items[k]);
    const Node& value = m.at(sdm.items[k + 1]);
    if (fqn.kind != Kind::kStr || value.kind != Kind::kObject) continue;
    if (value.s == StrCat(kDcpMetadataModule, ".BytesStorageMetadata")) bytes_items.insert(fqn.s);
    if (value.s != tensor_cls) continue;
    const auto chunks = w.Attr(sdm.items[k + 1], tensor_cls, "chunks");
    if (!chunks || m.at(*chunks).kind != Kind::kList) continue;
    for (uint32_t c : m.at(*chunks).items) {
      const auto offsets = w.Attr(c, chunk_cls, "offsets");
      const auto sizes = w.Attr(c, chunk_cls, "sizes");
      if (!offsets || !sizes) m.Fail("a chunk without offsets or sizes");
      const std::string at = w.SizeText(*offsets);
      chunk_sizes[at.empty() ? fqn.s : StrCat(fqn.s, " at ", at)] = w.SizeValues(*sizes);
    }
  }
  const Node& storage = w.Need(w.Attr(root, md, "storage_data"), Kind::kDict, "storage_data");
  const std::string index_cls = StrCat(kDcpMetadataModule, ".MetadataIndex");
  const std::string info_cls = StrCat(kFilesystemModule, "._StorageInfo");
  for (size_t k = 0; k + 1 < storage.items.size(); k += 2) {
    const uint32_t index = storage.items[k];
    const uint32_t info = storage.items[k + 1];
    DcpStoredItem item;
    const std::string fqn = w.Need(w.Attr(index, index_cls, "fqn"), Kind::kStr, "fqn").s;
    item.name = fqn;
    item.fqn = fqn;
    if (auto offset = w.Attr(index, index_cls, "offset");
        offset && m.at(*offset).kind != Kind::kNone) {
      if (std::string at = w.SizeText(*offset); !at.empty()) item.name += " at " + at;
    }
    item.bytes = bytes_items.contains(fqn);
    if (auto c = chunk_sizes.find(item.name); !item.bytes && c != chunk_sizes.end()) {
      item.chunk_sizes = c->second;
    }
    item.relative_path =
        w.Need(w.Attr(info, info_cls, "relative_path"), Kind::kStr, "relative_path").s;
    if (!IsDcpDataFileName(item.relative_path)) {
      m.Fail(StrCat("a data file name '", item.relative_path, "' outside the directory"));
    }
    item.offset = w.Unsigned(w.Attr(info, info_cls, "offset"), "offset");
    item.length = w.Unsigned(w.Attr(info, info_cls, "length"), "length");
    if (auto x = w.Attr(info, info_cls, "xxh64"); x) {
      const Node& n = m.at(*x);
      if (n.kind != Kind::kInt) m.Fail("an xxh64 that is not an integer");
      item.xxh64 = static_cast<uint64_t>(n.i);
    }
    if (auto b = w.Attr(info, info_cls, "xxh64_blocks"); b) {
      const Node& n = m.at(*b);
      if (n.kind != Kind::kBytes) m.Fail("block sums (xxh64_blocks) that are not bytes");
      item.block_xxh64 = n.s;
    }
    if (auto t = w.Attr(info, info_cls, "transform_descriptors"); t) {
      const Node& n = m.at(*t);
      item.transformed = n.kind != Kind::kNone && !n.items.empty();
    }
    out.items.push_back(std::move(item));
  }
  // The index must describe this pickle: its readers (tensortier.dcp.Reader) would read other
  // items than the pickle's readers otherwise.
  if (index) {
    using Place = std::tuple<std::string, uint64_t, uint64_t, std::optional<uint64_t>>;
    std::vector<Place> indexed;
    std::vector<Place> pickled;
    for (const auto& s : index->storage) {
      indexed.emplace_back(s.relative_path, s.offset_in_file, s.length, s.xxh64);
    }
    for (const auto& item : out.items) {
      pickled.emplace_back(item.relative_path, item.offset, item.length, item.xxh64);
    }
    std::sort(indexed.begin(), indexed.end());
    std::sort(pickled.begin(), pickled.end());
    if (indexed != pickled || index->entries.size() != sdm.items.size() / 2) {
      throw FormatError(StrCat(what,
                               ": tensortier's index does not describe the pickle after "
                               "it (other items or places): the file is damaged"));
    }
  }
  return out;
}

bool IsDcpDataFile(std::string_view name) {
  return name.starts_with("__") && name.ends_with(".distcp");
}

bool IsRankLocalDcpMetadata(std::string_view name) {
  if (!name.starts_with("__") || !name.ends_with(kDcpMetadataName) ||
      name.size() <= 2 + kDcpMetadataName.size()) {
    return false;
  }
  const std::string_view rank = name.substr(2, name.size() - 2 - kDcpMetadataName.size());
  return std::all_of(rank.begin(), rank.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string DcpMetadataPath(const std::string& dir, std::optional<int64_t> rank) {
  return rank ? StrCat(dir, "/__", *rank, kDcpMetadataName) : StrCat(dir, "/", kDcpMetadataName);
}

std::vector<std::string> UnnamedDcpDataFiles(const std::string& dir,
                                             const std::set<std::string>& named) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (IsDcpDataFile(name) && !named.contains(name)) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// Whether `name` is a DCP data file or the temporary file of a save (".__*").
bool IsDcpSaveFile(const std::string& name) {
  return IsDcpDataFile(name) || name.starts_with(".__");
}

}  // namespace

bool IsDcpDirectory(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return false;
  if (lstat(DcpMetadataPath(dir).c_str(), &st) == 0) return true;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (IsDcpSaveFile(e.path().filename().string())) return true;
  }
  return false;
}

std::string ReadDcpMetadataBytes(const std::string& dir, std::optional<int64_t> rank) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    throw IoError(errno, "load DCP checkpoint (the directory cannot be reached)", dir, 0, 0);
  }
  if (!S_ISDIR(st.st_mode)) {
    throw IoError(ENOTDIR, "load DCP checkpoint (a DCP checkpoint is a directory)", dir, 0, 0);
  }
  const std::string path = DcpMetadataPath(dir, rank);
  const std::string name = std::filesystem::path(path).filename();
  if (stat(path.c_str(), &st) != 0 && errno == ENOENT) {
    bool unfinished = false;  // data files, or temporary files of a save
    bool rank_local = false;  // __N.metadata: a save with use_collectives=False
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      const std::string file = e.path().filename().string();
      unfinished = unfinished || IsDcpSaveFile(file);
      rank_local = rank_local || IsRankLocalDcpMetadata(file);
    }
    if (rank) {
      throw IoError(ENOENT,
                    StrCat("load DCP checkpoint (no rank-local metadata ", name, " for rank ",
                           *rank, " and no .metadata)"),
                    path, 0, 0);
    }
    throw IoError(ENOENT,
                  rank_local   ? "load DCP checkpoint (no .metadata, but the rank-local metadata "
                                 "files (__N.metadata) of a save with use_collectives=False, which "
                                 "dcp.load reads rank by rank)"
                  : unfinished ? "load DCP checkpoint (a DCP checkpoint directory whose .metadata "
                                 "is missing: no .metadata, only the data files of a save that "
                                 "did not finish, so no checkpoint was committed here)"
                               : "load DCP checkpoint (no .metadata: not a DCP checkpoint "
                                 "directory)",
                  path, 0, 0);
  }
  if (stat(path.c_str(), &st) != 0) throw IoError(errno, "load DCP checkpoint (stat)", path, 0, 0);
  if (S_ISDIR(st.st_mode)) {
    throw IoError(EISDIR,
                  "load DCP checkpoint (its .metadata is a directory, not the checkpoint's "
                  "metadata file)",
                  path, 0, 0);
  }
  if (!S_ISREG(st.st_mode)) {
    throw FormatError(StrCat(path, ": not a regular file (a DCP checkpoint's .metadata is one)"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(errno, "open", path, 0, 0);
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  if (size > kMaxMetadataBytes) throw FormatError(StrCat(path, ": larger than 1 GiB"));
  in.seekg(0);
  std::string data(size, '\0');
  if (!in.read(data.data(), static_cast<std::streamsize>(size))) {
    throw IoError(errno ? errno : EIO, "read", path, 0, size);
  }
  return data;
}

DcpMetadata ReadDcpMetadata(const std::string& dir) {
  return ParseDcpMetadata(ReadDcpMetadataBytes(dir), DcpMetadataPath(dir));
}

DcpMetadata ReadDcpMetadataOfSave(const std::string& dir, size_t* rank_local) {
  if (rank_local != nullptr) *rank_local = 0;
  struct stat st;
  if (lstat(DcpMetadataPath(dir).c_str(), &st) == 0 || errno != ENOENT) {
    return ReadDcpMetadata(dir);
  }
  std::vector<int64_t> ranks;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!IsRankLocalDcpMetadata(name)) continue;
    int64_t rank = 0;
    const auto [end, parse] = std::from_chars(name.data() + 2, name.data() + name.size(), rank);
    if (parse == std::errc()) ranks.push_back(rank);
  }
  if (ranks.empty()) return ReadDcpMetadata(dir);  // its error: no metadata at all
  std::sort(ranks.begin(), ranks.end());
  DcpMetadata all;
  for (int64_t rank : ranks) {
    DcpMetadata md = ParseDcpMetadata(ReadDcpMetadataBytes(dir, rank), DcpMetadataPath(dir, rank));
    if (all.version.empty()) all.version = md.version;
    if (!all.format) all.format = md.format;
    for (DcpStoredItem& item : md.items) all.items.push_back(std::move(item));
  }
  if (rank_local != nullptr) *rank_local = ranks.size();
  return all;
}

void CheckDcpDataFilesPresent(const std::string& dir,
                              const std::vector<std::string>& relative_paths) {
  const std::set<std::string> named(relative_paths.begin(), relative_paths.end());
  std::vector<std::string> missing;
  for (const auto& name : named) {
    struct stat st;
    if (stat(StrCat(dir, "/", name).c_str(), &st) != 0 && errno == ENOENT) missing.push_back(name);
  }
  if (missing.empty()) return;
  // Data files of the directory the metadata does not name.
  const std::vector<std::string> others = UnnamedDcpDataFiles(dir, named);
  auto list = [](const std::vector<std::string>& names) {
    std::string out;
    for (size_t i = 0; i < names.size() && i < 3; ++i) out += StrCat(i ? ", " : "", names[i]);
    return names.size() > 3 ? StrCat(out, " and ", names.size() - 3, " more") : out;
  };
  const std::string metadata = DcpMetadataPath(dir);
  std::string what = StrCat("load DCP checkpoint (", metadata,
                            " names data files that are missing: ", list(missing), ")");
  if (!others.empty()) {
    what = StrCat("load DCP checkpoint (", metadata,
                  " is stale: it names data files of another save, missing here (", list(missing),
                  "), and not the directory's own (", list(others), "))");
  }
  throw IoError(ENOENT, what, StrCat(dir, "/", missing[0]), 0, 0);
}

void CheckDcpChunksCover(const std::string& name, const std::vector<int64_t>& size,
                         const std::vector<std::vector<int64_t>>& offsets,
                         const std::vector<std::vector<int64_t>>& sizes, const std::string& what) {
  __extension__ typedef unsigned __int128 Wide;  // volumes of up to 64 dims of int64
  auto volume = [](const std::vector<int64_t>& dims) {
    Wide v = 1;
    for (int64_t d : dims) v *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
    return v;
  };
  Wide covered = 0;
  for (size_t c = 0; c < offsets.size() && c < sizes.size(); ++c) {
    bool inside = offsets[c].size() == size.size() && sizes[c].size() == size.size();
    for (size_t d = 0; inside && d < size.size(); ++d) {
      inside = offsets[c][d] >= 0 && sizes[c][d] >= 0 && offsets[c][d] <= size[d] - sizes[c][d];
    }
    if (!inside) {
      throw FormatError(StrCat(what, ": a chunk of '", name, "' lies outside its size"));
    }
    covered += volume(sizes[c]);
  }
  const Wide all = volume(size);
  if (covered < all) {
    throw FormatError(StrCat(what, ": the chunks of '", name, "' hold ",
                             static_cast<uint64_t>(covered), " of its ", static_cast<uint64_t>(all),
                             " elements: the data of the others is in no file (a rank's chunks "
                             "are missing from the metadata)"));
  }
}

}  // namespace tensortier
