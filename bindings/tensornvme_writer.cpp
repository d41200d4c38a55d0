// TensorNVMe's C++ AsyncFileWriter (tensornvme._C) on an IOHandle: writes at given offsets of the
// file an open descriptor refers to, each with an optional callback; synchronize() waits for
// every write, then runs the callbacks in order. Python's subclass (tensortier.compat.tensornvme)
// starts the IOHandle and takes tensors apart; every call holds the GIL, and the waits release it.
#include <pybind11/pybind11.h>

#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "arguments.hpp"
#include "cycle_collected.hpp"
#include "gil.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/process_identity.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

uint64_t TensorNvmeUnsigned(const py::handle& value, const std::string& name, int bits);
void CheckCallback(const py::handle& callback);  // bindings/offload_entries.cpp

namespace {

class TensorNvmeWriter {
 public:
  // `io`: the IOHandle the writes go through (closed here when the descriptor cannot be opened).
  TensorNvmeWriter(py::object io, const py::handle& fd) : io_(std::move(io)) {
    try {
      int overflow = 0;
      const long long number = PyLong_AsLongLongAndOverflow(fd.ptr(), &overflow);
      if (number == -1 && PyErr_Occurred() != nullptr) throw py::error_already_set();
      if (overflow != 0 || number < INT_MIN || number > INT_MAX) {
        throw py::type_error(StrCat("fd must be a descriptor number, not ", ReprOf(fd)));
      }
      // Buffered, as TensorNVMe's: writes of any size land at any offset without
      // read-modify-write of blocks. Errors name the descriptor's file.
      std::optional<File> file;
      {
        GilReleased release;
        file.emplace(File::OpenDescriptor(static_cast<int>(number), OpenMode::kCreate, false));
      }
      file_ = py::cast(std::move(*file));
    } catch (...) {
      io_.attr("close")();
      throw;
    }
  }

  void Write(const py::handle& buffer, const py::handle& n_bytes, const py::handle& offset,
             const py::object& callback) {
    const uint64_t address = TensorNvmeUnsigned(buffer, "buffer", 64);
    const uint64_t size = TensorNvmeUnsigned(n_bytes, "n_bytes", 64);
    if (address == 0 && size > 0) throw py::value_error("buffer is a null address");
    if (size > static_cast<uint64_t>(PY_SSIZE_T_MAX)) {
      // What the memoryview the write was made from raised.
      PyErr_SetString(PyExc_OverflowError, "cannot fit 'int' into an index-sized integer");
      throw py::error_already_set();
    }
    const py::object data =
        size == 0
            ? py::object(py::bytes())
            : py::reinterpret_steal<py::object>(PyMemoryView_FromMemory(
                  reinterpret_cast<char*>(address), static_cast<Py_ssize_t>(size), PyBUF_READ));
    if (!data) throw py::error_already_set();
    Start(data, offset, callback);
  }

  // Starts writing `data` (anything an IOHandle writes) at `offset`.
  void Start(const py::object& data, const py::handle& offset, const py::object& callback) {
    CheckCallback(callback);
    if (io_.is_none()) throw py::value_error("AsyncFileWriter is closed");
    CheckNotForked();
    const uint64_t at = TensorNvmeUnsigned(offset, "offset", 64);
    pending_.push_back({io_.attr("pwrite_async")(data, file_, at), callback});
  }

  // Waits for every write (an interrupt leaves them all pending), then runs the callbacks in
  // order; raises the first write's error after them. TensorNVMe's loop stops at a callback's
  // exception: the callbacks after it run at the next call.
  void Synchronize() {
    CheckNotForked();
    std::optional<py::error_already_set> first;
    // By index, each future held: a wait releases the GIL, and another thread's write() may
    // append to (and so reallocate) pending_ meanwhile; its write is waited for too.
    for (size_t i = 0; i < pending_.size(); ++i) {
      const py::object future = pending_[i].future;
      try {
        future.attr("wait")();
      } catch (py::error_already_set& e) {
        if (!e.matches(PyExc_OSError)) throw;
        if (!first) first = std::move(e);
      }
    }
    std::vector<Pending> pending = std::exchange(pending_, {});
    for (size_t i = 0; i < pending.size(); ++i) {
      if (pending[i].callback.is_none()) continue;
      try {
        pending[i].callback();
      } catch (...) {
        pending_.insert(pending_.begin(), std::make_move_iterator(pending.begin() + i + 1),
                        std::make_move_iterator(pending.end()));
        throw;
      }
    }
    if (first) throw std::move(*first);
  }

