#include "tensortier/cuda/cuda_driver.hpp"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cstddef>
#include <cstdlib>
#include <utility>

#include "tensortier/cuda/dl.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// Names of the codes worth explaining when the driver's own cuGetErrorName cannot be asked.
const char* FallbackErrorName(cuda::CUresult result) {
  switch (result) {
    case 0:
      return "CUDA_SUCCESS";
    case 1:
      return "CUDA_ERROR_INVALID_VALUE";
    case 2:
      return "CUDA_ERROR_OUT_OF_MEMORY";
    case 3:
      return "CUDA_ERROR_NOT_INITIALIZED";
    case 4:
      return "CUDA_ERROR_DEINITIALIZED";
    case 34:  // cuInit of the CUDA toolkit's stub libcuda.so (no real driver behind it)
      return "CUDA_ERROR_STUB_LIBRARY";
    case 46:
      return "CUDA_ERROR_DEVICE_UNAVAILABLE";
    case 100:
      return "CUDA_ERROR_NO_DEVICE";
    case 101:
      return "CUDA_ERROR_INVALID_DEVICE";
    case 201:
      return "CUDA_ERROR_INVALID_CONTEXT";
    case 304:
      return "CUDA_ERROR_OPERATING_SYSTEM";
    case 400:
      return "CUDA_ERROR_INVALID_HANDLE";
    case 600:
      return "CUDA_ERROR_NOT_READY";
    case 700:
      return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case 712:
      return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
    case 713:
      return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
    case 800:
      return "CUDA_ERROR_NOT_PERMITTED";
    case 801:
      return "CUDA_ERROR_NOT_SUPPORTED";
    case 803:
      return "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH";
    case 999:
      return "CUDA_ERROR_UNKNOWN";
    default:
      return nullptr;
  }
}

std::string UnavailableDetail(const CudaDriver& driver) {
  return StrCat("CUDA driver unavailable: ", driver.why_unavailable());
}

// Pushes `context` when possible, for destructors (which cannot throw); pops on destruction.
class TryContext {
 public:
  explicit TryContext(const PrimaryContext& context) : api_(context.driver().api()) {
    pushed_ = api_.CtxPushCurrent(context.get()) == cuda::kSuccess;
  }
  ~TryContext() {
    cuda::CUcontext popped = nullptr;
    if (pushed_) api_.CtxPopCurrent(&popped);
  }
  TryContext(const TryContext&) = delete;
  TryContext& operator=(const TryContext&) = delete;

 private:
  const CudaApi& api_;
  bool pushed_ = false;
};

}  // namespace

CudaError::CudaError(cuda::CUresult code, std::string call, const std::string& detail)
    : std::runtime_error(StrCat(call, " failed: ", detail)), code_(code), call_(std::move(call)) {}

std::string_view MemoryTypeName(MemoryType type) {
  return NameOf(kMemoryTypeNames, type, "unknown");
}

// ---------------------------------------------------------------------------------------------
// CudaDriver

const CudaDriver& CudaDriver::Get() noexcept {
  static const CudaDriver* const driver = Load(DefaultLibrary()).release();  // leaked on purpose
  return *driver;
}

std::string CudaDriver::DefaultLibrary() {
  return WordSetting(SettingFor("TENSORTIER_CUDA_LIBRARY"));
}

std::unique_ptr<CudaDriver> CudaDriver::Load(const std::string& library) noexcept {
  std::unique_ptr<CudaDriver> driver(new CudaDriver(library));
  driver->Open();
  return driver;
}

CudaDriver::~CudaDriver() = default;  // the library stays loaded: see DlOpen

