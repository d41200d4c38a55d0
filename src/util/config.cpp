#include "tensortier/config.hpp"

#include <charconv>
#include <cstdlib>
#include <stdexcept>
#include <utility>
#include "tensortier/strings.hpp"

namespace tensortier {
namespace {

constexpr uint64_t kMaxChunk = 1ull << 30;
constexpr unsigned kMaxDepth = 4096;
constexpr unsigned kMaxWorkers = 256;
constexpr uint32_t kMaxBounceIdleMs = 3'600'000;  // an hour: beyond that, "never" is meant

const char* GetEnv(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

uint64_t ParseUnsigned(std::string_view text, const char* what) {
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) {
    throw std::invalid_argument(StrCat(what, ": '", text, "' is not a non-negative integer"));
  }
  return value;
}

}  // namespace

bool ParseBool(std::string_view text, const char* what) {
  if (text == "1" || text == "true" || text == "on" || text == "yes") return true;
  if (text == "0" || text == "false" || text == "off" || text == "no") return false;
  throw std::invalid_argument(StrCat(what, ": '", text, "' is not a boolean (use 0 or 1)"));
}

uint64_t ParseSize(std::string_view text) {
  std::string_view digits = text;
  for (std::string_view suffix : {"iB", "B"}) {
    if (digits.size() > suffix.size() && digits.ends_with(suffix)) {
      digits.remove_suffix(suffix.size());
      break;
    }
  }
  uint64_t multiplier = 1;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'k':
      case 'K':
        multiplier = 1ull << 10;
        break;
      case 'm':
      case 'M':
        multiplier = 1ull << 20;
        break;
      case 'g':
      case 'G':
        multiplier = 1ull << 30;
        break;
      case 't':
      case 'T':
        multiplier = 1ull << 40;
        break;
      default:
        break;
    }
    if (multiplier != 1) digits.remove_suffix(1);
  }
  uint64_t value = ParseUnsigned(digits, "size");
  if (digits.empty() || (value != 0 && value > UINT64_MAX / multiplier)) {
    throw std::invalid_argument(
        StrCat("size: '", text, "' is not a size like 4096, 64K, 1M or 2G"));
  }
  return value * multiplier;
}

std::string FormatSize(uint64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024 && unit < 4) {
    v /= 1024;
    ++unit;
  }
  if (unit == 0 || v == static_cast<double>(static_cast<uint64_t>(v))) {
    return StrCat(static_cast<uint64_t>(v), " ", kUnits[unit]);
  }
  return StrCat(Fixed(v, 1), " ", kUnits[unit]);
}

ReadStaging ParseReadStaging(std::string_view text) {
  if (text == "auto") return ReadStaging::kAuto;
  try {
    return ParseBool(text, "stage_reads") ? ReadStaging::kOn : ReadStaging::kOff;
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument(StrCat("stage_reads: '", text, "' is not one of off, auto, on"));
  }
}

std::string_view ReadStagingName(ReadStaging staging) {
  switch (staging) {
    case ReadStaging::kOff:
      return "off";
    case ReadStaging::kOn:
      return "on";
    case ReadStaging::kAuto:
      break;
  }
  return "auto";
}

void EngineOptions::Validate() const {
  if (backend != "auto" && backend != "io_uring" && backend != "libaio" && backend != "threads") {
    throw std::invalid_argument(
        StrCat("backend: '", backend, "' is not one of auto, io_uring, libaio, threads"));
  }
  if (chunk_size == 0 || chunk_size % 4096 != 0 || chunk_size > kMaxChunk) {
    throw std::invalid_argument(StrCat("chunk_size: ", chunk_size,
                                       " must be a non-zero multiple of 4096 and at most 1 GiB"));
  }
  if (queue_depth == 0 || queue_depth > kMaxDepth) {
    throw std::invalid_argument(
        StrCat("queue_depth: ", queue_depth, " must be between 1 and ", kMaxDepth));
  }
  if (workers == 0 || workers > kMaxWorkers) {
    throw std::invalid_argument(
        StrCat("workers: ", workers, " must be between 1 and ", kMaxWorkers));
  }
  if (max_inflight_bytes < chunk_size) {
    throw std::invalid_argument(StrCat("max_inflight_bytes: ", max_inflight_bytes,
                                       " must be at least chunk_size (", chunk_size, ")"));
  }
  if (bounce_idle_ms > kMaxBounceIdleMs) {
    throw std::invalid_argument(StrCat("bounce_idle_ms: ", bounce_idle_ms, " must be at most ",
                                       kMaxBounceIdleMs, " (an hour)"));
  }
}

