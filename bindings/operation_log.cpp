// An IOHandle's record of its operations: those not known to be over, and finished ones whose
// error nobody has been given yet, each with the Python future that keeps its memory alive.
// wait_all() raises each failure once, whether its future was waited for or dropped. Every call
// holds the GIL, which guards the record; waits release it, and Ctrl-C interrupts them with
// nothing lost. And the futures themselves (tensortier.IOFuture's base).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "binding_helpers.hpp"
#include "cycle_collected.hpp"
#include "errors.hpp"
#include "gil.hpp"
#include "register.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/transfer/operation.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/process_identity.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

class OperationLog {
 public:
  // Records `op` (its future keeps its memory alive); forgets the operations over whose error
  // was given, or that had none.
  void Add(const Operation& op, py::object future) {
    std::erase_if(pending_,
                  [](const Pending& p) { return p.op.done() && !p.op.HasUndeliveredError(); });
    pending_.push_back({op, std::move(future)});
  }

  // Starts `host` pieces (file, address, length, offset) on `engine` and each `device` piece
  // (address, nbytes, device, stream, file, offset) on `route` (a DeviceRoute), and records the
  // operation with its future, `future_type(operation, keepalive)`, in one call: Ctrl-C, raised
  // only between Python instructions, cannot come between a start and the record and leave an
  // operation running on memory nothing keeps alive. `on_device[i]`: whether the caller's piece
  // i is a device piece (empty: none is). A device piece refused records what started, then
  // raises.
  py::object Submit(const py::object& engine, const std::string& op,
                    const std::vector<std::tuple<File, uintptr_t, uint64_t, uint64_t>>& host,
                    bool stage_reads, const py::object& future_type, py::object keepalive,
                    const py::object& route, const py::list& device, std::vector<bool> on_device) {
    const std::optional<IoOp> parsed = ValueOf(kIoOpNames, op);
    if (!parsed)
      throw std::invalid_argument(StrCat("op must be 'read' or 'write', not '", op, "'"));
    if (on_device.empty()) on_device.assign(host.size(), false);
    if (std::count(on_device.begin(), on_device.end(), true) != py::ssize_t(device.size()) ||
        on_device.size() != host.size() + device.size()) {
      throw std::invalid_argument(
          "on_device must have an entry per piece, true for each device one");
    }
    Future started;
    if (!host.empty() || device.size() == 0) {  // an empty operation still goes through the engine
      std::vector<IoDesc> descs;
      descs.reserve(host.size());
      for (const auto& [file, address, length, offset] : host) {
        descs.push_back({file, reinterpret_cast<void*>(address), offset, length});
      }
      Engine& e = engine.cast<Engine&>();
      GilReleased release;
      started = e.Submit(*parsed, descs, SubmitOptions{.stage_reads = stage_reads});
    }
    std::vector<DeviceJob> jobs;
    std::exception_ptr refused;
    for (const py::handle piece : device) {
      try {
        py::tuple p = py::reinterpret_borrow<py::tuple>(piece);
        jobs.push_back(route.attr("start")(engine, op, *p).cast<DeviceJob>());
      } catch (...) {
        refused = std::current_exception();
        break;
      }
    }
    if (refused) {  // the pieces that did not start are not the operation's
      std::vector<bool> kept;
      size_t device_seen = 0;
      for (const bool d : on_device) {
        if (d && device_seen++ >= jobs.size()) continue;
        kept.push_back(d);
      }
      on_device = std::move(kept);
    }
    const Operation operation(started, std::move(jobs), std::move(on_device));
    py::object future = future_type(operation, std::move(keepalive));
    Add(operation, future);
    if (refused) std::rethrow_exception(refused);
    return future;
  }

  // Waits for every operation recorded, then for those other threads submit meanwhile (whose
  // errors are their futures'); raises the first error nobody was given, the number of the
  // others in a note on it. Interrupted (Ctrl-C), it gives back the errors it took and keeps
  // every operation not yet seen over for the next wait.
  void WaitAll(Engine& engine) {
    std::vector<Pending> pending;
    pending.swap(pending_);
    std::vector<Pending> failed;
    std::exception_ptr first;
    size_t next = 0;
    try {
      for (; next < pending.size(); ++next) {
        const Operation& op = pending[next].op;
        WaitInterruptibly([&](auto timeout) { return op.WaitFor(timeout); }, true);
        std::exception_ptr error;
        {
          GilReleased release;
          error = op.TakeUndeliveredError();
        }
        if (error) {
          if (!first) first = error;
          failed.push_back(std::move(pending[next]));
        }
      }
      GilReleased release;
      try {
        engine.WaitAll();
      } catch (const IoError&) {
      } catch (const std::system_error&) {
      }
    } catch (...) {
      for (const Pending& p : failed) p.op.ReturnError();
      failed.insert(failed.end(), std::make_move_iterator(pending.begin() + next),
                    std::make_move_iterator(pending.end()));
      pending_.insert(pending_.begin(), std::make_move_iterator(failed.begin()),
                      std::make_move_iterator(failed.end()));
      throw;
    }
    if (!first) return;
    py::object error = PythonError(first);
    if (failed.size() > 1) {
      py::module_::import("tensortier._notes")
          .attr("add_note")(
              error, StrCat(failed.size() - 1, " other operation(s) of this IOHandle also failed"));
    }
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    throw py::error_already_set();
  }

