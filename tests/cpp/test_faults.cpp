// Faults injected at the backend seam (errors, short counts, delays on the Nth request), seen
// through the engine: errors surface from Future::Wait() / Engine::WaitAll() with errno, path and
// range; short transfers are continued to the byte; the engine stays usable after a fault.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/io/fault_injection.hpp"
#include "tensortier/io/file.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::CompiledBackends;
using testing::FillPattern;
using testing::MatchesPattern;
using testing::Plan;
using testing::ReadWholeFile;
using testing::TempDir;
using testing::WritePatternFile;

constexpr uint64_t kChunk = 64 << 10;
constexpr uint64_t kFileSize = 1 << 20;

// The IoError the future's Wait() throws (a test failure, and error_code() -1, if none).
IoError WaitError(const Future& f) {
  try {
    f.Wait();
  } catch (const IoError& e) {
    return e;
  }
  ADD_FAILURE() << "Wait() did not throw IoError";
  return IoError(-1, "none", "", 0, 0);
}

class FaultTest : public testing::BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_NO_FATAL_FAILURE(WritePatternFile(path_, kFileSize, 1));
    file_ = File::Open(path_, OpenMode::kReadWrite);
    ASSERT_TRUE(file_.direct()) << file_.direct_fallback_reason();
  }

  // An engine whose workers share one injector following `plan` (so "the Nth request" counts over
  // the whole engine).
  std::unique_ptr<Engine> FaultyEngine(const FaultPlan& plan, unsigned workers = 2) {
    injector_ = std::make_shared<FaultInjector>(plan);
    EngineOptions o = testing::SmallEngineOptions(GetParam(), kChunk);
    o.workers = workers;
    BackendKind kind = GetParam();
    auto injector = injector_;
    return std::make_unique<Engine>(o, [kind, injector](unsigned depth) {
      return MakeFaultInjectingBackend(MakeBackend(kind, depth), injector);
    });
  }

  // Reads [offset, offset+length) into a buffer `misalign` bytes past a page boundary; expects
  // success and the pattern `seed`.
  IoResult ReadOk(Engine& engine, uint64_t offset, uint64_t length, size_t misalign = 0,
                  uint64_t seed = 1) {
    AlignedBuffer mem(length + misalign);
    uint8_t* buf = reinterpret_cast<uint8_t*>(mem.data()) + misalign;
    IoResult r = engine.Read(file_, buf, length, offset).Wait();
    EXPECT_EQ(r.bytes, length);
    EXPECT_TRUE(MatchesPattern(buf, length, seed, offset));
    return r;
  }

  // Writes pattern `seed` over [offset, offset+length) from a buffer `misalign` bytes past a page
  // boundary; expects success and the file to hold exactly that range of the new pattern.
  IoResult WriteOk(Engine& engine, uint64_t offset, uint64_t length, size_t misalign,
                   uint64_t seed) {
    AlignedBuffer mem(length + misalign);
    uint8_t* buf = reinterpret_cast<uint8_t*>(mem.data()) + misalign;
    FillPattern(buf, length, seed, offset);
    IoResult r = engine.Write(file_, buf, length, offset).Wait();
    EXPECT_EQ(r.bytes, length);
    std::vector<uint8_t> data = ReadWholeFile(path_);
    EXPECT_EQ(data.size(), kFileSize);
    EXPECT_TRUE(MatchesPattern(data.data(), offset, 1));
    EXPECT_TRUE(MatchesPattern(data.data() + offset, length, seed, offset));
    EXPECT_TRUE(MatchesPattern(data.data() + offset + length, kFileSize - offset - length, 1,
                               offset + length));
    return r;
  }

  TempDir dir_;
  const std::string path_ = dir_.File("data");
  File file_;
  std::shared_ptr<FaultInjector> injector_;
};

// ---------------------------------------------------------------------------------------------
// Errors

TEST_P(FaultTest, ReadErrorSurfacesAsIoErrorWithPathAndRange) {
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, true, false, /*nth=*/3));
  constexpr uint64_t kOffset = 4097, kLength = 300000;
  AlignedBuffer buf(kLength);
  IoError e = WaitError(engine->Read(file_, buf.data(), kLength, kOffset));
  EXPECT_EQ(e.error_code(), EIO);
  EXPECT_EQ(e.path(), path_);
  EXPECT_NE(e.op().find("read"), std::string::npos) << e.op();
  EXPECT_GT(e.length(), 0u);
  EXPECT_GE(e.offset(), kOffset);
  EXPECT_LE(e.offset() + e.length(), kOffset + kLength);
  EXPECT_NE(std::string(e.what()).find(path_), std::string::npos) << e.what();
  EXPECT_EQ(injector_->hits(), 1u);
}

