// tensortier._core, the arguments of shared tensors' calls that need no torch objects, only what
// the Python layer reads off them (a torch.device's type and index): timeouts, where memory is
// and where it can be seen from, the rows a gather or scatter names and the values it writes,
// with the errors the package raises.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "arguments.hpp"
#include "gil.hpp"
#include "register.hpp"
#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/shared/shared_spec.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

// CudaError (tensortier._core's) "{prefix}no CUDA driver was found (why); {advice}" when there is
// no usable driver.
void RequireCudaDriver(const std::string& prefix, const std::string& advice) {
  const CudaDriver* driver = nullptr;
  {
    GilReleased release;  // the first call dlopens the driver and runs cuInit
    driver = &CudaDriver::Get();
  }
  if (driver->available()) return;
  py::object error = py::module_::import("tensortier._core").attr("CudaError");
  const std::string text =
      StrCat(prefix, "no CUDA driver was found (", driver->why_unavailable(), "); ", advice);
  PyErr_SetObject(error.ptr(), py::str(text).ptr());
  throw py::error_already_set();
}

// "host" or "device" for a device of type `type` (`dev`: how torch writes it) given to call
// `what`; ValueError for one neither CPU nor CUDA, CudaError for CUDA without a driver.
std::string MemoryOf(const std::string& type, const std::string& dev, const std::string& what) {
  if (type != "cpu" && type != "cuda") {
    throw py::value_error(StrCat(what, ": device must be 'cpu' or 'cuda', not ", dev));
  }
  if (type == "cpu") return "host";
  RequireCudaDriver(StrCat(what, " on ", dev, ": "), "use host memory (device='cpu')");
  return "device";
}

}  // namespace

