// tensortier._core, the transfer layer: CUDA driver and cuFile status, pinned host memory, cuFile
// buffer registrations, files registered for GDS and device <-> file transfers. Device memory
// crosses as (address, device ordinal, stream handle) integers: no torch or CUDA headers here.
// Every call that can block releases the GIL; no Python runs on C++ threads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>

#include "arguments.hpp"
#include "binding_helpers.hpp"
#include "errors.hpp"
#include "gil.hpp"
#include "gil_free_holder.hpp"
#include "offload_arguments.hpp"
#include "paths.hpp"
#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/cuda/cufile.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/offload/device_offload.hpp"
#include "tensortier/offload/offload_device.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/transfer/device_copier.hpp"
#include "tensortier/transfer/device_jobs.hpp"
#include "tensortier/transfer/operation.hpp"
#include "tensortier/transfer/pinned_pool.hpp"
#include "tensortier/transfer/transfer.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

const CudaDriver& RequireDriver(const std::string& what) {
  const CudaDriver& driver = CudaDriver::Get();
  if (!driver.available()) {
    throw CudaError(cuda::kUnavailable, what,
                    StrCat("CUDA driver unavailable: ", driver.why_unavailable()));
  }
  return driver;
}

// Page-aligned host memory registered with CUDA (cuMemHostRegister, portable), with the buffer
// protocol. The registration goes before the memory (members are destroyed in reverse order).
struct PinnedMemory {
  AlignedBuffer memory;
  std::optional<HostRegistration> registration;

  PinnedMemory(size_t size, int device) {
    const CudaDriver& driver = RequireDriver("pinned host memory (cuMemHostRegister)");
    if (size == 0) return;
    memory = AlignedBuffer(size, Pages::kReused);
    registration.emplace(PrimaryContext(driver, device), memory.data(), size);
  }
};

py::dict ResultToDict(const TransferResult& r) {
  py::dict stats = IoStatsToDict(r.io);
  stats["path"] = r.path;
  stats["copier"] = r.copier;
  stats["chunks"] = r.chunks;
  stats["gds_reason"] = MessageToPython(r.gds_reason);  // may quote the path
  py::dict out;
  out["bytes"] = r.bytes;
  out["eof"] = r.eof;
  out["stats"] = stats;
  return out;
}

// IOResult's fields: the engine's stats, and with device pieces, each one's stats
// (device_pieces), the first one's path, the first reason given for not using GDS, and eof when
// any part reached it.
py::dict OperationResultToDict(const OperationResult& r) {
  py::dict stats = r.host ? IoStatsToDict(r.stats) : py::dict();
  if (!r.device.empty()) {
    py::list pieces;
    std::string reason;
    bool eof = r.host && r.stats.eof;
    for (const TransferResult& d : r.device) {
      pieces.append(ResultToDict(d)["stats"]);
      if (reason.empty()) reason = d.gds_reason;
      eof = eof || d.eof;
    }
    stats["device_pieces"] = pieces;
    stats["path"] = r.device.front().path;
    stats["gds_reason"] = MessageToPython(reason);
    stats["eof"] = eof;
  }
  py::dict out;
  out["bytes"] = r.bytes;
  out["segment_bytes"] = r.segment_bytes;
  out["stats"] = stats;
  return out;
}

using AnyFile = std::variant<DeviceFile, File, std::shared_ptr<LazyDeviceFile>>;

// A transfer of `file`, whichever kind it is (a LazyDeviceFile registers on first use, here).
template <typename Move>
TransferResult WithFile(const AnyFile& file, const Move& move) {
  if (const auto* lazy = std::get_if<std::shared_ptr<LazyDeviceFile>>(&file)) {
    return move((*lazy)->Get());
  }
  if (const auto* device = std::get_if<DeviceFile>(&file)) return move(*device);
  return move(std::get<File>(file));
}

DeviceSpan Span(uintptr_t address, int device, std::optional<uintptr_t> stream) {
  DeviceSpan s;
  s.address = address;
  s.device = device;
  if (stream) s.stream = reinterpret_cast<cuda::CUstream>(*stream);
  return s;
}

