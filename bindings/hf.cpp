// tensortier._core functions of tensortier.hf: Hugging Face model directories (hf_checkpoint.hpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "paths.hpp"
#include "register.hpp"
#include "tensortier/checkpoint/hf_checkpoint.hpp"

namespace py = pybind11;
using namespace tensortier;

void RegisterHf(py::module_& m) {
  m.def(
      "find_hf_checkpoint",
      [](const FsPath& dir) -> std::optional<py::tuple> {
        std::optional<HfCheckpoint> found;
        {
          py::gil_scoped_release release;
          found = FindHfCheckpoint(dir);
        }
        if (!found) return std::nullopt;
        return py::make_tuple(PathToPython(found->target), found->cached);
      },
      py::arg("dir"),
      "(the file tensortier.load reads for the model in dir: model.safetensors.index.json, else "
      "model.safetensors; whether dir's *.safetensors files are in the page cache, 9/10 at "
      "least), or None where neither file is there or config.json is unreadable or names a "
      "quantization_config.");
  m.def(
      "hf_shard_index_of",
      [](const FsPath& dir, const std::string& shard,
         const std::map<std::string, std::string>& weight_map) {
        std::string path;
        {
          py::gil_scoped_release release;
          path = HfShardIndexOf(dir, shard, weight_map);
        }
        return PathToPython(path);
      },
      py::arg("dir"), py::arg("shard"), py::arg("weight_map"),
      "The shard index in dir (model.safetensors.index*.json, first in name order) whose weight "
      "map is weight_map. FileNotFoundError naming dir and shard where none is.");
  m.def(
      "hf_files_cached",
      [](const std::vector<FsPath>& files) {
        const std::vector<std::string> names = PathBytes(files);
        py::gil_scoped_release release;
        return HfFilesCached(names);
      },
      py::arg("files"),
      "Whether files are in the page cache, 9/10 of their bytes at least (a busy machine evicts "
      "a few pages at any moment).");
}
