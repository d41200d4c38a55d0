// Device memory offloaded through DeviceTransfer's bounce rings (OffloadFromDevice /
// RestoreToDevice) and the Offloader's Begin/Finish API beneath them. On CI the "device" is host
// memory moved by MemcpyCopier (asynchronous, optionally failing), and engine faults come from the
// fault-injecting backend; the GPU suite at the end runs against the stand-in driver on CI and the
// real one on a GPU machine.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fake_cuda/fake_cuda_hooks.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/transfer/device_copier.hpp"
#include "tensortier/transfer/device_jobs.hpp"
#include "tensortier/offload/device_offload.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/util/strings.hpp"
#include "tensortier/transfer/transfer.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::FillPattern;
using testing::MatchesPattern;
using testing::Plan;
using testing::TempDir;

constexpr uint64_t kSlot = 64 << 10;
using testing::kMiB;

// "Device" memory for MemcpyCopier: host memory `misalign` bytes past a page boundary.
class HostDevice {
 public:
  HostDevice(uint64_t length, size_t misalign)
      : mem_(static_cast<size_t>(length) + misalign + 1), misalign_(misalign) {}
  uint8_t* data() const { return reinterpret_cast<uint8_t*>(mem_.data()) + misalign_; }
  DeviceSpan span() const { return {reinterpret_cast<uint64_t>(data()), 0, std::nullopt}; }

 private:
  AlignedBuffer mem_;
  size_t misalign_;
};

int ErrnoOf(const std::exception& e) {
  const auto* io = dynamic_cast<const IoError*>(&e);
  return io != nullptr ? io->error_code() : 0;
}

class DeviceOffloadTest : public testing::BackendTest {
 protected:
  OffloaderOptions Options(std::vector<std::string> dirs = {}) {
    OffloaderOptions o;
    o.dirs = dirs.empty() ? std::vector<std::string>{dir_.path()} : std::move(dirs);
    o.engine = testing::SmallEngineOptions(GetParam(), kSlot);
    return o;
  }

  OffloaderOptions FaultyOptions(const FaultPlan& plan) {
    OffloaderOptions o = Options();
    auto injector = std::make_shared<FaultInjector>(plan);
    BackendKind kind = GetParam();
    o.backend_factory = [kind, injector](unsigned depth) {
      return MakeFaultInjectingBackend(MakeBackend(kind, depth), injector);
    };
    return o;
  }

  // A DeviceTransfer on the offloader's engine whose copies are MemcpyCopier's.
  static std::unique_ptr<DeviceTransfer> Transfer(Offloader& off, MemcpyCopierOptions copier = {},
                                                  size_t max_rings = 2) {
    DeviceTransferOptions o;
    o.ring.slots = 3;
    o.ring.slot_bytes = kSlot;
    o.max_rings = max_rings;
    PinnedPoolOptions pool;
    pool.budget_bytes = max_rings * o.ring.bytes();
    pool.register_with_cuda = false;
    return std::make_unique<DeviceTransfer>(
        off.engine(), o,
        [copier](const DeviceSpan&) -> std::unique_ptr<DeviceCopier> {
          return std::make_unique<MemcpyCopier>(copier);
        },
        pool);
  }

  TempDir dir_;
};