void RegisterSharedArgs(py::module_& m) {
  m.def(
      "shared_attached_dtype",
      [](const py::object& core, const std::string& name) {
        py::module_ torch = py::module_::import("torch");
        std::string text = py::str(core.attr("dtype"));
        if (text.rfind("torch.", 0) == 0) text.erase(0, 6);
        py::object dtype = py::getattr(torch, text.c_str(), py::none());
        if (!py::isinstance(dtype, torch.attr("dtype"))) {
          throw py::value_error(StrCat("shared tensor ", PyRepr(name), " has dtype ",
                                       py::str(core.attr("dtype")).cast<std::string>(),
                                       ", unknown to torch"));
        }
        const auto element_size = core.attr("element_size").cast<int64_t>();
        const auto itemsize = dtype.attr("itemsize").cast<int64_t>();
        if (element_size != itemsize) {
          throw py::value_error(StrCat(
              "shared tensor ", PyRepr(name), ": its record's element_size ", element_size,
              " is not the size of ", py::str(dtype).cast<std::string>(), " (", itemsize, ")"));
        }
        return dtype;
      },
      py::arg("core"), py::arg("name"),
      "The torch.dtype of attached tensor `core`: ValueError unless its dtype (from a record "
      "anyone who reaches the store can write) is torch's and of the record's element size.");
  m.def(
      "shared_timeout_s",
      [](py::object timeout) {
        if (py::isinstance(timeout, py::module_::import("datetime").attr("timedelta"))) {
          timeout = timeout.attr("total_seconds")();
        }
        const int positive =
            PyUnicode_Check(timeout.ptr()) || PyBytes_Check(timeout.ptr())
                ? -1
                : PyObject_RichCompareBool(timeout.ptr(), py::int_(0).ptr(), Py_GT);
        if (positive < 0) {
          PyErr_Clear();
          throw py::type_error(
              StrCat("timeout must be seconds (a number) or a "
                     "datetime.timedelta, not ",
                     TypeName(timeout)));
        }
        if (positive == 0) {
          throw py::value_error(StrCat("timeout must be positive seconds, not ",
                                       py::repr(timeout).cast<std::string>()));
        }
        // Longer than a year is a wait without end (shared::DeadlineAfter's rule); held to a
        // year here, infinity included, every store call and deadline stays in range.
        constexpr double kYear = std::chrono::duration<double>(kLongestWait).count();
        return py::float_(std::min(py::float_(timeout).cast<double>(), kYear));
      },
      py::arg("timeout"),
      "A timeout (seconds, or a datetime.timedelta) as float seconds, a year at most (what is "
      "longer, infinity included, waits without end); ValueError unless positive, TypeError for "
      "what is neither.");
  m.def("require_cuda_driver", &RequireCudaDriver, py::arg("prefix"), py::arg("advice"),
        "CudaError '{prefix}no CUDA driver was found (why); {advice}' without a usable driver.");
  m.def("shared_memory_of", &MemoryOf, py::arg("type"), py::arg("device"), py::arg("what"),
        "'host' or 'device' for a device of torch type `type` ('cpu', 'cuda') given to `what`: "
        "ValueError for another type, CudaError for CUDA without a driver.");
  m.def(
      "shared_view_device",
      [](const py::object& core, const std::string& type, std::optional<int> index,
         const std::string& dev) -> std::optional<int> {
        const std::string memory = py::str(core.attr("memory"));
        if (py::str(core.attr("layout")).cast<std::string>() == "distributed") {
          if (MemoryOf(type, dev, "view") == "device") {
            throw py::value_error(
                StrCat("view on ", dev, ": only host memory (device='cpu') is supported"));
          }
          throw py::value_error(
              "a distributed tensor has no view of all its rows in one process: use gather(), "
              "or local() for this rank's rows");
        }
        if (memory == "device") {
          if (type != "cuda") {
            throw py::value_error(StrCat("view on ", dev,
                                         ": this shared tensor is in device memory; view it on "
                                         "'cuda'"));
          }
          return index ? *index : core.attr("stats")["device"].cast<int>();
        }
        if (type != "cuda") {
          MemoryOf(type, dev, "view");  // ValueError for a device neither CPU nor CUDA
          return std::nullopt;
        }
        RequireCudaDriver(StrCat("view on ", dev, ": "), "use host memory (device='cpu')");
        py::dict stats = core.attr("stats");
        if (!stats["cuda_registered"].cast<bool>()) {
          throw py::value_error(
              StrCat("view on ", dev, ": this host memory is not registered with CUDA (",
                     py::str(stats["cuda_registered_reason"]).cast<std::string>(), ")"));
        }
        return index ? *index : -1;
      },
      py::arg("core"), py::arg("type"), py::arg("index"), py::arg("device"),
      "The CUDA device a view of shared tensor `core` is made on for a torch device (its type, "
      "index and text): None for the CPU, -1 for torch's current device; ValueError for a "
      "device the memory cannot be seen from, CudaError for CUDA without a driver.");
  m.def(
      "shared_create_dtype",
      [](const py::object& dtype, const py::object& layout) {
        if (!py::isinstance(dtype, py::module_::import("torch").attr("dtype"))) {
          throw py::type_error(StrCat("dtype must be a torch.dtype, not ",
                                      py::str(py::type::handle_of(dtype).attr("__name__"))));
        }
        if (!py::isinstance<py::str>(layout)) {
          throw py::value_error(StrCat("layout must be ",
                                       JoinNames(kSharedLayoutNames, ", ", " or ", "'"), ", not ",
                                       ReprOf(layout)));
        }
        ParseSharedLayout(layout.cast<std::string>());
        return dtype.attr("itemsize");
      },
      py::arg("dtype"), py::arg("layout"),
      "The element size of create_tensor's `dtype`: TypeError unless a torch.dtype, ValueError "
      "for a layout other than 'continuous', 'chunked' or 'distributed'.");
  m.def(
      "shared_create_args",
      [](const std::string& layout, const std::string& memory, const py::object& name, int rank,
         int world_size) {
        if (memory == "device" && layout == "distributed") {
          throw py::value_error(
              "the distributed layout keeps rows in host memory: use device='cpu'");
        }
        CheckNameArgument(name, "name");
        if (layout != "distributed") return;
        std::optional<std::pair<int, int>> torch_group;  // the default process group's
        py::module_ dist = py::module_::import("torch.distributed");
        if (dist.attr("is_available")().cast<bool>() &&
            dist.attr("is_initialized")().cast<bool>()) {
          torch_group = {dist.attr("get_rank")().cast<int>(),
                         dist.attr("get_world_size")().cast<int>()};
        }
        if (!torch_group) {
          throw py::value_error(
              "the distributed layout moves rows through torch.distributed: initialise its "
              "default process group first (torch.distributed.init_process_group('gloo'))");
        }
        if (torch_group->first != rank || torch_group->second != world_size) {
          throw py::value_error(StrCat("this group is rank ", rank, " of ", world_size,
                                       "; torch.distributed's default group is rank ",
                                       torch_group->first, " of ", torch_group->second));
        }
      },
      py::arg("layout"), py::arg("memory"), py::arg("name"), py::arg("rank"), py::arg("world_size"),
      "ValueError for create_tensor arguments that do not go together: device memory with the "
      "distributed layout, a name that is not a non-empty str, the distributed layout without "
      "torch.distributed's default group or with one whose rank and size are not this group's.");
  m.def(
      "shared_check_indices",
      [](const std::string& device, const std::string& dtype, const std::vector<int64_t>& shape) {
        if (device != "cpu") {
          throw py::value_error(StrCat("indices must be on the CPU, not ", device));
        }
        if (dtype == "torch.uint8" || dtype == "torch.bool") {
          // torch indexing takes these as a mask (t[mask]); index_select refuses them.
          throw py::type_error(StrCat("indices of ", dtype,
                                      " are a mask in torch's indexing, not row numbers: pass "
                                      "row numbers (mask.nonzero().flatten() for a mask)"));
        }
        if (dtype != "torch.int64" && dtype != "torch.int32" && dtype != "torch.int16" &&
            dtype != "torch.int8") {
          throw py::type_error(StrCat("indices must be integers, not ", dtype));
        }
        if (shape.size() != 1) {
          throw py::value_error(
              StrCat("indices must be one-dimensional, not of shape ", PyTuple(shape)));
        }
      },
      py::arg("device"), py::arg("dtype"), py::arg("shape"),
      "ValueError or TypeError for gather or scatter indices (a tensor's device, dtype and "
      "shape) that are not one-dimensional integers on the CPU.");
  m.def(
      "shared_check_values",
      [](const std::string& dtype, const std::string& want_dtype, const std::vector<int64_t>& shape,
         const std::vector<int64_t>& want_shape, const std::optional<std::string>& device) {
        if (dtype != want_dtype) {
          throw py::type_error(
              StrCat("values are ", dtype, "; this shared tensor holds ", want_dtype));
        }
        if (shape != want_shape) {
          throw py::value_error(
              StrCat("values have shape ", PyTuple(shape), "; expected ", PyTuple(want_shape)));
        }
        if (device && *device != "cpu") {
          throw py::value_error(StrCat("values must be on the CPU, not ", *device));
        }
      },
      py::arg("dtype"), py::arg("want_dtype"), py::arg("shape"), py::arg("want_shape"),
      py::arg("device") = py::none(),
      "TypeError for scatter values of another dtype, ValueError for another shape or, when "
      "`device` (theirs) is given, for values not on the CPU.");
}
