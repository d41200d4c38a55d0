// DeepNVMe's handles (DeepSpeed's aio_handle and gds_handle), but for taking their tensors apart:
//   DeepNvmeHandle: the settings a handle is made with, taken as DeepSpeed's pybind11 binding
//     takes them (the getters answer them), and the I/O engine's nearest ones; DeepNVMe's calls
//     (their arguments, the checks of the file and offset they name, the copies of tensors that
//     cannot move as they are) started on the Python handle's IOHandle under the handle's mutex;
//     and the log of the operations started, which wait() completes in order (a read into a
//     non-contiguous tensor copied out, DeepNVMe's validate).
//   A file DeepNVMe cannot open or stat: the call returns -1 (DeepNVMe prints its message, a
//   RuntimeWarning here).
//   deepnvme_tensor, deepnvme_argument: the checks of a tensor argument, and an argument given by
//     its name or by DeepSpeed's spelling of it.
#include <fcntl.h>
#include <pybind11/pybind11.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "arguments.hpp"
#include "binding_helpers.hpp"
#include "cycle_collected.hpp"
#include "errors.hpp"
#include "gil.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/transfer/operation.hpp"
#include "tensortier/util/process_identity.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

// The most bytes a handle's engine keeps in flight.
constexpr uint64_t kMaxInflight = uint64_t{1} << 30;

// TypeError naming the keywords `what` was given that it does not take, as Python's own.
void RefuseKeywords(const std::string& what, const py::dict& kwargs) {
  if (py::len(kwargs) == 0) return;
  const py::object names = py::module_::import("builtins").attr("sorted")(kwargs);
  throw py::type_error(StrCat(what, "() got unexpected keyword arguments: ", ReprOf(names)));
}

// `value`, or the keyword `alias` taken out of `kwargs` (DeepSpeed's spelling); no other keyword
// may be left. TypeError for both, for neither, or for another keyword.
py::object AliasedArgument(const std::string& what, py::object value, const py::dict& kwargs,
                           const std::string& name, const std::string& alias) {
  if (kwargs.contains(alias)) {
    if (!value.is_none()) throw py::type_error(StrCat(what, "() got both ", name, " and ", alias));
    value = kwargs.attr("pop")(alias);
  }
  RefuseKeywords(what, kwargs);
  if (value.is_none()) throw py::type_error(StrCat(what, "() missing its argument '", name, "'"));
  return value;
}

[[noreturn]] void RaiseOsError(int code, const std::string& message,
                               const py::object& filename = py::none()) {
  PyErr_SetObject(PyExc_OSError, py::make_tuple(code, message, filename).ptr());
  throw py::error_already_set();
}

// DeepNVMe's answer to a file it cannot open or stat: its message, as a RuntimeWarning naming
// the first caller outside the module that called here (DeepNVMe prints it).
void Failed(const std::string& path, const char* step, int code) {
  const py::object first = py::module_::import("sys").attr("_getframe")(0);
  const py::object module = first.attr("f_code").attr("co_filename");
  int level = 1;
  for (py::object frame = first;
       !frame.is_none() && module.equal(frame.attr("f_code").attr("co_filename"));
       frame = frame.attr("f_back")) {
    ++level;
  }
  const py::str message = py::str("deepspeed_aio:  {} failed on {} error = {} ({})")
                              .format(step, PathToPython(path), code, std::strerror(code));
  if (PyErr_WarnEx(PyExc_RuntimeWarning, message.cast<std::string>().c_str(), level) < 0) {
    throw py::error_already_set();
  }
}

// Whether `target` is a path (str, bytes, os.PathLike), not a descriptor.
bool IsPath(const py::object& target) {
  const py::handle type(reinterpret_cast<PyObject*>(Py_TYPE(target.ptr())));
  return PyUnicode_Check(target.ptr()) || PyBytes_Check(target.ptr()) ||
         py::hasattr(type, "__fspath__");
}

// `target` as a path: DeepNVMe's calls take a C string (TypeError for anything else).
std::string PathArgument(const py::object& target, const std::string& what) {
  if (!IsPath(target)) {
    throw py::type_error(StrCat(what, ": filename must be a path, not ", TypeName(target)));
  }
  return target.cast<FsPath>().bytes;
}