TEST_P(DeviceOffloadTest, RoundTripSizesAndAlignments) {
  Offloader off(Options());
  auto transfer = Transfer(off);
  uint64_t key = 1;
  for (uint64_t length :
       {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{4097}, kSlot * 3 + 17, 3 * kMiB + 5}) {
    for (size_t misalign : {size_t{0}, size_t{1}, size_t{513}}) {
      SCOPED_TRACE(StrCat("length=", length, " misalign=", misalign));
      HostDevice src(length, misalign);
      FillPattern(src.data(), length, key);
      TransferResult w = OffloadFromDevice(off, *transfer, key, src.span(), length);
      EXPECT_EQ(w.bytes, length);
      EXPECT_TRUE(off.stored(key));
      EXPECT_FALSE(off.pending(key));
      EXPECT_EQ(off.stored_bytes(), length);
      // Nothing of it waits in the offloader's own queue.
      EXPECT_TRUE(off.Wait(OffloadKind::kWrite).empty());

      HostDevice dst(length, misalign + 7);
      std::memset(dst.data(), 0xEE, length);
      TransferResult r = RestoreToDevice(off, *transfer, key, dst.span(), length);
      EXPECT_EQ(r.bytes, length);
      if (length > 0) {
        EXPECT_EQ(r.path, "bounce");
        EXPECT_EQ(r.copier, "memcpy");
      }
      EXPECT_TRUE(MatchesPattern(dst.data(), length, key));
      EXPECT_FALSE(off.stored(key));
      EXPECT_FALSE(off.pending(key));
      EXPECT_EQ(off.stored_bytes(), 0u);
      ++key;
    }
  }
  // Space is reused: everything was read back, so nothing is allocated any more.
  off.Trim();
  EXPECT_EQ(off.file_bytes(), 0u);
}

// The async forms run on the transfer's job queue and apply the same outcome when their job is
// over: stored keys after the writes, gone after the reads, errors kept by their jobs.
TEST_P(DeviceOffloadTest, AsyncJobsApplyTheirOutcomeWhenOver) {
  Offloader off(Options());
  auto transfer = Transfer(off);
  constexpr uint64_t kKeys = 6;
  const uint64_t length = 2 * kSlot + 99;
  std::vector<std::unique_ptr<HostDevice>> src, dst;
  std::vector<DeviceJob> writes;
  for (uint64_t key = 1; key <= kKeys; ++key) {
    src.push_back(std::make_unique<HostDevice>(length, key));
    FillPattern(src.back()->data(), length, key);
    writes.push_back(OffloadFromDeviceAsync(off, *transfer, key, src.back()->span(), length));
  }
  for (uint64_t key = 1; key <= kKeys; ++key) {
    EXPECT_EQ(writes[key - 1].Wait().bytes, length);
    EXPECT_TRUE(off.stored(key));
  }
  EXPECT_EQ(off.stored_bytes(), kKeys * length);
  // A key never written: the job's error, nothing else changes.
  HostDevice stray(length, 0);
  DeviceJob bad = RestoreToDeviceAsync(off, *transfer, 99, stray.span(), length);
  EXPECT_THROW(bad.Wait(), std::invalid_argument);
  std::vector<DeviceJob> reads;
  for (uint64_t key = 1; key <= kKeys; ++key) {
    dst.push_back(std::make_unique<HostDevice>(length, key + 3));
    reads.push_back(RestoreToDeviceAsync(off, *transfer, key, dst.back()->span(), length));
  }
  for (uint64_t key = 1; key <= kKeys; ++key) {
    EXPECT_EQ(reads[key - 1].Wait().path, "bounce");
    EXPECT_TRUE(MatchesPattern(dst[key - 1]->data(), length, key));
    EXPECT_FALSE(off.stored(key));
  }
  EXPECT_EQ(off.stored_bytes(), 0u);
}

TEST_P(DeviceOffloadTest, DeviceAndHostKeysShareTheFiles) {
  Offloader off(Options());
  auto transfer = Transfer(off);
  const uint64_t length = 300001;
  HostDevice device(length, 3);
  FillPattern(device.data(), length, 7);
  std::vector<uint8_t> host = testing::Pattern(length, 8);
  off.AsyncWrite(2, host.data(), length);
  OffloadFromDevice(off, *transfer, 1, device.span(), length);
  ASSERT_EQ(off.Wait(OffloadKind::kWrite).size(), 1u);
  EXPECT_EQ(off.stored_bytes(), 2 * length);

  std::vector<uint8_t> host_back(length);
  off.AsyncRead(2, host_back.data(), length);
  HostDevice device_back(length, 0);
  RestoreToDevice(off, *transfer, 1, device_back.span(), length);
  std::vector<OffloadOutcome> reads = off.Wait(OffloadKind::kRead);
  ASSERT_EQ(reads.size(), 1u);
  EXPECT_EQ(reads[0].key, 2u);
  EXPECT_EQ(reads[0].error, nullptr);
  EXPECT_TRUE(MatchesPattern(device_back.data(), length, 7));
  EXPECT_TRUE(MatchesPattern(host_back.data(), length, 8));
  EXPECT_EQ(off.stored_bytes(), 0u);
}

