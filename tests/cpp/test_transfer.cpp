// The transfer layer: the pinned pool, the bounce ring and DeviceTransfer. On CI the "device" is
// host memory and the copies are MemcpyCopier's (asynchronous, on a thread of its own, optionally
// slow or failing), so the ring's ordering, overlap, bounds and error handling run without a GPU.
// Engine faults come from the fault-injecting backend. The CUDA tests at the end skip without a
// driver.
#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fake_cuda/fake_cuda_hooks.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/cuda/cufile.hpp"
#include "tensortier/transfer/device_copier.hpp"
#include "tensortier/transfer/device_jobs.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/transfer/pinned_pool.hpp"
#include "tensortier/util/strings.hpp"
#include "tensortier/transfer/transfer.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::AllBytesAre;
using testing::CompiledBackends;
using testing::FillPattern;
using testing::MatchesPattern;
using testing::ReadWholeFile;
using testing::ScopedEnv;
using testing::TempDir;
using testing::WritePatternFile;

constexpr uint64_t kRingSlot = 64 << 10;

PinnedPoolOptions HostPool(uint64_t budget) {
  PinnedPoolOptions o;
  o.budget_bytes = budget;
  o.register_with_cuda = false;
  return o;
}

BounceRingOptions Ring(size_t slots = 4, uint64_t slot_bytes = kRingSlot) {
  BounceRingOptions o;
  o.slots = slots;
  o.slot_bytes = slot_bytes;
  return o;
}

uint64_t Address(const void* p) {
  return reinterpret_cast<uint64_t>(p);
}

// "Device" memory for MemcpyCopier: a host buffer with guard bytes on both sides, so writes
// outside the target range are seen.
class FakeDevice {
 public:
  static constexpr size_t kGuard = 4096;
  static constexpr uint8_t kFill = 0xA5;
  // `misalign`: how far past a page boundary the target range starts.
  FakeDevice(size_t bytes, size_t misalign)
      : memory_(bytes + misalign + 2 * kGuard), misalign_(misalign), bytes_(bytes) {
    std::memset(memory_.data(), kFill, memory_.size());
  }
  uint8_t* data() const { return reinterpret_cast<uint8_t*>(memory_.data()) + kGuard + misalign_; }
  uint64_t address() const { return Address(data()); }
  size_t size() const { return bytes_; }
  ::testing::AssertionResult GuardsIntact() const {
    const auto* base = reinterpret_cast<const uint8_t*>(memory_.data());
    auto head = AllBytesAre(base, kGuard + misalign_, kFill);
    if (!head) return head << " (before the range)";
    auto tail = AllBytesAre(data() + bytes_, kGuard, kFill);
    if (!tail) return tail << " (after the range)";
    return ::testing::AssertionSuccess();
  }

 private:
  AlignedBuffer memory_;
  size_t misalign_;
  size_t bytes_;
};

class TransferRingTest : public testing::BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    engine_ = std::make_unique<Engine>(testing::SmallEngineOptions(GetParam(), kRingSlot));
  }

  // File -> device of [offset, offset+length) of a pattern file; checks bytes and guards.
  void ReadCase(uint64_t file_size, uint64_t offset, uint64_t length, size_t misalign,
                BounceRingOptions ring_options, MemcpyCopierOptions copier_options = {}) {
    SCOPED_TRACE(StrCat("file_size=", file_size, " offset=", offset, " length=", length,
                        " misalign=", misalign, " slots=", ring_options.slots,
                        " slot_bytes=", ring_options.slot_bytes));
    const std::string path = dir_.File(StrCat("in-", file_size));
    ASSERT_NO_FATAL_FAILURE(WritePatternFile(path, file_size, 7));
    File file = File::Open(path, OpenMode::kRead);
    PinnedPool pool(HostPool(ring_options.bytes()));
    BounceRing ring(*engine_, pool, ring_options);
    MemcpyCopier copier(copier_options);
    FakeDevice device(length, misalign);
    TransferResult r = ring.FileToDevice(copier, file, offset, length, device.address());
    const uint64_t expect = offset >= file_size ? 0 : std::min(length, file_size - offset);
    EXPECT_EQ(r.bytes, expect);
    EXPECT_EQ(r.eof, expect < length);
    EXPECT_EQ(r.path, "bounce");
    EXPECT_EQ(r.copier, "memcpy");
    EXPECT_TRUE(MatchesPattern(device.data(), expect, 7, offset));
    // Past end of file the device memory is untouched.
    EXPECT_TRUE(AllBytesAre(device.data() + expect, length - expect, FakeDevice::kFill));
    EXPECT_TRUE(device.GuardsIntact());
    EXPECT_EQ(pool.lent_bytes(), ring_options.bytes());
  }

  // Device -> file into the middle of a pattern file; checks the range and everything around.
  void WriteCase(uint64_t file_size, uint64_t offset, uint64_t length, size_t misalign,
                 BounceRingOptions ring_options, MemcpyCopierOptions copier_options = {}) {
    SCOPED_TRACE(StrCat("file_size=", file_size, " offset=", offset, " length=", length,
                        " misalign=", misalign));
    const std::string path = dir_.File(StrCat("out-", file_size, "-", offset));
    ASSERT_NO_FATAL_FAILURE(WritePatternFile(path, file_size, 1));
    File file = File::Open(path, OpenMode::kReadWrite);
    PinnedPool pool(HostPool(ring_options.bytes()));
    BounceRing ring(*engine_, pool, ring_options);
    MemcpyCopier copier(copier_options);
    FakeDevice device(length, misalign);
    FillPattern(device.data(), length, 9, offset);
    TransferResult r = ring.DeviceToFile(copier, device.address(), length, file, offset);
    EXPECT_EQ(r.bytes, length);
    EXPECT_FALSE(r.eof);
    EXPECT_TRUE(MatchesPattern(device.data(), length, 9, offset)) << "the source changed";
    std::vector<uint8_t> data = ReadWholeFile(path);
    ASSERT_EQ(data.size(), std::max(file_size, offset + length));
    EXPECT_TRUE(MatchesPattern(data.data(), std::min(offset, file_size), 1));
    EXPECT_TRUE(MatchesPattern(data.data() + offset, length, 9, offset));
    if (offset + length < file_size) {
      EXPECT_TRUE(MatchesPattern(data.data() + offset + length, file_size - offset - length, 1,
                                 offset + length));
    }
    if (offset > file_size) {  // a hole reads as zeros
      EXPECT_TRUE(AllBytesAre(data.data() + file_size, offset - file_size, 0));
    }
  }

  TempDir dir_;
  std::unique_ptr<Engine> engine_;
};

