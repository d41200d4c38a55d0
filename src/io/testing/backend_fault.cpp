// Fault injection for tests (the LevelDB ErrorEnv idea at the backend seam): errors never reach
// the kernel, short completions under-report what the kernel did (harmless to resubmit, and it
// produces counts at any alignment), delays stall the submitting worker.
#include <iterator>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tensortier/io/fault_injection.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

class FaultInjectingBackend final : public Backend {
 public:
  FaultInjectingBackend(std::unique_ptr<Backend> inner, std::shared_ptr<FaultInjector> injector)
      : inner_(std::move(inner)), injector_(std::move(injector)), plan_(injector_->plan()) {}

  std::string_view name() const noexcept override { return inner_->name(); }
  unsigned depth() const noexcept override { return inner_->depth(); }

  void Submit(std::span<const IoRequest> requests) override {
    std::vector<IoRequest> forward;
    forward.reserve(requests.size());
    for (const IoRequest& r : requests) {
      if (!injector_->Hit(r.op)) {
        forward.push_back(r);
        continue;
      }
      switch (plan_.kind) {
        case FaultPlan::Kind::kError:
          synthetic_.push_back({r.user_data, -static_cast<int64_t>(plan_.error)});
          break;
        case FaultPlan::Kind::kShort:
          shorten_[r.user_data] = plan_.short_bytes != 0 ? plan_.short_bytes : r.len / 2;
          forward.push_back(r);
          break;
        case FaultPlan::Kind::kDelay:
          std::this_thread::sleep_for(plan_.delay);
          forward.push_back(r);
          break;
        case FaultPlan::Kind::kNone:
          forward.push_back(r);
          break;
      }
    }
    if (!forward.empty()) inner_->Submit(forward);
  }

  size_t Reap(std::span<IoCompletion> out, unsigned min_wait) override {
    size_t n = 0;
    while (n < out.size() && !synthetic_.empty()) {
      out[n++] = synthetic_.back();
      synthetic_.pop_back();
    }
    unsigned still = n >= min_wait ? 0 : min_wait - static_cast<unsigned>(n);
    if (n < out.size()) n += inner_->Reap(out.subspan(n), still);
    for (size_t i = 0; i < n; ++i) {
      auto it = shorten_.find(out[i].user_data);
      if (it == shorten_.end()) continue;
      if (out[i].result > 0) {
        out[i].result = std::min<int64_t>(out[i].result, static_cast<int64_t>(it->second));
      }
      shorten_.erase(it);
    }
    return n;
  }

 private:
  std::unique_ptr<Backend> inner_;
  std::shared_ptr<FaultInjector> injector_;
  const FaultPlan& plan_;
  std::vector<IoCompletion> synthetic_;
  std::unordered_map<uint64_t, uint64_t> shorten_;
};

}  // namespace

namespace {
constexpr EnumName<FileStep> kFileStepNames[] = {{FileStep::kOpen, "open"},
                                                 {FileStep::kAllocate, "allocate"},
                                                 {FileStep::kDataSync, "datasync"},
                                                 {FileStep::kRename, "rename"},
                                                 {FileStep::kSyncDirectory, "sync_directory"},
                                                 {FileStep::kRelease, "release"},
                                                 {FileStep::kExchange, "exchange"}};
static_assert(std::size(kFileStepNames) == kFileStepCount);
}  // namespace

std::string_view FileStepName(FileStep step) {
  return NameOf(kFileStepNames, step);
}

FileStep ParseFileStep(std::string_view name) {
  if (const auto step = ValueOf(kFileStepNames, name)) return *step;
  throw std::invalid_argument(
      StrCat("fault step must be ", JoinNames(kFileStepNames, ", ", " or "), ", not '", name, "'"));
}

bool FaultInjector::Hit(IoOp op) noexcept {
  bool eligible = op == IoOp::kRead ? plan_.reads : plan_.writes;
  return eligible && Count();
}

bool FaultInjector::Hit(FileStep step) noexcept {
  return (plan_.steps & (1u << static_cast<unsigned>(step))) != 0 && Count();
}

int FaultInjector::Before(FileStep step) {
  if (!Hit(step)) return 0;
  if (plan_.kind == FaultPlan::Kind::kDelay) {
    std::this_thread::sleep_for(plan_.delay);
    return 0;
  }
  return plan_.error;
}

bool FaultInjector::Count() noexcept {
  if (plan_.kind == FaultPlan::Kind::kNone) return false;
  uint64_t n = seen_.fetch_add(1) + 1;
  bool hit = n >= plan_.nth && n < plan_.nth + plan_.count;
  if (hit) hits_.fetch_add(1);
  return hit;
}

std::unique_ptr<Backend> MakeFaultInjectingBackend(std::unique_ptr<Backend> inner,
                                                   std::shared_ptr<FaultInjector> injector) {
  return std::make_unique<FaultInjectingBackend>(std::move(inner), std::move(injector));
}

std::unique_ptr<Backend> MakeFaultInjectingBackend(std::unique_ptr<Backend> inner, FaultPlan plan) {
  return MakeFaultInjectingBackend(std::move(inner), std::make_shared<FaultInjector>(plan));
}

}  // namespace tensortier
