// What the DCP bindings read from torch's DCP objects (MetadataIndex, ReadItem): bindings/
// dcp_items.cpp. With the GIL held.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "tensortier/checkpoint/dcp_reads.hpp"

// A MetadataIndex's item name: its fqn, with its chunk's offsets where they are not all 0
// ("w at [8, 0]").
std::string DcpItemName(const pybind11::handle& index);
// a == b, as Python compares them.
bool PyEqual(const pybind11::handle& a, const pybind11::handle& b);
// The key of a chunk's sizes in dcp_chunk_sizes' dict: (fqn, offsets as a tuple; () for an index
// without offsets).
pybind11::tuple DcpChunkKey(const pybind11::handle& fqn, const pybind11::handle& offsets);
// Reader's `verify` (True, False or "full") as DcpFileReads takes it.
tensortier::DcpVerify DcpVerifyOf(const pybind11::handle& verify);
