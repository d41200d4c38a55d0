// The engine end to end, on every backend this build has: planning (buffered head and tail,
// O_DIRECT middle in chunks, bounce buffers, page-cache-resident chunks), end of file, batches,
// concurrency, completion and shutdown. Every read is checked byte by byte against the pattern the
// file was written with, and the bytes around the destination are checked to be untouched.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <fstream>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/io/page_cache.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::AllBytesAre;
using testing::CompiledBackends;
using testing::FillPattern;
using testing::MatchesPattern;
using testing::ReadWholeFile;
using testing::TempDir;
using testing::WritePatternFile;

constexpr uint8_t kSentinel = 0xEE;
constexpr size_t kGuard = 4096;

// A destination buffer that starts `misalign` bytes past a page boundary, with kGuard sentinel
// bytes on each side (and the whole buffer pre-filled with the sentinel).
class GuardedBuffer {
 public:
  GuardedBuffer(uint64_t length, size_t misalign)
      : length_(length), misalign_(misalign), mem_(kGuard + misalign + length + kGuard) {
    std::memset(mem_.data(), kSentinel, mem_.size());
  }
  uint8_t* data() const { return reinterpret_cast<uint8_t*>(mem_.data()) + kGuard + misalign_; }
  uint64_t length() const { return length_; }

  // Success iff the first `filled` bytes hold the pattern for file position `pos` and every other
  // byte (the rest of the buffer and both guards) still holds the sentinel.
  ::testing::AssertionResult Holds(uint64_t seed, uint64_t pos, uint64_t filled) const {
    auto* base = reinterpret_cast<const uint8_t*>(mem_.data());
    if (auto r = AllBytesAre(base, kGuard + misalign_, kSentinel); !r) {
      return r << " (guard before the buffer)";
    }
    if (auto r = MatchesPattern(data(), filled, seed, pos); !r) return r;
    if (auto r = AllBytesAre(data() + filled, length_ - filled + kGuard, kSentinel); !r) {
      return r << " (counted from the end of the " << filled << " bytes read; buffer length "
               << length_ << ")";
    }
    return ::testing::AssertionSuccess();
  }

 private:
  uint64_t length_;
  size_t misalign_;
  AlignedBuffer mem_;
};

class EngineTest : public testing::BackendTest {
 protected:
  EngineOptions Options(uint64_t chunk = 64 << 10) const {
    return testing::SmallEngineOptions(GetParam(), chunk);
  }

  // A file of `size` bytes holding pattern `seed`, opened with `mode` (O_DIRECT when `direct`).
  File PatternFile(const std::string& name, uint64_t size, uint64_t seed,
                   OpenMode mode = OpenMode::kRead, bool direct = true) {
    WritePatternFile(dir_.File(name), size, seed);
    File f = File::Open(dir_.File(name), mode, direct);
    EXPECT_EQ(f.direct(), direct) << f.direct_fallback_reason();
    return f;
  }

  // Reads [offset, offset+length) into a guarded buffer `misalign` bytes past a page boundary and
  // checks that exactly `expect_bytes` bytes of pattern `seed` arrived and nothing else changed.
  IoResult CheckedRead(Engine& engine, const File& file, uint64_t offset, uint64_t length,
                       size_t misalign, uint64_t seed, uint64_t expect_bytes) {
    GuardedBuffer buf(length, misalign);
    IoResult result = engine.Read(file, buf.data(), length, offset).Wait();
    EXPECT_EQ(result.bytes, expect_bytes) << "offset " << offset << " length " << length;
    EXPECT_TRUE(buf.Holds(seed, offset, std::min(result.bytes, length)))
        << "offset " << offset << " length " << length << " misalign " << misalign;
    EXPECT_EQ(result.stats.requested_bytes, length);
    EXPECT_EQ(result.stats.transferred_bytes, result.bytes);
    EXPECT_EQ(result.segment_bytes, std::vector<uint64_t>{result.bytes});
    EXPECT_EQ(result.stats.direct_bytes + result.stats.buffered_bytes, length);
    return result;
  }

  TempDir dir_;
};

// How the planner must split [offset, offset+length) for `file`.
struct Split {
  uint64_t head, middle, tail;
};
Split ExpectedSplit(const File& file, uint64_t offset, uint64_t length) {
  const uint64_t a = file.offset_alignment();
  const uint64_t begin = AlignUp(offset, a), end = AlignDown(offset + length, a);
  if (begin >= end) return {length, 0, 0};
  return {begin - offset, end - begin, offset + length - end};
}

// Writes go direct only in whole pages (a partial page written buffered must never share a page
// with a direct write, or writeback of the stale page overwrites the direct data).
Split ExpectedWriteSplit(const File& file, uint64_t offset, uint64_t length) {
  const uint64_t a = std::max<uint64_t>(file.offset_alignment(), kPageSize);
  const uint64_t begin = AlignUp(offset, a), end = AlignDown(offset + length, a);
  if (begin >= end) return {length, 0, 0};
  return {begin - offset, end - begin, offset + length - end};
}

// ---------------------------------------------------------------------------------------------
// Planning: alignment of the file range and of the host address

TEST_P(EngineTest, ReportsTheBackendItRuns) {
  Engine engine(Options());
  EXPECT_EQ(engine.backend(), BackendName(GetParam()));
}

TEST_P(EngineTest, AlignedReadIsAllDirect) {
  File f = PatternFile("data", 1 << 20, 1);
  ASSERT_TRUE(f.direct());
  Engine engine(Options());
  IoResult r = CheckedRead(engine, f, 64 << 10, 512 << 10, 0, 1, 512 << 10);
  EXPECT_EQ(r.stats.backend, BackendName(GetParam()));
  EXPECT_EQ(r.stats.direct_bytes, 512u << 10);
  EXPECT_EQ(r.stats.buffered_bytes, 0u);
  EXPECT_EQ(r.stats.bounced_bytes, 0u);
  EXPECT_EQ(r.stats.cached_bytes, 0u);
  EXPECT_EQ(r.stats.requests, 8u);  // 512 KiB in 64 KiB chunks
  EXPECT_EQ(r.stats.resubmits, 0u);
  EXPECT_FALSE(r.stats.eof);
  EXPECT_FALSE(r.stats.direct_fallback);
  EXPECT_EQ(r.stats.residency_method, "");  // page_cache_check is off
}

TEST_P(EngineTest, UnalignedOffsetReadsHeadBuffered) {
  File f = PatternFile("data", 1 << 20, 2);
  Engine engine(Options());
  for (uint64_t offset : {1ull, 511ull, 513ull, 4095ull, 4097ull, 65537ull}) {
    const uint64_t length = (256 << 10) - offset % 4096;
    IoResult r = CheckedRead(engine, f, offset, length, 0, 2, length);
    Split s = ExpectedSplit(f, offset, length);
    EXPECT_GT(s.head, 0u);
    EXPECT_EQ(r.stats.buffered_bytes, s.head + s.tail) << offset;
    EXPECT_EQ(r.stats.direct_bytes, s.middle) << offset;
  }
}

TEST_P(EngineTest, UnalignedLengthReadsTailBuffered) {
  File f = PatternFile("data", 1 << 20, 3);
  Engine engine(Options());
  for (uint64_t length : {1ull, 511ull, 4097ull, 65535ull, 65537ull, 200001ull}) {
    IoResult r = CheckedRead(engine, f, 0, length, 0, 3, length);
    Split s = ExpectedSplit(f, 0, length);
    EXPECT_EQ(s.head, length < f.offset_alignment() ? length : 0u);
    EXPECT_EQ(r.stats.buffered_bytes, s.head + s.tail) << length;
    EXPECT_EQ(r.stats.direct_bytes, s.middle) << length;
  }
}

TEST_P(EngineTest, UnalignedHostAddressIsBounced) {
  File f = PatternFile("data", 1 << 20, 4);
  ASSERT_TRUE(f.direct());
  const uint32_t mem_align = f.memory_alignment();
  ASSERT_GT(mem_align, 1u) << "no host alignment rule to break";
  Engine engine(Options());
  for (size_t misalign : {size_t{1}, size_t{17}, size_t{mem_align - 1}, size_t{mem_align + 3}}) {
    IoResult r = CheckedRead(engine, f, 0, 256 << 10, misalign, 4, 256 << 10);
    EXPECT_EQ(r.stats.direct_bytes, 256u << 10) << misalign;
    EXPECT_EQ(r.stats.bounced_bytes, 256u << 10) << misalign;
  }
  // Misaligned by a multiple of the rule: no bounce needed.
  if (mem_align < kGuard) {
    IoResult r = CheckedRead(engine, f, 0, 256 << 10, mem_align, 4, 256 << 10);
    EXPECT_EQ(r.stats.direct_bytes, 256u << 10);
    EXPECT_EQ(r.stats.bounced_bytes, 0u);
  }
}

TEST_P(EngineTest, UnalignedHostAddressAndRangeTogether) {
  File f = PatternFile("data", 1 << 20, 5);
  Engine engine(Options());
  IoResult r = CheckedRead(engine, f, 4097, (300 << 10) + 7, 33, 5, (300 << 10) + 7);
  Split s = ExpectedSplit(f, 4097, (300 << 10) + 7);
  EXPECT_EQ(r.stats.direct_bytes, s.middle);
  ASSERT_NE((33 + s.head) % f.memory_alignment(), 0u);
  EXPECT_EQ(r.stats.bounced_bytes, s.middle);
}

TEST_P(EngineTest, UnalignedHostAddressWriteIsBounced) {
  const std::string path = dir_.File("out");
  File f = File::Open(path, OpenMode::kWrite);
  ASSERT_TRUE(f.direct());
  Engine engine(Options());
  constexpr uint64_t kLen = 256 << 10;
  AlignedBuffer src(kLen + 64);
  uint8_t* p = reinterpret_cast<uint8_t*>(src.data()) + 17;
  FillPattern(p, kLen, 6);
  const IoResult& w = engine.Write(f, p, kLen, 0).Wait();
  EXPECT_EQ(w.bytes, kLen);
  EXPECT_EQ(w.stats.direct_bytes, kLen);
  EXPECT_EQ(w.stats.bounced_bytes, kLen);
  std::vector<uint8_t> data = ReadWholeFile(path);
  ASSERT_EQ(data.size(), kLen);
  EXPECT_TRUE(MatchesPattern(data.data(), kLen, 6));
}

// A backend that forwards to a real one and records how many requests each Submit() carried.
class SubmitRecorder : public Backend {
 public:
  SubmitRecorder(std::unique_ptr<Backend> inner, std::shared_ptr<std::vector<size_t>> calls,
                 std::shared_ptr<std::mutex> mu)
      : inner_(std::move(inner)), calls_(std::move(calls)), mu_(std::move(mu)) {}
  std::string_view name() const noexcept override { return inner_->name(); }
  unsigned depth() const noexcept override { return inner_->depth(); }
  void Submit(std::span<const IoRequest> requests) override {
    {
      std::lock_guard lock(*mu_);
      calls_->push_back(requests.size());
    }
    inner_->Submit(requests);
  }
  size_t Reap(std::span<IoCompletion> out, unsigned min_wait) override {
    return inner_->Reap(out, min_wait);
  }

 private:
  std::unique_ptr<Backend> inner_;
  std::shared_ptr<std::vector<size_t>> calls_;
  std::shared_ptr<std::mutex> mu_;
};

