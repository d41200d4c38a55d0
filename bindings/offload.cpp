// The offloader: tensors' bytes kept in files under a list of directories, by key.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "binding_helpers.hpp"
#include "errors.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

OffloadKind ParseOffloadKind(const std::string& kind) {
  if (const auto parsed = ValueOf(kOffloadKindNames, kind)) return *parsed;
  throw std::invalid_argument(StrCat(
      "kind must be ", JoinNames(kOffloadKindNames, ", ", " or ", "'"), ", not '", kind, "'"));
}

std::vector<OffloadPiece> ToPieces(
    const std::vector<std::tuple<uint64_t, uintptr_t, uint64_t>>& pieces) {
  std::vector<OffloadPiece> out;
  out.reserve(pieces.size());
  for (const auto& [key, address, length] : pieces) {
    out.push_back({key, reinterpret_cast<void*>(address), length});
  }
  return out;
}

}  // namespace

void RegisterOffload(py::module_& m) {
  py::class_<Offloader>(m, "Offloader")
      .def(py::init([](const std::vector<FsPath>& dirs, std::optional<std::string> backend,
                       std::optional<uint64_t> chunk_size, std::optional<unsigned> queue_depth,
                       std::optional<unsigned> workers, std::optional<uint64_t> max_inflight_bytes,
                       std::optional<uint64_t> stripe_threshold) {
             OffloaderOptions o;
             o.dirs = PathBytes(dirs);
             o.engine =
                 Overrides{backend,      chunk_size,   queue_depth, workers, max_inflight_bytes,
                           std::nullopt, std::nullopt, std::nullopt}
                     .Apply(OffloaderEngineDefaults());
             if (stripe_threshold) o.stripe_threshold = *stripe_threshold;
             o.backend_factory = TestBackends(o.engine);
             py::gil_scoped_release release;
             return std::make_unique<Offloader>(std::move(o));
           }),
           py::arg("dirs"), py::arg("backend") = py::none(), py::arg("chunk_size") = py::none(),
           py::arg("queue_depth") = py::none(), py::arg("workers") = py::none(),
           py::arg("max_inflight_bytes") = py::none(), py::arg("stripe_threshold") = py::none())
      .def(
          "write",
          [](Offloader& o, const std::vector<std::tuple<uint64_t, uintptr_t, uint64_t>>& pieces) {
            std::vector<OffloadPiece> p = ToPieces(pieces);
            py::gil_scoped_release release;
            o.AsyncWritev(p);
          },
          py::arg("pieces"), "Starts writing (key, address, length) pieces in one submission.")
      .def(
          "read",
          [](Offloader& o, const std::vector<std::tuple<uint64_t, uintptr_t, uint64_t>>& pieces) {
            std::vector<OffloadPiece> p = ToPieces(pieces);
            py::gil_scoped_release release;
            o.AsyncReadv(p);
          },
          py::arg("pieces"), "Starts reading (key, address, length) pieces in one submission.")
      .def(
          "wait",
          [](Offloader& o, const std::string& kind,
             const std::optional<std::vector<uint64_t>>& keys) {
            OffloadKind parsed = ParseOffloadKind(kind);
            std::vector<OffloadOutcome> outcomes;
            {
              py::gil_scoped_release release;
              outcomes = keys ? o.Wait(parsed, *keys) : o.Wait(parsed);
            }
            py::list out;
            for (const OffloadOutcome& r : outcomes) {
              out.append(py::make_tuple(r.key, r.error ? PythonError(r.error) : py::none()));
            }
            return out;
          },
          py::arg("kind"), py::arg("keys") = py::none(),
          "Waits for the operations of a kind (those moving any of `keys` when given): [(key, "
          "exception or None)].")
      .def("discard", &Offloader::Discard, py::arg("key"))
      .def("trim", &Offloader::Trim, py::call_guard<py::gil_scoped_release>())
      .def("stored", &Offloader::stored, py::arg("key"))
      .def("pending", &Offloader::pending, py::arg("key"))
      .def_property_readonly("stored_bytes", &Offloader::stored_bytes)
      .def_property_readonly("file_bytes", &Offloader::file_bytes)
      .def_property_readonly("bounce_bytes", &Offloader::bounce_bytes)
      .def_property_readonly("bounce_allocations", &Offloader::bounce_allocations)
      .def_property_readonly("engine_options",
                             [](const Offloader& o) { return OptionsDict(o.engine_options()); })
      .def_property_readonly("paths", [](const Offloader& o) { return PathsToPython(o.paths()); })
      .def_property_readonly("backend", &Offloader::backend)
      .def_property_readonly(
          "engine", [](Offloader& o) -> Engine& { return o.engine(); },
          py::return_value_policy::reference_internal)
      .def("close", &Offloader::Close, py::call_guard<py::gil_scoped_release>());
  m.def(
      "remove_stale_offload_files", [](const FsPath& dir) { return RemoveStaleOffloadFiles(dir); },
      py::arg("dir"), py::call_guard<py::gil_scoped_release>());
}
