// The fault-injecting backend: a wrapper around any backend that fails, shortens or delays chosen
// requests, so every error path of the engine and the layers above it runs on CI; and the faults
// of the file steps (FileSystem). Internal: built from src/io/testing/ into the test targets and
// the Python binding's test-only `_fault` argument (tensortier_test_seams in CMakeLists.txt), not
// into the library; not installed. The io_uring submission fault alone lives in the library's
// io_uring backend, below any seam.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

#include <string_view>

#include "tensortier/io/backend.hpp"
#include "tensortier/io/file_system.hpp"

namespace tensortier {

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
  // Throws the plan's error or sleeps its delay when the call of `step` gets the fault.
  void Before(FileStep step, std::string_view what, const std::string& path) override;
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
void InjectUringSubmitFault(unsigned accepted, int error) noexcept;
// Whether the injected fault still waits for a submission.
bool UringSubmitFaultPending() noexcept;

std::unique_ptr<Backend> MakeFaultInjectingBackend(std::unique_ptr<Backend> inner,
                                                   std::shared_ptr<FaultInjector> injector);
// Convenience: a private injector (counts only this backend's requests).
std::unique_ptr<Backend> MakeFaultInjectingBackend(std::unique_ptr<Backend> inner, FaultPlan plan);

}  // namespace tensortier
