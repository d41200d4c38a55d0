// Engine settings. Their defaults, variables and limits are rows of the settings table
// (settings.hpp); EngineOptions::FromEnvironment() reads the variables once per call, and bad
// values are rejected, never ignored. Defaults() lists every row of the table with the value in
// effect.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/settings.hpp"

namespace tensortier {

// Whether direct reads whose caller allows it (SubmitOptions::stage_reads: small-page
// destinations such as torch tensors) are staged through the engine's huge-page bounce buffers and
// copied out on its worker threads. kAuto: see StagesReads (engine.hpp).
enum class ReadStaging { kOff, kAuto, kOn };
// The words of TENSORTIER_STAGE_READS.
inline constexpr auto kReadStagingNames =
    NamesFromWords(SettingFor("TENSORTIER_STAGE_READS").choices,
                   {ReadStaging::kOff, ReadStaging::kAuto, ReadStaging::kOn});
// "off", "auto", "on" in any case (also the ParseBool words for off and on). Throws
// std::invalid_argument.
ReadStaging ParseReadStaging(std::string_view text);
// The backend's word for `text` in any case ("IO_URING": "io_uring"), as TENSORTIER_BACKEND
// takes it. Throws std::invalid_argument "backend: 'x' is not one of ...".
std::string BackendWord(std::string_view text);
std::string_view ReadStagingName(ReadStaging staging);

struct EngineOptions {
  // "auto", "io_uring", "libaio" or "threads". TENSORTIER_BACKEND.
  std::string backend{SettingFor("TENSORTIER_BACKEND").default_text};
  // Large transfers are split into chunks of this many bytes (a multiple of 4 KiB).
  // TENSORTIER_CHUNK_SIZE.
  uint64_t chunk_size = SettingFor("TENSORTIER_CHUNK_SIZE").default_number;
  // Requests in flight per worker ring. TENSORTIER_QUEUE_DEPTH.
  unsigned queue_depth = SettingFor("TENSORTIER_QUEUE_DEPTH").default_number;
  // Worker threads, each with its own ring. TENSORTIER_WORKERS.
  unsigned workers = SettingFor("TENSORTIER_WORKERS").default_number;
  // Bound on bytes in flight over all workers. TENSORTIER_MAX_INFLIGHT.
  uint64_t max_inflight_bytes = SettingFor("TENSORTIER_MAX_INFLIGHT").default_number;
  // Read page-cache-resident ranges through the page cache instead of O_DIRECT.
  // TENSORTIER_PAGE_CACHE_CHECK (0/1).
  bool page_cache_check = SettingFor("TENSORTIER_PAGE_CACHE_CHECK").default_text == "1";
  // TENSORTIER_STAGE_READS: off, auto, on.
  ReadStaging stage_reads =
      *ValueOf(kReadStagingNames, SettingFor("TENSORTIER_STAGE_READS").default_text);
  // Bound on bytes of bounce buffers in use over all workers: staged reads in flight or being
  // copied out, and unaligned reads and writes; memory on top of the destinations; at least one
  // chunk per worker. TENSORTIER_MAX_STAGED.
  uint64_t max_staged_bytes = SettingFor("TENSORTIER_MAX_STAGED").default_number;
  // Threads that copy staged reads out of the bounce buffers (the copy faults in each small page
  // of memory never touched: on a worker thread it held up reaping and submitting); 0: the
  // workers copy. TENSORTIER_COPY_THREADS.
  unsigned copy_threads = SettingFor("TENSORTIER_COPY_THREADS").default_number;
  // Milliseconds a worker keeps a bounce buffer nothing uses before it frees it (each worker
  // keeps two); 0 frees them as soon as the worker is idle. Keeping them spares the next burst
  // faulting in up to max_inflight_bytes of huge pages again (a sharded checkpoint's next shard,
  // a loop of reads). TENSORTIER_BOUNCE_IDLE_MS.
  uint32_t bounce_idle_ms = SettingFor("TENSORTIER_BOUNCE_IDLE_MS").default_number;

  // The built-in defaults, or `base`, overridden by the environment. Throws
  // std::invalid_argument on a malformed value.
  static EngineOptions FromEnvironment();
  static EngineOptions FromEnvironment(EngineOptions base);
  // Throws std::invalid_argument naming the bad field.
  void Validate() const;
};

// One row of the settings table with the value in effect.
struct DefaultSetting {
  std::string name;           // the option it sets, as the API spells it
  std::string env;            // environment variable
  std::string value;          // effective value after the environment
  std::string default_value;  // the built-in default
  std::string allowed;        // what the variable accepts
  std::string description;    // one line
  bool from_environment;      // the variable is set
};
// Every row of kSettings. Throws std::invalid_argument on a bad variable (the engine's are also
// checked together, as EngineOptions::FromEnvironment does).
std::vector<DefaultSetting> Defaults();

}  // namespace tensortier
