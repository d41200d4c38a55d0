#include "tensortier/cuda/cufile.hpp"

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <utility>

#include "tensortier/cuda/dl.hpp"
#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

const char* OpErrorName(int code) {
  switch (code) {
    case 0:
      return "CU_FILE_SUCCESS";
    case 5001:
      return "CU_FILE_DRIVER_NOT_INITIALIZED";
    case 5002:
      return "CU_FILE_DRIVER_INVALID_PROPS";
    case 5003:
      return "CU_FILE_DRIVER_UNSUPPORTED_LIMIT";
    case 5004:
      return "CU_FILE_DRIVER_VERSION_MISMATCH";
    case 5005:
      return "CU_FILE_DRIVER_VERSION_READ_ERROR";
    case 5006:
      return "CU_FILE_DRIVER_CLOSING";
    case 5007:
      return "CU_FILE_PLATFORM_NOT_SUPPORTED";
    case 5008:
      return "CU_FILE_IO_NOT_SUPPORTED";
    case 5009:
      return "CU_FILE_DEVICE_NOT_SUPPORTED";
    case 5010:
      return "CU_FILE_NVFS_DRIVER_ERROR";
    case 5011:
      return "CU_FILE_CUDA_DRIVER_ERROR";
    case 5012:
      return "CU_FILE_CUDA_POINTER_INVALID";
    case 5013:
      return "CU_FILE_CUDA_MEMORY_TYPE_INVALID";
    case 5014:
      return "CU_FILE_CUDA_POINTER_RANGE_ERROR";
    case 5015:
      return "CU_FILE_CUDA_CONTEXT_MISMATCH";
    case 5016:
      return "CU_FILE_INVALID_MAPPING_SIZE";
    case 5017:
      return "CU_FILE_INVALID_MAPPING_RANGE";
    case 5018:
      return "CU_FILE_INVALID_FILE_TYPE";
    case 5019:
      return "CU_FILE_INVALID_FILE_OPEN_FLAG";
    case 5020:
      return "CU_FILE_DIO_NOT_SET";
    case 5022:
      return "CU_FILE_INVALID_VALUE";
    case 5023:
      return "CU_FILE_MEMORY_ALREADY_REGISTERED";
    case 5024:
      return "CU_FILE_MEMORY_NOT_REGISTERED";
    case 5025:
      return "CU_FILE_PERMISSION_DENIED";
    case 5026:
      return "CU_FILE_DRIVER_ALREADY_OPEN";
    case 5027:
      return "CU_FILE_HANDLE_NOT_REGISTERED";
    case 5028:
      return "CU_FILE_HANDLE_ALREADY_REGISTERED";
    case 5029:
      return "CU_FILE_DEVICE_NOT_FOUND";
    case 5030:
      return "CU_FILE_INTERNAL_ERROR";
    case 5031:
      return "CU_FILE_GETNEWFD_FAILED";
    case 5033:
      return "CU_FILE_NVFS_SETUP_ERROR";
    case 5034:
      return "CU_FILE_IO_DISABLED";
    case 5035:
      return "CU_FILE_BATCH_SUBMIT_FAILED";
    case 5036:
      return "CU_FILE_GPU_MEMORY_PINNING_FAILED";
    case 5037:
      return "CU_FILE_BATCH_FULL";
    case 5038:
      return "CU_FILE_ASYNC_NOT_SUPPORTED";
    case 5039:
      return "CU_FILE_INTERNAL_BATCH_SETUP_ERROR";
    case 5040:
      return "CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR";
    case 5041:
      return "CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR";
    case 5042:
      return "CU_FILE_INTERNAL_BATCH_CANCEL_ERROR";
    case 5043:
      return "CU_FILE_NOMEM_ERROR";
    case 5044:
      return "CU_FILE_IO_ERROR";
    case 5045:
      return "CU_FILE_INTERNAL_BUF_REGISTER_ERROR";
    case 5046:
      return "CU_FILE_HASH_OPR_ERROR";
    case 5047:
      return "CU_FILE_INVALID_CONTEXT_ERROR";
    case 5048:
      return "CU_FILE_NVFS_INTERNAL_DRIVER_ERROR";
    case 5049:
      return "CU_FILE_BATCH_NOCOMPAT_ERROR";
    case 5050:
      return "CU_FILE_IO_MAX_ERROR";
    default:
      return nullptr;
  }
}

