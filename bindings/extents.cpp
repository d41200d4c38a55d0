// Extent maps and raw block-device reads (tensortier.data.extents). Buffers cross as addresses
// and sizes; python/tensortier/data/extents.py keeps the objects alive.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "arguments.hpp"
#include "binding_helpers.hpp"
#include "gil.hpp"
#include "gil_free_holder.hpp"
#include "paths.hpp"
#include "tensortier/data/extent_map.hpp"
#include "tensortier/data/extent_reader.hpp"
#include "tensortier/io/config.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

py::dict FileDict(const MappedFile& f) {
  py::dict d;
  d["path"] = PathToPython(f.path);
  d["device"] = f.device;
  d["inode"] = f.identity.inode;
  d["size"] = f.identity.size;
  d["mtime_ns"] = f.identity.mtime_ns;
  d["ctime_ns"] = f.identity.ctime_ns;
  py::list extents;
  for (const FileExtent& x : f.extents)
    extents.append(py::make_tuple(x.logical, x.physical, x.length));
  d["extents"] = extents;
  return d;
}

py::dict DeviceDict(const MappedDevice& d) {
  py::dict out;
  out["major"] = d.major;
  out["minor"] = d.minor;
  out["disk"] = PathToPython(d.disk);
  out["disk_major"] = d.disk_major;
  out["disk_minor"] = d.disk_minor;
  out["partition_offset"] = d.partition_offset;
  out["filesystem"] = d.filesystem;
  out["block_size"] = d.block_size;
  return out;
}

}  // namespace

