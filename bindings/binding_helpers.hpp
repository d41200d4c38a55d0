// Helpers that several binding files need; defined once, in module.cpp.
#pragma once

#include <pybind11/pybind11.h>

#include "tensortier/io/fault_injection.hpp"
#include "tensortier/io/engine.hpp"

namespace tensortier {

// The Python view of an operation's I/O statistics (`stats` of results and futures).
pybind11::dict IoStatsToDict(const IoStats& s);

// The test-only `_fault` dict as a plan: "kind" (error, short, delay), "errno", "nth", "count",
// "reads", "writes" (which engine requests are eligible), "steps" (names of the FileSteps whose
// system calls are: open, allocate, datasync, rename, sync_directory, release; a dict naming
// steps makes reads and writes ineligible unless it says otherwise), "short_bytes", "delay_us".
FaultPlan FaultPlanFromDict(const pybind11::dict& f);

// An engine backend that fails or shortens requests as the test-only `_fault` dict says.
BackendFactory FaultFactory(const EngineOptions& options, const pybind11::dict& f);

}  // namespace tensortier