// A bounced write copies each chunk into its bounce buffer before the request starts: each goes
// to the disk as soon as it is copied rather than after the copies of everything that fits in
// flight (in a new process those copies first-touch the bounce memory, and the disk sat idle).
// Writes from aligned memory copy nothing and are still submitted together.
TEST_P(EngineTest, BouncedWriteChunksAreSubmittedAsEachIsCopied) {
  constexpr uint64_t kChunk = 64 << 10;
  constexpr uint64_t kLen = 8 * kChunk;
  EngineOptions o = Options(kChunk);
  o.workers = 1;
  o.queue_depth = 8;
  o.max_inflight_bytes = kLen;
  auto calls = std::make_shared<std::vector<size_t>>();
  auto mu = std::make_shared<std::mutex>();
  const BackendKind kind = GetParam();
  Engine engine(o, [kind, calls, mu](unsigned depth) {
    return std::make_unique<SubmitRecorder>(MakeBackend(kind, depth), calls, mu);
  });
  const std::string path = dir_.File("out");
  File f = File::Open(path, OpenMode::kWrite);
  ASSERT_TRUE(f.direct()) << f.direct_fallback_reason();
  AlignedBuffer src(kLen + 64);
  uint8_t* unaligned = reinterpret_cast<uint8_t*>(src.data()) + 17;
  FillPattern(unaligned, kLen, 9);

  const IoResult bounced = engine.Write(f, unaligned, kLen, 0).Wait();
  EXPECT_EQ(bounced.bytes, kLen);
  EXPECT_EQ(bounced.stats.bounced_bytes, kLen);
  std::vector<size_t> bounced_calls;
  {
    std::lock_guard lock(*mu);
    bounced_calls.swap(*calls);
  }
  EXPECT_EQ(bounced_calls, std::vector<size_t>(bounced.stats.requests, 1));
  std::vector<uint8_t> data = ReadWholeFile(path);
  ASSERT_EQ(data.size(), kLen);
  EXPECT_TRUE(MatchesPattern(data.data(), kLen, 9));

  AlignedBuffer aligned(kLen);
  FillPattern(aligned.data(), kLen, 10);
  const IoResult direct = engine.Write(f, aligned.data(), kLen, 0).Wait();
  EXPECT_EQ(direct.bytes, kLen);
  EXPECT_EQ(direct.stats.bounced_bytes, 0u);
  std::lock_guard lock(*mu);
  ASSERT_FALSE(calls->empty());
  EXPECT_EQ((*calls)[0], 8u);  // all 8 chunks fit in flight: one submission
}

// Bounce buffers a burst made stay for the next burst while the worker has been idle less than
// bounce_idle_ms, and go (all but two per worker) once it has been idle that long.
class BounceIdleTest : public EngineTest {
 protected:
  static constexpr uint64_t kChunk = 64 << 10;
  static constexpr uint64_t kBurst = 8 * kChunk;  // 8 tasks: 8 bounce buffers, all in flight
  static constexpr uint64_t kKept = 2 * kChunk;   // what an idle worker keeps

  // By default every task on one worker, all submitted together; with more workers the tasks
  // are dealt out round robin, each worker's share all in flight at once.
  EngineOptions IdleOptions(uint32_t idle_ms, unsigned workers = 1) const {
    EngineOptions o = Options(kChunk);
    o.workers = workers;
    o.max_inflight_bytes = kBurst;
    o.bounce_idle_ms = idle_ms;
    return o;
  }

  // Reads kBurst bytes into an address O_DIRECT cannot use, so every chunk needs a bounce buffer.
  void BouncedBurst(Engine& engine, const File& f) {
    IoResult r = CheckedRead(engine, f, 0, kBurst, 17, 9, kBurst);
    ASSERT_EQ(r.stats.bounced_bytes, kBurst);
  }

  // Polls until the engine holds `bytes` of bounce buffers; false after 20 s.
  static bool HoldsEventually(const Engine& engine, uint64_t bytes) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (engine.bounce_bytes() != bytes) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return true;
  }
};

