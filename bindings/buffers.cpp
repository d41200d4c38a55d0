// Host memory: page-aligned buffers, their huge-page policy, and the address of a buffer export.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "arguments.hpp"
#include "gil.hpp"
#include "register.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/parallel_copy.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

// The memory of a buffer export (bytes, bytearray, memoryview, numpy array, mmap...) as
// (address, nbytes, a memoryview holding the export: the object cannot be resized while it
// lives), or None when `obj` has no buffer protocol. ValueError naming its type: read-only where
// `writable` (a read target), not C-contiguous, or its export refused (BufferError).
py::object HostRange(const py::object& obj, bool writable) {
  if (PyObject_CheckBuffer(obj.ptr()) == 0) return py::none();
  const std::string type = TypeName(obj);
  PyObject* raw = PyMemoryView_FromObject(obj.ptr());
  if (raw == nullptr) {
    py::error_already_set error;
    if (!error.matches(PyExc_BufferError)) throw error;
    throw py::value_error(type + ": " + py::str(error.value()).cast<std::string>());
  }
  const auto view = py::reinterpret_steal<py::object>(raw);
  const Py_buffer* b = PyMemoryView_GET_BUFFER(raw);
  if (writable && b->readonly) {
    throw py::value_error(type +
                          " is read-only and cannot be read into: pass a writable buffer "
                          "(bytearray, numpy array, tensor)");
  }
  if (PyBuffer_IsContiguous(b, 'C') == 0) {
    throw py::value_error(type + " is not C-contiguous: make a contiguous copy first");
  }
  const auto address = b->len == 0 ? uintptr_t{0} : reinterpret_cast<uintptr_t>(b->buf);
  return py::make_tuple(address, static_cast<uint64_t>(b->len), view);
}

}  // namespace

void RegisterBuffers(py::module_& m) {
  m.def("huge_pages_policy", &HugePagesPolicy,
        "Which page-aligned buffers ask for transparent huge pages in this process, and why.");
  m.def("host_range", &HostRange, py::arg("obj"), py::arg("writable"),
        "(address, nbytes, memoryview) of a buffer export, or None for an object without the "
        "buffer protocol; ValueError for a read-only (when `writable`) or non-contiguous one.");
  m.def(
      "copy_ranges",
      [](const std::vector<uintptr_t>& dst, const std::vector<uintptr_t>& src,
         const std::vector<uint64_t>& nbytes, unsigned threads) {
        if (src.size() != dst.size() || nbytes.size() != dst.size()) {
          throw std::invalid_argument("copy_ranges: one value per range in each list");
        }
        std::vector<CopyRange> ranges(dst.size());
        for (size_t i = 0; i < ranges.size(); ++i) {
          ranges[i] = {reinterpret_cast<std::byte*>(dst[i]),
                       reinterpret_cast<const std::byte*>(src[i]), static_cast<size_t>(nbytes[i])};
        }
        GilReleased release;
        ParallelCopy(ranges, threads);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("threads"),
      "Copies nbytes[i] bytes of host memory from src[i] to dst[i] for every i, on up to "
      "`threads` threads, the GIL released.");
  // Page-aligned host memory with the buffer protocol (numpy/torch.frombuffer wrap it).
  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init([](const py::int_& size, bool reused, bool resident) {
             const std::string cannot = StrCat("aligned_empty: cannot allocate ",
                                               py::str(size).cast<std::string>(), " bytes");
             const unsigned long long bytes = PyLong_AsUnsignedLongLong(size.ptr());
             // Not an integer a size_t holds, or past any address space.
             if (PyErr_Occurred() != nullptr || bytes >= uint64_t{1} << 63) {
               PyErr_Clear();
               PyErr_SetString(PyExc_MemoryError, cannot.c_str());
               throw py::error_already_set();
             }
             try {
               GilReleased release;  // faulting in gigabytes takes seconds
               return AlignedBuffer(static_cast<size_t>(bytes),
                                    reused ? Pages::kReused : Pages::kTouchedOnce,
                                    resident ? Populate::kUpFront : Populate::kOnDemand);
             } catch (const std::bad_alloc& e) {
               PyErr_SetString(PyExc_MemoryError, StrCat(cannot, " (", e.what(), ")").c_str());
               throw py::error_already_set();
             }
           }),
           py::arg("size"), py::arg("reused") = false, py::arg("resident") = false,
           "size bytes of page-aligned memory; MemoryError naming size (aligned_empty's) for "
           "sizes past any address space or memory not to be had.")
      .def_property_readonly("locked", &AlignedBuffer::locked)
      .def("__len__", &AlignedBuffer::size)
      .def_property_readonly(
          "address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(b.size())}, {1});
      });
}
