// tensortier._core's training-data reader: file lists, shard plans and the batch reader. Batches
// cross as buffers (the arena) plus per-sample offsets and sizes; python/tensortier/data makes
// the tensors.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "arguments.hpp"
#include "binding_helpers.hpp"
#include "dlpack_export.hpp"
#include "gil.hpp"
#include "gil_free_holder.hpp"
#include "paths.hpp"
#include "tensortier/data/batch_reader.hpp"
#include "tensortier/data/sample_inputs.hpp"
#include "tensortier/data/sample_list.hpp"
#include "tensortier/data/shard_plan.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

// Each sample of a batch as a DLPack tensor that owns a reference to the batch, so that its arena
// goes back to the reader only when the last consumer lets go.
py::list SamplesAsDlpack(const std::shared_ptr<Batch>& batch) {
  static std::byte empty{};  // a pointer for samples of an empty arena (all files empty)
  auto* base = const_cast<std::byte*>(batch->data());
  if (base == nullptr) base = &empty;
  const auto& offsets = batch->offsets();
  const auto& sizes = batch->sizes();
  py::list out(offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    out[i] = BytesAsDlpack(batch, base + offsets[i], sizes[i]);
  }
  return out;
}

// `value` (one glob or a sequence of them) as a list; None stays nullopt.
std::optional<std::vector<std::string>> Globs(const char* name, const py::handle& value) {
  if (value.is_none()) return std::nullopt;
  if (py::isinstance<py::str>(value)) return std::vector<std::string>{value.cast<std::string>()};
  std::vector<std::string> globs;
  bool valid = py::isinstance<py::iterable>(value) && !py::isinstance<py::bytes>(value);
  if (valid) {
    for (const py::handle glob : value) {
      valid = py::isinstance<py::str>(glob);
      if (!valid) break;
      globs.push_back(glob.cast<std::string>());
    }
  }
  if (!valid) {
    throw py::type_error(std::string(name) + " must be a glob string or a list of them, not " +
                         py::repr(value).cast<std::string>());
  }
  return globs;
}

// Labels as integers: Python ints or numpy integers, never bools, strings or floats (DALI takes
// integers only; "1" and 1.5 are refused, not converted). Range is ResolveSampleInputs's check.
std::vector<int64_t> LabelsFromPython(const py::handle& labels) {
  const char* flat = "labels must be a flat sequence of integers, one per file";
  if (py::isinstance<py::str>(labels) || py::isinstance<py::bytes>(labels) ||
      !py::isinstance<py::iterable>(labels)) {
    throw py::type_error(flat);
  }
  std::vector<int64_t> out;
  for (const py::handle label : labels) {
    const std::string type = Py_TYPE(label.ptr())->tp_name;
    if (PyBool_Check(label.ptr()) || type == "numpy.bool" || type == "numpy.bool_" ||
        !PyIndex_Check(label.ptr())) {
      if (py::isinstance<py::sequence>(label) && !py::isinstance<py::str>(label)) {
        throw py::type_error(flat);
      }
      throw py::type_error("labels must be integers, not " + type + " values such as " +
                           py::repr(label).cast<std::string>());
    }
    const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(label.ptr()));
    if (!index) throw py::error_already_set();
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow != 0) throw py::value_error("labels must fit in int32");
    if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
    out.push_back(value);
  }
  return out;
}

py::array_t<int32_t> LabelArray(const std::vector<int32_t>& labels) {
  py::array_t<int32_t> out(static_cast<py::ssize_t>(labels.size()));
  if (!labels.empty()) std::memcpy(out.mutable_data(), labels.data(), labels.size() * 4);
  return out;
}

// `value` as a Python int (not a bool; a numpy integer, which a loop over np.arange gives, as
// its int) from `minimum` to 2**bits - 1, else nullopt.
std::optional<uint64_t> ReaderInteger(const py::handle& value, uint64_t minimum, int bits) {
  py::object integer = py::reinterpret_borrow<py::object>(value);
  if (!IsPlainInt(value)) {
    if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr())) return std::nullopt;
    PyObject* index = PyNumber_Index(value.ptr());
    if (index == nullptr) {
      PyErr_Clear();
      return std::nullopt;
    }
    integer = py::reinterpret_steal<py::object>(index);
  }
  const unsigned long long number = PyLong_AsUnsignedLongLong(integer.ptr());
  if (PyErr_Occurred() != nullptr) {  // negative, or past 64 bits
    PyErr_Clear();
    return std::nullopt;
  }
  if (number < minimum || (bits < 64 && number >= (1ULL << bits))) return std::nullopt;
  return number;
}

