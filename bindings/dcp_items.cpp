// tensortier._core DCP item bookkeeping: the plain data tensortier.dcp takes from torch's DCP
// objects (MetadataIndex, _StorageInfo, ReadItem, WriteResult) and gives back to them, and the
// walk of a state dict that DCP staging copies, so the Python layer handles only tensors. Runs
// with the GIL held: every value is a Python object.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "dcp_items.hpp"
#include "gil.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

using Dims = std::vector<int64_t>;

std::string DcpItemName(const py::handle& index) {
  std::string name = py::str(index.attr("fqn"));
  const py::object offset = index.attr("offset");
  if (offset.is_none()) return name;
  const auto at = offset.cast<Dims>();
  if (std::all_of(at.begin(), at.end(), [](int64_t v) { return v == 0; })) return name;
  name += " at [";
  for (size_t i = 0; i < at.size(); ++i) name += StrCat(i ? ", " : "", at[i]);
  return name + "]";
}

bool PyEqual(const py::handle& a, const py::handle& b) {
  const int eq = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
  if (eq < 0) throw py::error_already_set();
  return eq == 1;
}

py::tuple DcpChunkKey(const py::handle& fqn, const py::handle& offsets) {
  if (offsets.is_none()) return py::make_tuple(fqn, py::tuple());
  return py::make_tuple(fqn, py::tuple(py::reinterpret_borrow<py::object>(offsets)));
}