void CudaDriver::Open() {
  handle_ = detail::DlOpen(library_, &why_);
  if (handle_ == nullptr) return;
  const bool resolved =
      detail::DlSym(handle_, library_, "cuInit", api_.Init, &why_) &&
      detail::DlSym(handle_, library_, "cuDriverGetVersion", api_.DriverGetVersion, &why_) &&
      detail::DlSym(handle_, library_, "cuGetErrorName", api_.GetErrorName, &why_) &&
      detail::DlSym(handle_, library_, "cuGetErrorString", api_.GetErrorString, &why_) &&
      detail::DlSym(handle_, library_, "cuDeviceGetCount", api_.DeviceGetCount, &why_) &&
      detail::DlSym(handle_, library_, "cuDeviceGet", api_.DeviceGet, &why_) &&
      detail::DlSym(handle_, library_, "cuDevicePrimaryCtxRetain", api_.DevicePrimaryCtxRetain,
                    &why_) &&
      detail::DlSym(handle_, library_, "cuDevicePrimaryCtxRelease_v2", api_.DevicePrimaryCtxRelease,
                    &why_) &&
      detail::DlSym(handle_, library_, "cuCtxPushCurrent_v2", api_.CtxPushCurrent, &why_) &&
      detail::DlSym(handle_, library_, "cuCtxPopCurrent_v2", api_.CtxPopCurrent, &why_) &&
      detail::DlSym(handle_, library_, "cuPointerGetAttributes", api_.PointerGetAttributes,
                    &why_) &&
      detail::DlSym(handle_, library_, "cuStreamCreate", api_.StreamCreate, &why_) &&
      detail::DlSym(handle_, library_, "cuStreamDestroy_v2", api_.StreamDestroy, &why_) &&
      detail::DlSym(handle_, library_, "cuStreamSynchronize", api_.StreamSynchronize, &why_) &&
      detail::DlSym(handle_, library_, "cuEventCreate", api_.EventCreate, &why_) &&
      detail::DlSym(handle_, library_, "cuEventDestroy_v2", api_.EventDestroy, &why_) &&
      detail::DlSym(handle_, library_, "cuEventRecord", api_.EventRecord, &why_) &&
      detail::DlSym(handle_, library_, "cuEventQuery", api_.EventQuery, &why_) &&
      detail::DlSym(handle_, library_, "cuEventSynchronize", api_.EventSynchronize, &why_) &&
      detail::DlSym(handle_, library_, "cuMemcpyHtoDAsync_v2", api_.MemcpyHtoDAsync, &why_) &&
      detail::DlSym(handle_, library_, "cuMemcpyDtoHAsync_v2", api_.MemcpyDtoHAsync, &why_) &&
      detail::DlSym(handle_, library_, "cuMemHostRegister_v2", api_.MemHostRegister, &why_) &&
      detail::DlSym(handle_, library_, "cuMemHostUnregister", api_.MemHostUnregister, &why_) &&
      detail::DlSym(handle_, library_, "cuMemAllocHost_v2", api_.MemAllocHost, &why_) &&
      detail::DlSym(handle_, library_, "cuMemFreeHost", api_.MemFreeHost, &why_) &&
      detail::DlSym(handle_, library_, "cuMemAlloc_v2", api_.MemAlloc, &why_) &&
      detail::DlSym(handle_, library_, "cuMemFree_v2", api_.MemFree, &why_) &&
      detail::DlSym(handle_, library_, "cuMemGetAllocationGranularity",
                    api_.MemGetAllocationGranularity, &why_) &&
      detail::DlSym(handle_, library_, "cuMemCreate", api_.MemCreate, &why_) &&
      detail::DlSym(handle_, library_, "cuMemRelease", api_.MemRelease, &why_) &&
      detail::DlSym(handle_, library_, "cuMemExportToShareableHandle",
                    api_.MemExportToShareableHandle, &why_) &&
      detail::DlSym(handle_, library_, "cuMemImportFromShareableHandle",
                    api_.MemImportFromShareableHandle, &why_) &&
      detail::DlSym(handle_, library_, "cuMemAddressReserve", api_.MemAddressReserve, &why_) &&
      detail::DlSym(handle_, library_, "cuMemAddressFree", api_.MemAddressFree, &why_) &&
      detail::DlSym(handle_, library_, "cuMemMap", api_.MemMap, &why_) &&
      detail::DlSym(handle_, library_, "cuMemUnmap", api_.MemUnmap, &why_) &&
      detail::DlSym(handle_, library_, "cuMemSetAccess", api_.MemSetAccess, &why_);
  if (!resolved) return;

  if (cuda::CUresult r = api_.Init(0); r != cuda::kSuccess) {
    why_ = StrCat("cuInit failed: ", ErrorText(r));
    return;
  }
  if (cuda::CUresult r = api_.DriverGetVersion(&version_); r != cuda::kSuccess) {
    why_ = StrCat("cuDriverGetVersion failed: ", ErrorText(r));
    return;
  }
  if (cuda::CUresult r = api_.DeviceGetCount(&device_count_); r != cuda::kSuccess) {
    why_ = StrCat("cuDeviceGetCount failed: ", ErrorText(r));
    device_count_ = 0;
    return;
  }
  if (device_count_ <= 0) {
    why_ = "no CUDA device is visible (cuDeviceGetCount returned 0)";
    device_count_ = 0;
    return;
  }
  available_ = true;
}

const CudaApi& CudaDriver::api(std::string_view call) const {
  if (!available_) throw CudaError(cuda::kUnavailable, std::string(call), UnavailableDetail(*this));
  return api_;
}

void CudaDriver::Check(cuda::CUresult result, std::string_view call) const {
  if (result != cuda::kSuccess) throw CudaError(result, std::string(call), ErrorText(result));
}

