// tensortier._core checks of state dicts and loads that need no tensor objects
// (state_dict_checks.hpp, load_checks.hpp): the Python layer passes what it reads off the tensors
// as plain tuples.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "paths.hpp"
#include "register.hpp"
#include "tensortier/checkpoint/load_checks.hpp"
#include "tensortier/checkpoint/state_dict_checks.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

using TensorTuple = std::tuple<std::string, std::vector<int64_t>, std::string, uint64_t, uint64_t>;

std::vector<NamedTensor> NamedTensors(const std::vector<TensorTuple>& tuples) {
  std::vector<NamedTensor> out;
  out.reserve(tuples.size());
  for (const auto& [name, shape, dtype, address, size] : tuples) {
    out.push_back({name, shape, dtype, address, size});
  }
  return out;
}

// Text as UTF-8 that keeps any lone surrogate (a file name's undecodable bytes, a pickle's
// string), and back: what crosses comes back the same str.
std::string Utf8(const py::str& text) {
  return py::bytes(text.attr("encode")("utf-8", "surrogatepass"));
}

py::str FromUtf8(std::string_view text) {
  PyObject* s =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "surrogatepass");
  if (s == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(s);
}

}  // namespace

void RegisterCheckpointChecks(py::module_& m) {
  m.def(
      "span_in_file",
      [](const FsPath& path, uint64_t file_size,
         const std::vector<std::tuple<std::string, int64_t, int64_t>>& ranges) {
        std::vector<FileRange> in;
        in.reserve(ranges.size());
        for (const auto& [name, offset, size] : ranges) in.push_back({name, offset, size});
        return SpanInFile(path, file_size, in);
      },
      py::arg("path"), py::arg("file_size"), py::arg("ranges"),
      "(begin, end): the span of the non-empty (name, offset, size) ranges of the file at path, "
      "(0, 0) when none; ValueError naming path and the range for one that ends past file_size.");
  m.def(
      "match_state_dict",
      [](const std::vector<TensorTuple>& targets, const std::vector<TensorTuple>& saved,
         bool strict) {
        StateDictMatch match = MatchStateDict(NamedTensors(targets), NamedTensors(saved), strict);
        return py::make_tuple(match.missing, match.unexpected, match.errors);
      },
      py::arg("targets"), py::arg("saved"), py::arg("strict"),
      "(missing, unexpected, errors) of load_into's targets against a checkpoint's saved "
      "tensors, each a (name, shape, dtype, address, size) tuple (address and size 0 for saved "
      "ones): errors are load_state_dict's lines (missing and unexpected names when strict, shape "
      "mismatches always). A missing target whose memory is a loaded one's is not missing.");

  m.def("check_load_options", &CheckLoadOptions, py::arg("device"), py::arg("verify"),
        py::arg("mmap"), py::arg("to_meta"),
        "ValueError for load arguments that exclude each other (CheckLoadOptions): verify=True "
        "where no byte is read (device 'meta', or to_meta, the repr of the saved locations "
        "map_location sends there, '' for none), mmap=True for another device than 'cpu'.");
  py::class_<ProgressBar>(m, "Progress",
                          "A load's progress bar on sys.stderr (ProgressBar): redrawn at most ten "
                          "times a second, its final state drawn once. enabled None: for loads of "
                          "512 MiB or more when stderr is a terminal.")
      .def(py::init([](const py::str& label, uint64_t total, std::optional<bool> enabled) {
             if (!enabled) {
               enabled = false;
               if (total >= kProgressMinBytes) {
                 try {
                   py::object isatty = py::module_::import("sys").attr("stderr").attr("isatty");
                   enabled = isatty().cast<bool>();
                 } catch (const py::error_already_set& e) {  // no stderr (None), or a closed one
                   if (!e.matches(PyExc_AttributeError) && !e.matches(PyExc_ValueError)) throw;
                 }
               }
             }
             return ProgressBar(Utf8(label), total, *enabled, [](const std::string& text) {
               py::object stderr_ = py::module_::import("sys").attr("stderr");
               stderr_.attr("write")(FromUtf8(text));
               stderr_.attr("flush")();
             });
           }),
           py::arg("label"), py::arg("total"), py::arg("enabled") = py::none())
      .def_property_readonly("enabled", &ProgressBar::enabled)
      .def_property_readonly("done", &ProgressBar::done)
      .def("update", &ProgressBar::Update, py::arg("bytes"))
      .def("close", &ProgressBar::Close);
  m.def(
      "check_torch_storage",
      [](const py::str& path, const py::str& record, const py::str& key, const std::string& dtype,
         uint64_t itemsize, const py::int_& numel, std::optional<uint64_t> record_size,
         const std::optional<std::pair<std::string, uint64_t>>& prior) {
        // The pickle's integer may be any size: the product is Python's, as torch.load's.
        py::object nbytes = numel * py::int_(itemsize);
        int overflow = 0;
        const long long fits = PyLong_AsLongLongAndOverflow(nbytes.ptr(), &overflow);
        std::optional<int64_t> n;
        if (overflow == 0) n = fits;
        try {
          return CheckTorchStorage(Utf8(path), Utf8(record), Utf8(key), dtype, n,
                                   py::str(nbytes).cast<std::string>(), record_size, prior);
        } catch (const std::invalid_argument& e) {  // the names as they came
          PyErr_SetObject(PyExc_ValueError, FromUtf8(e.what()).ptr());
          throw py::error_already_set();
        }
      },
      py::arg("path"), py::arg("record"), py::arg("key"), py::arg("dtype"), py::arg("itemsize"),
      py::arg("numel"), py::arg("record_size"), py::arg("prior"),
      "The size in bytes of storage key as a torch pickle's persistent id describes it (numel "
      "elements of dtype, itemsize bytes each), checked against its zip record's size "
      "(record_size, None: missing) and an earlier description (prior: (dtype, nbytes) or None): "
      "CheckTorchStorage's ValueErrors naming path.");
}