namespace {

py::dict ChunkSizes(const py::dict& state_dict_metadata, const py::handle& tensor_type,
                    const FsPath& metadata_path) {
  const std::string& what = metadata_path;  // bytes: a directory name need not be UTF-8
  py::dict out;
  for (const auto& [fqn, md] : state_dict_metadata) {
    if (!py::isinstance(md, tensor_type)) continue;
    std::vector<Dims> offsets;
    std::vector<Dims> sizes;
    for (const py::handle& chunk : md.attr("chunks")) {
      offsets.push_back(chunk.attr("offsets").cast<Dims>());
      sizes.push_back(chunk.attr("sizes").cast<Dims>());
    }
    CheckDcpChunksCover(fqn.cast<std::string>(), md.attr("size").cast<Dims>(), offsets, sizes,
                        what);
    for (size_t i = 0; i < offsets.size(); ++i) {
      out[DcpChunkKey(fqn, py::cast(offsets[i]))] = py::cast(sizes[i]);
    }
  }
  return out;
}

py::list RequestsByFile(const py::iterable& items, const py::object& storage_data) {
  py::dict entry_of;  // relative_path -> its entry of out
  py::list out;
  const DcpMetadataTable* table = py::isinstance<DcpMetadataTable>(storage_data)
                                      ? &storage_data.cast<const DcpMetadataTable&>()
                                      : nullptr;
  for (const py::handle& req : items) {
    py::object path;
    const py::object index = req.attr("storage_index");
    if (table != nullptr) {
      const py::object at = index.attr("offset");
      const DcpStorageEntry* place =
          table->Storage(index.attr("fqn").cast<std::string>(),
                         at.is_none() ? std::nullopt : std::optional<Dims>(at.cast<Dims>()));
      if (place == nullptr) throw py::key_error(DcpItemName(index));
      path = py::str(place->relative_path);
    } else {
      path = storage_data[index].attr("relative_path");
    }
    py::object entry = entry_of.attr("get")(path);
    if (entry.is_none()) {
      entry = py::make_tuple(path, py::list());
      entry_of[path] = entry;
      out.append(entry);
    }
    entry[py::int_(1)].attr("append")(req);
  }
  return out;
}

// What write_dcp_file needs of each write item without torch: a bytes item's pickled bytes, a
// tensor item's value where the default planner's flattened state dict holds it as a plain tensor
// (the planner's own lookup costs a ShardedTensor check per item, most of the Python time of a
// save of many small tensors), else None.
py::list WriteValues(const py::list& items, const py::object& planner,
                     const py::handle& default_planner, const py::handle& byte_io,
                     const py::handle& tensor_type) {
  py::object lookup = py::getattr(planner, "state_dict", py::none());
  for (const char* m : {"resolve_data", "lookup_object", "transform_object"}) {
    if (!py::getattr(py::type::of(planner), m, py::none()).is(default_planner.attr(m))) {
      lookup = py::none();
    }
  }
  if (!PyDict_Check(lookup.ptr())) lookup = py::none();
  const py::object bytes_io = py::module_::import("io").attr("BytesIO");
  py::list out;
  for (const py::handle& item : items) {
    if (!PyEqual(item.attr("type"), byte_io)) {
      const py::object t =
          lookup.is_none() ? py::none() : lookup.attr("get")(item.attr("index").attr("fqn"));
      out.append(
          Py_TYPE(t.ptr()) == reinterpret_cast<PyTypeObject*>(tensor_type.ptr()) ? t : py::none());
      continue;
    }
    py::object data;
    try {
      data = planner.attr("resolve_data")(item);
    } catch (py::error_already_set& e) {  // a lambda, an open file...
      if (!e.matches(PyExc_Exception)) throw;
      const std::string message =
          StrCat(DcpItemName(item.attr("index")), ": cannot be saved: pickling it failed (",
                 py::str(e.type().attr("__name__")).cast<std::string>(), ": ",
                 py::str(e.value()).cast<std::string>(),
                 "); store tensors, numbers, strings, lists or dicts");
      py::raise_from(e, PyExc_TypeError, message.c_str());
      throw py::error_already_set();
    }
    if (py::isinstance(data, bytes_io)) {
      out.append(data.attr("getvalue")());
      continue;
    }
    // bytes(data), as DCP's file writer: any bytes-like object a custom planner returns.
    const py::handle as_bytes(PyObject_Bytes(data.ptr()));
    if (!as_bytes) {
      py::error_already_set e;
      py::raise_from(e, PyExc_TypeError,
                     StrCat(DcpItemName(item.attr("index")), ": resolve_data returned ",
                            py::str(py::type::handle_of(data).attr("__name__")).cast<std::string>(),
                            ", not bytes or io.BytesIO")
                         .c_str());
      throw py::error_already_set();
    }
    out.append(py::reinterpret_steal<py::object>(as_bytes));
  }
  return out;
}

// Calls fn(path, fqn, offset, index, place, blocks) for each item of a rank's WriteResult
// (path, fqns, offsets, indices, places, block sums); place: offset, length and xxh64.
template <typename F>
void ForEachRankItem(const py::tuple& writes, F&& fn) {
  if (writes.size() != 6) throw std::invalid_argument("a rank's write result of 6 values");
  const py::object path = writes[0];
  const py::sequence fqns = writes[1];
  const py::sequence offsets = writes[2];
  const py::sequence indices = writes[3];
  const std::string places = writes[4].cast<std::string>();
  const py::sequence blocks = writes[5];
  const size_t n = fqns.size();
  if (places.size() != 3 * n * sizeof(uint64_t) || offsets.size() != n || indices.size() != n ||
      blocks.size() != n) {
    throw std::invalid_argument("a rank's write result with one place per item");
  }
  for (size_t k = 0; k < n; ++k) {
    uint64_t place[3];
    std::memcpy(place, places.data() + 3 * k * sizeof(uint64_t), sizeof(place));
    fn(path, fqns[k], offsets[k], indices[k], place, blocks[k]);
  }
}

// Expands a rank's WriteResult into MetadataIndex -> _StorageInfo, with each item's xxh64 and its
// tensor data's block sums.
void AddRankItems(py::dict& out, const py::tuple& writes, const py::handle& index_type,
                  const py::handle& info_type) {
  ForEachRankItem(writes,
                  [&](const py::object& path, const py::handle& fqn, const py::handle& offset,
                      const py::handle& index, const uint64_t* place, const py::handle& blocks) {
                    py::object info = info_type(path, place[0], place[1]);
                    info.attr("xxh64") = place[2];  // stock readers ignore it
                    if (PyObject_IsTrue(blocks.ptr()) == 1) info.attr("xxh64_blocks") = blocks;
                    out[index_type(fqn, offset, index)] = info;
                  });
}

py::dict StorageData(const py::iterable& results, const py::str& rank_writes,
                     const py::handle& index_type, const py::handle& info_type) {
  py::dict out;
  for (const py::handle& rank : results) {
    for (const py::handle& r : rank) {
      const py::object index = r.attr("index");
      if (PyEqual(index.attr("fqn"), rank_writes)) {
        AddRankItems(out, r.attr("storage_data"), index_type, info_type);
      } else {
        out[index] = r.attr("storage_data");
      }
    }
  }
  return out;
}

// TensorProperties.memory_format as its _MEM_FORMAT_ENCODING value.
int64_t MemoryFormatEncoding(const py::handle& format) {
  const std::string name = py::str(format);
  if (name == "torch.contiguous_format") return 0;
  if (name == "torch.channels_last") return 1;
  if (name == "torch.preserve_format") return 2;
  throw std::invalid_argument(StrCat("DCP metadata: memory format ", name));
}

std::optional<std::string> OptionalStr(const py::handle& v) {
  if (v.is_none()) return std::nullopt;
  return v.cast<std::string>();
}

// The .metadata of a save (SerializeDcpMetadata) from plain values: `regular` (fqn ->
// TensorStorageMetadata or BytesStorageMetadata), the plain tensors (fqn, torch's dtype name,
// shape, flags: bit 0 requires_grad, bit 1 pinned; one chunk each, at the origin), the planner
// data, the rank writes of `results` and the storage meta. Returns (its bytes, the data files it
// names).
py::tuple MetadataPickle(const py::dict& regular, const py::handle& tensor_type,
                         const std::vector<std::string>& plain_fqns,
                         const std::vector<std::string>& plain_dtypes,
                         const std::vector<Dims>& plain_shapes, const std::string& plain_flags,
                         const py::object& planner_data, const py::iterable& results,
                         const py::str& rank_writes, const py::object& storage_meta,
                         const std::string& version, const std::vector<std::string>& order) {
  const size_t n = plain_fqns.size();
  if (plain_dtypes.size() != n || plain_shapes.size() != n || plain_flags.size() != n) {
    throw std::invalid_argument("dcp_metadata_pickle: one dtype, shape and flag per plain tensor");
  }
  DcpMetadataContents md;
  md.entries.reserve(regular.size() + n);
  for (const auto& [fqn, value] : regular) {
    DcpMetadataEntry& e = md.entries.emplace_back();
    e.fqn = fqn.cast<std::string>();
    if (!py::isinstance(value, tensor_type)) {
      e.bytes = true;
      continue;
    }
    const py::object props = value.attr("properties");
    const std::string dtype = py::str(props.attr("dtype"));
    e.dtype = dtype.starts_with("torch.") ? dtype.substr(6) : dtype;
    e.layout = py::str(props.attr("layout"));
    e.requires_grad = props.attr("requires_grad").cast<bool>();
    e.memory_format = MemoryFormatEncoding(props.attr("memory_format"));
    e.pin_memory = props.attr("pin_memory").cast<bool>();
    e.size = value.attr("size").cast<Dims>();
    for (const py::handle& chunk : value.attr("chunks")) {
      e.chunks.emplace_back(chunk.attr("offsets").cast<Dims>(), chunk.attr("sizes").cast<Dims>());
    }
  }
  for (size_t i = 0; i < n; ++i) {
    DcpMetadataEntry& e = md.entries.emplace_back();
    e.fqn = plain_fqns[i];
    e.dtype = plain_dtypes[i];
    e.requires_grad = (plain_flags[i] & 1) != 0;
    e.pin_memory = (plain_flags[i] & 2) != 0;
    e.size = plain_shapes[i];
    e.chunks.emplace_back(Dims(e.size.size(), 0), e.size);
  }
  if (!order.empty()) {  // the keys in torch's order; any the order lacks after them
    std::unordered_map<std::string_view, size_t> place;
    for (size_t i = 0; i < order.size(); ++i) place.emplace(order[i], i);
    std::stable_sort(md.entries.begin(), md.entries.end(), [&](const auto& a, const auto& b) {
      auto pa = place.find(a.fqn);
      auto pb = place.find(b.fqn);
      return (pa == place.end() ? order.size() : pa->second) <
             (pb == place.end() ? order.size() : pb->second);
    });
  }
  if (!planner_data.is_none()) {
    auto& paths = md.planner_data.emplace();
    paths.reserve(py::len(planner_data));
    for (const auto& [fqn, path] : py::dict(planner_data)) {
      DcpKeyPath parts;
      for (const py::handle& part : path) {
        if (PyLong_Check(part.ptr())) {
          parts.emplace_back(part.cast<int64_t>());
        } else {
          parts.emplace_back(part.cast<std::string>());
        }
      }
      paths.emplace_back(fqn.cast<std::string>(), std::move(parts));
    }
  }
  std::set<std::string> files;
  for (const py::handle& rank : results) {
    for (const py::handle& r : rank) {
      if (!PyEqual(r.attr("index").attr("fqn"), rank_writes)) {
        throw std::invalid_argument("dcp_metadata_pickle: a write result of another writer");
      }
      ForEachRankItem(r.attr("storage_data"), [&](const py::object& path, const py::handle& fqn,
                                                  const py::handle& offset, const py::handle& index,
                                                  const uint64_t* place, const py::handle& blocks) {
        DcpStorageEntry& e = md.storage.emplace_back();
        e.fqn = fqn.cast<std::string>();
        if (!offset.is_none()) e.offset = offset.cast<Dims>();
        if (!index.is_none()) e.index = index.cast<int64_t>();
        e.relative_path = path.cast<std::string>();
        e.offset_in_file = place[0];
        e.length = place[1];
        e.xxh64 = place[2];
        e.block_xxh64 = blocks.cast<std::string>();
        files.insert(e.relative_path);
      });
    }
  }
  // A path: its bytes that are not UTF-8 are lone surrogates, pickled as pickle does them.
  md.checkpoint_id =
      Utf8(py::str(py::module_::import("os").attr("fspath")(storage_meta.attr("checkpoint_id"))));
  md.save_id = OptionalStr(storage_meta.attr("save_id"));
  md.load_id = OptionalStr(storage_meta.attr("load_id"));
  md.modules = storage_meta.attr("modules").cast<std::vector<std::string>>();
  const py::object format = py::getattr(storage_meta, "tensortier_format", py::none());
  if (!format.is_none()) md.format = format.cast<int64_t>();
  md.version = version;
  std::string data;
  {
    GilReleased release;
    data = SerializeDcpMetadata(md);
  }
  return py::make_tuple(py::bytes(data), std::vector<std::string>(files.begin(), files.end()));
}

// Which rank writes each item that several ranks plan (a replicated value), as torch's
// dedup_save_plans chooses: items keyed by their MetadataIndex, in the order keys are first seen
// (rank by rank, each rank's items in its state dict's order), each given to the rank with the
// fewest bytes planned so far among those holding it (the lowest on ties), or to the lowest with
// `to_lowest`; the item counts the bytes of the last rank's (torch keeps that one), at least 1. A
// rank's items are its plain tensors (fqns, shapes, nbytes: one chunk at the origin each) and its
// other write items (their keys, dcp_dedup_key's, and sizes), merged in `order` (i >= 0: plain
// tensor i; i < 0: item ~i). Returns per rank (the plain tensors it keeps, the items it keeps),
// each None where all.
py::list DedupSavePlans(const std::vector<std::vector<std::string>>& plain_fqns,
                        const std::vector<std::vector<std::vector<int64_t>>>& plain_shapes,
                        const std::vector<std::vector<uint64_t>>& plain_nbytes,
                        const std::vector<std::vector<std::string>>& keys,
                        const std::vector<std::vector<uint64_t>>& sizes,
                        const std::vector<std::vector<int64_t>>& order, bool to_lowest) {
  const size_t ranks = plain_fqns.size();
  for (size_t n :
       {plain_shapes.size(), plain_nbytes.size(), keys.size(), sizes.size(), order.size()}) {
    if (n != ranks) throw std::invalid_argument("dcp_dedup_save_plans: one list per rank each");
  }
  struct Held {
    size_t rank;
    int64_t item;  // as in `order`
  };
  std::unordered_map<std::string, std::vector<Held>> holders;
  std::vector<const std::string*> first_seen;
  for (size_t r = 0; r < ranks; ++r) {
    if (plain_shapes[r].size() != plain_fqns[r].size() ||
        plain_nbytes[r].size() != plain_fqns[r].size() || sizes[r].size() != keys[r].size() ||
        order[r].size() != plain_fqns[r].size() + keys[r].size()) {
      throw std::invalid_argument("dcp_dedup_save_plans: one shape, size and place per item");
    }
    for (int64_t i : order[r]) {
      std::string key;
      if (i >= 0) {
        key = plain_fqns[r].at(i);
        key += '\0';
        for (size_t d = 0; d < plain_shapes[r][i].size(); ++d) key += "0,";
      } else {
        key = keys[r].at(~i);
      }
      auto [it, added] = holders.try_emplace(std::move(key));
      if (added) first_seen.push_back(&it->first);
      it->second.push_back({r, i});
    }
  }
  std::vector<uint64_t> planned(ranks, 0);
  std::vector<std::vector<int64_t>> kept(ranks);
  std::vector<bool> all(ranks, true);
  for (const std::string* key : first_seen) {
    const auto& where = holders.at(*key);
    size_t pick = 0;
    for (size_t k = 1; k < where.size() && !to_lowest; ++k) {
      if (planned[where[k].rank] < planned[where[pick].rank]) pick = k;
    }
    const auto [rank, item] = where[pick];
    // torch counts the item of the last rank holding it, whichever rank writes it.
    const auto [last_rank, last_item] = where.back();
    const uint64_t bytes =
        last_item >= 0 ? plain_nbytes[last_rank][last_item] : sizes[last_rank][~last_item];
    planned[rank] += std::max<uint64_t>(bytes, 1);
    for (size_t k = 0; k < where.size(); ++k) {
      if (k != pick) all[where[k].rank] = false;
    }
    kept[rank].push_back(item);
  }
  py::list out;
  for (size_t r = 0; r < ranks; ++r) {
    if (all[r]) {
      out.append(py::make_tuple(py::none(), py::none()));
      continue;
    }
    std::vector<int64_t> plain;
    std::vector<int64_t> items;
    for (int64_t i : kept[r]) (i >= 0 ? plain : items).push_back(i >= 0 ? i : ~i);
    std::sort(plain.begin(), plain.end());
    std::sort(items.begin(), items.end());
    out.append(py::make_tuple(plain, items));
  }
  return out;
}

// The plain tensors the ranks write, in rank order: (fqns, dtypes, shapes, flags) of each rank's
// lists (plains[r]: SavePlanner's fqns, dtypes, shapes, flag bytes, nbytes, order) at the indices
// kept[r][0] (None: all of them); and the keys of the Metadata in the order torch's global plan
// gives them (each rank's kept values in its state dict's order, ranks in order, each key where
// first seen): plain tensors and the other write items (kept[r][1]: those kept, None for all;
// kept[r][2]: the fqn of each of the rank's items).
py::tuple KeptPlain(const py::list& plains, const py::list& kept) {
  if (plains.size() != kept.size()) throw std::invalid_argument("dcp_kept_plain: one per rank");
  py::list fqns;
  py::list dtypes;
  py::list shapes;
  std::string flags;
  py::list key_order;
  std::unordered_set<std::string> seen;
  std::unordered_set<std::string> plain_seen;
  for (size_t r = 0; r < plains.size(); ++r) {
    const py::sequence plain = plains[r];
    const py::list rank_fqns = plain[0];
    const py::list rank_dtypes = plain[1];
    const py::list rank_shapes = plain[2];
    const std::string rank_flags = plain[3].cast<std::string>();
    const auto order = plain[5].cast<std::vector<int64_t>>();
    const py::sequence rank_kept = kept[r];
    const auto item_fqns = rank_kept[2].cast<std::vector<std::string>>();
    const size_t n = rank_fqns.size();
    if (rank_dtypes.size() != n || rank_shapes.size() != n || rank_flags.size() != n) {
      throw std::invalid_argument("dcp_kept_plain: one dtype, shape and flag per tensor");
    }
    auto kept_set = [](const py::handle& indices, size_t count) {
      std::vector<bool> out(count, indices.is_none());
      if (!indices.is_none()) {
        for (const size_t i : indices.cast<std::vector<size_t>>()) {
          if (i >= count) throw std::out_of_range("dcp_kept_plain: an index past the rank's");
          out[i] = true;
        }
      }
      return out;
    };
    const std::vector<bool> plain_kept = kept_set(rank_kept[0], n);
    const std::vector<bool> items_kept = kept_set(rank_kept[1], item_fqns.size());
    for (size_t i = 0; i < n; ++i) {
      if (!plain_kept[i]) continue;
      // Kept on two ranks: their chunks differ (another number of dimensions). torch's global
      // plan refuses one fqn twice, with this AssertionError.
      if (!plain_seen.insert(rank_fqns[i].cast<std::string>()).second) {
        PyErr_SetString(PyExc_AssertionError,
                        StrCat("item.index.fqn not in md: ", rank_fqns[i].cast<std::string>(),
                               " is a tensor of another number of dimensions on another rank")
                            .c_str());
        throw py::error_already_set();
      }
      fqns.append(rank_fqns[i]);
      dtypes.append(rank_dtypes[i]);
      shapes.append(rank_shapes[i]);
      flags += rank_flags[i];
    }
    for (const int64_t i : order) {
      const bool in = i >= 0 ? static_cast<size_t>(i) < n && plain_kept[i]
                             : static_cast<size_t>(~i) < item_fqns.size() && items_kept[~i];
      if (!in) continue;
      std::string fqn = i >= 0 ? rank_fqns[i].cast<std::string>() : item_fqns[~i];
      if (seen.insert(fqn).second) key_order.append(py::str(fqn));
    }
  }
  return py::make_tuple(fqns, dtypes, shapes, py::bytes(flags), key_order);
}

// ValueError naming the first of `keys` (state dict keys) that is not a str of valid UTF-8 (a
// lone surrogate, as os.fsdecode gives for a byte name): the files tensortier writes store keys
// as UTF-8.
void CheckKeys(const py::iterable& keys) {
  for (const py::handle& key : keys) {
    if (PyUnicode_Check(key.ptr()) && PyUnicode_AsUTF8AndSize(key.ptr(), nullptr) != nullptr) {
      continue;
    }
    PyErr_Clear();
    throw py::value_error(StrCat(py::repr(key).cast<std::string>(),
                                 ": a state dict key that is not a str of valid UTF-8, which "
                                 "tensortier.dcp stores keys as; rename it"));
  }
}

// Where a staged tensor goes in a rebuilt state dict (DCP staging).
struct StageSlot {
  size_t index;
  py::object spec;  // a DTensor's spec, None for a plain tensor
};

// Like Python's recursion limit, so that a too deeply nested state dict raises RecursionError.
class RecursionGuard {
 public:
  RecursionGuard() {
    if (Py_EnterRecursiveCall(" while staging a state dict")) throw py::error_already_set();
  }
  ~RecursionGuard() { Py_LeaveRecursiveCall(); }
  RecursionGuard(const RecursionGuard&) = delete;
  RecursionGuard& operator=(const RecursionGuard&) = delete;
};

py::object Collect(const py::handle& obj, py::list& sources, const py::handle& tensor_type,
                   const py::handle& dtensor, const py::handle& deepcopy) {
  const RecursionGuard guard;
  // Exact types first: isinstance on torch.Tensor costs more.
  const bool container =
      PyDict_CheckExact(obj.ptr()) || PyList_CheckExact(obj.ptr()) || PyTuple_CheckExact(obj.ptr());
  if (!container && py::isinstance(obj, tensor_type)) {
    py::object spec = py::none();
    py::object local = py::reinterpret_borrow<py::object>(obj);
    if (py::isinstance(obj, dtensor)) {  // dtensor: () where no DTensor can exist
      spec = obj.attr("_spec");
      local = obj.attr("_local_tensor");
    }
    sources.append(local);
    return py::cast(StageSlot{sources.size() - 1, spec});
  }
  if (PyDict_Check(obj.ptr())) {
    py::dict out;
    for (const auto& [k, v] : py::reinterpret_borrow<py::dict>(obj)) {
      out[k] = Collect(v, sources, tensor_type, dtensor, deepcopy);
    }
    return py::object(std::move(out));
  }
  if (PyList_Check(obj.ptr()) || PyTuple_CheckExact(obj.ptr())) {
    py::list out;
    for (const py::handle& v : obj) out.append(Collect(v, sources, tensor_type, dtensor, deepcopy));
    if (PyList_Check(obj.ptr())) return py::object(std::move(out));
    return py::tuple(out);
  }
  try {
    return deepcopy(obj);
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_Exception)) throw;
    return py::reinterpret_borrow<py::object>(obj);  // an open file, a lock...: the save names it
  }
}

