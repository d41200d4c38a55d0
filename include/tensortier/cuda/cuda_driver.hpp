// The CUDA driver API, opened with dlopen("libcuda.so.1") at run time: one build runs on machines
// with and without GPUs, and nothing here needs the CUDA headers or libraries to compile.
//
// CudaDriver::Get() loads the driver once per process and never throws: available() says whether
// it works, why_unavailable() says why not. Everything that needs the driver (contexts, streams,
// events, registrations, allocations) throws CudaError, naming the failing call and the CUresult,
// when the driver is unavailable or a call fails. Errors in destructors are ignored (nothing can be
// done about them there).
//
// Contexts: each object below holds the device's primary context (retained, as the runtime API and
// PyTorch use it) and makes it current around its own driver calls, so callers never have to.
//
// Thread-safety: CudaDriver is immutable after loading (thread-safe). The RAII objects are
// thread-compatible: one thread at a time per object.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "tensortier/util/enum_names.hpp"

namespace tensortier {

// Our own declarations of the driver API's ABI (cuda.h is not needed to build). Type names follow
// cuda.h; they live in this namespace so that a file including cuda.h as well sees no clash.
namespace cuda {
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = uint64_t;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;

// CUresult values (cuda.h: cudaError_enum).
inline constexpr CUresult kSuccess = 0;
inline constexpr CUresult kErrorInvalidValue = 1;
inline constexpr CUresult kErrorOutOfMemory = 2;
inline constexpr CUresult kErrorNotInitialized = 3;
inline constexpr CUresult kErrorDeinitialized = 4;
inline constexpr CUresult kErrorNoDevice = 100;
inline constexpr CUresult kErrorInvalidDevice = 101;
inline constexpr CUresult kErrorInvalidContext = 201;
inline constexpr CUresult kErrorOperatingSystem = 304;
inline constexpr CUresult kErrorNotReady = 600;
inline constexpr CUresult kErrorHostMemoryAlreadyRegistered = 712;
inline constexpr CUresult kErrorHostMemoryNotRegistered = 713;
inline constexpr CUresult kErrorNotSupported = 801;
// Not a CUDA value: the driver library could not be loaded or initialised.
inline constexpr CUresult kUnavailable = -1;

// CUpointer_attribute.
inline constexpr int kPointerAttributeMemoryType = 2;
inline constexpr int kPointerAttributeIsManaged = 8;
inline constexpr int kPointerAttributeDeviceOrdinal = 9;
// CUmemorytype.
inline constexpr unsigned kMemoryTypeHost = 1;
inline constexpr unsigned kMemoryTypeDevice = 2;
inline constexpr unsigned kMemoryTypeArray = 3;
inline constexpr unsigned kMemoryTypeUnified = 4;
// Flags.
inline constexpr unsigned kMemHostRegisterPortable = 1;  // CU_MEMHOSTREGISTER_PORTABLE
inline constexpr unsigned kEventBlockingSync = 1;        // CU_EVENT_BLOCKING_SYNC
inline constexpr unsigned kEventDisableTiming = 2;       // CU_EVENT_DISABLE_TIMING
inline constexpr unsigned kStreamNonBlocking = 1;        // CU_STREAM_NON_BLOCKING

// Virtual memory management (cuMemCreate & co; cuda.h's layouts, checked by static_asserts).
using CUmemGenericAllocationHandle = unsigned long long;
inline constexpr int kMemAllocationTypePinned = 1;  // CU_MEM_ALLOCATION_TYPE_PINNED
inline constexpr int kMemHandleTypePosixFileDescriptor =
    1;                                                 // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
inline constexpr int kMemLocationTypeDevice = 1;       // CU_MEM_LOCATION_TYPE_DEVICE
inline constexpr int kMemAccessFlagsReadWrite = 3;     // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
inline constexpr int kMemAllocGranularityMinimum = 0;  // CU_MEM_ALLOC_GRANULARITY_MINIMUM
inline constexpr int kMemAllocGranularityRecommended = 1;  // CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
struct CUmemLocation {
  int type = 0;
  int id = 0;
};
struct CUmemAllocationProp {
  int type = 0;
  int requested_handle_types = 0;
  CUmemLocation location;
  void* win32_handle_meta_data = nullptr;
  struct {
    unsigned char compression_type = 0;
    unsigned char gpu_direct_rdma_capable = 0;
    unsigned short usage = 0;
    unsigned char reserved[4] = {};
  } alloc_flags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags = 0;
};
static_assert(sizeof(CUmemLocation) == 8 && sizeof(CUmemAccessDesc) == 12);
static_assert(sizeof(CUmemAllocationProp) == 32);
}  // namespace cuda

// The entry points we use, resolved by their exported names (the `_v2` ones where cuda.h maps a
// name to `_v2`, noted per member). Null only while the driver is unavailable.
struct CudaApi {
  using CUresult = cuda::CUresult;
  CUresult (*Init)(unsigned flags) = nullptr;
  CUresult (*DriverGetVersion)(int* version) = nullptr;
  CUresult (*GetErrorName)(CUresult error, const char** name) = nullptr;
  CUresult (*GetErrorString)(CUresult error, const char** text) = nullptr;
  CUresult (*DeviceGetCount)(int* count) = nullptr;
  CUresult (*DeviceGet)(cuda::CUdevice* device, int ordinal) = nullptr;
  CUresult (*DevicePrimaryCtxRetain)(cuda::CUcontext* context, cuda::CUdevice device) = nullptr;
  CUresult (*DevicePrimaryCtxRelease)(cuda::CUdevice device) = nullptr;  // _v2
  CUresult (*CtxPushCurrent)(cuda::CUcontext context) = nullptr;         // _v2
  CUresult (*CtxPopCurrent)(cuda::CUcontext* context) = nullptr;         // _v2
  CUresult (*PointerGetAttributes)(unsigned count, int* attributes, void** data,
                                   cuda::CUdeviceptr pointer) = nullptr;
  CUresult (*StreamCreate)(cuda::CUstream* stream, unsigned flags) = nullptr;
  CUresult (*StreamDestroy)(cuda::CUstream stream) = nullptr;  // _v2
  CUresult (*StreamSynchronize)(cuda::CUstream stream) = nullptr;
  CUresult (*EventCreate)(cuda::CUevent* event, unsigned flags) = nullptr;
  CUresult (*EventDestroy)(cuda::CUevent event) = nullptr;  // _v2
  CUresult (*EventRecord)(cuda::CUevent event, cuda::CUstream stream) = nullptr;
  CUresult (*EventQuery)(cuda::CUevent event) = nullptr;
  CUresult (*EventSynchronize)(cuda::CUevent event) = nullptr;
  CUresult (*MemcpyHtoDAsync)(cuda::CUdeviceptr dst, const void* src, size_t bytes,
                              cuda::CUstream stream) = nullptr;  // _v2
  CUresult (*MemcpyDtoHAsync)(void* dst, cuda::CUdeviceptr src, size_t bytes,
                              cuda::CUstream stream) = nullptr;                  // _v2
  CUresult (*MemHostRegister)(void* p, size_t bytes, unsigned flags) = nullptr;  // _v2
  CUresult (*MemHostUnregister)(void* p) = nullptr;
  CUresult (*MemAllocHost)(void** p, size_t bytes) = nullptr;  // _v2
  CUresult (*MemFreeHost)(void* p) = nullptr;
  CUresult (*MemAlloc)(cuda::CUdeviceptr* p, size_t bytes) = nullptr;  // _v2
  CUresult (*MemFree)(cuda::CUdeviceptr p) = nullptr;                  // _v2
  // Virtual memory management (CUDA 10.2+).
  CUresult (*MemGetAllocationGranularity)(size_t* granularity,
                                          const cuda::CUmemAllocationProp* prop,
                                          int option) = nullptr;
  CUresult (*MemCreate)(cuda::CUmemGenericAllocationHandle* handle, size_t bytes,
                        const cuda::CUmemAllocationProp* prop, unsigned long long flags) = nullptr;
  CUresult (*MemRelease)(cuda::CUmemGenericAllocationHandle handle) = nullptr;
  CUresult (*MemExportToShareableHandle)(void* shareable, cuda::CUmemGenericAllocationHandle handle,
                                         int handle_type, unsigned long long flags) = nullptr;
  CUresult (*MemImportFromShareableHandle)(cuda::CUmemGenericAllocationHandle* handle,
                                           void* os_handle, int handle_type) = nullptr;
  CUresult (*MemAddressReserve)(cuda::CUdeviceptr* address, size_t bytes, size_t alignment,
                                cuda::CUdeviceptr hint, unsigned long long flags) = nullptr;
  CUresult (*MemAddressFree)(cuda::CUdeviceptr address, size_t bytes) = nullptr;
  CUresult (*MemMap)(cuda::CUdeviceptr address, size_t bytes, size_t offset,
                     cuda::CUmemGenericAllocationHandle handle, unsigned long long flags) = nullptr;
  CUresult (*MemUnmap)(cuda::CUdeviceptr address, size_t bytes) = nullptr;
  CUresult (*MemSetAccess)(cuda::CUdeviceptr address, size_t bytes,
                           const cuda::CUmemAccessDesc* desc, size_t count) = nullptr;
};

// A failed driver call. what(): "<call> failed: CUDA_ERROR_X (code): <driver's description>", or
// "<call> failed: CUDA driver unavailable: <reason>" with code() == cuda::kUnavailable.
class CudaError : public std::runtime_error {
 public:
  CudaError(cuda::CUresult code, std::string call, const std::string& detail);
  cuda::CUresult code() const noexcept { return code_; }
  const std::string& call() const noexcept { return call_; }

