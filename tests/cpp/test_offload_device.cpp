// OffloadDevice::Wait's rule against the stand-in CUDA driver on CI (the real one on a GPU
// machine): every device move's outcome is reported once, a move the offloader applied never as
// failed, a failed one with its error, and the bytes counted by path for the moves done.
#include <gtest/gtest.h>

#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fake_cuda/fake_cuda_hooks.hpp"
#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/offload/offload_device.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/transfer/transfer.hpp"
#include "tensortier/util/error.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::kMiB;

class OffloadDeviceTest : public testing::CudaDriverSuite {
 protected:
  testing::TempDir dir_;
};

TEST_F(OffloadDeviceTest, WaitReportsEachMoveOnceAndCountsTheDoneOnes) {
  const CudaDriver& driver = CudaDriver::Get();
  PrimaryContext context(driver, 0);
  OffloaderOptions o;
  o.dirs = {dir_.path()};
  o.engine = testing::SmallEngineOptions(BackendKind::kThreads, kMiB);
  Offloader off(o);
  OffloadDevice device(off, GdsMode::kOff, [&driver](Engine& engine) {
    DeviceTransferOptions t;
    t.ring.slots = 2;
    t.ring.slot_bytes = kMiB;
    t.max_rings = 2;
    return std::make_unique<DeviceTransfer>(engine, t, driver);
  });
  EXPECT_EQ(device.transfer(), nullptr);
  Stream stream(context);
  const uint64_t length = 2 * kMiB + 5;
  DeviceMemory memory(context, length);
  const std::vector<uint8_t> src = testing::Pattern(length, 7);
  stream.CopyToDevice(memory.address(), src.data(), length);
  const DeviceSpan span{memory.address(), 0, stream.get()};

  device.Submit(OffloadKind::kWrite, 1, span, length);
  device.Submit(OffloadKind::kWrite, 2, span, length);
  device.Submit(OffloadKind::kWrite, 3, span, 0);
  EXPECT_NE(device.transfer(), nullptr);
  EXPECT_EQ(device.Jobs(OffloadKind::kWrite, std::vector<uint64_t>{3, 1}).size(), 2u);
  std::vector<OffloadOutcome> out = device.Wait(OffloadKind::kWrite, std::nullopt);
  ASSERT_EQ(out.size(), 3u);
  for (const OffloadOutcome& r : out) EXPECT_EQ(r.error, nullptr) << r.key;
  EXPECT_TRUE(off.stored(1) && off.stored(2) && off.stored(3));
  EXPECT_EQ(device.device_bytes(), (std::map<std::string, uint64_t>{{"bounce", 2 * length}}));
  EXPECT_TRUE(device.Wait(OffloadKind::kWrite, std::nullopt).empty());  // reported once

  // Done, so applied: the key is gone, the outcome a success, its bytes counted.
  DeviceMemory back(context, length);
  device.Submit(OffloadKind::kRead, 1, {back.address(), 0, stream.get()}, length);
  out = device.Wait(OffloadKind::kRead, std::vector<uint64_t>{1});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].key, 1u);
  EXPECT_EQ(out[0].error, nullptr);
  EXPECT_FALSE(off.stored(1));
  EXPECT_EQ(device.device_bytes().at("bounce"), 3 * length);
  std::vector<uint8_t> copy(length);
  stream.CopyFromDevice(copy.data(), back.address(), length);
  stream.Synchronize();
  EXPECT_TRUE(testing::MatchesPattern(copy.data(), length, 7));

  // Failed (the backing file cut short): reported once with its error, the key still stored,
  // nothing counted; a wait for other keys leaves it in flight.
  ASSERT_EQ(truncate(off.paths()[0].c_str(), 0), 0);
  device.Submit(OffloadKind::kRead, 2, {back.address(), 0, stream.get()}, length);
  EXPECT_TRUE(device.Wait(OffloadKind::kRead, std::vector<uint64_t>{3}).empty());
  out = device.Wait(OffloadKind::kRead, std::nullopt);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].key, 2u);
  ASSERT_NE(out[0].error, nullptr);
  try {
    std::rethrow_exception(out[0].error);
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EIO) << e.what();
  }
  EXPECT_TRUE(off.stored(2));
  EXPECT_EQ(device.device_bytes().at("bounce"), 3 * length);
  EXPECT_TRUE(device.Wait(OffloadKind::kRead, std::nullopt).empty());
  device.Close();
  EXPECT_EQ(device.transfer(), nullptr);
}

}  // namespace
}  // namespace tensortier