TEST_P(TransferRingTest, FileToDeviceSizesAndAlignments) {
  const uint64_t kFile = 1 << 20;
  ReadCase(kFile, 0, 0, 0, Ring());
  ReadCase(kFile, 0, 1, 0, Ring());
  ReadCase(kFile, 4095, 1, 3, Ring());
  ReadCase(kFile, 0, 4096, 0, Ring());
  ReadCase(kFile, 1, 4095, 1, Ring());
  ReadCase(kFile, 4097, 300001, 5, Ring());            // unaligned everything, many chunks
  ReadCase(kFile, 12345, kRingSlot, 0, Ring());        // one slot's worth, straddling two chunks
  ReadCase(kFile, 0, kFile, 0, Ring());                // whole file, aligned
  ReadCase(kFile, 777, kFile - 777, 11, Ring(1));      // one slot: no overlap at all
  ReadCase(kFile, 3, kFile - 5, 4095, Ring(3, 4096));  // page-sized slots
}

TEST_P(TransferRingTest, FileToDeviceStopsAtEndOfFile) {
  ReadCase(100000, 90000, 50000, 1, Ring());       // straddles the end
  ReadCase(100000, 100000, 10, 0, Ring());         // starts at the end
  ReadCase(100000, 200000, 10, 0, Ring());         // starts past the end
  ReadCase(3 * kRingSlot, 0, 10 * kRingSlot, 0, Ring(2));  // reads past the end still in flight
}

TEST_P(TransferRingTest, DeviceToFileSizesAndAlignments) {
  const uint64_t kFile = 1 << 20;
  WriteCase(kFile, 0, 0, 0, Ring());
  WriteCase(kFile, 0, 1, 0, Ring());
  WriteCase(kFile, 4095, 1, 3, Ring());
  WriteCase(kFile, 1, 4095, 1, Ring());
  WriteCase(kFile, 4097, 300001, 5, Ring());
  WriteCase(kFile, 0, kFile, 0, Ring());
  WriteCase(kFile, 777, 500000, 11, Ring(1));
  WriteCase(kFile, 3, 200000, 4095, Ring(3, 4096));
  WriteCase(kFile, kFile - 100, 5000, 0, Ring());  // grows the file
  WriteCase(1000, 70000, 9000, 2, Ring());         // past the end: leaves a hole
}

TEST_P(TransferRingTest, SlowCopiesKeepOrder) {
  // Copies slower than the disk: the ring must wait for fences before reusing slots.
  MemcpyCopierOptions slow;
  slow.delay = std::chrono::microseconds(300);
  ReadCase(1 << 20, 4097, 700000, 3, Ring(3), slow);
  WriteCase(1 << 20, 4097, 700000, 3, Ring(3), slow);
}

TEST_P(TransferRingTest, SixtyFourMiBRoundTrip) {
  constexpr uint64_t kBytes = 64 << 20;
  const std::string path = dir_.File("big");
  File file = File::Open(path, OpenMode::kWrite);
  PinnedPool pool(HostPool(4 << 20));
  BounceRing ring(*engine_, pool, Ring(4, 1 << 20));
  MemcpyCopier copier;
  FakeDevice src(kBytes, 0);
  FillPattern(src.data(), kBytes, 3, 0);
  TransferResult w = ring.DeviceToFile(copier, src.address(), kBytes, file, 0);
  EXPECT_EQ(w.bytes, kBytes);
  EXPECT_EQ(w.chunks, 64u);
  EXPECT_EQ(w.io.transferred_bytes, kBytes);
  FakeDevice dst(kBytes, 0);
  TransferResult r = ring.FileToDevice(copier, file, 0, kBytes, dst.address());
  EXPECT_EQ(r.bytes, kBytes);
  EXPECT_FALSE(r.eof);
  EXPECT_EQ(r.chunks, 64u);
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), kBytes), 0);
  EXPECT_TRUE(dst.GuardsIntact());
  EXPECT_EQ(pool.allocations(), 4u) << "slots are allocated once";
}

TEST_P(TransferRingTest, SeveralFilesAndOffsetsThroughOneRing) {
  PinnedPool pool(HostPool(4 * kRingSlot));
  BounceRing ring(*engine_, pool, Ring());
  MemcpyCopier copier;
  // Three "tensors" written to two files at various offsets, then read back crosswise.
  struct Piece {
    int file;
    uint64_t offset;
    uint64_t length;
    uint64_t seed;
  };
  const std::vector<Piece> pieces = {
      {0, 0, 100000, 11},  {0, 100000, 1, 12}, {0, 100001, 333333, 13},
      {1, 8192, 4096, 14}, {1, 5, 3000, 15},   {1, 1 << 20, 250000, 16},
  };
  std::vector<File> files = {File::Open(dir_.File("a"), OpenMode::kWrite),
                             File::Open(dir_.File("b"), OpenMode::kWrite)};
  for (const Piece& p : pieces) {
    FakeDevice d(p.length, p.seed % 7);
    FillPattern(d.data(), p.length, p.seed, p.offset);
    EXPECT_EQ(ring.DeviceToFile(copier, d.address(), p.length, files[p.file], p.offset).bytes,
              p.length);
  }
  for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
    FakeDevice d(it->length, it->seed % 5);
    TransferResult r =
        ring.FileToDevice(copier, files[it->file], it->offset, it->length, d.address());
    EXPECT_EQ(r.bytes, it->length);
    EXPECT_TRUE(MatchesPattern(d.data(), it->length, it->seed, it->offset)) << "seed " << it->seed;
    EXPECT_TRUE(d.GuardsIntact());
  }
}

TEST_P(TransferRingTest, CopyFailureSurfacesAndTheRingStaysUsable) {
  const std::string path = dir_.File("data");
  ASSERT_NO_FATAL_FAILURE(WritePatternFile(path, 1 << 20, 2));
  File file = File::Open(path, OpenMode::kReadWrite);
  PinnedPool pool(HostPool(4 * kRingSlot));
  BounceRing ring(*engine_, pool, Ring());
  {
    MemcpyCopierOptions o;
    o.fail_nth = 3;
    MemcpyCopier copier(o);
    FakeDevice d(600000, 1);
    EXPECT_THROW(ring.FileToDevice(copier, file, 1, 600000, d.address()), std::runtime_error);
    // Documented: the chunks before the failing copy hold the file's data.
    const uint64_t first = kRingSlot - 1;  // the first chunk ends on a page boundary of the file
    EXPECT_TRUE(MatchesPattern(d.data(), first + kRingSlot, 2, 1));
    EXPECT_TRUE(d.GuardsIntact());
    // The same copier is usable again once its error was thrown.
    FakeDevice again(5000, 0);
    EXPECT_EQ(ring.FileToDevice(copier, file, 0, 5000, again.address()).bytes, 5000u);
    EXPECT_TRUE(MatchesPattern(again.data(), 5000, 2, 0));
  }
  {
    MemcpyCopierOptions o;
    o.fail_nth = 2;
    MemcpyCopier copier(o);
    FakeDevice d(600000, 0);
    FillPattern(d.data(), 600000, 5, 0);
    EXPECT_THROW(ring.DeviceToFile(copier, d.address(), 600000, file, 0), std::runtime_error);
    std::vector<uint8_t> data = ReadWholeFile(path);
    ASSERT_EQ(data.size(), 1u << 20);
    EXPECT_TRUE(MatchesPattern(data.data() + 600000, data.size() - 600000, 2, 600000))
        << "bytes outside the range must be untouched";
    EXPECT_TRUE(MatchesPattern(d.data(), 600000, 5, 0)) << "the source is never written";
  }
  // A fresh copier through the same ring: all good.
  MemcpyCopier copier;
  FakeDevice d(1 << 20, 0);
  EXPECT_EQ(ring.FileToDevice(copier, file, 0, 1 << 20, d.address()).bytes, 1u << 20);
  EXPECT_TRUE(MatchesPattern(d.data() + 600000, (1 << 20) - 600000, 2, 600000));
}

