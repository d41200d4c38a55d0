// DiskOffloader's entries: which key holds which tensor's data, found through the tensor given or
// its storage (`param.data` written, `param` read), in which state, and what an operation in
// flight keeps alive. A key's data is dropped once both the tensor and its storage have died.
//
// Deaths are noticed by weak references whose callbacks run wherever the last reference goes,
// maybe amid the offloader's own code: a callback only queues the death and calls the offloader's
// hook (which drains the queue if the offloader's lock is free). Called with the GIL held, under
// the Python offloader's lock; Python objects an entry lets go of die after the call's changes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "arguments.hpp"
#include "cycle_collected.hpp"
#include "gil.hpp"
#include "offload_arguments.hpp"
#include "offload_tensors.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/process_identity.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

// A callback is refused when given, not at the wait (the memory freed, the error out of place).
void CheckCallback(const py::handle& callback) {
  if (!callback.is_none() && PyCallable_Check(callback.ptr()) == 0) {
    throw py::type_error(StrCat("callback must be callable or None, not ", TypeName(callback)));
  }
}

namespace {

// Entries follow storages by identity: torch must keep one Python object per storage.
void RequirePreservedStorages() {
  static const bool preserved = [] {
    const py::module_ torch = py::module_::import("torch");
    const py::object probe = torch.attr("empty")(1);
    if (!probe.attr("untyped_storage")().is(probe.attr("untyped_storage")())) {
      throw std::runtime_error(StrCat(
          "torch ", py::str(torch.attr("__version__")).cast<std::string>(),
          " makes a new Python object per untyped_storage() call; DiskOffloader needs one per "
          "storage (newer PyTorch releases keep it): upgrade torch"));
    }
    return true;
  }();
  (void)preserved;
}

enum class State { kWriting, kStored, kReading };
constexpr EnumName<State> kStateNames[] = {
    {State::kWriting, "writing"}, {State::kStored, "stored"}, {State::kReading, "reading"}};

enum Part { kTensor = 0, kStorage = 1 };

uintptr_t Id(const py::handle& obj) {
  return reinterpret_cast<uintptr_t>(obj.ptr());
}

class OffloadEntries {
 public:
  OffloadEntries(Offloader& offloader, py::object hook)
      : offloader_(offloader), hook_(std::move(hook)) {}
  // The deaths the entries' last references cause are queued while every member still lives.
  ~OffloadEntries() {
    Clear();
    forgotten_.clear();
  }
  OffloadEntries(const OffloadEntries&) = delete;
  OffloadEntries& operator=(const OffloadEntries&) = delete;

  // The key whose data `tensor` stands for: the tensor written, or another tensor covering all
  // of its storage (a view of part of it would have the whole moved at its address).
  std::optional<uint64_t> Find(const py::handle& tensor) const {
    if (const Entry* e = Mapped(kTensor, tensor); e != nullptr && Watches(*e, kTensor, tensor)) {
      return e->key;
    }
    const py::object storage = tensor.attr("untyped_storage")();
    const Entry* e = Mapped(kStorage, storage);
    if (e == nullptr || !Watches(*e, kStorage, storage) ||
        tensor.attr("storage_offset")().cast<int64_t>() != 0 ||
        tensor.attr("nbytes").cast<uint64_t>() != e->nbytes) {
      return std::nullopt;
    }
    return e->key;
  }

  // Whether `tensor` (anything) stands for data parked here (written, not yet read back).
  bool IsOffloaded(const py::handle& tensor) const {
    static const py::handle tensor_type =  // looked up once: this is a per-tensor call
        py::object(py::module_::import("torch").attr("Tensor")).release();
    static const py::handle strided =
        py::object(py::module_::import("torch").attr("strided")).release();
    if (!py::isinstance(tensor, tensor_type) ||
        py::object(tensor.attr("layout")).ptr() != strided.ptr()) {
      return false;
    }
    const auto key = Find(tensor);
    return key && At(*key).state != State::kWriting;
  }

  // Whether TensorNVMe would find each of `tensors` to read back: offloaded, and not being read
  // (TensorNVMe takes a tensor's key when its read starts: a second read of it finds nothing,
  // even while the first runs).
  bool Readable(const py::list& tensors) const {
    for (const py::handle t : tensors) {
      const auto key = Find(t);
      if (!key || At(*key).state == State::kReading) return false;
    }
    return true;
  }
  // Whether `tensor` is the tensor `key` was written from (not another of its storage).
  bool Holds(uint64_t key, const py::handle& tensor) const {
    return Watches(At(key), kTensor, tensor);
  }

