// tensortier._core, shared tensors: the group, its tensors and their memory regions. The store
// is a torch.distributed.Store (TorchStore): C++ calls it only from the thread that made the
// collective call, taking the GIL back for it; the partition server thread never touches Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding_helpers.hpp"
#include "distributed_tensor.hpp"
#include "gil.hpp"
#include "paths.hpp"
#include "tensortier/io/test_hooks.hpp"
#include "tensortier/shared/shared_exchange.hpp"
#include "tensortier/shared/shared_files.hpp"
#include "tensortier/shared/shared_store.hpp"
#include "tensortier/shared/shared_tensor.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

// The Store interface over a torch.distributed.Store, called (the GIL taken back) only from the
// thread that made the collective call. Failures are told apart by torch's exception types, never
// by their text: a store that vanished (DistNetworkError: the process hosting a TCPStore died or
// exited) is ECONNRESET naming `where` (ConnectionResetError in Python); a key that does not
// appear in time is ETIMEDOUT. FileStore's wait raises a plain RuntimeError on a timeout: that
// counts as one only once the time is up and the key is still absent. Anything else is EIO (an
// OSError keeps its errno).
class TorchStore : public Store {
 public:
  TorchStore(py::object store, std::string where)
      : store_(std::move(store)), where_(std::move(where)) {
    const std::string type = py::str(py::type::handle_of(store_).attr("__name__"));
    if (!py::isinstance(store_, py::module_::import("torch.distributed").attr("Store"))) {
      throw py::type_error(StrCat("store must be a torch.distributed.Store, not ", type));
    }
    if (where_.empty()) {  // the process serving it, named as well as the store tells
      py::object host = py::getattr(store_, "host", py::none());
      py::object port = py::getattr(store_, "port", py::none());
      where_ = StrCat("the process hosting the ", type);
      if (!host.is_none() && !port.is_none()) {
        where_ += StrCat(" at ", py::str(host).cast<std::string>(), ":",
                         py::str(port).cast<std::string>());
      }
    }
  }
  ~TorchStore() override {
    if (!Py_IsInitialized()) {
      store_.release();  // the interpreter is gone, and the object with it
      return;
    }
    WaitHereIfFinalizing();
    py::gil_scoped_acquire gil;
    store_ = py::object();
  }

  void Set(const std::string& key, const std::string& value) override {
    Call("set", key, [&] { store_.attr("set")(key, py::bytes(value)); });
  }

  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::optional<std::string> out;
    Call("get", key, [&] {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      py::module_ dist = py::module_::import("torch.distributed");
      py::list keys;
      keys.append(key);
      try {
        py::object wait =
            py::module_::import("datetime")
                .attr("timedelta")(py::arg("milliseconds") = std::max<int64_t>(timeout.count(), 1));
        store_.attr("wait")(keys, wait);
      } catch (py::error_already_set& e) {
        if (e.matches(dist.attr("DistNetworkError"))) throw;
        if (e.matches(dist.attr("DistStoreError"))) {  // TCPStore, HashStore: the wait timed out
          if (!store_.attr("check")(keys).cast<bool>()) return;
        } else if (!e.matches(PyExc_RuntimeError)) {
          throw;
        } else if (std::chrono::steady_clock::now() < deadline ||  // FileStore: no type of its own
                   store_.attr("check")(keys).cast<bool>()) {
          throw;
        } else {
          return;
        }
      }
      out = store_.attr("get")(key).cast<std::string>();
    });
    if (!out) ThrowIoError(ETIMEDOUT, StrCat("store get (waited ", timeout.count(), " ms)"), key);
    return *out;
  }

  int64_t Add(const std::string& key, int64_t delta) override {
    int64_t out = 0;
    Call("add", key, [&] { out = store_.attr("add")(key, delta).cast<int64_t>(); });
    return out;
  }

  void Delete(const std::string& key) override {
    Call("delete_key", key, [&] { store_.attr("delete_key")(key); });
  }

 private:
  // Runs `body` with the GIL held; its Python exceptions become IoError so they cross the C++
  // code, which runs with the GIL released, as plain C++ exceptions.
  template <typename Body>
  void Call(const char* name, const std::string& key, Body body) {
    std::string message;
    int code = EIO;
    {
      WaitHereIfFinalizing();
      py::gil_scoped_acquire gil;
      try {
        body();
        return;
      } catch (py::error_already_set& e) {
        message = e.what();
        if (e.matches(py::module_::import("torch.distributed").attr("DistNetworkError"))) {
          std::string text = py::str(e.value()).cast<std::string>();
          const size_t b = text.find_first_not_of(" \t\r\n");
          text = b == std::string::npos ? "" : text.substr(b);
          text = text.substr(0, text.find('\n'));
          const std::string type = py::str(e.type().attr("__name__")).cast<std::string>();
          code = ECONNRESET;
          message = StrCat("the store the processes meet through is gone: ", where_,
                           " died or exited (", type, ": ", text.empty() ? type : text, ")");
        } else if (e.matches(PyExc_OSError)) {
          py::object err = e.value().attr("errno");
          if (!err.is_none()) code = err.cast<int>();
          py::object text = e.value().attr("strerror");
          if (!text.is_none()) message = text.cast<std::string>();
        }
      }
    }
    ThrowIoError(code, StrCat("store ", name, ": ", message), key);
  }

  py::object store_;
  std::string where_;
};

