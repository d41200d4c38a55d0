// What DiskOffloader checks of the tensors it takes: a write frees a tensor's memory by resizing
// its storage, a read fills and resizes it again.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace tensortier {

// The facts of a tensor that DiskOffloader checks.
struct OffloadTensorFacts {
  pybind11::object shape;  // a tuple of ints
  uint64_t nbytes;
  uint64_t storage_nbytes;
  uint64_t storage_offset;
  bool resizable;
  bool shared;  // host memory shared between processes: torch says resizable, and crashes
};

OffloadTensorFacts FactsOf(const pybind11::handle& tensor);

// ValueError unless a write may free the tensor's memory: the tensor must own all of its storage.
void CheckOffloadWrite(const OffloadTensorFacts& t, uintptr_t data_ptr);

// ValueError unless a read of `nbytes` may fill the tensor: it must still cover a storage of its
// own of 0 (offloaded) or `nbytes` bytes.
void CheckOffloadReadTarget(const OffloadTensorFacts& t, uint64_t nbytes);

}  // namespace tensortier