// The environment's options with the caller's in their place, checked (std::invalid_argument).
DeviceTransferOptions TransferOptions(std::optional<size_t> slots,
                                      std::optional<uint64_t> slot_bytes,
                                      std::optional<size_t> max_rings) {
  DeviceTransferOptions o = DeviceTransferOptions::FromEnvironment();
  if (slots) o.ring.slots = *slots;
  if (slot_bytes) o.ring.slot_bytes = *slot_bytes;
  if (max_rings) o.max_rings = *max_rings;
  o.Validate();
  return o;
}

GilFreeHolder<DeviceTransfer> MakeTransfer(Engine& engine, std::optional<size_t> slots,
                                           std::optional<uint64_t> slot_bytes,
                                           std::optional<size_t> max_rings,
                                           const std::string& copier) {
  const DeviceTransferOptions o = TransferOptions(slots, slot_bytes, max_rings);
  if (copier == "cuda") return GilFreeHolder<DeviceTransfer>(new DeviceTransfer(engine, o));
  if (copier == "memcpy") {
    // Test seam: "device" addresses are host addresses, copies run on a thread of their own.
    PinnedPoolOptions pool;
    pool.budget_bytes = o.max_rings * o.ring.bytes();
    pool.register_with_cuda = false;
    return GilFreeHolder<DeviceTransfer>(new DeviceTransfer(
        engine, o,
        [](const DeviceSpan&) -> std::unique_ptr<DeviceCopier> {
          return std::make_unique<MemcpyCopier>();
        },
        pool));
  }
  throw std::invalid_argument(StrCat("copier must be 'cuda' or 'memcpy', not '", copier, "'"));
}

// `gds` as a GdsMode: 'off', 'auto' or 'on', or None for TENSORTIER_GDS (TypeError otherwise).
GdsMode GdsModeArgument(const py::object& gds) {
  if (gds.is_none()) return GdsModeFromEnvironment();
  if (!py::isinstance<py::str>(gds)) {
    throw py::type_error(
        StrCat("gds must be a str (or None for TENSORTIER_GDS), not ", TypeName(gds)));
  }
  return ParseGdsMode(gds.cast<std::string>());
}

// {slots, slot_bytes, max_rings, pinned_budget, pinned_bytes, pinned_registered} of `t`.
py::dict TransferOptionsDict(const DeviceTransfer& t) {
  py::dict d;
  d["slots"] = t.options().ring.slots;
  d["slot_bytes"] = t.options().ring.slot_bytes;
  d["max_rings"] = t.options().max_rings;
  const PinnedPool* pool = t.pool();
  d["pinned_budget"] = t.options().max_rings * t.options().ring.bytes();
  d["pinned_bytes"] = pool != nullptr ? pool->held_bytes() : 0;
  d["pinned_registered"] = pool != nullptr && pool->registers();
  return d;
}

// The OffloadDevice of a DiskOffloader (offload_device.hpp), with what keeps each operation's
// memory and stream alive until its wait. Called with the GIL held, under the Python offloader's
// lock; waits release it.
class PyOffloadDevice {
 public:
  PyOffloadDevice(Offloader& offloader, const std::string& gds, std::optional<size_t> max_rings,
                  const std::string& copier)
      : core_(new OffloadDevice(
            offloader, ParseGdsMode(gds),
            [max_rings, copier](Engine& e) {
              return std::unique_ptr<DeviceTransfer>(
                  MakeTransfer(e, std::nullopt, std::nullopt, max_rings, copier).release());
            })),
        every_tensor_(copier == "memcpy") {}

  // Per tensor, whether it takes the device path (CUDA tensors; all with the memcpy copier, for
  // tests without a GPU); the transfer is made first when one does (CudaError before anything).
  std::vector<bool> Route(const py::list& tensors) {
    std::vector<bool> device;
    for (const py::handle t : tensors) {
      device.push_back(every_tensor_ ||
                       t.attr("device").attr("type").cast<std::string>() == "cuda");
    }
    if (std::find(device.begin(), device.end(), true) != device.end()) core_->Transfer();
    return device;
  }