  size_t size() const { return pending_.size(); }
  void Clear() { pending_.clear(); }

  // For the cycle collector (cycle_collected.hpp): a future's memory may refer back to its owner.
  int Traverse(visitproc visit, void* arg) const {
    for (const Pending& p : pending_) Py_VISIT(p.future.ptr());
    return 0;
  }
  void ClearReferences() {
    std::vector<Pending> pending;
    pending.swap(pending_);
  }

 private:
  struct Pending {
    Operation op;
    py::object future;
  };
  std::vector<Pending> pending_;
};

// "Made in another process" of an IOHandle or IOFuture used in a child made by fork().
std::string ForkedMessage(const std::string& what, pid_t pid) {
  return ForkedUseMessage(what, pid, "its engine's worker threads do not exist",
                          "make a new IOHandle in the child");
}

// An operation submitted, with the Python objects whose memory it uses (kept until it is over)
// and, once known, its outcome: the result, or its error, raised to every caller (an interrupt
// of the wait is never the outcome).
class IOFuture {
 public:
  IOFuture(Operation op, py::object keepalive)
      : op_(std::move(op)), keepalive_(std::move(keepalive)) {}
  IOFuture(const IOFuture&) = delete;
  IOFuture& operator=(const IOFuture&) = delete;

  // The memory must outlive the I/O, Ctrl-C or not (in a fork's child nothing runs it).
  ~IOFuture() {
    if (!keepalive_.is_none() && !maker_.Forked()) {
      WaitInterruptibly([&](auto timeout) { return op_.WaitFor(timeout); }, false);
    }
  }

  // result(): waits (Ctrl-C interrupts the wait), then `result_type(**result)` or the error.
  py::object Outcome(const py::handle& result_type) {
    if (maker_.Forked() && outcome_.is_none()) {
      throw py::value_error(ForkedMessage("IOFuture", maker_.pid()));
    }
    if (outcome_.is_none()) {
      try {
        outcome_ = result_type(**py::cast(op_).attr("result")());
      } catch (py::error_already_set& e) {
        if (!e.matches(PyExc_Exception)) throw;
        outcome_ = e.value();
      }
      keepalive_ = py::none();
    }
    if (PyExceptionInstance_Check(outcome_.ptr())) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(outcome_.ptr())), outcome_.ptr());
      throw py::error_already_set();
    }
    return outcome_;
  }

  const Operation& op() const { return op_; }

  // For the cycle collector: the memory kept alive may refer back to what holds the future.
  // Garbage is let go only once its operation is over, as the destructor does.
  int Traverse(visitproc visit, void* arg) const {
    Py_VISIT(keepalive_.ptr());
    Py_VISIT(outcome_.ptr());
    return 0;
  }
  void ClearReferences() {
    if (!keepalive_.is_none() && !maker_.Forked()) {
      WaitInterruptibly([&](auto timeout) { return op_.WaitFor(timeout); }, false);
    }
    keepalive_ = py::none();
    outcome_ = py::none();
  }

 private:
  Operation op_;
  py::object keepalive_;
  py::object outcome_ = py::none();
  MakerProcess maker_;
};

}  // namespace

void RegisterOperationLog(py::module_& m) {
  py::class_<OperationLog>(m, "OperationLog", CycleCollected<OperationLog>())
      .def(py::init<>())
      .def("add", &OperationLog::Add, py::arg("operation"), py::arg("future"),
           "Records an operation and the future that keeps its memory alive.")
      .def("submit", &OperationLog::Submit, py::arg("engine"), py::arg("op"), py::arg("host"),
           py::arg("stage_reads"), py::arg("future_type"), py::arg("keepalive"),
           py::arg("route") = py::none(), py::arg("device") = py::list(),
           py::arg("on_device") = std::vector<bool>(),
           "Starts the host pieces on the engine and the device ones (address, nbytes, device, "
           "stream, file, offset) on the DeviceRoute, and records the operation with its future "
           "(future_type(operation, keepalive)), returned, in one call; `on_device` says which "
           "of the caller's pieces is which.")
      .def("wait_all", &OperationLog::WaitAll, py::arg("engine"),
           "Waits for every operation, then for the engine's; raises the first error nobody was "
           "given (a note counts the others).")
      .def("__len__", &OperationLog::size)
      .def("clear", &OperationLog::Clear, "Forgets every operation (no wait).");
  py::class_<IOFuture>(m, "IOFuture", CycleCollected<IOFuture>(),
                       "tensortier.IOFuture's state (the Python class adds its API).")
      .def(py::init<Operation, py::object>(), py::arg("operation"), py::arg("keepalive"))
      .def_property_readonly("_op", &IOFuture::op, "The operation (_core.Operation).")
      .def("_outcome", &IOFuture::Outcome, py::arg("result_type"),
           "result(): `result_type(**fields)`, or raises the operation's error (every time).");
  m.def("forked_message", &ForkedMessage, py::arg("what"), py::arg("pid"),
        "The error of an IOHandle or IOFuture made in process `pid`, used in a child of fork().");
}