  // The keys a write of `tensors` supersedes (with `supersede`, TensorNVMe's rule: a tensor being
  // written is written again); None while one of them is being read (wait for the reads first).
  // ValueError for a tensor given twice or already offloaded.
  std::optional<std::vector<uint64_t>> CheckWrite(const py::list& tensors, bool supersede) const {
    RequirePreservedStorages();
    CheckTensors(tensors, "write");
    std::vector<std::optional<uint64_t>> keys;
    for (const py::handle t : tensors) {
      keys.push_back(Find(t));
      if (keys.back() && At(*keys.back()).state == State::kReading) return std::nullopt;
    }
    std::vector<uint64_t> superseded;
    for (const auto& key : keys) {
      if (key && supersede && At(*key).state == State::kWriting) {
        superseded.push_back(*key);
      } else if (key) {
        throw py::value_error(At(*key).state == State::kStored ? "tensor is already offloaded"
                                                               : "tensor is already being written");
      }
    }
    for (const py::handle t : tensors) {
      CheckOffloadWrite(FactsOf(t), t.attr("data_ptr")().cast<uintptr_t>());
    }
    return superseded;
  }

  std::vector<uint64_t> NewKeys(size_t n) {
    std::vector<uint64_t> keys(n);
    for (uint64_t& k : keys) k = next_key_++;
    return keys;
  }

  // Records the writes started under `keys`; `callback` runs after the last one's.
  void Add(const std::vector<uint64_t>& keys, const py::list& tensors, const py::object& callback,
           const std::vector<uint64_t>& superseded) {
    std::vector<py::object> dropped;
    for (const uint64_t key : superseded) {
      Entry& old = At(key);
      old.superseded = true;  // the later entry watches the tensor and its storage
      for (py::object& w : old.watch) dropped.push_back(std::move(w));
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      const py::handle t = tensors[i];
      Entry& e = entries_[keys[i]];
      e.key = keys[i];
      e.nbytes = t.attr("nbytes").cast<uint64_t>();
      e.tensor = py::reinterpret_borrow<py::object>(t);
      e.storage = t.attr("untyped_storage")();
      if (i + 1 == keys.size()) e.callback = callback;
      Watch(keys[i], kTensor, e.tensor);
      Watch(keys[i], kStorage, e.storage);
    }
  }

  // The keys `tensors` (all distinct, all offloaded) are read back from; None while one of them
  // is being written and `settled` is false (wait for the writes first). ValueError otherwise.
  std::optional<std::vector<uint64_t>> ReadKeys(const py::list& tensors, bool settled) const {
    CheckTensors(tensors, "read");
    std::vector<uint64_t> keys;
    for (const py::handle t : tensors) {
      const auto key = Find(t);
      if (!key) {
        throw py::value_error(settled ? "tensor's write failed, so there is nothing to read"
                                      : "tensor is not offloaded by this DiskOffloader (never "
                                        "written, or already read back)");
      }
      keys.push_back(*key);
    }
    for (const uint64_t key : keys) {
      if (At(key).state == State::kWriting) return std::nullopt;
    }
    if (std::set<uint64_t>(keys.begin(), keys.end()).size() != keys.size()) {
      throw py::value_error(
          "two of these tensors stand for one offloaded tensor (the tensor written and another "
          "tensor of its storage): read it once");
    }
    for (const uint64_t key : keys) {
      if (At(key).state == State::kReading) throw py::value_error("tensor is already being read");
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      CheckOffloadReadTarget(FactsOf(tensors[i]), At(keys[i]).nbytes);
    }
    return keys;
  }

  // Records the reads started into `tensors`; `callback` runs after the last one's.
  void Reading(const std::vector<uint64_t>& keys, const py::list& tensors,
               const py::object& callback) {
    std::vector<py::object> dropped;
    for (size_t i = 0; i < keys.size(); ++i) {
      Entry& e = At(keys[i]);
      e.state = State::kReading;
      dropped.push_back(std::exchange(e.tensor, py::reinterpret_borrow<py::object>(tensors[i])));
      dropped.push_back(std::exchange(e.storage, tensors[i].attr("untyped_storage")()));
      dropped.push_back(std::exchange(e.callback, i + 1 == keys.size() ? callback : py::none()));
    }
  }