TEST_P(DeviceOffloadTest, BadKeysThrowBeforeAnythingMoves) {
  Offloader off(Options());
  auto transfer = Transfer(off);
  HostDevice d(4096, 0);
  FillPattern(d.data(), 4096, 1);
  EXPECT_THROW(RestoreToDevice(off, *transfer, 1, d.span(), 4096), std::invalid_argument);
  OffloadFromDevice(off, *transfer, 1, d.span(), 4096);
  EXPECT_THROW(OffloadFromDevice(off, *transfer, 1, d.span(), 4096), std::invalid_argument);
  EXPECT_THROW(RestoreToDevice(off, *transfer, 1, d.span(), 4095), std::invalid_argument);
  EXPECT_TRUE(off.stored(1));
  HostDevice back(4096, 0);
  RestoreToDevice(off, *transfer, 1, back.span(), 4096);
  EXPECT_TRUE(MatchesPattern(back.data(), 4096, 1));
  // A Finish without its Begin changes nothing.
  off.FinishWrite(1, nullptr);
  off.FinishRead(1, nullptr);
  EXPECT_FALSE(off.stored(1));
}

// A key begun by one caller is off limits to everyone else until it is finished.
TEST_P(DeviceOffloadTest, BegunKeysAreClaimed) {
  Offloader off(Options());
  std::vector<OffloadExtent> extents = off.BeginWrite(5, 10000);
  ASSERT_EQ(extents.size(), 1u);
  EXPECT_EQ(extents[0].data_offset, 0u);
  EXPECT_EQ(extents[0].length, 10000u);
  EXPECT_EQ(extents[0].file_offset % 4096, 0u);
  EXPECT_TRUE(off.pending(5));
  EXPECT_FALSE(off.stored(5));
  std::vector<uint8_t> host(10000);
  EXPECT_THROW(off.AsyncWrite(5, host.data(), 10000), std::invalid_argument);
  EXPECT_THROW(off.AsyncRead(5, host.data(), 10000), std::invalid_argument);
  EXPECT_THROW(off.Discard(5), std::invalid_argument);
  EXPECT_THROW(off.BeginRead(5, 10000), std::invalid_argument);
  // A finish of the other kind is not this operation's.
  off.FinishRead(5, nullptr);
  EXPECT_TRUE(off.pending(5));
  // The caller writes the bytes itself (the extent's File stays usable), then finishes.
  std::vector<uint8_t> bytes = testing::Pattern(10000, 9);
  ASSERT_EQ(pwrite(extents[0].file.buffered_fd(), bytes.data(), bytes.size(),
                   static_cast<off_t>(extents[0].file_offset)),
            10000);
  off.FinishWrite(5, nullptr);
  EXPECT_TRUE(off.stored(5));
  off.AsyncRead(5, host.data(), 10000);
  ASSERT_EQ(off.Wait(OffloadKind::kRead).size(), 1u);
  EXPECT_TRUE(MatchesPattern(host.data(), 10000, 9));
}

TEST_P(DeviceOffloadTest, FailedBeginsChangeNothing) {
  Offloader off(Options());
  // A read of an unknown key, a write of a zero-free key twice.
  EXPECT_THROW(off.BeginRead(1, 1), std::invalid_argument);
  off.BeginWrite(1, 1);
  off.FinishWrite(1, std::make_exception_ptr(std::runtime_error("caller failed")));
  EXPECT_FALSE(off.stored(1));
  EXPECT_FALSE(off.pending(1));
  EXPECT_EQ(off.stored_bytes(), 0u);
  off.Trim();
  EXPECT_EQ(off.file_bytes(), 0u);
  off.Close();
  EXPECT_THROW(off.BeginWrite(2, 1), std::logic_error);
}

