// Host bytes lent to Python as DLPack capsules (uint8, one dimension) that keep their owner alive.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>

#include "dlpack_abi.hpp"

namespace tensortier {

namespace dlpack_export {

struct Export {
  dlpack::ManagedTensor managed{};
  int64_t shape[1] = {0};
  std::shared_ptr<const void> owner;
};

inline void DeleteExport(dlpack::ManagedTensor* managed) {
  delete static_cast<Export*>(managed->manager_ctx);
}

// A capsule nobody consumed still owns its tensor; a consumer renames it when it takes it.
inline void DeleteUnconsumed(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, dlpack::kCapsuleName)) return;
  auto* managed =
      static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, dlpack::kCapsuleName));
  managed->deleter(managed);
}

}  // namespace dlpack_export

// `nbytes` at `data` as a "dltensor" capsule whose tensor holds `owner` until the last consumer
// lets go (DALI frees its inputs on its own threads: the deleter touches no Python). Throws
// py::error_already_set when the capsule cannot be made.
inline pybind11::object BytesAsDlpack(std::shared_ptr<const void> owner, void* data,
                                      uint64_t nbytes) {
  auto out = std::make_unique<dlpack_export::Export>();
  out->shape[0] = static_cast<int64_t>(nbytes);
  dlpack::Tensor& t = out->managed.dl_tensor;
  t.data = data;
  t.device = {dlpack::kCpu, 0};
  t.ndim = 1;
  t.dtype = {dlpack::kUInt, 8, 1};
  t.shape = out->shape;
  out->owner = std::move(owner);
  out->managed.manager_ctx = out.get();
  out->managed.deleter = dlpack_export::DeleteExport;
  PyObject* capsule =
      PyCapsule_New(&out->managed, dlpack::kCapsuleName, dlpack_export::DeleteUnconsumed);
  if (capsule == nullptr) throw pybind11::error_already_set();
  out.release();  // the capsule owns it now
  return pybind11::reinterpret_steal<pybind11::object>(capsule);
}

}  // namespace tensortier