  // Starts writing `tensors` to `keys` and records the writes in one call: host
  // `pieces` (key, address, length) on the engine, the tensors given a span on `device` (an
  // OffloadDevice). Ctrl-C, raised only between Python instructions, cannot come between the
  // start and the record and leave a write running on memory nothing keeps alive.
  void StartWrites(const std::vector<OffloadPieceTuple>& pieces, const py::object& device,
                   const py::list& spans, const std::vector<uint64_t>& keys,
                   const py::list& tensors, const py::object& callback,
                   const std::vector<uint64_t>& superseded) {
    Start(OffloadKind::kWrite, pieces, device, spans, keys);
    Add(keys, tensors, callback, superseded);
  }

  // Starts reading `keys` into `tensors` and records the reads in one call, as
  // StartWrites() does: the tensors' memory cannot be freed under a read that runs on, nor a
  // read be recorded that never started.
  void StartReads(const std::vector<OffloadPieceTuple>& pieces, const py::object& device,
                  const py::list& spans, const std::vector<uint64_t>& keys, const py::list& tensors,
                  const py::object& callback) {
    Start(OffloadKind::kRead, pieces, device, spans, keys);
    Reading(keys, tensors, callback);
  }

  // The entry stops watching its storage (about to be replaced: its death is not the entry's).
  void UnwatchStorage(uint64_t key) { const py::object old = std::move(At(key).watch[kStorage]); }
  // The entry watches `storage` as its own (the old one again, or a new one).
  void WatchStorage(uint64_t key, const py::object& storage) {
    Entry& e = At(key);
    Unmap(key, e, kStorage);
    e.id[kStorage] = Id(storage);
    by_id_[kStorage][e.id[kStorage]] = key;
    Watch(key, kStorage, storage);
  }

  // Waits for the operations of `kind` (those moving `keys`) on `device` (an OffloadDevice) and
  // applies the outcomes: returns (errors, callbacks due). With `cancel` (close()) a write done
  // leaves its tensor as it is.
  py::tuple Collect(const py::object& device, const std::string& kind,
                    std::optional<std::vector<uint64_t>> keys, bool cancel) {
    Drain();
    if (keys) {
      std::sort(keys->begin(), keys->end());
      keys->erase(std::unique(keys->begin(), keys->end()), keys->end());
    }
    // Everything is waited for before any outcome is taken: an interrupt (Ctrl-C) while waiting
    // leaves them all to the next wait.
    const py::list outcomes = device.attr("wait")(kind, keys);
    py::list errors, callbacks;
    {
      std::vector<py::object> freed;
      Apply(kind == "read", outcomes, cancel, errors, callbacks, freed);
      for (const py::object& storage : freed) {
        // Only if its size differs: a zero-size tensor's storage may not be resizable.
        if (storage.attr("nbytes")().cast<uint64_t>() != 0) storage.attr("resize_")(0);
      }
    }
    // Tensors whose last reference this wait held died here: their deaths were queued.
    Drain();
    return py::make_tuple(errors, callbacks);
  }

  // Runs the callbacks of a wait for `kind` (`errors` and `callbacks`: collect()'s); returns the
  // error to raise: the first I/O error (with `all`, those held for `kind` first), the others
  // and the callbacks' errors as its notes, else the first callback's, else None. An interrupt
  // (Ctrl-C) from a callback is returned after the others ran, the I/O errors held.
  py::object Deliver(const std::string& kind, const py::list& errors, const py::list& callbacks,
                     bool all) {
    Held& held = held_[KindIndex(kind)];
    std::vector<py::object> failed, callback_errors;
    if (all) {
      failed = std::exchange(held.errors, {});
      callback_errors = std::exchange(held.callback_errors, {});
    }
    for (const py::handle e : errors) failed.push_back(py::reinterpret_borrow<py::object>(e));
    const py::object interrupt = RunCallbacks(callbacks, callback_errors);
    if (interrupt) {
      held.errors.insert(held.errors.begin(), failed.begin(), failed.end());
      return interrupt;
    }
    if (failed.empty()) return callback_errors.empty() ? py::none() : callback_errors[0];
    const py::object add_note = py::module_::import("tensortier._notes").attr("add_note");
    if (failed.size() > 1) {
      add_note(failed[0], StrCat(failed.size() - 1, " other offload ", kind, "(s) also failed"));
    }
    for (const py::object& e : callback_errors) {
      add_note(failed[0], StrCat("and a callback raised ", ReprOf(e)));
    }
    return failed[0];
  }