void RegisterExtents(py::module_& m) {
  py::class_<ExtentMap>(m, "ExtentMap",
                        "Where every byte of a set of files lies on its block device, and each "
                        "file's identity (tensortier.data.build_extent_map makes one).")
      .def_static(
          "build",
          [](const py::object& root_arg, const py::object& files, bool allow_refused,
             const py::object& output_arg) {
            const FsPath root = FsPathArgument(root_arg, "root").cast<FsPath>();
            std::optional<std::vector<std::string>> listed;
            if (!files.is_none()) {
              listed.emplace();
              for (const py::handle f : files) {
                listed->push_back(FsPathArgument(f, "files[i]").cast<FsPath>().bytes);
              }
            }
            std::optional<FsPath> output;
            if (!output_arg.is_none()) output = FsPathArgument(output_arg, "output").cast<FsPath>();
            GilReleased release;  // FIEMAP_FLAG_SYNC writes data out: seconds
            BuildOptions options;
            options.allow_refused = allow_refused;
            if (output) options.leave_out = output->bytes;  // a map written inside its root
            ExtentMap map =
                listed ? BuildExtentMap(root, *listed, options) : BuildExtentMap(root, options);
            if (output) SaveExtentMap(map, *output);
            return map;
          },
          py::arg("root"), py::arg("files") = py::none(), py::arg("allow_refused") = false,
          py::arg("output") = py::none(),
          "Maps the files under `root` (or `files`), and writes the map to `output` (durably) "
          "unless None. Raises OSError (EOPNOTSUPP naming refused files unless allow_refused), "
          "ValueError for a file outside the root, TypeError for a path that is not one.")
      .def_static(
          "load", [](const FsPath& path) { return LoadExtentMap(path); }, py::arg("path"),
          py::call_guard<GilReleased>())
      .def_static(
          "of",
          [](const py::object& value) -> py::object {
            if (py::isinstance<ExtentMap>(value)) return value;
            if (!py::isinstance<py::str>(value) && !py::isinstance<py::bytes>(value) &&
                !py::isinstance(value, py::module_::import("os").attr("PathLike"))) {
              throw py::type_error(TypeName(value) + " is not an ExtentMap or a path to one");
            }
            const FsPath path = value.cast<FsPath>();
            ExtentMap map;
            {
              GilReleased release;
              map = LoadExtentMap(path);
            }
            return py::cast(std::move(map));
          },
          py::arg("map"),
          "`map` as it is, or the map a path names (load). TypeError for anything else.")
      .def_static(
          "from_json", [](const std::string& text) { return ParseExtentMap(text, "extent map"); },
          py::arg("text"), "Parses a map's JSON text. Raises ValueError for a bad map.")
      .def(
          "save", [](const ExtentMap& map, const FsPath& path) { SaveExtentMap(map, path); },
          py::arg("path"), py::call_guard<GilReleased>(),
          "Writes the map as JSON, durably (temporary file, fsync, rename).")
      .def("to_json", &ExtentMapToJson, "The map as JSON text.")
      .def_property_readonly("root", [](const ExtentMap& map) { return PathToPython(map.root); })
      .def("__len__", [](const ExtentMap& map) { return map.files.size(); })
      .def("__eq__", [](const ExtentMap& a, const ExtentMap& b) { return a == b; })
      .def_property_readonly("devices",
                             [](const ExtentMap& map) {
                               py::list out;
                               for (const MappedDevice& d : map.devices) out.append(DeviceDict(d));
                               return out;
                             })
      .def_property_readonly("paths",
                             [](const ExtentMap& map) {
                               py::list out;
                               for (const MappedFile& f : map.files)
                                 out.append(PathToPython(f.path));
                               return out;
                             })
      .def(
          "file", [](const ExtentMap& map, size_t index) { return FileDict(map.files.at(index)); },
          py::arg("index"))
      .def_property_readonly("refused",
                             [](const ExtentMap& map) {
                               py::list out;
                               for (const RefusedFile& r : map.refused) {
                                 out.append(py::make_tuple(PathToPython(r.path), r.reason));
                               }
                               return out;
                             })
      .def(
          "find", [](const ExtentMap& map, const FsPath& path) { return map.Find(path.bytes); },
          py::arg("path"),
          "The index of the file at `path` (absolute or relative to the root), or None.")
      .def(
          "index_of",
          [](const ExtentMap& map, const py::object& file) -> size_t {
            const size_t count = map.files.size();
            if (py::isinstance<py::str>(file) || py::isinstance<py::bytes>(file) ||
                py::hasattr(file, "__fspath__")) {
              const FsPath path = file.cast<FsPath>();
              if (const auto found = map.Find(path.bytes)) return *found;
              throw py::value_error(py::str("{!r} is not in the extent map of {!r}")
                                        .format(PathToPython(path.bytes), PathToPython(map.root))
                                        .cast<std::string>());
            }
            const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(file.ptr()));
            if (!index) throw py::error_already_set();
            int overflow = 0;
            const long long value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
            if (overflow == 0 && value >= 0 && static_cast<size_t>(value) < count) {
              return static_cast<size_t>(value);
            }
            throw py::index_error(py::str("file index {} is not in the map ({} files)")
                                      .format(index, count)
                                      .cast<std::string>());
          },
          py::arg("file"),
          "The index of `file`: a map index, or a path (absolute or relative to the root). "
          "IndexError: an index outside the map; ValueError: a path the map does not hold.")
      .def(
          "full_path",
          [](const ExtentMap& map, size_t index) {
            if (index >= map.files.size()) throw py::index_error("file index out of range");
            return PathToPython(map.FullPath(index));
          },
          py::arg("index"))
      .def("verify", [](const ExtentMap& map) {
        std::vector<ChangedFile> changed;
        {
          GilReleased release;
          changed = VerifyExtentMap(map);
        }
        py::list out;
        for (const ChangedFile& c : changed)
          out.append(py::make_tuple(PathToPython(c.path), c.what));
        return out;
      });

  // Dropping a reader waits for its engine's I/O and joins its threads: with the GIL released.
  py::class_<ExtentReader, GilFreeHolder<ExtentReader>>(m, "ExtentReader")
      .def(py::init([](const ExtentMap& map, std::optional<std::string> backend,
                       std::optional<unsigned> queue_depth, std::optional<unsigned> workers,
                       bool verify_checksums) {
             EngineOptions options = EngineOptions::FromEnvironment();
             if (backend) options.backend = BackendWord(*backend);
             if (queue_depth) options.queue_depth = *queue_depth;
             if (workers) options.workers = *workers;
             BackendFactory factory = TestBackends(options);
             GilReleased release;
             return GilFreeHolder<ExtentReader>(
                 new ExtentReader(map, options, factory, verify_checksums));
           }),
           py::arg("map"), py::arg("backend") = py::none(), py::arg("queue_depth") = py::none(),
           py::arg("workers") = py::none(), py::arg("verify_checksums") = true)
      .def_property_readonly("backend", [](const ExtentReader& r) { return r.engine().backend(); })
      .def(
          "read",
          [](ExtentReader& r, const std::vector<std::tuple<size_t, uintptr_t, uint64_t>>& files) {
            std::vector<ExtentReadRequest> requests;
            requests.reserve(files.size());
            for (const auto& [index, address, capacity] : files) {
              requests.push_back({index, reinterpret_cast<void*>(address), capacity});
            }
            ExtentBatch batch;
            {
              GilReleased release;
              batch = r.ReadBatch(requests);
            }
            py::list sizes, fallbacks;
            size_t raw = 0;
            for (size_t i = 0; i < batch.files.size(); ++i) {
              const ExtentReadResult& f = batch.files[i];
              sizes.append(f.bytes);
              raw += f.raw ? 1 : 0;
              if (!f.raw) {
                fallbacks.append(py::make_tuple(PathToPython(r.map().FullPath(requests[i].file)),
                                                MessageToPython(f.fallback)));
              }
            }
            py::dict stats;
            stats["raw_files"] = raw;
            stats["fallback_files"] = batch.files.size() - raw;
            stats["fallbacks"] = fallbacks;
            for (const auto& [name, value] : IoStatsToDict(batch.io)) stats[name] = value;
            return py::make_tuple(sizes, stats);
          },
          py::arg("files"),
          "Reads (map index, address, capacity) files: the bytes of each, and the batch's stats "
          "(raw_files, fallback_files, fallbacks as (path, why), the engine's).");
}
