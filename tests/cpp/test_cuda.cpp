// The runtime-loaded CUDA driver and cuFile: without the libraries (or with a path that is no
// library) both report unavailable with a reason naming the library, and nothing crashes; every
// object that needs the driver throws CudaError naming the call; host pointers locate as host.
// The Gpu suites run only where CudaDriver::Get() (and CuFile::Get()) are available, and skip
// with the reason otherwise.
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fake_cuda/fake_cuda_hooks.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/cuda/cufile.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::ScopedEnv;
using testing::TempDir;

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A file that exists but is no shared library.
std::string WriteNotALibrary(const TempDir& dir) {
  const std::string path = dir.File("not-a-library.so");
  std::ofstream(path) << "this is not an ELF file\n";
  return path;
}

// ---------------------------------------------------------------------------------------------
// CudaDriver without a usable library

TEST(CudaDriverTest, MissingLibraryIsUnavailableWithReason) {
  const std::string path = "/nonexistent/tensortier/libcuda.so.1";
  auto driver = CudaDriver::Load(path);
  ASSERT_NE(driver, nullptr);
  EXPECT_FALSE(driver->available());
  EXPECT_EQ(driver->library(), path);
  EXPECT_TRUE(Contains(driver->why_unavailable(), path + " not found: "))
      << driver->why_unavailable();
  EXPECT_EQ(driver->device_count(), 0);
  EXPECT_EQ(driver->version(), 0);
}

TEST(CudaDriverTest, FileThatIsNoLibraryIsUnavailableWithReason) {
  TempDir dir;
  const std::string path = WriteNotALibrary(dir);
  auto driver = CudaDriver::Load(path);
  EXPECT_FALSE(driver->available());
  EXPECT_TRUE(Contains(driver->why_unavailable(), path + " could not be loaded: "))
      << driver->why_unavailable();
}

TEST(CudaDriverTest, LibraryWithoutTheDriverSymbolsIsUnavailableWithReason) {
  // libdl/libc is a real library that has none of the driver's entry points.
  auto driver = CudaDriver::Load("libc.so.6");
  EXPECT_FALSE(driver->available());
  EXPECT_TRUE(Contains(driver->why_unavailable(), "libc.so.6 lacks cuInit"))
      << driver->why_unavailable();
}

TEST(CudaDriverTest, EnvironmentVariableOverridesTheLibrary) {
  {
    ScopedEnv env("TENSORTIER_CUDA_LIBRARY", "/nonexistent/override/libcuda.so");
    EXPECT_EQ(CudaDriver::DefaultLibrary(), "/nonexistent/override/libcuda.so");
    auto driver = CudaDriver::Load(CudaDriver::DefaultLibrary());
    EXPECT_FALSE(driver->available());
    EXPECT_TRUE(Contains(driver->why_unavailable(), "/nonexistent/override/libcuda.so not found"))
        << driver->why_unavailable();
  }
  {
    ScopedEnv env("TENSORTIER_CUDA_LIBRARY", "");
    EXPECT_EQ(CudaDriver::DefaultLibrary(), "libcuda.so.1");
  }
  {
    ScopedEnv env("TENSORTIER_CUDA_LIBRARY", std::nullopt);
    EXPECT_EQ(CudaDriver::DefaultLibrary(), "libcuda.so.1");
  }
}

TEST(CudaDriverTest, GetNeverThrowsAndExplainsItself) {
  const CudaDriver& driver = CudaDriver::Get();
  EXPECT_EQ(&driver, &CudaDriver::Get()) << "one instance per process";
  EXPECT_EQ(driver.available(), driver.why_unavailable().empty()) << driver.why_unavailable();
  if (driver.available()) {
    EXPECT_GT(driver.device_count(), 0);
    EXPECT_GT(driver.version(), 0);
  } else {
    EXPECT_EQ(driver.device_count(), 0);
    std::cout << "CUDA driver unavailable here: " << driver.why_unavailable() << "\n";
  }
}

TEST(CudaDriverTest, WithoutTheSystemLibraryGetNamesLibcuda) {
  if (std::getenv("TENSORTIER_CUDA_LIBRARY") != nullptr) GTEST_SKIP() << "library overridden";
  void* probe = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (probe == nullptr) probe = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (probe != nullptr) GTEST_SKIP() << "libcuda.so.1 is installed here";
  EXPECT_FALSE(CudaDriver::Get().available());
  EXPECT_TRUE(Contains(CudaDriver::Get().why_unavailable(), "libcuda.so.1 not found: "))
      << CudaDriver::Get().why_unavailable();
}

