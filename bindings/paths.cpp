// tensortier._core, the paths and files the Python API takes: fspath() for every path argument
// and io_file() for the file of an IOHandle transfer's piece.
#include <pybind11/pybind11.h>

#include <string>
#include <string_view>
#include <utility>

#include "arguments.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

bool IsPathLike(const py::handle& value) {
  return PyUnicode_Check(value.ptr()) || PyBytes_Check(value.ptr()) ||
         PyObject_HasAttrString(reinterpret_cast<PyObject*>(Py_TYPE(value.ptr())), "__fspath__");
}

}  // namespace

py::str tensortier::FsPathArgument(const py::handle& path, const std::string& what,
                                 bool bytes_ok) {
  if (IsPathLike(path)) {
    PyObject* p = PyOS_FSPath(path.ptr());  // str or bytes; TypeError from a bad __fspath__
    if (p == nullptr) throw py::error_already_set();
    const auto owned = py::reinterpret_steal<py::object>(p);
    if (PyUnicode_Check(p)) return owned;
    if (bytes_ok) {
      return PathToPython(std::string_view(PyBytes_AS_STRING(p), PyBytes_GET_SIZE(p)));
    }
  }
  throw py::type_error(StrCat(what, " must be ",
                              bytes_ok ? "str, bytes or os.PathLike" : "str or os.PathLike",
                              ", not ", TypeName(path)));
}

void RegisterPaths(py::module_& m) {
  m.def("fspath", &FsPathArgument, py::arg("path"), py::arg("what") = "path", py::kw_only(),
        py::arg("bytes_ok") = true,
        "`path` (str, bytes or os.PathLike) as a str that os.fsencode turns into its exact "
        "bytes; TypeError naming `what` and the types accepted (bytes refused unless "
        "`bytes_ok`).");
  m.def(
      "io_file",
      [](const py::object& file, bool write, bool direct) -> py::object {
        if (py::isinstance<File>(file)) {
          if (!file.cast<const File&>().is_open()) throw py::value_error("file is closed");
          return file;
        }
        if (!IsPathLike(file)) {
          throw py::type_error(
              StrCat("file must be a path or a tensortier.File, not ", TypeName(file)));
        }
        const FsPath path = file.cast<FsPath>();
        const OpenMode mode = ParseOpenMode(write ? "a" : "r");
        File opened;
        {
          py::gil_scoped_release release;
          opened = File::Open(path, mode, direct);
        }
        return py::cast(std::move(opened));
      },
      py::arg("file"), py::arg("write"), py::arg("direct"),
      "An IOHandle's piece's file: an open File as it is (ValueError once closed), a path "
      "opened 'a' for a write or 'r' for a read.");
}