TEST_P(TransferRingTest, WriteToReadOnlyFileThrowsIoError) {
  const std::string path = dir_.File("ro");
  ASSERT_NO_FATAL_FAILURE(WritePatternFile(path, 100000, 1));
  File file = File::Open(path, OpenMode::kRead);
  PinnedPool pool(HostPool(4 * kRingSlot));
  BounceRing ring(*engine_, pool, Ring());
  MemcpyCopier copier;
  FakeDevice d(100000, 0);
  EXPECT_THROW(ring.DeviceToFile(copier, d.address(), 100000, file, 0), IoError);
  EXPECT_TRUE(MatchesPattern(ReadWholeFile(path).data(), 100000, 1));
  EXPECT_EQ(ring.DeviceToFile(copier, d.address(), 0, file, 0).bytes, 0u);
}

TEST_P(TransferRingTest, OverflowingRangesAreRejected) {
  File file = File::Open(dir_.File("x"), OpenMode::kWrite);
  PinnedPool pool(HostPool(4 * kRingSlot));
  BounceRing ring(*engine_, pool, Ring());
  MemcpyCopier copier;
  EXPECT_THROW(ring.FileToDevice(copier, file, UINT64_MAX - 10, 100, 4096), std::invalid_argument);
  EXPECT_THROW(ring.DeviceToFile(copier, UINT64_MAX - 10, 100, file, 0), std::invalid_argument);
  EXPECT_THROW(ring.FileToDevice(copier, file, uint64_t{1} << 63, 1, 4096), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Backends, TransferRingTest, ::testing::ValuesIn(CompiledBackends()),
                         testing::BackendParamName());

// ---------------------------------------------------------------------------------------------
// Engine faults through the ring

class TransferFaultTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(WritePatternFile(path_, kFileSize, 1)); }

  std::unique_ptr<Engine> FaultyEngine(FaultPlan plan) {
    injector_ = std::make_shared<FaultInjector>(plan);
    auto injector = injector_;
    return std::make_unique<Engine>(
        testing::SmallEngineOptions(BackendKind::kThreads, kRingSlot), [injector](unsigned depth) {
          return MakeFaultInjectingBackend(MakeBackend(BackendKind::kThreads, depth), injector);
        });
  }

  static FaultPlan Plan(FaultPlan::Kind kind, bool reads, bool writes, uint64_t nth) {
    FaultPlan p;
    p.kind = kind;
    p.reads = reads;
    p.writes = writes;
    p.nth = nth;
    return p;
  }

  static constexpr uint64_t kFileSize = 1 << 20;
  TempDir dir_;
  const std::string path_ = dir_.File("data");
  std::shared_ptr<FaultInjector> injector_;
};

TEST_F(TransferFaultTest, ReadErrorSurfacesWithPathAndRangeAndRingRecovers) {
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, true, false, /*nth=*/4));
  File file = File::Open(path_, OpenMode::kRead);
  PinnedPool pool(HostPool(4 * kRingSlot));
  BounceRing ring(*engine, pool, Ring());
  MemcpyCopierOptions slow;
  slow.delay = std::chrono::microseconds(200);
  MemcpyCopier copier(slow);
  FakeDevice d(kFileSize - 4097, 3);
  try {
    ring.FileToDevice(copier, file, 4097, kFileSize - 4097, d.address());
    ADD_FAILURE() << "no IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EIO);
    EXPECT_EQ(e.path(), path_);
    EXPECT_GE(e.offset(), 4097u);
    EXPECT_LE(e.offset() + e.length(), kFileSize);
  }
  EXPECT_EQ(injector_->hits(), 1u);
  EXPECT_TRUE(d.GuardsIntact());
  // The ring, copier and engine work again.
  FakeDevice again(kFileSize, 0);
  EXPECT_EQ(ring.FileToDevice(copier, file, 0, kFileSize, again.address()).bytes, kFileSize);
  EXPECT_TRUE(MatchesPattern(again.data(), kFileSize, 1));
}

TEST_F(TransferFaultTest, WriteErrorLeavesBytesOutsideTheRangeUntouched) {
  FaultPlan plan = Plan(FaultPlan::Kind::kError, false, true, /*nth=*/3);
  plan.error = ENOSPC;
  auto engine = FaultyEngine(plan);
  File file = File::Open(path_, OpenMode::kReadWrite);
  PinnedPool pool(HostPool(4 * kRingSlot));
  BounceRing ring(*engine, pool, Ring());
  MemcpyCopier copier;
  constexpr uint64_t kOffset = 100001, kLength = 500000;
  FakeDevice d(kLength, 0);
  FillPattern(d.data(), kLength, 4, kOffset);
  try {
    ring.DeviceToFile(copier, d.address(), kLength, file, kOffset);
    ADD_FAILURE() << "no IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOSPC);
    EXPECT_EQ(e.path(), path_);
    EXPECT_NE(std::string(e.what()).find(path_), std::string::npos);
  }
  std::vector<uint8_t> data = ReadWholeFile(path_);
  ASSERT_EQ(data.size(), kFileSize);
  EXPECT_TRUE(MatchesPattern(data.data(), kOffset, 1));
  EXPECT_TRUE(MatchesPattern(data.data() + kOffset + kLength, kFileSize - kOffset - kLength, 1,
                             kOffset + kLength));
  EXPECT_TRUE(MatchesPattern(d.data(), kLength, 4, kOffset));
  // Retrying writes everything.
  EXPECT_EQ(ring.DeviceToFile(copier, d.address(), kLength, file, kOffset).bytes, kLength);
  data = ReadWholeFile(path_);
  EXPECT_TRUE(MatchesPattern(data.data() + kOffset, kLength, 4, kOffset));
}