TEST_P(BounceIdleTest, BuffersAreKeptWithinTheDelayAndReused) {
  File f = PatternFile("data", kBurst, 9);
  ASSERT_TRUE(f.direct());
  Engine engine(IdleOptions(60'000));
  EXPECT_EQ(engine.bounce_bytes(), 0u);
  BouncedBurst(engine, f);
  EXPECT_EQ(engine.bounce_bytes(), kBurst);
  EXPECT_EQ(engine.bounce_allocations(), kBurst / kChunk);
  BouncedBurst(engine, f);  // the same buffers again, none new
  EXPECT_EQ(engine.bounce_bytes(), kBurst);
  EXPECT_EQ(engine.bounce_allocations(), kBurst / kChunk);
}

TEST_P(BounceIdleTest, ZeroDelayFreesThemOnceIdle) {
  File f = PatternFile("data", kBurst, 9);
  ASSERT_TRUE(f.direct());
  Engine engine(IdleOptions(0));
  BouncedBurst(engine, f);
  EXPECT_TRUE(HoldsEventually(engine, kKept)) << engine.bounce_bytes();
}

TEST_P(BounceIdleTest, EachWorkerKeepsTwo) {
  File f = PatternFile("data", kBurst, 9);
  ASSERT_TRUE(f.direct());
  Engine engine(IdleOptions(0, 2));
  BouncedBurst(engine, f);
  EXPECT_EQ(engine.bounce_allocations(), kBurst / kChunk);
  EXPECT_TRUE(HoldsEventually(engine, 2 * kKept)) << engine.bounce_bytes();
}

// A trickle of small reads keeps the worker from ever being idle for the delay; the buffers it
// does not need go all the same, and the trickle reuses the ones kept.
TEST_P(BounceIdleTest, UnusedBuffersGoWhileWorkTrickles) {
  File f = PatternFile("data", kBurst, 9);
  ASSERT_TRUE(f.direct());
  Engine engine(IdleOptions(200));
  BouncedBurst(engine, f);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (engine.bounce_bytes() != kKept && std::chrono::steady_clock::now() < deadline) {
    IoResult r = CheckedRead(engine, f, kChunk, kChunk, 17, 9, kChunk);
    ASSERT_EQ(r.stats.bounced_bytes, kChunk);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(engine.bounce_bytes(), kKept);
  EXPECT_EQ(engine.bounce_allocations(), kBurst / kChunk);
}

// Work that never lets the worker wait (each operation queued before the one before it ends),
// with no bounce buffer in use: the buffers an earlier burst made go all the same, once unused
// for the delay, and not only when the worker is next idle.
TEST_P(BounceIdleTest, UnusedBuffersGoWhileTheWorkerIsBusy) {
  File f = PatternFile("data", kBurst, 9);
  ASSERT_TRUE(f.direct());
  Engine engine(IdleOptions(50));
  BouncedBurst(engine, f);
  // Aligned: these reads need no bounce buffer. Each piece has memory of its own, and the two
  // operations in flight use two halves (a third starts only after the first has ended).
  constexpr uint64_t kPieces = 64;
  AlignedBuffer memory(2 * kPieces * kChunk);
  auto pieces = [&](uint64_t half) {
    std::vector<IoDesc> out;
    auto* base = static_cast<std::byte*>(memory.data()) + half * kPieces * kChunk;
    for (uint64_t i = 0; i < kPieces; ++i) {
      out.push_back({f, base + i * kChunk, (i % 8) * kChunk, kChunk});
    }
    return out;
  };
  std::deque<Future> queued;
  uint64_t submitted = 0;
  queued.push_back(engine.Submit(IoOp::kRead, pieces(submitted++ % 2)));
  bool trimmed_while_busy = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!trimmed_while_busy && std::chrono::steady_clock::now() < deadline) {
    queued.push_back(engine.Submit(IoOp::kRead, pieces(submitted++ % 2)));
    IoResult r = queued.front().Wait();
    queued.pop_front();
    ASSERT_EQ(r.stats.bounced_bytes, 0u);
    trimmed_while_busy = engine.bounce_bytes() == kKept && !queued.front().done();
  }
  for (const Future& q : queued) q.Wait();
  EXPECT_TRUE(trimmed_while_busy) << engine.bounce_bytes();
  EXPECT_EQ(engine.bounce_allocations(), kBurst / kChunk);
}

// A bounced piece holds a whole bounce buffer however short it is: a batch of small unaligned
// pieces stays within max_inflight_bytes of buffers (it made one per request slot before).
TEST_P(BounceIdleTest, SmallBouncedPiecesStayWithinTheBudget) {
  File f = PatternFile("data", 1 << 20, 9);
  ASSERT_TRUE(f.direct());
  EngineOptions o = Options(kChunk);  // 2 workers, 8 requests each, budget 4 chunks
  o.bounce_idle_ms = 60'000;          // keep every buffer made: bounce_bytes is the peak
  Engine engine(o);
  constexpr uint64_t kPieces = 64;
  constexpr uint64_t kPiece = 8 << 10;
  constexpr uint64_t kStride = kPiece + 4096;
  AlignedBuffer memory(kPieces * kStride);
  auto* base = static_cast<std::byte*>(memory.data());
  std::vector<IoDesc> pieces;
  for (uint64_t i = 0; i < kPieces; ++i) {
    pieces.push_back({f, base + i * kStride + 17, 2 * i * kPiece, kPiece});
  }
  IoResult r = engine.Submit(IoOp::kRead, pieces).Wait();
  EXPECT_EQ(r.bytes, kPieces * kPiece);
  EXPECT_EQ(r.stats.bounced_bytes, kPieces * kPiece);
  for (uint64_t i = 0; i < kPieces; ++i) {
    EXPECT_TRUE(MatchesPattern(pieces[i].buf, kPiece, 9, pieces[i].offset)) << i;
  }
  EXPECT_GT(engine.bounce_bytes(), 0u);
  EXPECT_LE(engine.bounce_bytes(), o.max_inflight_bytes);
}

TEST_P(BounceIdleTest, TheyGoNoSoonerThanTheDelay) {
  File f = PatternFile("data", kBurst, 9);
  ASSERT_TRUE(f.direct());
  constexpr auto kDelay = std::chrono::milliseconds(300);
  Engine engine(IdleOptions(static_cast<uint32_t>(kDelay.count())));
  const auto submitted = std::chrono::steady_clock::now();  // the worker is idle only after this
  BouncedBurst(engine, f);
  ASSERT_TRUE(HoldsEventually(engine, kKept)) << engine.bounce_bytes();
  EXPECT_GE(std::chrono::steady_clock::now() - submitted, kDelay);
}

TEST_P(BounceIdleTest, StoppingDoesNotWaitForTheDelay) {
  File f = PatternFile("data", kBurst, 9);
  ASSERT_TRUE(f.direct());
  auto engine = std::make_unique<Engine>(IdleOptions(3'600'000));
  BouncedBurst(*engine, f);
  const auto start = std::chrono::steady_clock::now();
  engine.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST_P(EngineTest, ZeroLengthCompletesWithNoBytes) {
  File f = PatternFile("data", 8192, 7, OpenMode::kReadWrite);
  Engine engine(Options());
  uint8_t byte = kSentinel;
  for (uint64_t offset : {0ull, 4097ull, 1ull << 40}) {
    for (void* buf : {static_cast<void*>(nullptr), static_cast<void*>(&byte)}) {
      Future r = engine.Read(f, buf, 0, offset);
      EXPECT_TRUE(r.done());
      const IoResult& rr = r.Wait();
      EXPECT_EQ(rr.bytes, 0u);
      EXPECT_EQ(rr.segment_bytes, std::vector<uint64_t>{0});
      EXPECT_EQ(rr.stats.requests, 0u);
      EXPECT_FALSE(rr.stats.eof);
      Future w = engine.Write(f, buf, 0, offset);
      EXPECT_EQ(w.Wait().bytes, 0u);
      EXPECT_EQ(w.Wait().stats.requests, 0u);
    }
  }
  EXPECT_EQ(byte, kSentinel);
  EXPECT_EQ(f.Size(), 8192u) << "a zero-length write must not extend the file";
  engine.WaitAll();
}

TEST_P(EngineTest, OneByteReadsAndWrites) {
  const std::string path = dir_.File("data");
  File f = PatternFile("data", 3 * 4096, 8, OpenMode::kReadWrite);
  Engine engine(Options());
  for (uint64_t offset : {0ull, 1ull, 4095ull, 4096ull, 3ull * 4096 - 1}) {
    IoResult r = CheckedRead(engine, f, offset, 1, 0, 8, 1);
    EXPECT_EQ(r.stats.buffered_bytes, 1u);
    EXPECT_EQ(r.stats.direct_bytes, 0u);
  }
  // Overwrite one byte in the middle of a block: its neighbours stay.
  std::vector<uint8_t> expect = testing::Pattern(3 * 4096, 8);
  uint8_t b = static_cast<uint8_t>(~expect[5000]);
  const IoResult& w = engine.Write(f, &b, 1, 5000).Wait();
  EXPECT_EQ(w.bytes, 1u);
  EXPECT_EQ(w.stats.buffered_bytes, 1u);
  expect[5000] = b;
  EXPECT_EQ(ReadWholeFile(path), expect);
}

TEST_P(EngineTest, RangeSpanningManyChunksIsExact) {
  constexpr uint64_t kOffset = 4097, kLength = (1 << 20) + 123;
  File f = PatternFile("data", 2 << 20, 9);
  Engine engine(Options(64 << 10));
  for (size_t misalign : {size_t{0}, size_t{1}, size_t{2}}) {
    IoResult r = CheckedRead(engine, f, kOffset, kLength, misalign, 9, kLength);
    Split s = ExpectedSplit(f, kOffset, kLength);
    EXPECT_EQ(r.stats.direct_bytes, s.middle);
    EXPECT_EQ(r.stats.buffered_bytes, s.head + s.tail);
    // The middle starts `head` bytes into the buffer: it needs a bounce unless that lands on the
    // memory alignment (misalign 1 + head 511 does, misalign 0 does not).
    const bool bounce = (misalign + s.head) % f.memory_alignment() != 0;
    EXPECT_EQ(r.stats.bounced_bytes, bounce ? s.middle : 0u) << "misalign " << misalign;
    const uint64_t chunks = (s.middle + (64 << 10) - 1) / (64 << 10);
    EXPECT_EQ(r.stats.requests, 2 + chunks);  // head, tail, and the chunks of the middle
    EXPECT_GE(chunks, 16u);
  }
}

TEST_P(EngineTest, WriteSpanningManyChunksIsExact) {
  constexpr uint64_t kOffset = 4097, kLength = (1 << 20) + 123, kSize = 2 << 20;
  const std::string path = dir_.File("data");
  File f = PatternFile("data", kSize, 10, OpenMode::kReadWrite);
  Engine engine(Options(64 << 10));
  std::vector<uint8_t> src = testing::Pattern(kLength, 11, kOffset);
  const IoResult& w = engine.Write(f, src.data(), kLength, kOffset).Wait();
  EXPECT_EQ(w.bytes, kLength);
  Split s = ExpectedWriteSplit(f, kOffset, kLength);
  EXPECT_EQ(w.stats.direct_bytes, s.middle);
  EXPECT_EQ(w.stats.buffered_bytes, s.head + s.tail);
  std::vector<uint8_t> data = ReadWholeFile(path);
  ASSERT_EQ(data.size(), kSize);
  EXPECT_TRUE(MatchesPattern(data.data(), kOffset, 10));
  EXPECT_TRUE(MatchesPattern(data.data() + kOffset, kLength, 11, kOffset));
  EXPECT_TRUE(MatchesPattern(data.data() + kOffset + kLength, kSize - kOffset - kLength, 10,
                             kOffset + kLength));
}

TEST_P(EngineTest, OffsetBeyond4GiBInSparseFile) {
  constexpr uint64_t kOffset = (5ull << 30) + 777, kLength = (12 << 10) + 5;
  const std::string path = dir_.File("sparse");
  File f = File::Open(path, OpenMode::kWrite);
  Engine engine(Options());
  std::vector<uint8_t> src = testing::Pattern(kLength, 12, kOffset);
  const IoResult& w = engine.Write(f, src.data(), kLength, kOffset).Wait();
  EXPECT_EQ(w.bytes, kLength);
  EXPECT_GT(w.stats.direct_bytes, 0u);
  EXPECT_EQ(f.Size(), kOffset + kLength);

  IoResult r = CheckedRead(engine, f, kOffset, kLength, 0, 12, kLength);
  EXPECT_GT(r.stats.direct_bytes, 0u);
  // The same bytes through a plain pread, so the engine is not only checked against itself.
  std::vector<uint8_t> back(kLength);
  ASSERT_EQ(pread(f.buffered_fd(), back.data(), kLength, static_cast<off_t>(kOffset)),
            static_cast<ssize_t>(kLength));
  EXPECT_EQ(back, src);
  // The hole before reads as zeros.
  GuardedBuffer hole(64 << 10, 0);
  const IoResult& h = engine.Read(f, hole.data(), 64 << 10, 4ull << 30).Wait();
  EXPECT_EQ(h.bytes, 64u << 10);
  EXPECT_TRUE(AllBytesAre(hole.data(), 64 << 10, 0));
}

// ---------------------------------------------------------------------------------------------
// End of file

struct PastEofCase {
  uint64_t size, offset, length;
  size_t misalign;
};
const PastEofCase kPastEofCases[] = {
    {10000, 0, 64 << 10, 0},            // EOF inside an O_DIRECT chunk, not block-aligned
    {10000, 0, 64 << 10, 1},            // ... read through a bounce buffer
    {10000, 9000, 20000, 0},            // EOF inside the buffered head
    {16384, 0, 256 << 10, 0},           // block-aligned EOF, later chunks wholly past it
    {16384, 100, 256 << 10, 0},         // unaligned start
    {(64 << 10) + 1, 0, 128 << 10, 0},  // one byte into the second chunk
};

TEST_P(EngineTest, ReadPastEofReturnsOnlyExistingBytes) {
  Engine engine(Options());
  for (const PastEofCase& c : kPastEofCases) {
    SCOPED_TRACE(::testing::Message() << "size " << c.size << " offset " << c.offset << " length "
                                      << c.length << " misalign " << c.misalign);
    File f = PatternFile("data", c.size, 13);
    GuardedBuffer buf(c.length, c.misalign);
    const IoResult& r = engine.Read(f, buf.data(), c.length, c.offset).Wait();
    EXPECT_EQ(r.bytes, c.size - c.offset);
    EXPECT_EQ(r.segment_bytes, std::vector<uint64_t>{c.size - c.offset});
    EXPECT_EQ(r.stats.transferred_bytes, c.size - c.offset);
    EXPECT_TRUE(r.stats.eof);
    EXPECT_TRUE(MatchesPattern(buf.data(), r.bytes, 13, c.offset));
  }
}

// Only the bytes the result reports may change: a caller reading a whole tensor slot from a file
// that turned out short must find the rest of its buffer as it left it, whatever path ran.
TEST_P(EngineTest, ReadPastEofLeavesTheRestOfTheBufferUntouched) {
  Engine engine(Options());
  for (const PastEofCase& c : kPastEofCases) {
    SCOPED_TRACE(::testing::Message() << "size " << c.size << " offset " << c.offset << " length "
                                      << c.length << " misalign " << c.misalign);
    File f = PatternFile("data", c.size, 13);
    IoResult r = CheckedRead(engine, f, c.offset, c.length, c.misalign, 13, c.size - c.offset);
    EXPECT_TRUE(r.stats.eof);
  }
}

TEST_P(EngineTest, ReadEntirelyBeyondEofReturnsNothing) {
  File f = PatternFile("data", 10000, 14);
  Engine engine(Options());
  for (uint64_t offset : {10000ull, 12288ull, 20000ull, 1ull << 33}) {
    for (uint64_t length : {1ull, 4096ull, 200000ull}) {
      IoResult r = CheckedRead(engine, f, offset, length, 0, 14, 0);
      EXPECT_TRUE(r.stats.eof) << offset << "+" << length;
    }
  }
}

TEST_P(EngineTest, ReadOfEmptyFileReturnsNothing) {
  File f = PatternFile("empty", 0, 15);
  Engine engine(Options());
  IoResult r = CheckedRead(engine, f, 0, 128 << 10, 0, 15, 0);
  EXPECT_TRUE(r.stats.eof);
}

// Some files take read(2) but not the kernel's asynchronous interface: procfs files with a plain
// read handler, such as /proc/self/cmdline, which io_submit refuses (EINVAL). Every backend reads
// them as read(2) does, alone and within a batch, where the other pieces, submitted in the same
// call, complete as usual.
TEST_P(EngineTest, FilesWithoutAsyncReadSupportAreReadAsByRead) {
  const std::string proc = "/proc/self/cmdline";
  std::string expect;
  {
    std::FILE* in = std::fopen(proc.c_str(), "rb");
    ASSERT_NE(in, nullptr);
    char chunk[4096];
    for (size_t n; (n = std::fread(chunk, 1, sizeof chunk, in)) > 0;) expect.append(chunk, n);
    std::fclose(in);
  }
  ASSERT_FALSE(expect.empty());
  File cmdline = File::Open(proc, OpenMode::kRead);
  File data = PatternFile("data", 1 << 20, 21);
  Engine engine(Options());
  std::vector<char> alone(expect.size() + 4096, 'x');
  IoResult r = engine.Read(cmdline, alone.data(), alone.size(), 0).Wait();
  ASSERT_EQ(r.bytes, expect.size());
  EXPECT_EQ(std::string(alone.data(), r.bytes), expect);
  EXPECT_EQ(alone[r.bytes], 'x');

  constexpr size_t kPieces = 8, kLength = 100000;
  std::vector<std::vector<char>> bufs(kPieces, std::vector<char>(kLength, 'x'));
  std::vector<IoDesc> pieces;
  for (size_t i = 0; i < kPieces; ++i) {
    pieces.push_back(
        {i % 2 == 0 ? data : cmdline, bufs[i].data(), i % 2 == 0 ? i * 1000 : 0, kLength});
  }
  IoResult batch = engine.Submit(IoOp::kRead, pieces).Wait();
  for (size_t i = 0; i < kPieces; ++i) {
    SCOPED_TRACE(i);
    if (i % 2 == 0) {
      EXPECT_EQ(batch.segment_bytes[i], kLength);
      EXPECT_TRUE(MatchesPattern(bufs[i].data(), kLength, 21, i * 1000));
    } else {
      ASSERT_EQ(batch.segment_bytes[i], expect.size());
      EXPECT_EQ(std::string(bufs[i].data(), expect.size()), expect);
    }
  }
}

TEST_P(EngineTest, ReadEndingExactlyAtEofIsNotEof) {
  File f = PatternFile("data", 10000, 16);
  Engine engine(Options());
  IoResult r = CheckedRead(engine, f, 100, 9900, 0, 16, 9900);
  EXPECT_FALSE(r.stats.eof);
}

// A batch arena rounds each file up to the O_DIRECT alignment (IoDesc::may_fill_past_eof): such a
// read goes direct through the block holding end of file, with no buffered tail (on a cold file a
// second, synchronous request), stops at end of file, and writes nothing past the rounded length.
TEST_P(EngineTest, ReadThatMayFillPastEofGoesDirectThroughTheLastBlock) {
  Engine engine(Options());
  for (uint64_t size : {uint64_t{10000}, uint64_t{4097}, uint64_t{16384}, uint64_t{(64 << 10) + 1},
                        uint64_t{200000}}) {
    SCOPED_TRACE(::testing::Message() << "size " << size);
    File f = PatternFile("data", size, 21);
    const uint64_t length = AlignUp(size, f.offset_alignment());
    GuardedBuffer buf(length, 0);
    IoDesc piece{f, buf.data(), 0, length};
    piece.may_fill_past_eof = true;
    const IoResult& r = engine.Submit(IoOp::kRead, {&piece, 1}).Wait();
    EXPECT_EQ(r.bytes, size);
    EXPECT_EQ(r.segment_bytes, std::vector<uint64_t>{size});
    EXPECT_EQ(r.stats.direct_bytes, length);
    EXPECT_EQ(r.stats.buffered_bytes, 0u);
    EXPECT_EQ(r.stats.requests, (length + (64 << 10) - 1) / (64 << 10));  // one per chunk
    EXPECT_EQ(r.stats.eof, length > size);
    EXPECT_TRUE(MatchesPattern(buf.data(), size, 21, 0));
    EXPECT_TRUE(AllBytesAre(buf.data() + length, kGuard, kSentinel)) << "past the rounded length";
  }
}

// Without the flag the same read keeps the caller's bytes past end of file (the tail goes through
// the page cache), and with it a buffer the engine must bounce gets only the file's bytes.
TEST_P(EngineTest, ReadThatMayFillPastEofIntoUnalignedMemoryWritesOnlyTheFile) {
  Engine engine(Options());
  File f = PatternFile("data", 10000, 22);
  const uint64_t length = AlignUp(10000, f.offset_alignment());
  for (bool may_fill : {false, true}) {
    SCOPED_TRACE(may_fill ? "may fill past EOF, bounced" : "may not fill past EOF");
    GuardedBuffer buf(length, may_fill ? 1 : 0);
    IoDesc piece{f, buf.data(), 0, length};
    piece.may_fill_past_eof = may_fill;
    const IoResult& r = engine.Submit(IoOp::kRead, {&piece, 1}).Wait();
    EXPECT_EQ(r.bytes, 10000u);
    EXPECT_TRUE(r.stats.eof);
    EXPECT_TRUE(buf.Holds(22, 0, 10000));
  }
}

// ---------------------------------------------------------------------------------------------
// Writes

TEST_P(EngineTest, WriteThenReadBackDirectAndBuffered) {
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "O_DIRECT file" : "buffered file");
    const std::string path = dir_.File(direct ? "direct" : "buffered");
    constexpr uint64_t kSize = 512 << 10, kOffset = 3001, kLength = 300000;
    File f = PatternFile(direct ? "direct" : "buffered", kSize, 17, OpenMode::kReadWrite, direct);
    Engine engine(Options());
    std::vector<uint8_t> src = testing::Pattern(kLength, 18, kOffset);
    const IoResult& w = engine.Write(f, src.data(), kLength, kOffset).Wait();
    EXPECT_EQ(w.bytes, kLength);
    EXPECT_EQ(w.segment_bytes, std::vector<uint64_t>{kLength});
    EXPECT_EQ(w.stats.direct_bytes, direct ? ExpectedWriteSplit(f, kOffset, kLength).middle : 0u);
    EXPECT_FALSE(w.stats.direct_fallback);

    IoResult r = CheckedRead(engine, f, kOffset, kLength, 0, 18, kLength);
    EXPECT_EQ(r.stats.direct_bytes, direct ? ExpectedSplit(f, kOffset, kLength).middle : 0u);
    std::vector<uint8_t> data = ReadWholeFile(path);
    ASSERT_EQ(data.size(), kSize);
    EXPECT_TRUE(MatchesPattern(data.data(), kOffset, 17));
    EXPECT_TRUE(MatchesPattern(data.data() + kOffset, kLength, 18, kOffset));
    EXPECT_TRUE(MatchesPattern(data.data() + kOffset + kLength, kSize - kOffset - kLength, 17,
                               kOffset + kLength));
  }
}

TEST_P(EngineTest, WritePastEndExtendsTheFile) {
  const std::string path = dir_.File("data");
  File f = PatternFile("data", 10000, 19, OpenMode::kReadWrite);
  Engine engine(Options());
  constexpr uint64_t kOffset = 20000, kLength = 70000;
  std::vector<uint8_t> src = testing::Pattern(kLength, 20, kOffset);
  EXPECT_EQ(engine.Write(f, src.data(), kLength, kOffset).Wait().bytes, kLength);
  EXPECT_EQ(f.Size(), kOffset + kLength);
  std::vector<uint8_t> data = ReadWholeFile(path);
  ASSERT_EQ(data.size(), kOffset + kLength);
  EXPECT_TRUE(MatchesPattern(data.data(), 10000, 19));
  EXPECT_TRUE(AllBytesAre(data.data() + 10000, kOffset - 10000, 0));
  EXPECT_TRUE(MatchesPattern(data.data() + kOffset, kLength, 20, kOffset));
}

// ---------------------------------------------------------------------------------------------
// Scatter/gather

TEST_P(EngineTest, ScatterGatherReadOfManyPiecesOnSeveralFiles) {
  constexpr uint64_t kSize = 1 << 20;
  std::vector<File> files;
  for (int i = 0; i < 3; ++i) files.push_back(PatternFile("f" + std::to_string(i), kSize, 30 + i));
  Engine engine(Options());
  std::mt19937_64 rng(1234);
  struct Piece {
    int file = 0;
    uint64_t offset = 0, length = 0, expect = 0;
    size_t misalign = 0;
    std::unique_ptr<GuardedBuffer> buf;
  };
  std::vector<Piece> pieces;
  for (int i = 0; i < 40; ++i) {
    Piece p;
    p.file = i % 3;
    p.offset = rng() % kSize;
    p.length = 1 + rng() % (100 << 10);
    p.misalign = (i % 4 == 0) ? 0 : rng() % 64;
    pieces.push_back(std::move(p));
  }
  pieces[7].length = 0;                                        // an empty piece
  pieces[11].offset = kSize - 1000, pieces[11].length = 5000;  // crosses end of file
  pieces[13].offset = kSize + 4096, pieces[13].length = 4096;  // wholly past end of file
  pieces[17].offset = 0, pieces[17].length = 256 << 10;        // aligned, several chunks
  std::vector<IoDesc> descs;
  uint64_t total = 0;
  for (Piece& p : pieces) {
    p.expect = p.offset >= kSize ? 0 : std::min(p.length, kSize - p.offset);
    total += p.expect;
    p.buf = std::make_unique<GuardedBuffer>(p.length, p.misalign);
    descs.push_back({files[p.file], p.buf->data(), p.offset, p.length});
  }
  const IoResult& r = engine.Submit(IoOp::kRead, descs).Wait();
  EXPECT_EQ(r.bytes, total);
  ASSERT_EQ(r.segment_bytes.size(), pieces.size());
  EXPECT_TRUE(r.stats.eof);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& p = pieces[i];
    EXPECT_EQ(r.segment_bytes[i], p.expect) << "piece " << i;
    EXPECT_TRUE(p.buf->Holds(30 + p.file, p.offset, p.expect)) << "piece " << i;
  }
}