// The path a DeepNVMe call names: `target` a path, or (`descriptor_ok`: async_pwrite's second
// overload) an open descriptor, named by /proc/self/fd and left open (OSError when it is not
// open, or read-only for a write). A read's file must exist, open for reading and not be a
// directory; a write's path is created if missing (mode 0600, as DeepNVMe's). nullopt, with
// DeepNVMe's warning, when a check fails; TypeError for a target that is no path (an int but where
// `descriptor_ok`).
std::optional<std::string> DeepNvmeFile(const std::string& op, const py::object& target,
                                        const std::string& what, bool descriptor_ok) {
  const bool descriptor = descriptor_ok && !IsPath(target);
  std::string path;
  if (!descriptor) {
    path = PathArgument(target, what);
  } else {
    const int fd = CIntegerArgument(target, what, "fd", 0, 32, false).cast<int>();
    const int flags = fcntl(fd, F_GETFL);
    const int code = errno;
    const std::string name = StrCat(what, ": file descriptor ", fd);
    if (flags < 0) RaiseOsError(code, StrCat(name, ": ", std::strerror(code)));
    if (op == "write" && (flags & O_ACCMODE) == O_RDONLY) {
      RaiseOsError(EBADF, name + " is read-only");
    }
    path = StrCat("/proc/self/fd/", fd);
  }
  const char* step = "";
  int code = 0;
  {
    GilReleased release;
    struct stat st{};
    int fd = -1;
    if (op == "read" && stat(path.c_str(), &st) != 0) {
      step = "fstat for read";
    } else if (op == "read" && S_ISDIR(st.st_mode)) {
      step = "open for read";  // DeepNVMe's open (O_DIRECT) of a directory fails, so
      errno = EINVAL;
    } else if (op == "read" && (fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)) < 0) {
      step = "open for read";
    } else if (op == "write" && !descriptor &&
               (fd = open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600)) < 0) {
      step = "open for write";
    }
    if (*step != '\0') code = errno;
    if (fd >= 0) close(fd);
  }
  if (*step == '\0') return path;
  Failed(path, step, code);
  return std::nullopt;
}

// (path, offset) of a DeepNVMe call, in DeepNVMe's order: pybind11 converts the offset (an
// int64: TypeError), the file is checked (nullopt, with DeepNVMe's warning, when it cannot be
// opened), and only then is a negative offset used (DeepNVMe aborts; ValueError).
std::optional<std::pair<std::string, uint64_t>> DeepNvmeTarget(const std::string& op,
                                                               const py::object& target,
                                                               const py::object& offset,
                                                               const std::string& what,
                                                               bool descriptor_ok) {
  CIntegerArgument(offset, what, "file_offset", LLONG_MIN, 64, false);
  const std::optional<std::string> path = DeepNvmeFile(op, target, what, descriptor_ok);
  if (!path) return std::nullopt;
  return std::pair{*path,
                   CIntegerArgument(offset, what, "file_offset", 0, 64, false).cast<uint64_t>()};
}

// DeepNVMe's synchronous read()'s check: the buffer's `nbytes` at `offset` must be in the file,
// and at offset 0 the file's size must be the buffer's (ValueError: DeepNVMe aborts). False,
// with DeepNVMe's warning, when the file cannot be stat'ed.
bool DeepNvmeReadFits(const py::object& target, uint64_t nbytes, uint64_t offset) {
  const std::string path = PathArgument(target, "read");
  struct stat st{};
  int code = 0;
  {
    GilReleased release;
    if (stat(path.c_str(), &st) != 0) code = errno;
  }
  if (code != 0) {
    Failed(path, "fstat for read", code);
    return false;
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  const py::object name = PathToPython(path);
  if (offset == 0 && size != nbytes) {
    throw py::value_error(py::str("read: {} holds {} bytes, buffer {}")
                              .format(name, size, nbytes)
                              .cast<std::string>());
  }
  if (offset + nbytes > size) {  // a read that stopped at the end would leave the tail unseen
    throw py::value_error(
        py::str("read: {} holds {} bytes, fewer than the buffer's {} from offset {}")
            .format(name, size, nbytes, offset)
            .cast<std::string>());
  }
  return true;
}

// DeepNVMe's validate: the file's bytes at `offset` (through the page cache) against the host
// memory [address, address + nbytes). OSError(EIO) when they differ.
// A read's buffer may run past the file's end (DeepNVMe reads whole blocks): only the bytes the
// file holds are compared (`read`); a write's must all be there.
void DeepNvmeValidate(uintptr_t address, size_t nbytes, const std::string& path, uint64_t offset,
                      bool read) {
  int code = 0;
  bool same = false;
  {
    GilReleased release;
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      code = errno;
    } else {
      std::vector<char> on_disk(nbytes);
      size_t got = 0;
      while (got < nbytes) {
        const ssize_t n =
            pread(fd, on_disk.data() + got, nbytes - got, static_cast<off_t>(offset + got));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) code = errno;
        if (n <= 0) break;
        got += static_cast<size_t>(n);
      }
      close(fd);
      same = code == 0 && (read || got == nbytes) &&
             (got == 0 ||
              std::memcmp(on_disk.data(), reinterpret_cast<const void*>(address), got) == 0);
    }
  }
  const py::str name = PathToPython(path);
  if (code != 0) RaiseOsError(code, std::strerror(code), name);
  if (!same) {
    RaiseOsError(
        EIO, py::str("validation failed: {} at offset {}").format(name, offset).cast<std::string>(),
        name);
  }
}

