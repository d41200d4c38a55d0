// cuFile (GPUDirect Storage), opened with dlopen("libcufile.so.0") at run time; nothing here needs
// the cuFile headers or library to compile.
//
// CuFile::Get() loads the library and opens the cuFile driver once per process and never throws:
// available() says whether GDS can be used here, why_unavailable() says why not (library missing,
// no CUDA driver or device, /run/udev missing, WSL, cuFileDriverOpen failing with its error);
// compat_mode_reason() says when cuFile would move data in its compatibility mode (no nvidia-fs
// kernel driver: POSIX I/O through cuFile's own buffers, not GPUDirect). The driver is never
// closed: cuFile must not be called after main() returns, so the instance is deliberately leaked.
//
// Errors: registration failures throw CuFileError (the cuFile status, and the CUDA result when the
// status is CU_FILE_CUDA_DRIVER_ERROR); read/write failures throw IoError with the errno, path,
// offset and length (a cuFile status code, which has no errno, is named in IoError::op() and
// reported as EIO, as a CuFileTransferError).
//
// Thread-safety: CuFile is immutable after loading (thread-safe); cuFile's own calls are
// thread-safe, so CuFileHandle::Read/Write may be called from several threads at once.
#pragma once

#include <sys/types.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/util/error.hpp"

namespace tensortier {

// Our own declarations of cuFile's ABI (cufile.h); names follow it.
namespace cufile {
// CUfileError_t: returned by value (8 bytes, two C enums/ints).
struct CUfileError_t {
  int err;     // CUfileOpError: 0 or 5000 + n
  int cu_err;  // CUresult, meaningful when err == kCudaDriverError
};
using CUfileHandle_t = void*;

// CUfileFileHandleType.
inline constexpr int kHandleTypeOpaqueFd = 1;

// CUfileDescr_t.
struct CUfileDescr_t {
  int type;  // kHandleTypeOpaqueFd
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;  // CUfileFSOps_t*, null for ordinary files
};

// CUfileOpError values used here; the rest are named by CuFile::ErrorName.
inline constexpr int kSuccess = 0;
inline constexpr int kBaseError = 5000;
inline constexpr int kCudaDriverError = 5011;
inline constexpr int kDriverAlreadyOpen = 5026;
// CUFileBoolConfigParameter_t values used here.
inline constexpr int kParamForceCompatMode = 2;  // CUFILE_PARAM_FORCE_COMPAT_MODE
inline constexpr int kParamUsePciP2pdma = 7;     // CUFILE_PARAM_USE_PCIP2PDMA
}  // namespace cufile

struct CuFileApi {
  cufile::CUfileError_t (*DriverOpen)() = nullptr;
  cufile::CUfileError_t (*HandleRegister)(cufile::CUfileHandle_t* handle,
                                          cufile::CUfileDescr_t* descr) = nullptr;
  void (*HandleDeregister)(cufile::CUfileHandle_t handle) = nullptr;
  cufile::CUfileError_t (*BufRegister)(const void* base, size_t length, int flags) = nullptr;
  cufile::CUfileError_t (*BufDeregister)(const void* base) = nullptr;
  // Bytes transferred, or -1 with errno set, or -(CUfileOpError).
  ssize_t (*Read)(cufile::CUfileHandle_t handle, void* base, size_t size, off_t file_offset,
                  off_t base_offset) = nullptr;
  ssize_t (*Write)(cufile::CUfileHandle_t handle, const void* base, size_t size, off_t file_offset,
                   off_t base_offset) = nullptr;
  // Optional: null where the library predates it (the configuration's values).
  cufile::CUfileError_t (*GetParameterBool)(int param, bool* value) = nullptr;
};

// A cuFileRead/cuFileWrite that failed with a cuFile status (a negated CUfileOpError) rather than
// -1 with errno: GDS itself could not move the bytes (the same transfer may work through the
// bounce ring). An IoError (EIO; the status named in op()), so callers that do not care see the
// usual I/O error.
class CuFileTransferError : public IoError {
 public:
  CuFileTransferError(int status, std::string_view op, std::string path, uint64_t offset,
                      uint64_t length)
      : IoError(EIO, op, std::move(path), offset, length), status_(status) {}
  // The CUfileOpError (positive, e.g. 5008 for CU_FILE_IO_NOT_SUPPORTED).
  int status() const noexcept { return status_; }

 private:
  int status_;
};

// A failed cuFile call that is not a data transfer. what(): "<call> failed: <detail>".
class CuFileError : public std::runtime_error {
 public:
  // `code`: CUfileOpError, or -1 when cuFile is unavailable. `cuda_code`: the CUresult for
  // CU_FILE_CUDA_DRIVER_ERROR, else 0.
  CuFileError(int code, int cuda_code, std::string call, const std::string& detail);
  int code() const noexcept { return code_; }
  int cuda_code() const noexcept { return cuda_code_; }
  const std::string& call() const noexcept { return call_; }

 private:
  int code_;
  int cuda_code_;
  std::string call_;
};

// Where CuFilePlatform::Probe looks (tests point these elsewhere).
struct CuFileProbePaths {
  std::string udev = "/run/udev";                             // cuFile finds devices here
  std::string nvidia_fs = "/proc/driver/nvidia-fs/devcount";  // the kernel driver's file
};

// What the machine allows cuFile, read before cuFileDriverOpen is called.
struct CuFilePlatform {
  // Why cuFile must not be opened here (empty: it may): no CUDA driver or device, WSL, no udev.
  std::string unusable;
  // Why cuFile would run in its compatibility mode (empty: the nvidia-fs driver is loaded).
  std::string compat_mode;

