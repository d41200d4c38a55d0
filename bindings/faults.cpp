// Test-only fault injection for the bindings: the `_fault` dicts that Engine, Offloader and the
// checkpoint, extent and data bindings take, as plans and backend factories.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "binding_helpers.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/io/fault_injection.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

constexpr EnumName<FaultPlan::Kind> kFaultKindNames[] = {{FaultPlan::Kind::kError, "error"},
                                                         {FaultPlan::Kind::kShort, "short"},
                                                         {FaultPlan::Kind::kDelay, "delay"}};

FaultPlan::Kind ParseFaultKind(const std::string& kind) {
  if (const auto parsed = ValueOf(kFaultKindNames, kind)) return *parsed;
  throw std::invalid_argument(StrCat(
      "fault kind must be ", JoinNames(kFaultKindNames, ", ", " or "), ", not '", kind, "'"));
}

}  // namespace

// A backend factory that injects the faults described by `fault` (test hook; also used by
// bindings/extents.cpp).
FaultPlan tensortier::FaultPlanFromDict(const py::dict& f) {
  FaultPlan plan;
  plan.kind = ParseFaultKind(f["kind"].cast<std::string>());
  if (f.contains("errno")) plan.error = f["errno"].cast<int>();
  if (f.contains("nth")) plan.nth = f["nth"].cast<uint64_t>();
  if (f.contains("count")) plan.count = f["count"].cast<uint64_t>();
  if (f.contains("steps")) {
    plan.reads = plan.writes = false;
    for (const auto& step : f["steps"].cast<std::vector<std::string>>()) {
      plan.steps |= 1u << static_cast<unsigned>(ParseFileStep(step));
    }
  }
  if (f.contains("reads")) plan.reads = f["reads"].cast<bool>();
  if (f.contains("writes")) plan.writes = f["writes"].cast<bool>();
  if (f.contains("short_bytes")) plan.short_bytes = f["short_bytes"].cast<uint64_t>();
  if (f.contains("delay_us")) plan.delay = std::chrono::microseconds(f["delay_us"].cast<int64_t>());
  return plan;
}

BackendFactory tensortier::FaultFactory(const EngineOptions& options, const py::dict& f) {
  const FaultPlan plan = FaultPlanFromDict(f);
  BackendKind kind = ParseBackendKind(options.backend == "auto" ? "threads" : options.backend);
  auto injector = std::make_shared<FaultInjector>(plan);
  return [kind, injector](unsigned depth) {
    return MakeFaultInjectingBackend(MakeBackend(kind, depth), injector);
  };
}
