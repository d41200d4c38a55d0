// tensortier._core, what the compatibility modules (tensortier.compat) check without torch:
// TensorNVMe's arguments and backend names, and WholeMemory's shapes, strides and ranks, with the
// originals' errors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "arguments.hpp"
#include "gil.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

// `value` as TensorNVMe's bindings take an unsigned int of `bits` bits (32; 64 for a size_t or
// an unsigned long long): anything else is pybind11's TypeError.
uint64_t TensorNvmeUnsigned(const py::handle& value, const std::string& name, int bits) {
  PyObject* index = PyNumber_Index(value.ptr());
  uint64_t n = 0;
  bool ok = false;
  if (index != nullptr) {
    n = PyLong_AsUnsignedLongLong(index);  // OverflowError below 0 or past 64 bits
    ok = PyErr_Occurred() == nullptr && (bits == 64 || n >> bits == 0);
    Py_DECREF(index);
  }
  PyErr_Clear();
  if (!ok) {
    throw py::type_error(
        StrCat(name, " must be an unsigned integer (", bits, " bits), not ", ReprOf(value)));
  }
  return n;
}

void RegisterTensorNvmeWriter(py::module_& m);  // bindings/tensornvme_writer.cpp

namespace {

// operator.index(value), its TypeError included.
py::int_ Index(const py::handle& value) {
  PyObject* index = PyNumber_Index(value.ptr());
  if (index == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::int_>(index);
}

std::string Repr(const std::vector<int64_t>& values) {
  return ReprOf(py::cast(values));
}

// As TensorNVMe's DiskOffloader: makes the directory `path` if missing (os.mkdir's error).
void TensorNvmeDirectory(const FsPath& path) {
  struct stat status{};
  if (stat(path.bytes.c_str(), &status) != 0) {
    if (mkdir(path.bytes.c_str(), 0777) != 0) {  // os.mkdir's error, filename included
      PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, PathToPython(path.bytes).ptr());
      throw py::error_already_set();
    }
  } else if (!S_ISDIR(status.st_mode)) {
    PyErr_SetString(PyExc_AssertionError, StrCat("dir_name ", ReprOf(PathToPython(path.bytes)),
                                                 " exists and is not a directory")
                                              .c_str());
    throw py::error_already_set();
  }
}

// TensorNVMe's `n_entries` as the engine's queue depth: the nearest one its rings allow.
uint64_t QueueDepth(const py::handle& n_entries) {
  const Setting& s = SettingFor("TENSORTIER_QUEUE_DEPTH");
  return std::clamp<uint64_t>(TensorNvmeUnsigned(n_entries, "n_entries", 32), s.min, s.max);
}

// TensorNVMe's error for a backend it does not know: its DiskOffloader asserts (AssertionError),
// its C++ (and an older DiskOffloader) throws RuntimeError("Unsupported backend: ..."). This is
// both, so that code catching either keeps working. Made once, for the module's lifetime.
PyObject* UnsupportedBackendError() {
  static PyObject* type = [] {
    PyObject* bases = PyTuple_Pack(2, PyExc_AssertionError, PyExc_RuntimeError);
    PyObject* t = PyErr_NewException("tensortier._core.UnsupportedBackendError", bases, nullptr);
    Py_XDECREF(bases);
    if (t == nullptr) throw py::error_already_set();
    return t;
  }();
  return type;
}

// The engine's name of the backend TensorNVMe would run (TENSORNVME_BACKEND when set).
std::string TensorNvmeBackend(const py::object& backend) {
  const char* variable = std::getenv("TENSORNVME_BACKEND");
  std::string name = variable != nullptr && *variable != '\0' ? variable
                     : py::isinstance<py::str>(backend)       ? backend.cast<std::string>()
                                                              : ReprOf(backend);
  try {
    return std::string(OffloadBackendName(name));
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(UnsupportedBackendError(), StrCat("Unsupported backend: ", e.what()).c_str());
    throw py::error_already_set();
  }
}

}  // namespace