// Bytes of a shared tensor's memory with the buffer protocol; holds the mappings alive.
struct SharedRegion {
  std::shared_ptr<void> hold;
  uint8_t* data = nullptr;
  uint64_t size = 0;
  bool device = false;  // device addresses: no buffer
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

// The group as the package holds it: closed once, for good; closing also closes the distributed
// tensors it made (their rows are not the C++ group's) and counts this rank out of a store it
// does not serve.
class BoundGroup : public SharedGroup {
 public:
  BoundGroup(std::shared_ptr<Store> store, int rank, int world_size,
             std::chrono::milliseconds timeout, bool hosts_store)
      : SharedGroup(std::move(store), rank, world_size, timeout), hosts_store_(hosts_store) {}
  // A group dropped without close() leaves as close() does, so that the rank serving the store
  // does not wait for it at exit. Not while the interpreter finalizes: the store is a Python
  // object (groups of more than one rank were closed before that, at exit).
  ~BoundGroup() {
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      CloseAll();
    } else {
      Close();
    }
  }
  BoundGroup(const BoundGroup&) = delete;
  BoundGroup& operator=(const BoundGroup&) = delete;

  void Require(const std::string& what) const {
    if (closed_)
      throw std::runtime_error(StrCat(what, ": the shared group was closed (finalized)"));
  }
  void Keep(const std::shared_ptr<DistributedTensor>& tensor) {
    std::lock_guard lock(mutex_);
    distributed_.push_back(tensor);
  }
  void CloseAll() {
    if (closed_.exchange(true)) return;
    std::vector<std::weak_ptr<DistributedTensor>> distributed;
    {
      std::lock_guard lock(mutex_);
      distributed.swap(distributed_);
    }
    for (const auto& weak : distributed) {
      if (auto t = weak.lock()) t->Close();
    }
    Close();
    // A child made by os.fork() holds a copy of the parent's group: closing it (its exit
    // included) frees the copy only, and tells the other ranks nothing.
    if (forked()) return;
    MarkClosed();
    if (!hosts_store_) CountOut();  // a store that is gone has nobody waiting
  }

 private:
  bool hosts_store_;
  std::atomic<bool> closed_ = false;
  std::mutex mutex_;
  std::vector<std::weak_ptr<DistributedTensor>> distributed_;
};

// The checks ahead of a SharedTensor method: RuntimeError once closed; for a collective call
// (`member`), ValueError in a process that attached the tensor from outside its group.
template <typename Tensor>
void RequireOpen(const Tensor& t, const std::string& what, bool member) {
  if (t.closed()) {
    throw std::runtime_error(StrCat(what, ": the shared tensor was closed (finalized)"));
  }
  if (member && t.rank() < 0) {
    throw py::value_error(StrCat(what, " is collective over the group that created ",
                                 PyRepr(t.spec().name),
                                 ": this process attached it from outside that group"));
  }
}

template <typename Tensor>
py::list RowRanges(const Tensor& t) {
  py::list out;
  for (const auto& p : t.partitions()) {
    out.append(py::make_tuple(p.row_begin, p.row_begin + p.rows));
  }
  return out;
}