TEST(CudaDriverTest, LocateWithoutDriverReportsHost) {
  auto driver = CudaDriver::Load("/nonexistent/libcuda.so.1");
  int on_stack = 0;
  std::vector<uint8_t> on_heap(100);
  for (const void* p :
       {static_cast<const void*>(&on_stack), static_cast<const void*>(on_heap.data()),
        static_cast<const void*>(nullptr)}) {
    PointerLocation where = driver->Locate(p);
    EXPECT_EQ(where.type, MemoryType::kHost);
    EXPECT_EQ(where.device, -1);
    EXPECT_FALSE(driver->IsPinnedHost(p, 100));
  }
  EXPECT_EQ(MemoryTypeName(MemoryType::kHost), "host");
  EXPECT_EQ(MemoryTypeName(MemoryType::kDevice), "device");
}

TEST(CudaDriverTest, MemoryTypeNamesBothWays) {
  EXPECT_EQ(MemoryTypeName(MemoryType::kRegisteredHost), "registered host");
  EXPECT_EQ(MemoryTypeName(MemoryType::kManaged), "managed");
  for (MemoryType type : {MemoryType::kHost, MemoryType::kRegisteredHost, MemoryType::kDevice,
                          MemoryType::kManaged}) {
    EXPECT_EQ(ValueOf(kMemoryTypeNames, MemoryTypeName(type)), type) << MemoryTypeName(type);
  }
}

TEST(CudaDriverTest, ObjectsWithoutDriverThrowCudaErrorNamingTheCall) {
  auto driver = CudaDriver::Load("/nonexistent/libcuda.so.1");
  try {
    PrimaryContext context(*driver, 0);
    FAIL() << "PrimaryContext without a driver did not throw";
  } catch (const CudaError& e) {
    EXPECT_EQ(e.code(), cuda::kUnavailable);
    EXPECT_EQ(e.call(), "cuDevicePrimaryCtxRetain");
    const std::string what = e.what();
    EXPECT_TRUE(Contains(what, "cuDevicePrimaryCtxRetain failed: CUDA driver unavailable: "))
        << what;
    EXPECT_TRUE(Contains(what, "/nonexistent/libcuda.so.1 not found")) << what;
  }
  // Everything else needs a context, so it cannot be made either.
  EXPECT_THROW(Stream(PrimaryContext(*driver, 0)), CudaError);
  EXPECT_THROW(Event(PrimaryContext(*driver, 0)), CudaError);
  std::vector<uint8_t> host(4096);
  EXPECT_THROW(HostRegistration(PrimaryContext(*driver, 0), host.data(), host.size()), CudaError);
  EXPECT_THROW(PinnedHostMemory(PrimaryContext(*driver, 0), 4096), CudaError);
  EXPECT_THROW(DeviceMemory(PrimaryContext(*driver, 0), 4096), CudaError);
  try {
    driver->api("cuMemAlloc");
    FAIL() << "api() without a driver did not throw";
  } catch (const CudaError& e) {
    EXPECT_EQ(e.call(), "cuMemAlloc");
  }
}

TEST(CudaDriverTest, ErrorTextAndCheckWithoutDriver) {
  auto driver = CudaDriver::Load("/nonexistent/libcuda.so.1");
  EXPECT_EQ(driver->ErrorText(100), "CUDA_ERROR_NO_DEVICE (100)");
  EXPECT_EQ(driver->ErrorText(12345), "CUDA error 12345");
  EXPECT_NO_THROW(driver->Check(cuda::kSuccess, "cuNothing"));
  try {
    driver->Check(cuda::kErrorOutOfMemory, "cuMemAlloc");
    FAIL() << "Check did not throw";
  } catch (const CudaError& e) {
    EXPECT_EQ(e.code(), cuda::kErrorOutOfMemory);
    EXPECT_EQ(e.call(), "cuMemAlloc");
    EXPECT_STREQ(e.what(), "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2)");
  }
}

// ---------------------------------------------------------------------------------------------
// CuFile without a usable library

