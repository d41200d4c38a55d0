// Every TENSORTIER_* environment variable, declared once: its type, default, allowed values and
// meaning. The library reads each through this table (a bad value is an error naming the variable
// and what it allows, never ignored); `tensortier check`, `tensortier --help`,
// `tensortier.defaults()` and the README's settings table are all printed from it.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace tensortier {

enum class SettingKind {
  kChoice,  // one word of `choices`; "0/1", "true/false", "yes/no" also spell "off"/"on"
  kSize,    // bytes: "4096", "64K", "1M", "2G"; in [min, max] and a multiple of `multiple`
  kCount,   // a whole number in [min, max]
  kText,    // any text (a library name or path)
};

struct Setting {
  std::string_view env;   // the environment variable
  std::string_view name;  // the option it sets, as the API spells it
  SettingKind kind;
  std::string_view default_text;              // the default, as a user writes it
  uint64_t default_number = 0;                // kSize, kCount: the default
  uint64_t min = 0;                           // kSize, kCount: the smallest value allowed
  uint64_t max = 0;                           // kSize, kCount: the largest value allowed
  uint64_t multiple = 1;                      // kSize: values are a multiple of this
  std::span<const std::string_view> choices;  // kChoice: the words allowed
  std::string_view description;               // one line
};

// The words of the kChoice rows. An enum set by a row takes its names from these words
// (NamesFromWords, enum_names.hpp).
inline constexpr std::string_view kBackendWords[] = {"auto", "io_uring", "libaio", "threads"};
inline constexpr std::string_view kOffOnDigits[] = {"0", "1"};
inline constexpr std::string_view kStageReadsWords[] = {"off", "auto", "on"};
inline constexpr std::string_view kHugePagesWords[] = {"auto", "0", "1"};
inline constexpr std::string_view kGdsWords[] = {"off", "auto", "on", "require"};

// clang-format off
inline constexpr Setting kSettings[] = {
    // The I/O engine (EngineOptions).
    {"TENSORTIER_BACKEND", "backend", SettingKind::kChoice, "auto", 0, 0, 0, 1,
     kBackendWords,
     "I/O backend; auto takes the first that works on the directory: io_uring, libaio, threads"},
    {"TENSORTIER_CHUNK_SIZE", "chunk_size", SettingKind::kSize, "4M", 4ull << 20, 4096,
     1ull << 30, 4096, {},
     "large transfers are split into page-aligned chunks of this size"},
    {"TENSORTIER_QUEUE_DEPTH", "queue_depth", SettingKind::kCount, "32", 32, 1, 4096, 1, {},
     "requests in flight per worker ring"},
    {"TENSORTIER_WORKERS", "workers", SettingKind::kCount, "2", 2, 1, 256, 1, {},
     "worker threads, each with its own ring"},
    {"TENSORTIER_MAX_INFLIGHT", "max_inflight_bytes", SettingKind::kSize, "128M", 128ull << 20,
     4096, 1ull << 40, 1, {},
     "bound on bytes in flight over all workers (at least the chunk size)"},
    {"TENSORTIER_PAGE_CACHE_CHECK", "page_cache_check", SettingKind::kChoice, "1", 0, 0, 0, 1,
     kOffOnDigits,
     "read page-cache-resident ranges buffered instead of O_DIRECT"},
    {"TENSORTIER_STAGE_READS", "stage_reads", SettingKind::kChoice, "auto", 0, 0, 0, 1,
     kStageReadsWords,
     "reads into new tensors (tensortier.load to CPU, pread_batch_async(stage_reads=True)) go "
     "through the engine's huge-page buffers and are copied out by its copy threads; auto: where "
     "the disk cuts requests into scattered small pages (virtio; `tensortier check DIR` says "
     "which disks), and without copy threads only into memory already faulted in"},
    {"TENSORTIER_MAX_STAGED", "max_staged_bytes", SettingKind::kSize, "32M", 32ull << 20, 4096,
     1ull << 40, 1, {},
     "bound on bytes of bounce buffers in use over all workers (at least one chunk per worker): "
     "staged reads in flight or being copied out, and reads and writes of memory O_DIRECT cannot "
     "use (a save of tensors that are not block-aligned in memory)"},
    {"TENSORTIER_COPY_THREADS", "copy_threads", SettingKind::kCount, "2", 2, 0, 256, 1, {},
     "threads that copy staged reads out of the engine's bounce buffers, so that the workers "
     "keep the disk busy meanwhile; 0: the workers copy"},
    {"TENSORTIER_BOUNCE_IDLE_MS", "bounce_idle_ms", SettingKind::kCount, "1000", 1000, 0,
     3'600'000, 1, {},
     "milliseconds a worker keeps a bounce buffer nothing uses before freeing it (two per worker "
     "stay); 0 frees them when the worker is idle; DiskOffloader frees them at once unless set"},
    // Memory (AlignedBuffer).
    {"TENSORTIER_HUGE_PAGES", "huge_pages", SettingKind::kChoice, "auto", 0, 0, 0, 1,
     kHugePagesWords,
     "page-aligned buffers of 4 MiB+ ask for transparent huge pages (1) or not (0); auto: reused "
     "buffers do, buffers filled once do unless the VM reports free pages to its host"},
    // CUDA tensors (DeviceFile, DeviceTransfer, DiskOffloader).
    {"TENSORTIER_GDS", "gds", SettingKind::kChoice, "off", 0, 0, 0, 1, kGdsWords,
     "CUDA tensors of IOHandle and DiskOffloader: off (the pinned bounce ring), auto (GPUDirect "
     "Storage where cuFile opens the file outside compatibility mode, else the ring), on or "
     "require (cuFile, or an error)"},
    {"TENSORTIER_BOUNCE_SLOTS", "bounce_slots", SettingKind::kCount, "8", 8, 1, 4096, 1, {},
     "slots (chunks in flight) per pinned bounce ring of a CUDA transfer"},
    {"TENSORTIER_BOUNCE_SLOT_SIZE", "bounce_slot_size", SettingKind::kSize, "8M", 8ull << 20,
     4096, 1ull << 40, 4096, {},
     "bytes per bounce ring slot"},
    {"TENSORTIER_BOUNCE_RINGS", "bounce_rings", SettingKind::kCount, "4", 4, 1, 4096, 1, {},
     "bounce rings (concurrent CUDA transfers) per IOHandle; a DiskOffloader makes one per "
     "directory, at least 2, unless this is set"},
    {"TENSORTIER_CUDA_LIBRARY", "cuda_library", SettingKind::kText, "libcuda.so.1", 0, 0, 0, 1,
     {}, "the CUDA driver library loaded at run time"},
    {"TENSORTIER_CUFILE_LIBRARY", "cufile_library", SettingKind::kText, "libcufile.so.0", 0, 0,
     0, 1, {}, "the cuFile library loaded at run time (only where the CUDA driver sees a device)"},
};
// clang-format on