template <typename Tensor>
py::list PartitionList(const Tensor& t) {
  py::list out;
  for (const auto& p : t.partitions()) out.append(PartitionTuple(p));
  return out;
}

// The ranks' parts of load_files, load_checkpoint and store_files on this rank's partition: the
// bytes move in C++. Raw row files' sizes are taken here (a test may shrink one meanwhile).
py::object ReadRowsInto(const SharedTensorSpec& spec, const SharedPartition& part, int device,
                        const std::string& what, const std::vector<FsPath>& files,
                        const std::optional<FsPath>& checkpoint, const std::string& key) {
  std::optional<IoStats> stats;
  try {
    GilReleased release;
    std::vector<RowSource> sources;
    for (const FsPath& path : files) {
      struct stat st{};
      if (::stat(path.bytes.c_str(), &st) != 0) ThrowIoError(errno, "stat", path.bytes);
      if (TestHooks* hooks = InstalledTestHooks()) hooks->FileSizeTaken(path.bytes);
      sources.push_back({path.bytes, 0, static_cast<uint64_t>(st.st_size)});
    }
    if (checkpoint) {
      std::string_view dtype = spec.dtype;
      if (dtype.rfind("torch.", 0) == 0) dtype.remove_prefix(6);
      const std::vector<uint64_t> shape(spec.shape.begin(), spec.shape.end());
      sources = {CheckpointRowSource(*checkpoint, key, dtype, shape)};
    }
    stats = ReadPartitionRows(sources, what, spec, part, device);
  } catch (const MissingTensorError& e) {
    throw py::key_error(e.what());
  }
  return stats ? py::object(IoStatsToDict(*stats)) : py::object(py::dict());
}

py::object WriteRowsOf(const SharedPartition& part, int world, int device, const FsPath& prefix) {
  std::vector<std::string> names;
  {
    GilReleased release;
    names = WritePartitionRows(prefix, world, part, device);
  }
  return PathsToPython(names);
}

// Adds the methods both kinds of tensor have, over their partitions: `device(t)` is the GPU of a
// device-memory tensor's partitions, else -1.
template <typename Tensor, typename Class, typename Device>
void DefRows(Class& c, Device device) {
  c.def_property_readonly("partitions", &PartitionList<Tensor>)
      .def_property_readonly("row_ranges", &RowRanges<Tensor>,
                             "Each rank's rows as (begin, end), in rank order.")
      .def("require", &RequireOpen<Tensor>, py::arg("what"), py::arg("member") = false,
           "RuntimeError once closed; ValueError for a collective call (member) in a process "
           "that attached the tensor from outside its group.")
      .def(
          "local_rank",
          [](const Tensor& t) {
            RequireOpen(t, "local", false);
            if (t.rank() < 0) {
              throw py::value_error(StrCat("shared tensor ", PyRepr(t.spec().name),
                                           " was attached from outside its group: it owns no "
                                           "rows here (use view(), gather() or scatter())"));
            }
            return t.rank();
          },
          "The rank whose rows local() sees: RuntimeError once closed; ValueError in a process "
          "that attached the tensor from outside its group.")
      .def(
          "read_rows",
          [device](const Tensor& t, const std::string& what, const py::object& paths,
                   const std::optional<FsPath>& checkpoint, const py::object& key) {
            if (!py::isinstance<py::str>(key)) {
              throw py::type_error(StrCat("key must be a str, not ",
                                          py::str(py::type::handle_of(key).attr("__name__"))));
            }
            std::vector<FsPath> files;  // one path (str, bytes, os.PathLike) or a sequence
            const bool one = py::isinstance<py::str>(paths) || py::isinstance<py::bytes>(paths) ||
                             py::hasattr(py::type::handle_of(paths), "__fspath__");
            for (const py::handle p : one ? py::list(py::make_tuple(paths)) : py::list(paths)) {
              files.push_back(FsPathArgument(p, "paths[i]").cast<FsPath>());
            }
            std::shared_ptr<void> hold = t.memory();
            return ReadRowsInto(t.spec(), t.partitions().at(t.rank()), device(t), what, files,
                                checkpoint, key.cast<std::string>());
          },
          py::arg("what"), py::arg("paths"), py::arg("checkpoint"), py::arg("key"),
          "Reads this rank's rows from raw row files `paths` (one, or a sequence) whose "
          "concatenation is the tensor, or from "
          "tensor `key` (TypeError unless a str) of a checkpoint (safetensors or torch.save, its "
          "pickle never run). "
          "Returns the engine's stats ({} when there is nothing to read). KeyError: no such "
          "tensor (the keys there are); ValueError: another shape or dtype, a shard index, "
          "sources of the wrong size; OSError.")
      .def(
          "write_rows",
          [device](const Tensor& t, const FsPath& prefix) {
            std::shared_ptr<void> hold = t.memory();
            return WriteRowsOf(t.partitions().at(t.rank()), static_cast<int>(t.partitions().size()),
                               device(t), prefix);
          },
          py::arg("prefix"),
          "Writes this rank's rows to {prefix}_part_{rank}_of_{world}, synced; every rank's name.")
      .def(
          "span",
          [device](const Tensor& t, int rank) {
            SharedRegion r;
            r.hold = t.memory();
            if (rank < 0) {
              r.data = t.data();
              r.size = t.spec().rows() * t.spec().row_bytes();
            } else {
              const SharedPartition& p = t.partitions().at(rank);
              if (p.address == nullptr && p.bytes > 0) {
                throw py::value_error(StrCat("this process does not map rank ", rank, "'s rows"));
              }
              r.data = p.address;
              r.size = p.bytes;
            }
            r.device = device(t) >= 0;
            return py::make_tuple(reinterpret_cast<uintptr_t>(r.data), r.size, r);
          },
          py::arg("rank"),
          "(address, bytes, keeper) of partition `rank`, or of the whole (continuous) tensor for "
          "-1: a device address for device memory; the memory stays mapped while `keeper` lives "
          "(for host memory, the bytes, with the buffer protocol).");
}