// EAGAIN/EINTR completions are the kernel asking to try again: retried, but not for good (a
// device that answers nothing else would spin a worker forever, and hide it).
TEST_P(FaultTest, RetriesAskedForAreBounded) {
  for (int error : {EAGAIN, EINTR}) {
    FaultPlan transient = Plan(FaultPlan::Kind::kError, true, false, /*nth=*/1, /*count=*/50);
    transient.error = error;
    auto engine = FaultyEngine(transient, /*workers=*/1);
    ReadOk(*engine, 0, 256 << 10);

    FaultPlan forever = Plan(FaultPlan::Kind::kError, true, false, /*nth=*/1,
                             /*count=*/1000000);
    forever.error = error;
    engine = FaultyEngine(forever, /*workers=*/1);
    AlignedBuffer buf(8192);
    IoError e = WaitError(engine->Read(file_, buf.data(), 8192, 0));
    EXPECT_EQ(e.error_code(), error);
    EXPECT_NE(std::string(e.what()).find("retries"), std::string::npos) << e.what();
    EXPECT_EQ(e.path(), path_);
  }
}

// WaitFor says whether the operation is over without taking its outcome: the error stays for
// Wait().
TEST_P(FaultTest, WaitForTimesOutThenLeavesTheErrorToWait) {
  FaultPlan plan = Plan(FaultPlan::Kind::kDelay, true, false, /*nth=*/1);
  plan.delay = std::chrono::milliseconds(300);
  auto engine = FaultyEngine(plan);
  AlignedBuffer buf(8192);
  Future slow = engine->Read(file_, buf.data(), 8192, 0);
  EXPECT_FALSE(slow.WaitFor(std::chrono::milliseconds(10)));
  EXPECT_TRUE(slow.WaitFor(std::chrono::seconds(30)));
  EXPECT_EQ(slow.Wait().bytes, 8192u);

  auto failing = FaultyEngine(Plan(FaultPlan::Kind::kError, true, false, /*nth=*/1));
  Future bad = failing->Read(file_, buf.data(), 8192, 0);
  EXPECT_TRUE(bad.WaitFor(std::chrono::seconds(30)));
  EXPECT_EQ(WaitError(bad).error_code(), EIO);
}

TEST_P(FaultTest, WriteErrorENOSPCSurfacesAsIoError) {
  FaultPlan plan = Plan(FaultPlan::Kind::kError, false, true, /*nth=*/2);
  plan.error = ENOSPC;
  auto engine = FaultyEngine(plan);
  constexpr uint64_t kOffset = 8192, kLength = 256 << 10;
  std::vector<uint8_t> src = testing::Pattern(kLength, 2, kOffset);
  IoError e = WaitError(engine->Write(file_, src.data(), kLength, kOffset));
  EXPECT_EQ(e.error_code(), ENOSPC);
  EXPECT_EQ(e.path(), path_);
  EXPECT_NE(e.op().find("write"), std::string::npos) << e.op();
  EXPECT_GE(e.offset(), kOffset);
  EXPECT_LE(e.offset() + e.length(), kOffset + kLength);
  EXPECT_EQ(injector_->hits(), 1u);
}

TEST_P(FaultTest, ErrorOnBufferedFile) {
  File buffered = File::Open(path_, OpenMode::kRead, /*direct=*/false);
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, true, false));
  std::vector<uint8_t> buf(10000);
  IoError e = WaitError(engine->Read(buffered, buf.data(), buf.size(), 123));
  EXPECT_EQ(e.error_code(), EIO);
  EXPECT_EQ(e.op(), "read");
  EXPECT_EQ(e.offset(), 123u);
  EXPECT_EQ(e.length(), 10000u);
}

TEST_P(FaultTest, ErrorLeavesTheEngineAndFileUsable) {
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, true, true, /*nth=*/1));
  AlignedBuffer buf(256 << 10);
  EXPECT_EQ(WaitError(engine->Read(file_, buf.data(), 256 << 10, 0)).error_code(), EIO);
  // The same engine and file: the next operations succeed and carry the right bytes.
  ReadOk(*engine, 0, 256 << 10);
  ReadOk(*engine, 4097, 300000, 3);
  WriteOk(*engine, 5000, 200000, 0, 3);
  EXPECT_EQ(injector_->hits(), 1u);
  EXPECT_NO_THROW(engine->WaitAll()) << "the observed error must not come back";
}