// A finished operation lets go of its files, though its future (and the engine's list of
// operations, until WaitAll) remain: their descriptors close with the caller's last copy.
TEST_P(EngineTest, AFinishedOperationHoldsNoFileOpen) {
  Engine engine(Options());
  std::vector<uint8_t> data = testing::Pattern(100000, 3);
  File file = File::Open(dir_.File("held.bin"), OpenMode::kWrite);
  const int fds[2] = {file.buffered_fd(), file.direct_fd()};
  Future write = engine.Write(file, data.data(), data.size(), 4096);
  Future empty = engine.Write(file, data.data(), 0, 0);
  EXPECT_EQ(write.Wait().bytes, data.size());
  empty.Wait();
  file.Close();
  for (int fd : fds) {
    if (fd >= 0) {
      EXPECT_EQ(fcntl(fd, F_GETFD), -1) << "descriptor " << fd << " still open";
    }
  }
  engine.WaitAll();
}

TEST_P(EngineTest, ScatterGatherWriteOfManyPiecesOnSeveralFiles) {
  constexpr uint64_t kSlot = 24 << 10, kSlots = 40, kSize = kSlot * kSlots;
  std::vector<File> files;
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    paths.push_back(dir_.File("f" + std::to_string(i)));
    files.push_back(File::Open(paths.back(), OpenMode::kWrite));
    files.back().Truncate(kSize);
  }
  Engine engine(Options(16 << 10));
  std::mt19937_64 rng(99);
  std::vector<std::vector<uint8_t>> expect(3, std::vector<uint8_t>(kSize, 0));
  std::vector<std::unique_ptr<AlignedBuffer>> sources;
  std::vector<IoDesc> descs;
  for (uint64_t i = 0; i < kSlots * 3; ++i) {
    const int file = static_cast<int>(i % 3);
    const uint64_t slot = i / 3;
    const uint64_t offset = slot * kSlot + rng() % (kSlot / 2);
    const uint64_t length = 1 + rng() % (kSlot / 2);
    const size_t misalign = (i % 5 == 0) ? 0 : rng() % 32;
    sources.push_back(std::make_unique<AlignedBuffer>(length + misalign));
    uint8_t* src = reinterpret_cast<uint8_t*>(sources.back()->data()) + misalign;
    FillPattern(src, length, 40 + file, offset);
    std::memcpy(expect[file].data() + offset, src, length);
    descs.push_back({files[file], src, offset, length});
  }
  const IoResult& w = engine.Submit(IoOp::kWrite, descs).Wait();
  ASSERT_EQ(w.segment_bytes.size(), descs.size());
  uint64_t total = 0;
  for (size_t i = 0; i < descs.size(); ++i) {
    EXPECT_EQ(w.segment_bytes[i], descs[i].length) << "piece " << i;
    total += descs[i].length;
  }
  EXPECT_EQ(w.bytes, total);
  EXPECT_EQ(w.stats.requested_bytes, total);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(ReadWholeFile(paths[i]), expect[i]) << paths[i];
}

TEST_P(EngineTest, SubmitWithNoPiecesCompletes) {
  Engine engine(Options());
  const IoResult& r = engine.Submit(IoOp::kRead, {}).Wait();
  EXPECT_EQ(r.bytes, 0u);
  EXPECT_TRUE(r.segment_bytes.empty());
}

// ---------------------------------------------------------------------------------------------
// Concurrency, completion, shutdown

// Neighbouring writes that meet inside a page, in flight together: each must keep every byte of
// the others (a buffered partial-page write racing a direct write to the same page loses data).
TEST_P(EngineTest, AdjacentUnalignedWritesInFlightTogetherKeepEveryByte) {
  constexpr uint64_t kSize = 256 << 10;
  const std::string path = dir_.File("adjacent");
  File f = File::Open(path, OpenMode::kWrite);
  f.Truncate(kSize);
  Engine engine(Options(16 << 10));
  std::mt19937_64 rng(77);
  std::vector<uint8_t> expect(kSize, 0);
  for (int round = 0; round < 40; ++round) {
    std::vector<uint64_t> cuts = {0, kSize};
    for (int i = 0; i < 12; ++i) cuts.push_back(1 + rng() % (kSize - 1));
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<uint8_t> src = testing::Pattern(kSize, 100 + round);
    std::vector<Future> futures;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      futures.push_back(engine.Write(f, src.data() + cuts[i], cuts[i + 1] - cuts[i], cuts[i]));
    }
    for (const Future& fut : futures) fut.Wait();
    expect = src;
    ASSERT_EQ(ReadWholeFile(path), expect) << "round " << round;
    f.DropCache();
  }
}

