// tensortier._core, the paths and files the Python API takes: fspath() for every path argument,
// io_file() for the file of an IOHandle transfer's piece, and a DiskOffloader's directories.
#include <pybind11/pybind11.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "arguments.hpp"
#include "gil.hpp"
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

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// os.path.abspath for a path's bytes: joined to the working directory, then normalized as
// posixpath.normpath does ("." and empty parts dropped, ".." taken back, "//" kept at the start).
std::string AbsolutePath(const std::string& path) {
  std::string joined = path;
  if (path.empty() || path[0] != '/') {
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof cwd) == nullptr) {
      PyErr_SetFromErrno(PyExc_OSError);
      throw py::error_already_set();
    }
    joined = StrCat(cwd, path.empty() || std::string_view(cwd) == "/" ? "" : "/", path);
  }
  const size_t slashes = joined.rfind("//", 0) == 0 && joined.rfind("///", 0) != 0 ? 2 : 1;
  std::vector<std::string> parts;
  for (size_t start = 0; start <= joined.size();) {
    size_t end = joined.find('/', start);
    if (end == std::string::npos) end = joined.size();
    const std::string part = joined.substr(start, end - start);
    if (part == "..") {
      if (!parts.empty()) parts.pop_back();
    } else if (!part.empty() && part != ".") {
      parts.push_back(part);
    }
    start = end + 1;
  }
  std::string out(slashes, '/');
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? "/" : "") + parts[i];
  return out;
}

// os.makedirs(path, exist_ok=True) for a normalized absolute path: 0, or the errno of the mkdir
// that failed, its path in `failed`.
int MakeDirectories(const std::string& path, std::string& failed) {
  const size_t slash = path.rfind('/');
  const std::string head = path.substr(0, slash == 0 ? 1 : slash);
  struct stat st;
  if (slash + 1 < path.size() && stat(head.c_str(), &st) != 0) {
    const int code = MakeDirectories(head, failed);
    if (code != 0 && code != EEXIST) return code;
  }
  if (mkdir(path.c_str(), 0777) == 0) return 0;
  const int code = errno;
  if (IsDirectory(path)) return 0;
  failed = path;
  return code;
}

}  // namespace

py::str tensortier::FsPathArgument(const py::handle& path, const std::string& what, bool bytes_ok) {
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
          GilReleased release;
          opened = File::Open(path, mode, direct);
        }
        return py::cast(std::move(opened));
      },
      py::arg("file"), py::arg("write"), py::arg("direct"),
      "An IOHandle's piece's file: an open File as it is (ValueError once closed), a path "
      "opened 'a' for a write or 'r' for a read.");
  m.def(
      "offload_directories",
      [](const py::object& dir_name) {
        py::list given;
        if (IsPathLike(dir_name)) {
          given.append(dir_name);
        } else if (!py::isinstance(dir_name,
                                   py::module_::import("collections.abc").attr("Iterable"))) {
          throw py::type_error(
              StrCat("dir_name must be a path (str, bytes or os.PathLike) or a "
                     "list of paths, not ",
                     TypeName(dir_name)));
        } else {
          given = py::list(dir_name);
        }
        py::list out;
        for (const py::handle d : given) {
          out.append(PathToPython(AbsolutePath(FsPathArgument(d, "dir_name").cast<FsPath>())));
        }
        if (out.empty()) throw py::value_error("DiskOffloader needs at least one directory");
        return out;
      },
      py::arg("dir_name"),
      "A DiskOffloader's dir_name (a path or a list of paths) as absolute paths, as "
      "os.path.abspath gives them; TypeError for anything else, ValueError for none.");
  m.def(
      "make_directories",
      [](const std::vector<FsPath>& dirs) {
        for (const FsPath& d : dirs) {
          struct stat st;
          if (stat(d.bytes.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
            // makedirs would say "File exists", which reads as if all were well.
            PyErr_SetObject(PyExc_OSError, py::make_tuple(ENOTDIR, "dir_name is not a directory",
                                                          PathToPython(d.bytes))
                                               .ptr());
            throw py::error_already_set();
          }
          std::string failed;
          if (const int code = MakeDirectories(d.bytes, failed); code != 0) {
            errno = code;
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, PathToPython(failed).ptr());
            throw py::error_already_set();
          }
        }
      },
      py::arg("dirs"),
      "Creates each of the absolute `dirs` and the directories above it, as os.makedirs with "
      "exist_ok; NotADirectoryError for one that is a file.");
}