TEST(CuFileTest, MissingLibraryIsUnavailableWithReason) {
  auto cufile = CuFile::Load("/nonexistent/tensortier/libcufile.so.0");
  EXPECT_FALSE(cufile->available());
  EXPECT_TRUE(
      Contains(cufile->why_unavailable(), "/nonexistent/tensortier/libcufile.so.0 not found"))
      << cufile->why_unavailable();
}

TEST(CuFileTest, FileThatIsNoLibraryIsUnavailableWithReason) {
  TempDir dir;
  const std::string path = WriteNotALibrary(dir);
  auto cufile = CuFile::Load(path);
  EXPECT_FALSE(cufile->available());
  EXPECT_TRUE(Contains(cufile->why_unavailable(), path + " could not be loaded: "))
      << cufile->why_unavailable();
}

TEST(CuFileTest, LibraryWithoutCuFileSymbolsIsUnavailableWithReason) {
  auto cufile = CuFile::Load("libc.so.6");
  EXPECT_FALSE(cufile->available());
  EXPECT_TRUE(Contains(cufile->why_unavailable(), "libc.so.6 lacks cuFileDriverOpen"))
      << cufile->why_unavailable();
}

TEST(CuFileTest, EnvironmentVariableOverridesTheLibrary) {
  ScopedEnv env("TENSORTIER_CUFILE_LIBRARY", "/nonexistent/override/libcufile.so");
  EXPECT_EQ(CuFile::DefaultLibrary(), "/nonexistent/override/libcufile.so");
  ScopedEnv unset("TENSORTIER_CUFILE_LIBRARY", std::nullopt);
  EXPECT_EQ(CuFile::DefaultLibrary(), "libcufile.so.0");
}

TEST(CuFileTest, GetNeverThrowsAndExplainsItself) {
  const CuFile& cufile = CuFile::Get();
  EXPECT_EQ(&cufile, &CuFile::Get());
  EXPECT_EQ(cufile.available(), cufile.why_unavailable().empty()) << cufile.why_unavailable();
  if (!cufile.available())
    std::cout << "cuFile unavailable here: " << cufile.why_unavailable() << "\n";
}

TEST(CuFileTest, HandlesAndBuffersWithoutCuFileThrow) {
  auto cufile = CuFile::Load("/nonexistent/libcufile.so.0");
  try {
    CuFileHandle handle(*cufile, 0, "/some/file");
    FAIL() << "CuFileHandle without cuFile did not throw";
  } catch (const CuFileError& e) {
    EXPECT_EQ(e.code(), -1);
    EXPECT_EQ(e.call(), "cuFileHandleRegister");
    EXPECT_TRUE(Contains(e.what(), "cuFile unavailable: /nonexistent/libcufile.so.0 not found"))
        << e.what();
  }
  std::vector<uint8_t> host(4096);
  EXPECT_THROW(CuFileBuffer(*cufile, host.data(), host.size()), CuFileError);
}

// libcufile 1.20.0 spun for minutes in cuFileDriverOpen without libcuda.so.1: it is not called.
TEST(CuFileTest, PlatformWithoutACudaDriverIsUnusable) {
  auto driver = CudaDriver::Load("/nonexistent/libcuda.so.1");
  const CuFilePlatform platform = CuFilePlatform::Probe(*driver);
  EXPECT_TRUE(Contains(platform.unusable, "no usable CUDA driver")) << platform.unusable;
  EXPECT_TRUE(Contains(platform.unusable, "/nonexistent/libcuda.so.1")) << platform.unusable;
  EXPECT_EQ(platform.compat_mode, "");
}

TEST(CuFileTest, ErrorNames) {
  EXPECT_EQ(CuFile::ErrorName(5001), "CU_FILE_DRIVER_NOT_INITIALIZED (5001)");
  EXPECT_EQ(CuFile::ErrorName(5050), "CU_FILE_IO_MAX_ERROR (5050)");
  EXPECT_EQ(CuFile::ErrorName(-5011), "CU_FILE_CUDA_DRIVER_ERROR (5011)");
  EXPECT_EQ(CuFile::ErrorName(5999), "cuFile error 5999");
}

TEST(CuFileTest, DescriptorLayoutMatchesCufileH) {
  // cufile.h: { enum type; union { int fd; void* handle; } handle; const CUfileFSOps_t* fs_ops; }
  EXPECT_EQ(sizeof(cufile::CUfileDescr_t), 24u);
  EXPECT_EQ(offsetof(cufile::CUfileDescr_t, handle), 8u);
  EXPECT_EQ(offsetof(cufile::CUfileDescr_t, fs_ops), 16u);
  EXPECT_EQ(sizeof(cufile::CUfileError_t), 8u);
}

