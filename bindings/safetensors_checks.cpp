// tensortier._core, the checks of safetensors files that need no tensor objects, only what the
// Python layer reads off them. A save: values that are not tensors, names that are not str,
// tensors the format cannot hold, and tensors that share memory (state_dict_checks.hpp), with the
// errors tensortier.save raises, each kind in this order, naming all its keys; and a save's
// metadata and checksum arguments, and its OSErrors. A verified load: the checksums a file's
// metadata stores.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "paths.hpp"
#include "register.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/checkpoint/state_dict_checks.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

[[noreturn]] void RaiseValueError(const py::str& message) {
  PyErr_SetObject(PyExc_ValueError, message.ptr());
  throw py::error_already_set();
}

std::string Repr(const py::handle& value) {
  return py::repr(value).cast<std::string>();
}

// The bytes from a strided tensor's first element to the end of its furthest one.
uint64_t Extent(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                uint64_t element_size) {
  int64_t furthest = 0;
  for (size_t i = 0; i < shape.size(); ++i) furthest += (shape[i] - 1) * strides.at(i);
  return static_cast<uint64_t>(furthest + 1) * element_size;
}

void CheckSafetensorsSave(const py::list& rows) {
  py::list not_tensors, bad_names, not_strided, meta;
  std::vector<std::string> no_dtype;
  std::vector<MemoryArea> areas;
  areas.reserve(rows.size());
  for (const py::handle row : rows) {
    const auto t = row.cast<py::tuple>();
    const py::object key = t[0];
    if (!py::isinstance<py::str>(key)) bad_names.append(key);
    if (t.size() == 2) {
      const auto kind = t[1].cast<std::string>();
      (kind == "value" ? not_tensors : kind == "sparse" ? not_strided : meta).append(key);
    } else if (bad_names.empty()) {
      const auto dtype = t[4].cast<std::string>();
      if (!dtype.empty()) no_dtype.push_back(StrCat(key.cast<std::string>(), " (", dtype, ")"));
      uint64_t size = t[3].cast<uint64_t>();
      if (size != 0 && t.size() == 8) {  // not contiguous: (shape, strides, element size)
        size = Extent(t[5].cast<std::vector<int64_t>>(), t[6].cast<std::vector<int64_t>>(),
                      t[7].cast<uint64_t>());
      }
      areas.push_back(
          {t[1].cast<std::string>(), t[2].cast<uint64_t>(), size, key.cast<std::string>()});
    }
  }
  if (!not_tensors.empty()) {
    throw py::type_error(
        StrCat("safetensors files hold tensors only; these values are not tensors: ",
               Repr(not_tensors[py::slice(0, 8, 1)]), not_tensors.size() > 8 ? " ..." : "",
               ": use format='torch' to keep them"));
  }
  if (!bad_names.empty()) {
    throw py::type_error(
        StrCat("safetensors tensor names must be str, not ", Repr(bad_names[py::slice(0, 8, 1)])));
  }
  if (!not_strided.empty()) {
    throw py::type_error(StrCat("sparse or non-strided tensors cannot be saved as safetensors: ",
                                Repr(not_strided)));
  }
  if (!meta.empty()) {
    throw py::value_error(StrCat("meta tensors have no data to save: ", Repr(meta)));
  }
  if (!no_dtype.empty()) {
    std::string names;
    for (const std::string& n : no_dtype) names += (names.empty() ? "" : ", ") + n;
    throw py::type_error(
        StrCat("safetensors has no dtype for: ", names, ": convert them or use format='torch'"));
  }
  const auto shared = OverlappingGroups(std::move(areas));
  if (!shared.empty()) {
    const std::string text = StrCat(
        "these tensors share memory, which safetensors files cannot express: ",
        Repr(py::cast(shared)),
        "; save one name per group (or .clone() the others), or use format='torch', which keeps "
        "the sharing");
    PyErr_SetString(py::module_::import("tensortier._core").attr("SharedStorageError").ptr(),
                    text.c_str());
    throw py::error_already_set();
  }
}

// name -> xxh64 of each of a file's tensors `names` by `tensortier verify`'s rule, from its
// safetensors `metadata`; ValueError naming `path` when it stores none or a malformed value.
py::dict StoredChecksums(const py::str& path, const py::dict& metadata,
                         const std::vector<std::string>& names) {
  const py::str key(kTensorChecksumsKey);
  if (!metadata.contains(key)) {
    RaiseValueError(py::str("{}: verify=True but the file stores no checksums (save it with "
                            "tensortier.save(..., checksum=True), or load with verify=False)")
                        .format(path));
  }
  const py::str malformed = py::str("{}: malformed {} metadata: ").format(path, key);
  TensorChecksums sums;
  try {
    sums = ReadTensorChecksums(metadata[key].cast<std::string>(), names);
  } catch (const std::invalid_argument& e) {
    RaiseValueError(malformed + MessageToPython(e.what()));
  }
  if (!sums.problems.empty()) {
    const size_t more = sums.problems.size() - 1;
    RaiseValueError(malformed +
                    MessageToPython(StrCat(sums.problems[0],
                                           more ? StrCat(" (and ", more, " more problems)") : "")));
  }
  py::dict out;
  for (size_t i = 0; i < names.size(); ++i) out[py::str(names[i])] = py::cast(sums.want[i]);
  return out;
}

