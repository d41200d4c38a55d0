// The buffer registries of the compatibility APIs, by address:
//   LockedTensors: DeepSpeed's pinned-tensor manager (one per process): the locked host tensors
//     made by its handles, each as its size and a weak reference to its storage.
//   CuFileRegistrations: device memory registered with cuFile (torch.cuda.gds's
//     gds_register_buffer, DeepNVMe's pin_device_tensor), each with what keeps the memory alive.
// Both are called with the GIL held; cuFile's calls run with it released, under the registry's
// own lock (never waited for with the GIL held by its holder).
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "register.hpp"
#include "tensortier/cuda/cufile.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

class LockedTensors {
 public:
  void Add(uintptr_t address, size_t nbytes, const py::object& storage) {
    tensors_.insert_or_assign(address, Locked{nbytes, py::weakref(storage)});
  }

  // The live storage of the tensor at `address`, taken out of the registry; None when there is
  // none. A zero-byte one only when `storage` is it: such tensors may share an address.
  py::object Take(uintptr_t address, const py::object& storage) {
    const auto it = tensors_.find(address);
    if (it == tensors_.end()) return py::none();
    py::object live = it->second.storage();
    if (live.is_none() || (it->second.nbytes == 0 && !live.is(storage))) return py::none();
    tensors_.erase(it);
    return live;
  }

  // Whether [address, address + nbytes) lies in one live tensor; forgets the dead ones.
  bool Covers(uintptr_t address, size_t nbytes) {
    bool covered = false;
    for (auto it = tensors_.begin(); it != tensors_.end();) {
      if (it->second.storage().is_none()) {
        it = tensors_.erase(it);
        continue;
      }
      const uintptr_t end = it->first + it->second.nbytes;
      covered = covered || (it->first <= address && address + nbytes <= end);
      ++it;
    }
    return covered;
  }

 private:
  struct Locked {
    size_t nbytes;
    py::weakref storage;
  };
  std::map<uintptr_t, Locked> tensors_;
};

class CuFileRegistrations {
 public:
  // Registers [address, address + nbytes) with cuFile unless it is already, or nothing would
  // DMA into registered memory (no bytes, cuFile unavailable or in its compatibility mode);
  // `keep` stays referenced while it is. Throws CuFileError when cuFile refuses the memory.
  void Add(uintptr_t address, size_t nbytes, const py::object& keep) {
    {
      py::gil_scoped_release release;
      std::lock_guard lock(mu_);
      if (buffers_.contains(address)) return;
      const CuFile& cufile = CuFile::Get();
      if (nbytes == 0 || !cufile.available() || !cufile.compat_mode_reason().empty()) return;
      auto buffer = std::make_unique<CuFileBuffer>(
          cufile, reinterpret_cast<const void*>(address), nbytes);
      buffers_.emplace(address, Registered{std::move(buffer), py::object()});
    }
    std::lock_guard lock(mu_);
    if (const auto it = buffers_.find(address); it != buffers_.end()) it->second.keep = keep;
  }

  // Deregisters the memory at `address` now (nothing when it is not registered).
  void Remove(uintptr_t address) {
    Registered gone;
    {
      std::lock_guard lock(mu_);
      const auto it = buffers_.find(address);
      if (it == buffers_.end()) return;
      gone = std::move(it->second);
      buffers_.erase(it);
    }
    py::gil_scoped_release release;
    gone.buffer.reset();
  }

  void Clear() {
    std::map<uintptr_t, Registered> gone;
    {
      std::lock_guard lock(mu_);
      gone.swap(buffers_);
    }
    py::gil_scoped_release release;
    for (auto& [address, registered] : gone) registered.buffer.reset();
  }

 private:
  struct Registered {
    std::unique_ptr<CuFileBuffer> buffer;
    py::object keep;
  };
  std::mutex mu_;
  std::map<uintptr_t, Registered> buffers_;  // guarded by mu_
};

}  // namespace

void RegisterRegistries(py::module_& m) {
  py::class_<LockedTensors>(m, "LockedTensors")
      .def(py::init<>())
      .def("add", &LockedTensors::Add, py::arg("address"), py::arg("nbytes"), py::arg("storage"),
           "Records a locked tensor: its address, size and storage (weakly).")
      .def("take", &LockedTensors::Take, py::arg("address"), py::arg("storage") = py::none(),
           "The live storage of the tensor at `address`, forgotten; None when there is none (a "
           "zero-byte one only when `storage` is it).")
      .def("covers", &LockedTensors::Covers, py::arg("address"), py::arg("nbytes"),
           "Whether all of the range lies in one live locked tensor.");
  py::class_<CuFileRegistrations>(m, "CuFileRegistrations")
      .def(py::init<>())
      .def("add", &CuFileRegistrations::Add, py::arg("address"), py::arg("nbytes"),
           py::arg("keep") = py::none(),
           "Registers device memory with cuFile through its device's primary context, unless it "
           "is already or nothing would DMA into it (no bytes, no cuFile, compatibility mode); "
           "CuFileError when cuFile refuses it.")
      .def("remove", &CuFileRegistrations::Remove, py::arg("address"),
           "Deregisters the memory at `address` now; nothing when it is not registered.")
      .def("clear", &CuFileRegistrations::Clear, "Deregisters everything now.");
}
