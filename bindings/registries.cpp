// The buffer registries of the compatibility APIs, by address:
//   LockedTensors: DeepSpeed's pinned-tensor manager (one per process): the locked host tensors
//     made by its handles, each as its size, a weak reference to its storage and the operations
//     started on its memory (freeing it waits for them, then shrinks the storage).
//   CuFileRegistrations: device memory registered with cuFile (torch.cuda.gds's
//     gds_register_buffer, DeepNVMe's pin_device_tensor), each with what keeps the memory alive.
//   TensorGroups: the tensors of each write call of TensorNVMe's DiskOffloader, keyed as
//     TensorNVMe keys them (one tensor by its id, a vector by the tuple of its ids), weakly.
//   GdsFileState: torch.cuda.gds's GdsFile but for taking its storages apart: the file (opened as
//     os.open would), its cuFile handle registered or not (torch's register_handle /
//     deregister_handle, with torch's messages), the DeviceFile made on first use, dropped on
//     deregistration and close, and the transfers (torch's cuFileRead/cuFileWrite errors).
// Both are called with the GIL held; cuFile's calls run with it released, under the registry's
// own lock (never waited for with the GIL held by its holder).
#include <fcntl.h>
#include <pybind11/pybind11.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "binding_helpers.hpp"
#include "gil.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/cuda/cufile.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/transfer/operation.hpp"
#include "tensortier/transfer/transfer.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

class LockedTensors {
 public:
  void Add(uintptr_t address, size_t nbytes, const py::object& storage) {
    tensors_.insert_or_assign(address, Locked{nbytes, py::weakref(storage), {}});
  }

  // Records `op`, started on [address, address + nbytes), on the locked tensor it starts in.
  void Track(uintptr_t address, size_t nbytes, const Operation& op) {
    auto it = tensors_.upper_bound(address);
    if (nbytes == 0 || it == tensors_.begin()) return;
    --it;
    if (address >= it->first + it->second.nbytes) return;
    std::erase_if(it->second.busy, Over);
    it->second.busy.push_back({getpid(), op});
  }

  // The live storage of the tensor at `address`, taken out of the registry once every operation
  // started on its memory is over (DeepSpeed frees it at once, under a read still writing into
  // it); None when there is none. A zero-byte one only when `storage` is it: such tensors may
  // share an address. Ctrl-C interrupts the wait, leaving the tensor registered.
  py::object Take(uintptr_t address, const py::object& storage) {
    for (;;) {
      const auto it = tensors_.find(address);
      if (it == tensors_.end()) return py::none();
      py::object live = it->second.storage();
      if (live.is_none() || (it->second.nbytes == 0 && !live.is(storage))) return py::none();
      std::erase_if(it->second.busy, Over);
      if (it->second.busy.empty()) {
        tensors_.erase(it);
        return live;
      }
      const Operation op = it->second.busy.front().op;  // the GIL goes: look again after it
      WaitInterruptibly([&](auto timeout) { return op.WaitFor(timeout); }, true);
    }
  }

  // Frees the live tensor at `address` once `Take` has it: its storage shrinks to nothing where
  // torch allows (pinned storages do; page-aligned memory goes with its last reference). A
  // zero-byte one only through `tensor`, a view of it. False, and nothing freed, when there is
  // none.
  bool Free(uintptr_t address, const py::object& tensor) {
    const py::object storage =
        Take(address, tensor.is_none() ? tensor : tensor.attr("untyped_storage")());
    if (storage.is_none()) return false;
    if (storage.attr("resizable")().cast<bool>()) storage.attr("resize_")(0);
    return true;
  }

  // Whether [address, address + nbytes) is locked host memory: in one live tensor here, or
  // (asked of the CUDA driver, where one is loaded) page-locked with CUDA by anyone.
  bool Pinned(uintptr_t address, size_t nbytes) {
    if (Covers(address, nbytes)) return true;
    GilReleased release;
    try {
      return CudaDriver::Get().IsPinnedHost(reinterpret_cast<const void*>(address), nbytes);
    } catch (const std::exception&) {  // a driver that cannot answer: not pinned, as DeepNVMe
      return false;
    }
  }

  // Whether [address, address + nbytes) lies in one live tensor; forgets the dead ones.
  bool Covers(uintptr_t address, size_t nbytes) {
    bool covered = false;
    for (auto it = tensors_.begin(); it != tensors_.end();) {
      if (it->second.storage().is_none()) {
        it = tensors_.erase(it);
        continue;
      }
      const uintptr_t end = it->first + it->second.nbytes;
      covered = covered || (it->first <= address && address + nbytes <= end);
      ++it;
    }
    return covered;
  }