// ---------------------------------------------------------------------------------------------
// With a GPU

class CudaGpuTest : public testing::CudaDriverSuite {
 protected:
  const CudaDriver& driver_ = CudaDriver::Get();
};

TEST_F(CudaGpuTest, LocateTellsDeviceRegisteredAndPageableMemoryApart) {
  PrimaryContext context(driver_, 0);
  DeviceMemory device(context, 1 << 20);
  PointerLocation d = driver_.Locate(reinterpret_cast<const void*>(device.address()));
  EXPECT_EQ(d.type, MemoryType::kDevice) << MemoryTypeName(d.type);
  EXPECT_EQ(d.device, 0);

  AlignedBuffer pageable(1 << 20);
  EXPECT_EQ(driver_.Locate(pageable.data()).type, MemoryType::kHost);
  {
    HostRegistration registration(context, pageable.data(), pageable.size());
    EXPECT_EQ(driver_.Locate(pageable.data()).type, MemoryType::kRegisteredHost);
  }
  EXPECT_EQ(driver_.Locate(pageable.data()).type, MemoryType::kHost);

  PinnedHostMemory pinned(context, 1 << 20);
  EXPECT_EQ(driver_.Locate(pinned.data()).type, MemoryType::kRegisteredHost);
}

TEST_F(CudaGpuTest, IsPinnedHostAnswersForMemoryPinnedByAnyoneOverItsWholeRange) {
  PrimaryContext context(driver_, 0);
  constexpr size_t kBytes = 1 << 20;
  AlignedBuffer pageable(2 * kBytes);
  auto* base = static_cast<std::byte*>(pageable.data());
  EXPECT_FALSE(driver_.IsPinnedHost(base, kBytes));
  {
    // Registered straight through the driver, as another library would: no tensortier object
    // records it.
    const CudaApi& api = driver_.api();
    {
      ScopedContext current(context);
      driver_.Check(api.MemHostRegister(base, kBytes, cuda::kMemHostRegisterPortable),
                    "cuMemHostRegister");
    }
    EXPECT_TRUE(driver_.IsPinnedHost(base, kBytes));
    EXPECT_TRUE(driver_.IsPinnedHost(base + 4096, kBytes - 4096));  // a part of it
    EXPECT_TRUE(driver_.IsPinnedHost(base + kBytes - 1, 1));
    EXPECT_TRUE(driver_.IsPinnedHost(base + 8, 0));
    // Starts in the registration, ends past it: its tail is pageable.
    EXPECT_FALSE(driver_.IsPinnedHost(base + 4096, kBytes));
    EXPECT_FALSE(driver_.IsPinnedHost(base + kBytes, 4096));
    ScopedContext current(context);
    driver_.Check(api.MemHostUnregister(base), "cuMemHostUnregister");
  }
  EXPECT_FALSE(driver_.IsPinnedHost(base, kBytes));
  PinnedHostMemory pinned(context, kBytes);
  EXPECT_TRUE(driver_.IsPinnedHost(pinned.data(), kBytes));
  DeviceMemory device(context, kBytes);
  EXPECT_FALSE(driver_.IsPinnedHost(reinterpret_cast<const void*>(device.address()), kBytes));
}

TEST_F(CudaGpuTest, StreamAndEventRoundTripThroughDeviceMemory) {
  PrimaryContext context(driver_, 0);
  Stream stream(context);
  Event event(context);
  constexpr size_t kBytes = (8 << 20) + 3;
  PinnedHostMemory src(context, kBytes), dst(context, kBytes);
  testing::FillPattern(src.data(), kBytes, 11);
  std::memset(dst.data(), 0, kBytes);
  DeviceMemory device(context, kBytes);
  stream.CopyToDevice(device.address(), src.data(), kBytes);
  stream.CopyFromDevice(dst.data(), device.address(), kBytes);
  event.Record(stream.get());
  event.Synchronize();
  EXPECT_TRUE(event.Query());
  stream.Synchronize();
  EXPECT_TRUE(testing::MatchesPattern(dst.data(), kBytes, 11));
}

