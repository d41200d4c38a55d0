// tensortier._core.DcpFileLoad: what a DCP load does with one rank file, from the ReadItems that
// ask for its items to the commit of each: the memory each read goes to, the read itself (GIL
// released), then the view of the read bytes each ReadItem takes. tensortier.dcp makes and copies
// the tensors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dcp_items.hpp"
#include "gil.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/checkpoint/dcp_reads.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/checkpoint/state_dict_checks.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

using Dims = std::vector<int64_t>;

DcpVerify DcpVerifyOf(const py::handle& verify) {
  if (py::isinstance<py::str>(verify) && verify.cast<std::string>() == "full") {
    return DcpVerify::kFull;
  }
  if (PyBool_Check(verify.ptr())) {
    return verify.ptr() == Py_True ? DcpVerify::kRead : DcpVerify::kNone;
  }
  // Not any truthy value: verify="fast" or "off" is a mistake, not True.
  throw py::value_error(
      StrCat("verify must be True, False or 'full', not ", py::repr(verify).cast<std::string>()));
}

namespace {

std::string Tuple(const Dims& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += StrCat(i ? ", " : "", v[i]);
  return s + (v.size() == 1 ? ",)" : ")");
}

Dims ContiguousStrides(const Dims& shape) {
  Dims out(shape.size());
  int64_t step = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    out[d] = step;
    step *= std::max<int64_t>(shape[d], 1);
  }
  return out;
}