 private:
  struct Busy {
    pid_t pid;  // the process that started it
    Operation op;
  };
  struct Locked {
    size_t nbytes;
    py::weakref storage;
    std::vector<Busy> busy;  // started on its memory, maybe not over
  };
  // Over, or started by the parent of a child made by fork: its threads are not in the child,
  // which has a copy of the memory of its own (waiting for it would never end).
  static bool Over(const Busy& b) { return b.pid != getpid() || b.op.done(); }
  std::map<uintptr_t, Locked> tensors_;
};

class CuFileRegistrations {
 public:
  // Registers [address, address + nbytes) with cuFile unless it is already, or nothing would
  // DMA into registered memory (no bytes, cuFile unavailable or in its compatibility mode);
  // `keep` stays referenced while it is. Throws CuFileError when cuFile refuses the memory.
  void Add(uintptr_t address, size_t nbytes, const py::object& keep) {
    {
      GilReleased release;
      std::lock_guard lock(mu_);
      if (buffers_.contains(address)) return;
      const CuFile& cufile = CuFile::Get();
      if (nbytes == 0 || !cufile.available() || !cufile.compat_mode_reason().empty()) return;
      auto buffer =
          std::make_unique<CuFileBuffer>(cufile, reinterpret_cast<const void*>(address), nbytes);
      buffers_.emplace(address, Registered{std::move(buffer), py::object()});
    }
    std::lock_guard lock(mu_);
    if (const auto it = buffers_.find(address); it != buffers_.end()) it->second.keep = keep;
  }

  // Deregisters the memory at `address` now (nothing when it is not registered).
  void Remove(uintptr_t address) {
    Registered gone;
    {
      std::lock_guard lock(mu_);
      const auto it = buffers_.find(address);
      if (it == buffers_.end()) return;
      gone = std::move(it->second);
      buffers_.erase(it);
    }
    GilReleased release;
    gone.buffer.reset();
  }

  void Clear() {
    std::map<uintptr_t, Registered> gone;
    {
      std::lock_guard lock(mu_);
      gone.swap(buffers_);
    }
    GilReleased release;
    for (auto& [address, registered] : gone) registered.buffer.reset();
  }

 private:
  struct Registered {
    std::unique_ptr<CuFileBuffer> buffer;
    py::object keep;
  };
  std::mutex mu_;
  std::map<uintptr_t, Registered> buffers_;  // guarded by mu_
};

class TensorGroups {
 public:
  // Records the key `tensors` were written under. A key stays readable until it is read, also
  // when one of its tensors is written again under another (TensorNVMe's keys are the call's
  // tensors, not their data): its read brings back that tensor's later write. Groups with a tensor
  // gone are dropped when there are twice as many as after the last sweep.
  void Remember(const py::list& tensors, bool vector) {
    std::vector<py::weakref> refs;
    for (const py::handle t : tensors) refs.emplace_back(t);
    groups_.insert_or_assign(KeyOf(tensors, vector), std::move(refs));
    if (groups_.size() <= 2 * kept_) return;
    std::erase_if(groups_, [](const auto& group) {
      return std::any_of(group.second.begin(), group.second.end(),
                         [](const py::weakref& r) { return r().is_none(); });
    });
    kept_ = std::max<size_t>(64, groups_.size());
  }

  // A group read back: its key is TensorNVMe's no more (a read takes it).
  void Forget(const py::list& tensors, bool vector) { groups_.erase(KeyOf(tensors, vector)); }

  // Whether `tensors` are, in this order, the live tensors of one write call's group.
  bool Matches(const py::list& tensors, bool vector) const {
    const auto group = groups_.find(KeyOf(tensors, vector));
    if (group == groups_.end() || group->second.size() != tensors.size()) return false;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!group->second[i]().is(tensors[i])) return false;
    }
    return true;
  }

 private:
  using Key = std::pair<bool, std::vector<uintptr_t>>;  // (a vector, the tensors' ids)
  static uintptr_t Id(const py::handle& t) { return reinterpret_cast<uintptr_t>(t.ptr()); }
  static Key KeyOf(const py::list& tensors, bool vector) {
    Key key{vector, {}};
    for (const py::handle t : tensors) key.second.push_back(Id(t));
    return key;
  }
  std::map<Key, std::vector<py::weakref>> groups_;
  size_t kept_ = 64;
};

[[noreturn]] void RaiseAssertionError(const std::string& message) {
  PyErr_SetString(PyExc_AssertionError, message.c_str());
  throw py::error_already_set();
}

