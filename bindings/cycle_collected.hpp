// Lets Python's cycle collector see the Python objects a bound C++ class holds: without it, an
// object referred to from such a C++ member (a callback, a tensor with attributes) that refers
// back to its owner makes garbage nothing frees. T gives Traverse(visit, arg), which visits what
// it holds, and ClearReferences(), which drops what breaks the cycles; Python subclasses reach
// both through CPython's subtype traverse and clear.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

namespace tensortier {

template <class T>
pybind11::custom_type_setup CycleCollected() {
  return pybind11::custom_type_setup([](PyHeapTypeObject* heap_type) {
    // Null before __init__ has made the object (the collector may visit it in between).
    static constexpr auto constructed = [](PyObject* self) -> T* {
      auto* instance = reinterpret_cast<pybind11::detail::instance*>(self);
      pybind11::detail::value_and_holder v = instance->get_value_and_holder();
      return v.holder_constructed() ? v.template holder<std::unique_ptr<T>>().get() : nullptr;
    };
    PyTypeObject* type = &heap_type->ht_type;
    type->tp_flags |= Py_TPFLAGS_HAVE_GC;
    type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) -> int {
      Py_VISIT(Py_TYPE(self));
      if (const T* object = constructed(self)) return object->Traverse(visit, arg);
      return 0;
    };
    type->tp_clear = [](PyObject* self) -> int {
      if (T* object = constructed(self)) object->ClearReferences();
      return 0;
    };
  });
}

}  // namespace tensortier