TEST_P(DeviceOffloadTest, WriteErrorsLeaveTheKeyUnknownAndFreeItsSpace) {
  for (int error : {EIO, ENOSPC}) {
    SCOPED_TRACE(StrCat("errno=", error));
    FaultPlan plan = Plan(FaultPlan::Kind::kError, false, true, /*nth=*/2);
    plan.error = error;
    Offloader off(FaultyOptions(plan));
    auto transfer = Transfer(off);
    const uint64_t length = 5 * kSlot + 3;
    HostDevice d(length, 1);
    FillPattern(d.data(), length, 3);
    try {
      OffloadFromDevice(off, *transfer, 1, d.span(), length);
      ADD_FAILURE() << "the write did not fail";
    } catch (const IoError& e) {
      EXPECT_EQ(ErrnoOf(e), error) << e.what();
      EXPECT_NE(std::string(e.what()).find(off.paths()[0]), std::string::npos) << e.what();
    }
    EXPECT_FALSE(off.stored(1));
    EXPECT_FALSE(off.pending(1));
    EXPECT_EQ(off.stored_bytes(), 0u);
    EXPECT_TRUE(MatchesPattern(d.data(), length, 3));  // the device memory is untouched
    off.Trim();
    EXPECT_EQ(off.file_bytes(), 0u);
    // The fault was one request: the same key can be written now, and read back.
    OffloadFromDevice(off, *transfer, 1, d.span(), length);
    HostDevice back(length, 0);
    RestoreToDevice(off, *transfer, 1, back.span(), length);
    EXPECT_TRUE(MatchesPattern(back.data(), length, 3));
  }
}

TEST_P(DeviceOffloadTest, ReadErrorsKeepTheKeyStoredAndARetryWorks) {
  Offloader off(FaultyOptions(Plan(FaultPlan::Kind::kError, true, false, /*nth=*/2)));
  auto transfer = Transfer(off);
  const uint64_t length = 4 * kSlot + 1;
  HostDevice d(length, 0);
  FillPattern(d.data(), length, 4);
  OffloadFromDevice(off, *transfer, 1, d.span(), length);
  HostDevice back(length, 5);
  EXPECT_THROW(RestoreToDevice(off, *transfer, 1, back.span(), length), IoError);
  EXPECT_TRUE(off.stored(1));
  EXPECT_FALSE(off.pending(1));
  EXPECT_EQ(off.stored_bytes(), length);
  RestoreToDevice(off, *transfer, 1, back.span(), length);
  EXPECT_TRUE(MatchesPattern(back.data(), length, 4));
  EXPECT_FALSE(off.stored(1));
}

TEST_P(DeviceOffloadTest, ShortTransfersAreContinued) {
  // At most 1000 bytes per faulted request (halving a 1-byte tail would make no progress).
  FaultPlan plan = Plan(FaultPlan::Kind::kShort, true, true, /*nth=*/1, /*count=*/40);
  plan.short_bytes = 1000;
  Offloader off(FaultyOptions(plan));
  auto transfer = Transfer(off);
  const uint64_t length = 6 * kSlot + 99;
  HostDevice d(length, 0);
  FillPattern(d.data(), length, 6);
  OffloadFromDevice(off, *transfer, 1, d.span(), length);
  HostDevice back(length, 0);
  RestoreToDevice(off, *transfer, 1, back.span(), length);
  EXPECT_TRUE(MatchesPattern(back.data(), length, 6));
}

// A copy that fails (a device fault) fails the operation like an I/O error: a write leaves
// nothing stored, a read keeps the key.
TEST_P(DeviceOffloadTest, CopyFailuresKeepTheData) {
  Offloader off(Options());
  const uint64_t length = 4 * kSlot;
  HostDevice d(length, 0);
  FillPattern(d.data(), length, 2);
  {
    MemcpyCopierOptions failing;
    failing.fail_nth = 2;
    auto transfer = Transfer(off, failing, 1);
    EXPECT_THROW(OffloadFromDevice(off, *transfer, 1, d.span(), length), std::runtime_error);
    EXPECT_FALSE(off.stored(1));
    EXPECT_EQ(off.stored_bytes(), 0u);
  }
  {
    auto transfer = Transfer(off);
    OffloadFromDevice(off, *transfer, 1, d.span(), length);
  }
  HostDevice back(length, 0);
  {
    MemcpyCopierOptions failing;
    failing.fail_nth = 3;
    auto transfer = Transfer(off, failing, 1);
    EXPECT_THROW(RestoreToDevice(off, *transfer, 1, back.span(), length), std::runtime_error);
    EXPECT_TRUE(off.stored(1));
  }
  auto transfer = Transfer(off);
  RestoreToDevice(off, *transfer, 1, back.span(), length);
  EXPECT_TRUE(MatchesPattern(back.data(), length, 2));
}