// ValueError "<name> must be a positive|non-negative <bits>-bit integer, not <repr>" unless
// `value` is one (as ReaderInteger takes it).
uint64_t ReaderSetting(const py::handle& value, const char* name, uint64_t minimum, int bits) {
  const std::optional<uint64_t> number = ReaderInteger(value, minimum, bits);
  if (!number) {
    throw py::value_error(StrCat(name, " must be a ", minimum > 0 ? "positive" : "non-negative",
                                 " ", bits, "-bit integer, not ", ReprOf(value)));
  }
  return *number;
}

using LabelArray32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

std::string FilesDigestOf(const std::vector<FsPath>& paths, const LabelArray32& labels,
                          bool spelled) {
  const std::vector<std::string> bytes = PathBytes(paths);
  std::vector<int32_t> values(labels.data(), labels.data() + labels.size());
  GilReleased release;
  return FilesDigest(bytes, values, spelled);
}

// A FileReader's place in its files: the settings that fix the order, the shard plan they make,
// the epoch and the batches of it given out, and a count of the moves (set_epoch,
// load_state_dict) that an iteration under way follows. Its state dict resumes only a reader
// with the same settings, paths and labels.
class ReaderState {
 public:
  ReaderState(py::object paths, py::object labels, uint64_t batch_size, bool shuffle, uint64_t seed,
              uint64_t shard_id, uint64_t num_shards, bool stick_to_shard, bool pad_last_batch,
              bool drop_last)
      : paths_(std::move(paths)),
        labels_(std::move(labels)),
        plan_(ShardSpec{.batch_size = batch_size,
                        .shuffle = shuffle,
                        .seed = seed,
                        .shard_id = shard_id,
                        .num_shards = num_shards,
                        .stick_to_shard = stick_to_shard,
                        .pad_last_batch = pad_last_batch,
                        .drop_last = drop_last},
              py::len(paths_)) {
    config_["num_files"] = py::len(paths_);
    config_["batch_size"] = batch_size;
    config_["shuffle"] = shuffle;
    config_["seed"] = seed;
    config_["shard_id"] = shard_id;
    config_["num_shards"] = num_shards;
    config_["stick_to_shard"] = stick_to_shard;
    config_["pad_last_batch"] = pad_last_batch;
    config_["drop_last"] = drop_last;
    config_["shuffle_version"] = kShuffleVersion;
  }

  size_t EpochLength(uint64_t epoch) const { return plan_.EpochBatches(epoch).size(); }

  // The current epoch's batches not given out yet.
  std::vector<std::vector<uint64_t>> Remaining() const {
    std::vector<std::vector<uint64_t>> batches = plan_.EpochBatches(epoch_);
    batches.erase(batches.begin(),
                  batches.begin() + static_cast<ptrdiff_t>(std::min(position_, batches.size())));
    return batches;
  }

  void Advance() {
    ++position_;
    resumed_ = false;
  }
  void NextEpoch() {
    ++epoch_;
    position_ = 0;
    resumed_ = false;
  }

  void SetEpoch(const py::object& epoch) {
    const uint64_t number = ReaderSetting(epoch, "epoch", 0, 64);
    // The epoch under way keeps its place, and so does the epoch a state was just loaded at
    // (`for epoch in range(start, n): reader.set_epoch(epoch)` after a resume, as with
    // DistributedSampler.set_epoch under torchdata's StatefulDataLoader).
    if (number == epoch_ && (iteration_ != 0 || resumed_)) return;
    epoch_ = number;
    position_ = 0;
    resumed_ = false;
    ++moves_;
  }

  std::vector<uint64_t> EpochIndices(const py::object& epoch) const {
    return plan_.EpochSamples(ReaderSetting(epoch, "epoch", 0, 64));
  }

  // The reader's read-ahead serves one iteration at a time: the one that last started.
  uint64_t NewIteration() { return ++iterations_; }
  void Serve(uint64_t iteration) { iteration_ = iteration; }
  bool Serves(uint64_t iteration) const { return iteration_ == iteration; }

