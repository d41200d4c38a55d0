// tensortier._core, shared tensors: the group, its tensors and their memory regions. The store
// is a Python object (a torch.distributed.Store behind an adapter in python/tensortier/shared.py):
// C++ calls it only from the thread that made the collective call, taking the GIL back for it;
// the partition server thread never touches Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding_helpers.hpp"
#include "paths.hpp"
#include "tensortier/shared/shared_exchange.hpp"
#include "tensortier/shared/shared_files.hpp"
#include "tensortier/shared/shared_store.hpp"
#include "tensortier/shared/shared_tensor.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

// A Store whose methods a Python subclass implements: set(key, value: bytes), get(key,
// timeout_ms) -> bytes or None on timeout, add(key, delta) -> int.
class PyStore : public Store {
 public:
  void Set(const std::string& key, const std::string& value) override {
    Call("set", key, [&](const py::function& f) { f(key, py::bytes(value)); });
  }

  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::string out;
    bool found = false;
    Call("get", key, [&](const py::function& f) {
      py::object v = f(key, static_cast<int64_t>(timeout.count()));
      if (!v.is_none()) {
        out = v.cast<std::string>();
        found = true;
      }
    });
    if (!found) ThrowIoError(ETIMEDOUT, StrCat("store get (waited ", timeout.count(), " ms)"), key);
    return out;
  }

  int64_t Add(const std::string& key, int64_t delta) override {
    int64_t out = 0;
    Call("add", key, [&](const py::function& f) { out = f(key, delta).cast<int64_t>(); });
    return out;
  }

 private:
  // Runs the Python method `name` with the GIL held; its exceptions become IoError so they
  // cross the C++ code, which runs with the GIL released, as plain C++ exceptions: an OSError
  // keeps its errno (a store that vanished stays a ConnectionResetError), anything else is EIO.
  template <typename Body>
  void Call(const char* name, const std::string& key, Body body) {
    std::string message;
    int code = EIO;
    {
      py::gil_scoped_acquire gil;
      py::function f = py::get_override(static_cast<const Store*>(this), name);
      if (!f) throw std::logic_error(StrCat("the store adapter does not implement ", name, "()"));
      try {
        body(f);
        return;
      } catch (py::error_already_set& e) {
        message = e.what();
        if (e.matches(PyExc_OSError)) {
          py::object err = e.value().attr("errno");
          if (!err.is_none()) code = err.cast<int>();
          py::object text = e.value().attr("strerror");
          if (!text.is_none()) message = text.cast<std::string>();
        }
      }
    }
    ThrowIoError(code, StrCat("store ", name, ": ", message), key);
  }
};

// Bytes of a shared tensor's memory with the buffer protocol; holds the mappings alive.
struct SharedRegion {
  std::shared_ptr<void> hold;
  uint8_t* data = nullptr;
  uint64_t size = 0;
};

// Keeps a device-memory shared tensor's mappings alive while a CUDA view of them lives.
struct SharedDeviceKeeper {
  std::shared_ptr<void> hold;
};

py::tuple SplitsTuple(const SharedRowExchange::Splits& splits) {
  return py::make_tuple(splits.send, splits.recv);
}

// The exchange's buffer as writable bytes; valid until its next step.
py::memoryview BufferView(const SharedRowExchange::Buffer& b) {
  static uint8_t none = 0;
  return py::memoryview::from_memory(b.bytes == 0 ? &none : b.data, static_cast<ssize_t>(b.bytes));
}

py::tuple PartitionTuple(const SharedPartition& p) {
  return py::make_tuple(p.rank, p.row_begin, p.rows, p.bytes,
                        reinterpret_cast<uintptr_t>(p.address));
}

}  // namespace