class FileLoad {
 public:
  FileLoad(Engine& engine, const FsPath& path, const py::list& reqs, const py::object& storage_data,
           const py::dict& chunk_sizes, const py::handle& bytes_type, const py::handle& verify,
           const py::dict& torch_dtypes) {
    std::vector<std::vector<py::object>> groups;  // each stored item's ReadItems
    std::vector<size_t> group_of_req;
    std::vector<DcpFileReads::Item> items;
    py::dict group_of;  // storage_index -> its group
    const DcpMetadataTable* table = py::isinstance<DcpMetadataTable>(storage_data)
                                        ? &storage_data.cast<const DcpMetadataTable&>()
                                        : nullptr;
    for (const py::handle& req : reqs) {
      const py::object index = req.attr("storage_index");
      const py::object known = group_of.attr("get")(index);
      const size_t k = known.is_none() ? groups.size() : known.cast<size_t>();
      if (known.is_none()) {
        group_of[index] = k;
        groups.emplace_back();
        DcpFileReads::Item& it = items.emplace_back();
        it.name = DcpItemName(index);
        it.tensor = !PyEqual(req.attr("type"), bytes_type);
        const py::object fqn = index.attr("fqn");
        it.fqn = fqn.cast<std::string>();
        if (table != nullptr) {  // the metadata's index: no Python objects per item
          const py::object at = index.attr("offset");
          const auto offset = at.is_none() ? std::nullopt : std::optional<Dims>(at.cast<Dims>());
          const DcpStorageEntry* place = table->Storage(it.fqn, offset);
          if (place == nullptr) throw py::key_error(it.name);
          it.offset = place->offset_in_file;
          it.length = place->length;
          it.xxh64 = place->xxh64;
          it.blocks = place->block_xxh64;
          const Dims* shape =
              it.tensor ? table->ChunkSizes(it.fqn, offset.value_or(Dims{})) : nullptr;
          if (shape != nullptr) it.expected_shape = *shape;
        } else {
          const py::object info = storage_data[index];
          it.offset = info.attr("offset").cast<uint64_t>();
          it.length = info.attr("length").cast<uint64_t>();
          if (it.tensor) {
            const py::object shape =
                chunk_sizes.attr("get")(DcpChunkKey(fqn, index.attr("offset")));
            if (!shape.is_none()) it.expected_shape = shape.cast<Dims>();
          }
          it.xxh64 = py::getattr(info, "xxh64", py::none()).cast<std::optional<uint64_t>>();
          it.blocks = py::getattr(info, "xxh64_blocks", py::none())
                          .cast<std::optional<std::string>>()
                          .value_or("");
        }
      }
      groups[k].push_back(py::reinterpret_borrow<py::object>(req));
      group_of_req.push_back(k);
      if (items[k].tensor) {
        items[k].requests.push_back(
            {req.attr("storage_offsets").cast<Dims>(), req.attr("lengths").cast<Dims>()});
      }
    }
    const DcpVerify how = DcpVerifyOf(verify);
    {
      GilReleased release;
      reads_ = std::make_unique<DcpFileReads>(engine, path, items, how);
    }
    auto torch_dtype = [&](const std::string& dtype, const std::string& name) {
      py::object out = torch_dtypes.attr("get")(dtype);
      if (out.is_none()) {
        throw std::invalid_argument(StrCat(static_cast<const std::string&>(path), ": ", name,
                                           " has dtype ", dtype, ", which this torch lacks"));
      }
      return out;
    };
    std::vector<size_t> buffer_of(groups.size());
    std::vector<py::object> dtypes(groups.size());  // each item's torch dtype
    for (size_t k = 0; k < groups.size(); ++k) {
      const DcpTensorItem* t = reads_->tensor(k);
      const py::str name(items[k].name);
      dtypes[k] = torch_dtype(t == nullptr ? "U8" : t->dtype, items[k].name);
      if (reads_->how(k) == DcpItemRead::kParts) {
        const Dtype* dtype = DtypeNamed(t->dtype);
        for (size_t j = 0; j < groups[k].size(); ++j) {
          const Dims& lengths = items[k].requests[j].lengths;
          uint64_t nbytes = dtype == nullptr ? 0 : dtype->bits / 8;
          for (int64_t n : lengths) {
            if (n < 0) {
              throw std::invalid_argument(StrCat(static_cast<const std::string&>(path), ": ",
                                                 items[k].name, ": the load asks for ",
                                                 Tuple(lengths), " of it"));
            }
            nbytes *= static_cast<uint64_t>(n);
          }
          commits.append(py::make_tuple(
              buffers.size(), groups[k][j], name,
              py::make_tuple(dtypes[k], lengths, ContiguousStrides(lengths), 0, false, false)));
          buffers.append(py::make_tuple(groups[k][j], dtypes[k], lengths, py::none(), nbytes));
          dests_.emplace_back(k, j);
        }
        continue;
      }
      buffer_of[k] = buffers.size();
      dests_.emplace_back(k, std::nullopt);
      if (t == nullptr) {
        buffers.append(
            py::make_tuple(py::none(), dtypes[k], py::none(), py::none(), items[k].length));
        continue;
      }
      const bool direct = reads_->how(k) == DcpItemRead::kDirect;
      buffers.append(py::make_tuple(direct ? groups[k][0] : py::none(), dtypes[k], t->shape,
                                    direct ? py::cast(t->stride) : py::none(), t->nbytes));
    }
    for (size_t i = 0; i < group_of_req.size(); ++i) {
      const size_t k = group_of_req[i];
      if (reads_->how(k) == DcpItemRead::kParts) continue;
      const py::handle req = reqs[i];
      const DcpTensorItem* t = reads_->tensor(k);
      const py::str name(items[k].name);
      if (t == nullptr) {
        commits.append(py::make_tuple(buffer_of[k], req, name, py::none()));
        continue;
      }
      commits.append(
          py::make_tuple(buffer_of[k], req, name, View(path, items[k].name, *t, dtypes[k], req)));
    }
  }

  uint64_t Read(Engine& engine, const std::vector<uintptr_t>& addresses) const {
    if (!reads_) throw std::logic_error("DcpFileLoad.read: the load was closed");
    if (addresses.size() != dests_.size()) {
      throw std::invalid_argument("DcpFileLoad.read: one address per buffer");
    }
    std::vector<DcpRead> reads;
    reads.reserve(dests_.size());
    for (size_t i = 0; i < dests_.size(); ++i) {
      reads.push_back(reads_->ReadOf(dests_[i].first, dests_[i].second,
                                     reinterpret_cast<std::byte*>(addresses[i])));
    }
    GilReleased release;
    return reads_->bytes_read() + reads_->Read(engine, reads);
  }

  // Closes the file now (a failed read's error, which a caller may keep, holds this object).
  void Close() { reads_.reset(); }

  py::list buffers;
  py::list commits;