TEST_F(CudaGpuTest, ScopedContextPushesAndPops) {
  PrimaryContext context(driver_, 0);
  {
    ScopedContext current(context);
  }
  {
    ScopedContext current(context);
  }
  EXPECT_THROW(PrimaryContext(driver_, driver_.device_count()), CudaError);
}

// The fake driver itself (tests/cpp/fake_cuda): that it models what the suites above rely on to
// find ordering bugs. Skipped with a real driver or none.
class FakeCudaTest : public testing::FakeCudaDriverSuite {};

TEST_F(FakeCudaTest, CopiesFromPinnedMemoryCompleteLaterInStreamOrder) {
  const CudaDriver& driver = CudaDriver::Get();
  {
    PrimaryContext context(driver, 0);
    Stream stream(context);
    Event event(context);
    PinnedHostMemory src(context, 1 << 20), dst(context, 1 << 20);
    testing::FillPattern(src.data(), 1 << 20, 21);
    DeviceMemory device(context, 1 << 20);
    const int old = fake_.SetCopyDelay(50000);
    stream.CopyToDevice(device.address(), src.data(), 1 << 20);
    stream.CopyFromDevice(dst.data(), device.address(), 1 << 20);
    event.Record(stream.get());
    EXPECT_FALSE(event.Query()) << "the copies ran at once: ordering bugs would go unseen";
    event.Synchronize();
    EXPECT_TRUE(event.Query());
    EXPECT_TRUE(testing::MatchesPattern(dst.data(), 1 << 20, 21));
    fake_.SetCopyDelay(old);
  }
  fake_.Check();  // and everything above was given back
}

TEST_F(FakeCudaTest, UnregisteringMemoryAQueuedCopyUsesIsRecordedAndLeaksAreCounted) {
  const CudaDriver& driver = CudaDriver::Get();
  PrimaryContext context(driver, 0);
  Stream stream(context);
  AlignedBuffer host(1 << 20);
  DeviceMemory device(context, 1 << 20);
  const int violations = fake_.Violations();
  const int old = fake_.SetCopyDelay(20000);
  {
    HostRegistration registration(context, host.data(), host.size());
    stream.CopyToDevice(device.address(), host.data(), host.size());
  }  // unregistered while the copy is queued: a bug the fake reports
  stream.Synchronize();
  fake_.SetCopyDelay(old);
  EXPECT_EQ(fake_.Violations(), violations + 1);
  const int live = fake_.Live();
  {
    DeviceMemory more(context, 4096);
    EXPECT_EQ(fake_.Live(), live + 1);  // the allocation (the context is the same retain)
  }
  EXPECT_EQ(fake_.Live(), live);
}

// cuFileDriverOpen is not called where the platform is unusable (libcufile 1.20.0 spun in it
// without libcuda.so.1); the platform's compatibility-mode reason carries over.
TEST_F(FakeCudaTest, CuFileIsNotOpenedWhereThePlatformIsUnusable) {
  const std::string library = testing::FakeCudaLibrary();
  const int opens = fake_.CuFileDriverOpens();
  auto refused = CuFile::Load(
      library, CuFilePlatform{.unusable = "no driver in this test", .compat_mode = ""});
  EXPECT_FALSE(refused->available());
  EXPECT_EQ(refused->why_unavailable(), "no driver in this test");
  EXPECT_EQ(fake_.CuFileDriverOpens(), opens);
  auto opened =
      CuFile::Load(library, CuFilePlatform{.unusable = "", .compat_mode = "no nvidia-fs (test)"});
  EXPECT_TRUE(opened->available()) << opened->why_unavailable();
  EXPECT_EQ(opened->compat_mode_reason(), "no nvidia-fs (test)");
  EXPECT_EQ(fake_.CuFileDriverOpens(), opens + 1);
}

// The driver is one per process: where another library opened it first, cuFileDriverOpen may
// answer CU_FILE_DRIVER_ALREADY_OPEN, and cuFile is ready all the same. Other failures are not.
TEST_F(FakeCudaTest, CuFileOpenedByAnotherLibraryIsUsable) {
  const std::string library = testing::FakeCudaLibrary();
  const CuFilePlatform platform{.unusable = "", .compat_mode = ""};
  fake_.NextCuFileDriverOpenResult(5026);
  auto shared = CuFile::Load(library, platform);
  EXPECT_TRUE(shared->available()) << shared->why_unavailable();
  fake_.NextCuFileDriverOpenResult(5007);
  auto refused = CuFile::Load(library, platform);
  EXPECT_FALSE(refused->available());
  EXPECT_TRUE(Contains(refused->why_unavailable(), "CU_FILE_PLATFORM_NOT_SUPPORTED"))
      << refused->why_unavailable();
}