// The status, plus the CUDA driver's error when cuFile reports one.
std::string StatusText(cufile::CUfileError_t status) {
  std::string text = CuFile::ErrorName(status.err);
  if (status.err == cufile::kCudaDriverError) {
    text += StrCat(": ", CudaDriver::Get().ErrorText(status.cu_err));
  }
  return text;
}

bool RunningInWsl() {
  std::ifstream in("/proc/sys/kernel/osrelease");
  std::string release;
  std::getline(in, release);
  for (char& c : release) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return release.find("microsoft") != std::string::npos || release.find("wsl") != std::string::npos;
}

}  // namespace

CuFileError::CuFileError(int code, int cuda_code, std::string call, const std::string& detail)
    : std::runtime_error(StrCat(call, " failed: ", detail)),
      code_(code),
      cuda_code_(cuda_code),
      call_(std::move(call)) {}

// ---------------------------------------------------------------------------------------------
// CuFilePlatform

CuFilePlatform CuFilePlatform::Probe(const CudaDriver& driver, const CuFileProbePaths& paths) {
  CuFilePlatform platform;
  // The checks KvikIO makes (udev, WSL), and a driver first: without libcuda.so.1, libcufile
  // 1.20.0 spun in cuFileDriverOpen for minutes, until stopped. CUDA builds of torch on machines
  // without a GPU make that case likely (their libtorch_cuda loads libcufile.so.0).
  if (!driver.available()) {
    platform.unusable = StrCat("no usable CUDA driver (", driver.why_unavailable(), ")");
  } else if (driver.device_count() == 0) {
    platform.unusable = "the CUDA driver sees no device";
  } else if (RunningInWsl()) {
    platform.unusable = "cuFile is not supported under WSL";
  } else if (access(paths.udev.c_str(), R_OK) != 0) {
    platform.unusable =
        StrCat(paths.udev, " is not readable (", std::strerror(errno),
               "): cuFile needs it to find devices (in a container, mount the host's /run/udev)");
  } else if (access(paths.nvidia_fs.c_str(), R_OK) != 0) {
    platform.compat_mode =
        StrCat("no nvidia-fs kernel driver (", paths.nvidia_fs, ": ", std::strerror(errno), ")");
  }
  return platform;
}

// ---------------------------------------------------------------------------------------------
// CuFile

const CuFile& CuFile::Get() noexcept {
  static const CuFile* const cufile = Load(DefaultLibrary()).release();  // leaked on purpose
  return *cufile;
}

std::string CuFile::DefaultLibrary() {
  return WordSetting(SettingFor("TENSORTIER_CUFILE_LIBRARY"));
}

std::unique_ptr<CuFile> CuFile::Load(const std::string& library, bool check_platform) noexcept {
  return Load(library, check_platform ? CuFilePlatform::Probe() : CuFilePlatform{});
}

std::unique_ptr<CuFile> CuFile::Load(const std::string& library,
                                     const CuFilePlatform& platform) noexcept {
  std::unique_ptr<CuFile> cufile(new CuFile(library));
  cufile->Open(platform);
  return cufile;
}

std::string CuFile::ErrorName(int code) {
  if (code < 0) code = -code;
  const char* name = OpErrorName(code);
  return name != nullptr ? StrCat(name, " (", code, ")") : StrCat("cuFile error ", code);
}

CuFile::~CuFile() = default;  // never closes the driver or the library: see the header