TEST_P(FaultTest, ErrorsHitOnlyEligibleOps) {
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, /*reads=*/false, /*writes=*/true));
  ReadOk(*engine, 0, 256 << 10);
  EXPECT_EQ(injector_->hits(), 0u);
  std::vector<uint8_t> src(4096, 0x77);
  EXPECT_EQ(WaitError(engine->Write(file_, src.data(), src.size(), 0)).error_code(), EIO);
  EXPECT_EQ(injector_->hits(), 1u);
}

TEST_P(FaultTest, NthRequestWithCountGreaterThanOne) {
  // Each aligned one-chunk read is exactly one request: requests 3 and 4 fail, the rest succeed.
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, true, false, /*nth=*/3, /*count=*/2));
  AlignedBuffer buf(kChunk);
  for (int op = 1; op <= 6; ++op) {
    Future f = engine->Read(file_, buf.data(), kChunk, (op - 1) * kChunk);
    if (op == 3 || op == 4) {
      IoError e = WaitError(f);
      EXPECT_EQ(e.error_code(), EIO) << "op " << op;
      EXPECT_EQ(e.offset(), (op - 1) * kChunk);
      EXPECT_EQ(e.length(), kChunk);
    } else {
      const IoResult& r = f.Wait();
      EXPECT_EQ(r.bytes, kChunk) << "op " << op;
      EXPECT_EQ(r.stats.requests, 1u);
      EXPECT_TRUE(MatchesPattern(buf.data(), kChunk, 1, (op - 1) * kChunk)) << "op " << op;
    }
  }
  EXPECT_EQ(injector_->hits(), 2u);
}

TEST_P(FaultTest, ErrorNamesTheFileOfTheFailedPiece) {
  const std::string other_path = dir_.File("other");
  ASSERT_NO_FATAL_FAILURE(WritePatternFile(other_path, kFileSize, 2));
  File other = File::Open(other_path, OpenMode::kRead);
  // One worker: requests go to the backend in plan order, piece by piece.
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, true, false, /*nth=*/2), 1);
  AlignedBuffer a(kChunk), b(kChunk);
  std::vector<IoDesc> pieces{{file_, a.data(), 0, kChunk}, {other, b.data(), kChunk, kChunk}};
  IoError e = WaitError(engine->Submit(IoOp::kRead, pieces));
  EXPECT_EQ(e.error_code(), EIO);
  EXPECT_EQ(e.path(), other_path);
  EXPECT_EQ(e.offset(), kChunk);
  EXPECT_EQ(e.length(), kChunk);
}

TEST_P(FaultTest, PrivateInjectorCountsOneBackendsRequests) {
  EngineOptions o = testing::SmallEngineOptions(GetParam(), kChunk);
  o.workers = 1;
  BackendKind kind = GetParam();
  Engine engine(o, [kind](unsigned depth) {
    return MakeFaultInjectingBackend(MakeBackend(kind, depth),
                                     Plan(FaultPlan::Kind::kError, true, false, /*nth=*/2));
  });
  AlignedBuffer buf(kChunk);
  EXPECT_EQ(engine.Read(file_, buf.data(), kChunk, 0).Wait().bytes, kChunk);
  EXPECT_EQ(WaitError(engine.Read(file_, buf.data(), kChunk, 0)).error_code(), EIO);
  EXPECT_EQ(engine.Read(file_, buf.data(), kChunk, 0).Wait().bytes, kChunk);
  EXPECT_TRUE(MatchesPattern(buf.data(), kChunk, 1));
}

// ---------------------------------------------------------------------------------------------
// Errors and WaitAll

TEST_P(FaultTest, FaultMidMultiChunkWriteFailsTheOpAndWaitAllThrowsIt) {
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, false, true, /*nth=*/5));
  std::vector<uint8_t> src = testing::Pattern(kFileSize, 4);
  Future f = engine->Write(file_, src.data(), kFileSize, 0);  // 16 chunks
  try {
    engine->WaitAll();
    FAIL() << "WaitAll did not throw the unobserved error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EIO);
    EXPECT_EQ(e.path(), path_);
    EXPECT_EQ(e.length(), kChunk);
    EXPECT_EQ(e.offset() % kChunk, 0u);
  }
  EXPECT_TRUE(f.done());
  EXPECT_EQ(WaitError(f).error_code(), EIO) << "the future keeps its error";
  EXPECT_NO_THROW(engine->WaitAll()) << "an error is thrown by WaitAll once";
  EXPECT_EQ(injector_->hits(), 1u);
}

TEST_P(FaultTest, WaitAllDoesNotRethrowAnErrorWaitObserved) {
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, false, true, /*nth=*/5));
  std::vector<uint8_t> src = testing::Pattern(kFileSize, 4);
  Future f = engine->Write(file_, src.data(), kFileSize, 0);
  EXPECT_EQ(WaitError(f).error_code(), EIO);
  EXPECT_NO_THROW(engine->WaitAll());
}

