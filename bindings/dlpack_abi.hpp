// The DLPack ABI (the unversioned "dltensor" capsule every DLPack consumer accepts: DALI's
// TensorCPU, torch.from_dlpack, numpy.from_dlpack). Declared here rather than taken from a
// dlpack.h so that building the module needs no extra system package; the layout is DLPack's
// stable C ABI.
#pragma once

#include <cstdint>

namespace tensortier::dlpack {

enum DeviceType : int32_t { kCpu = 1 };
enum DataTypeCode : uint8_t { kUInt = 1 };

struct Device {
  DeviceType device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};

struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

// A capsule's name before and after a consumer takes ownership of its ManagedTensor.
inline constexpr const char* kCapsuleName = "dltensor";
inline constexpr const char* kUsedCapsuleName = "used_dltensor";

}  // namespace tensortier::dlpack
