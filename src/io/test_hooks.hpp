// The test seam, as LevelDB's Env: one process-wide hook through which a test build injects faults
// into objects the library and its Python binding make. The faults themselves live outside the
// library (src/io/testing/, the test targets and the test-only Python module tensortier._testing);
// the library only asks the installed hook, and none is installed unless a test does so. Internal;
// not installed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tensortier/io/backend.hpp"
#include "tensortier/io/file_system.hpp"

namespace tensortier {

// What a test injects. Each method has a default that injects nothing. Thread-safe
// implementations only: the library asks from any thread.
class TestHooks {
 public:
  virtual ~TestHooks() = default;

  // The io_uring backend's next submission: true (once per injected fault) when it must hand the
  // kernel at most `*accepted` of its entries and complete the rest with -`*error`.
  virtual bool TakeUringSubmitFault(unsigned* /*accepted*/, int* /*error*/) noexcept {
    return false;
  }
  // The backends of an engine that the Python binding is making: a factory that wraps `inner`, or
  // an empty one to let the engine choose its own (probing, as without the hook).
  virtual BackendFactory Backends(BackendFactory /*inner*/) { return {}; }
  // The step faults of a FileSystem that the Python binding is making (null: none).
  virtual std::shared_ptr<FileStepFaults> FileFaults() { return nullptr; }
  // `path`'s size was just taken, before its bytes are read (a test may change the file here).
  virtual void FileSizeTaken(const std::string& /*path*/) noexcept {}
  // The bytes of the page-locked slab through which a shared tensor's device rows move to and from
  // files, given the library's own `normal` (a test makes it small to cross many slabs).
  virtual uint64_t DeviceSlabBytes(uint64_t normal) noexcept { return normal; }
};

// Installs `hooks` (null: none) for the whole process; the caller keeps it alive while it is
// installed.
void InstallTestHooks(TestHooks* hooks) noexcept;
// The hooks installed, or null (always null unless a test installed some).
TestHooks* InstalledTestHooks() noexcept;

}  // namespace tensortier