TEST_F(TransferFaultTest, ShortTransfersAreContinued) {
  FaultPlan plan = Plan(FaultPlan::Kind::kShort, true, true, /*nth=*/1);
  plan.count = 1000;
  plan.short_bytes = 4096;  // (half of a 1-byte request would be no progress at all)
  auto engine = FaultyEngine(plan);
  File file = File::Open(path_, OpenMode::kReadWrite);
  PinnedPool pool(HostPool(4 * kRingSlot));
  BounceRing ring(*engine, pool, Ring());
  MemcpyCopier copier;
  FakeDevice d(300000, 7);
  FillPattern(d.data(), 300000, 8, 5000);
  EXPECT_EQ(ring.DeviceToFile(copier, d.address(), 300000, file, 5000).bytes, 300000u);
  FakeDevice back(300000, 1);
  TransferResult r = ring.FileToDevice(copier, file, 5000, 300000, back.address());
  EXPECT_EQ(r.bytes, 300000u);
  EXPECT_GT(r.io.resubmits, 0u);
  EXPECT_TRUE(MatchesPattern(back.data(), 300000, 8, 5000));
}

TEST_F(TransferFaultTest, DelaysDoNotReorderChunks) {
  FaultPlan plan = Plan(FaultPlan::Kind::kDelay, true, true, /*nth=*/2);
  plan.count = 3;
  plan.delay = std::chrono::microseconds(20000);
  auto engine = FaultyEngine(plan);
  File file = File::Open(path_, OpenMode::kRead);
  PinnedPool pool(HostPool(4 * kRingSlot));
  BounceRing ring(*engine, pool, Ring());
  MemcpyCopier copier;
  FakeDevice d(kFileSize, 0);
  EXPECT_EQ(ring.FileToDevice(copier, file, 0, kFileSize, d.address()).bytes, kFileSize);
  EXPECT_TRUE(MatchesPattern(d.data(), kFileSize, 1));
}

// ---------------------------------------------------------------------------------------------
// PinnedPool

TEST(TransferPinnedPoolTest, BuffersArePageAlignedRoundedAndReused) {
  PinnedPool pool(HostPool(1 << 20));
  EXPECT_FALSE(pool.registers());
  {
    PinnedBuffer a = pool.Acquire(1);
    ASSERT_TRUE(a);
    EXPECT_EQ(Address(a.data()) % 4096, 0u);
    EXPECT_EQ(a.size(), 4096u);
    EXPECT_FALSE(a.registered());
    std::memset(a.data(), 1, a.size());
    EXPECT_EQ(pool.lent_bytes(), 4096u);
  }
  EXPECT_EQ(pool.lent_bytes(), 0u);
  EXPECT_EQ(pool.held_bytes(), 4096u);
  PinnedBuffer b = pool.Acquire(4000);  // same rounded size: the idle buffer comes back
  EXPECT_EQ(pool.allocations(), 1u);
  PinnedBuffer c = pool.Acquire(8192);
  EXPECT_EQ(pool.allocations(), 2u);
  EXPECT_EQ(pool.held_bytes(), 12288u);
}

TEST(TransferPinnedPoolTest, BudgetIsNeverExceeded) {
  PinnedPool pool(HostPool(64 << 10));
  EXPECT_THROW(pool.Acquire(0), std::invalid_argument);
  EXPECT_THROW(pool.Acquire((64 << 10) + 1), std::invalid_argument);
  PinnedBuffer a = pool.Acquire(48 << 10);
  EXPECT_FALSE(pool.TryAcquire(32 << 10).has_value());
  std::optional<PinnedBuffer> b = pool.TryAcquire(16 << 10);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(pool.held_bytes(), 64u << 10);
  b->Release();
  EXPECT_FALSE(*b);
  // An idle buffer of another size is freed to make room.
  a = PinnedBuffer();
  PinnedBuffer c = pool.Acquire(64 << 10);
  EXPECT_EQ(pool.held_bytes(), 64u << 10);
  EXPECT_LE(pool.held_bytes(), pool.budget());
}

TEST(TransferPinnedPoolTest, AcquireBlocksUntilABufferComesBack) {
  PinnedPool pool(HostPool(64 << 10));
  std::optional<PinnedBuffer> held = pool.Acquire(64 << 10);
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    PinnedBuffer b = pool.Acquire(32 << 10);
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(got.load());
  held.reset();
  waiter.join();
  EXPECT_TRUE(got.load());
  EXPECT_LE(pool.held_bytes(), pool.budget());
}

TEST(TransferPinnedPoolTest, TrimFreesIdleBuffersAndBuffersOutliveThePool) {
  PinnedBuffer survivor;
  {
    PinnedPool pool(HostPool(1 << 20));
    {
      PinnedBuffer a = pool.Acquire(4096);
    }
    EXPECT_EQ(pool.held_bytes(), 4096u);
    pool.Trim();
    EXPECT_EQ(pool.held_bytes(), 0u);
    survivor = pool.Acquire(8192);
  }
  std::memset(survivor.data(), 3, survivor.size());  // still valid memory
  survivor.Release();
}

TEST(TransferPinnedPoolTest, ZeroBudgetAndRingOverBudgetAreRejected) {
  EXPECT_THROW(PinnedPool(HostPool(0)), std::invalid_argument);
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads));
  PinnedPool pool(HostPool(3 * kRingSlot));
  EXPECT_THROW(BounceRing(engine, pool, Ring(4)), std::invalid_argument);
  EXPECT_THROW(BounceRing(engine, pool, Ring(0)), std::invalid_argument);
  EXPECT_THROW(BounceRing(engine, pool, Ring(2, 1000)), std::invalid_argument);
  BounceRing ring(engine, pool, Ring(3));
  EXPECT_FALSE(ring.pinned());
  EXPECT_EQ(pool.lent_bytes(), 3 * kRingSlot);
}

TEST(TransferPinnedPoolTest, WithoutDriverRegistrationIsSkippedNotFailed) {
  auto driver = CudaDriver::Load("/nonexistent/libcuda.so.1");
  PinnedPoolOptions o;
  o.budget_bytes = 1 << 20;
  o.register_with_cuda = true;
  PinnedPool pool(o, *driver);
  EXPECT_FALSE(pool.registers());
  EXPECT_FALSE(pool.Acquire(4096).registered());
}

// ---------------------------------------------------------------------------------------------
// DeviceTransfer (memcpy copiers), DeviceFile, options

std::unique_ptr<DeviceTransfer> MemcpyTransfer(Engine& engine, size_t max_rings,
                                               MemcpyCopierOptions copier = {}) {
  DeviceTransferOptions o;
  o.ring = Ring(3);
  o.max_rings = max_rings;
  return std::make_unique<DeviceTransfer>(
      engine, o,
      [copier](const DeviceSpan&) -> std::unique_ptr<DeviceCopier> {
        return std::make_unique<MemcpyCopier>(copier);
      },
      HostPool(max_rings * o.ring.bytes()));
}

