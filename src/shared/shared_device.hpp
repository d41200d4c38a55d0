// Shared tensors in device memory: each rank's partition is physical memory on its own GPU,
// exported as a descriptor, imported by every process and mapped into one reserved range of
// device addresses (SharedGroup::MapDevice, defined in shared_device.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tensortier {

// What the ranks of a group told each other about their GPUs.
struct DevicePeers {
  std::vector<int> access;   // the GPUs of the group this process can see, ascending
  uint64_t granularity = 0;  // the largest allocation granularity: every partition's multiple
};

// Combines every rank's "<device> <granularity>" (`peers`, in rank order) with this process's
// `granularity`. Throws std::invalid_argument (`what` starts the message) when the granularities
// do not all divide the largest one.
DevicePeers CombineDevicePeers(const std::vector<std::string>& peers, const std::string& what,
                               uint64_t granularity);

}  // namespace tensortier
