// The fault-injecting backend: a wrapper around any backend that fails, shortens or delays chosen
// requests, so every error path of the engine and the layers above it runs on CI; the faults of
// the file steps (FileSystem); and the test hooks (test_hooks.hpp) that carry them, and a fault of
// the io_uring backend's submissions, into what the library makes. Internal: built from
// src/io/testing/ into the test targets and the test-only Python module tensortier._testing
// (tensortier_test_seams in CMakeLists.txt), never into the library or tensortier._core; not
// installed.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "tensortier/io/backend.hpp"
#include "tensortier/io/file_system.hpp"
#include "tensortier/io/test_hooks.hpp"

namespace tensortier {

inline constexpr size_t kFileStepCount = 7;
std::string_view FileStepName(FileStep step);
// "open", "allocate", "datasync", "rename", "sync_directory", "release", "exchange". Throws
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
  uint32_t steps = 0;        // FileStep bits (1 << step) whose system calls are eligible
  uint64_t short_bytes = 0;  // kShort: the completion reports at most this many bytes (0 = half)
  std::chrono::microseconds delay{1000};
};

// Decides which requests get the fault. Shared by the wrappers of all of an engine's workers, so
// "the Nth request" counts over the whole engine. Thread-safe.
class FaultInjector final : public FileStepFaults {
 public:
  explicit FaultInjector(FaultPlan plan) : plan_(plan) {}
  const FaultPlan& plan() const noexcept { return plan_; }
  // Counts an eligible request; true if it gets the fault.
  bool Hit(IoOp op) noexcept;
  bool Hit(FileStep step) noexcept;
  // The plan's error, or 0 after sleeping its delay, when the call of `step` gets the fault;
  // otherwise 0.
  int Before(FileStep step) override;
  // Faults injected so far.
  uint64_t hits() const noexcept override { return hits_.load(); }

 private:
  bool Count() noexcept;  // counts an eligible request or call; true if it gets the fault
  FaultPlan plan_;
  std::atomic<uint64_t> seen_{0};
  std::atomic<uint64_t> hits_{0};
};

// A fault inside the io_uring backend, below the seam the wrapper above works at: liburing makes
// its system calls itself, so neither that wrapper nor LD_PRELOAD reaches them. The next
// submission of any io_uring backend in this process hands the kernel at most `accepted` of its
// entries, and the kernel's answer for the rest is -`error` (EAGAIN: out of resources; EBUSY:
// completion queue overflow), leaving the ring as a real short or refused io_uring_enter does.
// Installs FaultHooks::Get() in this process; (0, 0) disarms.
void InjectUringSubmitFault(unsigned accepted, int error) noexcept;
// Whether the injected fault still waits for a submission.
bool UringSubmitFaultPending() noexcept;

// The test hooks that inject these faults: the io_uring submission fault above, and a plan armed
// while a test makes objects through the Python binding (each engine's backends, each
// FileSystem made meanwhile gets an injector of its own for it). Thread-safe.
class FaultHooks final : public TestHooks {
 public:
  // The one instance of this copy of the test seams (a Python module linking them installs its
  // own into tensortier._core's copy of the library).
  static FaultHooks& Get();

  void ArmUringSubmitFault(unsigned accepted, int error) noexcept;
  bool UringSubmitFaultPending() const noexcept;
  // Objects made from now until Disarm() get `plan`'s faults.
  void Arm(const FaultPlan& plan);
  void Disarm();

  bool TakeUringSubmitFault(unsigned* accepted, int* error) noexcept override;
  BackendFactory Backends(BackendFactory inner) override;
  std::shared_ptr<FileStepFaults> FileFaults() override;
  // Once the size of `path` is taken, the file is truncated to half that ("": none).
  void ShrinkAfterSize(std::string path);
  void FileSizeTaken(const std::string& path) noexcept override;
  // Device-row slabs of `bytes` from now on (0: the library's own size).
  void SetDeviceSlabBytes(uint64_t bytes) noexcept { device_slab_bytes_.store(bytes); }
  uint64_t DeviceSlabBytes(uint64_t normal) noexcept override {
    const uint64_t bytes = device_slab_bytes_.load();
    return bytes != 0 ? bytes : normal;
  }

 private:
  std::optional<FaultPlan> Armed();
  std::atomic<uint64_t> submit_fault_{0};  // accepted << 32 | error, 0 when none
  std::atomic<uint64_t> device_slab_bytes_{0};
  std::mutex mu_;
  std::optional<FaultPlan> armed_;  // guarded by mu_
  std::string shrink_path_;         // guarded by mu_
};

std::unique_ptr<Backend> MakeFaultInjectingBackend(std::unique_ptr<Backend> inner,
                                                   std::shared_ptr<FaultInjector> injector);
// Convenience: a private injector (counts only this backend's requests).
std::unique_ptr<Backend> MakeFaultInjectingBackend(std::unique_ptr<Backend> inner, FaultPlan plan);

}  // namespace tensortier