py::object Rebuild(const py::handle& obj, const py::list& staged, const py::handle& dtensor) {
  const RecursionGuard guard;
  if (py::isinstance<StageSlot>(obj)) {
    const auto& slot = obj.cast<const StageSlot&>();
    py::object t = staged[slot.index];
    if (slot.spec.is_none()) return t;
    return dtensor(t, slot.spec, py::arg("requires_grad") = false);
  }
  if (PyDict_Check(obj.ptr())) {
    py::dict out;
    for (const auto& [k, v] : py::reinterpret_borrow<py::dict>(obj)) {
      out[k] = Rebuild(v, staged, dtensor);
    }
    return py::object(std::move(out));
  }
  if (PyList_Check(obj.ptr()) || PyTuple_CheckExact(obj.ptr())) {
    py::list out;
    for (const py::handle& v : obj) out.append(Rebuild(v, staged, dtensor));
    if (PyList_Check(obj.ptr())) return py::object(std::move(out));
    return py::tuple(out);
  }
  return py::reinterpret_borrow<py::object>(obj);
}

}  // namespace

void RegisterDcpItems(py::module_& m) {
  m.def("dcp_item_name", &DcpItemName, py::arg("index"),
        "A MetadataIndex's item name: its fqn, with its offsets where they are not all 0 "
        "('w at [8, 0]').");
  m.def("dcp_chunk_sizes", &ChunkSizes, py::arg("state_dict_metadata"), py::arg("tensor_type"),
        py::arg("what"),
        "(fqn, chunk offsets) -> chunk sizes of each tensor (values of tensor_type) of a DCP "
        "Metadata's state_dict_metadata. ValueError naming `what` and the tensor for chunks "
        "that lie outside the tensor's size or do not hold all of its elements (data no file "
        "has).");
  m.def("dcp_requests_by_file", &RequestsByFile, py::arg("items"), py::arg("storage_data"),
        "The ReadItems of a load grouped by the data file that holds them (storage_data: "
        "MetadataIndex -> _StorageInfo, or a DcpMetadataTable): [(relative_path, its items in "
        "order)], files in the "
        "order they are first asked for.");
  m.def("dcp_write_values", &WriteValues, py::arg("items"), py::arg("planner"),
        py::arg("default_planner"), py::arg("byte_io"), py::arg("tensor_type"),
        "Per WriteItem of `items`: the bytes of a bytes item (type byte_io: the planner's "
        "resolve_data, TypeError naming the item where pickling fails); for a tensor item, the "
        "plain tensor (of exactly tensor_type) the planner's state dict holds under its fqn "
        "where the planner resolves as default_planner does, else None.");
  m.def("dcp_storage_data", &StorageData, py::arg("results"), py::arg("rank_writes"),
        py::arg("index_type"), py::arg("info_type"),
        "MetadataIndex -> _StorageInfo of a save's WriteResults (a list per rank): a result "
        "whose index is named rank_writes is a rank's items (write_dcp_file's file name, fqns, "
        "offsets, indices, places and block sums), made into index_type and info_type objects "
        "with their xxh64 and block sums; others are kept as they are.");
  m.def("dcp_dedup_save_plans", &DedupSavePlans, py::arg("plain_fqns"), py::arg("plain_shapes"),
        py::arg("plain_nbytes"), py::arg("keys"), py::arg("sizes"), py::arg("order"),
        py::arg("to_lowest"),
        "Per rank, (the indices of the plain tensors it writes, of the other write items it "
        "writes), each None for all of its own, where several ranks plan one item: chosen as "
        "torch's dedup_save_plans does, over each rank's plain tensors (fqns, shapes, nbytes) "
        "and other items (keys from dcp_dedup_key, sizes) merged in `order` (i >= 0: plain "
        "tensor i; i < 0: item ~i).");
  m.def("dcp_kept_plain", &KeptPlain, py::arg("plains"), py::arg("kept"),
        "(fqns, torch dtype names, shapes, flag bytes) of the plain tensors the ranks write: "
        "each rank's SavePlanner lists (plains[r]) at the indices kept[r][0] (None: all), in "
        "rank order; and the Metadata's keys in the order torch's global plan gives them (the "
        "ranks' kept plain tensors and items, kept[r][1], of fqns kept[r][2], in each rank's "
        "state dict order).");
  m.def(
      "dcp_dedup_key",
      [](const py::handle& index) {
        std::string key = py::str(index.attr("fqn"));
        key += '\0';
        const py::object offset = index.attr("offset");
        if (offset.is_none()) return py::bytes(key + "N");
        for (int64_t v : offset.cast<std::vector<int64_t>>()) key += StrCat(v, ",");
        return py::bytes(key);
      },
      py::arg("index"),
      "A MetadataIndex's key in dcp_dedup_save_plans (its fqn and offsets, as it compares).");
  m.def("check_dcp_keys", &CheckKeys, py::arg("keys"),
        "ValueError naming the first of `keys` that is not a str of valid UTF-8.");
  m.def("dcp_metadata_pickle", &MetadataPickle, py::arg("regular"), py::arg("tensor_type"),
        py::arg("plain_fqns"), py::arg("plain_dtypes"), py::arg("plain_shapes"),
        py::arg("plain_flags"), py::arg("planner_data"), py::arg("results"), py::arg("rank_writes"),
        py::arg("storage_meta"), py::arg("version"), py::arg("order") = std::vector<std::string>(),
        "(the bytes of a save's .metadata, the data files it names), made without Python "
        "objects per item: `regular` (fqn -> tensor_type or BytesStorageMetadata) and the plain "
        "tensors (fqns, torch's dtype names, shapes, a flag byte each: 1 requires_grad, 2 "
        "pinned; one chunk at the origin) as state_dict_metadata, planner_data as it is, the "
        "rank writes of `results` (write_dcp_file's, index named rank_writes) as storage_data, "
        "storage_meta's fields, the entries in `order` (their keys; as they come where empty). "
        "pickle.load reads it as the Metadata these describe.");
  py::class_<StageSlot>(m, "DcpStageSlot",
                        "Where a staged tensor goes in a state dict dcp_stage_collect shaped.")
      .def_readonly("index", &StageSlot::index)
      .def_readonly("spec", &StageSlot::spec);
  m.def(
      "dcp_stage_collect",
      [](const py::object& obj, py::list& sources, const py::object& tensor_type,
         const py::object& dtensor) {
        const py::object deepcopy = py::module_::import("copy").attr("deepcopy");
        return Collect(obj, sources, tensor_type, dtensor, deepcopy);
      },
      py::arg("obj"), py::arg("sources"), py::arg("tensor_type"), py::arg("dtensor"),
      "`obj` (nested dicts, lists and tuples) with each tensor (instance of tensor_type) appended "
      "to `sources` (a DTensor's local tensor; dtensor: the DTensor class, or ()) and replaced by "
      "its DcpStageSlot; other values deep-copied (kept as they are when they cannot be). Dicts "
      "and lists come back as plain ones.");
  m.def("dcp_stage_rebuild", &Rebuild, py::arg("obj"), py::arg("staged"), py::arg("dtensor"),
        "`obj` (from dcp_stage_collect) with each DcpStageSlot replaced by staged[index] (a "
        "DTensor around it, made by dtensor, where the original was one).");
}
