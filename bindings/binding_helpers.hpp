// Helpers that several binding files need, each defined once: IoStatsToDict and OptionsDict in
// engine.cpp, the test hooks' objects in test_hooks.cpp.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "gil.hpp"

#include "tensortier/io/config.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file_system.hpp"

namespace tensortier {

// Waits with the GIL released until `wait_for(50 ms)` says the work is over; meanwhile, with
// `interruptible`, signal handlers run every 50 ms (Ctrl-C raises KeyboardInterrupt, the work
// going on, its memory kept by the caller). Requires the GIL.
template <typename WaitFor>
void WaitInterruptibly(const WaitFor& wait_for, bool interruptible) {
  for (;;) {
    bool done;
    {
      GilReleased release;
      done = interruptible ? wait_for(std::chrono::milliseconds(50))
                           : wait_for(std::chrono::hours(24 * 365));
    }
    if (done) return;
    if (interruptible && PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
  }
}

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
    if (backend) o.backend = BackendWord(*backend);
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

// The backends of an engine being made with `options`: empty (the engine chooses its own) unless
// a test installed hooks (src/io/test_hooks.hpp, through tensortier._testing) that wrap them;
// then those the options name ("auto": threads), wrapped.
BackendFactory TestBackends(const EngineOptions& options);

// A FileSystem with the step faults the installed test hooks give it (none without hooks).
FileSystem TestFileSystem();

}  // namespace tensortier