// tensortier.save's errors for `metadata` (safetensors only, str -> str) and `checksum` (a bool)
// when saving in `format`.
void CheckSaveOptions(const std::string& format, const py::object& metadata,
                      const py::object& checksum) {
  if (!metadata.is_none()) {
    if (format != "safetensors") {
      throw py::value_error(
          "metadata is stored in safetensors files only: use format='safetensors'");
    }
    bool strings = py::isinstance(metadata, py::module_::import("collections.abc").attr("Mapping"));
    for (py::handle item : strings ? metadata.attr("items")() : py::list()) {
      const auto pair = item.cast<py::tuple>();
      strings = strings && py::isinstance<py::str>(pair[0]) && py::isinstance<py::str>(pair[1]);
    }
    if (!strings) throw py::type_error("metadata must be a mapping of str to str");
  }
  if (!PyBool_Check(checksum.ptr())) {
    throw py::type_error(
        StrCat("checksum must be a bool, not ",
               py::str(py::type::handle_of(checksum).attr("__name__")).cast<std::string>()));
  }
}

// tensortier.save's OSError for `e`, raised while saving `given`: `e` where it is about that file
// already (read-only, a directory...); else one naming `given` first, then what failed (a failure
// on the hidden temporary file is one of saving `given`), of the errno's subclass.
py::object SaveError(const py::object& e, const py::str& given) {
  const py::object filename = e.attr("filename");
  const py::object strerror = e.attr("strerror");
  const py::object os_path = py::module_::import("os").attr("path");
  const py::object final_path = os_path.attr("realpath")(given);
  // A save's temporary file: ".NAME.tmp-..." (TemporaryNameStem), whatever its folders are named.
  const py::str name = filename.is_none() ? py::str() : py::str(os_path.attr("basename")(filename));
  const bool about_temporary =
      name.attr("startswith")(".").cast<bool>() && name.attr("__contains__")(".tmp-").cast<bool>();
  if ((filename.equal(given) || filename.equal(final_path)) && !about_temporary) return e;
  py::str detail = PyObject_IsTrue(strerror.ptr()) == 1 ? py::str(strerror) : py::str(e);
  if (!filename.is_none() && !detail.attr("__contains__")(py::str(filename)).cast<bool>()) {
    detail = py::str("{}: {!r}").format(detail, filename);
  }
  const py::str message = py::str("cannot save {!r}: {}").format(given, detail);
  const py::object errno_value = e.attr("errno");
  if (errno_value.is_none()) return py::reinterpret_borrow<py::object>(PyExc_OSError)(message);
  return py::reinterpret_borrow<py::object>(PyExc_OSError)(errno_value, message);
}

}  // namespace

void RegisterSafetensorsChecks(py::module_& m) {
  m.def("check_safetensors_save", &CheckSafetensorsSave, py::arg("rows"),
        "The errors tensortier.save raises for a safetensors state dict, from one row per item: "
        "(key, kind) for kind 'value' (not a tensor), 'sparse' (not strided) or 'meta'; else "
        "(key, device ('' for host memory), address, nbytes, dtype ('' when safetensors has "
        "one, else its name)), followed by (shape, strides, element size) when not contiguous. "
        "TypeError or ValueError naming the keys of the first kind of problem: values, names, "
        "layouts, meta tensors, dtypes, then tensors whose memory meets.");
  m.def("safetensors_checksums", &StoredChecksums, py::arg("path"), py::arg("metadata"),
        py::arg("names"),
        "{name: xxh64 or None} of the file's tensors `names`, from the tensortier.xxh64 value of "
        "its safetensors `metadata` (ReadTensorChecksums, the rule `tensortier verify` follows). "
        "ValueError naming path when it stores none, or a malformed value (the first problem).");
  m.def("check_save_options", &CheckSaveOptions, py::arg("format"), py::arg("metadata"),
        py::arg("checksum"),
        "tensortier.save's errors for its metadata (ValueError unless format is 'safetensors', "
        "TypeError unless a mapping of str to str; None: none) and checksum (TypeError unless a "
        "bool) arguments.");
  m.def("save_error", &SaveError, py::arg("error"), py::arg("path"),
        "The OSError tensortier.save raises for error, raised while saving path (as the caller "
        "gave it): error itself where it is about that file, else one whose message names path "
        "first, then what failed, of error's errno subclass.");
}