 private:
  // (dtype, shape, stride, storage_offset, conj, neg) of the block `req` asks of stored tensor `t`.
  static py::tuple View(const std::string& path, const std::string& name, const DcpTensorItem& t,
                        const py::object& dtype, const py::handle& req) {
    const auto offsets = req.attr("storage_offsets").cast<Dims>();
    const auto lengths = req.attr("lengths").cast<Dims>();
    bool inside = offsets.size() == t.shape.size() && lengths.size() == t.shape.size();
    int64_t start = t.storage_offset;
    for (size_t d = 0; inside && d < t.shape.size(); ++d) {
      // Compared without a sum, and multiplied only once inside: no int64 overflow.
      inside = offsets[d] >= 0 && lengths[d] >= 0 && offsets[d] <= t.shape[d] - lengths[d];
      if (inside) start += offsets[d] * t.stride[d];
    }
    if (!inside) {
      throw std::invalid_argument(StrCat(path, ": ", name, " is a tensor of ", Tuple(t.shape),
                                         ", the load asks for ", Tuple(lengths), " of it at ",
                                         Tuple(offsets)));
    }
    return py::make_tuple(dtype, lengths, t.stride, start, t.conj, t.neg);
  }

  std::unique_ptr<DcpFileReads> reads_;
  std::vector<std::pair<size_t, std::optional<size_t>>> dests_;  // (item, its part) per buffer
};

}  // namespace

void RegisterDcpLoad(py::module_& m) {
  m.def(
      "overlapping_areas",
      [](const std::vector<std::pair<uint64_t, uint64_t>>& areas) {
        std::vector<MemoryArea> named;
        named.reserve(areas.size());
        for (size_t i = 0; i < areas.size(); ++i) {
          named.push_back({"", areas[i].first, areas[i].second, std::to_string(i)});
        }
        std::vector<size_t> out;
        for (const auto& group : OverlappingGroups(std::move(named))) {
          for (const std::string& i : group) out.push_back(std::stoul(i));
        }
        std::sort(out.begin(), out.end());
        return out;
      },
      py::arg("areas"),
      "The indices, in order, of the (address, size) memory areas that meet another one: a "
      "load's targets that share memory (tied weights, a planner's reused scratch tensor).");
  m.def(
      "check_dcp_verify", [](const py::handle& verify) { DcpVerifyOf(verify); }, py::arg("verify"),
      "Reader's verify checked: ValueError unless True, False or 'full'.");
  py::class_<FileLoad>(
      m, "DcpFileLoad",
      "What a DCP load does with one rank file (DcpFileReads): the memory each read goes to, the "
      "reads, then what each ReadItem commits.")
      .def(py::init<Engine&, const FsPath&, const py::list&, const py::object&, const py::dict&,
                    const py::handle&, const py::handle&, const py::dict&>(),
           py::arg("engine"), py::arg("path"), py::arg("reqs"), py::arg("storage_data"),
           py::arg("chunk_sizes"), py::arg("bytes_type"), py::arg("verify"),
           py::arg("torch_dtypes"),
           "Opens path to read the stored items `reqs` (the load's ReadItems of this file, in "
           "order; storage_data: MetadataIndex -> _StorageInfo, or the DcpMetadataTable of the "
           "metadata; chunk_sizes: dcp_chunk_sizes' (unused with a table); an "
           "item is bytes where its first ReadItem's type is bytes_type; verify: Reader's; "
           "torch_dtypes: tensortier dtype name -> torch dtype) and reads what says how to read "
           "them (DcpFileReads' errors; ValueError naming the path and item for a dtype "
           "torch_dtypes lacks).")
      .def_readonly("buffers", &FileLoad::buffers,
                    "Per read: (ReadItem whose target may take the bytes straight, or None; the "
                    "torch dtype, shape, strides (None: any contiguous) and bytes such a target "
                    "has; the bytes are also those of the buffer to read into where none does).")
      .def_readonly(
          "commits", &FileLoad::commits,
          "Per ReadItem: (its buffer, the ReadItem, item name, view): view None for a "
          "bytes item, else (torch dtype, shape, stride, storage_offset, conj, neg) of the "
          "buffer's bytes that the ReadItem takes. Reads in parts come first.")
      .def("read", &FileLoad::Read, py::arg("engine"), py::arg("addresses"),
           "Reads each of `buffers` into the memory at addresses[i], checked as verify says "
           "(DcpFileReads.read). Returns the bytes read from the file, the constructor's too.")
      .def("close", &FileLoad::Close,
           "Closes the file (idempotent); read() then raises RuntimeError. buffers and commits "
           "stay.");
}
