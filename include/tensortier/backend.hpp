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

namespace tensortier {

enum class IoOp : uint8_t { kRead, kWrite };

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
};

enum class BackendKind { kIoUring, kLibaio, kThreads };

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
  // Throws IoError if the submission itself fails; then none of `requests` is in flight.
  virtual void Submit(std::span<const IoRequest> requests) = 0;
  // Stores up to out.size() completions; blocks until at least `min_wait` (<= in flight) exist.
  virtual size_t Reap(std::span<IoCompletion> out, unsigned min_wait) = 0;
};

// Creates a backend of `depth` entries. Throws IoError (e.g. ENOSYS, EPERM when io_uring is
// disabled, or "not built" as ENOTSUP) when it cannot be used on this machine.
std::unique_ptr<Backend> MakeBackend(BackendKind kind, unsigned depth);
// Whether support for `kind` was compiled in (liburing / libaio found at build time).
bool BackendCompiledIn(BackendKind kind);

// The system calls outside the engine that a save or a load makes (file_system.hpp), each a
// place a fault can be injected.
enum class FileStep : uint8_t {
  kOpen,           // creating or opening a file
  kAllocate,       // fallocate
  kDataSync,       // fdatasync
  kRename,         // rename over the final name
  kSyncDirectory,  // fsync of the directory
  kRelease,        // closing a replaced file's last descriptor (frees its blocks)
};
inline constexpr size_t kFileStepCount = 6;
std::string_view FileStepName(FileStep step);
// "open", "allocate", "datasync", "rename", "sync_directory", "release". Throws
// std::invalid_argument otherwise.
FileStep ParseFileStep(std::string_view name);

// Faults for tests: request number `nth` (1-based, counted over the requests this wrapper sees
// whose op matches, or the system calls whose step is in `steps`) and the `count - 1` following
// ones get the fault.
struct FaultPlan {
  enum class Kind { kNone, kError, kShort, kDelay };
  Kind kind = Kind::kNone;
  int error = 5;  // errno for kError (EIO)
  uint64_t nth = 1;
  uint64_t count = 1;
  bool reads = true;  // which ops are eligible
  bool writes = true;
  uint32_t steps = 0;  // FileStep bits (1 << step) whose system calls are eligible
  uint64_t short_bytes = 0;  // kShort: the completion reports at most this many bytes (0 = half)
  std::chrono::microseconds delay{1000};
};

// Decides which requests get the fault. Shared by the wrappers of all of an engine's workers, so
// "the Nth request" counts over the whole engine. Thread-safe.
class FaultInjector {
 public:
  explicit FaultInjector(FaultPlan plan) : plan_(plan) {}
  const FaultPlan& plan() const noexcept { return plan_; }
  // Counts an eligible request; true if it gets the fault.
  bool Hit(IoOp op) noexcept;
  bool Hit(FileStep step) noexcept;
  // Faults injected so far.
  uint64_t hits() const noexcept { return hits_.load(); }

 private:
  bool Count() noexcept;  // counts an eligible request or call; true if it gets the fault
  FaultPlan plan_;
  std::atomic<uint64_t> seen_{0};
  std::atomic<uint64_t> hits_{0};
};

std::unique_ptr<Backend> MakeFaultInjectingBackend(std::unique_ptr<Backend> inner,
                                                   std::shared_ptr<FaultInjector> injector);
// Convenience: a private injector (counts only this backend's requests).
std::unique_ptr<Backend> MakeFaultInjectingBackend(std::unique_ptr<Backend> inner, FaultPlan plan);

// How an engine gets a backend for each worker (called on that worker's thread).
using BackendFactory = std::function<std::unique_ptr<Backend>(unsigned depth)>;

}  // namespace tensortier