// A create_tensor shape: an int or a sequence of ints (anything with __index__), at least one
// dimension (its rows), none negative.
std::vector<int64_t> ShapeOf(const py::object& shape) {
  std::vector<int64_t> dims;
  try {
    if (PyObject* one = PyNumber_Index(shape.ptr())) {
      dims.push_back(py::reinterpret_steal<py::int_>(one).cast<int64_t>());
    } else {
      PyErr_Clear();
      for (const py::handle d : shape) {
        PyObject* dim = PyNumber_Index(d.ptr());
        if (dim == nullptr) throw py::error_already_set();
        dims.push_back(py::reinterpret_steal<py::int_>(dim).cast<int64_t>());
      }
    }
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_TypeError)) throw;
    throw py::type_error(StrCat("shape must be an int or a sequence of ints, not ",
                                py::repr(shape).cast<std::string>()));
  } catch (const py::cast_error&) {  // an int past int64_t
    throw py::value_error(StrCat("shape ", py::repr(shape).cast<std::string>(),
                                 " has a dimension too large for a tensor"));
  }
  if (dims.empty()) {
    throw py::value_error("a shared tensor needs at least one dimension (its rows)");
  }
  for (int64_t d : dims) {
    if (d < 0) throw py::value_error(StrCat("shape ", PyTuple(dims), " has a negative dimension"));
  }
  return dims;
}
}  // namespace