std::string CudaDriver::ErrorText(cuda::CUresult result) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api_.GetErrorName == nullptr || api_.GetErrorName(result, &name) != cuda::kSuccess) {
    name = nullptr;
  }
  if (api_.GetErrorString == nullptr || api_.GetErrorString(result, &text) != cuda::kSuccess) {
    text = nullptr;
  }
  if (name == nullptr) name = FallbackErrorName(result);
  std::string out =
      name != nullptr ? StrCat(name, " (", result, ")") : StrCat("CUDA error ", result);
  if (text != nullptr) out += StrCat(": ", text);
  return out;
}

PointerLocation CudaDriver::Locate(const void* p) const {
  PointerLocation where;
  if (!available_ || p == nullptr) return where;
  // cuPointerGetAttributes (unlike the singular call) answers success with zeroed values for
  // memory CUDA does not know; older drivers may answer INVALID_VALUE or INVALID_CONTEXT instead
  // (a pointer no UVA context knows): either way, ordinary host memory.
  unsigned memory_type = 0;
  unsigned is_managed = 0;
  int ordinal = -1;
  int attributes[] = {cuda::kPointerAttributeMemoryType, cuda::kPointerAttributeIsManaged,
                      cuda::kPointerAttributeDeviceOrdinal};
  void* data[] = {&memory_type, &is_managed, &ordinal};
  const auto address = reinterpret_cast<cuda::CUdeviceptr>(p);
  cuda::CUresult r = api_.PointerGetAttributes(3, attributes, data, address);
  if (r == cuda::kErrorInvalidContext && device_count_ > 0) {
    // Some drivers need a current context to answer even for device memory: ask again with
    // device 0's primary context current (retained for the call) before concluding host memory.
    PrimaryContext context(*this, 0);
    ScopedContext current(context);
    memory_type = 0;
    is_managed = 0;
    ordinal = -1;
    r = api_.PointerGetAttributes(3, attributes, data, address);
  }
  if (r == cuda::kErrorInvalidValue || r == cuda::kErrorInvalidContext) return where;
  Check(r, "cuPointerGetAttributes");
  if (is_managed != 0 || memory_type == cuda::kMemoryTypeUnified) {
    where.type = MemoryType::kManaged;
    where.device = ordinal;
  } else if (memory_type == cuda::kMemoryTypeDevice || memory_type == cuda::kMemoryTypeArray) {
    where.type = MemoryType::kDevice;
    where.device = ordinal;
  } else if (memory_type == cuda::kMemoryTypeHost) {
    where.type = MemoryType::kRegisteredHost;
  }
  return where;
}

bool CudaDriver::IsPinnedHost(const void* p, size_t bytes) const {
  if (!available_ || p == nullptr) return false;
  const auto* first = static_cast<const std::byte*>(p);
  if (Locate(first).type != MemoryType::kRegisteredHost) return false;
  return bytes <= 1 || Locate(first + (bytes - 1)).type == MemoryType::kRegisteredHost;
}

// ---------------------------------------------------------------------------------------------
// PrimaryContext, ScopedContext

struct PrimaryContext::State {
  const CudaDriver* driver;
  int device;
  cuda::CUdevice handle = 0;
  cuda::CUcontext context = nullptr;

  State(const CudaDriver& d, int ordinal) : driver(&d), device(ordinal) {
    const CudaApi& api = d.api("cuDevicePrimaryCtxRetain");
    d.Check(api.DeviceGet(&handle, ordinal), StrCat("cuDeviceGet(", ordinal, ")"));
    d.Check(api.DevicePrimaryCtxRetain(&context, handle),
            StrCat("cuDevicePrimaryCtxRetain(device ", ordinal, ")"));
  }
  ~State() { driver->api().DevicePrimaryCtxRelease(handle); }
  State(const State&) = delete;
  State& operator=(const State&) = delete;
};

PrimaryContext::PrimaryContext(const CudaDriver& driver, int device)
    : state_(std::make_shared<State>(driver, device)) {}

const CudaDriver& PrimaryContext::driver() const noexcept {
  return *state_->driver;
}
int PrimaryContext::device() const noexcept {
  return state_->device;
}
cuda::CUcontext PrimaryContext::get() const noexcept {
  return state_->context;
}

ScopedContext::ScopedContext(const PrimaryContext& context)
    : api_(context.driver().api("cuCtxPushCurrent")) {
  context.driver().Check(api_.CtxPushCurrent(context.get()), "cuCtxPushCurrent");
}

ScopedContext::~ScopedContext() {
  cuda::CUcontext popped = nullptr;
  api_.CtxPopCurrent(&popped);
}

// ---------------------------------------------------------------------------------------------
// Copies, streams, events

void CopyToDeviceAsync(const PrimaryContext& context, cuda::CUdeviceptr dst, const void* src,
                       size_t bytes, cuda::CUstream stream) {
  const CudaDriver& driver = context.driver();
  ScopedContext current(context);
  const cuda::CUresult r = driver.api().MemcpyHtoDAsync(dst, src, bytes, stream);
  if (r != cuda::kSuccess) {
    throw CudaError(r, "cuMemcpyHtoDAsync",
                    StrCat(driver.ErrorText(r), " (", bytes, " bytes to device address 0x",
                           std::hex, dst, " from ", src, ")"));
  }
}

