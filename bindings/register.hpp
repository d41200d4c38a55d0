// The registration function of each binding file: module.cpp calls them, in this order, to fill
// tensortier._core. A file that defines a function here includes this header.
#pragma once

#include <pybind11/pybind11.h>

void RegisterFile(pybind11::module_& m);               // bindings/file.cpp
void RegisterEngine(pybind11::module_& m);             // bindings/engine.cpp
void RegisterOffload(pybind11::module_& m);            // bindings/offload.cpp
void RegisterBuffers(pybind11::module_& m);            // bindings/buffers.cpp
void RegisterSettings(pybind11::module_& m);           // bindings/settings.cpp
void RegisterCheckpoint(pybind11::module_& m);         // bindings/checkpoint.cpp
void RegisterCheckpointChecks(pybind11::module_& m);   // bindings/checkpoint_checks.cpp
void RegisterSafetensorsChecks(pybind11::module_& m);  // bindings/safetensors_checks.cpp
void RegisterTransfer(pybind11::module_& m);           // bindings/transfer.cpp
void RegisterExtents(pybind11::module_& m);            // bindings/extents.cpp
void RegisterShared(pybind11::module_& m);             // bindings/shared.cpp
void RegisterSharedArgs(pybind11::module_& m);         // bindings/shared_args.cpp
void RegisterSharedGroup(pybind11::module_& m);        // bindings/shared_group.cpp
void RegisterData(pybind11::module_& m);               // bindings/data.cpp
void RegisterTestHooks(pybind11::module_& m);          // bindings/test_hooks.cpp
void RegisterDcp(pybind11::module_& m);                // bindings/dcp.cpp
void RegisterDcpItems(pybind11::module_& m);           // bindings/dcp_items.cpp
void RegisterDcpLoad(pybind11::module_& m);            // bindings/dcp_load.cpp
void RegisterDcpTable(pybind11::module_& m);           // bindings/dcp_table.cpp
void RegisterHf(pybind11::module_& m);                 // bindings/hf.cpp
void RegisterOperationLog(pybind11::module_& m);       // bindings/operation_log.cpp
void RegisterRegistries(pybind11::module_& m);         // bindings/registries.cpp
void RegisterDeepNvme(pybind11::module_& m);           // bindings/deepnvme.cpp
void RegisterPaths(pybind11::module_& m);              // bindings/paths.cpp
void RegisterCompat(pybind11::module_& m);             // bindings/compat.cpp