  // Closes the file and the IOHandle (which waits for the writes; their errors were
  // synchronize()'s).
  void Close() {
    const py::object io = std::exchange(io_, py::none());
    if (io.is_none()) return;
    // A child made by fork(): the writes are the parent's; its copies of them are dropped, and
    // the IOHandle's close lets the parent's engine be.
    if (forked()) pending_.clear();
    try {
      file_.attr("close")();
    } catch (...) {
      io.attr("close")();
      throw;
    }
    io.attr("close")();
  }

  // Whether the caller runs in a child made by fork() (a DataLoader worker).
  bool forked() const noexcept { return maker_.Forked(); }

  py::object io() const { return io_; }
  void set_io(py::object io) { io_ = std::move(io); }
  py::object file() const { return file_; }

  int Traverse(visitproc visit, void* arg) const {
    Py_VISIT(io_.ptr());
    Py_VISIT(file_.ptr());
    for (const Pending& p : pending_) {
      Py_VISIT(p.future.ptr());
      Py_VISIT(p.callback.ptr());
    }
    return 0;
  }
  // The futures stay in the IOHandle's record until their writes are over.
  void ClearReferences() { const std::vector<Pending> dropped = std::exchange(pending_, {}); }

 private:
  struct Pending {
    py::object future, callback;
  };

  // ValueError naming the writer and its file in a child made by fork(), as an IOHandle's, but
  // in the writer's words.
  void CheckNotForked() const {
    if (!forked()) return;
    std::string name = "AsyncFileWriter";
    try {
      name = StrCat(name, " of ", py::str(file_.attr("path")).cast<std::string>());
    } catch (const py::error_already_set&) {  // closed: unnamed
    }
    throw py::value_error(ForkedUseMessage(name, maker_.pid(),
                                           "its writes and the threads that make them are the "
                                           "parent's",
                                           "make a new AsyncFileWriter in the child"));
  }

  const MakerProcess maker_;
  py::object io_, file_ = py::none();
  std::vector<Pending> pending_;
};

}  // namespace

void RegisterTensorNvmeWriter(py::module_& m) {
  py::class_<TensorNvmeWriter>(m, "TensorNvmeWriter", CycleCollected<TensorNvmeWriter>())
      .def(py::init<py::object, const py::handle&>(), py::arg("io"), py::arg("fd"),
           "Writes through the IOHandle `io` to the file of descriptor `fd` (opened again; "
           "OSError, `io` closed).")
      .def("write", &TensorNvmeWriter::Write, py::arg("buffer"), py::arg("n_bytes"),
           py::arg("offset"), py::arg("callback") = py::none(),
           "Starts writing `n_bytes` from address `buffer` at `offset`; the memory must stay "
           "until ``synchronize()``.")
      .def("_start", &TensorNvmeWriter::Start, py::arg("data"), py::arg("offset"),
           py::arg("callback") = py::none(), "Starts writing `data` at `offset`.")
      .def("synchronize", &TensorNvmeWriter::Synchronize,
           "Waits for every write started, then runs their callbacks in order. Raises the first "
           "write's error (``OSError``, where TensorNVMe ignores it) after all are done. Ctrl-C "
           "interrupts the wait with every write still pending: the next call waits for them.")
      .def("close", &TensorNvmeWriter::Close,
           "Waits for the writes and stops the engine (their errors were ``synchronize()``'s).")
      .def_property("_io", &TensorNvmeWriter::io, &TensorNvmeWriter::set_io)
      .def_property_readonly("_file", &TensorNvmeWriter::file)
      .def_property_readonly("_forked", &TensorNvmeWriter::forked,
                             "Whether this runs in a child made by fork() (the writes are the "
                             "parent's).");
}