TEST_P(EngineTest, ConcurrentOperationsFromManyThreads) {
  constexpr int kThreads = 8, kOps = 50;
  constexpr uint64_t kRegion = 1 << 20, kSlot = kRegion / kOps;
  constexpr uint64_t kSourceSize = 4 << 20;
  File source = PatternFile("source", kSourceSize, 50);
  const std::string target_path = dir_.File("target");
  File target = File::Open(target_path, OpenMode::kWrite);
  target.Truncate(kThreads * kRegion);
  Engine engine(Options(16 << 10));

  struct Write {
    uint64_t offset, length;
  };
  std::vector<std::vector<Write>> writes(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      std::vector<std::unique_ptr<GuardedBuffer>> reads;
      std::vector<uint64_t> read_offsets;
      std::vector<std::unique_ptr<AlignedBuffer>> sources;
      std::vector<Future> read_futures, write_futures;
      for (int i = 0; i < kOps; ++i) {
        // A read of any range of the shared source file.
        const uint64_t r_off = rng() % (kSourceSize - (64 << 10));
        const uint64_t r_len = 1 + rng() % (64 << 10);
        reads.push_back(std::make_unique<GuardedBuffer>(r_len, rng() % 4 == 0 ? 0 : rng() % 64));
        read_offsets.push_back(r_off);
        read_futures.push_back(engine.Read(source, reads.back()->data(), r_len, r_off));
        // A write into this thread's own slot of the target file.
        const uint64_t slot = t * kRegion + i * kSlot;
        const uint64_t w_off = slot + rng() % (kSlot / 2);
        const uint64_t w_len = 1 + rng() % (kSlot / 2);
        const size_t misalign = rng() % 4 == 0 ? 0 : rng() % 64;
        sources.push_back(std::make_unique<AlignedBuffer>(w_len + misalign));
        uint8_t* src = reinterpret_cast<uint8_t*>(sources.back()->data()) + misalign;
        FillPattern(src, w_len, 51, w_off);
        write_futures.push_back(engine.Write(target, src, w_len, w_off));
        writes[t].push_back({w_off, w_len});
      }
      for (int i = 0; i < kOps; ++i) {
        const IoResult& r = read_futures[i].Wait();
        EXPECT_EQ(r.bytes, reads[i]->length());
        EXPECT_TRUE(reads[i]->Holds(50, read_offsets[i], reads[i]->length()))
            << "thread " << t << " read " << i;
        EXPECT_EQ(write_futures[i].Wait().bytes, writes[t][i].length);
      }
    });
  }
  for (auto& th : threads) th.join();

  std::vector<uint8_t> expect(kThreads * kRegion, 0);
  for (const auto& per_thread : writes) {
    for (const Write& w : per_thread) FillPattern(expect.data() + w.offset, w.length, 51, w.offset);
  }
  EXPECT_EQ(ReadWholeFile(target_path), expect);
}

TEST_P(EngineTest, WaitAllWaitsForEverything) {
  constexpr int kOps = 24;
  constexpr uint64_t kLen = 96 << 10;
  const std::string path = dir_.File("data");
  File f = File::Open(path, OpenMode::kWrite);
  Engine engine(Options(16 << 10));
  std::vector<uint8_t> src = testing::Pattern(kOps * kLen, 52);
  std::vector<Future> futures;
  for (int i = 0; i < kOps; ++i) {
    futures.push_back(engine.Write(f, src.data() + i * kLen, kLen, i * kLen));
  }
  engine.WaitAll();
  for (int i = 0; i < kOps; ++i) EXPECT_TRUE(futures[i].done()) << "op " << i;
  EXPECT_EQ(ReadWholeFile(path), src);
  for (int i = 0; i < kOps; ++i) EXPECT_EQ(futures[i].Wait().bytes, kLen);
  engine.WaitAll();  // nothing outstanding: returns at once
}

TEST_P(EngineTest, FutureDoneAndRepeatedWait) {
  File f = PatternFile("data", 1 << 20, 53);
  Engine engine(Options());
  GuardedBuffer buf(1 << 20, 0);
  Future fut = engine.Read(f, buf.data(), 1 << 20, 0);
  EXPECT_TRUE(fut.valid());
  const IoResult& first = fut.Wait();
  EXPECT_TRUE(fut.done());
  const IoResult& second = fut.Wait();
  EXPECT_EQ(first.bytes, second.bytes);  // the same outcome, as a copy each time
  EXPECT_EQ(first.stats.requests, second.stats.requests);
  EXPECT_EQ(second.bytes, 1u << 20);
  Future copy = fut;
  EXPECT_TRUE(copy.done());
  EXPECT_EQ(copy.Wait().bytes, 1u << 20);
  EXPECT_TRUE(buf.Holds(53, 0, 1 << 20));
}

TEST_P(EngineTest, DefaultFutureIsNotValid) {
  Future fut;
  EXPECT_FALSE(fut.valid());
  EXPECT_THROW(fut.done(), std::logic_error);
  EXPECT_THROW(fut.Wait(), std::logic_error);
}

TEST_P(EngineTest, DestructorWaitsForInFlightOperations) {
  constexpr int kOps = 16;
  constexpr uint64_t kLen = 256 << 10;
  const std::string path = dir_.File("data");
  std::vector<uint8_t> src = testing::Pattern(kOps * kLen, 54);
  std::vector<Future> futures;
  {
    File f = File::Open(path, OpenMode::kWrite);
    Engine engine(Options());
    for (int i = 0; i < kOps; ++i) {
      futures.push_back(engine.Write(f, src.data() + i * kLen, kLen, i * kLen));
    }
    // The File handle goes first, the engine second: operations keep their files open.
  }
  for (int i = 0; i < kOps; ++i) {
    EXPECT_TRUE(futures[i].done()) << "op " << i << " still running after ~Engine";
    EXPECT_EQ(futures[i].Wait().bytes, kLen);
  }
  EXPECT_EQ(ReadWholeFile(path), src);
}

TEST_P(EngineTest, BadArgumentsAreRejectedUpFront) {
  File f = PatternFile("data", 8192, 55, OpenMode::kReadWrite);
  Engine engine(Options());
  uint8_t byte = 0;
  EXPECT_THROW(engine.Read(f, nullptr, 1, 0), std::invalid_argument);
  EXPECT_THROW(engine.Read(File(), &byte, 1, 0), std::invalid_argument);
  EXPECT_THROW(engine.Read(f, &byte, 1, UINT64_MAX), std::invalid_argument);
  EXPECT_THROW(engine.Read(f, &byte, UINT64_MAX, 1), std::invalid_argument);
  File closed = f;
  closed.Close();
  EXPECT_THROW(engine.Write(closed, &byte, 1, 0), std::invalid_argument);
  engine.WaitAll();
}

// A file size limit for the process while it lives (RLIMIT_FSIZE, SIGXFSZ ignored so that
// crossing it is the error EFBIG rather than the signal's death), restored after.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    EXPECT_EQ(getrlimit(RLIMIT_FSIZE, &old_), 0);
    old_handler_ = signal(SIGXFSZ, SIG_IGN);
    rlimit limit = old_;
    limit.rlim_cur = bytes;
    EXPECT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0) << std::strerror(errno);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &old_);
    signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit old_{};
  sighandler_t old_handler_;
};

// Reserving an extending write's range (fallocate, at submission where the file is O_DIRECT) can
// fail as the write itself would (no space, a file size limit): the error is the operation's,
// thrown by Wait() or, for a dropped future, by WaitAll(), once; the submitting call returns.
TEST_P(EngineTest, AnErrorReservingAWritesRangeIsThrownByTheWait) {
  constexpr uint64_t kLen = 4 << 20;
  AlignedBuffer src(kLen);
  std::memset(src.data(), 7, kLen);
  Engine engine(Options());
  File f = File::Open(dir_.File("big"), OpenMode::kWrite, true);
  File g = File::Open(dir_.File("dropped"), OpenMode::kWrite, true);
  FileSizeLimit limit(1 << 20);
  Future future;
  ASSERT_NO_THROW(future = engine.Write(f, src.data(), kLen, 0));
  try {
    future.Wait();
    ADD_FAILURE() << "a write past the file size limit succeeded";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EFBIG) << e.what();
    EXPECT_EQ(e.path(), f.path());
  }
  EXPECT_THROW(future.Wait(), IoError);                   // the same outcome again
  EXPECT_NO_THROW(engine.WaitAll());                      // already thrown to its waiter
  ASSERT_NO_THROW(engine.Write(g, src.data(), kLen, 0));  // dropped
  EXPECT_THROW(engine.WaitAll(), IoError);
  EXPECT_NO_THROW(engine.WaitAll());
  // Within the limit the engine writes as before.
  EXPECT_EQ(engine.Write(f, src.data(), 8192, 0).Wait().bytes, 8192u);
}

// A FIFO has no offsets: io_uring and libaio would read it from wherever it is (waiting for a
// writer forever) and write bytes into it at no offset. Every backend fails both with ESPIPE, as
// the operation's outcome, without waiting; what was written is nowhere.
TEST_P(EngineTest, AFifoIsReadAndWrittenByNoBackend) {
  const std::string fifo = dir_.File("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  // A reader holds the FIFO open, so that a write to it could go somewhere.
  const int reader = open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0);
  File f = File::Open(fifo, OpenMode::kReadWrite, true);
  EXPECT_FALSE(f.seekable());
  Engine engine(Options());
  AlignedBuffer buf(8192);
  std::memset(buf.data(), 3, buf.size());
  for (IoOp op : {IoOp::kRead, IoOp::kWrite}) {
    Future future;
    ASSERT_NO_THROW(future = engine.Submit(op, std::vector<IoDesc>{{f, buf.data(), 0, 8192}}));
    try {
      future.Wait();
      ADD_FAILURE() << "a FIFO was transferred at an offset";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_code(), ESPIPE) << e.what();
      EXPECT_EQ(e.path(), fifo);
      EXPECT_NE(std::string(e.what()).find("FIFO"), std::string::npos) << e.what();
    }
  }
  char byte;
  EXPECT_EQ(read(reader, &byte, 1), -1);  // nothing was written into it
  EXPECT_EQ(errno, EAGAIN);
  close(reader);
  // A regular file and /dev/zero have offsets.
  EXPECT_TRUE(PatternFile("data", 4096, 1).seekable());
  EXPECT_TRUE(File::Open("/dev/zero", OpenMode::kRead, true).seekable());
}

// ---------------------------------------------------------------------------------------------
// Page-cache awareness

class EnginePageCacheTest : public EngineTest {
 protected:
  static constexpr uint64_t kSize = 1 << 20;

  void SetUp() override {
    EngineTest::SetUp();
    if (IsSkipped()) return;
    file_ = PatternFile("data", kSize, 60);
    ASSERT_TRUE(file_.direct()) << file_.direct_fallback_reason();
    file_.DataSync();  // clean pages only can be dropped
    file_.DropCache();
    ASSERT_EQ(QueryResidency(file_.buffered_fd(), 0, kSize).resident_bytes, 0u)
        << "the page cache kept the file after DONTNEED";
  }

  // Reads the whole file through the page cache.
  void MakeResident() {
    std::vector<uint8_t> data = ReadWholeFile(dir_.File("data"));
    ASSERT_EQ(data.size(), kSize);
    ASSERT_EQ(QueryResidency(file_.buffered_fd(), 0, kSize).resident_bytes, kSize);
    // Given the file's size, the same answer without asking the file (and clamped to that size).
    const Residency sized =
        QueryResidency(file_.buffered_fd(), 0, kSize + 4096, ResidencyMethod::kUnknown, kSize);
    ASSERT_EQ(sized.resident_bytes, kSize);
    ASSERT_EQ(sized.checked_bytes, kSize);
    ASSERT_EQ(QueryResidency(file_.buffered_fd(), 0, kSize, ResidencyMethod::kUnknown, kSize / 2)
                  .checked_bytes,
              kSize / 2);
  }

  EngineOptions CheckingOptions(bool check = true) const {
    EngineOptions o = Options(64 << 10);
    o.page_cache_check = check;
    return o;
  }

  File file_;
};

