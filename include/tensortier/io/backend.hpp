// The seam between the engine and the kernel: one interface over io_uring, libaio and a
// pread/pwrite thread pool, plus a wrapper that injects faults for tests.
//
// Contract (like liburing): per-request results are a byte count or -errno, delivered as
// completions; only a failure of the submission mechanism itself throws. A backend instance is
// used by one thread at a time (each engine worker owns one).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/settings.hpp"

namespace tensortier {

enum class IoOp : uint8_t { kRead, kWrite };
inline constexpr EnumName<IoOp> kIoOpNames[] = {{IoOp::kRead, "read"}, {IoOp::kWrite, "write"}};

struct IoRequest {
  IoOp op;
  int fd;
  void* buf;
  uint64_t len;
  uint64_t offset;
  uint64_t user_data;
};

struct IoCompletion {
  uint64_t user_data;
  int64_t result;  // bytes transferred, or -errno
  // The submission refused the request (result says why): it never started. Final, even for
  // EAGAIN, which in a completion asks for the request again.
  bool refused = false;
};

enum class BackendKind { kIoUring, kLibaio, kThreads };
// The kinds' names: the words of TENSORTIER_BACKEND after "auto".
static_assert(SettingFor("TENSORTIER_BACKEND").choices.front() == "auto");
inline constexpr auto kBackendKindNames =
    NamesFromWords(SettingFor("TENSORTIER_BACKEND").choices.subspan(1),
                   {BackendKind::kIoUring, BackendKind::kLibaio, BackendKind::kThreads});

std::string_view BackendName(BackendKind kind);
// "io_uring", "libaio", "threads". Throws std::invalid_argument otherwise.
BackendKind ParseBackendKind(std::string_view name);
// In preference order, as `auto` tries them.
inline constexpr BackendKind kAllBackends[] = {BackendKind::kIoUring, BackendKind::kLibaio,
                                               BackendKind::kThreads};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const noexcept = 0;
  // Most requests that may be in flight at once.
  virtual unsigned depth() const noexcept = 0;
  // Starts all `requests`. REQUIRES: in-flight count + requests.size() <= depth().
  // A request the kernel refuses to start completes (once, through Reap) with `refused` set.
  // Throws if the submission itself cannot be made; then none of `requests` is in flight.
  virtual void Submit(std::span<const IoRequest> requests) = 0;
  // Stores up to out.size() completions; blocks until at least `min_wait` (<= in flight) exist.
  virtual size_t Reap(std::span<IoCompletion> out, unsigned min_wait) = 0;
};

// Creates a backend of `depth` entries. Throws std::system_error (e.g. ENOSYS, EPERM when
// io_uring is disabled, or "not built" as ENOTSUP) when it cannot be used on this machine.
std::unique_ptr<Backend> MakeBackend(BackendKind kind, unsigned depth);
// Whether support for `kind` was compiled in (liburing / libaio found at build time).
bool BackendCompiledIn(BackendKind kind);

// How an engine gets a backend for each worker (called on that worker's thread).
using BackendFactory = std::function<std::unique_ptr<Backend>(unsigned depth)>;

}  // namespace tensortier