namespace {

// The variable that sets each option, so a bad value is reported by the name the user typed.
struct EnvOption {
  const char* option;
  const char* variable;
};
constexpr EnvOption kEnvOptions[] = {
    {"backend", "TENSORTIER_BACKEND"},
    {"chunk_size", "TENSORTIER_CHUNK_SIZE"},
    {"queue_depth", "TENSORTIER_QUEUE_DEPTH"},
    {"workers", "TENSORTIER_WORKERS"},
    {"max_inflight_bytes", "TENSORTIER_MAX_INFLIGHT"},
    {"page_cache_check", "TENSORTIER_PAGE_CACHE_CHECK"},
    {"stage_reads", "TENSORTIER_STAGE_READS"},
    {"bounce_idle_ms", "TENSORTIER_BOUNCE_IDLE_MS"},
};

[[noreturn]] void ThrowBadVariable(const char* variable, const char* value, const char* why) {
  throw std::invalid_argument(StrCat(variable, "=", value, " is invalid: ", why));
}

}  // namespace

EngineOptions EngineOptions::FromEnvironment() {
  return FromEnvironment(EngineOptions{});
}

EngineOptions EngineOptions::FromEnvironment(EngineOptions base) {
  EngineOptions o = std::move(base);
  for (const EnvOption& e : kEnvOptions) {
    const char* v = GetEnv(e.variable);
    if (v == nullptr) continue;
    const std::string_view option = e.option;
    try {
      if (option == "backend") {
        o.backend = v;
      } else if (option == "chunk_size") {
        o.chunk_size = ParseSize(v);
      } else if (option == "queue_depth") {
        o.queue_depth =
            static_cast<unsigned>(std::min<uint64_t>(ParseUnsigned(v, e.variable), kMaxDepth + 1));
      } else if (option == "workers") {
        o.workers = static_cast<unsigned>(
            std::min<uint64_t>(ParseUnsigned(v, e.variable), kMaxWorkers + 1));
      } else if (option == "max_inflight_bytes") {
        o.max_inflight_bytes = ParseSize(v);
      } else if (option == "page_cache_check") {
        o.page_cache_check = ParseBool(v, e.variable);
      } else if (option == "bounce_idle_ms") {
        o.bounce_idle_ms = static_cast<uint32_t>(
            std::min<uint64_t>(ParseUnsigned(v, e.variable), kMaxBounceIdleMs + 1));
      } else {
        o.stage_reads = ParseReadStaging(v);
      }
    } catch (const std::invalid_argument& error) {
      ThrowBadVariable(e.variable, v, error.what());
    }
  }
  try {
    o.Validate();
  } catch (const std::invalid_argument& error) {
    // Validate names the option ("chunk_size: ..."); name the variable that set it instead.
    const std::string_view what = error.what();
    for (const EnvOption& e : kEnvOptions) {
      const char* v = GetEnv(e.variable);
      if (v != nullptr && what.starts_with(StrCat(e.option, ":"))) {
        ThrowBadVariable(e.variable, v, error.what());
      }
    }
    throw std::invalid_argument(StrCat("environment (TENSORTIER_*): ", error.what()));
  }
  return o;
}

std::vector<DefaultSetting> Defaults() {
  const EngineOptions o = EngineOptions::FromEnvironment();
  return {
      {"backend", "TENSORTIER_BACKEND", o.backend,
       "I/O backend: auto (io_uring, then libaio, then threads), io_uring, libaio, threads"},
      {"chunk_size", "TENSORTIER_CHUNK_SIZE", FormatSize(o.chunk_size),
       "large transfers are split into page-aligned chunks of this size"},
      {"queue_depth", "TENSORTIER_QUEUE_DEPTH", std::to_string(o.queue_depth),
       "requests in flight per worker ring"},
      {"workers", "TENSORTIER_WORKERS", std::to_string(o.workers),
       "worker threads, each with its own ring"},
      {"max_inflight_bytes", "TENSORTIER_MAX_INFLIGHT", FormatSize(o.max_inflight_bytes),
       "bound on bytes in flight over all workers"},
      {"page_cache_check", "TENSORTIER_PAGE_CACHE_CHECK", o.page_cache_check ? "1" : "0",
       "read page-cache-resident ranges buffered instead of O_DIRECT"},
      {"stage_reads", "TENSORTIER_STAGE_READS", std::string(ReadStagingName(o.stage_reads)),
       "stage direct reads into new tensors through huge-page buffers: off, auto (where the disk "
       "splits requests into scattered pages), on"},
      {"bounce_idle_ms", "TENSORTIER_BOUNCE_IDLE_MS", std::to_string(o.bounce_idle_ms),
       "milliseconds a worker keeps an unused bounce buffer before freeing it (two per worker "
       "stay)"},
  };
}

}  // namespace tensortier
