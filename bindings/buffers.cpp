// Host memory: page-aligned buffers, their huge-page policy, and the address of a buffer export.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "register.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/parallel_copy.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

// Address of a C-contiguous buffer export (memoryview, bytearray, numpy array...).
uintptr_t BufferAddress(const py::object& obj, bool writable) {
  Py_buffer view;
  int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) throw py::error_already_set();
  auto address = reinterpret_cast<uintptr_t>(view.buf);
  PyBuffer_Release(&view);
  return address;
}

}  // namespace

void RegisterBuffers(py::module_& m) {
  m.def("huge_pages_policy", &HugePagesPolicy,
        "Which page-aligned buffers ask for transparent huge pages in this process, and why.");
  m.def("buffer_address", &BufferAddress, py::arg("obj"), py::arg("writable"),
        "Address of a C-contiguous buffer export; raises BufferError if it is not one.");
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
        py::gil_scoped_release release;
        ParallelCopy(ranges, threads);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("threads"),
      "Copies nbytes[i] bytes of host memory from src[i] to dst[i] for every i, on up to "
      "`threads` threads, the GIL released.");
  // Page-aligned host memory with the buffer protocol (numpy/torch.frombuffer wrap it).
  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init([](size_t size, bool reused, bool resident) {
             py::gil_scoped_release release;  // faulting in gigabytes takes seconds
             return AlignedBuffer(size, reused ? Pages::kReused : Pages::kTouchedOnce,
                                  resident ? Populate::kUpFront : Populate::kOnDemand);
           }),
           py::arg("size"), py::arg("reused") = false, py::arg("resident") = false)
      .def_property_readonly("locked", &AlignedBuffer::locked)
      .def("__len__", &AlignedBuffer::size)
      .def_property_readonly(
          "address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(b.size())}, {1});
      });
}
