#include "tensortier/shared/shared_device.hpp"

#include <algorithm>
#include <exception>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tensortier/shared/partition_server.hpp"
#include "tensortier/shared/tensor_memory.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/cuda/cuda_vmm.hpp"
#include "tensortier/shared/shared_group.hpp"
#include "tensortier/shared/shared_tensor.hpp"
#include "tensortier/util/strings.hpp"
#include "tensortier/shared/unix_socket.hpp"

namespace tensortier {

using shared::UniqueFd;

DevicePeers CombineDevicePeers(const std::vector<std::string>& peers, const std::string& what,
                               uint64_t granularity) {
  DevicePeers out;
  out.granularity = granularity;
  std::set<int> devices;
  for (const std::string& p : peers) {
    std::istringstream in(p);
    int d = 0;
    uint64_t g = 0;
    in >> d >> g;
    if (d >= 0 && d < CudaDriver::Get().device_count()) devices.insert(d);
    out.granularity = std::max(out.granularity, g);
  }
  for (const std::string& p : peers) {
    uint64_t g = std::stoull(p.substr(p.find(' ') + 1));
    if (out.granularity % g != 0) {
      throw std::invalid_argument(StrCat(what, ": the GPUs' allocation granularities differ (", g,
                                         " does not divide ", out.granularity, ")"));
    }
  }
  out.access.assign(devices.begin(), devices.end());
  return out;
}

// Device memory: see the header. Every step that can fail on one rank ends in Settle, so that
// the others throw at once instead of waiting out the timeout; `memory` (and, once served, the
// tensor's Close) undoes whatever was done, in reverse.
std::shared_ptr<SharedTensor> SharedGroup::MapDevice(const SharedTensorSpec& spec,
                                                     const std::string& key, int device) {
  const std::string what = StrCat("create_tensor '", key, "' in device memory");
  std::optional<PrimaryContext> context;
  uint64_t granularity = 0;
  std::exception_ptr failure;
  try {
    context.emplace(CudaDriver::Get(), device);
    granularity = DeviceAllocationGranularity(*context);
  } catch (...) {
    failure = std::current_exception();
  }
  // Every rank's GPU and granularity: access is granted to all of them, and partitions are
  // rounded to the largest granularity so that they line up the same way in every process.
  std::vector<std::string> peers =
      Settle(StrCat(what, " (device)"), failure, StrCat(device, " ", granularity));
  const DevicePeers combined = CombineDevicePeers(peers, what, granularity);
  granularity = combined.granularity;
  const std::vector<int>& access = combined.access;
  const bool continuous = spec.layout == SharedLayout::kContinuous;

  auto tensor = std::shared_ptr<SharedTensor>(new SharedTensor());
  tensor->spec_ = spec;
  tensor->rank_ = rank_;
  tensor->key_ = key;
  tensor->partitions_ =
      PartitionRows(spec.rows(), spec.row_bytes(), world_size_, continuous ? granularity : 1);
  tensor->stats_.device = device;
  tensor->stats_.granularity = granularity;
  tensor->stats_.local_bytes = tensor->partitions_[rank_].bytes;
  auto memory = std::make_shared<SharedTensor::Memory>();
  std::vector<uint64_t> offsets(world_size_);
  uint64_t span = 0;
  for (int r = 0; r < world_size_; ++r) {
    offsets[r] = span;
    span += AlignUp(tensor->partitions_[r].bytes, granularity);
  }

  // This rank's partition: created, exported, served.
  std::optional<DeviceAllocation> own;
  try {
    const SharedPartition& p = tensor->partitions_[rank_];
    UniqueFd fd;
    if (p.bytes > 0) {
      own.emplace(DeviceAllocation::Create(*context, AlignUp(p.bytes, granularity)));
      fd = UniqueFd(own->Export());
    }
    std::shared_ptr<shared::PartitionServer> server = Server("create_tensor");
    server->Serve(key, std::move(fd));
    tensor->server_ = std::move(server);
  } catch (...) {
    failure = std::current_exception();
  }
  Settle(StrCat(what, " (serving)"), failure);

  // Every partition, this rank's included, mapped into one reserved range.
  try {
    if (span > 0) memory->device_range.emplace(*context, span, granularity);
    auto deadline = shared::DeadlineAfter(timeout_);
    for (int r = 0; r < world_size_; ++r) {
      SharedPartition& p = tensor->partitions_[r];
      if (p.bytes == 0) continue;
      if (r == rank_) {
        memory->device_allocations.push_back(std::move(*own));
        own.reset();
      } else {
        std::string from = StrCat("rank ", r, " (serving '", key, "')");
        UniqueFd fd = shared::FetchDescriptor(shared::PartitionSocketName(token_, r), key,
                                              deadline, from);
        memory->device_allocations.push_back(
            DeviceAllocation::Import(*context, fd.get(), AlignUp(p.bytes, granularity)));
      }
      const cuda::CUdeviceptr at = memory->device_range->address() + offsets[r];
      memory->device_mappings.emplace_back(*context, at, memory->device_allocations.back(), access);
      p.address = reinterpret_cast<uint8_t*>(at);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  Settle(StrCat(what, " (mapped)"), failure);
  tensor->memory_ = std::move(memory);
  Remember(tensor);
  return tensor;
}

}  // namespace tensortier
