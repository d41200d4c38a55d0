// The offloader: tensors' bytes kept in files under a list of directories, by key.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "arguments.hpp"
#include "binding_helpers.hpp"
#include "errors.hpp"
#include "gil.hpp"
#include "offload_arguments.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

void RegisterOffloadEntries(py::module_& m);  // bindings/offload_entries.cpp

namespace {

// DiskOffloader's `n_entries`: TypeError for what is not an int, ValueError outside the queue
// depth's range.
unsigned QueueDepthArgument(const py::object& value) {
  const Setting& row = SettingFor("TENSORTIER_QUEUE_DEPTH");
  const std::string what = StrCat(row.min, " to ", row.max,
                                  " (requests in flight per worker, as TENSORTIER_QUEUE_DEPTH)");
  if (!IsPlainInt(value)) {
    throw py::type_error(
        StrCat("n_entries must be an integer from ", what, ", not ", TypeName(value)));
  }
  int overflow = 0;
  const long long depth = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow != 0 || depth < static_cast<long long>(row.min) ||
      depth > static_cast<long long>(row.max)) {
    throw py::value_error(StrCat("n_entries must be from ", what, ", not ", ReprOf(value)));
  }
  return static_cast<unsigned>(depth);
}

// DiskOffloader's `stripe_threshold`: a positive 64-bit integer, else ValueError.
uint64_t StripeThresholdArgument(const py::object& value) {
  uint64_t bytes = IsPlainInt(value) ? PyLong_AsUnsignedLongLong(value.ptr()) : 0;
  if (PyErr_Occurred() != nullptr) {  // negative, or past 64 bits
    PyErr_Clear();
    bytes = 0;
  }
  if (bytes == 0) {
    throw py::value_error(
        StrCat("stripe_threshold must be a positive integer (bytes), not ", ReprOf(value)));
  }
  return bytes;
}

}  // namespace

void RegisterOffload(py::module_& m) {
  m.def(
      "check_offloader_arguments",
      [](const py::object& backend, const py::object& n_entries,
         const py::object& stripe_threshold) {
        OffloadBackendName(py::isinstance<py::str>(backend) ? backend.cast<std::string>()
                                                            : ReprOf(backend));
        QueueDepthArgument(n_entries);
        StripeThresholdArgument(stripe_threshold);
      },
      py::arg("backend"), py::arg("n_entries"), py::arg("stripe_threshold"),
      "Offloader's checks of its arguments, alone: DiskOffloader runs them before it makes its "
      "directories (ValueError or TypeError naming the argument).");
  py::class_<Offloader>(m, "Offloader")
      .def(py::init([](const std::vector<FsPath>& dirs, const py::object& backend,
                       const py::object& n_entries, const py::object& stripe_threshold) {
             OffloaderOptions o;
             o.dirs = PathBytes(dirs);
             Overrides engine;
             // Not a str: refused with its repr in the message.
             engine.backend = std::string(OffloadBackendName(
                 py::isinstance<py::str>(backend) ? backend.cast<std::string>() : ReprOf(backend)));
             engine.queue_depth = QueueDepthArgument(n_entries);
             o.engine = engine.Apply(OffloaderEngineDefaults());
             o.stripe_threshold = StripeThresholdArgument(stripe_threshold);
             o.backend_factory = TestBackends(o.engine);
             GilReleased release;
             return std::make_unique<Offloader>(std::move(o));
           }),
           py::arg("dirs"), py::arg("backend") = "auto", py::arg("n_entries") = 16,
           py::arg("stripe_threshold") = 16 << 20,
           "DiskOffloader's arguments, checked here: `backend` by the engine's names or "
           "TensorNVMe's, `n_entries` the queue depth. ValueError or TypeError naming them.")
      .def(
          "write",
          [](Offloader& o, const std::vector<OffloadPieceTuple>& pieces) {
            std::vector<OffloadPiece> p = ToPieces(pieces);
            GilReleased release;
            o.AsyncWritev(p);
          },
          py::arg("pieces"), "Starts writing (key, address, length) pieces in one submission.")
      .def(
          "read",
          [](Offloader& o, const std::vector<OffloadPieceTuple>& pieces) {
            std::vector<OffloadPiece> p = ToPieces(pieces);
            GilReleased release;
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
              GilReleased release;
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
      .def("trim", &Offloader::Trim, py::call_guard<GilReleased>())
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
          "bounce_rings",
          [](const Offloader& o) -> std::optional<size_t> {
            if (SettingFromEnvironment(SettingFor("TENSORTIER_BOUNCE_RINGS"))) return std::nullopt;
            return std::max<size_t>(2, o.paths().size());
          },
          "The bounce rings of its device path: one per directory and at least two (the parts "
          "of a striped tensor move at once); None when TENSORTIER_BOUNCE_RINGS says.")
      .def_property_readonly(
          "engine", [](Offloader& o) -> Engine& { return o.engine(); },
          py::return_value_policy::reference_internal)
      .def("close", &Offloader::Close, py::call_guard<GilReleased>());
  m.def(
      "offload_backend",
      [](const std::string& name) { return std::string(OffloadBackendName(name)); },
      py::arg("name"),
      "The engine's name of the backend `name` names ('auto', an engine backend's name or "
      "TensorNVMe's: 'uring', 'aio', 'pthread'); ValueError listing the names taken.");
  m.def(
      "tensornvme_backend_name",
      [](const std::string& engine_name) {
        return std::string(NameOf(kTensorNvmeBackendNames, ParseBackendKind(engine_name)));
      },
      py::arg("engine_name"), "TensorNVMe's name of an engine backend ('io_uring' -> 'uring').");
  m.def(
      "remove_stale_offload_files", [](const FsPath& dir) { return RemoveStaleOffloadFiles(dir); },
      py::arg("dir"), py::call_guard<GilReleased>());
  RegisterOffloadEntries(m);
}
