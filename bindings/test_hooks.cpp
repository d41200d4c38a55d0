// The test seam's end in tensortier._core: where the objects the bindings make ask the installed
// test hooks (src/io/test_hooks.hpp) for faults, and the capsule through which the test-only
// module tensortier._testing, a separate extension with its own copy of the library, installs its
// hooks into this module's copy. Nothing here injects a fault: without hooks every object is made
// as it would be without this file.
#include <pybind11/pybind11.h>

#include <string>

#include "binding_helpers.hpp"
#include "register.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/io/test_hooks.hpp"

namespace py = pybind11;
using namespace tensortier;

BackendFactory tensortier::TestBackends(const EngineOptions& options) {
  TestHooks* hooks = InstalledTestHooks();
  if (hooks == nullptr) return {};
  const std::string backend = options.backend == "auto" ? "threads" : options.backend;
  return hooks->Backends(
      [backend](unsigned depth) { return MakeBackend(ParseBackendKind(backend), depth); });
}

FileSystem tensortier::TestFileSystem() {
  TestHooks* hooks = InstalledTestHooks();
  return hooks != nullptr ? FileSystem(hooks->FileFaults()) : FileSystem();
}

void RegisterTestHooks(py::module_& m) {
  using Install = void (*)(TestHooks*) noexcept;
  static constexpr Install kInstall = &InstallTestHooks;
  m.attr("_install_test_hooks") =
      py::capsule(reinterpret_cast<const void*>(&kInstall), "tensortier._core._install_test_hooks");
}