  // A wait for a call of the other kind: the errors are held for the next wait of `kind` (other
  // tensors' failures are not this call's), then the callbacks run; returns an interrupt
  // (Ctrl-C) one of them raised, else None.
  py::object Hold(const std::string& kind, const py::list& errors, const py::list& callbacks) {
    Held& held = held_[KindIndex(kind)];
    for (const py::handle e : errors) {  // held before any callback runs: an interrupt loses none
      held.errors.push_back(py::reinterpret_borrow<py::object>(e));
    }
    std::vector<py::object> raised;
    const py::object interrupt = RunCallbacks(callbacks, raised);
    for (py::object& e : raised) {
      if (!e.is(interrupt)) held.callback_errors.push_back(std::move(e));
    }
    return interrupt ? interrupt : py::none();
  }

  size_t HeldErrors(const std::string& kind) const { return held_[KindIndex(kind)].errors.size(); }

  // close(): waits for the operations of both kinds on `device` (a write done leaves its tensor as
  // it is; callbacks do not run); returns the warning to give, or None.
  py::object Closing(const py::object& device) {
    size_t failed = 0;
    for (const char* kind : {"write", "read"}) {
      failed += py::len(Collect(device, kind, std::nullopt, true)[0]) + HeldErrors(kind);
    }
    const size_t lost = Count("stored");
    const std::string failures =
        failed > 0 ? StrCat(failed, " operation(s) not waited for had failed") : "";
    if (lost > 0) {
      return py::str(StrCat("DiskOffloader closed with ", lost,
                            " tensor(s) still offloaded; their data is gone",
                            failed > 0 ? StrCat(" (", failures, ")") : ""));
    }
    if (failed == 0) return py::none();
    return py::str(StrCat("DiskOffloader closed: ", failures));
  }

  // Applies a wait's outcomes; `freed`: the storages whose memory to free.
  void Apply(bool read, const py::list& outcomes, bool cancel, py::list& errors,
             py::list& callbacks, std::vector<py::object>& freed) {
    std::vector<py::object> dropped;
    std::vector<Entry> dead;
    for (const py::handle item : outcomes) {
      const auto key = item[py::int_(0)].cast<uint64_t>();
      const py::object error = item[py::int_(1)];
      if (!error.is_none()) errors.append(error);  // never dropped, whatever became of the entry
      const auto it = entries_.find(key);
      if (it == entries_.end()) continue;
      Entry& e = it->second;
      py::object storage = std::move(e.storage);
      py::object callback = std::move(e.callback);
      dropped.push_back(std::move(e.tensor));
      dropped.push_back(storage);
      if (e.superseded) {
        // The later write holds the tensor (and frees its memory once done: it is waited for
        // with this one); this copy is not the one to read back.
        Remove(key, dead);
        if (error.is_none()) offloader_.Discard(key);
      } else if (!error.is_none() && read) {  // still on disk: offloaded again
        freed.push_back(storage);
        e.state = State::kStored;
        continue;
      } else if (!error.is_none() || cancel) {
        // A failed write stored nothing; closing removes the files, so the memory keeps the
        // only copy of the data. The tensor is as it was.
        Remove(key, dead);
        continue;
      } else if (!read) {
        freed.push_back(storage);  // the memory written, whatever the tensor holds now
        e.state = State::kStored;
      } else {
        Remove(key, dead);
      }
      if (callback && !callback.is_none() && !cancel) callbacks.append(callback);
    }
  }

  // Queues the death of `key`'s part, watched by `ref` (a weak reference's callback).
  void Died(uint64_t key, Part part, const py::handle& ref) {
    forgotten_.push_back({key, part, py::reinterpret_borrow<py::object>(ref)});
    if (hook_.is_none()) return;  // collected as garbage: nothing will drain the deaths
    const py::object hook = hook_();
    if (!hook.is_none()) hook();
  }