  py::dict StateDict() {
    py::dict state;
    state["epoch"] = epoch_;
    state["position"] = position_;
    for (const auto& [key, value] : config_) state[key] = value;
    state["files_digest"] = Digest();
    return state;
  }

  void LoadStateDict(const py::object& state) {
    if (!py::isinstance(state, py::module_::import("collections.abc").attr("Mapping"))) {
      throw py::type_error(
          StrCat("load_state_dict takes the dict that FileReader.state_dict() "
                 "returns (epoch, position, settings and files_digest), not ",
                 TypeName(state)));
    }
    const py::object get = state.attr("get");
    py::dict expected = config_.attr("copy")();
    // A state taken before the shuffle had versions orders its epochs by version 1.
    const py::object version_given = get("shuffle_version", 1);
    const std::optional<uint64_t> version = ReaderInteger(version_given, 0, 64);
    if (!version || (*version != 1 && *version != kShuffleVersion)) {
      throw py::value_error(StrCat("state_dict has shuffle_version=", ReprOf(version_given),
                                   ": this reader orders files by versions 1 and ", kShuffleVersion,
                                   " only"));
    }
    PyDict_DelItemString(expected.ptr(), "shuffle_version");
    if (state.contains("files_digest")) {
      const py::object digest = state["files_digest"];
      expected["files_digest"] = Digest();
      // A state taken before paths were resolved has the digest of the paths as spelled.
      if (digest.not_equal(expected["files_digest"]) &&
          digest.equal(py::str(FilesDigestOf(paths_.cast<std::vector<FsPath>>(),
                                             labels_.cast<LabelArray32>(), true)))) {
        PyDict_DelItemString(expected.ptr(), "files_digest");
      }
    }
    for (const auto& [key, value] : expected) {
      const py::object given = get(key);
      if (given.not_equal(value)) {
        throw py::value_error(StrCat("state_dict has ", py::str(key).cast<std::string>(), "=",
                                     ReprOf(given), ", this reader ", ReprOf(value),
                                     ": it was taken from a reader of other files or settings"));
      }
    }
    const py::object epoch = get("epoch");
    const py::object position = get("position");
    const std::optional<uint64_t> e = ReaderInteger(epoch, 0, 64);
    const std::optional<uint64_t> p = ReaderInteger(position, 0, 64);
    // A position past the epoch's batches would silently skip to the next epoch.
    if (!e || !p || *p > EpochLength(*e)) {
      throw py::value_error(StrCat("state_dict has a bad position: epoch=", ReprOf(epoch),
                                   ", position=", ReprOf(position)));
    }
    UseShuffleVersion(*version);
    epoch_ = *e;
    position_ = *p;
    resumed_ = true;
    ++moves_;
  }

  // The plan of the same settings under shuffle `version` (a resumed state's).
  void UseShuffleVersion(uint64_t version) {
    if (version == plan_.spec().shuffle_version) return;
    ShardSpec spec = plan_.spec();
    spec.shuffle_version = version;
    plan_ = ShardPlan(spec, plan_.num_files());
    config_["shuffle_version"] = version;
  }

  uint64_t epoch() const { return epoch_; }
  uint64_t moves() const { return moves_; }
  const py::dict& config() const { return config_; }

 private:
  // Resolving and hashing every path costs ~0.5 s per million files: paid by the readers whose
  // state is taken or loaded, not by every reader (a DataLoader worker's each epoch).
  const std::string& Digest() {
    if (!digest_) {
      digest_ =
          FilesDigestOf(paths_.cast<std::vector<FsPath>>(), labels_.cast<LabelArray32>(), false);
    }
    return *digest_;
  }

  py::object paths_;
  py::object labels_;
  ShardPlan plan_;
  py::dict config_;
  bool resumed_ = false;  // a state was loaded, and no batch given out since
  uint64_t epoch_ = 0;
  uint64_t position_ = 0;  // batches of epoch_ given out
  uint64_t moves_ = 0;
  uint64_t iterations_ = 0;
  uint64_t iteration_ = 0;  // the iteration served; 0: none under way
  std::optional<std::string> digest_;
};