TEST(TransferDeviceTest, ConcurrentTransfersFromThreads) {
  TempDir dir;
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, kRingSlot));
  MemcpyCopierOptions slow;
  slow.delay = std::chrono::microseconds(50);
  auto transfer = MemcpyTransfer(engine, /*max_rings=*/2, slow);  // fewer rings than threads
  constexpr int kThreads = 6;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        // Each thread: its own file, and a shared file at its own offset.
        const uint64_t length = 200000 + 4097 * t;
        File own = File::Open(dir.File(StrCat("own-", t)), OpenMode::kWrite);
        File shared = File::Open(dir.File("shared"), OpenMode::kCreate);
        const uint64_t shared_offset = t * 300000 + t;
        for (int round = 0; round < 3; ++round) {
          FakeDevice src(length, t);
          FillPattern(src.data(), length, 100 + t + round, 0);
          DeviceSpan s{src.address(), 0, std::nullopt};
          if (transfer->Write(s, length, own, 0).bytes != length) failures[t] = "short write";
          if (transfer->Write(s, length, DeviceFile(shared, GdsMode::kOff), shared_offset).bytes !=
              length) {
            failures[t] = "short shared write";
          }
          for (const auto& [file, offset] :
               {std::pair{own, uint64_t{0}}, std::pair{shared, shared_offset}}) {
            FakeDevice dst(length, t + 1);
            TransferResult r =
                transfer->Read(file, offset, length, {dst.address(), 0, std::nullopt});
            if (r.bytes != length || !MatchesPattern(dst.data(), length, 100 + t + round, 0) ||
                !dst.GuardsIntact()) {
              failures[t] = StrCat("round ", round, ": bad data at offset ", offset);
            }
          }
        }
      } catch (const std::exception& e) {
        failures[t] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
  EXPECT_LE(transfer->rings(), 2u);
  ASSERT_NE(transfer->pool(), nullptr);
  EXPECT_LE(transfer->pool()->held_bytes(), transfer->pool()->budget());
}

TEST(TransferDeviceTest, ErrorsReturnTheRing) {
  TempDir dir;
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, kRingSlot));
  MemcpyCopierOptions failing;
  failing.fail_nth = 1;
  auto transfer = MemcpyTransfer(engine, 1, failing);
  File file = File::Open(dir.File("f"), OpenMode::kWrite);
  FakeDevice d(100000, 0);
  for (int i = 0; i < 3; ++i) {  // a leaked ring would block the second call forever
    EXPECT_THROW(transfer->Write({d.address(), 0, std::nullopt}, 100000, file, 0),
                 std::runtime_error);
  }
  EXPECT_EQ(transfer->rings(), 1u);
}

// GDS "off" never loads cuFile (its driver makes threads, GPU buffers and a log file): the
// process-wide CuFile is made by the first DeviceFile that asks for GDS. Run in a child process
// of its own, where nothing has made it yet: the library it names tells which file made it.
TEST(TransferDeviceTest, DeviceFileOffNeverLoadsCuFile) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        TempDir dir;
        File file = File::Open(dir.File("f"), OpenMode::kWrite);
        setenv("TENSORTIER_CUFILE_LIBRARY", "/nonexistent/loaded-for-off.so", 1);
        DeviceFile off(file, GdsMode::kOff);
        setenv("TENSORTIER_CUFILE_LIBRARY", "/nonexistent/loaded-for-auto.so", 1);
        DeviceFile autof(file, GdsMode::kAuto);
        std::cerr << autof.gds_reason();
        std::_Exit(autof.gds_reason().find("loaded-for-auto.so") != std::string::npos ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "loaded-for-auto");
}

TEST(TransferDeviceTest, DeviceFileWithoutCuFileFallsBackOrThrows) {
  TempDir dir;
  auto cufile = CuFile::Load("/nonexistent/libcufile.so.0");
  File file = File::Open(dir.File("f"), OpenMode::kWrite);
  DeviceFile off(file, GdsMode::kOff, *cufile);
  EXPECT_FALSE(off.gds());
  EXPECT_EQ(off.gds_reason(), "GDS off");
  DeviceFile autof(file, GdsMode::kAuto, *cufile);
  EXPECT_FALSE(autof.gds());
  EXPECT_NE(autof.gds_reason().find("libcufile.so.0"), std::string::npos) << autof.gds_reason();
  EXPECT_THROW(DeviceFile(file, GdsMode::kRequire, *cufile), CuFileError);
  EXPECT_THROW(DeviceFile(File(), GdsMode::kOff), std::invalid_argument);

  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, kRingSlot));
  auto transfer = MemcpyTransfer(engine, 1);
  FakeDevice d(5000, 1);
  FillPattern(d.data(), 5000, 3, 0);
  TransferResult r = transfer->Write({d.address(), 0, std::nullopt}, 5000, autof, 0);
  EXPECT_EQ(r.path, "bounce");
  EXPECT_EQ(r.gds_reason, autof.gds_reason());
}

// Submit() runs transfers on the DeviceTransfer's job queue while the caller goes on; a
// LazyDeviceFile is registered by its first transfer and kept.
TEST(TransferDeviceTest, SubmittedTransfersRunOnTheJobQueue) {
  TempDir dir;
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, kRingSlot));
  auto transfer = MemcpyTransfer(engine, /*max_rings=*/2);
  auto lazy = std::make_shared<LazyDeviceFile>(File::Open(dir.File("f"), OpenMode::kWrite),
                                               GdsMode::kOff);
  constexpr int kPieces = 5;
  constexpr uint64_t kLength = 3 * kRingSlot + 11;
  std::vector<std::unique_ptr<FakeDevice>> src, dst;
  std::vector<DeviceJob> writes;
  for (int i = 0; i < kPieces; ++i) {
    src.push_back(std::make_unique<FakeDevice>(kLength, i));
    FillPattern(src.back()->data(), kLength, 40 + i, 0);
    DeviceSpan s{src.back()->address(), 0, std::nullopt};
    const uint64_t offset = i * (kLength + 1);
    writes.push_back(transfer->Submit(
        [&transfer, lazy, s, offset] { return transfer->Write(s, kLength, lazy->Get(), offset); }));
  }
  for (const DeviceJob& w : writes) EXPECT_EQ(w.Wait().bytes, kLength);
  EXPECT_EQ(lazy->Get().gds_reason(), "GDS off");
  std::vector<DeviceJob> reads;
  for (int i = 0; i < kPieces; ++i) {
    dst.push_back(std::make_unique<FakeDevice>(kLength, i + 1));
    DeviceSpan s{dst.back()->address(), 0, std::nullopt};
    const uint64_t offset = i * (kLength + 1);
    reads.push_back(transfer->Submit(
        [&transfer, lazy, s, offset] { return transfer->Read(lazy->Get(), offset, kLength, s); }));
  }
  for (int i = 0; i < kPieces; ++i) {
    EXPECT_EQ(reads[i].Wait().bytes, kLength);
    EXPECT_TRUE(MatchesPattern(dst[i]->data(), kLength, 40 + i, 0));
    EXPECT_TRUE(dst[i]->GuardsIntact());
  }
  EXPECT_LE(transfer->rings(), 2u);
}