TEST_P(DeviceOffloadTest, BackingFileCutShortFailsTheReadAndKeepsTheKey) {
  Offloader off(Options());
  auto transfer = Transfer(off);
  const uint64_t length = 3 * kSlot;
  HostDevice d(length, 0);
  FillPattern(d.data(), length, 5);
  OffloadFromDevice(off, *transfer, 1, d.span(), length);
  ASSERT_EQ(truncate(off.paths()[0].c_str(), static_cast<off_t>(kSlot)), 0);
  HostDevice back(length, 0);
  try {
    RestoreToDevice(off, *transfer, 1, back.span(), length);
    ADD_FAILURE() << "the read did not fail";
  } catch (const IoError& e) {
    EXPECT_EQ(ErrnoOf(e), EIO) << e.what();
  }
  EXPECT_TRUE(off.stored(1));
}

TEST_P(DeviceOffloadTest, LargeRangesAreStripedOverEveryDirectory) {
  TempDir second;
  OffloaderOptions o = Options({dir_.path(), second.path()});
  o.stripe_threshold = kMiB;
  Offloader off(o);
  auto transfer = Transfer(off);
  const uint64_t length = 2 * kMiB + 12345;
  std::vector<OffloadExtent> extents = off.BeginWrite(9, length);
  ASSERT_EQ(extents.size(), 2u);
  EXPECT_NE(extents[0].file.path(), extents[1].file.path());
  EXPECT_EQ(extents[0].data_offset, 0u);
  EXPECT_EQ(extents[1].data_offset, extents[0].length);
  EXPECT_EQ(extents[0].length + extents[1].length, length);
  off.FinishWrite(9, std::make_exception_ptr(std::runtime_error("not written")));

  HostDevice d(length, 11);
  FillPattern(d.data(), length, 12);
  OffloadFromDevice(off, *transfer, 1, d.span(), length);
  struct stat a{}, b{};
  ASSERT_EQ(stat(off.paths()[0].c_str(), &a), 0);
  ASSERT_EQ(stat(off.paths()[1].c_str(), &b), 0);
  EXPECT_GT(a.st_size, 0);
  EXPECT_GT(b.st_size, 0);
  HostDevice back(length, 0);
  RestoreToDevice(off, *transfer, 1, back.span(), length);
  EXPECT_TRUE(MatchesPattern(back.data(), length, 12));
}

// With OffloadDeviceFiles under GDS "off", the ring moves every part and says why.
TEST_P(DeviceOffloadTest, DeviceFilesWithGdsOffUseTheRing) {
  TempDir second;
  OffloaderOptions o = Options({dir_.path(), second.path()});
  o.stripe_threshold = kMiB;
  Offloader off(o);
  auto transfer = Transfer(off);
  OffloadDeviceFiles files(GdsMode::kOff);
  const uint64_t length = 2 * kMiB + 1;
  HostDevice d(length, 0);
  FillPattern(d.data(), length, 13);
  TransferResult w = OffloadFromDevice(off, *transfer, 1, d.span(), length, &files);
  EXPECT_EQ(w.bytes, length);
  EXPECT_EQ(w.path, "bounce");
  EXPECT_EQ(w.gds_reason, "GDS off");
  HostDevice back(length, 0);
  TransferResult r = RestoreToDevice(off, *transfer, 1, back.span(), length, &files);
  EXPECT_EQ(r.path, "bounce");
  EXPECT_TRUE(MatchesPattern(back.data(), length, 13));
  EXPECT_EQ(files.For(File::Open(off.paths()[0], OpenMode::kRead)).gds(), false);
}

