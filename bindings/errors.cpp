#include "errors.hpp"

#include <optional>
#include <stdexcept>
#include <system_error>

#include "paths.hpp"
#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/cuda/cufile.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"

namespace py = pybind11;

namespace tensortier {
namespace {

// Made once by RegisterErrors; leaked, as the module that holds them lives until exit.
PyObject* cuda_error_type = nullptr;
PyObject* cufile_error_type = nullptr;
PyObject* format_error_type = nullptr;
PyObject* unsupported_format_error_type = nullptr;
PyObject* shared_storage_error_type = nullptr;

py::object Call(PyObject* type, py::tuple args) {
  PyObject* error = PyObject_Call(type, args.ptr(), nullptr);
  if (error == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(error);
}

py::object OsError(const IoError& e) {
  // OSError(errno, reason, filename): Python picks the subclass (FileNotFoundError...) and shows
  // "[Errno N] reason: 'filename'", so the reason leaves out the errno and path what() has. The
  // path may be any bytes: decoded as os.fsdecode, never failing, so e.filename is the str that
  // names the file.
  py::object error = Call(PyExc_OSError, py::make_tuple(e.error_code(), MessageToPython(e.reason()),
                                                        PathToPython(e.path())));
  error.attr("offset") = e.offset();
  error.attr("length") = e.length();
  error.attr("op") = e.op();
  return error;
}

py::object WithCode(PyObject* type, const char* what, int code) {
  py::object error = Call(type, py::make_tuple(MessageToPython(what)));
  error.attr("code") = code;
  return error;
}

// The Python exception for `error`, or nothing for errors pybind11 translates itself.
std::optional<py::object> Translate(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const IoError& e) {
    return OsError(e);
  } catch (const std::system_error& e) {
    if (e.code().category() != std::generic_category() &&
        e.code().category() != std::system_category()) {
      return std::nullopt;
    }
    return Call(PyExc_OSError, py::make_tuple(e.code().value(), MessageToPython(e.what())));
  } catch (const UnsupportedFormatError& e) {
    return Call(unsupported_format_error_type, py::make_tuple(MessageToPython(e.what())));
  } catch (const FormatError& e) {
    return Call(format_error_type, py::make_tuple(MessageToPython(e.what())));
  } catch (const std::invalid_argument& e) {
    return Call(PyExc_ValueError, py::make_tuple(MessageToPython(e.what())));
  } catch (const CudaError& e) {
    return WithCode(cuda_error_type, e.what(), e.code());
  } catch (const CuFileError& e) {
    return WithCode(cufile_error_type, e.what(), e.code());
  } catch (...) {
    return std::nullopt;
  }
}

}  // namespace

void RegisterErrors(py::module_& m) {
  cuda_error_type = PyErr_NewExceptionWithDoc(
      "tensortier._core.CudaError",
      "A failed CUDA driver call, or no usable driver; .code is the CUresult.", PyExc_RuntimeError,
      nullptr);
  cufile_error_type = PyErr_NewExceptionWithDoc(
      "tensortier._core.CuFileError",
      "A failed cuFile call that is not a data transfer, or cuFile unavailable; .code is the "
      "CUfileOpError (-1: unavailable).",
      PyExc_RuntimeError, nullptr);
  format_error_type = PyErr_NewExceptionWithDoc(
      "tensortier._core.FormatError",
      "A file that is not what it claims to be (truncated, damaged, malformed): a ValueError.",
      PyExc_ValueError, nullptr);
  unsupported_format_error_type = PyErr_NewExceptionWithDoc(
      "tensortier._core.UnsupportedFormatError",
      "A well-formed file of a format (or version) not read here, such as a legacy torch.save "
      "file: a FormatError, and so a ValueError, but not damage.",
      format_error_type, nullptr);
  // safetensors' save_file raises RuntimeError for tensors that share memory.
  const py::tuple value_and_runtime =
      py::make_tuple(py::handle(PyExc_ValueError), py::handle(PyExc_RuntimeError));
  shared_storage_error_type = PyErr_NewExceptionWithDoc(
      "tensortier._core.SharedStorageError",
      "Tensors that share memory given to a safetensors save, which cannot express it: a "
      "ValueError, and the RuntimeError safetensors' save_file raises.",
      value_and_runtime.ptr(), nullptr);
  if (cuda_error_type == nullptr || cufile_error_type == nullptr || format_error_type == nullptr ||
      unsupported_format_error_type == nullptr || shared_storage_error_type == nullptr) {
    throw py::error_already_set();
  }
  m.attr("SharedStorageError") = py::handle(shared_storage_error_type);
  m.attr("FormatError") = py::handle(format_error_type);
  m.attr("UnsupportedFormatError") = py::handle(unsupported_format_error_type);
  m.attr("CudaError") = py::handle(cuda_error_type);
  m.attr("CuFileError") = py::handle(cufile_error_type);
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    std::optional<py::object> error = Translate(p);
    if (!error) std::rethrow_exception(p);  // pybind11's own translation
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error->ptr())), error->ptr());
  });
}

py::object PythonError(const std::exception_ptr& error) {
  if (std::optional<py::object> translated = Translate(error)) return *translated;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return Call(PyExc_RuntimeError, py::make_tuple(MessageToPython(e.what())));
  } catch (...) {
    return Call(PyExc_RuntimeError, py::make_tuple("unknown C++ exception"));
  }
}

}  // namespace tensortier
