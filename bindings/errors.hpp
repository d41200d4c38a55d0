// The one translation of tensortier's C++ errors into Python exceptions (bindings/errors.cpp):
//   IoError (CuFileTransferError too)  -> OSError(errno, message, path), the errno's subclass
//                                         (FileNotFoundError...), with .offset, .length and .op
//   std::system_error of an errno      -> OSError(errno, message): failures that concern no file
//   FormatError                        -> tensortier._core.FormatError (a ValueError)
//   std::invalid_argument              -> ValueError
//   CudaError                          -> tensortier.CudaError (a RuntimeError), with .code
//   CuFileError                        -> tensortier.CuFileError (a RuntimeError), with .code
//   anything else                      -> pybind11's own (MemoryError, IndexError, RuntimeError)
#pragma once

#include <exception>

#include <pybind11/pybind11.h>

namespace tensortier {

// Creates CudaError, CuFileError and FormatError in `m` and installs the translator. Call first.
void RegisterErrors(pybind11::module_& m);

// The Python exception for `error`, as an object (not raised), for results that carry an error
// per item. Requires the GIL.
pybind11::object PythonError(const std::exception_ptr& error);

}  // namespace tensortier