void CuFile::Open(const CuFilePlatform& platform) {
  handle_ = detail::DlOpen(library_, &why_);
  if (handle_ == nullptr) return;
  const bool resolved =
      detail::DlSym(handle_, library_, "cuFileDriverOpen", api_.DriverOpen, &why_) &&
      detail::DlSym(handle_, library_, "cuFileHandleRegister", api_.HandleRegister, &why_) &&
      detail::DlSym(handle_, library_, "cuFileHandleDeregister", api_.HandleDeregister, &why_) &&
      detail::DlSym(handle_, library_, "cuFileBufRegister", api_.BufRegister, &why_) &&
      detail::DlSym(handle_, library_, "cuFileBufDeregister", api_.BufDeregister, &why_) &&
      detail::DlSym(handle_, library_, "cuFileRead", api_.Read, &why_) &&
      detail::DlSym(handle_, library_, "cuFileWrite", api_.Write, &why_);
  if (!resolved) return;
  if (!platform.unusable.empty()) {
    why_ = platform.unusable;
    return;
  }
  // The driver is one per process, shared with any library that opened it first (torch's GDS,
  // KvikIO): "already open" means it is ready. It is never closed (see the header).
  const cufile::CUfileError_t status = api_.DriverOpen();
  if (status.err != cufile::kSuccess && status.err != cufile::kDriverAlreadyOpen) {
    why_ = StrCat("cuFileDriverOpen failed: ", StatusText(status));
    return;
  }
  compat_mode_reason_ = platform.compat_mode;
  // cuFile's own configuration overrides what the platform suggests: it may force its
  // compatibility mode, or do GPUDirect through the kernel's PCI P2PDMA without nvidia-fs.
  std::string absent;  // an optional entry point: older libraries lack it
  if (detail::DlSym(handle_, library_, "cuFileGetParameterBool", api_.GetParameterBool, &absent)) {
    bool value = false;
    if (api_.GetParameterBool(cufile::kParamForceCompatMode, &value).err == cufile::kSuccess &&
        value) {
      compat_mode_reason_ = "its configuration forces compatibility mode (force_compat_mode)";
    } else if (!compat_mode_reason_.empty() &&
               api_.GetParameterBool(cufile::kParamUsePciP2pdma, &value).err == cufile::kSuccess &&
               value) {
      compat_mode_reason_.clear();  // use_pci_p2pdma: GPUDirect without nvidia-fs
    }
  }
  available_ = true;
}

const CuFileApi& CuFile::api(const char* call) const {
  if (!available_) throw CuFileError(-1, 0, call, StrCat("cuFile unavailable: ", why_));
  return api_;
}

// ---------------------------------------------------------------------------------------------
// CuFileHandle

CuFileHandle::CuFileHandle(const CuFile& cufile, int fd, std::string path)
    : cufile_(&cufile), path_(std::move(path)) {
  const CuFileApi& api = cufile.api("cuFileHandleRegister");
  cufile::CUfileDescr_t descr{};
  descr.type = cufile::kHandleTypeOpaqueFd;
  descr.handle.fd = fd;
  descr.fs_ops = nullptr;
  const cufile::CUfileError_t status = api.HandleRegister(&handle_, &descr);
  if (status.err != cufile::kSuccess) {
    handle_ = nullptr;
    throw CuFileError(status.err, status.err == cufile::kCudaDriverError ? status.cu_err : 0,
                      "cuFileHandleRegister",
                      StrCat(StatusText(status), " (fd ", fd, ", '", path_, "')"));
  }
}

CuFileHandle::~CuFileHandle() {
  Reset();
}

CuFileHandle::CuFileHandle(CuFileHandle&& other) noexcept
    : cufile_(other.cufile_),
      handle_(std::exchange(other.handle_, nullptr)),
      path_(std::move(other.path_)) {}

CuFileHandle& CuFileHandle::operator=(CuFileHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    cufile_ = other.cufile_;
    handle_ = std::exchange(other.handle_, nullptr);
    path_ = std::move(other.path_);
  }
  return *this;
}

void CuFileHandle::Reset() noexcept {
  if (handle_ == nullptr) return;
  cufile_->api().HandleDeregister(handle_);
  handle_ = nullptr;
}

namespace {

// Throws IoError for a negative result of cuFileRead/cuFileWrite: -1 carries errno, anything else
// is a negated cuFile status (no errno: CuFileTransferError, EIO, the status named in the op).
[[noreturn]] void ThrowTransferError(ssize_t result, int saved_errno, const char* call,
                                     const std::string& path, uint64_t offset, uint64_t length) {
  if (result == -1) ThrowIoError(saved_errno != 0 ? saved_errno : EIO, call, path, offset, length);
  const int status = static_cast<int>(-result);
  throw CuFileTransferError(status, StrCat(call, " (", CuFile::ErrorName(status), ")"), path,
                            offset, length);
}

}  // namespace