  // Starts moving the bytes of each key given a span (a DeviceBuffer; None: a host piece) between
  // device memory and the files ('write': to the files); the span stays referenced until wait()
  // collects it.
  void Submit(const std::string& kind, const std::vector<uint64_t>& keys, const py::list& spans) {
    const OffloadKind parsed = ParseOffloadKind(kind);
    for (size_t i = 0; i < keys.size(); ++i) {
      const py::object span = spans[i];
      if (span.is_none()) continue;
      const DeviceSpan memory =
          Span(span.attr("address").cast<uintptr_t>(), span.attr("device").cast<int>(),
               span.attr("stream").cast<std::optional<uintptr_t>>());
      const auto length = span.attr("nbytes").cast<uint64_t>();
      core_->Transfer();  // made with the GIL held: CudaError is raised as it is
      {
        GilReleased release;
        core_->Submit(parsed, keys[i], memory, length);
      }
      keep_[parsed == OffloadKind::kWrite ? 0 : 1].emplace(keys[i], span);
    }
  }

  // [(key, exception or None)]; Ctrl-C while waiting (when `interruptible`) leaves them all to
  // the next wait.
  py::list Wait(const std::string& kind, const std::optional<std::vector<uint64_t>>& keys,
                bool interruptible) {
    const OffloadKind parsed = ParseOffloadKind(kind);
    for (const DeviceJob& job : core_->Jobs(parsed, keys)) {
      WaitInterruptibly([&](auto timeout) { return job.WaitFor(timeout); }, interruptible);
    }
    std::vector<OffloadOutcome> outcomes;
    {
      GilReleased release;
      outcomes = core_->Wait(parsed, keys);
    }
    py::list out;
    for (const OffloadOutcome& r : outcomes) {
      out.append(py::make_tuple(r.key, r.error ? PythonError(r.error) : py::none()));
      keep_[parsed == OffloadKind::kWrite ? 0 : 1].erase(r.key);
    }
    return out;
  }

  OffloadDevice& core() { return *core_; }

  void Forget() {
    core_->Forget();
    for (auto& keep : keep_) keep.clear();
  }

 private:
  GilFreeHolder<OffloadDevice> core_;
  bool every_tensor_;
  std::multimap<uint64_t, py::object> keep_[2];  // writes, reads
};

// An IOHandle's CUDA route: its GDS mode, its bounce ring's options (checked when the handle is
// made), the transfer made for its first CUDA tensor, and each File's LazyDeviceFile (one cuFile
// registration per file; a closed file's entry goes at the next lookup). Called with the GIL
// held, which guards it; the transfer's work runs without it.
class DeviceRoute {
 public:
  DeviceRoute(const py::object& gds, const py::object& slots, const py::object& slot_bytes,
              const py::object& rings)
      : gds_(GdsModeArgument(gds)),
        slots_(PositiveArgument<size_t>(slots, "bounce_slots")),
        slot_bytes_(PositiveArgument<uint64_t>(slot_bytes, "bounce_slot_size")),
        rings_(PositiveArgument<size_t>(rings, "bounce_rings")) {
    // Resolved now (the TENSORTIER_BOUNCE_* variables too), used at the first CUDA transfer.
    const DeviceTransferOptions o = TransferOptions(slots_, slot_bytes_, rings_);
    slots_ = o.ring.slots;
    slot_bytes_ = o.ring.slot_bytes;
    rings_ = o.max_rings;
  }

  py::tuple RingOptions() const { return py::make_tuple(*slots_, *slot_bytes_, *rings_); }

  // The transfer of `engine`, made on first use (CudaError without a driver).
  DeviceTransfer& Transfer(const py::object& engine) {
    if (!transfer_) {
      transfer_ = MakeTransfer(engine.cast<Engine&>(), slots_, slot_bytes_, rings_, "cuda");
      engine_ = engine;
    }
    return *transfer_;
  }

  std::shared_ptr<LazyDeviceFile> FileOf(const py::object& file) {
    std::erase_if(files_, [](const auto& f) {
      const py::object live = f.first();
      return live.is_none() || !live.template cast<const File&>().is_open();
    });
    for (const auto& [ref, lazy] : files_) {
      if (ref().is(file)) return lazy;
    }
    files_.emplace_back(py::weakref(file),
                        std::make_shared<LazyDeviceFile>(file.cast<File>(), gds_));
    return files_.back().second;
  }

