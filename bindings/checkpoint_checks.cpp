// tensortier._core checks of state dicts that need no tensor objects (state_dict_checks.hpp): the
// Python layer passes what it reads off the tensors as plain tuples.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "paths.hpp"
#include "register.hpp"
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

}  // namespace

void RegisterCheckpointChecks(py::module_& m) {
  m.def(
      "overlapping_groups",
      [](const std::vector<std::tuple<std::string, uint64_t, uint64_t, std::string>>& areas) {
        std::vector<MemoryArea> in;
        in.reserve(areas.size());
        for (const auto& [device, address, size, name] : areas) {
          in.push_back({device, address, size, name});
        }
        return OverlappingGroups(std::move(in));
      },
      py::arg("areas"),
      "[[name, ...]]: the groups of two names or more among (device, address, size, name) areas "
      "of memory ('' for host memory) that meet on one device, each in address order.");
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
}
