// The test hooks that carry the faults into what the library makes (fault_injection.hpp).
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <utility>

#include "tensortier/io/fault_injection.hpp"

namespace tensortier {

FaultHooks& FaultHooks::Get() {
  static FaultHooks* const hooks = new FaultHooks();  // never destroyed: installed until exit
  return *hooks;
}

void FaultHooks::ArmUringSubmitFault(unsigned accepted, int error) noexcept {
  submit_fault_.store(static_cast<uint64_t>(accepted) << 32 | static_cast<uint32_t>(error));
}

bool FaultHooks::UringSubmitFaultPending() const noexcept {
  return submit_fault_.load() != 0;
}

bool FaultHooks::TakeUringSubmitFault(unsigned* accepted, int* error) noexcept {
  if (submit_fault_.load(std::memory_order_relaxed) == 0) return false;
  const uint64_t f = submit_fault_.exchange(0);
  if (f == 0) return false;
  *accepted = static_cast<unsigned>(f >> 32);
  *error = static_cast<int>(static_cast<uint32_t>(f));
  return true;
}

void FaultHooks::Arm(const FaultPlan& plan) {
  std::lock_guard lock(mu_);
  armed_ = plan;
}

void FaultHooks::Disarm() {
  std::lock_guard lock(mu_);
  armed_.reset();
}

std::optional<FaultPlan> FaultHooks::Armed() {
  std::lock_guard lock(mu_);
  return armed_;
}

BackendFactory FaultHooks::Backends(BackendFactory inner) {
  const std::optional<FaultPlan> plan = Armed();
  if (!plan) return {};
  auto injector = std::make_shared<FaultInjector>(*plan);
  return [inner = std::move(inner), injector](unsigned depth) {
    return MakeFaultInjectingBackend(inner(depth), injector);
  };
}

std::shared_ptr<FileStepFaults> FaultHooks::FileFaults() {
  const std::optional<FaultPlan> plan = Armed();
  if (!plan) return nullptr;
  return std::make_shared<FaultInjector>(*plan);
}

void FaultHooks::ShrinkAfterSize(std::string path) {
  std::lock_guard lock(mu_);
  shrink_path_ = std::move(path);
}

void FaultHooks::FileSizeTaken(const std::string& path) noexcept {
  {
    std::lock_guard lock(mu_);
    if (shrink_path_.empty() || path != shrink_path_) return;
  }
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0) (void)::truncate(path.c_str(), st.st_size / 2);
}

void InjectUringSubmitFault(unsigned accepted, int error) noexcept {
  FaultHooks& hooks = FaultHooks::Get();
  InstallTestHooks(&hooks);
  hooks.ArmUringSubmitFault(accepted, error);
}

bool UringSubmitFaultPending() noexcept {
  return FaultHooks::Get().UringSubmitFaultPending();
}

}  // namespace tensortier