TEST_P(FaultTest, WaitAllThrowsWhileTheOtherOpsComplete) {
  // One worker: the failing read's request is the first the backend sees.
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, true, false, /*nth=*/1), 1);
  AlignedBuffer bad(kChunk), good(256 << 10);
  Future failing = engine->Read(file_, bad.data(), kChunk, 0);
  Future ok = engine->Read(file_, good.data(), 256 << 10, 4096);
  EXPECT_THROW(engine->WaitAll(), IoError);
  EXPECT_TRUE(ok.done());
  EXPECT_EQ(ok.Wait().bytes, 256u << 10);
  EXPECT_TRUE(MatchesPattern(good.data(), 256 << 10, 1, 4096));
  EXPECT_EQ(WaitError(failing).error_code(), EIO);
}

TEST_P(FaultTest, OpsAfterAnObservedErrorSucceedAndWaitAllStaysQuiet) {
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kError, true, false, /*nth=*/1), 1);
  AlignedBuffer bad(kChunk), good(256 << 10);
  EXPECT_EQ(WaitError(engine->Read(file_, bad.data(), kChunk, 0)).error_code(), EIO);
  Future again = engine->Read(file_, bad.data(), kChunk, 0);
  Future ok = engine->Read(file_, good.data(), 256 << 10, 4096);
  EXPECT_NO_THROW(engine->WaitAll());
  EXPECT_EQ(again.Wait().bytes, kChunk);
  EXPECT_TRUE(MatchesPattern(bad.data(), kChunk, 1));
  EXPECT_EQ(ok.Wait().bytes, 256u << 10);
  EXPECT_TRUE(MatchesPattern(good.data(), 256 << 10, 1, 4096));
}

// ---------------------------------------------------------------------------------------------
// Short transfers

TEST_P(FaultTest, ShortReadsByHalfAreContinued) {
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kShort, true, false, /*nth=*/1, /*count=*/4));
  IoResult r = ReadOk(*engine, 0, 512 << 10);
  EXPECT_EQ(injector_->hits(), 4u);
  EXPECT_EQ(r.stats.resubmits, 4u);
  EXPECT_EQ(r.stats.requests, 8u + 4u);  // 8 chunks, 4 continuations
  EXPECT_EQ(r.stats.direct_bytes, 512u << 10);
  EXPECT_FALSE(r.stats.eof);
}

TEST_P(FaultTest, ShortReadsByHalfOfUnalignedRangeAndAddress) {
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kShort, true, false, /*nth=*/1, /*count=*/6));
  IoResult r = ReadOk(*engine, 4097, 400000, 5);
  EXPECT_EQ(injector_->hits(), 6u);
  EXPECT_EQ(r.stats.resubmits, 6u);
  EXPECT_GT(r.stats.bounced_bytes, 0u);
}

// 1000 bytes is not a multiple of the O_DIRECT block: the rest of the request cannot go O_DIRECT
// and must continue through the page cache.
TEST_P(FaultTest, ShortReadOfUnalignedCountOnDirectRequestContinuesBuffered) {
  for (size_t misalign : {size_t{0}, size_t{1}}) {  // straight into the buffer, and bounced
    SCOPED_TRACE(misalign == 0 ? "aligned buffer" : "bounced");
    FaultPlan plan = Plan(FaultPlan::Kind::kShort, true, false, /*nth=*/1, /*count=*/2);
    plan.short_bytes = 1000;
    auto engine = FaultyEngine(plan);
    IoResult r = ReadOk(*engine, 0, 256 << 10, misalign);
    EXPECT_EQ(injector_->hits(), 2u);
    EXPECT_EQ(r.stats.resubmits, 2u);
    EXPECT_EQ(r.stats.direct_bytes, 256u << 10);
    EXPECT_EQ(r.stats.bounced_bytes, misalign == 0 ? 0u : 256u << 10);
  }
}

// A read that may fill past end of file takes a count off the O_DIRECT block as end of file only
// at the file's size: before it, the rest is still read (through the page cache).
TEST_P(FaultTest, ShortUnalignedCountBeforeEofOfReadThatMayFillPastEofIsNotEof) {
  FaultPlan plan = Plan(FaultPlan::Kind::kShort, true, false, /*nth=*/1, /*count=*/2);
  plan.short_bytes = 1000;
  auto engine = FaultyEngine(plan);
  AlignedBuffer mem(256 << 10);
  IoDesc piece{file_, mem.data(), 0, 256 << 10};
  piece.may_fill_past_eof = true;
  IoResult r = engine->Submit(IoOp::kRead, {&piece, 1}).Wait();
  EXPECT_EQ(r.bytes, 256u << 10);
  EXPECT_FALSE(r.stats.eof);
  EXPECT_TRUE(MatchesPattern(mem.data(), 256 << 10, 1, 0));
  EXPECT_EQ(injector_->hits(), 2u);
  EXPECT_EQ(r.stats.resubmits, 2u);
}