 private:
  cuda::CUresult code_;
  std::string call_;
};

// Where a pointer's memory lives, as the driver sees it.
enum class MemoryType {
  kHost,            // ordinary (pageable) host memory, or no driver to ask
  kRegisteredHost,  // page-locked host memory known to CUDA (cuMemHostRegister, cuMemAllocHost)
  kDevice,          // device memory of `device`
  kManaged,         // managed (unified) memory
};
inline constexpr EnumName<MemoryType> kMemoryTypeNames[] = {
    {MemoryType::kHost, "host"},
    {MemoryType::kRegisteredHost, "registered host"},
    {MemoryType::kDevice, "device"},
    {MemoryType::kManaged, "managed"},
};
std::string_view MemoryTypeName(MemoryType type);

struct PointerLocation {
  MemoryType type = MemoryType::kHost;
  int device = -1;  // ordinal for kDevice (and kManaged where the driver says), else -1
};

class CudaDriver {
 public:
  // The process-wide driver, loaded from DefaultLibrary() on first use. Never throws. Never
  // unloaded: CUDA must not be called after main() returns, so it is deliberately leaked.
  static const CudaDriver& Get() noexcept;
  // $TENSORTIER_CUDA_LIBRARY when set and not empty, else "libcuda.so.1".
  static std::string DefaultLibrary();
  // Loads `library` (a name for the dynamic loader's search, or a path), resolves the entry points
  // and calls cuInit(0). Never throws; the result says whether it worked. Tests call this with
  // bad paths; everything else uses Get().
  static std::unique_ptr<CudaDriver> Load(const std::string& library) noexcept;