// DeepNVMe's binding takes a torch.Tensor: TypeError for anything else. With `device`, ValueError
// unless it is on the CPU or a GPU (with `gpu`, on a GPU); with `contiguous`, unless it is
// contiguous.
// `sequence` as a plain tuple (a torch.Size reads as one in messages, as DeepNVMe's did).
py::tuple PlainTuple(const py::handle& sequence) {
  const py::handle tuple(PySequence_Tuple(sequence.ptr()));
  if (!tuple) throw py::error_already_set();
  return py::reinterpret_steal<py::tuple>(tuple);
}

void CheckTensor(const py::object& value, const std::string& what, const std::string& name,
                 bool device, bool contiguous, bool gpu) {
  static const py::handle tensor_type =
      py::object(py::module_::import("torch").attr("Tensor")).release();
  if (!py::isinstance(value, tensor_type)) {
    throw py::type_error(
        StrCat(what, ": ", name, " must be a torch tensor, not ", TypeName(value)));
  }
  if (contiguous && !value.attr("is_contiguous")().cast<bool>()) {
    throw py::value_error(StrCat(what, ": buffer of shape ",
                                 ReprOf(PlainTuple(value.attr("shape"))), " is not contiguous"));
  }
  if (!device) return;
  const bool cuda = value.attr("is_cuda").cast<bool>();
  if (!cuda && !value.attr("is_cpu").cast<bool>()) {
    throw py::value_error(StrCat(what, ": buffer is on ",
                                 py::str(value.attr("device")).cast<std::string>(),
                                 "; only CPU and CUDA tensors move"));
  }
  if (gpu && !cuda) {
    throw py::value_error(StrCat(what, ": tensor is on ",
                                 py::str(value.attr("device")).cast<std::string>(), ", not a GPU"));
  }
}

uint64_t ClampToSetting(uint64_t value, const char* env) {
  const Setting& s = SettingFor(env);
  return std::clamp<uint64_t>(value, s.min, s.max);
}

class DeepNvmeHandle {
  struct Pending;  // an operation started and not yet waited for (below)

 public:
  // DeepSpeed's bindings take the settings as C ints (TypeError for others); a value below 1,
  // with which DeepNVMe's handle fails at its first transfer, is a ValueError.
  DeepNvmeHandle(const py::object& block_size, const py::object& queue_depth,
                 const py::object& single_submit, const py::object& overlap_events,
                 py::object parallelism, py::kwargs kwargs) {
    if (kwargs.contains("num_threads")) {  // the fifth argument's name before DeepSpeed 0.15
      parallelism = kwargs.attr("pop")("num_threads");
    }
    RefuseKeywords("aio_handle", kwargs);
    block_size_ = CInt(block_size, "block_size");
    queue_depth_ = CInt(queue_depth, "queue_depth");
    parallelism_ = CInt(parallelism, "intra_op_parallelism");
    single_submit_ = CBoolArgument(single_submit, "aio_handle", "single_submit");
    overlap_events_ = CBoolArgument(overlap_events, "aio_handle", "overlap_events");
  }