// FileReader.batches(): the current epoch's remaining batches, read ahead by a BatchReader. It
// takes the read-ahead over when first advanced; it follows a set_epoch or load_state_dict made
// meanwhile from the state's new place, and ends once a later iteration (or close()) takes over.
// One that `rewinds` (DaliSource) starts again, at the reader's place, on the call after the one
// that ended it (StopIteration or an error).
class ReaderIteration {
 public:
  ReaderIteration(py::object state, py::object reader, bool rewinds)
      : state_object_(std::move(state)),
        reader_object_(std::move(reader)),
        state_(state_object_.cast<ReaderState&>()),
        reader_(reader_object_.cast<BatchReader&>()),
        rewinds_(rewinds),
        id_(state_.NewIteration()) {}
  ReaderIteration(const ReaderIteration&) = delete;
  ReaderIteration& operator=(const ReaderIteration&) = delete;
  ~ReaderIteration() { Finish(); }

  std::shared_ptr<Batch> Next() {
    // Step releases the GIL around the reader, which takes one consumer: a second thread on the
    // same iteration gets a generator's error instead of a hang.
    if (running_) throw py::value_error("generator already executing");
    running_ = true;
    struct Running {
      bool& flag;
      ~Running() { flag = false; }
    } running{running_};
    try {
      return Step();
    } catch (...) {
      Finish();  // ended, left or failed: no iteration is under way
      throw;
    }
  }

 private:
  std::shared_ptr<Batch> Step() {
    if (done_ && rewinds_) {
      done_ = started_ = false;
      id_ = state_.NewIteration();
    }
    if (done_ || (started_ && !state_.Serves(id_))) throw py::stop_iteration();
    if (!started_ || state_.moves() != moves_) {
      started_ = true;
      state_.Serve(id_);
      moves_ = state_.moves();
      pending_ = state_.Remaining();
      given_ = 0;
      {
        GilReleased release;
        start_ = reader_.Start(pending_);
      }
      // A close() while the GIL was away, before this Start: the read-ahead it stopped must not
      // run again for an iteration that has ended.
      if (!state_.Serves(id_)) {
        if (state_.Serves(0)) {
          GilReleased release;
          reader_.Start({});
        }
        throw py::stop_iteration();
      }
    }
    if (given_ == pending_.size()) {
      state_.NextEpoch();
      throw py::stop_iteration();
    }
    std::shared_ptr<const Batch> batch;
    {
      GilReleased release;
      batch = reader_.Next(start_);
    }
    if (batch == nullptr) throw py::stop_iteration();  // the reader was closed meanwhile
    ++given_;
    state_.Advance();
    return std::const_pointer_cast<Batch>(batch);
  }

  void Finish() {
    if (started_ && state_.Serves(id_)) state_.Serve(0);
    done_ = true;
  }

  py::object state_object_;  // keep the state and the reader alive
  py::object reader_object_;
  ReaderState& state_;
  BatchReader& reader_;
  const bool rewinds_;
  uint64_t id_;
  bool started_ = false;
  bool done_ = false;
  bool running_ = false;  // a Next() is under way (read and set under the GIL)
  uint64_t moves_ = 0;
  std::vector<std::vector<uint64_t>> pending_;  // of the last Start()
  uint64_t start_ = 0;                          // what the last Start() returned
  size_t given_ = 0;
};

}  // namespace

