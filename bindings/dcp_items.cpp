// tensortier._core DCP item bookkeeping: the plain data tensortier.dcp takes from torch's DCP
// objects (MetadataIndex, _StorageInfo, ReadItem, WriteResult) and gives back to them, and the
// walk of a state dict that DCP staging copies, so the Python layer handles only tensors. Runs
// with the GIL held: every value is a Python object.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dcp_items.hpp"
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
  for (const py::handle& req : items) {
    const py::object path = storage_data[req.attr("storage_index")].attr("relative_path");
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

// Expands a rank's WriteResult (path, fqns, offsets, indices, places, block sums) into
// MetadataIndex -> _StorageInfo, with each item's xxh64 and its tensor data's block sums.
void AddRankItems(py::dict& out, const py::tuple& writes, const py::handle& index_type,
                  const py::handle& info_type) {
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
    py::object info = info_type(path, place[0], place[1]);
    info.attr("xxh64") = place[2];  // stock readers ignore it
    if (py::bool_(blocks[k])) info.attr("xxh64_blocks") = blocks[k];
    out[index_type(fqns[k], offsets[k], indices[k])] = info;
  }
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
        "MetadataIndex -> _StorageInfo): [(relative_path, its items in order)], files in the "
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