TEST_P(EnginePageCacheTest, ResidentRangeIsReadBuffered) {
  ASSERT_NO_FATAL_FAILURE(MakeResident());
  Engine engine(CheckingOptions());
  constexpr uint64_t kOffset = 4097, kLength = 600000;
  IoResult r = CheckedRead(engine, file_, kOffset, kLength, 0, 60, kLength);
  Split s = ExpectedSplit(file_, kOffset, kLength);
  EXPECT_EQ(r.stats.cached_bytes, s.middle);
  EXPECT_EQ(r.stats.direct_bytes, 0u);
  EXPECT_EQ(r.stats.buffered_bytes, kLength);
  EXPECT_EQ(r.stats.residency_method, ResidencyMethodName(ResidencyMethodInUse()));
}

TEST_P(EnginePageCacheTest, DroppedRangeIsReadDirect) {
  ASSERT_NO_FATAL_FAILURE(MakeResident());
  Engine engine(CheckingOptions());
  constexpr uint64_t kOffset = 4097, kLength = 600000;
  IoResult cached = CheckedRead(engine, file_, kOffset, kLength, 0, 60, kLength);
  EXPECT_GT(cached.stats.cached_bytes, 0u);
  file_.DropCache();
  ASSERT_EQ(QueryResidency(file_.buffered_fd(), 0, kSize).resident_bytes, 0u);
  IoResult r = CheckedRead(engine, file_, kOffset, kLength, 0, 60, kLength);
  Split s = ExpectedSplit(file_, kOffset, kLength);
  EXPECT_EQ(r.stats.cached_bytes, 0u);
  EXPECT_EQ(r.stats.direct_bytes, s.middle);
  EXPECT_GT(r.stats.direct_bytes, 0u);
  EXPECT_EQ(r.stats.residency_method, ResidencyMethodName(ResidencyMethodInUse()));
}

TEST_P(EnginePageCacheTest, PartlyResidentRangeIsDecidedPerChunk) {
  // Make exactly the first 256 KiB resident (no readahead past it).
  int fd = open(dir_.File("data").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM), 0);
  std::vector<uint8_t> head(256 << 10);
  ASSERT_EQ(pread(fd, head.data(), head.size(), 0), static_cast<ssize_t>(head.size()));
  close(fd);
  ASSERT_EQ(QueryResidency(file_.buffered_fd(), 0, 256 << 10).resident_bytes, 256u << 10);
  if (QueryResidency(file_.buffered_fd(), 256 << 10, 256 << 10).resident_bytes != 0) {
    GTEST_SKIP() << "the kernel read ahead despite POSIX_FADV_RANDOM";
  }
  Engine engine(CheckingOptions());
  IoResult r = CheckedRead(engine, file_, 0, 512 << 10, 0, 60, 512 << 10);
  EXPECT_EQ(r.stats.cached_bytes, 256u << 10);
  EXPECT_EQ(r.stats.direct_bytes, 256u << 10);
}

TEST_P(EnginePageCacheTest, BatchOfSmallReadsDecidesPerFile) {
  // One batch over a cold file and a cached one: the cold file's pieces go direct, the cached
  // file's through the page cache, whatever shortcut the planner takes for a cold file.
  File cold = PatternFile("cold", kSize, 62);
  cold.DataSync();
  cold.DropCache();
  ASSERT_EQ(QueryResidency(cold.buffered_fd(), 0, kSize).resident_bytes, 0u);
  ASSERT_NO_FATAL_FAILURE(MakeResident());  // `data`
  Engine engine(CheckingOptions());
  constexpr int kPieces = 64;
  constexpr uint64_t kBlock = 4096;
  std::vector<IoDesc> descs;
  AlignedBuffer mem(2 * kPieces * kBlock);
  for (int i = 0; i < 2 * kPieces; ++i) {
    const File& f = i % 2 == 0 ? cold : file_;
    descs.push_back({f, mem.data() + i * kBlock, (i / 2) * 3 * kBlock, kBlock});
  }
  const IoResult& r = engine.Submit(IoOp::kRead, descs).Wait();
  EXPECT_EQ(r.bytes, 2 * kPieces * kBlock);
  EXPECT_EQ(r.stats.cached_bytes, kPieces * kBlock);
  EXPECT_EQ(r.stats.direct_bytes, kPieces * kBlock);
  for (int i = 0; i < 2 * kPieces; ++i) {
    EXPECT_TRUE(
        MatchesPattern(mem.data() + i * kBlock, kBlock, i % 2 == 0 ? 62 : 60, (i / 2) * 3 * kBlock))
        << "piece " << i;
  }
}

TEST_P(EnginePageCacheTest, CheckDisabledAlwaysReadsDirect) {
  ASSERT_NO_FATAL_FAILURE(MakeResident());
  Engine engine(CheckingOptions(false));
  constexpr uint64_t kOffset = 4097, kLength = 600000;
  IoResult r = CheckedRead(engine, file_, kOffset, kLength, 0, 60, kLength);
  EXPECT_EQ(r.stats.cached_bytes, 0u);
  EXPECT_EQ(r.stats.direct_bytes, ExpectedSplit(file_, kOffset, kLength).middle);
  EXPECT_EQ(r.stats.residency_method, "");
}

TEST_P(EnginePageCacheTest, WritesIgnoreResidency) {
  ASSERT_NO_FATAL_FAILURE(MakeResident());
  File f = File::Open(dir_.File("data"), OpenMode::kReadWrite);
  Engine engine(CheckingOptions());
  std::vector<uint8_t> src = testing::Pattern(256 << 10, 61);
  const IoResult& w = engine.Write(f, src.data(), src.size(), 0).Wait();
  EXPECT_EQ(w.stats.cached_bytes, 0u);
  EXPECT_EQ(w.stats.direct_bytes, 256u << 10);
  // The O_DIRECT write invalidated the cached pages: a buffered read sees the new bytes.
  std::vector<uint8_t> data = ReadWholeFile(dir_.File("data"));
  EXPECT_TRUE(MatchesPattern(data.data(), 256 << 10, 61));
  EXPECT_TRUE(MatchesPattern(data.data() + (256 << 10), kSize - (256 << 10), 60, 256 << 10));
}

// ---------------------------------------------------------------------------------------------
// Staged reads (SubmitOptions::stage_reads): direct reads into aligned memory go through the
// workers' bounce buffers when the options say so for the file.

EngineOptions StagingOptions(EngineOptions o, ReadStaging staging) {
  o.stage_reads = staging;
  return o;
}

TEST_P(EngineTest, StagedReadsGoThroughBounceBuffersAndLandExactly) {
  File f = PatternFile("data", 1 << 20, 90);
  Engine engine(StagingOptions(Options(), ReadStaging::kOn));
  // Aligned and unaligned ranges, aligned and misaligned memory, one chunk and several.
  for (auto [offset, length, misalign] : {std::tuple<uint64_t, uint64_t, size_t>{0, 1 << 20, 0},
                                          {4096, 64 << 10, 0},
                                          {4097, 600000, 0},
                                          {4097, 600000, 4095},
                                          {12345, 300001, 3},
                                          {8192, 4096, 0}}) {
    SCOPED_TRACE(::testing::Message() << "offset " << offset << " length " << length);
    GuardedBuffer buf(length, misalign);
    IoDesc piece{f, buf.data(), offset, length};
    IoResult r = engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
    EXPECT_EQ(r.bytes, length);
    EXPECT_TRUE(buf.Holds(90, offset, length));
    Split s = ExpectedSplit(f, offset, length);
    EXPECT_EQ(r.stats.direct_bytes, s.middle);
    EXPECT_EQ(r.stats.bounced_bytes, s.middle);
    // Memory the O_DIRECT rules already send through bounce buffers is not counted as staged.
    const bool middle_aligned = (misalign + s.head) % f.memory_alignment() == 0;
    EXPECT_EQ(r.stats.staged_bytes, middle_aligned ? s.middle : 0u);
  }
}

TEST_P(EngineTest, ReadsAreStagedOnlyWhenTheOperationAndTheOptionsBothAsk) {
  File f = PatternFile("data", 512 << 10, 91);
  struct Case {
    ReadStaging option;
    bool asked;
  };
  for (Case c : {Case{ReadStaging::kOn, false}, Case{ReadStaging::kOff, true},
                 Case{ReadStaging::kOff, false}, Case{ReadStaging::kAuto, false}}) {
    SCOPED_TRACE(::testing::Message() << ReadStagingName(c.option) << " asked " << c.asked);
    Engine engine(StagingOptions(Options(), c.option));
    GuardedBuffer buf(512 << 10, 0);
    IoDesc piece{f, buf.data(), 0, 512 << 10};
    IoResult r = engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = c.asked}).Wait();
    EXPECT_TRUE(buf.Holds(91, 0, 512 << 10));
    EXPECT_EQ(r.stats.direct_bytes, 512u << 10);
    EXPECT_EQ(r.stats.bounced_bytes, 0u);
    EXPECT_EQ(r.stats.staged_bytes, 0u);
  }
}

TEST_P(EngineTest, AutoStagingStagesWhereTheFilesBlockQueueSplitsScatteredMemory) {
  File f = PatternFile("data", 512 << 10, 92);
  const EngineOptions o = StagingOptions(Options(4 << 20), ReadStaging::kAuto);
  const auto& limits = f.block_queue_limits();
  if (!limits || !ScatteredMemorySplitsRequests(*limits, o.chunk_size) ||
      !GetsHugePages(o.chunk_size, Pages::kReused)) {
    GTEST_SKIP() << "auto does not stage on the test directory's disk ("
                 << (limits ? limits->queue_dir : std::string("no block queue")) << ")";
  }
  EXPECT_TRUE(StagesReads(o, f));
  Engine engine(o);
  GuardedBuffer buf(512 << 10, 0);
  IoDesc piece{f, buf.data(), 0, 512 << 10};
  IoResult r = engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
  EXPECT_TRUE(buf.Holds(92, 0, 512 << 10));
  EXPECT_EQ(r.stats.staged_bytes, 512u << 10);
}

TEST_P(EngineTest, AutoStagingWithoutCopyThreadsReadsStraightIntoMemoryNeverTouched) {
  File f = PatternFile("data", 1 << 20, 95);
  EngineOptions o = StagingOptions(Options(4 << 20), ReadStaging::kAuto);
  o.copy_threads = 0;  // the copy would fault each page in on a worker
  if (!StagesReads(o, f)) GTEST_SKIP() << "auto does not stage on the test directory's disk";
  Engine engine(o);
  // A new mapping, as a new process's tensors are: nothing of it faulted in yet.
  AlignedBuffer fresh(1 << 20);
  ASSERT_EQ(ResidentMemoryBytes(fresh.data(), 1 << 20), 0u);
  IoDesc piece{f, fresh.data(), 0, 1 << 20};
  IoResult r = engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
  EXPECT_TRUE(MatchesPattern(fresh.data(), 1 << 20, 95, 0));
  EXPECT_EQ(r.stats.direct_bytes, 1u << 20);
  EXPECT_EQ(r.stats.bounced_bytes, 0u);
  EXPECT_EQ(r.stats.staged_bytes, 0u);
  // Faulted in now: the same memory is staged.
  r = engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
  EXPECT_TRUE(MatchesPattern(fresh.data(), 1 << 20, 95, 0));
  EXPECT_EQ(r.stats.staged_bytes, 1u << 20);
}