void RegisterShared(py::module_& m) {
  m.attr("shared_default_timeout_s") = std::chrono::duration<double>(kDefaultSharedTimeout).count();

  m.def(
      "partition_rows",
      [](uint64_t rows, uint64_t row_bytes, int world_size) {
        py::list out;
        for (const auto& p : PartitionRows(rows, row_bytes, world_size, 1)) {
          out.append(py::make_tuple(p.row_begin, p.row_begin + p.rows));
        }
        return out;
      },
      py::arg("rows"), py::arg("row_bytes"), py::arg("world_size"),
      "Each rank's rows [begin, end) of a tensor whose partitions are not mapped together.");

  // The ranks' parts of load_files, load_checkpoint and store_files: the bytes move in C++.
  m.def(
      "shared_read_rows",
      [](const std::string& what, const std::vector<std::pair<FsPath, uint64_t>>& files,
         std::optional<FsPath> checkpoint, const std::string& key, const std::string& dtype,
         uint64_t element_size, const std::vector<uint64_t>& shape, uint64_t begin, uint64_t end,
         uintptr_t dest) -> py::object {
        std::optional<IoStats> stats;
        try {
          py::gil_scoped_release release;
          std::vector<RowSource> sources;
          for (const auto& [path, size] : files) sources.push_back({path.bytes, 0, size});
          if (checkpoint) sources = {CheckpointRowSource(*checkpoint, key, dtype, shape)};
          stats = ReadRows(sources, what, dtype, element_size, shape, begin, end,
                           reinterpret_cast<void*>(dest));
        } catch (const MissingTensorError& e) {
          throw py::key_error(e.what());
        }
        return stats ? py::object(IoStatsToDict(*stats)) : py::object(py::dict());
      },
      py::arg("what"), py::arg("files"), py::arg("checkpoint"), py::arg("key"), py::arg("dtype"),
      py::arg("element_size"), py::arg("shape"), py::arg("begin"), py::arg("end"), py::arg("dest"),
      "Reads rows [begin, end) of a tensor (torch dtype name, element size, shape) into host "
      "memory at dest: from raw row files ((path, size) each) whose concatenation is the tensor, "
      "or from tensor key "
      "of a checkpoint (safetensors or torch.save, its pickle never run). Returns the engine's "
      "stats ({} when there is nothing to read). KeyError: no such tensor (the keys there are); "
      "ValueError: another shape or dtype, a shard index, sources of the wrong size; OSError.");
  m.def(
      "shared_write_rows",
      [](const FsPath& prefix, int rank, int world, uintptr_t data, uint64_t nbytes,
         uint64_t offset, bool last) {
        std::vector<std::string> names;
        {
          py::gil_scoped_release release;
          names = WriteRowFile(prefix, rank, world, reinterpret_cast<const void*>(data), nbytes,
                               offset, last);
        }
        return PathsToPython(names);
      },
      py::arg("prefix"), py::arg("rank"), py::arg("world"), py::arg("data"), py::arg("nbytes"),
      py::arg("offset") = 0, py::arg("last") = true,
      "Writes nbytes at data to {prefix}_part_{rank}_of_{world} at offset (0 replaces the file), "
      "synced when last; every rank's name.");
  // The distributed layout's rounds: the bookkeeping here, the all-to-alls in Python (through
  // torch.distributed) over the exchange's buffers.
  py::class_<SharedRowExchange>(m, "SharedRowExchange")
      .def(py::init<std::vector<uint64_t>, int, uint64_t>(), py::arg("ends"), py::arg("rank"),
           py::arg("row_bytes"))
      .def(
          "route",
          [](SharedRowExchange& x, uintptr_t indices, size_t count, bool scatter) {
            SharedRowExchange::Splits splits;
            {
              py::gil_scoped_release release;
              splits = x.Route(reinterpret_cast<const int64_t*>(indices), count,
                               scatter ? SharedRowExchange::kScatter : SharedRowExchange::kGather);
            }
            return SplitsTuple(splits);
          },
          py::arg("indices"), py::arg("count"), py::arg("scatter"),
          "Step 1 of a round: the requests for rows `indices`; (send splits, recv splits) in "
          "int64s of the buffers.")
      .def("read_requests", &SharedRowExchange::ReadRequests,
           py::call_guard<py::gil_scoped_release>(),
           "Step 2: True when an overflow all-to-all (late_splits) must run first. IndexError "
           "naming the ranks that passed an index out of range.")
      .def("late_splits", [](const SharedRowExchange& x) { return SplitsTuple(x.LateSplits()); })
      .def(
          "serve",
          [](SharedRowExchange& x, uintptr_t local, uintptr_t values) {
            SharedRowExchange::Splits splits;
            {
              py::gil_scoped_release release;
              splits = x.Serve(reinterpret_cast<const uint8_t*>(local),
                               reinterpret_cast<const uint8_t*>(values));
            }
            return SplitsTuple(splits);
          },
          py::arg("local"), py::arg("values"),
          "Step 3: the rows this rank sends; (send splits, recv splits) in rows.")
      .def(
          "finish",
          [](SharedRowExchange& x, uintptr_t local, uintptr_t out) {
            py::gil_scoped_release release;
            x.Finish(reinterpret_cast<uint8_t*>(local), reinterpret_cast<uint8_t*>(out));
          },
          py::arg("local"), py::arg("out"), "Step 4: the rows received, written.")
      .def("send_buffer", [](const SharedRowExchange& x) { return BufferView(x.send_buffer()); })
      .def("recv_buffer", [](const SharedRowExchange& x) { return BufferView(x.recv_buffer()); });

  py::class_<Store, PyStore, std::shared_ptr<Store>>(m, "SharedStore").def(py::init<>());

  py::class_<SharedRegion>(m, "SharedRegion", py::buffer_protocol())
      .def("__len__", [](const SharedRegion& r) { return r.size; })
      .def_property_readonly(
          "address", [](const SharedRegion& r) { return reinterpret_cast<uintptr_t>(r.data); })
      .def_buffer([](SharedRegion& r) {
        return py::buffer_info(r.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(r.size)}, {1});
      });

  py::class_<SharedDeviceKeeper>(m, "SharedDeviceKeeper");

  py::class_<SharedTensor, std::shared_ptr<SharedTensor>>(m, "SharedTensor")
      .def_property_readonly("describe", [](const SharedTensor& t) { return t.spec().Describe(); })
      .def_property_readonly("name", [](const SharedTensor& t) { return t.spec().name; })
      .def_property_readonly("dtype", [](const SharedTensor& t) { return t.spec().dtype; })
      .def_property_readonly("shape", [](const SharedTensor& t) { return t.spec().shape; })
      .def_property_readonly(
          "layout", [](const SharedTensor& t) { return SharedLayoutName(t.spec().layout); })
      .def_property_readonly(
          "memory", [](const SharedTensor& t) { return SharedMemoryName(t.spec().memory); })
      .def_property_readonly("element_size",
                             [](const SharedTensor& t) { return t.spec().element_size; })
      .def_property_readonly("row_bytes",
                             [](const SharedTensor& t) { return t.spec().row_bytes(); })
      .def_property_readonly("rank", &SharedTensor::rank)
      .def_property_readonly("partitions",
                             [](const SharedTensor& t) {
                               py::list out;
                               for (const auto& p : t.partitions()) out.append(PartitionTuple(p));
                               return out;
                             })
      .def_property_readonly("stats",
                             [](const SharedTensor& t) {
                               py::dict d;
                               d["local_bytes"] = t.stats().local_bytes;
                               d["huge_pages"] = t.stats().huge_pages;
                               d["huge_pages_reason"] = t.stats().huge_pages_reason;
                               d["cuda_registered"] = t.stats().cuda_registered;
                               d["cuda_registered_reason"] = t.stats().cuda_registered_reason;
                               if (t.spec().memory == SharedMemory::kDevice) {
                                 d["device"] = t.stats().device;
                                 d["granularity"] = t.stats().granularity;
                               }
                               d["shmem_huge_pages"] = t.stats().shmem_huge_pages;
                               d["shmem_huge_pages_reason"] = t.stats().shmem_huge_pages_reason;
                               return d;
                             })
      .def_property_readonly("closed", &SharedTensor::closed)
      .def(
          "region",
          [](const SharedTensor& t, int rank) {
            if (t.spec().memory == SharedMemory::kDevice) {
              throw py::value_error("a device-memory shared tensor has no host buffer");
            }
            SharedRegion r;
            r.hold = t.memory();
            if (rank < 0) {
              r.data = t.data();
              r.size = t.spec().rows() * t.spec().row_bytes();
            } else {
              const SharedPartition& p = t.partitions().at(rank);
              r.data = p.address;
              r.size = p.bytes;
            }
            return r;
          },
          py::arg("rank"),
          "The memory of partition `rank`, or of the whole (continuous) tensor for -1.")
      .def(
          "device_region",
          [](const SharedTensor& t, int rank) {
            if (t.spec().memory != SharedMemory::kDevice) {
              throw py::value_error("a host-memory shared tensor has no device addresses");
            }
            std::shared_ptr<void> hold = t.memory();
            uint8_t* data = rank < 0 ? t.data() : t.partitions().at(rank).address;
            uint64_t size =
                rank < 0 ? t.spec().rows() * t.spec().row_bytes() : t.partitions().at(rank).bytes;
            return py::make_tuple(reinterpret_cast<uintptr_t>(data), size,
                                  SharedDeviceKeeper{std::move(hold)});
          },
          py::arg("rank"),
          "(device address, bytes, keeper) of partition `rank`, or of the whole (continuous) "
          "tensor for -1; the mapping stays while `keeper` lives.")
      .def(
          "gather",
          [](const SharedTensor& t, uintptr_t indices, size_t count, uintptr_t out) {
            py::gil_scoped_release release;
            t.Gather(reinterpret_cast<const int64_t*>(indices), count,
                     reinterpret_cast<void*>(out));
          },
          py::arg("indices"), py::arg("count"), py::arg("out"))
      .def(
          "scatter",
          [](SharedTensor& t, uintptr_t indices, size_t count, uintptr_t in) {
            py::gil_scoped_release release;
            t.Scatter(reinterpret_cast<const int64_t*>(indices), count,
                      reinterpret_cast<const void*>(in));
          },
          py::arg("indices"), py::arg("count"), py::arg("values"))
      .def("close", &SharedTensor::Close);

  m.def(
      "shared_attach",
      [](std::shared_ptr<Store> store, const std::string& name, double timeout_s) {
        auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
        py::gil_scoped_release release;
        return AttachSharedTensor(*store, name, timeout);
      },
      py::arg("store"), py::arg("name"), py::arg("timeout_s"),
      "Maps the shared tensor some group created under `name` in `store`, from a process "
      "outside that group (rank -1: no local partition).");

  py::class_<SharedGroup>(m, "SharedGroup")
      .def(py::init([](std::shared_ptr<Store> store, int rank, int world_size, double timeout_s) {
             auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
             py::gil_scoped_release release;
             return std::make_unique<SharedGroup>(std::move(store), rank, world_size, timeout);
           }),
           py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("timeout_s"))
      .def_property_readonly("rank", &SharedGroup::rank)
      .def_property_readonly("world_size", &SharedGroup::world_size)
      .def_property_readonly("socket_name", &SharedGroup::socket_name)
      .def_property_readonly("refused_peers", &SharedGroup::refused_peers)
      .def(
          "create",
          [](SharedGroup& g, const std::vector<int64_t>& shape, const std::string& dtype,
             uint64_t element_size, const std::string& layout, const std::string& name,
             const std::string& memory, int device) {
            SharedTensorSpec spec;
            spec.shape = shape;
            spec.dtype = dtype;
            spec.element_size = element_size;
            spec.layout = ParseSharedLayout(layout);
            spec.name = name;
            spec.memory = ParseSharedMemory(memory);
            py::gil_scoped_release release;
            return g.Create(spec, device);
          },
          py::arg("shape"), py::arg("dtype"), py::arg("element_size"), py::arg("layout"),
          py::arg("name"), py::arg("memory") = "host", py::arg("device") = 0)
      .def(
          "agree",
          [](SharedGroup& g, const std::vector<int64_t>& shape, const std::string& dtype,
             uint64_t element_size, const std::string& layout, const std::string& name) {
            SharedTensorSpec spec;
            spec.shape = shape;
            spec.dtype = dtype;
            spec.element_size = element_size;
            spec.layout = ParseSharedLayout(layout);
            spec.name = name;
            py::gil_scoped_release release;
            g.Agree("create_tensor", spec.Describe());
          },
          py::arg("shape"), py::arg("dtype"), py::arg("element_size"), py::arg("layout"),
          py::arg("name"), "Collective: ValueError on every rank unless all ask for this tensor.")
      .def("attach", &SharedGroup::Attach, py::arg("name"), py::arg("device") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("barrier", &SharedGroup::Barrier, py::arg("what"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "all_gather",
          [](SharedGroup& g, const std::string& what, const py::bytes& value) {
            std::string v = value;
            std::vector<std::string> all;
            {
              py::gil_scoped_release release;
              all = g.AllGather(what, v);
            }
            py::list out;
            for (const auto& s : all) out.append(py::bytes(s));
            return out;
          },
          py::arg("what"), py::arg("value"))
      .def(
          "settle",
          [](SharedGroup& g, const std::string& what, const std::optional<std::string>& failure) {
            py::gil_scoped_release release;
            if (!failure) {
              g.Settle(what, nullptr);
              return;
            }
            try {
              g.Settle(what, std::make_exception_ptr(std::runtime_error(*failure)));
            } catch (const std::runtime_error&) {
              // This rank's own failure given back: the caller raises its own exception.
            }
          },
          py::arg("what"), py::arg("failure"),
          "Collective: every rank says whether its step `what` worked (failure None) or why not. "
          "Returns on a rank that failed (it raises its own error); elsewhere returns when all "
          "worked, else raises RuntimeError naming each failing rank with its text.")
      .def("close", &SharedGroup::Close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("leave_key", &SharedGroup::leave_key)
      .def("count_out", &SharedGroup::CountOut, py::call_guard<py::gil_scoped_release>(),
           "Counts this rank out of the store the group met through (see "
           "shared_wait_for_leavers); never raises.");
  m.def(
      "shared_wait_for_leavers",
      [](std::shared_ptr<Store> store, const std::string& leave_key, int world_size,
         double timeout_s) {
        auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
        py::gil_scoped_release release;
        SharedGroup::WaitForOthersToLeave(*store, leave_key, world_size, timeout);
      },
      py::arg("store"), py::arg("leave_key"), py::arg("world_size"), py::arg("timeout_s"),
      "At exit of the rank serving a group's store: waits (at most timeout_s: a dead rank never "
      "counts itself out) until the other ranks have counted themselves out; never raises.");
}