  bool Cached(const py::object& file) const {
    return std::any_of(files_.begin(), files_.end(),
                       [&](const auto& f) { return f.first().is(file); });
  }

  // Starts moving [address, address + length) of `device` on the transfer's job queue, ordered
  // on `stream`; the memory must stay alive until the job is over.
  DeviceJob Start(const py::object& engine, const std::string& op, uintptr_t address,
                  uint64_t length, int device, std::optional<uintptr_t> stream,
                  const py::object& file, uint64_t offset) {
    DeviceTransfer& t = Transfer(engine);
    const AnyFile target =
        gds_ == GdsMode::kOff ? AnyFile(file.cast<File>()) : AnyFile(FileOf(file));
    const DeviceSpan span = Span(address, device, stream);
    const bool read = op == "read";
    GilReleased release;
    return t.Submit([&t, target, offset, length, span, read] {
      return WithFile(target, [&](const auto& f) {
        return read ? t.Read(f, offset, length, span) : t.Write(span, length, f, offset);
      });
    });
  }

  py::dict Options() const {
    py::dict d;
    d["gds"] = GdsModeName(gds_);
    if (transfer_) d.attr("update")(TransferOptionsDict(*transfer_));
    return d;
  }

  GdsMode gds() const { return gds_; }

  size_t size() const { return files_.size(); }

  // Drops the transfer (its jobs must be over), the engine and the files.
  void Clear() {
    transfer_.reset();
    engine_ = py::object();
    files_.clear();
  }

 private:
  GdsMode gds_;
  std::optional<size_t> slots_;
  std::optional<uint64_t> slot_bytes_;
  std::optional<size_t> rings_;
  // The transfer's engine, kept alive as long as it (declared first: destroyed after it).
  py::object engine_;
  GilFreeHolder<DeviceTransfer> transfer_;
  std::vector<std::pair<py::weakref, std::shared_ptr<LazyDeviceFile>>> files_;
};

}  // namespace