// With copy threads the faults of the copy out are theirs, not the workers': auto stages memory
// never touched too (a new process's tensors).
TEST_P(EngineTest, AutoStagingWithCopyThreadsStagesMemoryNeverTouched) {
  File f = PatternFile("data", 1 << 20, 98);
  EngineOptions o = StagingOptions(Options(4 << 20), ReadStaging::kAuto);
  o.copy_threads = 1;
  if (!StagesReads(o, f)) GTEST_SKIP() << "auto does not stage on the test directory's disk";
  Engine engine(o);
  AlignedBuffer fresh(1 << 20);
  ASSERT_EQ(ResidentMemoryBytes(fresh.data(), 1 << 20), 0u);
  IoDesc piece{f, fresh.data(), 0, 1 << 20};
  IoResult r = engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
  EXPECT_TRUE(MatchesPattern(fresh.data(), 1 << 20, 98, 0));
  EXPECT_EQ(r.stats.staged_bytes, 1u << 20);
}

// Staged reads hold at most max_staged_bytes of bounce buffers however much is read and however
// slowly the copies go, with or without copy threads, and every byte lands.
TEST_P(EngineTest, StagedReadsHoldAtMostMaxStagedBytesOfBounceBuffers) {
  constexpr uint64_t kChunk = 64 << 10;
  constexpr uint64_t kSize = 8 << 20;
  File f = PatternFile("data", kSize, 99);
  for (unsigned copiers : {0u, 1u, 3u}) {
    SCOPED_TRACE(::testing::Message() << copiers << " copy threads");
    EngineOptions o = StagingOptions(Options(kChunk), ReadStaging::kOn);
    o.max_inflight_bytes = 64 * kChunk;  // the staging bound, not this one, must bite
    o.max_staged_bytes = 4 * kChunk;     // two chunks per worker
    o.copy_threads = copiers;
    Engine engine(o);
    AlignedBuffer dest(kSize);
    // Many pieces in one operation, and a second operation at the same time.
    std::vector<IoDesc> pieces;
    for (uint64_t at = 0; at < kSize / 2; at += 1 << 20)
      pieces.push_back({f, dest.data() + at, at, 1 << 20});
    IoDesc rest{f, dest.data() + kSize / 2, kSize / 2, kSize / 2};
    Future a = engine.Submit(IoOp::kRead, pieces, {.stage_reads = true});
    Future b = engine.Submit(IoOp::kRead, {&rest, 1}, {.stage_reads = true});
    EXPECT_EQ(a.Wait().stats.staged_bytes, kSize / 2);
    EXPECT_EQ(b.Wait().stats.staged_bytes, kSize / 2);
    EXPECT_TRUE(MatchesPattern(dest.data(), kSize, 99, 0));
    EXPECT_LE(engine.bounce_bytes(), 4 * kChunk);
    EXPECT_LE(engine.bounce_allocations(), 4u);
  }
}

// Writes and reads of memory O_DIRECT cannot use (a tensor 16 bytes past a page, as malloc gives)
// go through bounce buffers too, under the same bound: a save of gigabytes of such tensors in a
// new process faulted in max_inflight_bytes of fresh buffers before the disk got going.
TEST_P(EngineTest, UnalignedWritesAndReadsHoldAtMostMaxStagedBytesOfBounceBuffers) {
  constexpr uint64_t kChunk = 64 << 10;
  constexpr uint64_t kSize = 8 << 20;
  File f = PatternFile("data", kSize, 101, OpenMode::kReadWrite);
  EngineOptions o = Options(kChunk);
  o.max_inflight_bytes = 64 * kChunk;  // the bounce bound, not this one, must bite
  o.max_staged_bytes = 4 * kChunk;     // two chunks per worker
  o.page_cache_check = false;          // the read below goes direct, whatever is cached
  Engine engine(o);
  AlignedBuffer src(kSize + 4096);
  std::byte* unaligned = src.data() + 16;
  FillPattern(unaligned, kSize, 102, 0);
  std::vector<IoDesc> pieces;
  for (uint64_t at = 0; at < kSize; at += 1 << 20)
    pieces.push_back({f, unaligned + at, at, 1 << 20});
  IoResult w = engine.Submit(IoOp::kWrite, pieces).Wait();
  EXPECT_EQ(w.bytes, kSize);
  EXPECT_EQ(w.stats.bounced_bytes, kSize);
  EXPECT_EQ(w.stats.staged_bytes, 0u);
  EXPECT_LE(engine.bounce_bytes(), 4 * kChunk);
  EXPECT_LE(engine.bounce_allocations(), 4u);
  std::vector<uint8_t> data = ReadWholeFile(dir_.File("data"));
  EXPECT_TRUE(MatchesPattern(data.data(), data.size(), 102, 0));

  AlignedBuffer dest(kSize + 4096);
  IoResult r = engine.Read(f, dest.data() + 16, kSize, 0).Wait();
  EXPECT_EQ(r.bytes, kSize);
  EXPECT_EQ(r.stats.bounced_bytes, kSize);
  EXPECT_TRUE(MatchesPattern(dest.data() + 16, kSize, 102, 0));
  EXPECT_LE(engine.bounce_bytes(), 4 * kChunk);
  EXPECT_LE(engine.bounce_allocations(), 4u);
}

// Copy threads serve every worker and every caller: staged reads from several threads at once,
// into fresh and reused memory, land exactly (TSan runs this).
TEST_P(EngineTest, StagedReadsFromManyThreadsThroughCopyThreadsLandExactly) {
  constexpr uint64_t kSize = 2 << 20;
  File f = PatternFile("data", kSize, 100);
  EngineOptions o = StagingOptions(Options(64 << 10), ReadStaging::kOn);
  o.copy_threads = 2;
  Engine engine(o);
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      for (int round = 0; round < 4; ++round) {
        const uint64_t offset = static_cast<uint64_t>((i * 4 + round) % 8) * 4096;
        const uint64_t length = kSize - offset - 4096 * static_cast<uint64_t>(i);
        AlignedBuffer dest(length);
        IoDesc piece{f, dest.data(), offset, length};
        try {
          IoResult r = engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
          if (r.bytes != length || !MatchesPattern(dest.data(), length, 100, offset)) ++wrong;
        } catch (...) {
          ++wrong;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST_P(EngineTest, StagingOnStagesMemoryNeverTouchedToo) {
  File f = PatternFile("data", 1 << 20, 96);
  Engine engine(StagingOptions(Options(4 << 20), ReadStaging::kOn));
  AlignedBuffer fresh(1 << 20);
  IoDesc piece{f, fresh.data(), 0, 1 << 20};
  IoResult r = engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
  EXPECT_TRUE(MatchesPattern(fresh.data(), 1 << 20, 96, 0));
  EXPECT_EQ(r.stats.staged_bytes, 1u << 20);
}

// A read-only mapping of its own, unmapped at the end of the test.
class ReadOnlyMemory {
 public:
  explicit ReadOnlyMemory(size_t bytes) : bytes_(bytes) {
    p_ = mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p_ == MAP_FAILED) throw std::runtime_error("mmap");
  }
  ~ReadOnlyMemory() { munmap(p_, bytes_); }
  ReadOnlyMemory(const ReadOnlyMemory&) = delete;
  ReadOnlyMemory& operator=(const ReadOnlyMemory&) = delete;
  std::byte* data() const { return static_cast<std::byte*>(p_); }

 private:
  size_t bytes_;
  void* p_;
};

// A bounced read copies on an engine thread: into read-only memory it must fail with EFAULT, as
// a direct read into it does, whether staged or bounced for alignment, and the engine goes on.
TEST_P(EngineTest, BouncedReadIntoReadOnlyMemoryFailsWithEfault) {
  File f = PatternFile("data", 1 << 20, 97);
  for (auto [staging, copiers] : {std::pair{ReadStaging::kOn, 2u}, std::pair{ReadStaging::kOn, 0u},
                                  std::pair{ReadStaging::kOff, 2u}}) {
    SCOPED_TRACE(::testing::Message() << ReadStagingName(staging) << ", " << copiers << " copiers");
    EngineOptions o = StagingOptions(Options(256 << 10), staging);
    o.copy_threads = copiers;
    Engine engine(o);
    ReadOnlyMemory ro((1 << 20) + 4096);
    // kOn stages the aligned read; kOff bounces the unaligned one.
    std::byte* target = staging == ReadStaging::kOn ? ro.data() : ro.data() + 16;
    IoDesc piece{f, target, 0, 1 << 20};
    try {
      engine.Submit(IoOp::kRead, {&piece, 1}, {.stage_reads = true}).Wait();
      ADD_FAILURE() << "read into read-only memory succeeded";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_code(), EFAULT) << e.what();
      EXPECT_EQ(e.path(), f.path());
    }
    AlignedBuffer ok(1 << 20);
    IoDesc good{f, ok.data(), 0, 1 << 20};
    engine.Submit(IoOp::kRead, {&good, 1}, {.stage_reads = true}).Wait();
    EXPECT_TRUE(MatchesPattern(ok.data(), 1 << 20, 97, 0));
  }
}

TEST(MemoryIsWritableTest, TellsWritableFromReadOnlyAndUnmapped) {
  const uint64_t page = SystemPageSize();
  AlignedBuffer rw(4 * page);
  EXPECT_TRUE(MemoryIsWritable(rw.data() + 1, 3 * page));
  EXPECT_TRUE(MemoryIsWritable(nullptr, 0));
  ReadOnlyMemory ro(2 * page);
  EXPECT_FALSE(MemoryIsWritable(ro.data(), page));
  EXPECT_FALSE(MemoryIsWritable(ro.data() + page - 1, 2));
  void* gone = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(gone, MAP_FAILED);
  ASSERT_EQ(munmap(gone, page), 0);
  EXPECT_FALSE(MemoryIsWritable(gone, page));
}

TEST(MemoryIsWritableTest, SharedFileMappingPastTheEndOfItsFileIsNot) {
  const uint64_t page = SystemPageSize();
  TempDir dir;
  WritePatternFile(dir.File("f"), page, 1);
  File f = File::Open(dir.File("f"), OpenMode::kReadWrite, false);
  void* p = mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE, MAP_SHARED, f.buffered_fd(), 0);
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_TRUE(MemoryIsWritable(p, page));
  EXPECT_FALSE(MemoryIsWritable(static_cast<std::byte*>(p) + 2 * page, page));
  munmap(p, 4 * page);
}

TEST(ResidentMemoryBytesTest, CountsThePagesFaultedIn) {
  const uint64_t page = SystemPageSize();
  AlignedBuffer mem(16 * page);
  EXPECT_EQ(ResidentMemoryBytes(mem.data(), 16 * page), 0u);
  for (uint64_t i = 0; i < 16; i += 2) mem.data()[i * page] = std::byte{1};
  EXPECT_EQ(ResidentMemoryBytes(mem.data(), 16 * page), 8 * page);
  // Unaligned ranges count whole pages, at most the length asked about.
  EXPECT_EQ(ResidentMemoryBytes(mem.data() + 1, 10), 10u);
  EXPECT_EQ(ResidentMemoryBytes(mem.data() + page + 1, page), page);
  EXPECT_EQ(ResidentMemoryBytes(mem.data(), 0), 0u);
}

TEST(ResidentMemoryBytesTest, UnmappedMemoryCountsAsAbsent) {
  const uint64_t page = SystemPageSize();
  void* p = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  static_cast<volatile char*>(p)[0] = 1;
  static_cast<volatile char*>(p)[page] = 1;
  ASSERT_EQ(munmap(static_cast<char*>(p) + page, page), 0);
  EXPECT_EQ(ResidentMemoryBytes(p, page), page);
  EXPECT_EQ(ResidentMemoryBytes(p, 2 * page), 0u);
  munmap(p, page);
}

