// tensortier._testing: fault injection for the tests, built only with
// TENSORTIER_PYTHON_TEST_SEAMS=ON and never part of the shipped package. It links the test seams
// (src/io/testing/) and installs their hooks into tensortier._core's copy of the library through
// the capsule _core._install_test_hooks (two extensions each link their own copy of the static
// library, so a hook installed in this module's copy would never be asked). Objects that the
// tests make through with_faults() get the faults; everything else runs as in a shipped build.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensortier/io/fault_injection.hpp"
#include "tensortier/io/file_system.hpp"
#include "tensortier/io/test_hooks.hpp"
#include "tensortier/util/enum_names.hpp"
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

// A fault dict as a plan: "kind" (error, short, delay), "errno", "nth", "count", "reads",
// "writes" (which engine requests are eligible), "steps" (names of the FileSteps whose system
// calls are: open, allocate, datasync, rename, sync_directory, release; a dict naming steps makes
// reads and writes ineligible unless it says otherwise), "short_bytes", "delay_us".
FaultPlan FaultPlanFromDict(const py::dict& f) {
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

// Disarms the hooks when with_faults' call ends, returning or raising.
struct Disarm {
  ~Disarm() { FaultHooks::Get().Disarm(); }
};

}  // namespace

PYBIND11_MODULE(_testing, m) {
  m.doc() = "tensortier test seams: fault injection for the tests (not part of the package)";

  using Install = void (*)(TestHooks*) noexcept;
  const auto capsule =
      py::module_::import("tensortier._core").attr("_install_test_hooks").cast<py::capsule>();
  if (std::string(capsule.name() != nullptr ? capsule.name() : "") !=
      "tensortier._core._install_test_hooks") {
    throw std::runtime_error("tensortier._core._install_test_hooks is not the test hooks' capsule");
  }
  (*capsule.get_pointer<const Install>())(&FaultHooks::Get());

  m.def(
      "with_faults",
      [](const py::dict& plan, const py::object& make, const py::args& args,
         const py::kwargs& kwargs) {
        FaultHooks::Get().Arm(FaultPlanFromDict(plan));
        Disarm disarm;
        return make(*args, **kwargs);
      },
      py::arg("plan"), py::arg("make"),
      "Calls make(*args, **kwargs) with the fault plan armed, and returns what it returns: each "
      "engine (its backends) and each FileSystem that tensortier._core makes meanwhile gets an "
      "injector of its own for the plan, e.g. with_faults({'kind': 'error', 'nth': 3}, IOHandle, "
      "'threads'). The plan: 'kind' ('error', 'short' or 'delay'), 'errno' (default EIO), 'nth' "
      "(1-based, default 1) and 'count' (default 1): which eligible requests or calls get the "
      "fault; 'reads', 'writes' (engine requests eligible, default both), 'steps' (the "
      "FileSystem calls eligible: 'open', 'allocate', 'datasync', 'rename', 'sync_directory', "
      "'release'; naming steps makes reads and writes ineligible unless the plan says "
      "otherwise), 'short_bytes' (a short completion's most bytes, default half) and "
      "'delay_us'. ValueError for a plan it cannot read.");
  m.def(
      "shrink_after_size", [](const std::string& path) { FaultHooks::Get().ShrinkAfterSize(path); },
      py::arg("path"),
      "From now on, a file at `path` is truncated to half its size just after tensortier takes "
      "its size, before reading it (a file that shrinks meanwhile); '' stops it.");
  m.def(
      "set_device_slab_bytes", [](uint64_t bytes) { FaultHooks::Get().SetDeviceSlabBytes(bytes); },
      py::arg("bytes"),
      "From now on, a shared tensor's device rows move to and from files through page-locked "
      "slabs of `bytes` (0: the library's own size).");
  m.def(
      "faults_injected",
      [](const FileSystem& fs) -> uint64_t { return fs.faults() ? fs.faults()->hits() : 0; },
      py::arg("fs"), "How many calls a _core.FileSystem's fault plan failed or delayed so far.");
}
