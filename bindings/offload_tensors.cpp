#include "offload_tensors.hpp"

#include <cstdint>
#include <string>

#include "arguments.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;

namespace tensortier {
namespace {

constexpr const char* kSharedMemory =
    "shared memory (share_memory_(), Module.share_memory(), torch.multiprocessing, a "
    "tensortier.shared tensor), which cannot be resized (torch's resize_ of it crashes the "
    "process)";

}  // namespace

OffloadTensorFacts FactsOf(const py::handle& tensor) {
  const py::object storage = tensor.attr("untyped_storage")();
  const bool host = storage.attr("device").attr("type").cast<std::string>() == "cpu";
  return {
      py::tuple(tensor.attr("shape")),           tensor.attr("nbytes").cast<uint64_t>(),
      storage.attr("nbytes")().cast<uint64_t>(), tensor.attr("storage_offset")().cast<uint64_t>(),
      storage.attr("resizable")().cast<bool>(),  host && storage.attr("is_shared")().cast<bool>()};
}

// A write frees the tensor's memory by resizing its storage: the tensor must own all of it.
void CheckOffloadWrite(const OffloadTensorFacts& t, uintptr_t data_ptr) {
  if (t.nbytes > 0 && t.storage_nbytes == 0) {
    throw py::value_error(
        "tensor has no memory (it is offloaded by another DiskOffloader, or its storage was "
        "freed)");
  }
  if (t.nbytes > 0 && data_ptr == 0) {
    throw py::value_error(
        "tensor has no memory of its own to write (a functional or wrapper tensor?)");
  }
  if (t.storage_offset != 0 || t.storage_nbytes != t.nbytes) {
    throw py::value_error(StrCat(
        "tensor of shape ", ReprOf(t.shape), " is a view into a storage of ", t.storage_nbytes,
        " bytes; offloading frees the whole storage, so only a tensor that owns its storage can "
        "be offloaded (use .clone())"));
  }
  if (t.nbytes > 0 && !t.resizable) {
    throw py::value_error(
        "tensor's storage cannot be resized (it wraps foreign memory, e.g. from numpy or "
        "torch.frombuffer); offloading frees memory by resizing it: use .clone()");
  }
  if (t.nbytes > 0 && t.shared) {
    throw py::value_error(StrCat("tensor's storage is in ", kSharedMemory,
                                 "; offloading frees memory by resizing it: use .clone()"));
  }
}

// A read fills `nbytes` at the start of the tensor's storage, resized to that: the tensor must
// still cover a storage of its own of 0 (offloaded) or `nbytes` bytes. Its memory may have been
// replaced while offloaded (`x.data = ...`, set_, resize_); into a part of a larger storage, the
// read would write past the tensor (other tensors' memory) or shrink that storage under the
// tensors using it.
void CheckOffloadReadTarget(const OffloadTensorFacts& t, uint64_t nbytes) {
  if (t.storage_offset != 0 || t.nbytes != nbytes ||
      (t.storage_nbytes != 0 && t.storage_nbytes != nbytes)) {
    throw py::value_error(StrCat(
        "tensor's memory was replaced while it was offloaded (now ", t.nbytes, " bytes at offset ",
        t.storage_offset, " of a storage of ", t.storage_nbytes, "): its ", nbytes,
        " bytes can be read back only into a storage of its own of that size; give it "
        "one (x.data = torch.empty_like(x)) and read again"));
  }
  if (nbytes > 0 && (!t.resizable || t.shared)) {
    throw py::value_error(StrCat(
        "tensor's memory was replaced while it was offloaded by memory that cannot be resized (",
        t.shared ? kSharedMemory : "numpy or foreign memory",
        "); give it a torch storage of its own (x.data = torch.empty_like(x)) and read again"));
  }
}

}  // namespace tensortier