  // Probes this machine: `driver` (available, with a device), WSL, udev, and the nvidia-fs
  // kernel driver.
  static CuFilePlatform Probe(const CudaDriver& driver = CudaDriver::Get(),
                              const CuFileProbePaths& paths = CuFileProbePaths());
};

class CuFile {
 public:
  // The process-wide instance, loaded from DefaultLibrary() on first use. Never throws.
  static const CuFile& Get() noexcept;
  // $TENSORTIER_CUFILE_LIBRARY when set and not empty, else "libcufile.so.0".
  static std::string DefaultLibrary();
  // Loads `library`, resolves the entry points, checks the platform (CuFilePlatform::Probe();
  // unless `check_platform` is false: tests load a stand-in library, which needs no udev, no
  // driver besides itself and no nvidia-fs) and calls cuFileDriverOpen unless the platform is
  // unusable. Never throws. Tests call these with bad paths and stand-ins; everything else uses
  // Get().
  static std::unique_ptr<CuFile> Load(const std::string& library,
                                      bool check_platform = true) noexcept;
  static std::unique_ptr<CuFile> Load(const std::string& library,
                                      const CuFilePlatform& platform) noexcept;
  // "CU_FILE_DRIVER_NOT_INITIALIZED (5001)"; accepts the negated codes of Read/Write too.
  static std::string ErrorName(int code);

  ~CuFile();
  CuFile(const CuFile&) = delete;
  CuFile& operator=(const CuFile&) = delete;

  bool available() const noexcept { return available_; }
  // Empty when available.
  const std::string& why_unavailable() const noexcept { return why_; }
  const std::string& library() const noexcept { return library_; }
  // Non-empty when available but cuFile would read and write through its own host buffers
  // (compatibility mode): no nvidia-fs driver (unless its configuration sets use_pci_p2pdma), or
  // a configuration that forces that mode. "auto" GDS then uses the bounce ring instead.
  const std::string& compat_mode_reason() const noexcept { return compat_mode_reason_; }
  // Throws CuFileError (naming `call`) when unavailable.
  const CuFileApi& api(const char* call = "cuFile call") const;

 private:
  explicit CuFile(std::string library) : library_(std::move(library)) {}
  void Open(const CuFilePlatform& platform);

  std::string library_;
  void* handle_ = nullptr;
  CuFileApi api_;
  bool available_ = false;
  std::string why_;
  std::string compat_mode_reason_;
};

// A file descriptor registered with cuFile (cuFileHandleRegister). The descriptor is borrowed:
// the caller keeps it open for the handle's lifetime (GDS wants an O_DIRECT descriptor; others
// work in cuFile's compatibility mode where it allows that). `path` is for messages. Move-only.
class CuFileHandle {
 public:
  // Throws CuFileError when cuFile is unavailable or refuses the descriptor.
  CuFileHandle(const CuFile& cufile, int fd, std::string path);
  ~CuFileHandle();
  CuFileHandle(CuFileHandle&& other) noexcept;
  CuFileHandle& operator=(CuFileHandle&& other) noexcept;
  CuFileHandle(const CuFileHandle&) = delete;
  CuFileHandle& operator=(const CuFileHandle&) = delete;

  const std::string& path() const noexcept { return path_; }
  // Reads [file_offset, file_offset+size) into `base` + `base_offset` (device or registered host
  // memory), continuing short reads; returns fewer than `size` bytes only at end of file.
  // Throws IoError (CuFileTransferError for a cuFile status).
  uint64_t Read(void* base, uint64_t size, uint64_t file_offset, uint64_t base_offset = 0) const;
  // Writes all `size` bytes or throws IoError.
  uint64_t Write(const void* base, uint64_t size, uint64_t file_offset,
                 uint64_t base_offset = 0) const;

 private:
  void Reset() noexcept;
  const CuFile* cufile_ = nullptr;
  cufile::CUfileHandle_t handle_ = nullptr;
  std::string path_;
};

// A buffer registered with cuFile (cuFileBufRegister), which lets GDS skip its internal bounce
// buffers. cuFile registers through the calling thread's current CUDA context, so the buffer
// finds the memory's device with `driver` (CudaDriver::Locate; device 0 for host memory), keeps
// that device's primary context and makes it current around registering and deregistering.
// REQUIRES: the memory outlives the registration. Move-only.
class CuFileBuffer {
 public:
  // Throws CuFileError (cuFile unavailable or refusing the memory), or CudaError when the driver
  // fails to locate the memory or to make its context current.
  CuFileBuffer(const CuFile& cufile, const void* base, size_t length, int flags = 0,
               const CudaDriver& driver = CudaDriver::Get());
  ~CuFileBuffer();
  CuFileBuffer(CuFileBuffer&& other) noexcept;
  CuFileBuffer& operator=(CuFileBuffer&& other) noexcept;
  CuFileBuffer(const CuFileBuffer&) = delete;
  CuFileBuffer& operator=(const CuFileBuffer&) = delete;

  const void* data() const noexcept { return base_; }
  size_t size() const noexcept { return length_; }
  // The device whose primary context registered the memory; -1 without a CUDA driver.
  int device() const noexcept { return context_ ? context_->device() : -1; }

 private:
  void Reset() noexcept;
  const CuFile* cufile_ = nullptr;
  std::optional<PrimaryContext> context_;  // none without a driver (cuFile then refuses anyway)
  const void* base_ = nullptr;
  size_t length_ = 0;
};

}  // namespace tensortier
