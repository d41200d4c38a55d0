#include "tensortier/cuda/cuda_vmm.hpp"

#include <cstdint>
#include <utility>

#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

cuda::CUmemAllocationProp ShareableDeviceMemory(int device) {
  cuda::CUmemAllocationProp prop;
  prop.type = cuda::kMemAllocationTypePinned;
  prop.requested_handle_types = cuda::kMemHandleTypePosixFileDescriptor;
  prop.location.type = cuda::kMemLocationTypeDevice;
  prop.location.id = device;
  return prop;
}

[[noreturn]] void Fail(const CudaDriver& driver, cuda::CUresult r, const char* call,
                       const std::string& what) {
  throw CudaError(r, call, StrCat(driver.ErrorText(r), " (", what, ")"));
}

// Gives a resource back from a destructor: its errors cannot be acted upon there.
template <typename Body>
void Release(const PrimaryContext& context, Body body) noexcept {
  const CudaApi& api = context.driver().api();
  const bool pushed = api.CtxPushCurrent(context.get()) == cuda::kSuccess;
  body(api);
  cuda::CUcontext popped = nullptr;
  if (pushed) api.CtxPopCurrent(&popped);
}

}  // namespace

size_t DeviceAllocationGranularity(const PrimaryContext& context) {
  const CudaDriver& driver = context.driver();
  ScopedContext current(context);
  const cuda::CUmemAllocationProp prop = ShareableDeviceMemory(context.device());
  size_t granularity = 0;
  const cuda::CUresult r = driver.api().MemGetAllocationGranularity(
      &granularity, &prop, cuda::kMemAllocGranularityMinimum);
  if (r != cuda::kSuccess) {
    Fail(driver, r, "cuMemGetAllocationGranularity", StrCat("device ", context.device()));
  }
  if (granularity == 0) {
    throw CudaError(cuda::kErrorInvalidValue, "cuMemGetAllocationGranularity",
                    StrCat("the driver answered 0 bytes for device ", context.device()));
  }
  return granularity;
}

// ---- DeviceAllocation

DeviceAllocation DeviceAllocation::Create(const PrimaryContext& context, size_t bytes) {
  DeviceAllocation a(context);
  const CudaDriver& driver = context.driver();
  ScopedContext current(context);
  const cuda::CUmemAllocationProp prop = ShareableDeviceMemory(context.device());
  const cuda::CUresult r = driver.api().MemCreate(&a.handle_, bytes, &prop, 0);
  if (r != cuda::kSuccess) {
    a.handle_ = 0;
    Fail(driver, r, "cuMemCreate", StrCat(bytes, " bytes on device ", context.device()));
  }
  a.bytes_ = bytes;
  return a;
}

DeviceAllocation DeviceAllocation::Import(const PrimaryContext& context, int fd, size_t bytes) {
  DeviceAllocation a(context);
  const CudaDriver& driver = context.driver();
  ScopedContext current(context);
  void* os_handle = reinterpret_cast<void*>(static_cast<intptr_t>(fd));
  const cuda::CUresult r = driver.api().MemImportFromShareableHandle(
      &a.handle_, os_handle, cuda::kMemHandleTypePosixFileDescriptor);
  if (r != cuda::kSuccess) {
    a.handle_ = 0;
    Fail(driver, r, "cuMemImportFromShareableHandle",
         StrCat("descriptor ", fd, ", ", bytes, " bytes"));
  }
  a.bytes_ = bytes;
  return a;
}

DeviceAllocation::DeviceAllocation(DeviceAllocation&& other) noexcept
    : context_(other.context_),
      handle_(std::exchange(other.handle_, 0)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& other) noexcept {
  if (this != &other) {
    DeviceAllocation old(std::move(*this));
    context_ = other.context_;
    handle_ = std::exchange(other.handle_, 0);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceAllocation::~DeviceAllocation() {
  if (handle_ == 0) return;
  Release(context_, [&](const CudaApi& api) { api.MemRelease(handle_); });
}

int DeviceAllocation::Export() const {
  const CudaDriver& driver = context_.driver();
  ScopedContext current(context_);
  int fd = -1;
  const cuda::CUresult r = driver.api().MemExportToShareableHandle(
      &fd, handle_, cuda::kMemHandleTypePosixFileDescriptor, 0);
  if (r != cuda::kSuccess) {
    Fail(driver, r, "cuMemExportToShareableHandle",
         StrCat(bytes_, " bytes on device ", context_.device()));
  }
  return fd;
}

// ---- DeviceAddressRange

DeviceAddressRange::DeviceAddressRange(const PrimaryContext& context, size_t bytes,
                                       size_t alignment)
    : context_(context) {
  const CudaDriver& driver = context.driver();
  ScopedContext current(context);
  const cuda::CUresult r = driver.api().MemAddressReserve(&address_, bytes, alignment, 0, 0);
  if (r != cuda::kSuccess) {
    address_ = 0;
    Fail(driver, r, "cuMemAddressReserve", StrCat(bytes, " bytes, alignment ", alignment));
  }
  bytes_ = bytes;
}

DeviceAddressRange::DeviceAddressRange(DeviceAddressRange&& other) noexcept
    : context_(other.context_),
      address_(std::exchange(other.address_, 0)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DeviceAddressRange::~DeviceAddressRange() {
  if (address_ == 0) return;
  Release(context_, [&](const CudaApi& api) { api.MemAddressFree(address_, bytes_); });
}

// ---- DeviceMapping

DeviceMapping::DeviceMapping(const PrimaryContext& context, cuda::CUdeviceptr address,
                             const DeviceAllocation& allocation, const std::vector<int>& devices)
    : context_(context) {
  const CudaDriver& driver = context.driver();
  const CudaApi& api = driver.api("cuMemMap");
  ScopedContext current(context);
  const size_t bytes = allocation.size();
  const std::string where = StrCat(bytes, " bytes at device address 0x", std::hex, address);
  if (cuda::CUresult r = api.MemMap(address, bytes, 0, allocation.handle(), 0);
      r != cuda::kSuccess) {
    Fail(driver, r, "cuMemMap", where);
  }
  std::vector<cuda::CUmemAccessDesc> access(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    access[i].location.type = cuda::kMemLocationTypeDevice;
    access[i].location.id = devices[i];
    access[i].flags = cuda::kMemAccessFlagsReadWrite;
  }
  if (cuda::CUresult r = api.MemSetAccess(address, bytes, access.data(), access.size());
      r != cuda::kSuccess) {
    api.MemUnmap(address, bytes);
    Fail(driver, r, "cuMemSetAccess", StrCat(where, ", ", devices.size(), " devices"));
  }
  address_ = address;
  bytes_ = bytes;
}

DeviceMapping::DeviceMapping(DeviceMapping&& other) noexcept
    : context_(other.context_),
      address_(std::exchange(other.address_, 0)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DeviceMapping::~DeviceMapping() {
  if (address_ == 0) return;
  Release(context_, [&](const CudaApi& api) { api.MemUnmap(address_, bytes_); });
}

}  // namespace tensortier