void RegisterData(py::module_& m) {
  m.def(
      "list_file_root",
      [](const FsPath& root, std::optional<std::vector<std::string>> file_filters,
         bool case_sensitive_filter, std::optional<std::vector<std::string>> dir_filters) {
        FileFilter filter;
        if (file_filters) filter.patterns = std::move(*file_filters);
        filter.case_sensitive = case_sensitive_filter;
        SampleList list;
        {
          GilReleased release;
          list = ListFileRoot(root, filter, dir_filters);
        }
        return py::make_tuple(PathsToPython(list.paths), list.labels);
      },
      py::arg("root"), py::arg("file_filters") = py::none(),
      py::arg("case_sensitive_filter") = false, py::arg("dir_filters") = py::none(),
      "(paths, labels) of a folder with one subfolder per class (DALI's rule), the files whose "
      "names match file_filters (default: DALI's) in the subfolders matching dir_filters "
      "(default: all).");
  m.attr("default_file_filters") = DefaultFileFilters();
  m.def(
      "read_file_list",
      [](const FsPath& list_path, const FsPath& root) {
        SampleList list;
        {
          GilReleased release;
          list = ReadFileList(list_path, root);
        }
        return py::make_tuple(PathsToPython(list.paths), list.labels);
      },
      py::arg("list_path"), py::arg("root") = "",
      "(paths, labels) of a DALI file list ('path label' per line).");
  m.def(
      "check_files_exist",
      [](const std::vector<FsPath>& paths) {
        const std::vector<std::string> bytes = PathBytes(paths);
        GilReleased release;
        CheckFilesExist(bytes);
      },
      py::arg("paths"));
  m.def(
      "resolve_sample_inputs",
      [](const py::object& root_arg, const py::object& file_list_arg, py::object files,
         const py::object& labels, bool check_files, const py::object& file_filters,
         bool case_sensitive_filter, const py::object& dir_filters) -> py::tuple {
        const auto path = [](const py::object& value, const char* what) -> std::optional<FsPath> {
          if (value.is_none()) return std::nullopt;
          return FsPathArgument(value, what).cast<FsPath>();
        };
        const std::optional<FsPath> root = path(root_arg, "file_root");
        const std::optional<FsPath> file_list = path(file_list_arg, "file_list");
        if (!files.is_none()) {
          // One path is a sequence of letters: refused, not read as one file per letter.
          if (py::isinstance<py::str>(files) || py::isinstance<py::bytes>(files) ||
              py::hasattr(files, "__fspath__")) {
            throw py::type_error(StrCat("files must be a list of paths, not one path (",
                                        ReprOf(files), "): pass files=[path]"));
          }
          py::list named;
          for (const py::handle file : files) named.append(FsPathArgument(file, "files[i]"));
          files = named;
        }
        SampleInputs in;
        if (auto globs = Globs("file_filters", file_filters)) in.filter.patterns = *globs;
        in.filter.case_sensitive = case_sensitive_filter;
        in.dir_filters = Globs("dir_filters", dir_filters);
        if (!labels.is_none()) in.labels = LabelsFromPython(labels);
        if (!files.is_none() && !file_list && (!root || root->bytes.empty())) {
          // The paths are the list given: they cross into C++ only to be checked.
          std::vector<int32_t> values = FileLabels(py::len(files), in.labels);
          if (check_files) {
            const std::vector<std::string> bytes = PathBytes(files.cast<std::vector<FsPath>>());
            GilReleased release;
            CheckFilesExist(bytes);
          }
          return py::make_tuple(files, LabelArray(values));
        }
        if (root) in.root = root->bytes;
        if (file_list) in.file_list = file_list->bytes;
        if (!files.is_none()) in.files = PathBytes(files.cast<std::vector<FsPath>>());
        in.check_files = check_files;
        SampleList list;
        {
          GilReleased release;
          list = ResolveSampleInputs(std::move(in));
        }
        return py::make_tuple(PathsToPython(list.paths), LabelArray(list.labels));
      },
      py::arg("file_root") = py::none(), py::arg("file_list") = py::none(),
      py::arg("files") = py::none(), py::arg("labels") = py::none(), py::arg("check_files") = true,
      py::arg("file_filters") = py::none(), py::arg("case_sensitive_filter") = false,
      py::arg("dir_filters") = py::none(),
      "The (paths, int32 labels) named by DALI's fn.readers.file inputs, checked to exist "
      "(check_files). file_filters, dir_filters and case_sensitive_filter select the class "
      "folders of a file_root and their files as DALI does (ignored with file_list or files). "
      "ValueError: inputs given in a combination DALI refuses, or an empty list or folder. "
      "TypeError: a path that is not one, or file_filters or dir_filters not a string or a list "
      "of strings. OSError: a listed file or the folder cannot be reached (FileNotFoundError "
      "names it).");
  m.def("files_digest", &FilesDigestOf, py::arg("paths"), py::arg("labels"),
        py::arg("spelled") = false,
        "SHA-256 of the paths (by their folders' real paths unless spelled) and int32 labels.");
  m.def("epoch_permutation", &EpochPermutation, py::arg("size"), py::arg("seed"), py::arg("epoch"),
        py::arg("version") = kShuffleVersion);
  m.def("shard_start", &ShardStart, py::arg("shard_id"), py::arg("num_shards"), py::arg("size"));
  m.def("shard_padded_size", &ShardPaddedSize, py::arg("num_shards"), py::arg("size"));

  m.def(
      "shared_counter_add",
      [](uintptr_t address, int64_t value) {
        // FileDataset's count of skipped files, in memory its DataLoader workers share: a
        // lock-free atomic is address-free, so processes add to it without losing a count.
        if (address == 0 || address % std::atomic_ref<int64_t>::required_alignment != 0)
          throw py::value_error("shared_counter_add: address " + std::to_string(address) +
                                " is not that of an int64");
        static_assert(std::atomic_ref<int64_t>::is_always_lock_free);
        return std::atomic_ref<int64_t>(*reinterpret_cast<int64_t*>(address)).fetch_add(value) +
               value;
      },
      py::arg("address"), py::arg("value"),
      "Adds value to the int64 at address atomically, also against other processes mapping "
      "it; returns the sum. ValueError: an address that is null or not 8-byte aligned.");
  m.def(
      "check_reader_choices",
      [](const py::dict& flags, const py::object& backend) {
        py::dict out;
        for (const auto& [name, value] : flags) {
          const std::string n = py::str(name);
          out[name] = FlagArgument(py::reinterpret_borrow<py::object>(value), n.c_str());
        }
        if (!backend.is_none()) {
          if (!PyUnicode_Check(backend.ptr())) {
            throw py::type_error("backend must be a str, not " + TypeName(backend));
          }
          BackendWord(backend.cast<std::string>());  // ValueError naming the choices
        }
        return out;
      },
      py::arg("flags"), py::arg("backend"),
      "FileReader's flags (name -> value) as bools, None kept (TypeError naming one that is "
      "neither: a string such as 'False' would be true), and its backend checked (ValueError "
      "unless None or one of the engine's).");
  m.def("check_reader_setting", &ReaderSetting, py::arg("value"), py::arg("name"),
        py::arg("minimum"), py::arg("bits"),
        "value as an integer (a Python int, not a bool) of at least minimum below 2**bits; "
        "ValueError naming it otherwise, as FileReader's settings are checked.");
  m.def(
      "check_reader_settings",
      [](const py::object& batch_size, const py::object& prefetch, const py::object& num_shards,
         const py::object& open_threads, const py::object& seed, const py::object& shard_id,
         const py::object& on_error) {
        if (!py::str("raise").equal(on_error) && !py::str("skip").equal(on_error)) {
          throw py::value_error("on_error must be 'raise' or 'skip', not " + ReprOf(on_error));
        }
        ReaderSetting(batch_size, "batch_size", 1, 64);
        ReaderSetting(prefetch, "prefetch", 1, 32);
        ReaderSetting(num_shards, "num_shards", 1, 64);
        ReaderSetting(open_threads, "open_threads", 1, 32);
        ReaderSetting(seed, "seed", 0, 64);
        ReaderSetting(shard_id, "shard_id", 0, 64);
      },
      py::arg("batch_size"), py::arg("prefetch"), py::arg("num_shards"), py::arg("open_threads"),
      py::arg("seed"), py::arg("shard_id"), py::arg("on_error"),
      "FileReader's settings checked (integers: Python ints, not bools): ValueError naming the "
      "first that is out of its range.");
  py::class_<ReaderState>(m, "ReaderState",
                          "A FileReader's place in its files, and the state dict that resumes it.")
      .def(py::init<py::object, py::object, uint64_t, bool, uint64_t, uint64_t, uint64_t, bool,
                    bool, bool>(),
           py::arg("paths"), py::arg("labels"), py::arg("batch_size"), py::arg("shuffle"),
           py::arg("seed"), py::arg("shard_id"), py::arg("num_shards"), py::arg("stick_to_shard"),
           py::arg("pad_last_batch"), py::arg("drop_last"))
      .def(
          "__len__", [](const ReaderState& s) { return s.EpochLength(s.epoch()); },
          "Batches in the current epoch.")
      .def("set_epoch", &ReaderState::SetEpoch, py::arg("epoch"),
           "Starts `epoch` from its first batch, unless it is the epoch an iteration has under "
           "way; ValueError for an epoch that is no non-negative 64-bit integer.")
      .def("epoch_indices", &ReaderState::EpochIndices, py::arg("epoch"),
           "File indices of `epoch`, in order, padding included; ValueError for an epoch that is "
           "no non-negative 64-bit integer.")
      .def(
          "iterate",
          [](py::object state, py::object reader, bool rewinds) {
            return std::make_unique<ReaderIteration>(std::move(state), std::move(reader), rewinds);
          },
          py::arg("reader"), py::arg("rewinds") = false,
          "The current epoch's remaining batches, read by `reader`; with `rewinds`, the next "
          "epoch's (from the reader's place) on the call after the one that ended an epoch.")
      .def(
          "close",
          [](ReaderState& s, BatchReader& reader) {
            s.Serve(0);
            GilReleased release;
            reader.Start({});
          },
          py::arg("reader"), "Ends the iteration under way and stops `reader`'s read-ahead.")
      .def("state_dict", &ReaderState::StateDict, "epoch, position, the settings and files_digest.")
      .def("load_state_dict", &ReaderState::LoadStateDict, py::arg("state"),
           "Resumes at `state` (TypeError: not a mapping; ValueError: another reader's, or a "
           "bad position).")
      .def_property_readonly("epoch", &ReaderState::epoch)
      .def_property_readonly("config",
                             [](const ReaderState& s) { return s.config().attr("copy")(); });

  py::class_<ReaderIteration>(m, "ReaderIteration", "FileReader.batches(): Batch objects.")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__", &ReaderIteration::Next);

  py::class_<Batch, std::shared_ptr<Batch>>(m, "Batch", py::buffer_protocol())
      .def_property_readonly("indices", &Batch::indices)
      .def_property_readonly("offsets", &Batch::offsets)
      .def_property_readonly("sizes", &Batch::sizes)
      .def_property_readonly("pinned", &Batch::pinned)
      .def_property_readonly("skipped",
                             [](const Batch& b) {
                               py::list out;
                               for (const auto& s : b.skipped()) {
                                 out.append(py::make_tuple(s.index, MessageToPython(s.message)));
                               }
                               return out;
                             })
      .def("__len__", [](const Batch& b) { return b.size(); })
      .def("dlpack_samples", &SamplesAsDlpack,
           "One DLPack capsule per sample (uint8, 1-D, CPU), each keeping the batch's arena "
           "alive until its consumer frees it.")
      .def_buffer([](Batch& b) {
        // Writable: the arena is the batch's own, and torch warns on read-only buffers.
        auto* data = const_cast<std::byte*>(b.data());
        static std::byte empty{};
        return py::buffer_info(data != nullptr ? data : &empty, 1,
                               py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(b.size())}, {1});
      });

  py::class_<BatchReader, GilFreeHolder<BatchReader>>(m, "BatchReader")
      .def(py::init([](const std::vector<FsPath>& paths, unsigned prefetch, unsigned open_threads,
                       bool skip_errors, bool direct, bool pin_memory, int device,
                       std::optional<std::string> backend, std::optional<ExtentMap> extent_map,
                       bool extent_checksums) {
             BatchReaderOptions options;
             options.prefetch = prefetch;
             options.open_threads = open_threads;
             options.skip_errors = skip_errors;
             options.direct = direct;
             options.pin_memory = pin_memory;
             options.device = device;
             if (backend) options.engine.backend = BackendWord(*backend);
             options.extent_map = std::move(extent_map);
             options.extent_checksums = extent_checksums;
             options.backend_factory = TestBackends(options.engine);
             GilReleased release;
             return GilFreeHolder<BatchReader>(new BatchReader(PathBytes(paths), options));
           }),
           py::arg("paths"), py::arg("prefetch") = 2, py::arg("open_threads") = 16,
           py::arg("skip_errors") = false, py::arg("direct") = true, py::arg("pin_memory") = false,
           py::arg("device") = 0, py::arg("backend") = py::none(),
           py::arg("extent_map") = py::none(), py::arg("extent_checksums") = true)
      .def("start", &BatchReader::Start, py::arg("batches"), py::call_guard<GilReleased>())
      .def("next",
           [](BatchReader& r) -> std::shared_ptr<Batch> {
             std::shared_ptr<const Batch> batch;
             {
               GilReleased release;
               batch = r.Next();
             }
             return std::const_pointer_cast<Batch>(batch);
           })
      .def_property_readonly("backend", &BatchReader::backend)
      .def_property_readonly("num_files", [](const BatchReader& r) { return r.paths().size(); })
      .def("stats", [](const BatchReader& r) {
        BatchReaderStats s = r.stats();
        py::dict d;
        d["batches"] = s.batches;
        d["files"] = s.files;
        d["bytes"] = s.bytes;
        d["skipped"] = s.skipped;
        d["direct_bytes"] = s.direct_bytes;
        d["cached_bytes"] = s.cached_bytes;
        d["raw_files"] = s.raw_files;
        d["fallback_files"] = s.fallback_files;
        return d;
      });
}