// A file cuFile cannot serve under "on": the LazyDeviceFile's error is its transfer's, and a
// later Get() tries again.
TEST(TransferDeviceTest, LazyDeviceFileErrorsAreTheTransfersAndNotKept) {
  if (CuFile::Get().available()) GTEST_SKIP() << "cuFile serves files in this process";
  TempDir dir;
  LazyDeviceFile lazy(File::Open(dir.File("f"), OpenMode::kWrite), GdsMode::kRequire);
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, kRingSlot));
  auto transfer = MemcpyTransfer(engine, 1);
  FakeDevice d(5000, 0);
  DeviceJob job = transfer->Submit([&] {
    return transfer->Write({d.address(), 0, std::nullopt}, 5000, lazy.Get(), 0);
  });
  EXPECT_THROW(job.Wait(), CuFileError);
  EXPECT_THROW(lazy.Get(), CuFileError);
}

// GDS transfers come from a fake (no cuFile on CI): in "auto" mode a cuFile status failure reruns
// the transfer through the ring and says why; "on" and errno failures (-1) stay errors.
TEST(TransferDeviceTest, AutoFallsBackToTheRingWhenCuFileFailsWithAStatus) {
  TempDir dir;
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, kRingSlot));
  DeviceTransferOptions o;
  o.ring = Ring(3);
  o.max_rings = 1;
  int calls = 0;
  int status = 5008;  // CU_FILE_IO_NOT_SUPPORTED; -1: an errno failure; 0: success
  GdsFunction fake = [&](bool read, const DeviceFile& f, const DeviceSpan&, uint64_t length,
                         uint64_t offset) -> uint64_t {
    ++calls;
    const char* call = read ? "cuFileRead" : "cuFileWrite";
    if (status == 0) return length;
    if (status == -1) ThrowIoError(EIO, call, f.file().path(), offset, length);
    throw CuFileTransferError(status, StrCat(call, " (", CuFile::ErrorName(status), ")"),
                              f.file().path(), offset, length);
  };
  DeviceTransfer transfer(
      engine, o,
      [](const DeviceSpan&) -> std::unique_ptr<DeviceCopier> {
        return std::make_unique<MemcpyCopier>();
      },
      HostPool(o.ring.bytes()), fake);
  File file = File::Open(dir.File("f"), OpenMode::kWrite);
  const DeviceFile autof = DeviceFile::FakeGdsForTest(file, GdsMode::kAuto);
  ASSERT_TRUE(autof.gds());
  constexpr uint64_t kLength = 300000;
  FakeDevice src(kLength, 1);
  FillPattern(src.data(), kLength, 4, 0);
  TransferResult w = transfer.Write({src.address(), 0, std::nullopt}, kLength, autof, 4096);
  EXPECT_EQ(w.path, "bounce");
  EXPECT_EQ(w.bytes, kLength);
  EXPECT_NE(w.gds_reason.find("CU_FILE_IO_NOT_SUPPORTED (5008)"), std::string::npos)
      << w.gds_reason;
  FakeDevice dst(kLength, 2);
  TransferResult r = transfer.Read(autof, 4096, kLength, {dst.address(), 0, std::nullopt});
  EXPECT_EQ(r.path, "bounce");
  EXPECT_EQ(r.bytes, kLength);
  EXPECT_NE(r.gds_reason.find("cuFileRead"), std::string::npos) << r.gds_reason;
  EXPECT_TRUE(MatchesPattern(dst.data(), kLength, 4, 0));
  EXPECT_TRUE(dst.GuardsIntact());
  EXPECT_EQ(calls, 2);

  // Required GDS: the cuFile error is the caller's.
  const DeviceFile required = DeviceFile::FakeGdsForTest(file, GdsMode::kRequire);
  EXPECT_THROW(transfer.Read(required, 4096, kLength, {dst.address(), 0, std::nullopt}),
               CuFileTransferError);
  // errno failures are real I/O errors: not retried.
  status = -1;
  try {
    transfer.Read(autof, 4096, kLength, {dst.address(), 0, std::nullopt});
    ADD_FAILURE() << "no IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(dynamic_cast<const CuFileTransferError*>(&e), nullptr) << e.what();
    EXPECT_EQ(e.error_code(), EIO);
  }
  // GDS that works: its path.
  status = 0;
  TransferResult g = transfer.Read(autof, 4096, kLength, {dst.address(), 0, std::nullopt});
  EXPECT_EQ(g.path, "gds");
  EXPECT_EQ(g.bytes, kLength);
  EXPECT_EQ(g.gds_reason, "");
  EXPECT_EQ(calls, 5);
  EXPECT_EQ(transfer.rings(), 1u);
}

TEST(TransferDeviceTest, WithoutDriverTheCudaTransferNamesWhatIsMissing) {
  auto driver = CudaDriver::Load("/nonexistent/libcuda.so.1");
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads));
  try {
    DeviceTransfer t(engine, DeviceTransferOptions{}, *driver);
    ADD_FAILURE() << "no CudaError";
  } catch (const CudaError& e) {
    EXPECT_EQ(e.code(), cuda::kUnavailable);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/libcuda.so.1"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(CudaCopier(*driver, 0), CudaError);
}