  ~CudaDriver();
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  bool available() const noexcept { return available_; }
  // Empty when available; otherwise e.g. "libcuda.so.1 not found: <dlerror>",
  // "cuInit failed: CUDA_ERROR_NO_DEVICE (100): ...".
  const std::string& why_unavailable() const noexcept { return why_; }
  const std::string& library() const noexcept { return library_; }
  // cuDriverGetVersion (e.g. 12040 for 12.4); 0 when unavailable.
  int version() const noexcept { return version_; }
  // Visible devices; 0 when unavailable.
  int device_count() const noexcept { return device_count_; }

  // The entry points. Throws CudaError (naming `call`) when the driver is unavailable.
  const CudaApi& api(std::string_view call = "CUDA driver call") const;
  // Throws CudaError naming `call` unless `result` is success.
  void Check(cuda::CUresult result, std::string_view call) const;
  // "CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected"; works without a driver for
  // the common codes.
  std::string ErrorText(cuda::CUresult result) const;

  // Never kRegisteredHost/kDevice/kManaged without a driver. When the driver answers
  // CUDA_ERROR_INVALID_CONTEXT (no context current on this thread), asks once more with device 0's
  // primary context current before concluding host memory. Throws CudaError only when the driver
  // fails in an unexpected way.
  PointerLocation Locate(const void* p) const;
  // Whether [p, p + bytes) is page-locked host memory the driver knows, whoever pinned it
  // (cuMemHostRegister, cuMemAllocHost, cudaHostAlloc of any library): its first and its last
  // byte locate as kRegisteredHost (a range over two registrations with a gap between them would
  // pass; asking per page would cost a driver call per 4 KiB). A zero-byte range asks about p.
  // False without a driver. Throws as Locate does.
  bool IsPinnedHost(const void* p, size_t bytes) const;

 private:
  explicit CudaDriver(std::string library) : library_(std::move(library)) {}
  void Open();

  std::string library_;
  void* handle_ = nullptr;
  CudaApi api_;
  bool available_ = false;
  std::string why_;
  int version_ = 0;
  int device_count_ = 0;
};

// A device's primary context, retained for as long as any copy exists (copies share one
// retain). Throws CudaError when the driver is unavailable or the device is invalid.
class PrimaryContext {
 public:
  PrimaryContext(const CudaDriver& driver, int device);

  const CudaDriver& driver() const noexcept;
  int device() const noexcept;
  cuda::CUcontext get() const noexcept;