void RegisterTransfer(py::module_& m) {
  m.def(
      "require_cuda_driver",
      [error = py::object(m.attr("CudaError"))](const std::string& what) {
        const CudaDriver* driver = nullptr;
        {
          GilReleased release;  // the first call dlopens the driver and runs cuInit
          driver = &CudaDriver::Get();
        }
        if (driver->available()) return;
        const std::string message = StrCat(
            what, " needs the CUDA driver, which is unavailable here: ", driver->why_unavailable(),
            " (install the NVIDIA driver, or set TENSORTIER_CUDA_LIBRARY to the path of "
            "libcuda.so.1)");
        PyErr_SetObject(error.ptr(), MessageToPython(message).ptr());
        throw py::error_already_set();
      },
      py::arg("what"), "CudaError, saying what `what` needs and why, unless the driver works.");
  m.def(
      "gds_mode", [](const py::object& gds) { return GdsModeName(GdsModeArgument(gds)); },
      py::arg("gds") = py::none(),
      "'off', 'auto' or 'on': `gds` spelled canonically, or TENSORTIER_GDS's value when None.");

  m.def(
      "cuda_driver",
      [] {
        const CudaDriver* driver = nullptr;
        {
          GilReleased release;  // the first call dlopens the driver and runs cuInit
          driver = &CudaDriver::Get();
        }
        const CudaDriver& d = *driver;
        py::dict out;
        out["available"] = d.available();
        out["why_unavailable"] = d.why_unavailable();
        out["library"] = d.library();
        out["version"] = d.version();
        out["device_count"] = d.device_count();
        return out;
      },
      "The CUDA driver as tensortier sees it (loaded with dlopen on first use).");
  m.def(
      "cufile",
      [] {
        const CuFile* c = nullptr;
        {
          GilReleased release;
          c = &CuFile::Get();
        }
        py::dict out;
        out["available"] = c->available();
        out["why_unavailable"] = c->why_unavailable();
        out["library"] = c->library();
        out["compat_mode_reason"] = c->compat_mode_reason();
        return out;
      },
      "cuFile (GPUDirect Storage) as tensortier sees it (loaded on first use); "
      "compat_mode_reason: why cuFile would not be GPUDirect here (no nvidia-fs driver).");
  m.def(
      "locate",
      [](uintptr_t address) {
        PointerLocation where;
        {
          GilReleased release;
          where = CudaDriver::Get().Locate(reinterpret_cast<const void*>(address));
        }
        py::dict out;
        out["type"] = std::string(MemoryTypeName(where.type));
        out["device"] = where.device;
        return out;
      },
      py::arg("address"), "Where memory lives: host, registered host, device or managed.");
  m.def(
      "pinned_host",
      [](uintptr_t address, size_t nbytes) {
        GilReleased release;
        return CudaDriver::Get().IsPinnedHost(reinterpret_cast<const void*>(address), nbytes);
      },
      py::arg("address"), py::arg("nbytes"),
      "Whether host memory [address, address + nbytes) is page-locked memory the CUDA driver "
      "knows, whoever pinned it; False without a driver.");

  py::class_<PinnedMemory, GilFreeHolder<PinnedMemory>>(m, "PinnedMemory", py::buffer_protocol())
      .def(py::init([](size_t size, int device) {
             GilReleased release;
             return GilFreeHolder<PinnedMemory>(new PinnedMemory(size, device));
           }),
           py::arg("size"), py::arg("device") = 0)
      .def("__len__", [](const PinnedMemory& p) { return p.memory.size(); })
      .def_property_readonly(
          "address",
          [](const PinnedMemory& p) { return reinterpret_cast<uintptr_t>(p.memory.data()); })
      .def_property_readonly("registered",
                             [](const PinnedMemory& p) { return p.registration.has_value(); })
      .def_buffer([](PinnedMemory& p) {
        return py::buffer_info(p.memory.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(p.memory.size())}, {1});
      });

  py::class_<CuFileBuffer, GilFreeHolder<CuFileBuffer>>(m, "CuFileBuffer")
      .def(py::init([](uintptr_t address, size_t length) {
             GilReleased release;
             return GilFreeHolder<CuFileBuffer>(
                 new CuFileBuffer(CuFile::Get(), reinterpret_cast<const void*>(address), length));
           }),
           py::arg("address"), py::arg("length"),
           "Registers memory with cuFile through its device's primary context (made current for "
           "the call); raises CuFileError when cuFile is unavailable or refuses it.")
      .def_property_readonly("device", &CuFileBuffer::device)
      .def_property_readonly(
          "address", [](const CuFileBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("length", &CuFileBuffer::size)
      .def(
          "release",
          [](CuFileBuffer& b) {
            GilReleased release;
            CuFileBuffer gone(std::move(b));
          },
          "Deregisters now (also done when the object is collected); idempotent.");

  py::class_<DeviceFile>(m, "DeviceFile")
      .def(py::init([](const File& file, const std::optional<std::string>& gds) {
             GdsMode mode = gds ? ParseGdsMode(*gds) : GdsModeFromEnvironment();
             GilReleased release;
             return DeviceFile(file, mode);
           }),
           py::arg("file"), py::arg("gds") = py::none(),
           "`gds`: 'off', 'auto' or 'on'; None for TENSORTIER_GDS (default off).")
      .def_property_readonly("file", &DeviceFile::file)
      .def_property_readonly("gds", &DeviceFile::gds)
      .def_property_readonly("gds_reason",
                             [](const DeviceFile& f) { return MessageToPython(f.gds_reason()); });

  m.def(
      "device_transfer_options",
      [](const py::object& slots, const py::object& slot_bytes, const py::object& max_rings) {
        const DeviceTransferOptions o =
            TransferOptions(PositiveArgument<size_t>(slots, "bounce_slots"),
                            PositiveArgument<uint64_t>(slot_bytes, "bounce_slot_size"),
                            PositiveArgument<size_t>(max_rings, "bounce_rings"));
        py::dict d;
        d["slots"] = o.ring.slots;
        d["slot_bytes"] = o.ring.slot_bytes;
        d["max_rings"] = o.max_rings;
        return d;
      },
      py::arg("slots") = py::none(), py::arg("slot_bytes") = py::none(),
      py::arg("max_rings") = py::none(),
      "The bounce ring options a DeviceTransfer made now would take (TENSORTIER_BOUNCE_* with "
      "the given ones in their place): {slots, slot_bytes, max_rings}. ValueError for a value "
      "its settings row refuses, so a handle refuses it when made, not at its first CUDA "
      "transfer.");

  py::class_<LazyDeviceFile, std::shared_ptr<LazyDeviceFile>>(m, "LazyDeviceFile")
      .def(py::init([](const File& file, const std::string& gds) {
             return std::make_shared<LazyDeviceFile>(file, ParseGdsMode(gds));
           }),
           py::arg("file"), py::arg("gds"),
           "`file` under GDS mode `gds` ('off', 'auto', 'on'), registered with cuFile by its first "
           "transfer, on the thread running it (a CuFileError is that transfer's error).")
      .def_property_readonly("file", &LazyDeviceFile::file);

  // A device job is waited for with the GIL released; its work is C++ only.
  py::class_<DeviceJob>(m, "DeviceJob")
      .def(py::init([](uint64_t bytes, const std::string& path, const std::string& gds_reason) {
             TransferResult r;
             r.bytes = bytes;
             r.path = path;
             r.gds_reason = gds_reason;
             return DeviceJob(std::move(r));
           }),
           py::arg("bytes"), py::arg("path"), py::arg("gds_reason") = "",
           "A job done already, with a result of `bytes` moved by `path` ('bounce' or 'gds').")
      .def("done", &DeviceJob::done, "Whether the job is over (never blocks).")
      .def(
          "wait",
          [](const DeviceJob& j, bool interruptible) {
            WaitInterruptibly([&](auto timeout) { return j.WaitFor(timeout); }, interruptible);
          },
          py::arg("interruptible") = true,
          "Waits until the job is over, without raising its error. Interruptible: Ctrl-C raises "
          "KeyboardInterrupt every 50 ms of waiting, the job going on.")
      .def(
          "result",
          [](const DeviceJob& j, bool interruptible) {
            WaitInterruptibly([&](auto timeout) { return j.WaitFor(timeout); }, interruptible);
            TransferResult r;
            {
              GilReleased release;
              r = j.Wait();
            }
            return ResultToDict(r);
          },
          py::arg("interruptible") = true,
          "Waits (as wait()) and returns {bytes, eof, stats}, or raises the job's error.")
      .def(
          "outcome",
          [](const DeviceJob& j) -> py::tuple {
            WaitInterruptibly([&](auto timeout) { return j.WaitFor(timeout); }, true);
            TransferResult r;
            try {
              GilReleased release;
              r = j.Wait();
            } catch (...) {
              return py::make_tuple(py::none(), PythonError(std::current_exception()));
            }
            // The job's outcome is applied already (an offloader's key stored or gone): an
            // error making the dict now (out of memory) must not read as the job's. Only the
            // stats are lost: None.
            try {
              return py::make_tuple(ResultToDict(r), py::none());
            } catch (const std::exception&) {
              return py::make_tuple(py::none(), py::none());
            }
          },
          "Waits (as wait()) and returns (result dict, None), or (None, the job's error); the "
          "dict is None when it could not be made.");

  // An IOHandle operation (operation.hpp): waited for with the GIL released, Ctrl-C interrupting
  // the wait (every 50 ms), never the operation.
  py::class_<Operation>(m, "Operation")
      .def(py::init([](std::optional<Future> host, std::vector<DeviceJob> jobs,
                       std::vector<bool> device_piece) {
             return Operation(host ? *host : Future(), std::move(jobs), std::move(device_piece));
           }),
           py::arg("host"), py::arg("jobs"), py::arg("device_piece"))
      .def("done", &Operation::done, "Whether every part is over (never blocks).")
      .def(
          "wait",
          [](const Operation& o, bool interruptible) {
            WaitInterruptibly([&](auto timeout) { return o.WaitFor(timeout); }, interruptible);
          },
          py::arg("interruptible") = true, "Waits until every part is over; raises nothing.")
      .def(
          "result",
          [](const Operation& o) {
            WaitInterruptibly([&](auto timeout) { return o.WaitFor(timeout); }, true);
            OperationResult r;
            {
              GilReleased release;
              r = o.Wait();
            }
            return OperationResultToDict(r);
          },
          "Waits, then returns {bytes, segment_bytes, stats} or raises the error (delivered).")
      .def(
          "take_undelivered_error",
          [](const Operation& o) -> py::object {
            WaitInterruptibly([&](auto timeout) { return o.WaitFor(timeout); }, true);
            std::exception_ptr error;
            {
              GilReleased release;
              error = o.TakeUndeliveredError();
            }
            return error ? PythonError(error) : py::none();
          },
          "Waits, then returns the error nobody was given yet (now given), else None.")
      .def("return_error", &Operation::ReturnError, "Undoes take_undelivered_error().")
      .def("has_undelivered_error", &Operation::HasUndeliveredError, py::call_guard<GilReleased>(),
           "For an operation that is over: whether its error is still to be given.");

  py::class_<DeviceTransfer, GilFreeHolder<DeviceTransfer>>(m, "DeviceTransfer")
      .def(py::init([](Engine& engine, std::optional<size_t> slots,
                       std::optional<uint64_t> slot_bytes, std::optional<size_t> max_rings,
                       const std::string& copier) {
             return MakeTransfer(engine, slots, slot_bytes, max_rings, copier);
           }),
           py::arg("engine"), py::arg("slots") = py::none(), py::arg("slot_bytes") = py::none(),
           py::arg("max_rings") = py::none(), py::arg("copier") = "cuda", py::keep_alive<1, 2>())
      .def(
          "read",
          [](DeviceTransfer& t, const AnyFile& file, uint64_t offset, uint64_t length,
             uintptr_t address, int device, std::optional<uintptr_t> stream) {
            DeviceSpan span = Span(address, device, stream);
            TransferResult r;
            {
              GilReleased release;
              r = WithFile(file, [&](const auto& f) { return t.Read(f, offset, length, span); });
            }
            return ResultToDict(r);
          },
          py::arg("file"), py::arg("offset"), py::arg("length"), py::arg("address"),
          py::arg("device") = 0, py::arg("stream") = py::none(),
          "Reads file bytes into device memory; returns {bytes, eof, stats}.")
      .def(
          "write",
          [](DeviceTransfer& t, uintptr_t address, uint64_t length, const AnyFile& file,
             uint64_t offset, int device, std::optional<uintptr_t> stream) {
            DeviceSpan span = Span(address, device, stream);
            TransferResult r;
            {
              GilReleased release;
              r = WithFile(file, [&](const auto& f) { return t.Write(span, length, f, offset); });
            }
            return ResultToDict(r);
          },
          py::arg("address"), py::arg("length"), py::arg("file"), py::arg("offset"),
          py::arg("device") = 0, py::arg("stream") = py::none(),
          "Writes device memory to the file; returns {bytes, eof, stats}.")
      .def(
          "read_async",
          [](DeviceTransfer& t, const AnyFile& file, uint64_t offset, uint64_t length,
             uintptr_t address, int device, std::optional<uintptr_t> stream) {
            DeviceSpan span = Span(address, device, stream);
            GilReleased release;
            return t.Submit([&t, file, offset, length, span] {
              return WithFile(file, [&](const auto& f) { return t.Read(f, offset, length, span); });
            });
          },
          py::arg("file"), py::arg("offset"), py::arg("length"), py::arg("address"),
          py::arg("device") = 0, py::arg("stream") = py::none(), py::keep_alive<0, 1>(),
          "read() on the transfer's job queue: returns a DeviceJob. The memory must stay alive "
          "until the job is over.")
      .def(
          "write_async",
          [](DeviceTransfer& t, uintptr_t address, uint64_t length, const AnyFile& file,
             uint64_t offset, int device, std::optional<uintptr_t> stream) {
            DeviceSpan span = Span(address, device, stream);
            GilReleased release;
            return t.Submit([&t, file, offset, length, span] {
              return WithFile(file,
                              [&](const auto& f) { return t.Write(span, length, f, offset); });
            });
          },
          py::arg("address"), py::arg("length"), py::arg("file"), py::arg("offset"),
          py::arg("device") = 0, py::arg("stream") = py::none(), py::keep_alive<0, 1>(),
          "write() on the transfer's job queue: returns a DeviceJob.")
      .def_property_readonly(
          "threads", [](const DeviceTransfer& t) { return t.options().max_rings; },
          "Threads of the job queue (one per ring).")
      .def_property_readonly("rings", &DeviceTransfer::rings)
      .def_property_readonly("options", &TransferOptionsDict);
  py::class_<DeviceRoute>(m, "DeviceRoute")
      .def(py::init<const py::object&, const py::object&, const py::object&, const py::object&>(),
           py::arg("gds"), py::arg("slots"), py::arg("slot_bytes"), py::arg("rings"),
           "An IOHandle's CUDA route: GDS mode `gds` (None: TENSORTIER_GDS) and its bounce ring's "
           "options (None: TENSORTIER_BOUNCE_*), checked now (ValueError).")
      .def("transfer", &DeviceRoute::Transfer, py::arg("engine"),
           py::return_value_policy::reference_internal,
           "The DeviceTransfer of `engine`, made on first use (CudaError without a driver).")
      .def("device_file", &DeviceRoute::FileOf, py::arg("file"),
           "The LazyDeviceFile of `file`, made once per File; closed files' entries go.")
      .def("start", &DeviceRoute::Start, py::arg("engine"), py::arg("op"), py::arg("address"),
           py::arg("nbytes"), py::arg("device"), py::arg("stream"), py::arg("file"),
           py::arg("offset"),
           "Starts a CUDA piece ('read' or 'write') on the transfer's job queue: a DeviceJob.")
      .def_property_readonly("gds", [](const DeviceRoute& r) { return GdsModeName(r.gds()); })
      .def_property_readonly("options", &DeviceRoute::Options,
                             "gds, and the bounce ring's settings once the transfer is made.")
      .def_property_readonly("ring_options", &DeviceRoute::RingOptions,
                             "(slots, slot_bytes, rings) of the bounce ring, resolved when made.")
      .def("__contains__", &DeviceRoute::Cached)
      .def("__len__", &DeviceRoute::size)
      .def("clear", &DeviceRoute::Clear, "Drops the transfer and the files (jobs over).");
  py::class_<PyOffloadDevice>(m, "OffloadDevice")
      .def(py::init<Offloader&, const std::string&, std::optional<size_t>, std::string>(),
           py::arg("offloader"), py::arg("gds"), py::arg("max_rings") = py::none(),
           py::arg("copier") = "cuda", py::keep_alive<1, 2>(),
           "DiskOffloader's device path under GDS mode `gds`; its transfer is made for the first "
           "device tensor, with `max_rings` (None: TENSORTIER_BOUNCE_RINGS) and `copier`.")
      .def("route", &PyOffloadDevice::Route, py::arg("tensors"),
           "Per tensor, whether it takes the device path; makes the transfer when one does.")
      .def("submit", &PyOffloadDevice::Submit, py::arg("kind"), py::arg("keys"), py::arg("spans"),
           "Starts moving the bytes of each key whose span (a DeviceBuffer) is not None "
           "('write': to the files); the span stays referenced until wait() collects it.")
      .def("wait", &PyOffloadDevice::Wait, py::arg("kind"), py::arg("keys") = py::none(),
           py::arg("interruptible") = true,
           "Waits for the device operations of `kind` (those moving `keys`), then the "
           "offloader's: [(key, exception or None)]; Ctrl-C (when `interruptible`) leaves them "
           "all to the next wait.")
      .def_property_readonly(
          "device_bytes", [](PyOffloadDevice& d) { return d.core().device_bytes(); },
          "Bytes of device tensors moved, by path ('gds', 'bounce').")
      .def_property_readonly(
          "transfer", [](PyOffloadDevice& d) { return d.core().transfer(); },
          py::return_value_policy::reference_internal, "The transfer, or None before one is made.")
      .def("forget", &PyOffloadDevice::Forget, "Lets go of the operations without waiting.")
      .def("close", [](PyOffloadDevice& d) { d.core().Close(); }, py::call_guard<GilReleased>());
}
