// tensortier._core: the C++ API for Python, without torch. Buffers cross as addresses and sizes;
// the Python layer (python/tensortier) keeps the objects alive and validates them. Every call that
// can block releases the GIL, and no Python runs on engine threads. Each binding file registers
// one concept; this file only makes the module.
#include <pybind11/pybind11.h>

#include "errors.hpp"
#include "gil.hpp"
#include "register.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "tensortier C++ core (internal; use the tensortier package)";
  // The thread that finalizes the interpreter: threading's main thread (this import may run on
  // another).
  tensortier::main_thread_ident.store(
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>());

  tensortier::RegisterErrors(m);
  RegisterFile(m);
  RegisterEngine(m);
  RegisterOffload(m);
  RegisterBuffers(m);
  RegisterSettings(m);
  RegisterCheckpoint(m);
  RegisterCheckpointChecks(m);
  RegisterSafetensorsChecks(m);
  RegisterTransfer(m);
  RegisterExtents(m);
  RegisterShared(m);
  RegisterSharedArgs(m);
  RegisterSharedGroup(m);
  RegisterData(m);
  RegisterTestHooks(m);
  RegisterDcp(m);
  RegisterDcpTable(m);
  RegisterDcpItems(m);
  RegisterDcpLoad(m);
  RegisterHf(m);
  RegisterOperationLog(m);
  RegisterRegistries(m);
  RegisterDeepNvme(m);
  RegisterPaths(m);
  RegisterCompat(m);
}
