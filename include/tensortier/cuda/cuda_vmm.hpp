// CUDA virtual memory management: physical device memory (cuMemCreate) that another process can
// import through a POSIX file descriptor, address ranges reserved for it (cuMemAddressReserve),
// and the mappings between the two (cuMemMap, cuMemSetAccess). Shared tensors in device memory
// are built from these (shared_tensor.hpp).
//
// Every object gives its resource back on destruction, with its device's primary context
// current; errors are CudaError naming the call, the CUresult and the sizes involved. A mapping
// must be destroyed before the allocation and the reservation it joins (declare it after them).
#pragma once

#include <cstddef>
#include <vector>

#include "tensortier/cuda/cuda_driver.hpp"

namespace tensortier {

// The granularity (bytes) of physical allocations on the context's device that can be exported
// as POSIX file descriptors: their sizes, and the offsets they are mapped at, are multiples of it.
size_t DeviceAllocationGranularity(const PrimaryContext& context);

// Physical memory on the context's device, not yet mapped anywhere. Move-only.
class DeviceAllocation {
 public:
  // cuMemCreate of `bytes` (a multiple of DeviceAllocationGranularity) of pinned memory on the
  // context's device, exportable as a POSIX file descriptor.
  static DeviceAllocation Create(const PrimaryContext& context, size_t bytes);
  // cuMemImportFromShareableHandle of a descriptor another process exported (Export). `fd` stays
  // the caller's. `bytes` is the exporter's size (the handle does not carry it).
  static DeviceAllocation Import(const PrimaryContext& context, int fd, size_t bytes);

  DeviceAllocation(DeviceAllocation&& other) noexcept;
  DeviceAllocation& operator=(DeviceAllocation&& other) noexcept;
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  ~DeviceAllocation();

  // cuMemExportToShareableHandle: a new descriptor that the caller owns (and must close).
  int Export() const;
  cuda::CUmemGenericAllocationHandle handle() const noexcept { return handle_; }
  size_t size() const noexcept { return bytes_; }

 private:
  explicit DeviceAllocation(const PrimaryContext& context) : context_(context) {}
  PrimaryContext context_;
  cuda::CUmemGenericAllocationHandle handle_ = 0;
  size_t bytes_ = 0;
};

// A range of device virtual addresses, reserved and mapped to nothing. Move-only.
class DeviceAddressRange {
 public:
  // cuMemAddressReserve of `bytes` aligned to `alignment` (0: the driver's choice).
  DeviceAddressRange(const PrimaryContext& context, size_t bytes, size_t alignment);
  DeviceAddressRange(DeviceAddressRange&& other) noexcept;
  DeviceAddressRange& operator=(DeviceAddressRange&&) = delete;
  DeviceAddressRange(const DeviceAddressRange&) = delete;
  DeviceAddressRange& operator=(const DeviceAddressRange&) = delete;
  ~DeviceAddressRange();

  cuda::CUdeviceptr address() const noexcept { return address_; }
  size_t size() const noexcept { return bytes_; }

 private:
  PrimaryContext context_;
  cuda::CUdeviceptr address_ = 0;
  size_t bytes_ = 0;
};

// All of `allocation` mapped at `address` (inside a reserved range, granularity-aligned) and
// made readable and writable by every device in `devices` (cuMemMap, then cuMemSetAccess; the
// map is undone when the access call fails). Move-only; cuMemUnmap on destruction.
class DeviceMapping {
 public:
  DeviceMapping(const PrimaryContext& context, cuda::CUdeviceptr address,
                const DeviceAllocation& allocation, const std::vector<int>& devices);
  DeviceMapping(DeviceMapping&& other) noexcept;
  DeviceMapping& operator=(DeviceMapping&&) = delete;
  DeviceMapping(const DeviceMapping&) = delete;
  DeviceMapping& operator=(const DeviceMapping&) = delete;
  ~DeviceMapping();

  cuda::CUdeviceptr address() const noexcept { return address_; }
  size_t size() const noexcept { return bytes_; }

 private:
  PrimaryContext context_;
  cuda::CUdeviceptr address_ = 0;
  size_t bytes_ = 0;
};

}  // namespace tensortier