  // Applies the deaths queued: a key whose tensor and storage both died is discarded.
  void Drain() {
    std::vector<Entry> dead;
    while (!forgotten_.empty()) {
      const Death d = std::move(forgotten_.front());
      forgotten_.pop_front();
      const auto it = entries_.find(d.key);
      // Gone, or the death of a part the entry no longer watches (a storage replaced).
      if (it == entries_.end() || !it->second.watch[d.part].is(d.ref)) continue;
      Entry& e = it->second;
      const py::object gone = std::move(e.watch[d.part]);
      Unmap(d.key, e, d.part);
      if (e.watch[1 - d.part]) continue;  // the other can still read it back
      Remove(d.key, dead);
      if (!closed_ && !maker_.Forked()) offloader_.Discard(d.key);  // a fork's copy: not ours
    }
  }

  size_t Count(const std::string& state) const {
    const auto wanted = ValueOf(kStateNames, state);
    size_t n = 0;
    for (const auto& [key, e] : entries_) n += e.state == wanted;
    return n;
  }

  // Forgets every entry (the offloader closed); nothing is discarded afterwards.
  void Clear() {
    closed_ = true;
    std::unordered_map<uint64_t, Entry> gone;
    gone.swap(entries_);
    for (auto& ids : by_id_) ids.clear();
    std::deque<Death> deaths;
    deaths.swap(forgotten_);
    Held held[2];
    std::swap(held, held_);
  }

  size_t size() const { return entries_.size(); }
  size_t forgotten() const { return forgotten_.size(); }

  // The Python objects held, for the cycle collector: an object that owns its offloader and
  // hands it a bound method as a callback makes a cycle through these.
  int Traverse(visitproc visit, void* arg) const {
    for (const auto& [key, e] : entries_) {
      Py_VISIT(e.tensor.ptr());
      Py_VISIT(e.storage.ptr());
      Py_VISIT(e.callback.ptr());
      Py_VISIT(e.watch[0].ptr());
      Py_VISIT(e.watch[1].ptr());
    }
    for (const Death& d : forgotten_) Py_VISIT(d.ref.ptr());
    for (const Held& h : held_) {
      for (const py::object& e : h.errors) Py_VISIT(e.ptr());
      for (const py::object& e : h.callback_errors) Py_VISIT(e.ptr());
    }
    Py_VISIT(hook_.ptr());
    return 0;
  }

  // Breaks the cycles of unreachable garbage. The tensors and storages stay until the entries
  // go: the offloader's finaliser (run before this) has waited for what they are used by.
  void ClearReferences() {
    std::vector<py::object> dropped;
    for (auto& [key, e] : entries_) {
      dropped.push_back(std::move(e.callback));
      dropped.push_back(std::move(e.watch[0]));
      dropped.push_back(std::move(e.watch[1]));
    }
    std::deque<Death> deaths;
    deaths.swap(forgotten_);
    Held held[2];
    std::swap(held, held_);
    dropped.push_back(std::move(hook_));
    hook_ = py::none();
  }

 private:
  struct Entry {
    uint64_t key = 0;
    uint64_t nbytes = 0;
    State state = State::kWriting;
    bool superseded = false;  // written again before this write was waited for
    uintptr_t id[2] = {0, 0};
    // Strong while an operation is in flight: the tensor, and the storage whose memory the
    // operation uses (`x.data = ...` meanwhile must not free it under the engine).
    py::object tensor, storage, callback;
    // Weak references to the tensor and the storage, while they can die (destroyed first: a
    // death the entry's own end causes is not queued).
    py::object watch[2];
  };
  struct Held {  // errors of operations waited for by a call of the other kind, for the next wait
    std::vector<py::object> errors, callback_errors;
  };
  struct Death {
    uint64_t key;
    Part part;
    py::object ref;
  };

  const Entry* Mapped(Part part, const py::handle& obj) const {
    const auto id = by_id_[part].find(Id(obj));
    if (id == by_id_[part].end()) return nullptr;
    const auto it = entries_.find(id->second);
    return it == entries_.end() ? nullptr : &it->second;
  }
  static size_t KindIndex(const std::string& kind) {
    return ParseOffloadKind(kind) == OffloadKind::kRead;
  }