TEST_P(FaultTest, ShortStagedReadsAreContinuedIntoTheRightPlace) {
  // A staged task continues in its bounce buffer from the start: the copy out must follow
  // the task's advancing destination.
  for (uint64_t short_bytes : {uint64_t{0}, uint64_t{1000}}) {  // by half, and unaligned
    SCOPED_TRACE(::testing::Message() << "short_bytes " << short_bytes);
    FaultPlan plan = Plan(FaultPlan::Kind::kShort, true, false, /*nth=*/1, /*count=*/5);
    plan.short_bytes = short_bytes;
    injector_ = std::make_shared<FaultInjector>(plan);
    EngineOptions o = testing::SmallEngineOptions(GetParam(), kChunk);
    o.stage_reads = ReadStaging::kOn;
    BackendKind kind = GetParam();
    auto injector = injector_;
    Engine engine(o, [kind, injector](unsigned depth) {
      return MakeFaultInjectingBackend(MakeBackend(kind, depth), injector);
    });
    AlignedBuffer mem(300 << 10);
    IoDesc piece{file_, mem.data(), 4096, 300 << 10};
    IoResult r = engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
    EXPECT_EQ(r.bytes, 300u << 10);
    EXPECT_TRUE(MatchesPattern(mem.data(), 300 << 10, 1, 4096));
    EXPECT_EQ(injector_->hits(), 5u);
    EXPECT_EQ(r.stats.resubmits, 5u);
    EXPECT_EQ(r.stats.staged_bytes, 300u << 10);
  }
}

TEST_P(FaultTest, ShortStagedReadsCopiedOutNeverOverfillAOneSlotRing) {
  // Short staged reads come back from the copy threads as retries holding no ring slot: with one
  // slot, several may be due at once, and only as many as there are free slots may start.
  for (unsigned copiers : {1u, 2u}) {
    SCOPED_TRACE(::testing::Message() << copiers << " copy threads");
    FaultPlan plan = Plan(FaultPlan::Kind::kShort, true, false, /*nth=*/1, /*count=*/6);
    injector_ = std::make_shared<FaultInjector>(plan);
    EngineOptions o = testing::SmallEngineOptions(GetParam(), kChunk);
    o.stage_reads = ReadStaging::kOn;
    o.queue_depth = 1;
    o.workers = 1;
    o.copy_threads = copiers;
    o.max_staged_bytes = 8 * kChunk;
    o.max_inflight_bytes = 8 * kChunk;
    BackendKind kind = GetParam();
    auto injector = injector_;
    Engine engine(o, [kind, injector](unsigned depth) {
      return MakeFaultInjectingBackend(MakeBackend(kind, depth), injector);
    });
    AlignedBuffer mem(480 << 10);
    IoDesc piece{file_, mem.data(), 0, 480 << 10};
    IoResult r = engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
    EXPECT_EQ(r.bytes, 480u << 10);
    EXPECT_TRUE(MatchesPattern(mem.data(), 480 << 10, 1, 0));
    EXPECT_EQ(r.stats.staged_bytes, 480u << 10);
    EXPECT_EQ(r.stats.resubmits, injector_->hits());
  }
}

TEST_P(FaultTest, ShortWritesByHalfAreContinued) {
  auto engine = FaultyEngine(Plan(FaultPlan::Kind::kShort, false, true, /*nth=*/2, /*count=*/4));
  IoResult r = WriteOk(*engine, 4097, 500000, 0, 5);
  EXPECT_EQ(injector_->hits(), 4u);
  EXPECT_EQ(r.stats.resubmits, 4u);
}

TEST_P(FaultTest, ShortWriteOfUnalignedCountOnDirectRequestContinuesBuffered) {
  for (size_t misalign : {size_t{0}, size_t{7}}) {
    SCOPED_TRACE(misalign == 0 ? "aligned buffer" : "bounced");
    FaultPlan plan = Plan(FaultPlan::Kind::kShort, false, true, /*nth=*/1, /*count=*/3);
    plan.short_bytes = 1000;
    auto engine = FaultyEngine(plan);
    IoResult r = WriteOk(*engine, 0, 256 << 10, misalign, 6 + misalign);
    EXPECT_EQ(injector_->hits(), 3u);
    EXPECT_EQ(r.stats.resubmits, 3u);
    EXPECT_EQ(r.stats.direct_bytes, 256u << 10);
  }
}