// The row of `env`. At compile time, an unknown name does not build; at run time it throws
// std::invalid_argument.
constexpr const Setting& SettingFor(std::string_view env) {
  for (const Setting& s : kSettings) {
    if (s.env == env) return s;
  }
  throw std::invalid_argument("unknown setting");
}

// The variable's value when it is set and not empty, unparsed.
std::optional<std::string> SettingFromEnvironment(const Setting& setting);

// A TENSORTIER_* variable of the environment that names no setting (a misspelling is otherwise
// silently without effect), and the setting it most likely meant ("" when none is close).
struct UnknownSettingVariable {
  std::string name;
  std::string_view meant;
};
std::vector<UnknownSettingVariable> UnknownSettingVariables();

// The row's own spelling of `text` for a kChoice row: one of its words in any ASCII case, or a
// boolean spelling ("true", "no") of its off/on word; "" when the row does not take it. The one
// rule for words, from the environment and from the API's arguments alike.
std::string_view ChoiceWord(const Setting& setting, std::string_view text);

// The value in effect (the environment's, else the default), parsed and checked against the row.
// Throws std::invalid_argument "TENSORTIER_X=value is invalid: ... (allowed: ...)".
uint64_t NumberSetting(const Setting& setting);   // kSize, kCount
std::string WordSetting(const Setting& setting);  // kChoice (the canonical word), kText
// Checks a value given through the API (not the environment) against the row: throws
// std::invalid_argument "name: value is out of range (allowed: ...)".
void CheckNumberSetting(const Setting& setting, uint64_t value);  // kSize, kCount

// What the row accepts, for messages and tables: "auto, io_uring, libaio, threads",
// "4K to 1G, a multiple of 4K", "1 to 4096", "a library name or path".
std::string AllowedValues(const Setting& setting);
// The value in effect, formatted for tables: "4 MiB", "32", "auto".
std::string EffectiveValue(const Setting& setting);

// Parses "4096", "64K", "1M", "2G", "1T" (powers of 1024, optional trailing "B"/"iB").
// Throws std::invalid_argument on anything else.
uint64_t ParseSize(std::string_view text);
// "1", "true", "on", "yes" / "0", "false", "off", "no". Throws std::invalid_argument naming `what`.
bool ParseBool(std::string_view text, const char* what);
// "4 MiB", "1.5 GiB": for messages and tables.
std::string FormatSize(uint64_t bytes);

}  // namespace tensortier