  // Starts the host pieces on the engine, then the device ones (a span each; None: on the host).
  // A failure leaves nothing running. A refused write stores nothing (what it wrote is dropped).
  // A refused read leaves offloaded the tensors not read back whole; the pieces that were read
  // whole are read back (the offloader has freed their copy on disk), their entries gone: the
  // caller frees the memory of the tensors still offloaded only.
  void Start(OffloadKind kind, const std::vector<OffloadPieceTuple>& pieces,
             const py::object& device, const py::list& spans, const std::vector<uint64_t>& keys) {
    if (!pieces.empty()) {
      const std::vector<OffloadPiece> host = ToPieces(pieces);
      GilReleased release;
      kind == OffloadKind::kWrite ? offloader_.AsyncWritev(host) : offloader_.AsyncReadv(host);
    }
    const std::string name(NameOf(kOffloadKindNames, kind));
    try {
      device.attr("submit")(name, keys, spans);
    } catch (...) {
      // The pieces started, host and device, waited for without Ctrl-C: an interrupt here would
      // lose the error and leave them running unrecorded.
      const py::list outcomes = device.attr("wait")(name, keys, false);
      if (kind == OffloadKind::kWrite) {
        for (const uint64_t key : keys) offloader_.Discard(key);
      } else {
        std::vector<Entry> dead;
        for (const py::handle item : outcomes) {
          if (item[py::int_(1)].is_none()) Remove(item[py::int_(0)].cast<uint64_t>(), dead);
        }
      }
      throw;
    }
  }

  // Runs every callback; adds what they raised to `raised`; returns the first interrupt (not an
  // Exception: Ctrl-C), or null.
  static py::object RunCallbacks(const py::list& callbacks, std::vector<py::object>& raised) {
    py::object interrupt;
    for (const py::handle callback : callbacks) {
      try {
        callback();
      } catch (py::error_already_set& e) {
        raised.push_back(e.value());
        if (!interrupt && PyObject_IsInstance(e.value().ptr(), PyExc_Exception) == 0) {
          interrupt = e.value();
        }
      }
    }
    return interrupt;
  }

  Entry& At(uint64_t key) { return entries_.at(key); }
  const Entry& At(uint64_t key) const { return entries_.at(key); }

  static bool Watches(const Entry& e, Part part, const py::handle& obj) {
    return e.watch[part] && py::reinterpret_borrow<py::weakref>(e.watch[part])().is(obj);
  }

  // TypeError or ValueError unless `tensors` are distinct contiguous CPU or CUDA tensors.
  static void CheckTensors(const py::list& tensors, const char* what) {
    const py::object tensor_type = py::module_::import("torch").attr("Tensor");
    for (const py::handle t : tensors) {
      if (!py::isinstance(t, tensor_type)) {
        throw py::type_error(
            StrCat("DiskOffloader can ", what, " torch tensors only, not ", TypeName(t)));
      }
      const py::object device = t.attr("device");
      const auto type = device.attr("type").cast<std::string>();
      if (type != "cpu" && type != "cuda") {
        throw py::value_error(StrCat("tensor is on ", py::str(device).cast<std::string>(),
                                     "; DiskOffloader offloads CPU and CUDA tensors only"));
      }
      if (t.attr("is_nested").cast<bool>()) {
        throw py::value_error("nested tensors cannot be offloaded: offload their components");
      }
      if (const std::string layout = py::str(t.attr("layout")); layout != "torch.strided") {
        throw py::value_error(StrCat("tensors of layout ", layout,
                                     " cannot be offloaded: offload .to_dense(), or the tensors "
                                     "it is made of"));
      }
      if (!t.attr("is_contiguous")().cast<bool>()) {
        throw py::value_error(StrCat("tensor of shape ", ReprOf(py::tuple(t.attr("shape"))),
                                     " is not contiguous: only contiguous tensors can be "
                                     "offloaded (call .contiguous() first)"));
      }
    }
    py::set storages;
    for (const py::handle t : tensors) storages.add(py::int_(Id(t.attr("untyped_storage")())));
    if (py::len(storages) != py::len(tensors)) {
      throw py::value_error(
          "the same tensor (or two tensors of one storage, such as a parameter and its .data) "
          "is given twice");
    }
  }

  void Watch(uint64_t key, Part part, const py::handle& obj) {
    Entry& e = At(key);
    e.id[part] = Id(obj);
    by_id_[part][e.id[part]] = key;
    const py::object old = std::move(e.watch[part]);
    e.watch[part] = py::weakref(
        obj, py::cpp_function([this, key, part](py::handle ref) { Died(key, part, ref); }));
  }

  void Unmap(uint64_t key, const Entry& e, int part) {
    const auto it = by_id_[part].find(e.id[part]);
    if (it != by_id_[part].end() && it->second == key) by_id_[part].erase(it);
  }