TEST(StagesReadsTest, AutoNeedsHugePageBounceBuffersAndAQueueThatSplits) {
  TempDir dir;
  WritePatternFile(dir.File("f"), 4096, 1);
  File f = File::Open(dir.File("f"), OpenMode::kRead);
  EngineOptions o;
  o.stage_reads = ReadStaging::kOn;
  EXPECT_TRUE(StagesReads(o, f));
  o.stage_reads = ReadStaging::kOff;
  EXPECT_FALSE(StagesReads(o, f));
  o.stage_reads = ReadStaging::kAuto;
  o.chunk_size = 1 << 20;  // bounce buffers under 4 MiB never get huge pages
  EXPECT_FALSE(StagesReads(o, f));
  o.chunk_size = 4 << 20;
  const auto& limits = f.block_queue_limits();
  EXPECT_EQ(StagesReads(o, f), limits && ScatteredMemorySplitsRequests(*limits, o.chunk_size) &&
                                   UsesHugePages(Pages::kReused));
}

TEST_P(EngineTest, WritesAreNeverStaged) {
  File f = PatternFile("data", 256 << 10, 93, OpenMode::kReadWrite);
  Engine engine(StagingOptions(Options(), ReadStaging::kOn));
  AlignedBuffer src(256 << 10);
  FillPattern(src.data(), 256 << 10, 94, 0);
  IoDesc piece{f, src.data(), 0, 256 << 10};
  IoResult r = engine.Submit(IoOp::kWrite, {&piece, 1}, {.stage_reads = true}).Wait();
  EXPECT_EQ(r.stats.direct_bytes, 256u << 10);
  EXPECT_EQ(r.stats.bounced_bytes, 0u);
  EXPECT_EQ(r.stats.staged_bytes, 0u);
  std::vector<uint8_t> data = ReadWholeFile(dir_.File("data"));
  EXPECT_TRUE(MatchesPattern(data.data(), data.size(), 94, 0));
}

TEST_P(EngineTest, StagedScatterReadOfManyPiecesFromThreads) {
  // Bounce buffers are per worker: pieces of several operations from several threads share
  // them, and each copy must land in its own piece.
  constexpr uint64_t kSize = 2 << 20;
  File f = PatternFile("data", kSize, 95);
  Engine engine(StagingOptions(Options(), ReadStaging::kOn));
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      std::vector<std::unique_ptr<GuardedBuffer>> bufs;
      std::vector<IoDesc> descs;
      std::vector<uint64_t> offsets;
      for (int i = 0; i < 24; ++i) {
        const uint64_t offset = (rng() % (kSize / 4096)) * 4096 + (i % 3 == 0 ? rng() % 4096 : 0);
        const uint64_t length = std::min<uint64_t>(kSize - offset, 1 + rng() % (200 << 10));
        bufs.push_back(std::make_unique<GuardedBuffer>(length, 0));
        descs.push_back({f, bufs.back()->data(), offset, length});
        offsets.push_back(offset);
      }
      IoResult r = engine.Submit(IoOp::kRead, descs, {.stage_reads = true}).Wait();
      if (r.stats.staged_bytes == 0) ++failures[t];
      for (size_t i = 0; i < bufs.size(); ++i) {
        if (!bufs[i]->Holds(95, offsets[i], bufs[i]->length())) ++failures[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures, std::vector<int>(4, 0));
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineTest, ::testing::ValuesIn(CompiledBackends()),
                         testing::BackendParamName());
INSTANTIATE_TEST_SUITE_P(Backends, EnginePageCacheTest, ::testing::ValuesIn(CompiledBackends()),
                         testing::BackendParamName());
INSTANTIATE_TEST_SUITE_P(Backends, BounceIdleTest, ::testing::ValuesIn(CompiledBackends()),
                         testing::BackendParamName());

// ---------------------------------------------------------------------------------------------
// Engine construction (not per backend)

TEST(EngineStatsTest, AddingStatsSumsCountsAndKeepsFlags) {
  IoStats total;
  IoStats a;
  a.backend = "io_uring";
  a.requested_bytes = a.transferred_bytes = 10;
  a.direct_bytes = 8;
  a.buffered_bytes = 2;
  a.requests = 3;
  IoStats b;
  b.backend = "threads";
  b.requested_bytes = 5;
  b.transferred_bytes = 4;
  b.bounced_bytes = b.direct_bytes = 4;
  b.cached_bytes = b.buffered_bytes = 1;
  b.requests = 2;
  b.resubmits = 1;
  b.eof = true;
  b.residency_method = "cachestat";
  total += a;
  total += b;
  EXPECT_EQ(total.backend, "io_uring");  // the first operation's
  EXPECT_EQ(total.requested_bytes, 15u);
  EXPECT_EQ(total.transferred_bytes, 14u);
  EXPECT_EQ(total.direct_bytes, 12u);
  EXPECT_EQ(total.buffered_bytes, 3u);
  EXPECT_EQ(total.bounced_bytes, 4u);
  EXPECT_EQ(total.cached_bytes, 1u);
  EXPECT_EQ(total.requests, 5u);
  EXPECT_EQ(total.resubmits, 1u);
  EXPECT_TRUE(total.eof);
  EXPECT_FALSE(total.direct_fallback);
  EXPECT_EQ(total.residency_method, "cachestat");
}

TEST(EngineConstructionTest, BadOptionsAreRejected) {
  EngineOptions o = testing::SmallEngineOptions(BackendKind::kThreads);
  o.workers = 0;
  EXPECT_THROW(Engine{o}, std::invalid_argument);
  o = testing::SmallEngineOptions(BackendKind::kThreads);
  o.backend = "nope";
  EXPECT_THROW(Engine{o}, std::invalid_argument);
}

TEST(EngineConstructionTest, AutoPicksTheFirstBackendThatPassesTheProbe) {
  TempDir dir;
  EngineOptions o = testing::SmallEngineOptions(BackendKind::kThreads);
  o.backend = "auto";
  Engine engine(o, dir.path());
  std::string expect;
  for (BackendKind k : kAllBackends) {
    BackendProbe p = ProbeBackend(k, dir.path());
    if (p.available && (p.direct_ok || p.buffered_ok)) {
      expect = BackendName(k);
      break;
    }
  }
  EXPECT_EQ(engine.backend(), expect);
}

TEST(EngineConstructionTest, AProbeDirectoryThatCannotTakeAFileIsAnIoErrorNamingIt) {
  TempDir dir;
  EngineOptions o = testing::SmallEngineOptions(BackendKind::kThreads);
  o.backend = "auto";
  const std::string missing = dir.path() + "/missing";
  try {
    Engine engine(o, missing);
    FAIL() << "an engine started with a missing probe directory";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_EQ(e.path(), missing);
  }
  const std::string file = dir.path() + "/file";
  std::ofstream(file) << "x";
  try {
    Engine engine(o, file);
    FAIL() << "an engine started with a file as its probe directory";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOTDIR);
  }
}

TEST(EngineConstructionTest, FailingFactoryIsReported) {
  EngineOptions o = testing::SmallEngineOptions(BackendKind::kThreads);
  auto factory = [](unsigned) -> std::unique_ptr<Backend> {
    ThrowIoError(EPERM, "test backend", "(test)");
  };
  try {
    Engine engine(o, factory);
    FAIL() << "no exception";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), EPERM);
  }
}

// ---------------------------------------------------------------------------------------------
// QueryResidency

class ResidencyTest : public ::testing::TestWithParam<ResidencyMethod> {
 protected:
  static constexpr uint64_t kSize = 512 << 10;
  void SetUp() override {
    if (GetParam() == ResidencyMethod::kCachestat &&
        ResidencyMethodInUse() != ResidencyMethod::kCachestat) {
      GTEST_SKIP() << "cachestat(2) needs Linux 6.5";
    }
    ASSERT_NO_FATAL_FAILURE(WritePatternFile(dir_.File("data"), kSize, 70));
    file_ = File::Open(dir_.File("data"), OpenMode::kRead, /*direct=*/false);
    file_.DataSync();
    file_.DropCache();
  }
  ResidencyMethod Expected() const {
    return GetParam() == ResidencyMethod::kUnknown ? ResidencyMethodInUse() : GetParam();
  }
  TempDir dir_;
  File file_;
};

TEST_P(ResidencyTest, DroppedRangeIsNotResident) {
  Residency r = QueryResidency(file_.buffered_fd(), 0, kSize, GetParam());
  EXPECT_EQ(r.method, Expected());
  EXPECT_EQ(r.checked_bytes, kSize);
  EXPECT_EQ(r.resident_bytes, 0u);
}

TEST_P(ResidencyTest, CachedRangeIsResident) {
  ASSERT_EQ(ReadWholeFile(dir_.File("data")).size(), kSize);
  Residency r = QueryResidency(file_.buffered_fd(), 0, kSize, GetParam());
  EXPECT_EQ(r.method, Expected());
  EXPECT_EQ(r.checked_bytes, kSize);
  EXPECT_EQ(r.resident_bytes, kSize);
  // An unaligned sub-range counts no more than its own bytes.
  Residency sub = QueryResidency(file_.buffered_fd(), 100, 5000, GetParam());
  EXPECT_EQ(sub.checked_bytes, 5000u);
  EXPECT_EQ(sub.resident_bytes, 5000u);
  file_.DropCache();
  EXPECT_EQ(QueryResidency(file_.buffered_fd(), 0, kSize, GetParam()).resident_bytes, 0u);
}

TEST_P(ResidencyTest, PartlyCachedRangeCountsOnlyCachedPages) {
  int fd = open(dir_.File("data").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM), 0);
  std::vector<uint8_t> buf(64 << 10);
  ASSERT_EQ(pread(fd, buf.data(), buf.size(), 128 << 10), static_cast<ssize_t>(buf.size()));
  close(fd);
  Residency r = QueryResidency(file_.buffered_fd(), 0, kSize, GetParam());
  EXPECT_EQ(r.checked_bytes, kSize);
  EXPECT_GE(r.resident_bytes, 64u << 10);
  EXPECT_LT(r.resident_bytes, kSize);
  EXPECT_EQ(QueryResidency(file_.buffered_fd(), 128 << 10, 64 << 10, GetParam()).resident_bytes,
            64u << 10);
}

TEST_P(ResidencyTest, RangeIsClippedToTheFileSize) {
  Residency r = QueryResidency(file_.buffered_fd(), kSize - 1000, 1 << 20, GetParam());
  EXPECT_EQ(r.checked_bytes, 1000u);
  EXPECT_EQ(r.method, Expected());
}

TEST_P(ResidencyTest, RangeBeyondEofChecksNothing) {
  Residency r = QueryResidency(file_.buffered_fd(), kSize, 4096, GetParam());
  EXPECT_EQ(r.checked_bytes, 0u);
  EXPECT_EQ(r.resident_bytes, 0u);
  Residency empty = QueryResidency(file_.buffered_fd(), 0, 0, GetParam());
  EXPECT_EQ(empty.checked_bytes, 0u);
}

TEST_P(ResidencyTest, BadDescriptorGivesUnknownWithoutThrowing) {
  Residency r = QueryResidency(-1, 0, 4096, GetParam());
  EXPECT_EQ(r.method, ResidencyMethod::kUnknown);
  EXPECT_EQ(r.checked_bytes, 0u);
  EXPECT_EQ(r.resident_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Methods, ResidencyTest,
                         ::testing::Values(ResidencyMethod::kUnknown, ResidencyMethod::kCachestat,
                                           ResidencyMethod::kMincore),
                         [](const ::testing::TestParamInfo<ResidencyMethod>& info) {
                           return info.param == ResidencyMethod::kUnknown
                                      ? std::string("default")
                                      : std::string(ResidencyMethodName(info.param));
                         });

TEST(ResidencyMethodTest, Names) {
  EXPECT_EQ(ResidencyMethodName(ResidencyMethod::kCachestat), "cachestat");
  EXPECT_EQ(ResidencyMethodName(ResidencyMethod::kMincore), "mincore");
  EXPECT_EQ(ResidencyMethodName(ResidencyMethod::kUnknown), "none");
  EXPECT_NE(ResidencyMethodInUse(), ResidencyMethod::kUnknown);
}

}  // namespace
}  // namespace tensortier