  // The engine settings nearest to the handle's (every size DeepNVMe takes works).
  py::dict EngineSettings() const {
    const uint64_t chunk =
        ClampToSetting((block_size_ + 4095) / 4096 * 4096, "TENSORTIER_CHUNK_SIZE");
    const uint64_t depth = ClampToSetting(queue_depth_, "TENSORTIER_QUEUE_DEPTH");
    const uint64_t workers = ClampToSetting(parallelism_, "TENSORTIER_WORKERS");
    py::dict out;
    out["chunk_size"] = chunk;
    out["queue_depth"] = depth;
    out["workers"] = workers;
    out["max_inflight_bytes"] = std::max(chunk, std::min(chunk * depth * workers, kMaxInflight));
    return out;
  }

  // pread / pwrite(buffer, filename, validate, async, file_offset): 0 once started (async), the
  // count of operations completed (blocking: the handle held to the end of its wait), or -1.
  int64_t Call(const py::object& self, const std::string& op, const py::object& buffer,
               const py::object& filename, const py::object& validate, const py::object& async_op,
               const py::object& offset, const py::dict& kwargs) {
    const std::string what = op == "read" ? "pread" : "pwrite";
    const bool async =
        CBoolArgument(AliasedArgument(what, async_op, kwargs, "async_op", "async"), what, "async");
    const bool check = CBoolArgument(validate, what, "validate");
    CheckNotForked();
    const Held held(mutex_);
    if (!Start(self, op, buffer, filename, offset, check, async && op == "write", false)) return -1;
    return async ? 0 : static_cast<int64_t>(WaitPending());
  }

  // async_pwrite(buffer, filename or fd, file_offset): a descriptor stays the caller's (the
  // engine opens its file again).
  int64_t AsyncPwrite(const py::object& self, const py::object& buffer, const py::object& filename,
                      const py::object& offset, const py::object& fd) {
    if (filename.is_none() == fd.is_none()) {
      throw py::type_error("async_pwrite: give a filename or an fd (one of them)");
    }
    CheckNotForked();
    const Held held(mutex_);
    return Start(self, "write", buffer, filename.is_none() ? fd : filename, offset, false, true,
                 true)
               ? 0
               : -1;
  }

  // The synchronous read() / write(): 0 or -1. A read at offset 0 needs the file's size to be
  // the buffer's; at a later offset, the buffer's bytes from there in the file.
  int64_t Whole(const py::object& self, const std::string& op, const py::object& buffer,
                const py::object& filename, const py::object& validate, py::object offset) {
    CheckNotForked();
    CheckTensor(buffer, op, "buffer", true, false, false);
    const bool check = CBoolArgument(validate, op, "validate");
    if (op == "read") {
      offset = CIntegerArgument(offset, "read", "file_offset", 0, 64, false);
      if (!DeepNvmeReadFits(filename, buffer.attr("nbytes").cast<uint64_t>(),
                            offset.cast<uint64_t>())) {
        return -1;
      }
    }
    // Its own operation only, as DeepNVMe's read()/write() run on the handle's own context:
    // operations started before stay for wait() to count.
    const Held held(mutex_);
    if (!Start(self, op, buffer, filename, offset, check, false, false)) return -1;
    // Waited for while still recorded: Ctrl-C leaves it to the next wait(), which waits for it,
    // copies it out and counts it (its memory stays alive with it).
    WaitInterruptibly([&](auto timeout) { return pending_.back().op.WaitFor(timeout); }, true);
    std::vector<Pending> mine;
    mine.push_back(std::move(pending_.back()));
    pending_.pop_back();
    Complete(mine);
    return 0;
  }

  // wait(): every operation started, in order; returns their count.
  size_t Wait() {
    CheckNotForked();
    const Held held(mutex_);
    return WaitPending();
  }

  // close(): the IOHandle waits for everything in flight and stops its workers.
  void Close(const py::object& self) {
    if (maker_.Forked()) {
      // The child's copy: the lock may have been held by a thread of the parent at the fork
      // (taking it would never end); the IOHandle's close lets the parent's engine be.
      self.attr("_io").attr("close")();
      return;
    }
    const Held held(mutex_);
    self.attr("_io").attr("close")();
  }

  // (future, tensor moved) of each operation recorded, in order.
  py::list PendingList() const {
    py::list out;
    for (const Pending& p : pending_) out.append(py::make_tuple(p.future, p.buffer));
    return out;
  }

  int64_t block_size() const { return block_size_; }
  int64_t queue_depth() const { return queue_depth_; }
  int64_t parallelism() const { return parallelism_; }
  bool single_submit() const { return single_submit_; }
  bool overlap_events() const { return overlap_events_; }

