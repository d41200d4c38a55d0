// tensortier._core functions of tensortier.hf: Hugging Face model directories (hf_checkpoint.hpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "arguments.hpp"
#include "binding_helpers.hpp"
#include "gil.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/checkpoint/directory_commit.hpp"
#include "tensortier/checkpoint/hf_checkpoint.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

void RegisterHf(py::module_& m) {
  m.def(
      "find_hf_checkpoint",
      [](const FsPath& dir) -> std::optional<py::tuple> {
        std::optional<HfCheckpoint> found;
        {
          GilReleased release;
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
      "check_hf_model_directory", [](const FsPath& dir) { CheckHfModelDirectory(dir); },
      py::arg("dir"), py::call_guard<GilReleased>(),
      "FileNotFoundError where nothing is at dir (a Hub model id), saying how to download one; "
      "NotADirectoryError for a file.");
  m.def(
      "hf_load_target",
      [](const std::vector<FsPath>& files,
         const py::object& sharded_metadata) -> std::optional<py::str> {
        const std::vector<std::string> names = PathBytes(files);
        std::optional<std::map<std::string, std::string>> weight_map;
        if (!sharded_metadata.is_none()) {
          const py::object map = sharded_metadata["weight_map"];
          try {
            weight_map = map.cast<std::map<std::string, std::string>>();
          } catch (const py::cast_error&) {
            throw py::type_error(
                StrCat("the shard index's weight_map must map tensor names to "
                       "file names (str to str); this one is a ",
                       TypeName(map), PyDict_Check(map.ptr()) ? " with other entries" : ""));
          }
        }
        std::optional<std::string> target;
        {
          GilReleased release;
          target = HfLoadTarget(names, weight_map);
        }
        if (!target) return std::nullopt;
        return PathToPython(*target);
      },
      py::arg("files"), py::arg("sharded_metadata"),
      "The file tensortier.load reads for the checkpoint files transformers resolved: the one "
      "file, else the shard index in their folder whose weight map is sharded_metadata's "
      "(transformers' reading of an index, a dict; None without one); None where transformers "
      "reads them itself (also where no index in their folder has that weight map).");
  m.def(
      "hf_directory_swappable",
      [](const FsPath& final_dir) {
        GilReleased release;
        return HfDirectorySwappable(final_dir);
      },
      py::arg("final_dir"),
      "Whether a save into final_dir can swap in a new directory with one rename: not a link, a "
      "file or a mount point, holding no mount point and not the working directory.");
  // What stage_hf_save kept of the old directory, for commit_hf_save (opaque to Python).
  py::class_<HfSaveStaging>(m, "HfSaveStaging");
  m.def(
      "stage_hf_save",
      [](const FsPath& final_dir) {
        HfSaveStaging staging;
        {
          GilReleased release;
          staging = StageHfSave(final_dir);
        }
        try {
          py::object dir = PathToPython(staging.dir);
          return py::make_tuple(dir, HfSaveStaging{staging.dir, std::move(staging.kept)});
        } catch (...) {
          RemoveDirectoryTree(staging.dir);
          throw;
        }
      },
      py::arg("final_dir"),
      "(staging directory, what it kept) of a save into final_dir: the directory beside it, "
      "holding what final_dir holds (weight files linked, others copied), and final_dir's "
      "entries it holds, with their versions (for commit_hf_save). "
      "NotADirectoryError where final_dir is a file.");
  m.def(
      "commit_hf_save",
      [](const FsPath& staging_dir, const HfSaveStaging& kept, const FsPath& final_dir) {
        HfSaveCommit commit;
        {
          GilReleased release;
          commit = CommitHfSave(HfSaveStaging{staging_dir, kept.kept}, final_dir, TestFileSystem());
        }
        py::list left;
        for (const std::string& path : commit.left) left.append(py::bytes(path));
        return py::make_tuple(
            commit.swapped, left,
            commit.kept_dir.empty() ? py::object(py::none()) : PathToPython(commit.kept_dir));
      },
      py::arg("staging_dir"), py::arg("kept"), py::arg("final_dir"),
      "The end of a save staged by stage_hf_save: the written staging directory swapped with "
      "final_dir, what final_dir gained meanwhile carried over, the old directory removed. "
      "Returns (swapped, [relative paths, bytes, that could not be carried], the path the old "
      "directory is kept at then (else None)). What another process changed in final_dir "
      "meanwhile is carried too, where the save left the file as staged; swapped is False where "
      "final_dir is to be written "
      "in "
      "place instead (a bind mount, NFS, SMB, FUSE), the staging directory removed. OSError "
      "otherwise, the staging directory removed.");
  m.def(
      "replace_linked_shard",
      [](const FsPath& written, const FsPath& link) {
        ReplaceLinkedShard(written, link, TestFileSystem());
      },
      py::arg("written"), py::arg("link"), py::call_guard<GilReleased>(),
      "The shard written at `written` renamed over the symbolic link `link` (its target left "
      "as it was), the folder fsynced; OSError after removing `written`.");
  m.def(
      "remove_directory_tree", [](const FsPath& dir) { return RemoveDirectoryTree(dir); },
      py::arg("dir"), py::call_guard<GilReleased>(),
      "Removes dir and all it holds, read-only folders included; True when it is gone.");
  m.def(
      "hf_read_device",
      [](const std::vector<std::string>& places) -> std::optional<std::string> {
        for (const std::string& p : places) {
          if (p == "disk") return std::nullopt;
        }
        if (places.size() != 1) return "cpu";  // transformers moves each tensor where it goes
        const std::string type = places[0].substr(0, places[0].find(':'));
        if (type != "cpu" && type != "cuda") return std::nullopt;
        return places[0];  // straight there (CUDA: the engine's GPU path)
      },
      py::arg("places"),
      "The device tensortier.load reads a model's weights to for the distinct places of its "
      "device_map (devices as torch spells them, 'disk'): the one place where it is the CPU or "
      "a GPU, the CPU for several; None (transformers reads them) with disk offload or another "
      "device.");
  m.def(
      "hf_files_cached",
      [](const std::vector<FsPath>& files) {
        const std::vector<std::string> names = PathBytes(files);
        GilReleased release;
        return HfFilesCached(names);
      },
      py::arg("files"),
      "Whether files are in the page cache, 9/10 of their bytes at least (a busy machine evicts "
      "a few pages at any moment).");
}
