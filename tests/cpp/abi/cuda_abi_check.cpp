// Compiled (never run) against NVIDIA's own cuda.h and cufile.h by tests/python/test_cuda_abi.py:
// every constant, layout and entry point tensortier declares by hand (cuda_driver.hpp,
// cufile.hpp; no CUDA headers at build time) must agree with the real headers. A mismatch is a
// compile error here instead of a crash on the first GPU machine.
#include <cuda.h>
#include <cufile.h>

#include <cstddef>
#include <string_view>
#include <type_traits>

#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/cuda/cufile.hpp"

namespace {

namespace tc = tensortier::cuda;
namespace tf = tensortier::cufile;

// Two parameter or return types pass the same way in the x86-64 and aarch64 C ABIs: the same
// type; pointers whose pointees match (ours may be void or an opaque struct for a handle);
// integers and enums of one size; or structs of one size and alignment (their fields are checked
// one by one below).
template <class Ours, class Real>
constexpr bool SameAbi() {
  if constexpr (std::is_same_v<Ours, Real>) {
    return true;
  } else if constexpr (std::is_pointer_v<Ours> && std::is_pointer_v<Real>) {
    using O = std::remove_pointer_t<Ours>;
    using R = std::remove_pointer_t<Real>;
    if (std::is_const_v<O> != std::is_const_v<R>) return false;
    using OB = std::remove_cv_t<O>;
    using RB = std::remove_cv_t<R>;
    if constexpr (std::is_void_v<OB> || std::is_void_v<RB>) {
      return std::is_void_v<OB> == std::is_void_v<RB> || std::is_class_v<OB> || std::is_class_v<RB>;
    } else if constexpr (std::is_class_v<OB> && std::is_class_v<RB>) {
      return true;  // two opaque handle types
    } else {
      return SameAbi<OB, RB>();
    }
  } else if constexpr ((std::is_integral_v<Ours> ||
                        std::is_enum_v<Ours>)&&(std::is_integral_v<Real> || std::is_enum_v<Real>)) {
    return sizeof(Ours) == sizeof(Real) && (std::is_enum_v<Ours> || std::is_enum_v<Real> ||
                                            std::is_signed_v<Ours> == std::is_signed_v<Real>);
  } else if constexpr (std::is_class_v<Ours> && std::is_class_v<Real>) {
    return sizeof(Ours) == sizeof(Real) && alignof(Ours) == alignof(Real) &&
           std::is_trivially_copyable_v<Ours> && std::is_trivially_copyable_v<Real>;
  } else {
    return false;
  }
}

template <class Ours, class Real>
struct SameFunction : std::false_type {};
template <class RO, class... AO, class RR, class... AR>
requires(sizeof...(AO) == sizeof...(AR)) struct SameFunction<RO (*)(AO...), RR (*)(AR...)>
    : std::bool_constant<SameAbi<RO, RR>() && (SameAbi<AO, AR>() && ...)> {
};

// The name a C caller of `api` links against once cuda.h's macros have mapped it (`cuMemAlloc`
// -> `cuMemAlloc_v2`): the name tensortier must resolve with dlsym.
#define TT_NAME(api) TT_STR(api)
#define TT_STR(x) #x
#define TT_ENTRY(api, member, resolved)                                                      \
  static_assert(std::string_view(TT_NAME(api)) == resolved, #api " links as " TT_NAME(api)); \
  static_assert(SameFunction<decltype(member), decltype(&::api)>::value,                     \
                #member " does not match " #api " in the real header")

constexpr tensortier::CudaApi kCuda;
constexpr tensortier::CuFileApi kCuFile;

// The entry points and the names cuda_driver.cpp and cufile.cpp resolve (test_cuda_abi.py checks
// that these (name, member) pairs are exactly the ones those files pass to DlSym).
TT_ENTRY(cuInit, kCuda.Init, "cuInit");
TT_ENTRY(cuDriverGetVersion, kCuda.DriverGetVersion, "cuDriverGetVersion");
TT_ENTRY(cuGetErrorName, kCuda.GetErrorName, "cuGetErrorName");
TT_ENTRY(cuGetErrorString, kCuda.GetErrorString, "cuGetErrorString");
TT_ENTRY(cuDeviceGetCount, kCuda.DeviceGetCount, "cuDeviceGetCount");
TT_ENTRY(cuDeviceGet, kCuda.DeviceGet, "cuDeviceGet");
TT_ENTRY(cuDevicePrimaryCtxRetain, kCuda.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
TT_ENTRY(cuDevicePrimaryCtxRelease, kCuda.DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
TT_ENTRY(cuCtxPushCurrent, kCuda.CtxPushCurrent, "cuCtxPushCurrent_v2");
TT_ENTRY(cuCtxPopCurrent, kCuda.CtxPopCurrent, "cuCtxPopCurrent_v2");
TT_ENTRY(cuPointerGetAttributes, kCuda.PointerGetAttributes, "cuPointerGetAttributes");
TT_ENTRY(cuStreamCreate, kCuda.StreamCreate, "cuStreamCreate");
TT_ENTRY(cuStreamDestroy, kCuda.StreamDestroy, "cuStreamDestroy_v2");
TT_ENTRY(cuStreamSynchronize, kCuda.StreamSynchronize, "cuStreamSynchronize");
TT_ENTRY(cuEventCreate, kCuda.EventCreate, "cuEventCreate");
TT_ENTRY(cuEventDestroy, kCuda.EventDestroy, "cuEventDestroy_v2");
TT_ENTRY(cuEventRecord, kCuda.EventRecord, "cuEventRecord");
TT_ENTRY(cuEventQuery, kCuda.EventQuery, "cuEventQuery");
TT_ENTRY(cuEventSynchronize, kCuda.EventSynchronize, "cuEventSynchronize");
TT_ENTRY(cuMemcpyHtoDAsync, kCuda.MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
TT_ENTRY(cuMemcpyDtoHAsync, kCuda.MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
TT_ENTRY(cuMemHostRegister, kCuda.MemHostRegister, "cuMemHostRegister_v2");
TT_ENTRY(cuMemHostUnregister, kCuda.MemHostUnregister, "cuMemHostUnregister");
TT_ENTRY(cuMemAllocHost, kCuda.MemAllocHost, "cuMemAllocHost_v2");
TT_ENTRY(cuMemFreeHost, kCuda.MemFreeHost, "cuMemFreeHost");
TT_ENTRY(cuMemAlloc, kCuda.MemAlloc, "cuMemAlloc_v2");
TT_ENTRY(cuMemFree, kCuda.MemFree, "cuMemFree_v2");
TT_ENTRY(cuMemGetAllocationGranularity, kCuda.MemGetAllocationGranularity,
         "cuMemGetAllocationGranularity");
TT_ENTRY(cuMemCreate, kCuda.MemCreate, "cuMemCreate");
TT_ENTRY(cuMemRelease, kCuda.MemRelease, "cuMemRelease");
TT_ENTRY(cuMemExportToShareableHandle, kCuda.MemExportToShareableHandle,
         "cuMemExportToShareableHandle");
TT_ENTRY(cuMemImportFromShareableHandle, kCuda.MemImportFromShareableHandle,
         "cuMemImportFromShareableHandle");
TT_ENTRY(cuMemAddressReserve, kCuda.MemAddressReserve, "cuMemAddressReserve");
TT_ENTRY(cuMemAddressFree, kCuda.MemAddressFree, "cuMemAddressFree");
TT_ENTRY(cuMemMap, kCuda.MemMap, "cuMemMap");
TT_ENTRY(cuMemUnmap, kCuda.MemUnmap, "cuMemUnmap");
TT_ENTRY(cuMemSetAccess, kCuda.MemSetAccess, "cuMemSetAccess");

TT_ENTRY(cuFileDriverOpen, kCuFile.DriverOpen, "cuFileDriverOpen");
TT_ENTRY(cuFileHandleRegister, kCuFile.HandleRegister, "cuFileHandleRegister");
TT_ENTRY(cuFileHandleDeregister, kCuFile.HandleDeregister, "cuFileHandleDeregister");
TT_ENTRY(cuFileBufRegister, kCuFile.BufRegister, "cuFileBufRegister");
TT_ENTRY(cuFileBufDeregister, kCuFile.BufDeregister, "cuFileBufDeregister");
TT_ENTRY(cuFileRead, kCuFile.Read, "cuFileRead");
TT_ENTRY(cuFileWrite, kCuFile.Write, "cuFileWrite");
TT_ENTRY(cuFileGetParameterBool, kCuFile.GetParameterBool, "cuFileGetParameterBool");

// CUresult values, attributes, memory types and flags.
static_assert(tc::kSuccess == CUDA_SUCCESS);
static_assert(tc::kErrorInvalidValue == CUDA_ERROR_INVALID_VALUE);
static_assert(tc::kErrorOutOfMemory == CUDA_ERROR_OUT_OF_MEMORY);
static_assert(tc::kErrorNotInitialized == CUDA_ERROR_NOT_INITIALIZED);
static_assert(tc::kErrorDeinitialized == CUDA_ERROR_DEINITIALIZED);
static_assert(tc::kErrorNoDevice == CUDA_ERROR_NO_DEVICE);
static_assert(tc::kErrorInvalidDevice == CUDA_ERROR_INVALID_DEVICE);
static_assert(tc::kErrorInvalidContext == CUDA_ERROR_INVALID_CONTEXT);
static_assert(tc::kErrorNotReady == CUDA_ERROR_NOT_READY);
static_assert(tc::kErrorOperatingSystem == CUDA_ERROR_OPERATING_SYSTEM);
static_assert(tc::kErrorNotSupported == CUDA_ERROR_NOT_SUPPORTED);
static_assert(tc::kErrorHostMemoryAlreadyRegistered == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
static_assert(tc::kErrorHostMemoryNotRegistered == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
static_assert(tc::kUnavailable < 0);  // not a CUDA value: must never collide with one
static_assert(tc::kPointerAttributeMemoryType == CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
static_assert(tc::kPointerAttributeIsManaged == CU_POINTER_ATTRIBUTE_IS_MANAGED);
static_assert(tc::kPointerAttributeDeviceOrdinal == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
static_assert(tc::kMemoryTypeHost == CU_MEMORYTYPE_HOST);
static_assert(tc::kMemoryTypeDevice == CU_MEMORYTYPE_DEVICE);
static_assert(tc::kMemoryTypeArray == CU_MEMORYTYPE_ARRAY);
static_assert(tc::kMemoryTypeUnified == CU_MEMORYTYPE_UNIFIED);
static_assert(sizeof(CUmemorytype) == sizeof(unsigned));  // what MEMORY_TYPE writes
static_assert(tc::kMemHostRegisterPortable == CU_MEMHOSTREGISTER_PORTABLE);
static_assert(tc::kEventBlockingSync == CU_EVENT_BLOCKING_SYNC);
static_assert(tc::kEventDisableTiming == CU_EVENT_DISABLE_TIMING);
static_assert(tc::kStreamNonBlocking == CU_STREAM_NON_BLOCKING);
static_assert(sizeof(tc::CUdeviceptr) == sizeof(CUdeviceptr));

// Virtual memory management: values and the structs passed by pointer, field by field.
static_assert(std::is_same_v<tc::CUmemGenericAllocationHandle, CUmemGenericAllocationHandle>);
static_assert(tc::kMemAllocationTypePinned == CU_MEM_ALLOCATION_TYPE_PINNED);
static_assert(tc::kMemHandleTypePosixFileDescriptor == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
static_assert(tc::kMemLocationTypeDevice == CU_MEM_LOCATION_TYPE_DEVICE);
static_assert(tc::kMemAccessFlagsReadWrite == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
static_assert(tc::kMemAllocGranularityMinimum == CU_MEM_ALLOC_GRANULARITY_MINIMUM);
static_assert(tc::kMemAllocGranularityRecommended == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
static_assert(sizeof(CUmemAllocationType) == sizeof(int));
static_assert(sizeof(CUmemAllocationHandleType) == sizeof(int));
static_assert(sizeof(CUmemLocationType) == sizeof(int));
static_assert(sizeof(CUmemAccess_flags) == sizeof(int));
static_assert(sizeof(tc::CUmemLocation) == sizeof(CUmemLocation));
static_assert(offsetof(tc::CUmemLocation, type) == offsetof(CUmemLocation, type));
static_assert(offsetof(tc::CUmemLocation, id) == offsetof(CUmemLocation, id));
static_assert(sizeof(tc::CUmemAllocationProp) == sizeof(CUmemAllocationProp));
static_assert(alignof(tc::CUmemAllocationProp) == alignof(CUmemAllocationProp));
static_assert(offsetof(tc::CUmemAllocationProp, type) == offsetof(CUmemAllocationProp, type));
static_assert(offsetof(tc::CUmemAllocationProp, requested_handle_types) ==
              offsetof(CUmemAllocationProp, requestedHandleTypes));
static_assert(offsetof(tc::CUmemAllocationProp, location) ==
              offsetof(CUmemAllocationProp, location));
static_assert(offsetof(tc::CUmemAllocationProp, win32_handle_meta_data) ==
              offsetof(CUmemAllocationProp, win32HandleMetaData));
static_assert(offsetof(tc::CUmemAllocationProp, alloc_flags) ==
              offsetof(CUmemAllocationProp, allocFlags));
static_assert(sizeof(tc::CUmemAccessDesc) == sizeof(CUmemAccessDesc));
static_assert(offsetof(tc::CUmemAccessDesc, location) == offsetof(CUmemAccessDesc, location));
static_assert(offsetof(tc::CUmemAccessDesc, flags) == offsetof(CUmemAccessDesc, flags));

// cuFile's structs and values.
static_assert(sizeof(tf::CUfileError_t) == sizeof(CUfileError_t));
static_assert(offsetof(tf::CUfileError_t, err) == offsetof(CUfileError_t, err));
static_assert(offsetof(tf::CUfileError_t, cu_err) == offsetof(CUfileError_t, cu_err));
static_assert(sizeof(tf::CUfileDescr_t) == sizeof(CUfileDescr_t));
static_assert(offsetof(tf::CUfileDescr_t, type) == offsetof(CUfileDescr_t, type));
static_assert(offsetof(tf::CUfileDescr_t, handle) == offsetof(CUfileDescr_t, handle));
static_assert(offsetof(tf::CUfileDescr_t, fs_ops) == offsetof(CUfileDescr_t, fs_ops));
static_assert(sizeof(tf::CUfileDescr_t::handle) == sizeof(CUfileDescr_t::handle));
static_assert(sizeof(CUfileFileHandleType) == sizeof(int));
static_assert(tf::kHandleTypeOpaqueFd == CU_FILE_HANDLE_TYPE_OPAQUE_FD);
static_assert(tf::kSuccess == CU_FILE_SUCCESS);
static_assert(tf::kDriverAlreadyOpen == CU_FILE_DRIVER_ALREADY_OPEN);
static_assert(tf::kBaseError == CUFILEOP_BASE_ERR);
static_assert(tf::kCudaDriverError == CU_FILE_CUDA_DRIVER_ERROR);
static_assert(tf::kParamForceCompatMode == CUFILE_PARAM_FORCE_COMPAT_MODE);
static_assert(tf::kParamUsePciP2pdma == CUFILE_PARAM_USE_PCIP2PDMA);
// Field types, not only places: a field's type decides how its bytes are read.
static_assert(SameAbi<decltype(tf::CUfileError_t::err), decltype(CUfileError_t::err)>());
static_assert(SameAbi<decltype(tf::CUfileError_t::cu_err), decltype(CUfileError_t::cu_err)>());
static_assert(SameAbi<decltype(tf::CUfileDescr_t::type), decltype(CUfileDescr_t::type)>());
static_assert(
    SameAbi<decltype(tf::CUfileDescr_t::handle.fd), decltype(CUfileDescr_t::handle.fd)>());
static_assert(
    SameAbi<decltype(tf::CUfileDescr_t::handle.handle), decltype(CUfileDescr_t::handle.handle)>());
static_assert(SameAbi<decltype(tf::CUfileDescr_t::fs_ops), decltype(CUfileDescr_t::fs_ops)>());

}  // namespace