  // Moves the entry into `dead`, whose Python objects die after the caller's changes.
  void Remove(uint64_t key, std::vector<Entry>& dead) {
    const auto it = entries_.find(key);
    if (it == entries_.end()) return;
    Unmap(key, it->second, kTensor);
    Unmap(key, it->second, kStorage);
    dead.push_back(std::move(it->second));
    entries_.erase(it);
  }

  Offloader& offloader_;
  py::object hook_;  // a weakref.WeakMethod of the offloader's drain-if-free
  const MakerProcess maker_;
  std::unordered_map<uint64_t, Entry> entries_;
  std::unordered_map<uintptr_t, uint64_t> by_id_[2];  // id() of a tensor, of a storage -> key
  std::deque<Death> forgotten_;
  Held held_[2];  // writes, reads
  uint64_t next_key_ = 1;
  bool closed_ = false;
};

// The tensors of TensorNVMe's call `what` ("sync_writev"...), checked as its binding checks them
// before anything moves, with its errors.
py::list TensorNvmeTensors(const std::string& what, const py::object& given) {
  const bool vector = what.ends_with('v');
  const py::object tensor_type = py::module_::import("torch").attr("Tensor");
  py::list tensors;
  if (!vector) {
    if (!py::isinstance(given, tensor_type)) {
      throw py::type_error(StrCat(what, "() takes a torch.Tensor, not ", TypeName(given)));
    }
    tensors.append(given);
  } else if (py::isinstance(given, tensor_type)) {
    // TensorNVMe iterates what it is given: torch refuses to make the rows of an offloaded
    // tensor (RuntimeError); the rows of one with memory reach its binding, which wants a list
    // (TypeError). Iterating changes nothing.
    const py::list rows(given);
    throw py::type_error(StrCat(what,
                                "(): incompatible function arguments: a list of tensors is "
                                "expected, not a tensor (wrap it: [tensor])"));
  } else {
    tensors = py::list(given);
    for (const py::handle t : tensors) {
      if (!py::isinstance(t, tensor_type)) {
        throw py::type_error(StrCat(what, "() takes a list of torch.Tensor, not of ", TypeName(t)));
      }
    }
  }
  for (const py::handle t : tensors) {
    if (!t.attr("is_contiguous")().cast<bool>()) {
      throw std::runtime_error("Tensor must be contiguous");
    }
    // TensorNVMe's writes: `assert tensor.storage().size() > 0`.
    if (what.find("write") != std::string::npos &&
        t.attr("untyped_storage")().attr("nbytes")().cast<uint64_t>() == 0) {
      PyErr_SetString(PyExc_AssertionError,
                      StrCat(what,
                             ": tensor has no memory to write (it is offloaded already, or has "
                             "no elements)")
                          .c_str());
      throw py::error_already_set();
    }
  }
  return tensors;
}

// The tensors whose storages a TensorNVMe call moves. TensorNVMe moves each tensor's whole
// storage: a tensor that covers all of an earlier one's storage (a view of all of it, the same
// tensor again) adds nothing to move. Other tensors of one storage stay, for the offloader to
// refuse (TensorNVMe would move bytes past the storage's end).
py::list TensorNvmeMoved(const py::list& tensors) {
  const auto offset = [](const py::handle& t) {
    return t.attr("storage_offset")().cast<int64_t>();
  };
  const auto nbytes = [](const py::handle& t) { return t.attr("nbytes").cast<uint64_t>(); };
  std::map<uintptr_t, std::pair<py::object, py::handle>> first;  // id(storage) -> it, its first
  py::list moved;
  for (const py::handle t : tensors) {
    py::object storage = t.attr("untyped_storage")();
    const uintptr_t id = Id(storage);
    const auto seen = first.find(id);
    if (seen == first.end()) {
      first.emplace(id, std::make_pair(std::move(storage), t));
    } else if (offset(t) == 0 && offset(seen->second.second) == 0 &&
               nbytes(t) == nbytes(seen->second.second)) {
      continue;
    }
    moved.append(t);
  }
  return moved;
}

}  // namespace