uint64_t CuFileHandle::Read(void* base, uint64_t size, uint64_t file_offset,
                            uint64_t base_offset) const {
  if (handle_ == nullptr) throw std::logic_error("CuFileHandle::Read on a moved-from handle");
  const CuFileApi& api = cufile_->api("cuFileRead");
  uint64_t done = 0;
  while (done < size) {
    errno = 0;
    const ssize_t n = api.Read(handle_, base, size - done, static_cast<off_t>(file_offset + done),
                               static_cast<off_t>(base_offset + done));
    if (n < 0) ThrowTransferError(n, errno, "cuFileRead", path_, file_offset + done, size - done);
    if (n == 0) break;  // end of file
    done += static_cast<uint64_t>(n);
  }
  return done;
}

uint64_t CuFileHandle::Write(const void* base, uint64_t size, uint64_t file_offset,
                             uint64_t base_offset) const {
  if (handle_ == nullptr) throw std::logic_error("CuFileHandle::Write on a moved-from handle");
  const CuFileApi& api = cufile_->api("cuFileWrite");
  uint64_t done = 0;
  while (done < size) {
    errno = 0;
    const ssize_t n = api.Write(handle_, base, size - done, static_cast<off_t>(file_offset + done),
                                static_cast<off_t>(base_offset + done));
    if (n < 0) ThrowTransferError(n, errno, "cuFileWrite", path_, file_offset + done, size - done);
    if (n == 0) {  // no progress: would loop forever
      ThrowIoError(EIO, "cuFileWrite (wrote 0 bytes)", path_, file_offset + done, size - done);
    }
    done += static_cast<uint64_t>(n);
  }
  return done;
}

// ---------------------------------------------------------------------------------------------
// CuFileBuffer

CuFileBuffer::CuFileBuffer(const CuFile& cufile, const void* base, size_t length, int flags,
                           const CudaDriver& driver)
    : cufile_(&cufile) {
  const CuFileApi& api = cufile.api("cuFileBufRegister");
  if (driver.available()) {
    const PointerLocation where = driver.Locate(base);
    const bool on_device = where.type == MemoryType::kDevice || where.type == MemoryType::kManaged;
    context_.emplace(driver, on_device && where.device >= 0 ? where.device : 0);
  }
  std::optional<ScopedContext> current;
  if (context_) current.emplace(*context_);
  const cufile::CUfileError_t status = api.BufRegister(base, length, flags);
  if (status.err != cufile::kSuccess) {
    throw CuFileError(
        status.err, status.err == cufile::kCudaDriverError ? status.cu_err : 0, "cuFileBufRegister",
        StrCat(StatusText(status), " (", length, " bytes at ", base, ", device ", device(), ")"));
  }
  base_ = base;
  length_ = length;
}

CuFileBuffer::~CuFileBuffer() {
  Reset();
}

CuFileBuffer::CuFileBuffer(CuFileBuffer&& other) noexcept
    : cufile_(other.cufile_),
      context_(other.context_),
      base_(std::exchange(other.base_, nullptr)),
      length_(std::exchange(other.length_, 0)) {}

CuFileBuffer& CuFileBuffer::operator=(CuFileBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    cufile_ = other.cufile_;
    context_ = other.context_;
    base_ = std::exchange(other.base_, nullptr);
    length_ = std::exchange(other.length_, 0);
  }
  return *this;
}

void CuFileBuffer::Reset() noexcept {
  if (base_ == nullptr) return;
  std::optional<ScopedContext> current;
  try {
    if (context_) current.emplace(*context_);
  } catch (const CudaError&) {
    // Deregister anyway: cuFile may still find the registration without our context.
  }
  cufile_->api().BufDeregister(base_);
  base_ = nullptr;
  length_ = 0;
}

}  // namespace tensortier