  // For the cycle collector: a tensor moved (its attributes) may refer back to the handle.
  int Traverse(visitproc visit, void* arg) const {
    for (const Pending& p : pending_) {
      Py_VISIT(p.future.ptr());
      Py_VISIT(p.buffer.ptr());
      Py_VISIT(p.copy_to.ptr());
    }
    return 0;
  }

  // Garbage: the operations are dropped; each future waits for its operation as it goes, before
  // the memory the operation uses can be freed.
  void ClearReferences() {
    std::vector<Pending> pending;
    pending.swap(pending_);
  }

 private:
  // A child made by fork() (a DataLoader worker) holds a copy of the handle: the operations it
  // recorded are the parent's, run by threads the child does not have (waiting for them would
  // never end). ValueError, as an IOHandle's.
  void CheckNotForked() const {
    if (maker_.Forked()) {
      throw py::value_error(ForkedUseMessage(
          "aio_handle", maker_.pid(),
          "its engine's worker threads and the operations it started are the parent's",
          "make a new handle in the child"));
    }
  }

  // DeepNVMe's handle mutex: held while an operation starts, and by a blocking call to the end of
  // its wait (another thread's wait() cannot take its operation half done). Taken with the GIL
  // released, and interruptible as the Python lock it replaces was (Ctrl-C while the main thread
  // waits behind another thread's blocked read raises KeyboardInterrupt).
  class Held {
   public:
    explicit Held(std::timed_mutex& mutex) : lock_(mutex, std::defer_lock) {
      WaitInterruptibly([&](auto timeout) { return lock_.try_lock_for(timeout); }, true);
    }

   private:
    std::unique_lock<std::timed_mutex> lock_;
  };

  // Starts `op` on the handle's IOHandle; false (nothing started) when DeepNVMe cannot open the
  // file. `target` may be an open descriptor only with `descriptor_ok`.
  bool Start(const py::object& self, const std::string& op, py::object buffer,
             const py::object& target, const py::object& offset, bool validate, bool snapshot,
             bool descriptor_ok) {
    const std::string what = op == "read" ? "pread" : "pwrite";
    CheckTensor(buffer, what, "buffer", true, false, false);
    const auto file = DeepNvmeTarget(op, target, offset, what, descriptor_ok);
    if (!file) return false;
    py::object copy_to = py::none();
    if (!buffer.attr("is_contiguous")().cast<bool>()) {
      // DeepNVMe moves such a tensor through a contiguous bounce buffer, copied in at the call
      // (writes) or out at wait() (reads).
      if (op == "read") copy_to = buffer;
      snapshot = false;
      buffer = buffer.attr("contiguous")();
    }
    // In DeepNVMe's first-in, first-out order (below), an operation on memory an earlier one
    // still moves (a read into it, or a read into memory an earlier write takes from) sees that
    // one finished: it starts once that one is over, a write's copy of its memory (next) taken
    // after it.
    const MemoryRange memory{buffer.attr("data_ptr")().cast<uintptr_t>(),
                             buffer.attr("nbytes").cast<uint64_t>(), op == "read"};
    for (Pending& p : pending_) {
      if (p.memory.Conflicts(memory)) {
        WaitInterruptibly([&](auto timeout) { return p.op.WaitFor(timeout); }, true);
      }
    }
    // An async write copies a buffer that is not locked host memory first, as DeepNVMe does
    // (DeepSpeed may reuse it before wait()); our device path would queue a CUDA tensor's copies
    // after work the caller queues meanwhile.
    if (snapshot && buffer.attr("numel")().cast<int64_t>() > 0 &&
        (buffer.attr("is_cuda").cast<bool>() ? self.attr("_SNAPSHOT_CUDA_WRITES").cast<bool>()
                                             : !self.attr("is_pinned")(buffer).cast<bool>())) {
      buffer = buffer.attr("detach")().attr("to")("cpu", py::arg("copy") = true);
    }
    // DeepNVMe's workers take operations first in, first out, each its slice of every one: on
    // one handle a later write to the same bytes wins, and a read sees the writes started
    // before it. The engine runs operations side by side, so one that overlaps an earlier
    // operation still in flight on the same file, either of them a write, starts once that one
    // is over (its result stays for wait()).
    const FileRange range{FileIdentity(file->first), file->first, file->second,
                          file->second + buffer.attr("nbytes").cast<uint64_t>(), op == "write"};
    for (Pending& p : pending_) {
      // A write that created its file had no inode to record when it started.
      if (!p.range.id) p.range.id = FileIdentity(p.range.path);
      if (p.range.Conflicts(range)) {
        WaitInterruptibly([&](auto timeout) { return p.op.WaitFor(timeout); }, true);
      }
    }
    const char* method = op == "read" ? "pread_async" : "pwrite_async";
    const py::object future =
        self.attr("_io").attr(method)(buffer, PathToPython(file->first), file->second);
    const py::object operation = future.attr("_op");
    static const py::handle locked =  // the process's one registry of locked tensors
        py::object(py::module_::import("tensortier.compat.deepnvme").attr("_locked")).release();
    locked.attr("track")(buffer.attr("data_ptr")(), buffer.attr("nbytes"), operation);
    const MemoryRange moved{buffer.attr("data_ptr")().cast<uintptr_t>(),
                            buffer.attr("nbytes").cast<uint64_t>(), op == "read"};
    pending_.push_back({operation.cast<Operation>(), future, buffer, copy_to, validate, file->first,
                        file->second, range, moved});
    return true;
  }