 private:
  struct State;
  std::shared_ptr<const State> state_;
};

// Makes `context` current on this thread for the object's lifetime (cuCtxPushCurrent /
// cuCtxPopCurrent). Throws CudaError when the push fails.
class ScopedContext {
 public:
  explicit ScopedContext(const PrimaryContext& context);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const CudaApi& api_;
};

// Asynchronous copies on `stream` (any stream of `context`). REQUIRES: the host memory stays
// valid until the copy completes (an event recorded after it, or the stream, says when).
void CopyToDeviceAsync(const PrimaryContext& context, cuda::CUdeviceptr dst, const void* src,
                       size_t bytes, cuda::CUstream stream);
void CopyFromDeviceAsync(const PrimaryContext& context, void* dst, cuda::CUdeviceptr src,
                         size_t bytes, cuda::CUstream stream);

namespace detail {

// What the driver objects below share: a handle made in `context`, given back with `Free` (a
// CudaApi member: cuStreamDestroy, cuMemFree...), with the context current, when the owner is
// destroyed or assigned to; moves hand the handle over. The handle of a zero-byte allocation or
// of a failed constructor is empty (Handle{}) and never freed.
template <typename Handle, auto Free>
class ContextResource {
 public:
  ContextResource(ContextResource&& other) noexcept
      : context_(other.context_),
        handle_(std::exchange(other.handle_, Handle{})),
        bytes_(std::exchange(other.bytes_, 0)) {}
  ContextResource& operator=(ContextResource&& other) noexcept {
    if (this != &other) {
      Reset();
      context_ = other.context_;
      handle_ = std::exchange(other.handle_, Handle{});
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ContextResource(const ContextResource&) = delete;
  ContextResource& operator=(const ContextResource&) = delete;

  const PrimaryContext& context() const noexcept { return context_; }

 protected:
  explicit ContextResource(const PrimaryContext& context) : context_(context) {}
  ~ContextResource() { Reset(); }
  void Reset() noexcept;  // defined, and instantiated for the types below, in cuda_driver.cpp

  PrimaryContext context_;
  Handle handle_{};
  size_t bytes_ = 0;
};

}  // namespace detail

// A stream of its own (non-blocking by default: it does not synchronise with the legacy default
// stream). Move-only.
class Stream : public detail::ContextResource<cuda::CUstream, &CudaApi::StreamDestroy> {
 public:
  explicit Stream(const PrimaryContext& context, unsigned flags = cuda::kStreamNonBlocking);

  cuda::CUstream get() const noexcept { return handle_; }
  void CopyToDevice(cuda::CUdeviceptr dst, const void* src, size_t bytes) const {
    CopyToDeviceAsync(context_, dst, src, bytes, handle_);
  }
  void CopyFromDevice(void* dst, cuda::CUdeviceptr src, size_t bytes) const {
    CopyFromDeviceAsync(context_, dst, src, bytes, handle_);
  }
  // Blocks until everything queued on the stream is done; throws its error.
  void Synchronize() const;
};

// Without timing by default (cheaper). Move-only.
class Event : public detail::ContextResource<cuda::CUevent, &CudaApi::EventDestroy> {
 public:
  explicit Event(const PrimaryContext& context, unsigned flags = cuda::kEventDisableTiming);

  cuda::CUevent get() const noexcept { return handle_; }
  // Captures the work queued on `stream` so far.
  void Record(cuda::CUstream stream) const;
  // Whether the captured work is done (true for a never-recorded event); throws its error.
  bool Query() const;
  // Blocks until the captured work is done; throws its error.
  void Synchronize() const;
};

// Page-locks existing host memory [p, p+bytes) for DMA by every context (portable by default).
// Move-only; unregisters on destruction. REQUIRES: the memory outlives the registration.
class HostRegistration : public detail::ContextResource<void*, &CudaApi::MemHostUnregister> {
 public:
  HostRegistration(const PrimaryContext& context, void* p, size_t bytes,
                   unsigned flags = cuda::kMemHostRegisterPortable);

  void* data() const noexcept { return handle_; }
  size_t size() const noexcept { return bytes_; }
};

// Page-locked host memory from cuMemAllocHost. Move-only.
class PinnedHostMemory : public detail::ContextResource<void*, &CudaApi::MemFreeHost> {
 public:
  PinnedHostMemory(const PrimaryContext& context, size_t bytes);

  void* data() const noexcept { return handle_; }
  size_t size() const noexcept { return bytes_; }
};

// Device memory from cuMemAlloc. Move-only.
class DeviceMemory : public detail::ContextResource<cuda::CUdeviceptr, &CudaApi::MemFree> {
 public:
  DeviceMemory(const PrimaryContext& context, size_t bytes);

  cuda::CUdeviceptr address() const noexcept { return handle_; }
  size_t size() const noexcept { return bytes_; }
};

}  // namespace tensortier