TEST_F(FakeCudaTest, CuFilePlatformProbeReportsCompatibilityModeWithoutNvidiaFs) {
  TempDir dir;
  const CuFileProbePaths paths{.udev = dir.File("udev"), .nvidia_fs = dir.File("devcount")};
  const CuFilePlatform no_udev = CuFilePlatform::Probe(CudaDriver::Get(), paths);
  EXPECT_TRUE(Contains(no_udev.unusable, paths.udev + " is not readable")) << no_udev.unusable;
  ASSERT_EQ(mkdir(paths.udev.c_str(), 0755), 0) << std::strerror(errno);
  const CuFilePlatform missing = CuFilePlatform::Probe(CudaDriver::Get(), paths);
  EXPECT_EQ(missing.unusable, "");
  EXPECT_TRUE(Contains(missing.compat_mode, "no nvidia-fs kernel driver (" + paths.nvidia_fs))
      << missing.compat_mode;
  std::ofstream(paths.nvidia_fs) << "1\n";
  const CuFilePlatform present = CuFilePlatform::Probe(CudaDriver::Get(), paths);
  EXPECT_EQ(present.unusable, "");
  EXPECT_EQ(present.compat_mode, "");
}

// cuFile's configuration (cuFileGetParameterBool) overrides what the platform suggests.
TEST_F(FakeCudaTest, CuFileConfigurationDecidesCompatibilityModeOverNvidiaFs) {
  const std::string library = testing::FakeCudaLibrary();
  const CuFilePlatform no_nvidia_fs{.unusable = "", .compat_mode = "no nvidia-fs (test)"};
  fake_.SetCuFileBoolParameter(cufile::kParamUsePciP2pdma, true);
  EXPECT_EQ(CuFile::Load(library, no_nvidia_fs)->compat_mode_reason(), "");
  fake_.SetCuFileBoolParameter(cufile::kParamForceCompatMode, true);
  const CuFilePlatform with_nvidia_fs{.unusable = "", .compat_mode = ""};
  EXPECT_EQ(CuFile::Load(library, with_nvidia_fs)->compat_mode_reason(),
            "its configuration forces compatibility mode (force_compat_mode)");
  fake_.SetCuFileBoolParameter(cufile::kParamUsePciP2pdma, false);
  fake_.SetCuFileBoolParameter(cufile::kParamForceCompatMode, false);
  EXPECT_EQ(CuFile::Load(library, no_nvidia_fs)->compat_mode_reason(), "no nvidia-fs (test)");
}

// cuFile transfers through the real CuFileHandle: short transfers are continued, failures carry
// errno or the cuFile status with the path and range.
TEST_F(FakeCudaTest, CuFileShortTransfersContinueAndFailuresAreNamed) {
  const CuFile& cufile = testing::CuFileForTests();
  ASSERT_TRUE(cufile.available()) << cufile.why_unavailable();
  TempDir dir;
  const std::string path = dir.File("gds");
  constexpr size_t kBytes = (1 << 20) + 5;
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  {
    PrimaryContext context(CudaDriver::Get(), 0);
    Stream stream(context);
    DeviceMemory device(context, kBytes);
    std::vector<uint8_t> bytes = testing::Pattern(kBytes, 31);
    stream.CopyToDevice(device.address(), bytes.data(), kBytes);
    stream.Synchronize();
    void* base = reinterpret_cast<void*>(device.address());
    CuFileHandle handle(cufile, fd, path);
    fake_.NextCuFileResult(4096);
    EXPECT_EQ(handle.Write(base, kBytes, 8192), kBytes);
    fake_.NextCuFileResult(-1, ENOSPC);
    try {
      handle.Write(base, kBytes, 8192);
      ADD_FAILURE() << "no IoError";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_code(), ENOSPC);
      EXPECT_EQ(e.path(), path);
      EXPECT_EQ(dynamic_cast<const CuFileTransferError*>(&e), nullptr);
    }
    fake_.NextCuFileResult(-5008);
    try {
      handle.Read(base, kBytes, 8192);
      ADD_FAILURE() << "no CuFileTransferError";
    } catch (const CuFileTransferError& e) {
      EXPECT_EQ(e.status(), 5008);
      EXPECT_NE(std::string(e.what()).find("CU_FILE_IO_NOT_SUPPORTED"), std::string::npos);
    }
    std::vector<uint8_t> zeros(kBytes, 0);
    stream.CopyToDevice(device.address(), zeros.data(), kBytes);
    stream.Synchronize();
    fake_.NextCuFileResult(1000);
    EXPECT_EQ(handle.Read(base, kBytes, 8192), kBytes);
    EXPECT_EQ(handle.Read(base, kBytes, 8192 + kBytes - 7), 7u) << "short at end of file";
    EXPECT_EQ(handle.Read(base, kBytes, 8192), kBytes);
    std::vector<uint8_t> out(kBytes);
    stream.CopyFromDevice(out.data(), device.address(), kBytes);
    stream.Synchronize();
    EXPECT_TRUE(testing::MatchesPattern(out.data(), kBytes, 31));
  }
  close(fd);
  fake_.Check();
}