// The parts of a striped key move at once, each through a ring of its own (slow copies: the
// first part is still moving when the second needs a ring, so a second ring is made).
TEST_P(DeviceOffloadTest, StripedPartsMoveAtOnce) {
  TempDir second;
  OffloaderOptions o = Options({dir_.path(), second.path()});
  o.stripe_threshold = kMiB;
  Offloader off(o);
  MemcpyCopierOptions slow;
  slow.delay = std::chrono::milliseconds(2);  // 16 chunks a part: >= 32 ms, ample for a thread
  auto transfer = Transfer(off, slow, /*max_rings=*/2);
  const uint64_t length = 2 * kMiB;
  HostDevice d(length, 0);
  FillPattern(d.data(), length, 14);
  OffloadFromDevice(off, *transfer, 1, d.span(), length);
  EXPECT_EQ(transfer->rings(), 2u);
  HostDevice back(length, 0);
  RestoreToDevice(off, *transfer, 1, back.span(), length);
  EXPECT_TRUE(MatchesPattern(back.data(), length, 14));
}

// Threads offload and restore their own keys through one DeviceTransfer with fewer rings than
// threads, mixed with host keys written through the engine.
TEST_P(DeviceOffloadTest, ConcurrentThreads) {
  Offloader off(Options());
  MemcpyCopierOptions slow;
  slow.delay = std::chrono::microseconds(20);
  auto transfer = Transfer(off, slow, 2);
  constexpr int kThreads = 5;
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int round = 0; round < 4; ++round) {
          const uint64_t key = 100 * t + round;
          const uint64_t length = 70000 * (t + 1) + 4097 * round;
          HostDevice d(length, t);
          FillPattern(d.data(), length, key);
          OffloadFromDevice(off, *transfer, key, d.span(), length);
          HostDevice back(length, round);
          RestoreToDevice(off, *transfer, key, back.span(), length);
          if (!MatchesPattern(back.data(), length, key)) failures[t] = StrCat("key ", key);
        }
      } catch (const std::exception& e) {
        failures[t] = e.what();
      }
    });
  }
  // Meanwhile, host keys through the engine from this thread.
  for (uint64_t key = 1000; key < 1010; ++key) {
    std::vector<uint8_t> host = testing::Pattern(50000, key);
    off.AsyncWrite(key, host.data(), host.size());
    for (const OffloadOutcome& o : off.Wait(OffloadKind::kWrite)) EXPECT_EQ(o.error, nullptr);
    off.AsyncRead(key, host.data(), host.size());
    for (const OffloadOutcome& o : off.Wait(OffloadKind::kRead)) EXPECT_EQ(o.error, nullptr);
    EXPECT_TRUE(MatchesPattern(host.data(), host.size(), key));
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
  EXPECT_EQ(off.stored_bytes(), 0u);
}

