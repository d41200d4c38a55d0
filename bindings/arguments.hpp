// Arguments of the Python API checked where they cross into C++, with messages that name the
// argument as the API does (not pybind's listing of a binding's signature). Each takes None as
// "not given" (nullopt).
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace tensortier {

// repr(value), for messages.
inline std::string ReprOf(const pybind11::handle& value) {
  return pybind11::repr(value).cast<std::string>();
}

// The name of `value`'s type, for messages ("float").
inline std::string TypeName(const pybind11::handle& value) {
  const pybind11::handle type(reinterpret_cast<PyObject*>(Py_TYPE(value.ptr())));
  return type.attr("__name__").cast<std::string>();
}

// A Python int that is not a bool (numpy's integers are not ints: refused as the API refuses
// floats).
inline bool IsPlainInt(const pybind11::handle& value) {
  return PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr());
}

// `value` as a positive integer of type T; one beyond T's range is T's largest, which the
// settings' range checks then refuse naming the range. ValueError "<name> must be a positive
// integer, not <repr>" for anything else.
template <typename T>
std::optional<T> PositiveArgument(const pybind11::object& value, const char* name) {
  if (value.is_none()) return std::nullopt;
  int overflow = 0;
  long long number = IsPlainInt(value) ? PyLong_AsLongLongAndOverflow(value.ptr(), &overflow) : 0;
  if (overflow > 0) number = LLONG_MAX;
  if (number <= 0) {
    throw pybind11::value_error(std::string(name) + " must be a positive integer, not " +
                                ReprOf(value));
  }
  const auto largest = static_cast<unsigned long long>(std::numeric_limits<T>::max());
  return static_cast<T>(std::min(static_cast<unsigned long long>(number), largest));
}

// `value` as True or False: bools, 0, 1 and what equals them (numpy's bools: what a config file
// or argparse hands over); not strings such as "no". TypeError naming the argument.
inline std::optional<bool> FlagArgument(const pybind11::object& value, const char* name) {
  if (value.is_none()) return std::nullopt;
  if (!PyUnicode_Check(value.ptr()) && !PyBytes_Check(value.ptr())) {
    for (bool flag : {false, true}) {
      const int equal = PyObject_RichCompareBool(value.ptr(), flag ? Py_True : Py_False, Py_EQ);
      if (equal < 0) PyErr_Clear();  // an array's ambiguous truth: not a flag
      if (equal > 0) return flag;
    }
  }
  throw pybind11::type_error(std::string(name) + " must be True or False, not " + ReprOf(value));
}

// A file offset: an integer (numpy's and torch's too, through __index__) from 0 to 2**63 - 1.
// TypeError "offset must be an int" for a bool or a non-integer, ValueError outside the range.
inline uint64_t OffsetArgument(const pybind11::handle& value) {
  namespace py = pybind11;
  PyObject* index = PyBool_Check(value.ptr()) ? nullptr : PyNumber_Index(value.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    throw py::type_error("offset must be an int, not " + TypeName(value));
  }
  const auto number = py::reinterpret_steal<py::int_>(index);
  int overflow = 0;
  const long long offset = PyLong_AsLongLongAndOverflow(number.ptr(), &overflow);
  if (overflow != 0 || offset < 0) {
    throw py::value_error("offset must be from 0 to 2**63 - 1, not " +
                          py::str(number).cast<std::string>());
  }
  return static_cast<uint64_t>(offset);
}

// `value` as a C integer of `bits` bits, signed unless `is_unsigned`, as a pybind11 binding of a
// compatible API (DeepSpeed's) takes one: any integer, numpy's and torch's too (through
// __index__), bools too (pybind11's int conversion takes them: True is 1). TypeError "<what>:
// <name> must be an integer" or "must fit ..."; ValueError below `minimum`.
inline pybind11::int_ CIntegerArgument(const pybind11::object& value, const std::string& what,
                                       const std::string& name, long long minimum, int bits,
                                       bool is_unsigned) {
  namespace py = pybind11;
  const std::string prefix = what + ": " + name;
  PyObject* index = PyNumber_Index(value.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    throw py::type_error(prefix + " must be an integer, not " + TypeName(value));
  }
  const auto number = py::reinterpret_steal<py::int_>(index);
  const auto high = py::reinterpret_steal<py::object>(
      PyNumber_Lshift(py::int_(1).ptr(), py::int_(is_unsigned ? bits : bits - 1).ptr()));
  const auto low = is_unsigned ? py::object(py::int_(0))
                               : py::reinterpret_steal<py::object>(PyNumber_Negative(high.ptr()));
  const std::string shown = py::str(number).cast<std::string>();
  if (number < low || !(number < high)) {
    throw py::type_error(prefix + " must fit " + (is_unsigned ? "an unsigned " : "a signed ") +
                         std::to_string(bits) + "-bit integer, not " + shown);
  }
  if (number < py::int_(minimum)) {
    throw py::value_error(prefix + " must be at least " + std::to_string(minimum) + ", not " +
                          shown);
  }
  return number;
}

// An optional integer (None: not given): ints and what has __index__ (numpy's, torch's), not
// bools or floats. TypeError "<name> must be an int, not <type>"; one outside int64 is one too.
inline std::optional<int64_t> OptionalIntArgument(const pybind11::object& value, const char* name) {
  namespace py = pybind11;
  if (value.is_none()) return std::nullopt;
  PyObject* index = PyBool_Check(value.ptr()) ? nullptr : PyNumber_Index(value.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + " must be an int, not " + TypeName(value));
  }
  const auto number = py::reinterpret_steal<py::int_>(index);
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(number.ptr(), &overflow);
  if (overflow != 0) {
    throw py::type_error(std::string(name) + " must fit a 64-bit int, not " +
                         py::str(number).cast<std::string>());
  }
  return n;
}

// A name given as an optional argument: None, or a non-empty str. TypeError "<name> must be a
// str, not <type>"; ValueError for "".
inline void CheckNameArgument(const pybind11::handle& value, const char* name) {
  if (value.is_none()) return;
  if (!PyUnicode_Check(value.ptr())) {
    throw pybind11::type_error(std::string(name) + " must be a str, not " + TypeName(value));
  }
  if (PyUnicode_GetLength(value.ptr()) == 0) {
    throw pybind11::value_error(std::string(name) + " must be a non-empty str, not ''");
  }
}

// `value` as pybind11 converts it to a C++ bool: None is False, and an object whose type has a
// number's truth (__bool__: bools, ints, floats, numpy bools, one-element tensors) is its truth;
// anything else (a str, a list) is a TypeError "<what>: <name> must be a bool".
inline bool CBoolArgument(const pybind11::object& value, const std::string& what,
                          const std::string& name) {
  namespace py = pybind11;
  if (value.is_none()) return false;
  const std::string prefix = what + ": " + name + " must be a bool, not ";
  const py::handle type(reinterpret_cast<PyObject*>(Py_TYPE(value.ptr())));
  if (!py::hasattr(type, "__bool__")) throw py::type_error(prefix + TypeName(value));
  const int truth = PyObject_IsTrue(value.ptr());
  if (truth < 0) {
    py::error_already_set error;  // takes the error raised
    throw py::type_error(prefix + ReprOf(value) + " (" +
                         py::str(error.value()).cast<std::string>() + ")");
  }
  return truth == 1;
}

}  // namespace tensortier