TEST(TransferDeviceTest, OptionsGivenThroughTheApiFollowTheSettingsTable) {
  // Values set in code are held to the same rows as the environment's, named by their row.
  const auto refused = [](DeviceTransferOptions o, const std::string& says) {
    try {
      o.Validate();
      ADD_FAILURE() << "accepted: " << says;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  DeviceTransferOptions o;
  o.ring.slot_bytes = 5000;
  refused(o, "bounce_slot_size (TENSORTIER_BOUNCE_SLOT_SIZE): 5000 is out of range");
  o = {};
  o.ring.slot_bytes = 0;
  refused(o, "bounce_slot_size (TENSORTIER_BOUNCE_SLOT_SIZE): 0 is out of range");
  o = {};
  o.ring.slots = 4097;  // over the row's 4096 though slots x slot_bytes is small
  o.ring.slot_bytes = 4096;
  refused(o, "bounce_slots (TENSORTIER_BOUNCE_SLOTS): 4097 is out of range (allowed: 1 to 4096)");
  o = {};
  o.ring.slots = 0;
  refused(o, "bounce_slots (TENSORTIER_BOUNCE_SLOTS): 0 is out of range");
  o = {};
  o.max_rings = 0;
  refused(o, "bounce_rings (TENSORTIER_BOUNCE_RINGS): 0 is out of range");
  o.max_rings = 4097;
  refused(o, "bounce_rings (TENSORTIER_BOUNCE_RINGS): 4097 is out of range");
  o = {};
  o.ring.slots = 4096;
  o.ring.slot_bytes = 4096;
  o.max_rings = 4096;
  EXPECT_NO_THROW(o.Validate());
}

TEST(TransferDeviceTest, OptionsFromEnvironment) {
  {
    ScopedEnv slots("TENSORTIER_BOUNCE_SLOTS", "3");
    ScopedEnv size("TENSORTIER_BOUNCE_SLOT_SIZE", "2M");
    ScopedEnv rings("TENSORTIER_BOUNCE_RINGS", "5");
    DeviceTransferOptions o = DeviceTransferOptions::FromEnvironment();
    EXPECT_EQ(o.ring.slots, 3u);
    EXPECT_EQ(o.ring.slot_bytes, 2u << 20);
    EXPECT_EQ(o.max_rings, 5u);
  }
  {
    ScopedEnv slots("TENSORTIER_BOUNCE_SLOTS", "-1");
    EXPECT_THROW(DeviceTransferOptions::FromEnvironment(), std::invalid_argument);
  }
  {
    ScopedEnv size("TENSORTIER_BOUNCE_SLOT_SIZE", "1000");
    EXPECT_THROW(DeviceTransferOptions::FromEnvironment(), std::invalid_argument);
  }
  EXPECT_EQ(ParseGdsMode("auto"), GdsMode::kAuto);
  EXPECT_EQ(ParseGdsMode("off"), GdsMode::kOff);
  EXPECT_EQ(ParseGdsMode("on"), GdsMode::kRequire);
  EXPECT_THROW(ParseGdsMode("yes please"), std::invalid_argument);
}

TEST(TransferDeviceTest, GdsModeNamesBothWays) {
  for (GdsMode mode : {GdsMode::kOff, GdsMode::kAuto, GdsMode::kRequire}) {
    EXPECT_EQ(ParseGdsMode(GdsModeName(mode)), mode) << GdsModeName(mode);
  }
  EXPECT_STREQ(GdsModeName(GdsMode::kOff), "off");
  EXPECT_STREQ(GdsModeName(GdsMode::kAuto), "auto");
  EXPECT_STREQ(GdsModeName(GdsMode::kRequire), "on");
  EXPECT_EQ(ParseGdsMode("require"), GdsMode::kRequire);
  EXPECT_EQ(ParseGdsMode("1"), GdsMode::kRequire);
  EXPECT_EQ(ParseGdsMode("true"), GdsMode::kRequire);
  EXPECT_EQ(ParseGdsMode("0"), GdsMode::kOff);
  EXPECT_EQ(ParseGdsMode("false"), GdsMode::kOff);
  for (const char* bad : {"yes", "no", "On", ""}) {
    try {
      ParseGdsMode(bad);
      ADD_FAILURE() << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()),
                StrCat("gds must be 'off', 'auto' or 'on', not '", bad, "'"));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// With a GPU: the same ring with CUDA copies (skipped without a driver)

class TransferGpuTest : public testing::CudaDriverSuite {};

TEST_F(TransferGpuTest, RoundTripThroughDeviceMemoryOnOwnAndCallerStreams) {
  TempDir dir;
  const CudaDriver& driver = CudaDriver::Get();
  PrimaryContext context(driver, 0);
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, 1 << 20));
  for (uint64_t length : {uint64_t{1}, uint64_t{4097}, uint64_t{3333333}, uint64_t{64} << 20}) {
    SCOPED_TRACE(StrCat("length=", length));
    const uint64_t offset = length % 4096 + 1;
    DeviceMemory device(context, length);
    Stream stream(context);
    DeviceTransfer transfer(engine);
    File file = File::Open(dir.File(StrCat("g", length)), OpenMode::kWrite);
    std::vector<uint8_t> src = testing::Pattern(length, 5, offset);
    stream.CopyToDevice(device.address(), src.data(), length);
    stream.Synchronize();
    TransferResult w = transfer.Write({device.address(), 0, stream.get()}, length, file, offset);
    EXPECT_EQ(w.bytes, length);
    EXPECT_EQ(w.copier, "cuda");
    DeviceMemory back(context, length);
    TransferResult r = transfer.Read(file, offset, length, {back.address(), 0, std::nullopt});
    EXPECT_EQ(r.bytes, length);
    std::vector<uint8_t> out(length);
    stream.CopyFromDevice(out.data(), back.address(), length);
    stream.Synchronize();
    EXPECT_TRUE(MatchesPattern(out.data(), length, 5, offset));
    ASSERT_NE(transfer.pool(), nullptr);
    EXPECT_TRUE(transfer.pool()->registers());
  }
}

// Threads share one DeviceTransfer (fewer rings than threads, small slots: many chunks each),
// each with its own file and a region of a shared one, alternating its own stream and the
// transfer's; sizes from 1 byte to unaligned megabytes at unaligned offsets.
TEST_F(TransferGpuTest, ConcurrentTransfersFromThreadsOnTheirOwnAndTheTransfersStreams) {
  TempDir dir;
  const CudaDriver& driver = CudaDriver::Get();
  PrimaryContext context(driver, 0);
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, kRingSlot));
  DeviceTransferOptions o;
  o.ring = Ring(3);
  o.max_rings = 2;
  DeviceTransfer transfer(engine, o, driver);
  constexpr int kThreads = 4;
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        Stream stream(context);
        File own = File::Open(dir.File(StrCat("own-", t)), OpenMode::kWrite);
        File shared = File::Open(dir.File("shared"), OpenMode::kCreate);
        const uint64_t lengths[] = {1, 4097, 300001 + 4096 * uint64_t(t)};
        for (int round = 0; round < 3; ++round) {
          const uint64_t length = lengths[round];
          const uint64_t offset = t * 400000 + 7 * round + 1;
          const std::optional<cuda::CUstream> on =
              round % 2 == 0 ? std::optional(stream.get()) : std::nullopt;
          const uint64_t seed = 200 + 10 * t + round;
          std::vector<uint8_t> src = testing::Pattern(length, seed, offset);
          DeviceMemory device(context, length), back(context, length);
          stream.CopyToDevice(device.address(), src.data(), length);
          if (!on) stream.Synchronize();  // the transfer's own stream is not ordered after ours
          for (File* file : {&own, &shared}) {
            if (transfer.Write({device.address(), 0, on}, length, *file, offset).bytes != length) {
              failures[t] = StrCat("short write, round ", round);
            }
            if (transfer.Read(*file, offset, length, {back.address(), 0, on}).bytes != length) {
              failures[t] = StrCat("short read, round ", round);
            }
            std::vector<uint8_t> out(length);
            stream.CopyFromDevice(out.data(), back.address(), length);
            stream.Synchronize();
            if (!MatchesPattern(out.data(), length, seed, offset)) {
              failures[t] = StrCat("bad data, round ", round, ", file ", file->path());
            }
          }
        }
      } catch (const std::exception& e) {
        failures[t] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
  EXPECT_LE(transfer.rings(), 2u);
}

// Cases only the fake driver can stage (cuFile failures injected, a platform without nvidia-fs).
class FakeTransferTest : public testing::FakeCudaDriverSuite {
 protected:
  void TearDown() override { fake_.Check(); }
};