// Close() waits for operations begun and not yet finished: their files stay open for them.
TEST_P(DeviceOffloadTest, CloseWaitsForBegunOperations) {
  Offloader off(Options());
  std::vector<OffloadExtent> extents = off.BeginWrite(1, 8192);
  std::atomic<bool> closed{false};
  std::thread closer([&] {
    off.Close();
    closed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(closed.load());
  std::vector<uint8_t> bytes(8192, 0x5A);
  EXPECT_EQ(pwrite(extents[0].file.buffered_fd(), bytes.data(), bytes.size(),
                   static_cast<off_t>(extents[0].file_offset)),
            8192);
  off.FinishWrite(1, nullptr);
  closer.join();
  EXPECT_TRUE(closed.load());
  EXPECT_FALSE(off.stored(1));
  EXPECT_NE(access(extents[0].file.path().c_str(), F_OK), 0);  // removed
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceOffloadTest,
                         ::testing::ValuesIn(testing::CompiledBackends()),
                         testing::BackendParamName());

// ---------------------------------------------------------------------------------------------
// With CUDA copies: the stand-in driver on CI, the real one on a GPU machine (skipped without a
// driver).

class TransferGpuOffloadTest : public testing::CudaDriverSuite {
 protected:
  TempDir dir_;
};

TEST_F(TransferGpuOffloadTest, RoundTripThroughDeviceMemoryOnTheCallersStream) {
  const CudaDriver& driver = CudaDriver::Get();
  PrimaryContext context(driver, 0);
  OffloaderOptions o;
  o.dirs = {dir_.path()};
  o.engine = testing::SmallEngineOptions(BackendKind::kThreads, kMiB);
  Offloader off(o);
  DeviceTransferOptions t;
  t.ring.slots = 4;
  t.ring.slot_bytes = kMiB;
  t.max_rings = 2;
  DeviceTransfer transfer(off.engine(), t, driver);
  Stream stream(context);
  uint64_t key = 1;
  for (uint64_t length : {uint64_t{1}, uint64_t{4097}, uint64_t{3333333}, uint64_t{64} << 20}) {
    SCOPED_TRACE(StrCat("length=", length));
    DeviceMemory device(context, length);
    std::vector<uint8_t> src = testing::Pattern(length, key);
    // Queued, not waited for: the offload's copies are ordered after it on the same stream.
    stream.CopyToDevice(device.address(), src.data(), length);
    TransferResult w =
        OffloadFromDevice(off, transfer, key, {device.address(), 0, stream.get()}, length);
    EXPECT_EQ(w.bytes, length);
    EXPECT_EQ(w.copier, "cuda");
    EXPECT_TRUE(off.stored(key));
    DeviceMemory back(context, length);
    TransferResult r =
        RestoreToDevice(off, transfer, key, {back.address(), 0, stream.get()}, length);
    EXPECT_EQ(r.bytes, length);
    EXPECT_FALSE(off.stored(key));
    std::vector<uint8_t> out(length);
    stream.CopyFromDevice(out.data(), back.address(), length);
    stream.Synchronize();
    EXPECT_TRUE(MatchesPattern(out.data(), length, key));
    ++key;
  }
  ASSERT_NE(transfer.pool(), nullptr);
  EXPECT_TRUE(transfer.pool()->registers());
}

// The job queue with CUDA copies: several keys in flight at once, each on the caller's stream.
TEST_F(TransferGpuOffloadTest, AsyncRoundTripsOnTheJobQueue) {
  const CudaDriver& driver = CudaDriver::Get();
  PrimaryContext context(driver, 0);
  OffloaderOptions o;
  o.dirs = {dir_.path()};
  o.engine = testing::SmallEngineOptions(BackendKind::kThreads, kMiB);
  Offloader off(o);
  DeviceTransferOptions t;
  t.ring.slots = 4;
  t.ring.slot_bytes = kMiB;
  t.max_rings = 2;
  DeviceTransfer transfer(off.engine(), t, driver);
  Stream stream(context);
  const std::vector<uint64_t> lengths = {1, 4097, 3333333, 5 << 20};
  std::vector<std::unique_ptr<DeviceMemory>> device, back;
  std::vector<DeviceJob> writes, reads;
  for (size_t i = 0; i < lengths.size(); ++i) {
    device.push_back(std::make_unique<DeviceMemory>(context, lengths[i]));
    std::vector<uint8_t> src = testing::Pattern(lengths[i], i + 1);
    stream.CopyToDevice(device.back()->address(), src.data(), lengths[i]);
    stream.Synchronize();
    writes.push_back(OffloadFromDeviceAsync(off, transfer, i + 1,
                                            {device.back()->address(), 0, stream.get()},
                                            lengths[i]));
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_EQ(writes[i].Wait().copier, "cuda");
    back.push_back(std::make_unique<DeviceMemory>(context, lengths[i]));
    reads.push_back(RestoreToDeviceAsync(off, transfer, i + 1,
                                         {back.back()->address(), 0, stream.get()}, lengths[i]));
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_EQ(reads[i].Wait().bytes, lengths[i]);
    std::vector<uint8_t> out(lengths[i]);
    stream.CopyFromDevice(out.data(), back[i]->address(), lengths[i]);
    stream.Synchronize();
    EXPECT_TRUE(MatchesPattern(out.data(), lengths[i], i + 1));
  }
  EXPECT_EQ(off.stored_bytes(), 0u);
}

// GDS where cuFile takes the backing files (the stand-in's cuFile on CI, whose failures can be
// injected; on a GPU machine the real one, or the ring where it would only run in compatibility
// mode), striped over two directories: each file registered once, a cuFile status failure of
// "auto" rerun through the ring, an errno failure an error that keeps the key.
TEST_F(TransferGpuOffloadTest, GdsOrFallbackRoundTripOverTwoDirectories) {
  const CudaDriver& driver = CudaDriver::Get();
  PrimaryContext context(driver, 0);
  TempDir second;
  OffloaderOptions o;
  o.dirs = {dir_.path(), second.path()};
  o.engine = testing::SmallEngineOptions(BackendKind::kThreads, kMiB);
  o.stripe_threshold = kMiB;
  Offloader off(o);
  DeviceTransfer transfer(off.engine());
  OffloadDeviceFiles files(GdsMode::kAuto, &testing::CuFileForTests());
  const File probe = File::Open(off.paths()[0], OpenMode::kRead);
  const DeviceFile first = files.For(probe);
  const bool gds = first.gds();
  // Registered once per file: the same registration each time, another for another file.
  EXPECT_EQ(files.For(probe).handle(), first.handle());
  if (gds) {
    EXPECT_NE(files.For(File::Open(off.paths()[0], OpenMode::kRead)).handle(), first.handle());
  }
  if (fake_) {  // the stand-in's cuFile takes every file
    EXPECT_TRUE(gds) << first.gds_reason();
  }
  const std::string want = gds ? "gds" : "bounce";
  constexpr uint64_t kLength = (6 << 20) + 4097;
  DeviceMemory device(context, kLength), back(context, kLength);
  Stream stream(context);
  std::vector<uint8_t> src = testing::Pattern(kLength, 21);
  stream.CopyToDevice(device.address(), src.data(), kLength);
  TransferResult w =
      OffloadFromDevice(off, transfer, 1, {device.address(), 0, stream.get()}, kLength, &files);
  EXPECT_EQ(w.bytes, kLength);
  EXPECT_EQ(w.path, want) << first.gds_reason();
  TransferResult r =
      RestoreToDevice(off, transfer, 1, {back.address(), 0, stream.get()}, kLength, &files);
  EXPECT_EQ(r.path, want);
  std::vector<uint8_t> out(kLength);
  stream.CopyFromDevice(out.data(), back.address(), kLength);
  stream.Synchronize();
  EXPECT_TRUE(MatchesPattern(out.data(), kLength, 21));
  if (!gds || !fake_) return;  // failures are injected into the stand-in only

  OffloadFromDevice(off, transfer, 2, {device.address(), 0, stream.get()}, kLength, &files);
  accounting_.NextCuFileResult(-5008);  // CU_FILE_IO_NOT_SUPPORTED: "auto" falls back
  r = RestoreToDevice(off, transfer, 2, {back.address(), 0, stream.get()}, kLength, &files);
  EXPECT_EQ(r.path, "bounce");
  EXPECT_NE(r.gds_reason.find("CU_FILE_IO_NOT_SUPPORTED"), std::string::npos) << r.gds_reason;
  EXPECT_FALSE(off.stored(2));
  OffloadFromDevice(off, transfer, 3, {device.address(), 0, stream.get()}, kLength, &files);
  accounting_.NextCuFileResult(-1, EIO);
  EXPECT_THROW(
      RestoreToDevice(off, transfer, 3, {back.address(), 0, stream.get()}, kLength, &files),
      IoError);
  EXPECT_TRUE(off.stored(3));
  RestoreToDevice(off, transfer, 3, {back.address(), 0, stream.get()}, kLength, &files);
  EXPECT_FALSE(off.stored(3));
}

}  // namespace
}  // namespace tensortier
