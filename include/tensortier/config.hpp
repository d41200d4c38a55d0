// Engine settings and their defaults. Every default can be overridden by a TENSORTIER_* environment
// variable, read once per EngineOptions::FromEnvironment() call; bad values are rejected, never
// ignored. The table returned by Defaults() is the single source for docs and `tensortier check`.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tensortier {

// Whether direct reads whose caller allows it (SubmitOptions::stage_reads: small-page
// destinations such as torch tensors) are staged through the engine's huge-page bounce buffers and
// copied out on its worker threads. kAuto: see StagesReads (engine.hpp).
enum class ReadStaging { kOff, kAuto, kOn };
// "off", "auto", "on" (also the ParseBool words for off and on). Throws std::invalid_argument.
ReadStaging ParseReadStaging(std::string_view text);
std::string_view ReadStagingName(ReadStaging staging);

struct EngineOptions {
  // "auto", "io_uring", "libaio" or "threads". TENSORTIER_BACKEND.
  std::string backend = "auto";
  // Large transfers are split into chunks of this many bytes (a multiple of 4 KiB).
  // TENSORTIER_CHUNK_SIZE.
  uint64_t chunk_size = 4u << 20;
  // Requests in flight per worker ring. TENSORTIER_QUEUE_DEPTH.
  unsigned queue_depth = 32;
  // Worker threads, each with its own ring. TENSORTIER_WORKERS.
  unsigned workers = 2;
  // Bound on bytes in flight over all workers. TENSORTIER_MAX_INFLIGHT.
  uint64_t max_inflight_bytes = 128u << 20;
  // Read page-cache-resident ranges through the page cache instead of O_DIRECT.
  // TENSORTIER_PAGE_CACHE_CHECK (0/1).
  bool page_cache_check = true;
  // TENSORTIER_STAGE_READS: off, auto, on.
  ReadStaging stage_reads = ReadStaging::kAuto;
  // Milliseconds a worker keeps a bounce buffer nothing uses before it frees it (each worker
  // keeps two); 0 frees them as soon as the worker is idle. Keeping them spares the next burst
  // faulting in up to max_inflight_bytes of huge pages again (a sharded checkpoint's next shard,
  // a loop of reads). TENSORTIER_BOUNCE_IDLE_MS.
  uint32_t bounce_idle_ms = 1000;

  // The built-in defaults, or `base`, overridden by the environment. Throws
  // std::invalid_argument on a malformed value.
  static EngineOptions FromEnvironment();
  static EngineOptions FromEnvironment(EngineOptions base);
  // Throws std::invalid_argument naming the bad field.
  void Validate() const;
};

// One row of the defaults table.
struct DefaultSetting {
  std::string name;         // field name, as accepted by the Python API
  std::string env;          // environment variable
  std::string value;        // effective value after the environment
  std::string description;  // one line
};
std::vector<DefaultSetting> Defaults();

// Parses "4096", "64K", "1M", "2G", "1T" (powers of 1024, optional trailing "B"/"iB").
// Throws std::invalid_argument on anything else.
uint64_t ParseSize(std::string_view text);
// "1", "true", "on", "yes" / "0", "false", "off", "no". Throws std::invalid_argument naming `what`.
bool ParseBool(std::string_view text, const char* what);
// "4 MiB", "1.5 GiB": for messages and tables.
std::string FormatSize(uint64_t bytes);

}  // namespace tensortier