// With cuFile (the fake's, whose failures can be injected): "auto" GDS that fails with a cuFile
// status reruns through the ring and says why; errno failures stay errors.
TEST_F(FakeTransferTest, AutoGdsFallsBackToTheRingWhenCuFileFailsWithAStatus) {
  TempDir dir;
  PrimaryContext context(CudaDriver::Get(), 0);
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, kRingSlot));
  DeviceTransfer transfer(engine);
  constexpr uint64_t kLength = 500001;
  DeviceFile file(File::Open(dir.File("gds"), OpenMode::kWrite), GdsMode::kAuto,
                  testing::CuFileForTests());
  ASSERT_TRUE(file.gds()) << file.gds_reason();
  DeviceMemory device(context, kLength), back(context, kLength);
  Stream stream(context);
  std::vector<uint8_t> src = testing::Pattern(kLength, 8, 4096);
  stream.CopyToDevice(device.address(), src.data(), kLength);
  TransferResult w = transfer.Write({device.address(), 0, stream.get()}, kLength, file, 4096);
  EXPECT_EQ(w.path, "gds");
  fake_.NextCuFileResult(-5008);
  TransferResult r = transfer.Read(file, 4096, kLength, {back.address(), 0, stream.get()});
  EXPECT_EQ(r.path, "bounce");
  EXPECT_EQ(r.bytes, kLength);
  EXPECT_NE(r.gds_reason.find("CU_FILE_IO_NOT_SUPPORTED"), std::string::npos) << r.gds_reason;
  std::vector<uint8_t> out(kLength);
  stream.CopyFromDevice(out.data(), back.address(), kLength);
  stream.Synchronize();
  EXPECT_TRUE(MatchesPattern(out.data(), kLength, 8, 4096));
  fake_.NextCuFileResult(-1, EIO);
  EXPECT_THROW(transfer.Read(file, 4096, kLength, {back.address(), 0, stream.get()}), IoError);
}

// A driver that cannot register host memory (some sandboxes' GPU proxies): the pool's buffers
// come from cuMemAllocHost, still page-locked and page-aligned; other failures stay errors.
TEST_F(FakeTransferTest, PinnedPoolAllocatesWhereTheDriverCannotRegister) {
  PinnedPoolOptions o;
  o.budget_bytes = 1 << 20;
  PinnedPool pool(o);
  ASSERT_TRUE(pool.registers());
  fake_.NextHostRegisterResult(cuda::kErrorNotSupported);
  {
    PinnedBuffer buffer = pool.Acquire(100000);
    EXPECT_TRUE(buffer.registered());
    EXPECT_EQ(buffer.size(), 102400u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % kPageSize, 0u);
    EXPECT_EQ(CudaDriver::Get().Locate(buffer.data()).type, MemoryType::kRegisteredHost);
    std::memset(buffer.data(), 7, buffer.size());
  }
  EXPECT_EQ(pool.Acquire(100000).size(), 102400u);  // the idle one again
  EXPECT_EQ(pool.allocations(), 1u);
  // The refusal is remembered: the next buffer is allocated without asking to register (the
  // failure injected here is not met).
  fake_.NextHostRegisterResult(cuda::kErrorOutOfMemory);
  EXPECT_TRUE(pool.Acquire(200000).registered());
  EXPECT_EQ(pool.allocations(), 2u);
  fake_.NextHostRegisterResult(cuda::kSuccess);
  pool.Trim();
  // Other registration failures stay errors, and the buffer is not counted.
  PinnedPool other(o);
  fake_.NextHostRegisterResult(cuda::kErrorOutOfMemory);
  EXPECT_THROW(other.Acquire(100000), CudaError);
  EXPECT_EQ(other.held_bytes(), 0u);
  EXPECT_TRUE(other.Acquire(100000).registered());  // cuMemHostRegister again
}

// Without nvidia-fs cuFile is no GPUDirect: "auto" keeps the ring, "on" still uses cuFile.
TEST_F(FakeTransferTest, AutoGdsUsesTheRingWhereCuFileWouldRunInCompatibilityMode) {
  auto cufile = CuFile::Load(testing::FakeCudaLibrary(),
                             CuFilePlatform{.unusable = "", .compat_mode = "no nvidia-fs (test)"});
  ASSERT_TRUE(cufile->available()) << cufile->why_unavailable();
  TempDir dir;
  File file = File::Open(dir.File("gds"), OpenMode::kWrite);
  {
    DeviceFile autof(file, GdsMode::kAuto, *cufile);
    EXPECT_FALSE(autof.gds());
    EXPECT_EQ(autof.gds_reason(),
              "cuFile would run in compatibility mode: no nvidia-fs (test) (GDS 'on' uses it "
              "anyway)");
    DeviceFile required(file, GdsMode::kRequire, *cufile);
    EXPECT_TRUE(required.gds()) << required.gds_reason();
    EXPECT_EQ(required.gds_compat_mode(), "no nvidia-fs (test)");
    EXPECT_EQ(autof.gds_compat_mode(), "");
    // Its transfers say so: "gds" figures from such a file are not GPUDirect ones.
    PrimaryContext context(CudaDriver::Get(), 0);
    Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, kRingSlot));
    DeviceTransfer transfer(engine);
    constexpr uint64_t kLength = 65536;
    DeviceMemory device(context, kLength);
    Stream stream(context);
    TransferResult w = transfer.Write({device.address(), 0, stream.get()}, kLength, required, 0);
    EXPECT_EQ(w.path, "gds");
    EXPECT_EQ(w.gds_reason, "cuFile compatibility mode (not GPUDirect): no nvidia-fs (test)");
  }
}

TEST_F(TransferGpuTest, GdsOrFallbackRoundTrip) {
  TempDir dir;
  const CudaDriver& driver = CudaDriver::Get();
  PrimaryContext context(driver, 0);
  Engine engine(testing::SmallEngineOptions(BackendKind::kThreads, 1 << 20));
  DeviceTransfer transfer(engine);
  constexpr uint64_t kLength = 8 << 20;
  DeviceFile file(File::Open(dir.File("gds"), OpenMode::kWrite), GdsMode::kAuto,
                  testing::CuFileForTests());
  DeviceMemory device(context, kLength);
  Stream stream(context);
  std::vector<uint8_t> src = testing::Pattern(kLength, 6);
  stream.CopyToDevice(device.address(), src.data(), kLength);
  TransferResult w = transfer.Write({device.address(), 0, stream.get()}, kLength, file, 4096);
  EXPECT_EQ(w.bytes, kLength);
  EXPECT_EQ(w.path, file.gds() ? "gds" : "bounce") << file.gds_reason();
  DeviceMemory back(context, kLength);
  EXPECT_EQ(transfer.Read(file, 4096, kLength, {back.address(), 0, stream.get()}).bytes, kLength);
  std::vector<uint8_t> out(kLength);
  stream.CopyFromDevice(out.data(), back.address(), kLength);
  stream.Synchronize();
  EXPECT_TRUE(MatchesPattern(out.data(), kLength, 6));
}

}  // namespace
}  // namespace tensortier
