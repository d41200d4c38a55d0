// How file paths cross between Python and C++. A Linux file name is bytes; Python holds one as a
// str whose bytes that are not UTF-8 are lone surrogates U+DC80..U+DCFF (os.fsdecode, PEP 383),
// or as bytes. The C++ API takes and gives paths as std::string of those raw bytes. Every path
// parameter of the bindings is an FsPath, and every path given back goes through PathToPython,
// so a name that is not UTF-8 round-trips and nothing encodes a path as strict UTF-8.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <string_view>
#include <vector>

namespace tensortier {

// A path as the file system's bytes, from a str (os.fsencode), bytes or an os.PathLike.
struct FsPath {
  std::string bytes;
  operator const std::string&() const { return bytes; }
};

// os.fsdecode(bytes): a str that os.fsencode turns back into the same bytes.
inline pybind11::str PathToPython(std::string_view bytes) {
  PyObject* s =
      PyUnicode_DecodeFSDefaultAndSize(bytes.data(), static_cast<Py_ssize_t>(bytes.size()));
  if (s == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::str>(s);
}

// A message from C++ that may quote paths (an error's text): decoded as PathToPython, so it
// never fails and the quoted bytes survive.
inline pybind11::str MessageToPython(std::string_view text) {
  return PathToPython(text);
}

// Text as UTF-8 that keeps any lone surrogate (a file name's undecodable bytes, a pickle's
// string: pickle writes a str so), and back: what crosses comes back the same str.
inline std::string Utf8(const pybind11::str& text) {
  return pybind11::bytes(text.attr("encode")("utf-8", "surrogatepass"));
}

inline pybind11::str FromUtf8(std::string_view text) {
  PyObject* s =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "surrogatepass");
  if (s == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::str>(s);
}

// `path` (str, bytes, os.PathLike) as a str that os.fsencode turns into its exact bytes (the
// fspath() of the Python API); TypeError naming `what` and the types accepted.
pybind11::str FsPathArgument(const pybind11::handle& path, const std::string& what,
                             bool bytes_ok = true);

inline std::vector<std::string> PathBytes(const std::vector<FsPath>& paths) {
  std::vector<std::string> out;
  out.reserve(paths.size());
  for (const FsPath& p : paths) out.push_back(p.bytes);
  return out;
}

inline pybind11::list PathsToPython(const std::vector<std::string>& paths) {
  pybind11::list out;
  for (const std::string& p : paths) out.append(PathToPython(p));
  return out;
}

}  // namespace tensortier

namespace pybind11::detail {

template <>
struct type_caster<tensortier::FsPath> {
  PYBIND11_TYPE_CASTER(tensortier::FsPath, const_name("str | bytes | os.PathLike"));

  // Anything else is not a path (pybind11 then raises TypeError naming the accepted types); a
  // str that os.fsencode refuses (a surrogate outside U+DC80..U+DCFF) raises its
  // UnicodeEncodeError and a NUL ValueError, as open() does.
  bool load(handle src, bool /*convert*/) {
    if (!PyUnicode_Check(src.ptr()) && !PyBytes_Check(src.ptr()) &&
        !PyObject_HasAttrString(reinterpret_cast<PyObject*>(Py_TYPE(src.ptr())), "__fspath__")) {
      return false;
    }
    PyObject* path = PyOS_FSPath(src.ptr());  // str or bytes; TypeError from a bad __fspath__
    if (path == nullptr) throw error_already_set();
    object owned = reinterpret_steal<object>(path);
    if (PyUnicode_Check(path)) {
      PyObject* encoded = PyUnicode_EncodeFSDefault(path);
      if (encoded == nullptr) throw error_already_set();
      owned = reinterpret_steal<object>(encoded);
    }
    char* data = nullptr;
    Py_ssize_t size = 0;
    if (PyBytes_AsStringAndSize(owned.ptr(), &data, &size) != 0) throw error_already_set();
    value.bytes.assign(data, static_cast<size_t>(size));
    // As os.open: a C++ call would see the name end there.
    if (value.bytes.find('\0') != std::string::npos) throw value_error("embedded null byte");
    return true;
  }

  static handle cast(const tensortier::FsPath& path, return_value_policy, handle) {
    return tensortier::PathToPython(path.bytes).release();
  }
};

}  // namespace pybind11::detail