void CopyFromDeviceAsync(const PrimaryContext& context, void* dst, cuda::CUdeviceptr src,
                         size_t bytes, cuda::CUstream stream) {
  const CudaDriver& driver = context.driver();
  ScopedContext current(context);
  const cuda::CUresult r = driver.api().MemcpyDtoHAsync(dst, src, bytes, stream);
  if (r != cuda::kSuccess) {
    throw CudaError(r, "cuMemcpyDtoHAsync",
                    StrCat(driver.ErrorText(r), " (", bytes, " bytes from device address 0x",
                           std::hex, src, " to ", dst, ")"));
  }
}

template <typename Handle, auto Free>
void detail::ContextResource<Handle, Free>::Reset() noexcept {
  if (handle_ == Handle{}) return;
  TryContext current(context_);
  (context_.driver().api().*Free)(handle_);
  handle_ = Handle{};
  bytes_ = 0;
}

template class detail::ContextResource<cuda::CUstream, &CudaApi::StreamDestroy>;
template class detail::ContextResource<cuda::CUevent, &CudaApi::EventDestroy>;
template class detail::ContextResource<void*, &CudaApi::MemHostUnregister>;
template class detail::ContextResource<void*, &CudaApi::MemFreeHost>;
template class detail::ContextResource<cuda::CUdeviceptr, &CudaApi::MemFree>;

Stream::Stream(const PrimaryContext& context, unsigned flags) : ContextResource(context) {
  ScopedContext current(context_);
  context_.driver().Check(context_.driver().api().StreamCreate(&handle_, flags), "cuStreamCreate");
}

void Stream::Synchronize() const {
  ScopedContext current(context_);
  context_.driver().Check(context_.driver().api().StreamSynchronize(handle_),
                          "cuStreamSynchronize");
}

Event::Event(const PrimaryContext& context, unsigned flags) : ContextResource(context) {
  ScopedContext current(context_);
  context_.driver().Check(context_.driver().api().EventCreate(&handle_, flags), "cuEventCreate");
}

void Event::Record(cuda::CUstream stream) const {
  ScopedContext current(context_);
  context_.driver().Check(context_.driver().api().EventRecord(handle_, stream), "cuEventRecord");
}

bool Event::Query() const {
  ScopedContext current(context_);
  const cuda::CUresult r = context_.driver().api().EventQuery(handle_);
  if (r == cuda::kErrorNotReady) return false;
  context_.driver().Check(r, "cuEventQuery");
  return true;
}

void Event::Synchronize() const {
  ScopedContext current(context_);
  context_.driver().Check(context_.driver().api().EventSynchronize(handle_), "cuEventSynchronize");
}

// ---------------------------------------------------------------------------------------------
// Host registrations and allocations

HostRegistration::HostRegistration(const PrimaryContext& context, void* p, size_t bytes,
                                   unsigned flags)
    : ContextResource(context) {
  if (bytes == 0) return;
  ScopedContext current(context_);
  const CudaDriver& driver = context_.driver();
  const cuda::CUresult r = driver.api().MemHostRegister(p, bytes, flags);
  if (r != cuda::kSuccess) {
    throw CudaError(r, "cuMemHostRegister",
                    StrCat(driver.ErrorText(r), " (", bytes, " bytes at ", p, ")"));
  }
  handle_ = p;
  bytes_ = bytes;
}

PinnedHostMemory::PinnedHostMemory(const PrimaryContext& context, size_t bytes)
    : ContextResource(context) {
  if (bytes == 0) return;
  ScopedContext current(context_);
  const CudaDriver& driver = context_.driver();
  const cuda::CUresult r = driver.api().MemAllocHost(&handle_, bytes);
  if (r != cuda::kSuccess) {
    handle_ = nullptr;
    throw CudaError(r, "cuMemAllocHost", StrCat(driver.ErrorText(r), " (", bytes, " bytes)"));
  }
  bytes_ = bytes;
}

DeviceMemory::DeviceMemory(const PrimaryContext& context, size_t bytes) : ContextResource(context) {
  if (bytes == 0) return;
  ScopedContext current(context_);
  const CudaDriver& driver = context_.driver();
  const cuda::CUresult r = driver.api().MemAlloc(&handle_, bytes);
  if (r != cuda::kSuccess) {
    handle_ = 0;
    throw CudaError(
        r, "cuMemAlloc",
        StrCat(driver.ErrorText(r), " (", bytes, " bytes on device ", context_.device(), ")"));
  }
  bytes_ = bytes;
}

}  // namespace tensortier