void RegisterOffloadEntries(py::module_& m) {
  m.def("check_callback", &CheckCallback, py::arg("callback"),
        "TypeError unless `callback` is callable or None.");
  m.def("tensornvme_tensors", &TensorNvmeTensors, py::arg("what"), py::arg("given"),
        "The tensors of TensorNVMe's call `what` ('sync_writev'...), checked as its binding "
        "checks them (TypeError, RuntimeError, AssertionError).");
  m.def("tensornvme_moved", &TensorNvmeMoved, py::arg("tensors"),
        "The tensors whose storages a TensorNVMe call moves: a tensor covering all of an "
        "earlier one's storage adds nothing.");
  py::class_<OffloadEntries>(m, "OffloadEntries", CycleCollected<OffloadEntries>())
      .def(py::init<Offloader&, py::object>(), py::arg("offloader"), py::arg("hook"),
           py::keep_alive<1, 2>(),
           "DiskOffloader's entries; `hook` (a weakref.WeakMethod) is called after each death "
           "queued.")
      .def("find", &OffloadEntries::Find, py::arg("tensor"),
           "The key `tensor` stands for (the tensor written, or a tensor covering its whole "
           "storage), or None.")
      .def("is_offloaded", &OffloadEntries::IsOffloaded, py::arg("tensor"),
           "Whether `tensor` is a strided tensor whose data is parked (not being written).")
      .def("readable", &OffloadEntries::Readable, py::arg("tensors"),
           "Whether each tensor is offloaded here and not being read (TensorNVMe's read check).")
      .def("holds", &OffloadEntries::Holds, py::arg("key"), py::arg("tensor"),
           "Whether `tensor` is the tensor the key was written from.")
      .def("check_write", &OffloadEntries::CheckWrite, py::arg("tensors"), py::arg("supersede"),
           "The keys a write supersedes; None while one tensor is being read; TypeError or "
           "ValueError when one is not a contiguous CPU or CUDA tensor owning all of its "
           "storage, is given twice or is offloaded.")
      .def("new_keys", &OffloadEntries::NewKeys, py::arg("n"))
      .def("read_keys", &OffloadEntries::ReadKeys, py::arg("tensors"), py::arg("settled"),
           "The keys to read the tensors back from; None while one is being written and not "
           "`settled`; TypeError or ValueError when one cannot be read (back into a storage of "
           "its own of its size).")
      .def("start_writes", &OffloadEntries::StartWrites, py::arg("pieces"), py::arg("device"),
           py::arg("spans"), py::arg("keys"), py::arg("tensors"), py::arg("callback"),
           py::arg("superseded"),
           "Starts the writes (host pieces on the engine, spans on the OffloadDevice) and "
           "records them in one call (the callback after the last one).")
      .def("start_reads", &OffloadEntries::StartReads, py::arg("pieces"), py::arg("device"),
           py::arg("spans"), py::arg("keys"), py::arg("tensors"), py::arg("callback"),
           "Starts the reads (host pieces on the engine, spans on the OffloadDevice) and "
           "records them in one call (the callback after the last one).")
      .def("unwatch_storage", &OffloadEntries::UnwatchStorage, py::arg("key"))
      .def("watch_storage", &OffloadEntries::WatchStorage, py::arg("key"), py::arg("storage"))
      .def("collect", &OffloadEntries::Collect, py::arg("device"), py::arg("kind"),
           py::arg("keys") = py::none(), py::arg("cancel") = false,
           "Waits for the operations of `kind` (those moving `keys`) on the OffloadDevice and "
           "applies the outcomes: (errors, callbacks due).")
      .def("deliver", &OffloadEntries::Deliver, py::arg("kind"), py::arg("errors"),
           py::arg("callbacks"), py::arg("all"),
           "Runs a wait's callbacks; returns the error it raises (the first I/O error, with "
           "`all` those held first, the others as notes), or None.")
      .def("hold", &OffloadEntries::Hold, py::arg("kind"), py::arg("errors"), py::arg("callbacks"),
           "Holds a wait's errors for the next wait of `kind`, runs its callbacks; returns an "
           "interrupt one raised, or None.")
      .def("closing", &OffloadEntries::Closing, py::arg("device"),
           "Waits for every operation on the OffloadDevice, cancelling writes (no callback runs); "
           "returns the warning of data lost or failures, or None.")
      .def("drain", &OffloadEntries::Drain, "Applies the deaths queued.")
      .def("clear", &OffloadEntries::Clear)
      .def("__len__", &OffloadEntries::size)
      .def_property_readonly("forgotten", &OffloadEntries::forgotten,
                             "Deaths queued, not yet drained.");
}