  // Waits for every operation recorded, then completes each in order (its error; a read's copy
  // out of its contiguous buffer, DeepNVMe's validation through the page cache); returns how many
  // there were. Raises the first error (OSError, CudaError, CuFileError) once all are over.
  // Ctrl-C interrupts it with every operation still recorded: the next wait() waits for them,
  // counts them and finishes them.
  size_t WaitPending() {
    for (const Pending& p : pending_) {
      WaitInterruptibly([&](auto timeout) { return p.op.WaitFor(timeout); }, true);
    }
    std::vector<Pending> pending;
    pending.swap(pending_);
    Complete(pending);
    return pending.size();
  }

  // Completes each of `pending`, operations that are over (waited for while they were still
  // recorded: an interrupted wait must not lose them), in order (see WaitPending).
  void Complete(const std::vector<Pending>& pending) {
    py::object first;
    for (const Pending& p : pending) {
      try {
        try {
          GilReleased release;
          p.op.Wait();
        } catch (const std::exception&) {
          if (!first) first = PythonError(std::current_exception());
          continue;
        }
        if (!p.copy_to.is_none()) p.copy_to.attr("copy_")(p.buffer);
        if (p.validate) {
          const py::object host = p.buffer.attr("detach")().attr("cpu")();
          DeepNvmeValidate(host.attr("data_ptr")().cast<uintptr_t>(),
                           host.attr("nbytes").cast<size_t>(), p.path, p.offset, !p.range.write);
        }
      } catch (py::error_already_set& e) {
        if (!e.matches(PyExc_OSError) && !e.matches(PyExc_RuntimeError)) throw;
        if (!first) first = e.value();
      }
    }
    if (first) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(first.ptr())), first.ptr());
      throw py::error_already_set();
    }
  }

  static int64_t CInt(const py::object& value, const char* name) {
    return CIntegerArgument(value, "aio_handle", name, 1, 32, false).cast<int64_t>();
  }

  // The bytes an operation moves in its file: the file as (device, inode) where it exists when
  // the operation starts, and by the path it was given (a write may create it).
  struct FileRange {
    std::optional<std::pair<dev_t, ino_t>> id;
    std::string path;
    uint64_t begin = 0;
    uint64_t end = 0;
    bool write = false;

    bool Conflicts(const FileRange& other) const {
      const bool same_file = (id && other.id && *id == *other.id) || path == other.path;
      return same_file && (write || other.write) && begin < other.end && other.begin < end;
    }
  };

  // Memory an operation moves: `writes` for a read (the file's bytes go into it).
  struct MemoryRange {
    uintptr_t begin = 0;
    uint64_t length = 0;
    bool writes = false;

    bool Conflicts(const MemoryRange& other) const {
      return (writes || other.writes) && length != 0 && other.length != 0 &&
             begin < other.begin + other.length && other.begin < begin + length;
    }
  };

  static std::optional<std::pair<dev_t, ino_t>> FileIdentity(const std::string& path) {
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0) return std::nullopt;
    return std::pair(st.st_dev, st.st_ino);
  }

  struct Pending {
    Operation op;
    py::object future;   // keeps the memory alive
    py::object buffer;   // the tensor moved
    py::object copy_to;  // a read's non-contiguous tensor, else None
    bool validate;
    std::string path;
    uint64_t offset;
    FileRange range;
    MemoryRange memory;  // what it moves, as submitted (a write's copy, where it took one)
  };

  std::timed_mutex mutex_;
  const MakerProcess maker_;  // the process whose engine runs the operations
  std::vector<Pending> pending_;
  int64_t block_size_ = 0;
  int64_t queue_depth_ = 0;
  int64_t parallelism_ = 0;
  bool single_submit_ = false;
  bool overlap_events_ = false;
};

}  // namespace