void RegisterShared(py::module_& m) {
  m.attr("shared_default_timeout_s") = std::chrono::duration<double>(kDefaultSharedTimeout).count();

  // The distributed layout's rounds: the bookkeeping here, the all-to-alls in Python (through
  // torch.distributed) over the exchange's buffers.
  py::class_<SharedRowExchange>(m, "SharedRowExchange")
      .def(py::init<std::vector<uint64_t>, int, uint64_t>(), py::arg("ends"), py::arg("rank"),
           py::arg("row_bytes"))
      .def(
          "route",
          [](SharedRowExchange& x, uintptr_t indices, size_t count, bool scatter, bool refused) {
            SharedRowExchange::Splits splits;
            {
              GilReleased release;
              splits = x.Route(reinterpret_cast<const int64_t*>(indices), count,
                               scatter ? SharedRowExchange::kScatter : SharedRowExchange::kGather,
                               refused);
            }
            return SplitsTuple(splits);
          },
          py::arg("indices"), py::arg("count"), py::arg("scatter"), py::arg("refused") = false,
          "Step 1 of a round: the requests for rows `indices`; (send splits, recv splits) in "
          "int64s of the buffers. refused: this rank's call was refused before its round (the "
          "others' read_requests then raise ValueError naming it).")
      .def("read_requests", &SharedRowExchange::ReadRequests, py::call_guard<GilReleased>(),
           "Step 2: True when an overflow all-to-all (late_splits) must run first. ValueError "
           "naming the ranks whose call was refused, else IndexError naming the ranks that "
           "passed an index out of range.")
      .def("late_splits", [](const SharedRowExchange& x) { return SplitsTuple(x.LateSplits()); })
      .def(
          "serve",
          [](SharedRowExchange& x, uintptr_t local, uintptr_t values) {
            SharedRowExchange::Splits splits;
            {
              GilReleased release;
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
            GilReleased release;
            x.Finish(reinterpret_cast<uint8_t*>(local), reinterpret_cast<uint8_t*>(out));
          },
          py::arg("local"), py::arg("out"), "Step 4: the rows received, written.")
      .def("send_buffer", [](const SharedRowExchange& x) { return BufferView(x.send_buffer()); })
      .def("recv_buffer", [](const SharedRowExchange& x) { return BufferView(x.recv_buffer()); });

  py::class_<Store, std::shared_ptr<Store>>(m, "SharedStore");
  py::class_<TorchStore, Store, std::shared_ptr<TorchStore>>(m, "SharedTorchStore")
      .def(py::init<py::object, std::string>(), py::arg("store"), py::arg("where") = "",
           "The store interface over a torch.distributed.Store; `where` names who serves it "
           "(for errors; by default, the process hosting the store, with its host and port).");

  py::class_<SharedRegion>(m, "SharedRegion", py::buffer_protocol())
      .def("__len__", [](const SharedRegion& r) { return r.size; })
      .def_property_readonly(
          "address", [](const SharedRegion& r) { return reinterpret_cast<uintptr_t>(r.data); })
      .def_property_readonly("__cuda_array_interface__",
                             [](const SharedRegion& r) {  // for torch.as_tensor on a GPU
                               py::dict d;
                               d["shape"] = py::make_tuple(r.size);
                               d["typestr"] = "|u1";
                               d["data"] =
                                   py::make_tuple(reinterpret_cast<uintptr_t>(r.data), false);
                               d["version"] = 3;
                               d["strides"] = py::none();
                               return d;
                             })
      .def_buffer([](SharedRegion& r) {
        if (r.device) throw py::value_error("device memory has no host buffer");
        return py::buffer_info(r.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(r.size)}, {1});
      });

  // The distributed layout: the same properties as SharedTensor's, over this rank's private rows.
  py::class_<DistributedTensor, std::shared_ptr<DistributedTensor>> distributed(
      m, "SharedDistributedTensor");
  DefRows<DistributedTensor>(distributed, [](const DistributedTensor&) { return -1; });
  distributed
      .def_property_readonly("name", [](const DistributedTensor& t) { return t.spec().name; })
      .def_property_readonly("shape", [](const DistributedTensor& t) { return t.spec().shape; })
      .def_property_readonly("layout", [](const DistributedTensor&) { return "distributed"; })
      .def_property_readonly("memory", [](const DistributedTensor&) { return "host"; })
      .def_property_readonly("row_bytes",
                             [](const DistributedTensor& t) { return t.spec().row_bytes(); })
      .def_property_readonly("rank", &DistributedTensor::rank)
      .def_property_readonly("closed", &DistributedTensor::closed)
      .def_property_readonly(
          "stats",
          [](const DistributedTensor& t) {
            const char* why = "distributed layout: private memory of each rank";
            py::dict d;
            d["local_bytes"] = t.closed() ? 0 : t.partitions().at(t.rank()).bytes;
            for (const char* key : {"huge_pages", "shmem_huge_pages", "cuda_registered"}) {
              d[key] = false;
              d[py::str(StrCat(key, "_reason"))] = why;
            }
            return d;
          })
      .def_property_readonly("exchange", &DistributedTensor::exchange,
                             py::return_value_policy::reference_internal)
      .def("close", &DistributedTensor::Close);

  py::class_<SharedTensor, std::shared_ptr<SharedTensor>> tensor(m, "SharedTensor");
  DefRows<SharedTensor>(tensor, [](const SharedTensor& t) {
    return t.spec().memory == SharedMemory::kDevice ? t.stats().device : -1;
  });
  tensor
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
      .def(
          "route",
          [](const SharedTensor& t, uintptr_t indices, size_t count, uintptr_t order) {
            std::vector<uint64_t> ends;
            for (const auto& p : t.partitions()) ends.push_back(p.row_begin + p.rows);
            const auto* idx = reinterpret_cast<const int64_t*>(indices);
            RowRoute route;
            {
              GilReleased release;
              route = RouteRows(idx, count, ends, reinterpret_cast<int64_t*>(order));
            }
            if (route.bad >= 0) {
              throw py::index_error(StrCat("index ", idx[route.bad],
                                           " is out of range for a shared tensor of ",
                                           t.spec().rows(), " rows"));
            }
            return route.counts;
          },
          py::arg("indices"), py::arg("count"), py::arg("order"),
          "Groups rows `indices` by the partition holding them: writes the stable order to "
          "`order` (count int64s) and returns each partition's count. IndexError for an index "
          "out of range.")
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
          "gather",
          [](const SharedTensor& t, uintptr_t indices, size_t count, uintptr_t out) {
            GilReleased release;
            t.Gather(reinterpret_cast<const int64_t*>(indices), count,
                     reinterpret_cast<void*>(out));
          },
          py::arg("indices"), py::arg("count"), py::arg("out"))
      .def(
          "scatter",
          [](SharedTensor& t, uintptr_t indices, size_t count, uintptr_t in) {
            GilReleased release;
            t.Scatter(reinterpret_cast<const int64_t*>(indices), count,
                      reinterpret_cast<const void*>(in));
          },
          py::arg("indices"), py::arg("count"), py::arg("values"))
      .def("close", &SharedTensor::Close);

  m.def(
      "shared_tensor_name_at",
      [](uintptr_t address) { return SharedTensorNameAt(reinterpret_cast<const void*>(address)); },
      py::arg("address"),
      "The name of the shared tensor whose host memory in this process holds `address`, or "
      "None.");

  m.def(
      "shared_attach",
      [](std::shared_ptr<Store> store, const std::string& name, double timeout_s) {
        auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
        GilReleased release;
        return AttachSharedTensor(*store, name, timeout);
      },
      py::arg("store"), py::arg("name"), py::arg("timeout_s"),
      "Maps the shared tensor some group created under `name` in `store`, from a process "
      "outside that group (rank -1: no local partition).");

  py::class_<BoundGroup>(m, "SharedGroup")
      .def(py::init([](std::shared_ptr<Store> store, int rank, int world_size, double timeout_s,
                       bool hosts_store) {
             auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
             GilReleased release;
             return std::make_unique<BoundGroup>(std::move(store), rank, world_size, timeout,
                                                 hosts_store);
           }),
           py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("timeout_s"),
           py::arg("hosts_store") = false)
      .def("require", &BoundGroup::Require, py::arg("what"),
           "RuntimeError '{what}: the shared group was closed (finalized)' once closed.")
      .def("require_rank", &SharedGroup::RequireRank, py::arg("what"),
           "RuntimeError in a child made by fork(), which holds a copy of the group and is not "
           "the rank: a collective call there would stand in for its parent's.")
      .def_property_readonly("rank", &SharedGroup::rank)
      .def_property_readonly("world_size", &SharedGroup::world_size)
      .def_property_readonly("socket_name", &SharedGroup::socket_name)
      .def_property_readonly("refused_peers", &SharedGroup::refused_peers)
      .def(
          "create",
          [](BoundGroup& g, const py::object& shape, const std::string& dtype,
             uint64_t element_size, const std::string& layout, const std::string& name,
             const std::string& memory, int device) {
            SharedTensorSpec spec;
            try {
              spec.shape = ShapeOf(shape);
              spec.dtype = dtype;
              spec.element_size = element_size;
              spec.layout = ParseSharedLayout(layout);
              spec.name = name;
              spec.memory = ParseSharedMemory(memory);
              if (spec.layout == SharedLayout::kDistributed) spec.Validate();
            } catch (const std::exception& e) {
              // Refused here, the call still takes part: the other ranks raise at once, naming
              // this one (Create does the same for what it refuses).
              const std::string why = e.what();
              {
                GilReleased release;
                g.Refuse("create_tensor", why);
              }
              throw;
            }
            std::shared_ptr<SharedTensor> shared;
            std::shared_ptr<DistributedTensor> distributed;
            {
              GilReleased release;
              if (spec.layout == SharedLayout::kDistributed) {  // rows in private memory
                g.Agree("create_tensor", spec.Describe());
                distributed = std::make_shared<DistributedTensor>(spec, g.rank(), g.world_size());
                g.Keep(distributed);
              } else {
                shared = g.Create(spec, device);
              }
            }
            return distributed ? py::cast(distributed) : py::cast(shared);
          },
          py::arg("shape"), py::arg("dtype"), py::arg("element_size"), py::arg("layout"),
          py::arg("name"), py::arg("memory") = "host", py::arg("device") = 0)
      .def("refuse", &SharedGroup::Refuse, py::arg("what"), py::arg("why"),
           py::call_guard<GilReleased>(),
           "Collective: takes part in the call `what` for a rank that refused it before it began; "
           "the others raise ValueError naming this rank and `why`. Never raises.")
      .def(
          "attach",
          [](BoundGroup& g, const std::string& name, int device) {
            g.Require("attach");
            return g.Attach(name, device);
          },
          py::arg("name"), py::arg("device") = 0, py::call_guard<GilReleased>())
      .def(
          "barrier",
          [](BoundGroup& g, const std::string& what) {
            g.Require(what);
            g.Barrier(what);
          },
          py::arg("what"), py::call_guard<GilReleased>())
      .def(
          "all_gather",
          [](BoundGroup& g, const std::string& what, const py::bytes& value) {
            std::string v = value;
            std::vector<std::string> all;
            {
              GilReleased release;
              all = g.AllGather(what, v);
            }
            py::list out;
            for (const auto& s : all) out.append(py::bytes(s));
            return out;
          },
          py::arg("what"), py::arg("value"))
      .def(
          "settle",
          [](BoundGroup& g, const std::string& what, const std::optional<std::string>& failure) {
            g.Require(what);
            GilReleased release;
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
          "Collective (RuntimeError once the group is closed): every rank says whether its step "
          "`what` worked (failure None) or why not. "
          "Returns on a rank that failed (it raises its own error); elsewhere returns when all "
          "worked, else raises RuntimeError naming each failing rank with its text.")
      .def("close", &BoundGroup::CloseAll, py::call_guard<GilReleased>(),
           "Closes the group and every tensor it made, and counts this rank out of the store "
           "unless it serves it (see shared_wait_for_leavers). Idempotent.")
      .def_property_readonly("leave_key", &SharedGroup::leave_key);
  m.def(
      "shared_wait_for_leavers",
      [](std::shared_ptr<Store> store, const std::string& leave_key, int world_size,
         double timeout_s) {
        // In slices, with the signal handlers run between them: Ctrl-C while a dead rank is
        // waited for ends the wait (KeyboardInterrupt) rather than being held until the timeout,
        // and the waits of the process's other groups after it (one Ctrl-C ends them all).
        static std::atomic<bool> interrupted{false};
        if (interrupted) return;
        constexpr auto kSlice = std::chrono::milliseconds(200);
        const auto deadline = std::chrono::steady_clock::now() +
                              std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
        for (;;) {
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
              deadline - std::chrono::steady_clock::now());
          if (left.count() <= 0) return;
          bool done = false;
          {
            GilReleased release;
            done = SharedGroup::WaitForOthersToLeave(*store, leave_key, world_size,
                                                     std::min(left, kSlice));
          }
          if (done) return;
          if (PyErr_CheckSignals() != 0) {
            interrupted = true;
            throw py::error_already_set();
          }
        }
      },
      py::arg("store"), py::arg("leave_key"), py::arg("world_size"), py::arg("timeout_s"),
      "At exit of the rank serving a group's store: waits (at most timeout_s: a dead rank never "
      "counts itself out) until the other ranks have counted themselves out. Raises only what a "
      "signal handler raises meanwhile (KeyboardInterrupt on Ctrl-C ends the wait).");
}