TEST_P(FaultTest, ShortReadOnEveryRequestStillCompletes) {
  // Every request comes back with at most 1000 bytes: a task of L bytes takes ceil(L / 1000)
  // requests, the first O_DIRECT one and the rest through the page cache.
  FaultPlan plan = Plan(FaultPlan::Kind::kShort, true, false, /*nth=*/1, /*count=*/100000);
  plan.short_bytes = 1000;
  auto engine = FaultyEngine(plan);
  constexpr uint64_t kOffset = 100, kLength = 50000;  // head, one middle chunk, tail
  const uint64_t a = file_.offset_alignment();
  const uint64_t head = AlignUp(kOffset, a) - kOffset;
  const uint64_t tail = kOffset + kLength - AlignDown(kOffset + kLength, a);
  const uint64_t middle = kLength - head - tail;
  ASSERT_LE(middle, kChunk);
  auto requests = [](uint64_t len) { return (len + 999) / 1000; };
  const uint64_t expect = requests(head) + requests(middle) + requests(tail);
  IoResult r = ReadOk(*engine, kOffset, kLength, 0);
  EXPECT_EQ(r.stats.requests, expect);
  EXPECT_EQ(r.stats.resubmits, expect - 3);
  EXPECT_EQ(injector_->hits(), expect);
  EXPECT_EQ(r.stats.direct_bytes, middle);
}

// ---------------------------------------------------------------------------------------------
// Delays

TEST_P(FaultTest, DelayedRequestsCompleteWithTheRightBytes) {
  FaultPlan plan = Plan(FaultPlan::Kind::kDelay, true, true, /*nth=*/1, /*count=*/5);
  plan.delay = std::chrono::microseconds(2000);
  auto engine = FaultyEngine(plan);
  IoResult r = ReadOk(*engine, 4097, 300000, 1);
  EXPECT_EQ(r.stats.resubmits, 0u);
  WriteOk(*engine, 100, 200000, 0, 7);
  EXPECT_EQ(injector_->hits(), 5u);
}

TEST_P(FaultTest, DestructorWaitsForDelayedOperations) {
  FaultPlan plan = Plan(FaultPlan::Kind::kDelay, false, true, /*nth=*/1, /*count=*/100);
  plan.delay = std::chrono::microseconds(1000);
  std::vector<uint8_t> src = testing::Pattern(kFileSize, 8);
  Future f;
  {
    auto engine = FaultyEngine(plan);
    f = engine->Write(file_, src.data(), kFileSize, 0);
  }
  EXPECT_TRUE(f.done());
  EXPECT_EQ(f.Wait().bytes, kFileSize);
  EXPECT_EQ(ReadWholeFile(path_), src);
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TENSORTIER_TEST_UNDER_SANITIZER 1
#endif

// The bytes of address space this process has mapped (VmSize), 0 if unknown.
[[maybe_unused]] uint64_t MappedBytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  uint64_t kb = 0;
  while (status >> key) {
    if (key == "VmSize:" && status >> kb) return kb * 1024;
  }
  return 0;
}

