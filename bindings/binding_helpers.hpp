// Helpers that several binding files need, each defined once: IoStatsToDict and OptionsDict in
// engine.cpp, the fault plans in faults.cpp.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>

#include "tensortier/config.hpp"
#include "tensortier/engine.hpp"
#include "tensortier/fault_injection.hpp"

namespace tensortier {

// The Python view of an operation's I/O statistics (`stats` of results and futures).
pybind11::dict IoStatsToDict(const IoStats& s);

// Engine settings given as keyword arguments (None: keep the base's value).
struct Overrides {
  std::optional<std::string> backend;
  std::optional<uint64_t> chunk_size;
  std::optional<unsigned> queue_depth;
  std::optional<unsigned> workers;
  std::optional<uint64_t> max_inflight_bytes;
  std::optional<bool> page_cache_check;
  std::optional<std::string> stage_reads;
  std::optional<uint32_t> bounce_idle_ms;

  // `o` with the values given here in place of its own.
  EngineOptions Apply(EngineOptions o = EngineOptions::FromEnvironment()) const {
    if (backend) o.backend = *backend;
    if (chunk_size) o.chunk_size = *chunk_size;
    if (queue_depth) o.queue_depth = *queue_depth;
    if (workers) o.workers = *workers;
    if (max_inflight_bytes) o.max_inflight_bytes = *max_inflight_bytes;
    if (page_cache_check) o.page_cache_check = *page_cache_check;
    if (stage_reads) o.stage_reads = ParseReadStaging(*stage_reads);
    if (bounce_idle_ms) o.bounce_idle_ms = *bounce_idle_ms;
    return o;
  }
};

// The Python view of engine settings (IOHandle.options).
pybind11::dict OptionsDict(const EngineOptions& o);

// The test-only `_fault` dict as a plan: "kind" (error, short, delay), "errno", "nth", "count",
// "reads", "writes" (which engine requests are eligible), "steps" (names of the FileSteps whose
// system calls are: open, allocate, datasync, rename, sync_directory, release; a dict naming
// steps makes reads and writes ineligible unless it says otherwise), "short_bytes", "delay_us".
FaultPlan FaultPlanFromDict(const pybind11::dict& f);

// An engine backend that fails or shortens requests as the test-only `_fault` dict says.
BackendFactory FaultFactory(const EngineOptions& options, const pybind11::dict& f);

}  // namespace tensortier