TEST(CuFileGpuTest, RoundTripThroughDeviceMemory) {
  if (!CudaDriver::Get().available()) {
    GTEST_SKIP() << "CUDA driver unavailable: " << CudaDriver::Get().why_unavailable();
  }
  if (!testing::CuFileForTests().available()) {
    GTEST_SKIP() << "cuFile unavailable: " << testing::CuFileForTests().why_unavailable();
  }
  TempDir dir;
  const std::string path = dir.File("gds");
  constexpr size_t kBytes = 4 << 20;
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0 && errno == EINVAL) {
    GTEST_SKIP() << "the test directory's file system refuses O_DIRECT, which cuFile needs";
  }
  ASSERT_GE(fd, 0) << std::strerror(errno);
  PrimaryContext context(CudaDriver::Get(), 0);
  ScopedContext current(context);  // cuFile works on the current context
  DeviceMemory device(context, kBytes);
  PinnedHostMemory host(context, kBytes);
  testing::FillPattern(host.data(), kBytes, 12);
  Stream stream(context);
  stream.CopyToDevice(device.address(), host.data(), kBytes);
  stream.Synchronize();
  {
    CuFileHandle handle(testing::CuFileForTests(), fd, path);
    CuFileBuffer registered(testing::CuFileForTests(), reinterpret_cast<void*>(device.address()),
                            kBytes);
    void* base = reinterpret_cast<void*>(device.address());
    EXPECT_EQ(handle.Write(base, kBytes, 0), kBytes);
    std::memset(host.data(), 0, kBytes);
    stream.CopyToDevice(device.address(), host.data(), kBytes);  // clear the device copy
    stream.Synchronize();
    EXPECT_EQ(handle.Read(base, kBytes, 0), kBytes);
    EXPECT_EQ(handle.Read(base, kBytes, kBytes - 4096), 4096u) << "short at end of file";
    EXPECT_EQ(handle.Read(base, kBytes, 0), kBytes);
  }
  stream.CopyFromDevice(host.data(), device.address(), kBytes);
  stream.Synchronize();
  EXPECT_TRUE(testing::MatchesPattern(host.data(), kBytes, 12));
  close(fd);
}

// A fresh thread has no current context: the buffer makes its memory's device's context current
// around registering and deregistering.
TEST(CuFileGpuTest, BufferRegistersWithoutACurrentContext) {
  if (!CudaDriver::Get().available()) {
    GTEST_SKIP() << "CUDA driver unavailable: " << CudaDriver::Get().why_unavailable();
  }
  if (!testing::CuFileForTests().available()) {
    GTEST_SKIP() << "cuFile unavailable: " << testing::CuFileForTests().why_unavailable();
  }
  PrimaryContext context(CudaDriver::Get(), 0);
  DeviceMemory device(context, 1 << 20);
  std::string error;
  std::thread([&] {
    try {
      CuFileBuffer registered(testing::CuFileForTests(), reinterpret_cast<void*>(device.address()),
                              1 << 20);
      if (registered.device() != 0) error = StrCat("device ", registered.device());
      CuFileBuffer moved(std::move(registered));
    } catch (const std::exception& e) {
      error = e.what();
    }
  }).join();
  EXPECT_EQ(error, "");
}

}  // namespace
}  // namespace tensortier
