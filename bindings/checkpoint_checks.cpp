// tensortier._core checks of state dicts and loads that need no tensor objects
// (state_dict_checks.hpp, load_checks.hpp): the Python layer passes what it reads off the tensors
// as plain tuples.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "gil.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/checkpoint/checkpoint_format.hpp"
#include "tensortier/checkpoint/load_checks.hpp"
#include "tensortier/checkpoint/piece_reader.hpp"
#include "tensortier/checkpoint/state_dict_checks.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

using RecordTuple = std::tuple<std::string, uint64_t, uint64_t, uint32_t, bool>;

using TensorTuple = std::tuple<std::string, std::vector<int64_t>, std::string, uint64_t, uint64_t>;

std::vector<NamedTensor> NamedTensors(const std::vector<TensorTuple>& tuples) {
  std::vector<NamedTensor> out;
  out.reserve(tuples.size());
  for (const auto& [name, shape, dtype, address, size] : tuples) {
    out.push_back({name, shape, dtype, address, size});
  }
  return out;
}

// What mmap=True loads may still read ahead, in bytes.
struct ReadaheadBudget {
  uint64_t left;
};

}  // namespace

void RegisterCheckpointChecks(py::module_& m) {
  py::class_<ReadaheadBudget>(m, "ReadaheadBudget",
                              "Bytes that loads may still read ahead, shared by those given it.")
      .def(py::init([](uint64_t bytes) { return ReadaheadBudget{bytes}; }), py::arg("bytes"))
      .def_readonly("left", &ReadaheadBudget::left)
      .def(
          "take",
          [](ReadaheadBudget& budget, uint64_t nbytes) {
            if (nbytes > budget.left) return false;
            budget.left -= nbytes;
            return true;
          },
          py::arg("nbytes"), "Whether nbytes more fit in what is left (taken from it if so).");
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
      "plan_load_into",
      [](const std::vector<TensorTuple>& targets, const std::vector<TensorTuple>& saved,
         bool strict) {
        StateDictMatch match = MatchStateDict(NamedTensors(targets), NamedTensors(saved), strict);
        std::map<std::string, size_t> target_at, saved_at;
        for (size_t i = 0; i < targets.size(); ++i) target_at[std::get<0>(targets[i])] = i;
        for (size_t i = 0; i < saved.size(); ++i) saved_at[std::get<0>(saved[i])] = i;
        // The same memory under several names (tied weights) is read once, from the name that
        // comes last in the targets' order: the value load_state_dict leaves (the last copy).
        std::map<std::pair<uint64_t, uint64_t>, std::string> last;
        for (const auto& [name, shape, dtype, address, size] : targets) {
          if (size > 0 && saved_at.contains(name)) last[{address, size}] = name;
        }
        std::vector<std::string> reads;
        for (const TensorTuple& s : saved) {
          const auto it = target_at.find(std::get<0>(s));
          if (it == target_at.end()) continue;
          const auto& [name, shape, dtype, address, size] = targets[it->second];
          if (size == 0 || last.at({address, size}) == name) reads.push_back(name);
        }
        return py::make_tuple(match.missing, match.unexpected, match.errors, reads);
      },
      py::arg("targets"), py::arg("saved"), py::arg("strict"),
      "(missing, unexpected, errors) of load_into's targets against a checkpoint's saved "
      "tensors, each a (name, shape, dtype, address, size) tuple (address and size 0 for saved "
      "ones; errors are load_state_dict's lines), and the names to read, in the saved "
      "order: each name both hold, a target memory named more than once (tied weights) only "
      "under its last name in the targets' order.");

  m.def(
      "check_load_options",
      [](const std::string& device, bool verify, const py::object& mmap,
         const std::string& to_meta) {
        if (!py::isinstance<py::bool_>(mmap)) {
          PyErr_SetObject(PyExc_TypeError, py::str("mmap must be a bool or None, not {}")
                                               .format(py::type::of(mmap).attr("__name__"))
                                               .ptr());
          throw py::error_already_set();
        }
        CheckLoadOptions(device, verify, mmap.cast<bool>(), to_meta);
      },
      py::arg("device"), py::arg("verify"), py::arg("mmap"), py::arg("to_meta"),
      "ValueError for load arguments that exclude each other (CheckLoadOptions): verify=True "
      "where no byte is read (device 'meta', or to_meta, the repr of the saved locations "
      "map_location sends there, '' for none), mmap=True for another device than 'cpu'; "
      "TypeError for an mmap that is not a bool.");
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
               if (stderr_.is_none()) return;  // no stderr (pythonw, a daemon's 2>&-): not shown
               stderr_.attr("write")(FromUtf8(text));
               stderr_.attr("flush")();
             });
           }),
           py::arg("label"), py::arg("total"), py::arg("enabled") = py::none())
      .def_property_readonly("enabled", &ProgressBar::enabled)
      .def_property_readonly("done", &ProgressBar::done)
      .def("update", &ProgressBar::Update, py::arg("bytes"))
      .def("close", &ProgressBar::Close)
      .def("__enter__", [](const py::object& self) { return self; })
      .def("__exit__", [](ProgressBar& bar, const py::args&) { bar.Close(); });
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
          // A FormatError (a record missing or of another size) is the file's damage, which
          // the load names as torch does; other refusals stay ValueErrors.
          const bool damage = dynamic_cast<const FormatError*>(&e) != nullptr;
          static const py::handle format_error =
              py::object(py::module_::import("tensortier._core").attr("FormatError")).release();
          PyErr_SetObject(damage ? format_error.ptr() : PyExc_ValueError, FromUtf8(e.what()).ptr());
          throw py::error_already_set();
        }
      },
      py::arg("path"), py::arg("record"), py::arg("key"), py::arg("dtype"), py::arg("itemsize"),
      py::arg("numel"), py::arg("record_size"), py::arg("prior"),
      "The size in bytes of storage key as a torch pickle's persistent id describes it (numel "
      "elements of dtype, itemsize bytes each), checked against its zip record's size "
      "(record_size, None: missing) and an earlier description (prior: (dtype, nbytes) or None): "
      "CheckTorchStorage's ValueErrors naming path.");
  m.def(
      "read_torch_pickle",
      [](Engine& engine, const File& file, const FsPath& path, const std::string& prefix,
         const std::vector<RecordTuple>& records, bool verify) {
        const std::string names[] = {prefix + "data.pkl", prefix + "byteorder"};
        const RecordTuple* found[2] = {nullptr, nullptr};
        bool recorded = true, storage_bytes = false, record_bytes = false;
        for (const RecordTuple& r : records) {
          const auto& [name, offset, size, crc, crcs] = r;
          recorded = recorded && crcs;
          record_bytes = record_bytes || size > 0;
          storage_bytes = storage_bytes || (size > 0 && name.starts_with(prefix + "data/"));
          for (int i = 0; i < 2; ++i) {
            if (name == names[i]) found[i] = &r;  // the last of a name, as a dict keeps it
          }
        }
        std::string bytes[2];
        std::vector<PieceRead> pieces;
        for (int i = 0; i < 2; ++i) {
          if (found[i] == nullptr) continue;
          const auto& [name, offset, size, crc, crcs] = *found[i];
          bytes[i].resize(size);
          const PieceCheck check = verify && recorded ? PieceCheck::kCrc32 : PieceCheck::kNone;
          pieces.push_back(
              {name, offset, size, reinterpret_cast<std::byte*>(bytes[i].data()), check, crc});
        }
        if (verify && !recorded && record_bytes) {  // torch.save with set_crc32_options(False)
          throw std::invalid_argument(StrCat(
              path.bytes, ": verify=True but the file stores no CRC-32 for its ",
              storage_bytes ? "storages" : "records",
              " (it was saved with torch.serialization.set_crc32_options(False); save it with "
              "tensortier.save(..., checksum=True), or load with verify=False)"));
        }
        {
          GilReleased release;
          ReadPieces(engine, file, path, pieces);
        }
        const bool big_endian = found[1] != nullptr && TorchByteOrderIsBig(path.bytes, bytes[1]);
        // torch functions that read their tensor arguments' data while the pickle is loaded (a
        // nested tensor's sizes are tensors): in files naming one, storages are read as met.
        const bool data_dependent = bytes[0].find("_rebuild_nested_tensor") != std::string::npos;
        return py::make_tuple(py::bytes(bytes[0]), big_endian, data_dependent);
      },
      py::arg("engine"), py::arg("file"), py::arg("path"), py::arg("prefix"), py::arg("records"),
      py::arg("verify"),
      "(data.pkl, big_endian, data_dependent): the bytes of a torch.save zip's pickle, whether "
      "its byteorder record says 'big', and whether the pickle names a rebuild that reads its "
      "tensors' data while it is loaded (prefix: the archive's folder and '/'), read through "
      "engine from file, their CRC-32s checked with verify. records: (name, data_offset, size, "
      "crc32, crcs_recorded) as torch_zip_entries gives them. ValueError for a byte order "
      "other than 'little' or 'big', with verify for an archive that stores no CRC-32s, for a "
      "mismatch or a short file; OSError for I/O errors.");
  m.def(
      "unpickling_failure",
      [](const py::str& path, const py::str& error_type, const py::str& error,
         bool meta_unsupported, const py::bytes& pickle, uint64_t at) -> py::str {
        const std::string data = pickle;
        std::string kinds;
        if (meta_unsupported) {  // torch has no quantized meta tensors; nested ones need data
          for (const auto& [kind, rebuild] : {std::pair{"quantized", "_rebuild_qtensor"},
                                              std::pair{"nested", "_rebuild_nested_tensor"}}) {
            if (data.find(rebuild) == std::string::npos) continue;
            kinds += StrCat(kinds.empty() ? "" : " or ", kind);
          }
        }
        if (!kinds.empty()) {
          return py::str(
                     "{}: holds {} tensors, which cannot be described without reading them "
                     "(load_into reads plain tensors): use tensortier.load")
              .format(path, kinds);
        }
        return py::str("{}: malformed data.pkl (at byte {} of {}): {}: {}")
            .format(path, at, data.size(), error_type, error);
      },
      py::arg("path"), py::arg("error_type"), py::arg("error"), py::arg("meta_unsupported"),
      py::arg("pickle"), py::arg("at"),
      "The ValueError message for a torch pickle whose unpickling failed at byte at with an error "
      "of error_type: a malformed data.pkl, or, where the failure is meta_unsupported (a "
      "NotImplementedError unpickling onto the meta device), the quantized or nested tensors "
      "the pickle holds, which cannot be described without their data.");
  m.def(
      "check_saved_tensor",
      [](const py::str& path, const py::str& name, const py::str& other, const py::str& layout,
         bool has_data) {
        py::object message;
        if (py::len(other) > 0) {
          message = py::str(
                        "{}: {!r} is {}, not a tensor: load_into reads flat state dicts; use "
                        "tensortier.load")
                        .format(path, name, other);
        } else if (py::len(layout) > 0) {
          message = py::str(
                        "{}: {!r} is a {} tensor: load_into reads dense tensors; use "
                        "tensortier.load")
                        .format(path, name, layout);
        } else if (!has_data) {
          message = py::str(
                        "{}: {!r} has no data in the file (a tensor saved from the meta "
                        "device): load_into cannot read it; use tensortier.load")
                        .format(path, name);
        }
        if (message) {
          PyErr_SetObject(PyExc_ValueError, message.ptr());
          throw py::error_already_set();
        }
      },
      py::arg("path"), py::arg("name"), py::arg("other"), py::arg("layout"), py::arg("has_data"),
      "ValueError for a value of a torch file that load_into cannot read into a target: one "
      "that is no tensor (other: its type's name with its article, '' for a tensor), a tensor "
      "of another layout than strided (layout: its name, '' for strided), or one with no bytes "
      "in the file (has_data False: saved from the meta device).");
  m.def(
      "check_load_into_targets",
      [](const py::list& meta) {
        if (meta.empty()) return;
        // Meta tensors have no memory to read into (and all share data_ptr 0, which would make
        // them look tied to each other): materialise them first.
        PyErr_SetObject(PyExc_ValueError,
                        py::str("load_into: {} target(s) on the meta device, e.g. {}: give them "
                                "memory first (module.to_empty(device='cpu'))")
                            .format(py::len(meta), meta[py::slice(0, 4, 1)])
                            .ptr());
        throw py::error_already_set();
      },
      py::arg("meta"), "ValueError naming load_into's targets on the meta device (meta), if any.");
  m.def(
      "check_load_device",
      [](const py::str& device, const std::string& type, bool cuda_available, int64_t index,
         int64_t count) {
        const char* problem = nullptr;
        if (type != "cuda") {
          problem = "{!r} is not supported: use 'cpu', 'cuda:N' or 'meta'";
        } else if (!cuda_available) {
          problem =
              "{!r} was asked for but CUDA is not available (torch.cuda.is_available() is "
              "False): load with device='cpu'";
        } else if (index >= count) {
          problem = "{!r}: there are only {} GPUs";
        }
        if (problem != nullptr) {
          PyErr_SetObject(PyExc_ValueError,
                          (py::str("device ") + py::str(problem).format(device, count)).ptr());
          throw py::error_already_set();
        }
      },
      py::arg("device"), py::arg("type"), py::arg("cuda_available"), py::arg("index"),
      py::arg("count"),
      "ValueError for a load's target device (its str and type) other than 'cpu' and 'meta' "
      "that is not a CUDA device, or where CUDA is not available, or whose index is not below "
      "the count of GPUs.");
  m.def(
      "check_load_dtype",
      [](const py::object& dtype, bool is_dtype, bool floating) {
        if (!is_dtype) {
          PyErr_SetObject(PyExc_TypeError, py::str("dtype must be a torch.dtype, not {}")
                                               .format(py::type::of(dtype).attr("__name__"))
                                               .ptr());
          throw py::error_already_set();
        }
        if (!floating) {  // only floating-point tensors are converted: else a silent no-op
          PyErr_SetObject(PyExc_ValueError,
                          py::str("dtype={}: load converts floating-point tensors to a "
                                  "floating-point dtype (torch.bfloat16, torch.float16...); "
                                  "convert to other dtypes after loading")
                              .format(dtype)
                              .ptr());
          throw py::error_already_set();
        }
      },
      py::arg("dtype"), py::arg("is_dtype"), py::arg("floating"),
      "load's dtype, given that it is a torch.dtype (is_dtype) and a floating-point one: "
      "TypeError for what is no dtype, ValueError for another dtype than a floating-point one.");
  m.def(
      "byte_group_ends",
      [](const std::vector<uint64_t>& sizes, uint64_t limit) {
        std::vector<size_t> ends;
        uint64_t bytes = 0;
        for (size_t i = 0; i < sizes.size(); ++i) {
          if (i > 0 && bytes + sizes[i] > limit) {
            ends.push_back(i);
            bytes = 0;
          }
          bytes += sizes[i];
        }
        if (!sizes.empty()) ends.push_back(sizes.size());
        return ends;
      },
      py::arg("sizes"), py::arg("limit"),
      "The end index of each run of consecutive sizes whose sum is at most limit (a run of one "
      "where a size alone is larger), in order: how a load splits its pieces into groups.");
  m.def(
      "save_format",
      [](const py::object& path, const py::object& format) -> py::object {
        if (!format.is_none()) {
          if (format.equal(py::str("safetensors")) || format.equal(py::str("torch"))) {
            return format;
          }
          // The third argument of the calls save stands in for: safetensors' save_file(tensors,
          // filename, metadata), torch.save(obj, f, pickle_module).
          const char* hint =
              py::isinstance(format, py::module_::import("collections.abc").attr("Mapping"))
                  ? " (save's third argument is format; pass metadata as metadata=...)"
              : py::isinstance(format, py::module_::import("types").attr("ModuleType"))
                  ? " (save's third argument is format; pass a pickle module as "
                    "pickle_module=...)"
                  : "";
          PyErr_SetObject(
              PyExc_ValueError,
              (py::str("format must be 'safetensors' or 'torch', not {!r}").format(format) +
               py::str(hint))
                  .ptr());
          throw py::error_already_set();
        }
        if (path.is_none()) return py::str("torch");  // a file object, as torch.save writes
        const py::object name = py::module_::import("os").attr("fspath")(path);
        // A name that names no format is a torch file ("latest"), as torch.save writes any name.
        const auto named = FormatOfSuffix(name.cast<FsPath>().bytes);
        return py::str(std::string(CheckpointFormatName(named.value_or(CheckpointFormat::kTorch))));
      },
      py::arg("path"), py::arg("format"),
      "The format save writes to path (None: a file object): format ('safetensors' or 'torch') "
      "when given, else the one the file name names (format_of_suffix), else 'torch' "
      "(torch.save writes any name); ValueError for another format.");
  m.def(
      "shard_index_walk",
      [](const FsPath& path) {
        std::vector<Shard> shards;
        std::vector<std::string> kinds;
        {
          GilReleased release;
          shards = ReadShardIndex(path);
          for (Shard& s : shards) {
            s.path = std::filesystem::absolute(s.path).lexically_normal();
            const CheckpointKind kind = DetectCheckpointKind(s.path);
            if (kind == CheckpointKind::kShardIndex) {  // JSON under another name than .index.json
              throw std::invalid_argument(
                  StrCat(path.bytes, ": shard ", s.path, " is itself an index"));
            }
            kinds.emplace_back(CheckpointKindName(kind));
          }
        }
        py::list out;
        for (size_t i = 0; i < shards.size(); ++i) {
          out.append(py::make_tuple(PathToPython(shards[i].path), kinds[i], shards[i].names));
        }
        return out;
      },
      py::arg("path"),
      "[(shard path, kind, [tensor names])]: a shard index's shards (absolute paths, each once, "
      "in the index's order) with what each holds ('safetensors' or 'torch', by "
      "detect_checkpoint_kind's rule) and the names the index puts there. ValueError as "
      "read_shard_index and detect_checkpoint_kind raise.");
  m.def(
      "shard_names",
      [](const py::str& path, const py::str& shard, const py::list& names, const py::object& part) {
        if (!py::isinstance(part, py::module_::import("collections.abc").attr("Mapping"))) {
          PyErr_SetObject(PyExc_ValueError, py::str("{}: holds a {}, not a state dict")
                                                .format(shard, py::type::of(part).attr("__name__"))
                                                .ptr());
          throw py::error_already_set();
        }
        py::list missing;
        for (const py::handle name : names) {
          if (!part.contains(name)) missing.append(name);
        }
        if (!missing.empty()) {
          PyErr_SetObject(PyExc_ValueError, py::str("{}: the index puts {} in {}, which lacks them")
                                                .format(path, missing[py::slice(0, 8, 1)], shard)
                                                .ptr());
          throw py::error_already_set();
        }
        const py::set mine(names);
        py::list out;
        for (const py::handle name : part) {
          if (mine.contains(name)) out.append(name);
        }
        return out;
      },
      py::arg("path"), py::arg("shard"), py::arg("names"), py::arg("part"),
      "The names of what shard of index path holds (part, read from it) that the index puts "
      "there (names), in part's order: the weight_map is the checkpoint's list of tensors, so a "
      "tensor the index puts elsewhere or nowhere is not taken from it. ValueError when part is "
      "not a mapping, or lacks one of names.");
  m.def(
      "available_memory",
      [] {
        std::ifstream meminfo("/proc/meminfo");
        std::string key;
        uint64_t kib = 0;
        while (meminfo >> key >> kib) {
          if (key == "MemAvailable:") return kib * 1024;
          meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
        }
        return uint64_t{0};
      },
      "The bytes /proc/meminfo says are available (MemAvailable), 0 when it cannot tell.");
  m.def(
      "upgrade_note",
      [](const std::vector<std::tuple<std::string, std::string, py::object, py::object>>& subs) {
        std::vector<std::string> older;
        for (const auto& [prefix, type, saved, current] : subs) {
          if (!py::isinstance<py::int_>(current) || current.cast<py::int_>() <= py::int_(1)) {
            continue;
          }
          if (py::isinstance<py::int_>(saved) &&
              PyObject_RichCompareBool(saved.ptr(), current.ptr(), Py_GE) == 1) {
            continue;
          }
          const std::string was = saved.is_none()
                                      ? "no version"
                                      : StrCat("version ", py::repr(saved).cast<std::string>());
          older.push_back(StrCat("'", prefix, "' (", type, ", saved with ", was, ", now ",
                                 py::str(current).cast<std::string>(), ")"));
        }
        if (older.empty()) return std::string();
        std::string listed;
        for (size_t i = 0; i < std::min<size_t>(older.size(), 4); ++i) {
          listed += StrCat(i ? ", " : "", older[i]);
        }
        const std::string more =
            older.size() > 4 ? StrCat(" and ", older.size() - 4, " more") : std::string();
        return StrCat(
            "\n\tmodules saved at an older version: ", listed, more,
            "; load_state_dict upgrades their entries (their _load_from_state_dict), which "
            "load_into does not run: load this file with "
            "module.load_state_dict(tensortier.load(path))");
      },
      py::arg("modules"),
      "Why names may load with load_state_dict but not load_into: for (prefix, type name, the "
      "version the file's _metadata records or None, the class's _version) of the submodules "
      "holding them, the line naming those saved at an older version than now ('' when none).");
  m.def(
      "torch_persistent_id",
      [](const py::str& path, const py::object& saved_id) {
        py::list fields;
        if (py::isinstance<py::tuple>(saved_id) && py::len(saved_id) == 5) {
          for (const py::handle v : saved_id) {
            fields.append(py::isinstance<py::bytes>(v) ? v.attr("decode")("ascii") : v);
          }
        }
        if (fields.empty() || !py::str("storage").equal(fields[0]) ||
            !py::isinstance<py::str>(fields[2]) || !py::isinstance<py::int_>(fields[4])) {
          const py::object shown = py::repr(saved_id)[py::slice(0, 100, 1)];
          PyErr_SetObject(PyExc_ValueError,
                          py::str("{}: unexpected persistent id {}").format(path, shown).ptr());
          throw py::error_already_set();
        }
        return py::make_tuple(fields[1], fields[2], fields[3], fields[4]);
      },
      py::arg("path"), py::arg("saved_id"),
      "(storage type, key, location, numel) of a torch pickle's persistent id ('storage', "
      "type, key, location, numel; bytes decoded as ASCII, as torch.load does): ValueError "
      "naming path for any other.");
  m.def(
      "check_weights_only",
      [](const py::object& weights_only) {
        if (weights_only.is(py::bool_(false))) {
          throw py::value_error(
              "weights_only=False is not supported: tensortier loads pickles with torch's "
              "weights_only unpickler only and never runs arbitrary pickled code (a pickle can "
              "run any program); use torch.load(..., weights_only=False) for a file you trust");
        }
        if (!weights_only.is_none() && !weights_only.equal(py::bool_(true))) {
          PyErr_SetObject(
              PyExc_TypeError,
              py::str("weights_only must be True or None, not {!r}").format(weights_only).ptr());
          throw py::error_already_set();
        }
      },
      py::arg("weights_only"),
      "load's weights_only: True and None (torch.load's default) load as always; ValueError for "
      "False (tensortier never runs arbitrary pickled code), TypeError for anything else.");
  m.def(
      "check_read_length",
      [](const FsPath& path, const std::string& name, uint64_t offset, uint64_t nbytes,
         uint64_t got) {
        CheckReadLength(path, PieceRead{name, offset, nbytes, nullptr, PieceCheck::kNone, {}}, got);
      },
      py::arg("path"), py::arg("name"), py::arg("offset"), py::arg("nbytes"), py::arg("got"),
      "ValueError naming path and the piece, as read_pieces raises for a short file, when got "
      "bytes of the nbytes at offset came back (a read outside read_pieces).");
}