void RegisterDeepNvme(py::module_& m) {
  py::class_<DeepNvmeHandle>(m, "DeepNvmeHandle", CycleCollected<DeepNvmeHandle>(),
                             "DeepNVMe's handle: its settings, its calls started on the Python "
                             "handle's IOHandle (`_io`), and its log of the operations started.")
      .def(py::init<const py::object&, const py::object&, const py::object&, const py::object&,
                    py::object, py::kwargs>())
      .def("_engine_settings", &DeepNvmeHandle::EngineSettings,
           "IOHandle's chunk_size, queue_depth, workers and max_inflight_bytes for the handle.")
      .def(
          "_call",
          [](py::object self, const std::string& op, const py::object& buffer,
             const py::object& filename, const py::object& validate, const py::object& async_op,
             const py::object& offset, const py::dict& kwargs) {
            return self.cast<DeepNvmeHandle&>().Call(self, op, buffer, filename, validate, async_op,
                                                     offset, kwargs);
          },
          py::arg("op"), py::arg("buffer"), py::arg("filename"), py::arg("validate"),
          py::arg("async_op"), py::arg("file_offset"), py::arg("kwargs"),
          "pread / pwrite ('read', 'write'): 0, the count completed (blocking), or -1.")
      .def(
          "_async_pwrite",
          [](py::object self, const py::object& buffer, const py::object& filename,
             const py::object& offset, const py::object& fd) {
            return self.cast<DeepNvmeHandle&>().AsyncPwrite(self, buffer, filename, offset, fd);
          },
          py::arg("buffer"), py::arg("filename"), py::arg("file_offset"), py::arg("fd"))
      .def(
          "_whole",
          [](py::object self, const std::string& op, const py::object& buffer,
             const py::object& filename, const py::object& validate, py::object offset) {
            return self.cast<DeepNvmeHandle&>().Whole(self, op, buffer, filename, validate,
                                                      std::move(offset));
          },
          py::arg("op"), py::arg("buffer"), py::arg("filename"), py::arg("validate"),
          py::arg("file_offset"), "The synchronous read() / write(): 0 or -1.")
      .def("_wait", &DeepNvmeHandle::Wait,
           "wait(): every operation started, in order; returns their count.")
      .def(
          "_close", [](py::object self) { self.cast<DeepNvmeHandle&>().Close(self); },
          "Waits for everything in flight and stops the IOHandle's workers.")
      .def_property_readonly("_pending", &DeepNvmeHandle::PendingList,
                             "(future, tensor moved) of each operation recorded, in order.")
      .def("get_block_size", &DeepNvmeHandle::block_size)
      .def("get_queue_depth", &DeepNvmeHandle::queue_depth)
      .def("get_single_submit", &DeepNvmeHandle::single_submit)
      .def("get_overlap_events", &DeepNvmeHandle::overlap_events)
      .def("get_intra_op_parallelism", &DeepNvmeHandle::parallelism)
      .def("get_thread_count", &DeepNvmeHandle::parallelism);
  m.def("deepnvme_tensor", &CheckTensor, py::arg("value"), py::arg("what"),
        py::arg("name") = "buffer", py::arg("device") = false, py::arg("contiguous") = false,
        py::arg("gpu") = false,
        "TypeError unless `value` is a torch tensor; with `device`, ValueError unless on the CPU "
        "or a GPU (with `gpu`, on a GPU); with `contiguous`, unless contiguous.");
  m.def("deepnvme_argument", &AliasedArgument, py::arg("what"), py::arg("value"), py::arg("kwargs"),
        py::arg("name"), py::arg("alias"),
        "`value`, or the keyword `alias` taken out of `kwargs`; TypeError for both, neither, or "
        "another keyword left.");
}
