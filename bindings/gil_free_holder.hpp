// A pybind11 holder whose deleter releases the GIL: objects whose destructors block (an engine
// waiting for its I/O and joining its threads, cuMemHostUnregister of gigabytes) must not stall
// every Python thread, and Python drops them at any point (the last reference, a collection).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "gil.hpp"

namespace tensortier {

template <typename T>
struct ReleaseGilDelete {
  void operator()(T* p) const noexcept {
    GilReleased release;
    delete p;
  }
};

// REQUIRES: only the holder owns the object (nothing else hands it to Python), so no other
// thread can reach it while it is being destroyed.
template <typename T>
using GilFreeHolder = std::unique_ptr<T, ReleaseGilDelete<T>>;

}  // namespace tensortier
