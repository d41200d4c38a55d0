// tensortier._core.DcpMetadataTable: a .metadata's contents from the index tensortier's writer
// puts before its pickle (dcp_metadata.hpp), for a load that plans and reads without the
// Metadata's Python objects. tensortier.dcp builds those objects only for the entries that take
// torch's planning (DTensors, resharded tensors, non-tensor values).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "gil.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

using Dims = std::vector<int64_t>;

namespace {

// How a load takes a key of its state dict (DcpMetadataTable.classify).
enum Take : int { kWholeRead = 0, kPlanned = 1, kMissing = 2 };

std::string TorchSize(const Dims& v) {
  std::string s = "torch.Size([";
  for (size_t i = 0; i < v.size(); ++i) s += StrCat(i ? ", " : "", v[i]);
  return s + "])";
}

std::vector<int> Classify(const DcpMetadataTable& table, const std::vector<std::string>& fqns,
                          const std::vector<std::optional<Dims>>& shapes,
                          const std::vector<bool>& plain, bool strict) {
  if (shapes.size() != fqns.size() || plain.size() != fqns.size()) {
    throw std::invalid_argument("DcpMetadataTable.classify: one shape and flag per key");
  }
  std::vector<int> out(fqns.size());
  for (size_t i = 0; i < fqns.size(); ++i) {
    const DcpMetadataEntry* e = table.Entry(fqns[i]);
    if (e == nullptr) {
      // DefaultLoadPlanner's errors, word for word: code that catches them keeps working.
      if (strict) {
        throw std::runtime_error(StrCat("Missing key in checkpoint state_dict: ", fqns[i], "."));
      }
      out[i] = kMissing;
      continue;
    }
    if (!e->bytes && shapes[i] && *shapes[i] != e->size) {
      throw py::value_error(StrCat("Size mismatch between saved ", TorchSize(e->size),
                                   " and current: ", TorchSize(*shapes[i]), " for ", fqns[i]));
    }
    out[i] = plain[i] && !e->bytes && table.StoredWhole(*e) ? kWholeRead : kPlanned;
  }
  return out;
}

}  // namespace

void RegisterDcpTable(py::module_& m) {
  py::class_<DcpMetadataTable>(
      m, "DcpMetadataTable",
      "A DCP .metadata's contents from tensortier's index (dcp_metadata_table), looked up by key "
      "without the Metadata's Python objects.")
      .def(
          "keys",
          [](const DcpMetadataTable& t) {
            py::list out;
            for (const auto& e : t.contents().entries) out.append(py::str(e.fqn));
            return out;
          },
          "The keys of state_dict_metadata, in order.")
      .def("classify", &Classify, py::arg("fqns"), py::arg("shapes"), py::arg("plain"),
           py::arg("strict"),
           "How a load takes each key of its (flattened) state dict, of shapes[i] (None: not a "
           "tensor), plain[i] where it is a plain tensor: 0 read whole into it (a tensor stored "
           "as one chunk of all of it), 1 planned by torch's planner, 2 missing (strict False). "
           "DefaultLoadPlanner's errors: RuntimeError for a missing key with strict, ValueError "
           "for a size other than the stored tensor's.")
      .def(
          "entry",
          [](const DcpMetadataTable& t, const std::string& fqn) -> py::object {
            const DcpMetadataEntry* e = t.Entry(fqn);
            if (e == nullptr) throw py::key_error(fqn);
            if (e->bytes) return py::none();
            py::list chunks;
            for (const auto& [offsets, sizes] : e->chunks) {
              chunks.append(py::make_tuple(offsets, sizes));
            }
            return py::make_tuple(e->dtype, e->layout, e->requires_grad, e->memory_format,
                                  e->pin_memory, e->size, chunks);
          },
          py::arg("fqn"),
          "state_dict_metadata[fqn]: None for a bytes value, else (torch's dtype name, layout "
          "name, requires_grad, memory format code, pin_memory, size, [(chunk offsets, chunk "
          "sizes)]). KeyError where it has none.")
      .def(
          "check",
          [](const DcpMetadataTable& t, const FsPath& dir, const FsPath& what) {
            GilReleased release;
            t.Check(dir, what);
          },
          py::arg("dir"), py::arg("what"),
          "ValueError naming `what` (the .metadata) for a tensor whose chunks do not hold it "
          "all; FileNotFoundError naming the data files dir lacks.")
      .def_property_readonly(
          "storage_meta",
          [](const DcpMetadataTable& t) {
            const DcpMetadataContents& md = t.contents();
            return py::make_tuple(FromUtf8(md.checkpoint_id), md.save_id, md.load_id, md.modules,
                                  md.format);
          },
          "(checkpoint_id, save_id, load_id, modules, tensortier_format) of the StorageMeta.")
      .def_property_readonly(
          "version", [](const DcpMetadataTable& t) { return t.contents().version; },
          "The Metadata's version.");
  m.def(
      "dcp_metadata_table",
      [](const py::bytes& data, const FsPath& what) -> py::object {
        const std::string bytes = data;
        std::optional<DcpMetadataContents> md;
        {
          GilReleased release;
          md = ReadDcpMetadataIndex(bytes, what);
        }
        if (!md) return py::none();
        return py::cast(std::make_unique<DcpMetadataTable>(std::move(*md)));
      },
      py::arg("data"), py::arg("what"),
      "The DcpMetadataTable of a .metadata's bytes from the index tensortier puts before its "
      "pickle, or None where it has none (torch's files, tensortier's written by pickle). "
      "ValueError naming `what` for a damaged index or one that does not describe the pickle "
      "after it, or of a newer format.");
}
