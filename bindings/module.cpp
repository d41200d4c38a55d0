// tensortier._core: the C++ API for Python, without torch. Buffers cross as addresses and sizes;
// the Python layer (python/tensortier) keeps the objects alive and validates them. Every call that
// can block releases the GIL, and no Python runs on engine threads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/statfs.h>

#include <chrono>
#include <optional>
#include <system_error>
#include <utility>

#include "binding_helpers.hpp"
#include "errors.hpp"
#include "gil_free_holder.hpp"
#include "paths.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/io/fault_injection.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/io/page_cache.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

void RegisterCheckpoint(py::module_& m);  // bindings/checkpoint.cpp
void RegisterTransfer(py::module_& m);    // bindings/transfer.cpp
void RegisterExtents(py::module_& m);     // bindings/extents.cpp
void RegisterShared(py::module_& m);      // bindings/shared.cpp
void RegisterData(py::module_& m);        // bindings/data.cpp

py::dict tensortier::IoStatsToDict(const IoStats& s) {
  py::dict d;
  d["backend"] = s.backend;
  d["requested_bytes"] = s.requested_bytes;
  d["transferred_bytes"] = s.transferred_bytes;
  d["direct_bytes"] = s.direct_bytes;
  d["buffered_bytes"] = s.buffered_bytes;
  d["bounced_bytes"] = s.bounced_bytes;
  d["staged_bytes"] = s.staged_bytes;
  d["cached_bytes"] = s.cached_bytes;
  d["requests"] = s.requests;
  d["resubmits"] = s.resubmits;
  d["eof"] = s.eof;
  d["direct_fallback"] = s.direct_fallback;
  d["residency_method"] = s.residency_method;
  return d;
}

namespace {

IoOp ParseOp(const std::string& op) {
  if (op == "read") return IoOp::kRead;
  if (op == "write") return IoOp::kWrite;
  throw std::invalid_argument(StrCat("op must be 'read' or 'write', not '", op, "'"));
}

FaultPlan::Kind ParseFaultKind(const std::string& kind) {
  if (kind == "error") return FaultPlan::Kind::kError;
  if (kind == "short") return FaultPlan::Kind::kShort;
  if (kind == "delay") return FaultPlan::Kind::kDelay;
  throw std::invalid_argument(StrCat("fault kind must be error, short or delay, not '", kind, "'"));
}

struct Overrides {
  std::optional<std::string> backend;
  std::optional<uint64_t> chunk_size;
  std::optional<unsigned> queue_depth;
  std::optional<unsigned> workers;
  std::optional<uint64_t> max_inflight_bytes;
  std::optional<bool> page_cache_check;
  std::optional<std::string> stage_reads;
  std::optional<uint32_t> bounce_idle_ms;

  // `o` with the values given here in place of its own.
  EngineOptions Apply(EngineOptions o = EngineOptions::FromEnvironment()) const {
    if (backend) o.backend = *backend;
    if (chunk_size) o.chunk_size = *chunk_size;
    if (queue_depth) o.queue_depth = *queue_depth;
    if (workers) o.workers = *workers;
    if (max_inflight_bytes) o.max_inflight_bytes = *max_inflight_bytes;
    if (page_cache_check) o.page_cache_check = *page_cache_check;
    if (stage_reads) o.stage_reads = ParseReadStaging(*stage_reads);
    if (bounce_idle_ms) o.bounce_idle_ms = *bounce_idle_ms;
    return o;
  }
};

// The Python view of engine settings (IOHandle.options).
py::dict OptionsDict(const EngineOptions& o) {
  py::dict d;
  d["backend"] = o.backend;
  d["chunk_size"] = o.chunk_size;
  d["queue_depth"] = o.queue_depth;
  d["workers"] = o.workers;
  d["max_inflight_bytes"] = o.max_inflight_bytes;
  d["page_cache_check"] = o.page_cache_check;
  d["stage_reads"] = std::string(ReadStagingName(o.stage_reads));
  d["bounce_idle_ms"] = o.bounce_idle_ms;
  d["max_staged_bytes"] = o.max_staged_bytes;
  d["copy_threads"] = o.copy_threads;
  return d;
}

}  // namespace

// A backend factory that injects the faults described by `fault` (test hook; also used by
// bindings/extents.cpp).
FaultPlan tensortier::FaultPlanFromDict(const py::dict& f) {
  FaultPlan plan;
  plan.kind = ParseFaultKind(f["kind"].cast<std::string>());
  if (f.contains("errno")) plan.error = f["errno"].cast<int>();
  if (f.contains("nth")) plan.nth = f["nth"].cast<uint64_t>();
  if (f.contains("count")) plan.count = f["count"].cast<uint64_t>();
  if (f.contains("steps")) {
    plan.reads = plan.writes = false;
    for (const auto& step : f["steps"].cast<std::vector<std::string>>()) {
      plan.steps |= 1u << static_cast<unsigned>(ParseFileStep(step));
    }
  }
  if (f.contains("reads")) plan.reads = f["reads"].cast<bool>();
  if (f.contains("writes")) plan.writes = f["writes"].cast<bool>();
  if (f.contains("short_bytes")) plan.short_bytes = f["short_bytes"].cast<uint64_t>();
  if (f.contains("delay_us")) plan.delay = std::chrono::microseconds(f["delay_us"].cast<int64_t>());
  return plan;
}

