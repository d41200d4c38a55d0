// What the GPU suites check when they run against the fake CUDA driver (fake_libcuda.cpp): no
// misuse it recorded, and every stream, event, registration, allocation and context retain they
// made given back by the end of the test (RAII). Nothing is checked with a real driver.
#pragma once

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <string>

#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/cuda/cufile.hpp"

namespace tensortier::testing {

// The fake driver's library when TENSORTIER_CUDA_LIBRARY names it, else "".
inline std::string FakeCudaLibrary() {
  const char* path = std::getenv("TENSORTIER_CUDA_LIBRARY");
  if (path == nullptr || *path == '\0') return "";
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return "";
  const bool fake = dlsym(handle, "fakecuda_live") != nullptr;
  dlclose(handle);
  return fake ? path : "";
}

// cuFile for the GPU suites: the fake's (same library, no platform checks) with the fake driver,
// else the system's.
inline const CuFile& CuFileForTests() {
  static const CuFile* const cufile = [] {
    const std::string fake = FakeCudaLibrary();
    return fake.empty() ? &CuFile::Get() : CuFile::Load(fake, /*check_platform=*/false).release();
  }();
  return *cufile;
}

class FakeCudaAccounting {
 public:
  // True when the loaded CUDA library is the fake (its hooks resolve).
  bool Start() {
    const std::string path = FakeCudaLibrary();
    if (path.empty()) return false;
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);  // CudaDriver's
    if (handle == nullptr) return false;
    violations_ = reinterpret_cast<int (*)(char*, size_t)>(dlsym(handle, "fakecuda_violations"));
    live_ = reinterpret_cast<int (*)()>(dlsym(handle, "fakecuda_live"));
    set_delay_ = reinterpret_cast<int (*)(int)>(dlsym(handle, "fakecuda_set_copy_delay_us"));
    next_result_ =
        reinterpret_cast<void (*)(long, int)>(dlsym(handle, "fakecuda_cufile_next_result"));
    driver_opens_ = reinterpret_cast<int (*)()>(dlsym(handle, "fakecuda_cufile_driver_opens"));
    next_open_ =
        reinterpret_cast<void (*)(int)>(dlsym(handle, "fakecuda_cufile_next_driver_open_result"));
    set_bool_ =
        reinterpret_cast<void (*)(int, int)>(dlsym(handle, "fakecuda_cufile_set_bool_parameter"));
    next_register_ =
        reinterpret_cast<void (*)(int)>(dlsym(handle, "fakecuda_next_host_register_result"));
    dlclose(handle);  // drops our reference only: CudaDriver keeps the library loaded
    if (violations_ == nullptr || live_ == nullptr || set_delay_ == nullptr ||
        next_result_ == nullptr || driver_opens_ == nullptr || next_open_ == nullptr ||
        set_bool_ == nullptr || next_register_ == nullptr) {
      return false;
    }
    live_at_start_ = live_();
    violations_at_start_ = violations_(nullptr, 0);
    return true;
  }

  // Copies and records queued from now on start after `us` microseconds; returns the old value.
  int SetCopyDelay(int us) const { return set_delay_(us); }
  int Violations() const { return violations_(nullptr, 0); }
  // The next cuFileRead/Write moves at most `result` bytes (> 0), or returns `result` (< 0: -1
  // with errno `error`, or a negated cuFile status).
  void NextCuFileResult(long result, int error = 0) const { next_result_(result, error); }
  int Live() const { return live_(); }
  // cuFileDriverOpen calls so far (the stand-in counts them).
  int CuFileDriverOpens() const { return driver_opens_(); }
  // What the next cuFileDriverOpen answers (a cuFile status).
  void NextCuFileDriverOpenResult(int status) const { next_open_(status); }
  // What the stand-in's cuFileGetParameterBool answers for `param` from now on.
  void SetCuFileBoolParameter(int param, bool value) const { set_bool_(param, value ? 1 : 0); }
  // What the next cuMemHostRegister answers (a CUresult).
  void NextHostRegisterResult(int result) const { next_register_(result); }

  void Check() const {
    if (live_ == nullptr) return;
    EXPECT_EQ(live_(), live_at_start_)
        << "streams, events, registrations, allocations or context retains left behind";
    std::string text(1 << 16, '\0');
    const int n = violations_(text.data(), text.size());
    text.resize(text.find('\0'));
    EXPECT_EQ(n, violations_at_start_) << "misuse the fake CUDA driver recorded:\n" << text;
  }

 private:
  int (*violations_)(char*, size_t) = nullptr;
  int (*live_)() = nullptr;
  int (*set_delay_)(int) = nullptr;
  void (*next_result_)(long, int) = nullptr;
  int (*driver_opens_)() = nullptr;
  void (*next_open_)(int) = nullptr;
  void (*set_bool_)(int, int) = nullptr;
  void (*next_register_)(int) = nullptr;
  int live_at_start_ = 0;
  int violations_at_start_ = 0;
};

// A suite that needs a CUDA driver, the real one or the stand-in: skipped without one. On the
// stand-in it checks at the end that the test left nothing behind and misused nothing.
class CudaDriverSuite : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaDriver::Get().available()) {
      GTEST_SKIP() << "CUDA driver unavailable: " << CudaDriver::Get().why_unavailable();
    }
    fake_ = accounting_.Start();
  }
  void TearDown() override { accounting_.Check(); }
  FakeCudaAccounting accounting_;
  bool fake_ = false;  // the driver is the stand-in (failures can be injected)
};

// A suite only the stand-in can stage (injected failures, a platform without nvidia-fs): skipped
// with a real driver or none, so that the suites above never skip on a GPU (scripts/gpu-test.sh
// fails a GPU run whose GPU suites skipped).
class FakeCudaDriverSuite : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaDriver::Get().available() || !fake_.Start()) {
      GTEST_SKIP() << "not running on the fake CUDA driver";
    }
  }
  FakeCudaAccounting fake_;
};

}  // namespace tensortier::testing
