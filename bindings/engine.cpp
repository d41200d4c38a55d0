// The I/O engine: engines, their futures and the probe of the backends a directory takes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "arguments.hpp"
#include "binding_helpers.hpp"
#include "gil.hpp"
#include "gil_free_holder.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

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

// The Python view of engine settings (IOHandle.options).
py::dict tensortier::OptionsDict(const EngineOptions& o) {
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

namespace {

IoOp ParseOp(const std::string& op) {
  if (const auto parsed = ValueOf(kIoOpNames, op)) return *parsed;
  throw std::invalid_argument(
      StrCat("op must be ", JoinNames(kIoOpNames, ", ", " or ", "'"), ", not '", op, "'"));
}

// The engine's start (backend probes with verified O_DIRECT round trips in `probe_dir`, worker
// threads) runs with the GIL released.
GilFreeHolder<Engine> MakeEngine(const Overrides& overrides, const std::string& probe_dir) {
  EngineOptions options = overrides.Apply();
  BackendFactory factory = TestBackends(options);
  GilReleased release;
  if (!factory) return GilFreeHolder<Engine>(new Engine(options, probe_dir));
  return GilFreeHolder<Engine>(new Engine(options, factory));
}

// IOHandle's settings as given: positive integers, flags (bools, 0, 1), stage_reads as a word
// or a flag, bounce_idle_ms within its row's range. Ranges and words are the settings table's
// (checked when the engine starts).
Overrides EngineArguments(const py::object& backend, const py::object& chunk_size,
                          const py::object& queue_depth, const py::object& workers,
                          const py::object& max_inflight_bytes, const py::object& page_cache_check,
                          const py::object& stage_reads, const py::object& bounce_idle_ms) {
  Overrides o;
  if (!backend.is_none()) {
    if (!py::isinstance<py::str>(backend)) {
      throw py::type_error(StrCat("backend must be a str, not ", TypeName(backend)));
    }
    o.backend = backend.cast<std::string>();
  }
  o.chunk_size = PositiveArgument<uint64_t>(chunk_size, "chunk_size");
  o.queue_depth = PositiveArgument<unsigned>(queue_depth, "queue_depth");
  o.workers = PositiveArgument<unsigned>(workers, "workers");
  o.max_inflight_bytes = PositiveArgument<uint64_t>(max_inflight_bytes, "max_inflight_bytes");
  o.page_cache_check = FlagArgument(page_cache_check, "page_cache_check");
  if (py::isinstance<py::str>(stage_reads)) {
    o.stage_reads = stage_reads.cast<std::string>();
  } else if (!stage_reads.is_none()) {
    try {
      o.stage_reads = *FlagArgument(stage_reads, "stage_reads") ? "on" : "off";
    } catch (const py::type_error&) {
      throw py::type_error(StrCat("stage_reads must be 'auto', 'on', 'off', True or False, not ",
                                  ReprOf(stage_reads)));
    }
  }
  if (!bounce_idle_ms.is_none()) {
    const Setting& row = SettingFor("TENSORTIER_BOUNCE_IDLE_MS");
    int overflow = 0;
    const long long ms = IsPlainInt(bounce_idle_ms)
                             ? PyLong_AsLongLongAndOverflow(bounce_idle_ms.ptr(), &overflow)
                             : -1;
    if (overflow != 0 || ms < static_cast<long long>(row.min) ||
        ms > static_cast<long long>(row.max)) {
      throw py::value_error(StrCat("bounce_idle_ms must be an integer from ", row.min, " to ",
                                   row.max, " (an hour), not ", ReprOf(bounce_idle_ms)));
    }
    o.bounce_idle_ms = static_cast<uint32_t>(ms);
  }
  return o;
}

}  // namespace

void RegisterEngine(py::module_& m) {
  py::class_<Future>(m, "Future")
      .def("done", &Future::done)
      .def(
          "wait",
          [](const Future& f, bool interruptible) {
            WaitInterruptibly([&](auto timeout) { return f.WaitFor(timeout); }, interruptible);
            IoResult r;
            {
              GilReleased release;
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
      .def(py::init([](const py::object& backend, const py::object& chunk_size,
                       const py::object& queue_depth, const py::object& workers,
                       const py::object& max_inflight_bytes, const py::object& page_cache_check,
                       const py::object& stage_reads, const py::object& bounce_idle_ms,
                       const FsPath& probe_dir) {
             return MakeEngine(
                 EngineArguments(backend, chunk_size, queue_depth, workers, max_inflight_bytes,
                                 page_cache_check, stage_reads, bounce_idle_ms),
                 probe_dir);
           }),
           py::arg("backend") = py::none(), py::arg("chunk_size") = py::none(),
           py::arg("queue_depth") = py::none(), py::arg("workers") = py::none(),
           py::arg("max_inflight_bytes") = py::none(), py::arg("page_cache_check") = py::none(),
           py::arg("stage_reads") = py::none(), py::arg("bounce_idle_ms") = py::none(),
           py::arg("probe_dir") = "",
           "IOHandle's engine settings, checked here (None: the default or TENSORTIER_* "
           "variable): ValueError or TypeError naming the argument.")
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
            GilReleased release;
            return e.Submit(parsed, descs, SubmitOptions{.stage_reads = stage_reads});
          },
          py::arg("op"), py::arg("pieces"), py::arg("stage_reads") = false)
      .def("wait_all", &Engine::WaitAll, py::call_guard<GilReleased>());

  m.def(
      "flag", [](const py::object& value, const char* name) { return FlagArgument(value, name); },
      py::arg("value"), py::arg("name"),
      "`value` as True or False (bools, 0, 1, numpy's bools), None kept: TypeError naming `name`.");
  m.def(
      "batch_piece",
      [](size_t index, const py::handle& piece) {
        // A tensor or array of three elements would unpack as one piece.
        const bool sequence = PyTuple_Check(piece.ptr()) || PyList_Check(piece.ptr());
        if (!sequence || py::len(piece) != 3) {
          throw py::type_error(StrCat("piece ", index, " of the batch is a ", TypeName(piece),
                                      sequence ? StrCat(" of ", py::len(piece)) : "",
                                      ": each piece is a (buffer, file, offset) tuple"));
        }
        const auto items = py::reinterpret_borrow<py::sequence>(piece);
        return py::make_tuple(items[0], items[1], OffsetArgument(items[2]));
      },
      py::arg("index"), py::arg("piece"),
      "An IOHandle batch's piece `index` as (buffer, file, offset), the offset checked: "
      "TypeError or ValueError naming it.");
  m.def("c_integer", &CIntegerArgument, py::arg("value"), py::arg("what"), py::arg("name"),
        py::arg("minimum"), py::arg("bits"), py::arg("unsigned") = false,
        "`value` as a C integer of `bits` bits, as a compatible API's pybind11 binding takes one "
        "(not a bool): TypeError when it is not one or does not fit, ValueError below `minimum`; "
        "messages start with '<what>: <name>'.");
  m.def("c_bool", &CBoolArgument, py::arg("value"), py::arg("what"), py::arg("name"),
        "`value` as pybind11 converts it to a C++ bool (None is False; a str or list is a "
        "TypeError starting with '<what>: <name>').");
  m.def(
      "probe_backends",
      [](const FsPath& dir) {
        py::list out;
        std::vector<BackendProbe> probes;
        {
          GilReleased release;
          for (BackendKind k : kAllBackends) probes.push_back(ProbeBackend(k, dir));
        }
        for (const auto& p : probes) {
          py::dict row;
          row["backend"] = std::string(BackendName(p.kind));
          row["compiled_in"] = BackendCompiledIn(p.kind);
          row["available"] = p.available;
          row["direct_ok"] = p.direct_ok;
          row["buffered_ok"] = p.buffered_ok;
          row["writes_tested"] = p.writes_tested;  // False: reads of a read-only directory
          row["detail"] = MessageToPython(p.detail);
          out.append(row);
        }
        return out;
      },
      py::arg("dir"));
}