class GdsFileState {
 public:
  // Opens `filename` with `flags` as os.open would (O_CREAT and O_TRUNC honoured; OSError), then
  // through `io` (IOHandle.open), read-write when `flags` allow writing. `error`: the exception
  // type of a failed cuFile call (GdsIOError), made as OSError(errno, message, filename).
  GdsFileState(const py::object& io, py::object filename, const py::int_& os_flags,
               py::object error)
      : filename_(std::move(filename)), error_(std::move(error)) {
    const long flags = PyLong_AsLong(os_flags.ptr());
    if (flags == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (flags < INT_MIN || flags > INT_MAX) {  // os.open's C int
      PyErr_SetString(PyExc_OverflowError, "flags do not fit a C int");
      throw py::error_already_set();
    }
    const std::string path = filename_.cast<FsPath>().bytes;
    int code = 0;
    {
      GilReleased release;
      const int fd = open(path.c_str(), static_cast<int>(flags) | O_CLOEXEC, 0644);
      if (fd < 0) code = errno;
      if (fd >= 0) close(fd);
    }
    if (code != 0) {
      errno = code;
      PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, filename_.ptr());
      throw py::error_already_set();
    }
    file_ = io.attr("open")(filename_, (flags & O_ACCMODE) != O_RDONLY ? "r+" : "r");
  }

  // The file's descriptor; -1 once closed, as torch's.
  int fd() const { return file_.is_none() ? -1 : file_.cast<const File&>().buffered_fd(); }

  // The DeviceFile while registered and open, else None (torch's GdsFile.handle).
  py::object handle() { return registered_ && !file_.is_none() ? DeviceFileOf() : py::none(); }

  // The DeviceFile, made once per registration (ValueError once closed).
  py::object DeviceFileOf() {
    if (file_.is_none()) throw py::value_error("GdsFile is closed");
    if (device_file_.is_none()) {
      const File& file = file_.cast<const File&>();
      std::optional<DeviceFile> made;
      {
        GilReleased release;
        made.emplace(file, GdsMode::kAuto);
      }
      device_file_ = py::cast(std::move(*made));
    }
    return device_file_;
  }

  void Register() {
    if (registered_) RaiseAssertionError("Cannot register a handle that is already registered.");
    if (file_.is_none()) {  // torch's registers descriptor -1: cuFileHandleRegister fails
      RaiseError(EBADF, "cuFileHandleRegister failed: the file is closed", filename_);
    }
    registered_ = true;
  }

  void Deregister() {
    if (!registered_) {
      RaiseAssertionError("Cannot deregister a handle that is not registered.");
    }
    registered_ = false;
    device_file_ = py::none();
  }

  // The open file for a transfer (`verb`: "load data from"); AssertionError, with torch's
  // message, when the handle is not registered or the file is closed.
  py::object Require(const std::string& verb) const {
    if (!registered_ || file_.is_none()) {
      RaiseAssertionError("Cannot " + verb + " a file that is not registered.");
    }
    return file_;
  }

  // load_storage ('read') / save_storage ('write') of `tensor`, a 1-D uint8 tensor over the
  // storage, at `offset` through `io`, the IOHandle the GdsFiles share; `span` makes a CUDA
  // tensor's DeviceBuffer (None: a CPU tensor). Returns the path the bytes took ("host", "gds",
  // "bounce"). A failed transfer is `error`, with torch's "cuFileRead failed: ..." message.
  std::string Transfer(const std::string& op, const py::object& io, const py::object& tensor,
                       const py::int_& offset, const py::object& span) {
    const bool read = op == "read";
    const std::string call = read ? "cuFileRead failed: " : "cuFileWrite failed: ";
    if (offset < py::int_(0)) {
      RaiseError(EINVAL, StrCat(call, "negative offset ", py::str(offset).cast<std::string>()),
                 filename_);
    }
    try {
      if (span.is_none()) {
        io.attr(read ? "pread" : "pwrite")(tensor, file_, offset);
        return "host";
      }
      const py::object db = span(tensor);  // CudaError without a driver
      const py::object transfer = io.attr("_device").attr("transfer")(io.attr("_core")());
      const py::object nbytes = tensor.attr("numel")();
      const py::object target = DeviceFileOf();
      const py::object address = db.attr("address"), device = db.attr("device");
      const py::object result =
          read ? transfer.attr("read")(target, offset, nbytes, address, device, db.attr("stream"))
               : transfer.attr("write")(address, nbytes, target, offset, device, db.attr("stream"));
      return py::str(result["stats"]["path"]);
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_OSError)) throw;
      const py::object cause = e.value();
      const auto either = [](const py::object& value, py::object other) {
        return PyObject_IsTrue(value.ptr()) == 1 ? value : other;
      };
      RaiseError(either(cause.attr("errno"), py::int_(EIO)),
                 call + either(cause.attr("strerror"), py::str(cause)).cast<std::string>(),
                 either(cause.attr("filename"), filename_), cause);
    }
  }

  void Close() {
    registered_ = false;
    device_file_ = py::none();
    if (file_.is_none()) return;
    const py::object file = std::exchange(file_, py::none());
    file.attr("close")();
  }

 private:
  // Raises `error`(code, message, filename), caused by `cause` (as Python's raise ... from).
  [[noreturn]] void RaiseError(const py::object& code, const std::string& message,
                               const py::object& filename, const py::object& cause = py::none()) {
    const py::object error = error_(code, message, filename);
    if (!cause.is_none()) error.attr("__cause__") = cause;
    PyErr_SetObject(error_.ptr(), error.ptr());
    throw py::error_already_set();
  }
  [[noreturn]] void RaiseError(int code, const std::string& message, const py::object& filename) {
    RaiseError(py::int_(code), message, filename);
  }

  py::object file_;  // the _core.File; None once closed
  py::object filename_;
  py::object error_;
  bool registered_ = true;  // torch's GdsFile registers its handle when made
  py::object device_file_ = py::none();
};

}  // namespace

