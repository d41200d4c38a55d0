// Helpers that several binding files need; defined once, in module.cpp.
#pragma once

#include <pybind11/pybind11.h>

#include "tensortier/engine.hpp"

namespace tensortier {

// The Python view of an operation's I/O statistics (`stats` of results and futures).
pybind11::dict IoStatsToDict(const IoStats& s);

// An engine backend that fails or shortens requests as the test-only `_fault` dict says.
BackendFactory FaultFactory(const EngineOptions& options, const pybind11::dict& f);

}  // namespace tensortier