TEST(BounceAllocationTest, ABounceBufferThatCannotBeMappedFailsTheOperationWithENOMEM) {
#ifdef TENSORTIER_TEST_UNDER_SANITIZER
  GTEST_SKIP() << "sanitizer runtimes need more address space than the limit this test sets";
#else
  // In a child whose address space is capped below one bounce buffer (64 MiB): the worker
  // thread's allocation fails, and the operation, not the process, reports it.
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(WritePatternFile(dir.File("data"), 1 << 20, 3));
  File file = File::Open(dir.File("data"), OpenMode::kRead);
  ASSERT_TRUE(file.direct()) << file.direct_fallback_reason();
  AlignedBuffer dest(1 << 20);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 10;
    try {
      EngineOptions o = testing::SmallEngineOptions(BackendKind::kThreads, 64 << 20);
      o.max_inflight_bytes = 64 << 20;
      o.stage_reads = ReadStaging::kOn;
      Engine engine(o);
      const uint64_t mapped = MappedBytes();
      rlimit limit{mapped + (32 << 20), mapped + (32 << 20)};
      if (mapped == 0 || setrlimit(RLIMIT_AS, &limit) != 0) _exit(11);
      IoDesc piece{file, dest.data(), 0, 1 << 20};
      code = 12;  // read succeeded: the limit did not bite
      engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
    } catch (const IoError& e) {
      const std::string what = e.what();
      code = e.error_code() == ENOMEM && what.find("bounce") != std::string::npos &&
                     what.find(dir.File("data")) != std::string::npos
                 ? 0
                 : 13;
    } catch (...) {
      code = 14;
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "11: no limit set, 12: the read succeeded, 13: wrong error, 14: not an IoError";
#endif
}

// A refused or short io_uring submission, injected inside the io_uring backend (the seam above
// cannot reach liburing's own system calls). The ring must not keep the entries the kernel did
// not take: the next submission would start them, for requests already completed.
class UringSubmitFaultTest : public ::testing::Test {
 protected:
  static constexpr unsigned kDepth = 8;
  static constexpr uint64_t kBlock = 4096;

  void SetUp() override {
    if (!BackendCompiledIn(BackendKind::kIoUring)) GTEST_SKIP() << "io_uring not built";
    const std::string& why = testing::BackendRefusedHere(BackendKind::kIoUring);
    if (!why.empty() && std::getenv("CI") == nullptr) GTEST_SKIP() << why;
    ASSERT_NO_FATAL_FAILURE(WritePatternFile(path_, kDepth * kBlock, 7));
    file_ = File::Open(path_, OpenMode::kReadWrite, /*direct=*/false);
    backend_ = MakeBackend(BackendKind::kIoUring, kDepth);
  }
  void TearDown() override { InjectUringSubmitFault(0, 0); }  // disarmed, whatever happened

  // Block `block` of the file into buffer `slot`, the request's user data the slot.
  IoRequest ReadBlock(unsigned slot, unsigned block) {
    return {IoOp::kRead, file_.buffered_fd(), buffers_.data() + slot * kBlock,
            kBlock,      block * kBlock,      slot};
  }

  // Every completion of the `expected` requests in flight, then whatever else the ring holds.
  std::vector<IoCompletion> ReapAll(size_t expected) {
    std::vector<IoCompletion> all;
    std::vector<IoCompletion> out(kDepth);
    while (all.size() < expected) {
      const size_t n = backend_->Reap(out, 1);
      all.insert(all.end(), out.begin(), out.begin() + static_cast<ptrdiff_t>(n));
    }
    const size_t extra = backend_->Reap(out, 0);
    all.insert(all.end(), out.begin(), out.begin() + static_cast<ptrdiff_t>(extra));
    return all;
  }

  // Submits reads of blocks 0..count-1 into slots 0..count-1 with the fault armed; expects the
  // first `accepted` to read their block and the rest to complete once, refused with `error`.
  void ExpectRefusedAfter(unsigned count, unsigned accepted, int error) {
    std::memset(buffers_.data(), 0xEE, buffers_.size());
    std::vector<IoRequest> batch;
    for (unsigned i = 0; i < count; ++i) batch.push_back(ReadBlock(i, i));
    InjectUringSubmitFault(accepted, error);
    backend_->Submit(batch);
    EXPECT_FALSE(UringSubmitFaultPending());
    std::vector<int> seen(count, 0);
    for (const IoCompletion& c : ReapAll(count)) {
      ASSERT_LT(c.user_data, count);
      ++seen[c.user_data];
      if (c.user_data < accepted) {
        EXPECT_FALSE(c.refused);
        EXPECT_EQ(c.result, static_cast<int64_t>(kBlock));
        EXPECT_TRUE(MatchesPattern(buffers_.data() + c.user_data * kBlock, kBlock, 7,
                                   c.user_data * kBlock));
      } else {
        EXPECT_TRUE(c.refused) << c.user_data;
        EXPECT_EQ(c.result, -error) << c.user_data;
      }
    }
    for (unsigned i = 0; i < count; ++i) EXPECT_EQ(seen[i], 1) << "request " << i;
  }

  // A batch after the refusal, into other slots: each reads its block, and no completion comes
  // for the refused requests, whose buffers nobody writes.
  void ExpectTheNextBatchRunsAlone(unsigned refused_from, unsigned refused_to) {
    std::vector<IoRequest> batch;
    for (unsigned i = 0; i < kDepth - refused_to; ++i) {
      batch.push_back(ReadBlock(refused_to + i, kDepth - 1 - i));
    }
    backend_->Submit(batch);
    std::vector<int> seen(kDepth, 0);
    for (const IoCompletion& c : ReapAll(batch.size())) {
      ASSERT_LT(c.user_data, kDepth);
      ASSERT_GE(c.user_data, refused_to) << "a completion for a request that was refused";
      ++seen[c.user_data];
      EXPECT_FALSE(c.refused);
      EXPECT_EQ(c.result, static_cast<int64_t>(kBlock));
      const uint64_t block = kDepth - 1 - (c.user_data - refused_to);
      EXPECT_TRUE(
          MatchesPattern(buffers_.data() + c.user_data * kBlock, kBlock, 7, block * kBlock));
    }
    for (unsigned i = refused_to; i < kDepth; ++i) EXPECT_EQ(seen[i], 1) << "request " << i;
    for (unsigned i = refused_from; i < refused_to; ++i) {
      EXPECT_TRUE(testing::AllBytesAre(buffers_.data() + i * kBlock, kBlock, 0xEE))
          << "refused request " << i << " ran";
    }
  }

  TempDir dir_;
  std::string path_ = dir_.File("data");
  File file_;
  AlignedBuffer buffers_{kDepth * kBlock};
  std::unique_ptr<Backend> backend_;
};

TEST_F(UringSubmitFaultTest, ARefusedBatchCompletesEachRequestOnceWithTheError) {
  ASSERT_NO_FATAL_FAILURE(ExpectRefusedAfter(4, 0, EAGAIN));
  ExpectTheNextBatchRunsAlone(0, 4);
}

TEST_F(UringSubmitFaultTest, AShortSubmissionRefusedAfterTwoLeavesNothingInTheRing) {
  ASSERT_NO_FATAL_FAILURE(ExpectRefusedAfter(5, 2, EBUSY));
  ExpectTheNextBatchRunsAlone(2, 5);
}

TEST_F(UringSubmitFaultTest, AFullRingRefusedLeavesRoomForTheNextFullBatch) {
  ASSERT_NO_FATAL_FAILURE(ExpectRefusedAfter(kDepth, 3, EAGAIN));
  // Every entry taken back: a batch of the whole depth fits again.
  std::vector<IoRequest> batch;
  for (unsigned i = 0; i < kDepth; ++i) batch.push_back(ReadBlock(i, i));
  std::memset(buffers_.data(), 0, buffers_.size());
  backend_->Submit(batch);
  const std::vector<IoCompletion> all = ReapAll(kDepth);
  ASSERT_EQ(all.size(), kDepth);
  for (const IoCompletion& c : all) {
    EXPECT_FALSE(c.refused);
    EXPECT_EQ(c.result, static_cast<int64_t>(kBlock));
  }
  EXPECT_TRUE(MatchesPattern(buffers_.data(), kDepth * kBlock, 7, 0));
}

TEST_F(UringSubmitFaultTest, ABatchLargerThanTheFreeRingIsRefusedWholeAndLeavesNothing) {
  std::vector<IoRequest> batch;
  for (unsigned i = 0; i <= kDepth; ++i) batch.push_back(ReadBlock(i % kDepth, i % kDepth));
  EXPECT_THROW(backend_->Submit(batch), std::system_error);
  std::vector<IoCompletion> out(kDepth);
  EXPECT_EQ(backend_->Reap(out, 0), 0u);
  std::memset(buffers_.data(), 0xEE, buffers_.size());
  ExpectTheNextBatchRunsAlone(0, 0);
}

// Through the engine: the refusal is the caller's error (errno, path, range), raised by the
// wait, and not a retry loop (the fault is one-shot: a retry would have succeeded silently).
// The engine goes on working.
TEST_F(UringSubmitFaultTest, TheEngineReportsARefusedSubmissionAndGoesOn) {
  EngineOptions o = testing::SmallEngineOptions(BackendKind::kIoUring, 4 * kBlock);
  o.workers = 1;
  Engine engine(o);
  for (int error : {EAGAIN, EBUSY}) {
    for (IoOp op : {IoOp::kRead, IoOp::kWrite}) {
      SCOPED_TRACE(::testing::Message() << (op == IoOp::kRead ? "read " : "write ") << error);
      AlignedBuffer mem(kDepth * kBlock);
      FillPattern(mem.data(), mem.size(), 7);
      InjectUringSubmitFault(0, error);
      IoDesc piece{file_, mem.data(), 0, mem.size()};
      try {
        engine.Submit(op, {&piece, 1}).Wait();
        ADD_FAILURE() << "the refused submission was not reported";
      } catch (const IoError& e) {
        EXPECT_EQ(e.error_code(), error);
        EXPECT_NE(std::string(e.what()).find("refused"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(path_), std::string::npos) << e.what();
      }
      EXPECT_FALSE(UringSubmitFaultPending());
      std::memset(mem.data(), 0, mem.size());
      EXPECT_EQ(engine.Read(file_, mem.data(), mem.size(), 0).Wait().bytes, mem.size());
      EXPECT_TRUE(MatchesPattern(mem.data(), mem.size(), 7, 0));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, FaultTest, ::testing::ValuesIn(CompiledBackends()),
                         testing::BackendParamName());

}  // namespace
}  // namespace tensortier