void RegisterCompat(py::module_& m) {
  m.def("unsigned_argument", &TensorNvmeUnsigned, py::arg("value"), py::arg("name"),
        py::arg("bits") = 32,
        "`value` as TensorNVMe's bindings take an unsigned integer of `bits` bits; TypeError "
        "naming `name` otherwise.");
  m.def(
      "tensornvme_offloader_arguments",
      [](const py::object& dir_name, const py::handle& n_entries, const py::object& backend) {
        // TensorNVMe's order: the backend asserted before the directory is made.
        std::string name = TensorNvmeBackend(backend);
        if (PyUnicode_Check(dir_name.ptr()) || PyBytes_Check(dir_name.ptr()) ||
            py::isinstance(dir_name, py::module_::import("os").attr("PathLike"))) {
          // TensorNVMe joins dir_name with a str file name: bytes are a TypeError there.
          TensorNvmeDirectory(FsPathArgument(dir_name, "dir_name", false).cast<FsPath>());
        }
        const uint64_t depth = QueueDepth(n_entries);
        return py::make_tuple(depth, std::move(name));
      },
      py::arg("dir_name"), py::arg("n_entries"), py::arg("backend"),
      "TensorNVMe's DiskOffloader arguments checked as it checks them: (queue depth, the "
      "engine's backend name). UnsupportedBackendError (an AssertionError and a RuntimeError) "
      "for a backend it does not know, before anything else; then a path `dir_name` is made if "
      "missing (not its parents: FileNotFoundError); AssertionError when it is not a "
      "directory.");
  m.attr("UnsupportedBackendError") = py::handle(UnsupportedBackendError());
  m.def(
      "backend_starts",
      [](const std::string& backend, const FsPath& dir) {
        if (backend == "auto") return true;
        const BackendKind kind = ParseBackendKind(backend);
        GilReleased release;
        return ProbeBackend(kind, dir.bytes).available;
      },
      py::arg("backend"), py::arg("dir"),
      "Whether the engine backend `backend` ('auto' always) starts here (probed in `dir`).");
  m.def(
      "tensornvme_backends",
      [](const FsPath& dir) {
        std::set<std::string> names;
        GilReleased release;
        for (BackendKind k : kAllBackends) {
          const BackendProbe p = ProbeBackend(k, dir.bytes);
          if (p.available && (p.direct_ok || p.buffered_ok)) {
            names.emplace(NameOf(kTensorNvmeBackendNames, k));
          }
        }
        return names;
      },
      py::arg("dir"), "TensorNVMe's names of the backends whose round trip in `dir` passes.");
  m.def(
      "wholememory_dims",
      [](const py::iterable& shape, const py::object& stride, const py::iterable& ranks,
         int64_t world_size) {
        std::vector<int64_t> dims;
        for (const py::handle d : shape) dims.push_back(Index(d).cast<int64_t>());
        std::vector<int64_t> contiguous(dims.size(), 1);
        for (size_t i = dims.size(); i-- > 0;) {
          if (dims[i] < 0) {  // torch's error for the shape
            throw std::runtime_error(StrCat("Trying to create tensor with negative dimension ",
                                            dims[i], ": ", Repr(dims)));
          }
          if (i + 1 < dims.size()) {
            contiguous[i] = contiguous[i + 1] * std::max<int64_t>(dims[i + 1], 1);
          }
        }
        if (py::len(stride) != 0) {
          std::vector<int64_t> given;
          for (const py::handle s : py::iter(stride)) given.push_back(Index(s).cast<int64_t>());
          if (given != contiguous) {
            throw std::invalid_argument(StrCat(
                "wholememory: stride ", ReprOf(py::list(stride)), " is not the contiguous stride ",
                Repr(contiguous), " of shape ", Repr(dims), "; pass [] or the contiguous stride"));
          }
        }
        std::vector<int64_t> members;
        for (const py::handle r : ranks) members.push_back(Index(r).cast<int64_t>());
        std::sort(members.begin(), members.end());
        for (size_t i = 0; i < members.size(); ++i) {
          if (members.size() != static_cast<size_t>(world_size) ||
              members[i] != static_cast<int64_t>(i)) {
            throw std::invalid_argument(StrCat("wholememory: ranks ", ReprOf(py::list(ranks)),
                                               ": tensors are shared by every rank; pass []"));
          }
        }
        return py::tuple(py::cast(dims));
      },
      py::arg("shape"), py::arg("stride"), py::arg("ranks"), py::arg("world_size"),
      "WholeMemory's create_tensor arguments checked: the shape as a tuple; ValueError for a "
      "stride other than [] or the contiguous one, or ranks other than [] or all of them.");
  m.def(
      "tensornvme_writer_arguments",
      [](const py::handle& fd, const py::handle& n_entries, const py::object& backend,
         const py::handle& n_tasks) {
        if (!IsPlainInt(fd)) throw py::type_error(StrCat("fd must be an int, not ", TypeName(fd)));
        const uint64_t depth = QueueDepth(n_entries);
        TensorNvmeUnsigned(n_tasks, "n_tasks", 32);  // TensorNVMe's debug log counts them
        // A writer is one file written by one ring (aio, uring) or a pool of 8 threads
        // (TensorNVMe's pthread backend): one engine worker, the threads backend's threads
        // capped alike. ColossalAI keeps a writer per shard alive until the next step.
        constexpr uint64_t kPthreadPool = 8;
        const std::string name = TensorNvmeBackend(backend);
        return py::make_tuple(name == "threads" ? std::min(depth, kPthreadPool) : depth, name, 1);
      },
      py::arg("fd"), py::arg("n_entries"), py::arg("backend"), py::arg("n_tasks"),
      "TensorNVMe's AsyncFileWriter arguments checked as its binding checks them: (queue depth, "
      "the engine's backend name, engine workers).");
  RegisterTensorNvmeWriter(m);
}