BackendFactory tensortier::FaultFactory(const EngineOptions& options, const py::dict& f) {
  const FaultPlan plan = FaultPlanFromDict(f);
  BackendKind kind = ParseBackendKind(options.backend == "auto" ? "threads" : options.backend);
  auto injector = std::make_shared<FaultInjector>(plan);
  return [kind, injector](unsigned depth) {
    return MakeFaultInjectingBackend(MakeBackend(kind, depth), injector);
  };
}

namespace {

// The engine's start (backend probes with verified O_DIRECT round trips in `probe_dir`, worker
// threads) runs with the GIL released.
GilFreeHolder<Engine> MakeEngine(const Overrides& overrides, const std::string& probe_dir,
                                 const std::optional<py::dict>& fault) {
  EngineOptions options = overrides.Apply();
  BackendFactory factory;
  if (fault) factory = FaultFactory(options, *fault);
  py::gil_scoped_release release;
  if (!factory) return GilFreeHolder<Engine>(new Engine(options, probe_dir));
  return GilFreeHolder<Engine>(new Engine(options, factory));
}

OffloadKind ParseOffloadKind(const std::string& kind) {
  if (kind == "write") return OffloadKind::kWrite;
  if (kind == "read") return OffloadKind::kRead;
  throw std::invalid_argument(StrCat("kind must be 'write' or 'read', not '", kind, "'"));
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

// Address of a C-contiguous buffer export (memoryview, bytearray, numpy array...).
uintptr_t BufferAddress(const py::object& obj, bool writable) {
  Py_buffer view;
  int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) throw py::error_already_set();
  auto address = reinterpret_cast<uintptr_t>(view.buf);
  PyBuffer_Release(&view);
  return address;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "tensortier C++ core (internal; use the tensortier package)";

  RegisterErrors(m);

  py::class_<File>(m, "File",
                   "An open file for IOHandle transfers: a buffered descriptor, plus an O_DIRECT "
                   "one where the filesystem takes it. Open with IOHandle.open() or File.open().")
      .def_static(
          "open",
          [](const FsPath& path, const std::string& mode, bool direct) {
            OpenMode parsed = ParseOpenMode(mode);
            py::gil_scoped_release release;
            return File::Open(path, parsed, direct);
          },
          py::arg("path"), py::arg("mode") = "r", py::arg("direct") = true,
          "Opens `path`: mode 'r' (read), 'r+' (read and write), 'w' (create or truncate), 'a' "
          "(create if missing, keep contents); 'w' and 'a' files can be read too. `direct`: also "
          "open O_DIRECT where the filesystem allows (else `direct_fallback_reason` says why). "
          "Raises OSError.")
      .def_static(
          "open_descriptor",
          [](int fd, const std::string& mode, bool direct) {
            OpenMode parsed = ParseOpenMode(mode);
            py::gil_scoped_release release;
            return File::OpenDescriptor(fd, parsed, direct);
          },
          py::arg("fd"), py::arg("mode") = "r", py::arg("direct") = true,
          "Opens again the file the descriptor `fd` refers to (it stays the caller's), as open() "
          "does; named, in `path` and errors, by the descriptor's file. Raises OSError (EBADF "
          "for a descriptor not open).")
      .def_property_readonly(
          "path", [](const File& f) { return PathToPython(f.path()); },
          "The path it was opened with.")
      .def_property_readonly(
          "closed", [](const File& f) { return !f.is_open(); }, "Whether close() was called.")
      .def_property_readonly("writable", &File::writable, "Whether the mode allows writes.")
      .def_property_readonly("direct", &File::direct, "Whether an O_DIRECT descriptor is open.")
      .def_property_readonly(
          "direct_fallback_reason",
          [](const File& f) { return MessageToPython(f.direct_fallback_reason()); },
          "Why O_DIRECT was refused ('' when it was not, or not asked for).")
      .def_property_readonly("offset_alignment", &File::offset_alignment,
                             "File offset alignment O_DIRECT needs here (bytes).")
      .def_property_readonly("memory_alignment", &File::memory_alignment,
                             "Memory address alignment O_DIRECT needs here (bytes).")
      .def("fileno", &File::buffered_fd, "The buffered descriptor (valid until close()).")
      .def("size", &File::Size, "The file's size in bytes.")
      .def("truncate", &File::Truncate, py::arg("size"), py::call_guard<py::gil_scoped_release>(),
           "Sets the file's size to `size` bytes.")
      .def("allocate", &File::Allocate, py::arg("offset"), py::arg("length"),
           py::call_guard<py::gil_scoped_release>(),
           "Reserves [offset, offset+length) on disk (posix fallocate): ENOSPC now rather than "
           "mid-write. Raises OSError.")
      .def("datasync", &File::DataSync, py::call_guard<py::gil_scoped_release>(),
           "fdatasync: the data written so far is durable when it returns.")
      .def("drop_cache", &File::DropCache, py::call_guard<py::gil_scoped_release>(),
           "Drops the file's clean page-cache pages (the next read is cold).")
      .def("close", &File::Close,
           "Closes this handle; operations in flight keep the descriptors until they end.");

  py::class_<Future>(m, "Future")
      .def("done", &Future::done)
      .def(
          "wait",
          [](const Future& f, bool interruptible) {
            // Interruptible: signal handlers run every 50 ms while it waits (Ctrl-C raises
            // KeyboardInterrupt; the operation goes on, its memory kept by the caller).
            while (interruptible) {
              bool done;
              {
                py::gil_scoped_release release;
                done = f.WaitFor(std::chrono::milliseconds(50));
              }
              if (done) break;
              if (PyErr_CheckSignals() != 0) throw py::error_already_set();
            }
            IoResult r;
            {
              py::gil_scoped_release release;
              r = f.Wait();
            }
            py::dict out;
            out["bytes"] = r.bytes;
            out["segment_bytes"] = r.segment_bytes;
            out["stats"] = IoStatsToDict(r.stats);
            return out;
          },
          py::arg("interruptible") = true);

  // Dropping an engine waits for its I/O and joins its threads: with the GIL released.
  py::class_<Engine, GilFreeHolder<Engine>>(m, "Engine")
      .def(py::init([](std::optional<std::string> backend, std::optional<uint64_t> chunk_size,
                       std::optional<unsigned> queue_depth, std::optional<unsigned> workers,
                       std::optional<uint64_t> max_inflight_bytes,
                       std::optional<bool> page_cache_check, std::optional<std::string> stage_reads,
                       std::optional<uint32_t> bounce_idle_ms, const FsPath& probe_dir,
                       std::optional<py::dict> fault) {
             Overrides o{backend,          chunk_size,  queue_depth,   workers, max_inflight_bytes,
                         page_cache_check, stage_reads, bounce_idle_ms};
             return MakeEngine(o, probe_dir, fault);
           }),
           py::arg("backend") = py::none(), py::arg("chunk_size") = py::none(),
           py::arg("queue_depth") = py::none(), py::arg("workers") = py::none(),
           py::arg("max_inflight_bytes") = py::none(), py::arg("page_cache_check") = py::none(),
           py::arg("stage_reads") = py::none(), py::arg("bounce_idle_ms") = py::none(),
           py::arg("probe_dir") = "", py::arg("fault") = py::none())
      .def_property_readonly("backend", &Engine::backend)
      .def_property_readonly("options", [](const Engine& e) { return OptionsDict(e.options()); })
      .def_property_readonly("bounce_bytes", &Engine::bounce_bytes)
      .def_property_readonly("bounce_allocations", &Engine::bounce_allocations)
      .def(
          "submit",
          [](Engine& e, const std::string& op,
             const std::vector<std::tuple<File, uintptr_t, uint64_t, uint64_t>>& pieces,
             bool stage_reads) {
            IoOp parsed = ParseOp(op);
            std::vector<IoDesc> descs;
            descs.reserve(pieces.size());
            for (const auto& [file, address, length, offset] : pieces) {
              descs.push_back({file, reinterpret_cast<void*>(address), offset, length});
            }
            py::gil_scoped_release release;
            return e.Submit(parsed, descs, SubmitOptions{.stage_reads = stage_reads});
          },
          py::arg("op"), py::arg("pieces"), py::arg("stage_reads") = false)
      .def("wait_all", &Engine::WaitAll, py::call_guard<py::gil_scoped_release>());

  py::class_<Offloader>(m, "Offloader")
      .def(py::init([](const std::vector<FsPath>& dirs, std::optional<std::string> backend,
                       std::optional<uint64_t> chunk_size, std::optional<unsigned> queue_depth,
                       std::optional<unsigned> workers, std::optional<uint64_t> max_inflight_bytes,
                       std::optional<uint64_t> stripe_threshold, std::optional<py::dict> fault) {
             OffloaderOptions o;
             o.dirs = PathBytes(dirs);
             o.engine =
                 Overrides{backend,      chunk_size,   queue_depth, workers, max_inflight_bytes,
                           std::nullopt, std::nullopt, std::nullopt}
                     .Apply(OffloaderEngineDefaults());
             if (stripe_threshold) o.stripe_threshold = *stripe_threshold;
             if (fault) o.backend_factory = FaultFactory(o.engine, *fault);
             py::gil_scoped_release release;
             return std::make_unique<Offloader>(std::move(o));
           }),
           py::arg("dirs"), py::arg("backend") = py::none(), py::arg("chunk_size") = py::none(),
           py::arg("queue_depth") = py::none(), py::arg("workers") = py::none(),
           py::arg("max_inflight_bytes") = py::none(), py::arg("stripe_threshold") = py::none(),
           py::arg("fault") = py::none())
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

  m.def(
      "filesystem_magic",
      [](const FsPath& path) {
        struct statfs st {};
        int rc;
        {
          py::gil_scoped_release release;  // a network filesystem can take its time
          rc = statfs(path.bytes.c_str(), &st);
        }
        if (rc != 0) ThrowIoError(errno, "statfs", path);
        return static_cast<uint64_t>(st.f_type);
      },
      py::arg("path"), "statfs(2)'s f_type of the filesystem holding `path` (EXT4 0xEF53...).");
  m.def("huge_pages_policy", &HugePagesPolicy,
        "Which page-aligned buffers ask for transparent huge pages in this process, and why.");
  m.def("buffer_address", &BufferAddress, py::arg("obj"), py::arg("writable"),
        "Address of a C-contiguous buffer export; raises BufferError if it is not one.");
  // Page-aligned host memory with the buffer protocol (numpy/torch.frombuffer wrap it).
  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init([](size_t size, bool reused, bool resident) {
             py::gil_scoped_release release;  // faulting in gigabytes takes seconds
             return AlignedBuffer(size, reused ? Pages::kReused : Pages::kTouchedOnce,
                                  resident ? Populate::kUpFront : Populate::kOnDemand);
           }),
           py::arg("size"), py::arg("reused") = false, py::arg("resident") = false)
      .def_property_readonly("locked", &AlignedBuffer::locked)
      .def("__len__", &AlignedBuffer::size)
      .def_property_readonly(
          "address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(b.size())}, {1});
      });
  m.def(
      "defaults",
      [] {
        std::vector<DefaultSetting> rows;
        {
          py::gil_scoped_release release;
          rows = Defaults();
        }
        py::list out;
        for (const auto& d : rows) {
          py::dict row;
          row["name"] = d.name;
          row["env"] = d.env;
          row["value"] = d.value;
          row["default"] = d.default_value;
          row["allowed"] = d.allowed;
          row["description"] = d.description;
          row["from_environment"] = d.from_environment;
          out.append(row);
        }
        return out;
      },
      "Every TENSORTIER_* setting: name, env, value in effect, default, allowed, description, "
      "from_environment. Raises ValueError naming a variable whose value is bad.");
  m.def(
      "setting_is_set",
      [](const std::string& env) { return SettingFromEnvironment(SettingFor(env)).has_value(); },
      py::arg("env"), "Whether the TENSORTIER_* variable `env` is set (and not empty).");
  m.def(
      "setting_range",
      [](const std::string& env) {
        const Setting& s = SettingFor(env);
        return std::pair<uint64_t, uint64_t>(s.min, s.max);
      },
      py::arg("env"),
      "(smallest, largest) value the numeric TENSORTIER_* setting `env` allows, from the "
      "settings table.");
  m.def(
      "probe_backends",
      [](const FsPath& dir) {
        py::list out;
        std::vector<BackendProbe> probes;
        {
          py::gil_scoped_release release;
          for (BackendKind k : kAllBackends) probes.push_back(ProbeBackend(k, dir));
        }
        for (const auto& p : probes) {
          py::dict row;
          row["backend"] = std::string(BackendName(p.kind));
          row["compiled_in"] = BackendCompiledIn(p.kind);
          row["available"] = p.available;
          row["direct_ok"] = p.direct_ok;
          row["buffered_ok"] = p.buffered_ok;
          row["detail"] = MessageToPython(p.detail);
          out.append(row);
        }
        return out;
      },
      py::arg("dir"));
  m.def(
      "query_residency",
      [](int fd, uint64_t offset, uint64_t length) {
        Residency r = QueryResidency(fd, offset, length);
        return py::make_tuple(r.resident_bytes, r.checked_bytes,
                              std::string(ResidencyMethodName(r.method)));
      },
      py::arg("fd"), py::arg("offset"), py::arg("length"));
  RegisterCheckpoint(m);
  RegisterTransfer(m);
  RegisterExtents(m);
  RegisterShared(m);
  RegisterData(m);
}