void RegisterRegistries(py::module_& m) {
  py::class_<LockedTensors>(m, "LockedTensors")
      .def(py::init<>())
      .def("add", &LockedTensors::Add, py::arg("address"), py::arg("nbytes"), py::arg("storage"),
           "Records a locked tensor: its address, size and storage (weakly).")
      .def("free", &LockedTensors::Free, py::arg("address"), py::arg("tensor") = py::none(),
           "Frees the live tensor at `address` (a zero-byte one only through `tensor`, a view of "
           "it) once the operations started on its memory are over: its storage shrinks to "
           "nothing where torch allows. False, and nothing freed, when there is none.")
      .def("track", &LockedTensors::Track, py::arg("address"), py::arg("nbytes"),
           py::arg("operation"),
           "Records an operation started on the range, on the locked tensor it starts in.")
      .def(
          "pinned",
          [](LockedTensors& l, const py::object& tensor) {
            return tensor.attr("device").attr("type").cast<std::string>() == "cpu" &&
                   (tensor.attr("is_pinned")().cast<bool>() ||
                    l.Pinned(tensor.attr("data_ptr")().cast<uintptr_t>(),
                             tensor.attr("nbytes").cast<size_t>()));
          },
          py::arg("tensor"),
          "Whether all of a tensor is page-locked host memory: pinned by torch, in one live "
          "locked tensor or, where a CUDA driver is loaded, page-locked with CUDA.");
  py::class_<TensorGroups>(m, "TensorGroups")
      .def(py::init<>())
      .def("remember", &TensorGroups::Remember, py::arg("tensors"), py::arg("vector"),
           "Records the tensors of a write call (a vector call, or one tensor) as their group.")
      .def("forget", &TensorGroups::Forget, py::arg("tensors"), py::arg("vector"),
           "Drops the group of the tensors (read back).")
      .def("matches", &TensorGroups::Matches, py::arg("tensors"), py::arg("vector"),
           "Whether the tensors are, in order, one write call's group.");
  py::class_<CuFileRegistrations>(m, "CuFileRegistrations")
      .def(py::init<>())
      .def("add", &CuFileRegistrations::Add, py::arg("address"), py::arg("nbytes"),
           py::arg("keep") = py::none(),
           "Registers device memory with cuFile through its device's primary context, unless it "
           "is already or nothing would DMA into it (no bytes, no cuFile, compatibility mode); "
           "CuFileError when cuFile refuses it.")
      .def("remove", &CuFileRegistrations::Remove, py::arg("address"),
           "Deregisters the memory at `address` now; nothing when it is not registered.")
      .def("clear", &CuFileRegistrations::Clear, "Deregisters everything now.");
  py::class_<GdsFileState>(m, "GdsFileState")
      .def(py::init<const py::object&, py::object, const py::int_&, py::object>(), py::arg("io"),
           py::arg("filename"), py::arg("flags"), py::arg("error"),
           "A GdsFile's file, opened with os.open's `flags` and then by `io`, and its cuFile "
           "handle's state (registered when made).")
      .def_property_readonly("fd", &GdsFileState::fd)
      .def_property_readonly("handle", &GdsFileState::handle)
      .def("device_file", &GdsFileState::DeviceFileOf,
           "The file's DeviceFile, made on first use (ValueError once closed).")
      .def("register_handle", &GdsFileState::Register)
      .def("deregister_handle", &GdsFileState::Deregister)
      .def("require", &GdsFileState::Require, py::arg("verb"),
           "The open file; AssertionError (torch's message) unless registered and open.")
      .def("transfer", &GdsFileState::Transfer, py::arg("op"), py::arg("io"), py::arg("tensor"),
           py::arg("offset"), py::arg("span"),
           "load_storage / save_storage of a uint8 tensor over the storage through `io`; returns "
           "the path the bytes took. A failure is the error type, with torch's message.")
      .def("close", &GdsFileState::Close);
}
