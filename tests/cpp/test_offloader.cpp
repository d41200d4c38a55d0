// Offloader: write/read round trips of awkward sizes from aligned and unaligned memory, space reuse
// and tail shrinking (checked against the real file size too), vectored calls, argument errors
// that must change nothing, injected I/O faults and a backing file cut short behind its back
// (failed writes leave the key unknown, failed reads leave it stored), striping over several
// directories, Discard, Close and the destructor, removal of stale files, and concurrent use.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/offload/offloader.hpp"
#include "tensortier/util/process_identity.hpp"
#include "tensortier/util/strings.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::CompiledBackends;
using testing::FillPattern;
using testing::MatchesPattern;
using testing::Plan;
using testing::TempDir;

using testing::kMiB;
constexpr uint64_t kOffloadSizes[] = {0, 1, 4095, 4096, 4097, kMiB + 3};

// `length` bytes of host memory starting `misalign` bytes past a page boundary.
class HostBuffer {
 public:
  HostBuffer(uint64_t length, size_t misalign)
      : mem_(static_cast<size_t>(length) + misalign + 1), misalign_(misalign), length_(length) {}
  uint8_t* data() const { return reinterpret_cast<uint8_t*>(mem_.data()) + misalign_; }
  uint64_t size() const { return length_; }

 private:
  AlignedBuffer mem_;
  size_t misalign_;
  uint64_t length_;
};

// HostBuffer holding pattern `seed`.
HostBuffer PatternBuffer(uint64_t length, size_t misalign, uint64_t seed) {
  HostBuffer b(length, misalign);
  FillPattern(b.data(), length, seed);
  return b;
}

// Size of the file at `path` per stat(2), or -1 when it does not exist.
int64_t FileSize(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return -1;
  return st.st_size;
}

bool Exists(const std::string& path) {
  return FileSize(path) >= 0;
}

void Touch(const std::string& path) {
  std::ofstream(path) << "x";
}

// The errno of the IoError in `error`: 0 when null, -1 for anything but an IoError.
int ErrnoOf(const std::exception_ptr& error) {
  if (error == nullptr) return 0;
  try {
    std::rethrow_exception(error);
  } catch (const IoError& e) {
    return e.error_code();
  } catch (...) {
    return -1;
  }
}

std::string Describe(const std::exception_ptr& error) {
  if (error == nullptr) return "success";
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

// Success iff the outcomes name exactly `keys`, in that order, all without error.
::testing::AssertionResult AllOk(const std::vector<OffloadOutcome>& outcomes,
                                 const std::vector<uint64_t>& keys) {
  if (outcomes.size() != keys.size()) {
    return ::testing::AssertionFailure() << outcomes.size() << " outcomes, want " << keys.size();
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (outcomes[i].key != keys[i]) {
      return ::testing::AssertionFailure()
             << "outcome " << i << " is for key " << outcomes[i].key << ", want " << keys[i];
    }
    if (outcomes[i].error != nullptr) {
      return ::testing::AssertionFailure()
             << "key " << keys[i] << " failed: " << Describe(outcomes[i].error);
    }
  }
  return ::testing::AssertionSuccess();
}

class OffloaderTest : public testing::BackendTest {
 protected:
  OffloaderOptions Options(std::vector<std::string> dirs = {}) {
    OffloaderOptions o;
    o.dirs = dirs.empty() ? std::vector<std::string>{dir_.path()} : std::move(dirs);
    o.engine = testing::SmallEngineOptions(GetParam());
    return o;
  }

  // Options whose engine backends share one injector following `plan`.
  OffloaderOptions FaultyOptions(const FaultPlan& plan, std::vector<std::string> dirs = {}) {
    OffloaderOptions o = Options(std::move(dirs));
    injector_ = std::make_shared<FaultInjector>(plan);
    BackendKind kind = GetParam();
    auto injector = injector_;
    o.backend_factory = [kind, injector](unsigned depth) {
      return MakeFaultInjectingBackend(MakeBackend(kind, depth), injector);
    };
    return o;
  }

  // Writes pattern `seed` under `key` and waits for it; expects success.
  void Store(Offloader& off, uint64_t key, uint64_t length, uint64_t seed, size_t misalign = 0) {
    HostBuffer src = PatternBuffer(length, misalign, seed);
    off.AsyncWrite(key, src.data(), length);
    EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), {key}));
    EXPECT_TRUE(off.stored(key));
  }

  // Reads `key` back and waits; expects success, pattern `seed`, and the key gone.
  void Load(Offloader& off, uint64_t key, uint64_t length, uint64_t seed, size_t misalign = 0) {
    HostBuffer dst(length, misalign);
    std::memset(dst.data(), 0xEE, length);
    off.AsyncRead(key, dst.data(), length);
    EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kRead), {key}));
    EXPECT_TRUE(MatchesPattern(dst.data(), length, seed));
    EXPECT_FALSE(off.stored(key));
    EXPECT_FALSE(off.pending(key));
  }

  // A write failing with `error` is reported in its outcome, leaves the key unknown and its space
  // free; writing the key again then works.
  void CheckFailedWrite(Offloader& off, int error) {
    constexpr uint64_t kSize = kMiB + 3;
    HostBuffer src = PatternBuffer(kSize, 1, 1);
    off.AsyncWrite(1, src.data(), kSize);
    std::vector<OffloadOutcome> outcomes = off.Wait(OffloadKind::kWrite);
    ASSERT_EQ(outcomes.size(), 1u);
    EXPECT_EQ(outcomes[0].key, 1u);
    EXPECT_EQ(ErrnoOf(outcomes[0].error), error) << Describe(outcomes[0].error);
    EXPECT_FALSE(off.stored(1));
    EXPECT_FALSE(off.pending(1));
    EXPECT_EQ(off.stored_bytes(), 0u);
    off.Trim();  // freed tail space goes back in the background; now
    EXPECT_EQ(off.file_bytes(), 0u);
    EXPECT_EQ(FileSize(off.paths()[0]), 0);
    HostBuffer dst(kSize, 0);
    EXPECT_THROW(off.AsyncRead(1, dst.data(), kSize), std::invalid_argument);

    off.AsyncWrite(1, src.data(), kSize);
    EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), {1}));
    EXPECT_EQ(off.stored_bytes(), kSize);
    Load(off, 1, kSize, 1, 33);
  }

  TempDir dir_;
  std::shared_ptr<FaultInjector> injector_;
};

// The offloader's engine gives its bounce buffers back as soon as it is idle (the memory a
// caller offloads to get back), unless TENSORTIER_BOUNCE_IDLE_MS says otherwise.
TEST(OffloaderEngineDefaultsTest, BounceBuffersGoAtOnceUnlessTheEnvironmentSays) {
  {
    testing::ScopedEnv unset("TENSORTIER_BOUNCE_IDLE_MS", std::nullopt);
    EXPECT_EQ(OffloaderEngineDefaults().bounce_idle_ms, 0u);
    EXPECT_EQ(OffloaderOptions{}.engine.bounce_idle_ms, 0u);
    EXPECT_EQ(EngineOptions::FromEnvironment().bounce_idle_ms, EngineOptions{}.bounce_idle_ms);
  }
  {
    testing::ScopedEnv empty("TENSORTIER_BOUNCE_IDLE_MS", "");
    EXPECT_EQ(OffloaderEngineDefaults().bounce_idle_ms, 0u);
  }
  testing::ScopedEnv set("TENSORTIER_BOUNCE_IDLE_MS", "250");
  EXPECT_EQ(OffloaderEngineDefaults().bounce_idle_ms, 250u);
}

// ---------------------------------------------------------------------------------------------
// Round trips and space

TEST_P(OffloaderTest, BackingFilesAreTheOwnersOnly) {
  // Parked tensors are no other user's to read, whatever the umask allows (0644 under 022).
  const mode_t umask_before = umask(022);
  Offloader off(Options());
  umask(umask_before);
  ASSERT_FALSE(off.paths().empty());
  for (const std::string& path : off.paths()) {
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << path;
  }
}

TEST_P(OffloaderTest, RoundTripSizesAndAlignments) {
  Offloader off(Options());
  ASSERT_EQ(off.paths().size(), 1u);
  const std::string path = off.paths()[0];
  EXPECT_EQ(FileSize(path), 0);
  EXPECT_EQ(off.backend(), BackendName(GetParam()));
  uint64_t key = 100;
  for (uint64_t size : kOffloadSizes) {
    for (size_t misalign : {size_t{0}, size_t{1}, size_t{17}, size_t{63}}) {
      ++key;
      SCOPED_TRACE(StrCat("size ", size, ", misalign ", misalign, ", key ", key));
      HostBuffer src = PatternBuffer(size, misalign, key);
      off.AsyncWrite(key, src.data(), size);
      EXPECT_FALSE(off.stored(key)) << "stored before Wait(kWrite)";
      EXPECT_TRUE(off.pending(key));
      EXPECT_EQ(off.stored_bytes(), 0u);
      EXPECT_TRUE(off.Wait(OffloadKind::kRead).empty()) << "a read wait applies no write";
      EXPECT_FALSE(off.stored(key));
      EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), {key}));
      EXPECT_TRUE(off.stored(key));
      EXPECT_FALSE(off.pending(key));
      EXPECT_EQ(off.stored_bytes(), size);
      EXPECT_EQ(off.file_bytes(), AlignUp(size, kPageSize));
      EXPECT_GE(FileSize(path), static_cast<int64_t>(size));
      EXPECT_LE(FileSize(path), static_cast<int64_t>(AlignUp(size, kPageSize)));

      const size_t read_misalign = (misalign * 7) % 64;
      HostBuffer dst(size, read_misalign);
      std::memset(dst.data(), 0xEE, size);
      off.AsyncRead(key, dst.data(), size);
      EXPECT_TRUE(off.pending(key));
      EXPECT_TRUE(off.stored(key)) << "the data stays until the read is waited for";
      EXPECT_EQ(off.stored_bytes(), size);
      EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kRead), {key}));
      EXPECT_TRUE(MatchesPattern(dst.data(), size, key));
      EXPECT_FALSE(off.stored(key));
      EXPECT_FALSE(off.pending(key));
      EXPECT_EQ(off.stored_bytes(), 0u);
      off.Trim();  // freed tail space goes back in the background; now
      EXPECT_EQ(off.file_bytes(), 0u);
      EXPECT_EQ(FileSize(path), 0) << "tail space goes back to the filesystem";
    }
  }
}

TEST_P(OffloaderTest, ReadSpaceIsReused) {
  Offloader off(Options());
  const std::string path = off.paths()[0];
  constexpr uint64_t kA = 100000, kB = 300001, kC = 50000;
  Store(off, 1, kA, 1);
  Store(off, 2, kB, 2, 3);
  Store(off, 3, kC, 3);
  const uint64_t full = off.file_bytes();
  EXPECT_EQ(full, AlignUp(kA, kPageSize) + AlignUp(kB, kPageSize) + AlignUp(kC, kPageSize));
  const int64_t full_size = FileSize(path);

  Load(off, 2, kB, 2);
  EXPECT_EQ(off.file_bytes(), full) << "B's space is a hole in the middle";
  EXPECT_EQ(off.stored_bytes(), kA + kC);

  Store(off, 4, kB, 4, 5);
  EXPECT_EQ(off.file_bytes(), full) << "D reuses B's space";
  EXPECT_EQ(FileSize(path), full_size);
  EXPECT_EQ(off.stored_bytes(), kA + kB + kC);

  Load(off, 1, kA, 1, 9);
  Load(off, 4, kB, 4, 1);
  EXPECT_EQ(off.file_bytes(), full) << "C still holds the tail";
  Load(off, 3, kC, 3);
  off.Trim();  // freed tail space goes back in the background; now
  EXPECT_EQ(off.file_bytes(), 0u);
  EXPECT_EQ(FileSize(path), 0);
}

TEST_P(OffloaderTest, WritevReadvManyKeysInAnyOrder) {
  Offloader off(Options());
  constexpr size_t kKeys = 40;
  std::vector<uint64_t> keys;
  std::vector<uint64_t> sizes;
  std::vector<HostBuffer> src;
  std::vector<OffloadPiece> pieces;
  uint64_t total = 0;
  for (size_t i = 0; i < kKeys; ++i) {
    keys.push_back(7000 + 13 * i);
    sizes.push_back(i % 10 == 0 ? 0 : (i * 30011) % 200000 + i % 3);
    src.push_back(PatternBuffer(sizes[i], i % 64, keys[i]));
    pieces.push_back(OffloadPiece{keys[i], src[i].data(), sizes[i]});
    total += sizes[i];
  }
  off.AsyncWritev(pieces);
  for (uint64_t key : keys) EXPECT_TRUE(off.pending(key));
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), keys));
  EXPECT_EQ(off.stored_bytes(), total);

  // Read back in a shuffled order over two calls, waited for together.
  std::vector<size_t> order(kKeys);
  for (size_t i = 0; i < kKeys; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(42));
  std::vector<HostBuffer> dst;
  std::vector<OffloadPiece> first, second;
  std::vector<uint64_t> read_keys;
  for (size_t n = 0; n < kKeys; ++n) {
    const size_t i = order[n];
    dst.emplace_back(sizes[i], (i * 5) % 64);
    std::memset(dst.back().data(), 0xEE, sizes[i]);
    (n < kKeys / 2 ? first : second).push_back(OffloadPiece{keys[i], dst.back().data(), sizes[i]});
    read_keys.push_back(keys[i]);
  }
  off.AsyncReadv(first);
  off.AsyncReadv(second);
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kRead), read_keys));
  for (size_t n = 0; n < kKeys; ++n) {
    const size_t i = order[n];
    EXPECT_TRUE(MatchesPattern(dst[n].data(), sizes[i], keys[i])) << "key " << keys[i];
    EXPECT_FALSE(off.stored(keys[i]));
  }
  EXPECT_EQ(off.stored_bytes(), 0u);
  off.Trim();  // freed tail space goes back in the background; now
  EXPECT_EQ(off.file_bytes(), 0u);
  EXPECT_EQ(FileSize(off.paths()[0]), 0);
}

// ---------------------------------------------------------------------------------------------
// Argument errors change nothing

TEST_P(OffloaderTest, WriteOfStoredOrInFlightKeyThrows) {
  Offloader off(Options());
  HostBuffer a = PatternBuffer(10000, 0, 1), b = PatternBuffer(10000, 0, 2);
  off.AsyncWrite(1, a.data(), 10000);
  EXPECT_THROW(off.AsyncWrite(1, b.data(), 10000), std::invalid_argument);  // in flight
  EXPECT_TRUE(off.pending(1));
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), {1})) << "the refused write never started";
  const uint64_t file_bytes = off.file_bytes();
  EXPECT_THROW(off.AsyncWrite(1, b.data(), 10000), std::invalid_argument);  // stored
  EXPECT_THROW(off.AsyncWrite(1, b.data(), 500), std::invalid_argument);
  EXPECT_TRUE(off.Wait(OffloadKind::kWrite).empty());
  EXPECT_EQ(off.file_bytes(), file_bytes);
  EXPECT_EQ(off.stored_bytes(), 10000u);
  Load(off, 1, 10000, 1);  // the first data, not overwritten
}

TEST_P(OffloaderTest, WaitForKeysAppliesOnlyTheirOperations) {
  Offloader off(Options());
  HostBuffer a = PatternBuffer(20000, 0, 1);
  HostBuffer b = PatternBuffer(5000, 3, 2);
  HostBuffer c = PatternBuffer(4096, 0, 3);
  off.AsyncWrite(1, a.data(), a.size());
  std::vector<OffloadPiece> vector{{2, b.data(), b.size()}, {3, c.data(), c.size()}};
  off.AsyncWritev(vector);
  off.AsyncWrite(4, c.data(), c.size());

  const uint64_t none[] = {99};
  EXPECT_TRUE(off.Wait(OffloadKind::kWrite, none).empty()) << "no operation moves key 99";
  const uint64_t three[] = {3};
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite, three), {2, 3})) << "the whole vector";
  EXPECT_TRUE(off.stored(2) && off.stored(3));
  EXPECT_TRUE(off.pending(1) && off.pending(4)) << "the others stay in flight";
  EXPECT_FALSE(off.stored(1));
  EXPECT_TRUE(off.Wait(OffloadKind::kRead, three).empty()) << "another kind";

  HostBuffer back(5000, 0);
  off.AsyncRead(2, back.data(), back.size());
  const uint64_t two[] = {2};
  EXPECT_TRUE(off.Wait(OffloadKind::kWrite, two).empty()) << "applied already";
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kRead, two), {2}));
  EXPECT_TRUE(MatchesPattern(back.data(), back.size(), 2));
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), {1, 4}));
  EXPECT_EQ(off.stored_bytes(), 20000u + 4096u + 4096u);
}

TEST_P(OffloaderTest, FailingWritevStartsNone) {
  Offloader off(Options());
  Store(off, 5, 5000, 5);
  const uint64_t file_bytes = off.file_bytes();
  HostBuffer buf = PatternBuffer(100000, 0, 9);
  auto expect_nothing_started = [&](const std::vector<uint64_t>& keys) {
    for (uint64_t key : keys) {
      EXPECT_FALSE(off.stored(key)) << key;
      EXPECT_FALSE(off.pending(key)) << key;
    }
    EXPECT_TRUE(off.Wait(OffloadKind::kWrite).empty());
    EXPECT_EQ(off.file_bytes(), file_bytes);
    EXPECT_EQ(off.stored_bytes(), 5000u);
  };

  std::vector<OffloadPiece> existing{
      {10, buf.data(), 30000}, {11, buf.data(), 40000}, {5, buf.data(), 5000}, {12, buf.data(), 1}};
  EXPECT_THROW(off.AsyncWritev(existing), std::invalid_argument);
  expect_nothing_started({10, 11, 12});

  std::vector<OffloadPiece> duplicate{
      {20, buf.data(), 30000}, {21, buf.data(), 1000}, {20, buf.data(), 30000}};
  EXPECT_THROW(off.AsyncWritev(duplicate), std::invalid_argument);
  expect_nothing_started({20, 21});

  std::vector<OffloadPiece> null_buffer{{30, buf.data(), 4096}, {31, nullptr, 10}};
  EXPECT_THROW(off.AsyncWritev(null_buffer), std::invalid_argument);
  expect_nothing_started({30, 31});

  // The same keys without the bad piece go through.
  std::vector<OffloadPiece> good{{10, buf.data(), 30000}, {11, buf.data(), 40000}};
  off.AsyncWritev(good);
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), {10, 11}));
  EXPECT_EQ(off.stored_bytes(), 75000u);
}

TEST_P(OffloaderTest, BadReadsThrowAndChangeNothing) {
  Offloader off(Options());
  Store(off, 1, 20000, 1);
  Store(off, 2, 8192, 2);
  const uint64_t file_bytes = off.file_bytes();
  HostBuffer dst(20001, 0);
  auto expect_unchanged = [&] {
    EXPECT_TRUE(off.stored(1));
    EXPECT_FALSE(off.pending(1));
    EXPECT_TRUE(off.stored(2));
    EXPECT_FALSE(off.pending(2));
    EXPECT_TRUE(off.Wait(OffloadKind::kRead).empty());
    EXPECT_EQ(off.stored_bytes(), 20000u + 8192u);
    EXPECT_EQ(off.file_bytes(), file_bytes);
  };

  EXPECT_THROW(off.AsyncRead(99, dst.data(), 100), std::invalid_argument);  // unknown
  expect_unchanged();
  EXPECT_THROW(off.AsyncRead(1, dst.data(), 20001), std::invalid_argument);  // wrong length
  EXPECT_THROW(off.AsyncRead(1, dst.data(), 19999), std::invalid_argument);
  EXPECT_THROW(off.AsyncRead(1, dst.data(), 0), std::invalid_argument);
  expect_unchanged();
  EXPECT_THROW(off.AsyncRead(1, nullptr, 20000), std::invalid_argument);
  expect_unchanged();

  std::vector<OffloadPiece> one_unknown{
      {2, dst.data(), 8192}, {1, dst.data(), 20000}, {77, dst.data(), 10}};
  EXPECT_THROW(off.AsyncReadv(one_unknown), std::invalid_argument);
  expect_unchanged();
  std::vector<OffloadPiece> duplicate{{2, dst.data(), 8192}, {2, dst.data(), 8192}};
  EXPECT_THROW(off.AsyncReadv(duplicate), std::invalid_argument);
  expect_unchanged();

  // A key whose write is in flight cannot be read yet.
  HostBuffer src = PatternBuffer(3000, 1, 3);
  off.AsyncWrite(3, src.data(), 3000);
  EXPECT_THROW(off.AsyncRead(3, dst.data(), 3000), std::invalid_argument);
  EXPECT_TRUE(off.pending(3));
  EXPECT_TRUE(off.Wait(OffloadKind::kRead).empty());
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), {3}));

  // A key being read cannot be read again, and once read back it is gone.
  off.AsyncRead(2, dst.data(), 8192);
  EXPECT_THROW(off.AsyncRead(2, dst.data(), 8192), std::invalid_argument);
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kRead), {2}));
  EXPECT_TRUE(MatchesPattern(dst.data(), 8192, 2));
  EXPECT_THROW(off.AsyncRead(2, dst.data(), 8192), std::invalid_argument);

  Load(off, 1, 20000, 1);
  Load(off, 3, 3000, 3);
  off.Trim();  // freed tail space goes back in the background; now
  EXPECT_EQ(off.file_bytes(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Injected faults

TEST_P(OffloaderTest, WriteErrorEIOLeavesKeyUnknownAndSpaceFree) {
  Offloader off(FaultyOptions(Plan(FaultPlan::Kind::kError, false, true, /*nth=*/3)));
  CheckFailedWrite(off, EIO);
  EXPECT_EQ(injector_->hits(), 1u);
}

TEST_P(OffloaderTest, WriteErrorENOSPCLeavesKeyUnknownAndSpaceFree) {
  FaultPlan plan = Plan(FaultPlan::Kind::kError, false, true, /*nth=*/1);
  plan.error = ENOSPC;
  Offloader off(FaultyOptions(plan));
  CheckFailedWrite(off, ENOSPC);
  EXPECT_EQ(injector_->hits(), 1u);
}

// A filesystem that reserves space up front (tmpfs: fallocate) fails a write that does not fit
// when it is submitted; the offloader reports that through Wait(), as it does ENOSPC from the
// write itself where fallocate is missing (ext2), so that one call raises on every filesystem.
TEST_P(OffloaderTest, OutOfSpaceAtSubmissionIsAnOutcomeOfTheWait) {
  testing::ScopedMount tmpfs(dir_.path(), "tmpfs", "size=1m");
  if (!tmpfs.error().empty()) GTEST_SKIP() << tmpfs.error();
  Offloader off(Options({tmpfs.path()}));
  HostBuffer big = PatternBuffer(4 * kMiB, 0, 1);
  ASSERT_NO_THROW(off.AsyncWrite(1, big.data(), big.size()));
  EXPECT_FALSE(off.stored(1));
  std::vector<OffloadOutcome> outcomes = off.Wait(OffloadKind::kWrite);
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_EQ(outcomes[0].key, 1u);
  EXPECT_EQ(ErrnoOf(outcomes[0].error), ENOSPC) << Describe(outcomes[0].error);
  EXPECT_FALSE(off.stored(1));
  EXPECT_FALSE(off.pending(1));
  EXPECT_EQ(off.stored_bytes(), 0u);
  // The key and the space are free again: what fits is written and read back.
  Store(off, 1, 4096, 2);
  Load(off, 1, 4096, 2);
  // Synchronize() throws it, after the other operations.
  ASSERT_NO_THROW(off.AsyncWrite(2, big.data(), big.size()));
  EXPECT_THROW(off.Synchronize(), IoError);
  EXPECT_FALSE(off.stored(2));
}

TEST_P(OffloaderTest, FailedWriteFreesOnlyItsOwnSpace) {
  // Write requests: key 1 (one aligned page) is request 1; key 2's first request fails.
  Offloader off(FaultyOptions(Plan(FaultPlan::Kind::kError, false, true, /*nth=*/2)));
  Store(off, 1, 4096, 1);
  const uint64_t file_bytes = off.file_bytes();
  HostBuffer src = PatternBuffer(300000, 0, 2);
  off.AsyncWrite(2, src.data(), 300000);
  std::vector<OffloadOutcome> outcomes = off.Wait(OffloadKind::kWrite);
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_EQ(ErrnoOf(outcomes[0].error), EIO);
  EXPECT_FALSE(off.stored(2));
  EXPECT_TRUE(off.stored(1));
  off.Trim();
  EXPECT_EQ(off.file_bytes(), file_bytes);
  EXPECT_EQ(FileSize(off.paths()[0]), 4096);
  EXPECT_EQ(off.stored_bytes(), 4096u);
  Load(off, 1, 4096, 1);
}

TEST_P(OffloaderTest, ReadErrorKeepsKeyStoredAndRetryWorks) {
  Offloader off(FaultyOptions(Plan(FaultPlan::Kind::kError, true, false, /*nth=*/2)));
  constexpr uint64_t kSize = kMiB + 3;
  Store(off, 1, kSize, 1, 1);
  const uint64_t file_bytes = off.file_bytes();
  HostBuffer dst(kSize, 2);
  off.AsyncRead(1, dst.data(), kSize);
  std::vector<OffloadOutcome> outcomes = off.Wait(OffloadKind::kRead);
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_EQ(outcomes[0].key, 1u);
  EXPECT_EQ(ErrnoOf(outcomes[0].error), EIO) << Describe(outcomes[0].error);
  EXPECT_TRUE(off.stored(1));
  EXPECT_FALSE(off.pending(1));
  EXPECT_EQ(off.stored_bytes(), kSize);
  EXPECT_EQ(off.file_bytes(), file_bytes);
  Load(off, 1, kSize, 1, 7);
  off.Trim();  // freed tail space goes back in the background; now
  EXPECT_EQ(off.file_bytes(), 0u);
  EXPECT_EQ(injector_->hits(), 1u);
}

TEST_P(OffloaderTest, ShortTransfersStillComplete) {
  // At most 1000 bytes per faulted request (halving a 1-byte tail request would make no progress,
  // which the engine rightly reports as an error).
  FaultPlan plan = Plan(FaultPlan::Kind::kShort, true, true, /*nth=*/1, /*count=*/40);
  plan.short_bytes = 1000;
  Offloader off(FaultyOptions(plan));
  const uint64_t sizes[] = {4097, kMiB + 3, 70000};
  std::vector<HostBuffer> src;
  std::vector<OffloadPiece> pieces;
  for (uint64_t i = 0; i < 3; ++i) {
    src.push_back(PatternBuffer(sizes[i], i * 11, i + 1));
    pieces.push_back(OffloadPiece{i + 1, src.back().data(), sizes[i]});
  }
  off.AsyncWritev(pieces);
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), {1, 2, 3}));
  for (uint64_t i = 0; i < 3; ++i) Load(off, i + 1, sizes[i], i + 1, i * 3);
  EXPECT_EQ(injector_->hits(), 40u);
  off.Trim();  // freed tail space goes back in the background; now
  EXPECT_EQ(off.file_bytes(), 0u);
}

TEST_P(OffloaderTest, SynchronizeThrowsTheFirstErrorAndAppliesAllOutcomes) {
  Offloader off(FaultyOptions(Plan(FaultPlan::Kind::kError, false, true, /*nth=*/2)));
  HostBuffer a = PatternBuffer(4096, 0, 1), b = PatternBuffer(4096, 0, 2);
  off.AsyncWrite(1, a.data(), 4096);
  off.Synchronize();
  off.AsyncWrite(2, b.data(), 4096);
  EXPECT_THROW(off.Synchronize(), IoError);
  EXPECT_TRUE(off.stored(1));
  EXPECT_FALSE(off.stored(2));
  EXPECT_FALSE(off.pending(2));
  EXPECT_NO_THROW(off.Synchronize());
  off.Trim();
  EXPECT_EQ(off.file_bytes(), 4096u);
}

TEST_P(OffloaderTest, BackingFileCutShortFailsTheReadAndKeepsTheKey) {
  Offloader off(Options());
  constexpr uint64_t kSize = kMiB + 3;
  Store(off, 1, kSize, 1);
  const std::string path = off.paths()[0];
  ASSERT_EQ(truncate(path.c_str(), 8192), 0) << std::strerror(errno);
  HostBuffer dst(kSize, 0);
  off.AsyncRead(1, dst.data(), kSize);
  std::vector<OffloadOutcome> outcomes = off.Wait(OffloadKind::kRead);
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_EQ(ErrnoOf(outcomes[0].error), EIO) << Describe(outcomes[0].error);
  try {
    std::rethrow_exception(outcomes[0].error);
  } catch (const IoError& e) {
    EXPECT_EQ(e.path(), path);
  } catch (...) {
  }
  EXPECT_TRUE(off.stored(1));
  EXPECT_FALSE(off.pending(1));
  EXPECT_EQ(off.stored_bytes(), kSize);
  off.Discard(1);
  off.Trim();  // freed tail space goes back in the background; now
  EXPECT_EQ(off.file_bytes(), 0u);
  EXPECT_EQ(FileSize(path), 0);
}

// ---------------------------------------------------------------------------------------------
// Several directories

TEST_P(OffloaderTest, LargeRangeIsStripedOverAllDirectories) {
  TempDir d1, d2;
  OffloaderOptions o = Options({dir_.path(), d1.path(), d2.path()});
  o.stripe_threshold = 64 << 10;
  Offloader off(o);
  const std::vector<std::string> paths = off.paths();
  ASSERT_EQ(paths.size(), 3u);
  EXPECT_EQ(paths[0].rfind(dir_.path() + "/", 0), 0u) << paths[0];
  EXPECT_EQ(paths[1].rfind(d1.path() + "/", 0), 0u) << paths[1];
  EXPECT_EQ(paths[2].rfind(d2.path() + "/", 0), 0u) << paths[2];

  constexpr uint64_t kSize = kMiB + 5;
  Store(off, 1, kSize, 1, 3);
  int64_t sum = 0;
  for (const std::string& p : paths) {
    EXPECT_GT(FileSize(p), 0) << p;
    EXPECT_LT(FileSize(p), static_cast<int64_t>(kSize) / 2) << p;
    sum += FileSize(p);
  }
  EXPECT_EQ(sum, static_cast<int64_t>(kSize)) << "each file holds one stripe from offset 0";
  EXPECT_GE(off.file_bytes(), kSize);
  EXPECT_LT(off.file_bytes(), kSize + 3 * kPageSize);
  EXPECT_EQ(off.stored_bytes(), kSize);
  Load(off, 1, kSize, 1, 61);
  off.Trim();  // freed tail space goes back in the background; now
  for (const std::string& p : paths) EXPECT_EQ(FileSize(p), 0) << p;
  EXPECT_EQ(off.file_bytes(), 0u);
}

// A directory whose filesystem is full is passed over while another has room: the write that met
// ENOSPC fails (no retry elsewhere behind the caller's back), the next ones go to the other
// directory, striped ones included, instead of failing there again and again; space freed in the
// full directory's file makes it a candidate again.
TEST_P(OffloaderTest, ADirectoryOutOfSpaceIsPassedOverWhileAnotherHasRoom) {
  testing::ScopedMount tmpfs(dir_.path(), "tmpfs", "size=1m");
  if (!tmpfs.error().empty()) GTEST_SKIP() << tmpfs.error();
  TempDir roomy;
  OffloaderOptions o = Options({tmpfs.path(), roomy.path()});
  o.stripe_threshold = 4 * kMiB;
  Offloader off(o);
  const std::vector<std::string> paths = off.paths();
  Store(off, 10, 512 << 10, 10);  // directory 0 (both empty)
  Store(off, 11, 600 << 10, 11);  // directory 1 (less data)
  ASSERT_EQ(FileSize(paths[0]), 512 << 10);
  // Directory 0 has less data, but its filesystem cannot hold 2 MiB more.
  HostBuffer big = PatternBuffer(2 * kMiB, 0, 1);
  off.AsyncWrite(1, big.data(), big.size());
  std::vector<OffloadOutcome> outcomes = off.Wait(OffloadKind::kWrite);
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_EQ(ErrnoOf(outcomes[0].error), ENOSPC) << Describe(outcomes[0].error);
  EXPECT_FALSE(off.stored(1));
  // Still the directory with less data: the next ranges go to directory 1 all the same.
  Store(off, 1, 2 * kMiB, 1);
  Store(off, 2, 5 * kMiB + 3, 2);  // past the striping threshold: not striped onto directory 0
  EXPECT_EQ(FileSize(paths[0]), 512 << 10);
  EXPECT_GE(FileSize(paths[1]), static_cast<int64_t>((600 << 10) + 7 * kMiB));
  // Space freed in directory 0 makes it a candidate again (it now has the least data).
  Load(off, 10, 512 << 10, 10);
  off.Trim();
  ASSERT_EQ(FileSize(paths[0]), 0);
  Store(off, 3, 4096, 3);
  EXPECT_EQ(FileSize(paths[0]), 4096);
  Load(off, 1, 2 * kMiB, 1);
  Load(off, 2, 5 * kMiB + 3, 2);
  Load(off, 3, 4096, 3);
  Load(off, 11, 600 << 10, 11);
}

TEST_P(OffloaderTest, SmallRangeGoesToTheDirectoryWithLeastData) {
  TempDir d1, d2;
  OffloaderOptions o = Options({dir_.path(), d1.path(), d2.path()});
  o.stripe_threshold = 64 << 10;
  Offloader off(o);
  const std::vector<std::string> paths = off.paths();
  std::array<uint64_t, 3> model{};  // bytes allocated per directory
  std::vector<HostBuffer> src;
  // Writes `size` under `key` (not waited for: placement happens at the start) and checks that
  // exactly the file the model picks grew.
  auto write = [&](uint64_t key, uint64_t size) {
    SCOPED_TRACE(StrCat("key ", key, ", size ", size));
    const size_t least = std::min_element(model.begin(), model.end()) - model.begin();
    std::array<int64_t, 3> before{};
    for (size_t i = 0; i < 3; ++i) before[i] = FileSize(paths[i]);
    src.push_back(PatternBuffer(size, 0, key));
    off.AsyncWrite(key, src.back().data(), size);
    EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), {key}));
    for (size_t i = 0; i < 3; ++i) {
      if (i == least) {
        EXPECT_GT(FileSize(paths[i]), before[i]) << "directory " << i;
      } else {
        EXPECT_EQ(FileSize(paths[i]), before[i]) << "directory " << i;
      }
    }
    model[least] += AlignUp(size, kPageSize);
  };
  write(1, 40000);
  write(2, 20000);
  write(3, 30000);
  write(4, 1000);
  write(5, (64 << 10) - 1);  // just under the threshold: still one directory
  Load(off, 1, 40000, 1);
  off.Trim();  // so that the file's growth shows where the next range goes
  model[0] -= AlignUp(40000, kPageSize);
  write(6, 5000);  // directory 0 is empty again
  // A striped range takes a page-aligned share of every directory (the last one the remainder);
  // placement by least data goes on from there.
  constexpr uint64_t kBig = kMiB + 5;
  Store(off, 7, kBig, 7);
  for (const std::string& p : paths) EXPECT_GT(FileSize(p), 0);
  const uint64_t stripe = AlignUp((kBig + 2) / 3, kPageSize);
  for (size_t i = 0; i < 3; ++i) {
    model[i] += AlignUp(std::min(stripe, kBig - i * stripe), kPageSize);
  }
  write(8, 3000);
  write(9, 3000);
  for (uint64_t key : {2, 3, 4, 5, 6, 7, 8, 9}) off.Discard(key);
  off.Trim();  // freed tail space goes back in the background; now
  EXPECT_EQ(off.file_bytes(), 0u);
  EXPECT_EQ(off.stored_bytes(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Discard

TEST_P(OffloaderTest, DiscardFreesSpace) {
  Offloader off(Options());
  Store(off, 1, 10000, 1);
  Store(off, 2, 50000, 2);
  off.Discard(2);
  EXPECT_FALSE(off.stored(2));
  EXPECT_EQ(off.stored_bytes(), 10000u);
  off.Trim();
  EXPECT_EQ(off.file_bytes(), AlignUp(10000, kPageSize));
  EXPECT_LE(FileSize(off.paths()[0]), static_cast<int64_t>(AlignUp(10000, kPageSize)));
  HostBuffer dst(50000, 0);
  EXPECT_THROW(off.AsyncRead(2, dst.data(), 50000), std::invalid_argument);
  off.Discard(1);
  EXPECT_EQ(off.stored_bytes(), 0u);
  off.Trim();  // freed tail space goes back in the background; now
  EXPECT_EQ(off.file_bytes(), 0u);
  EXPECT_EQ(FileSize(off.paths()[0]), 0);
  Store(off, 2, 3000, 3);  // a discarded key can be written again
  Load(off, 2, 3000, 3);
}

TEST_P(OffloaderTest, DiscardOfUnknownKeyIsANoOp) {
  Offloader off(Options());
  Store(off, 1, 10000, 1);
  const uint64_t file_bytes = off.file_bytes();
  EXPECT_NO_THROW(off.Discard(2));
  EXPECT_NO_THROW(off.Discard(1ull << 63));
  EXPECT_TRUE(off.stored(1));
  EXPECT_EQ(off.stored_bytes(), 10000u);
  EXPECT_EQ(off.file_bytes(), file_bytes);
  Load(off, 1, 10000, 1);
  EXPECT_NO_THROW(off.Discard(1));  // read back: unknown again
}

TEST_P(OffloaderTest, DiscardOfKeyInFlightThrows) {
  Offloader off(Options());
  HostBuffer src = PatternBuffer(10000, 0, 1);
  off.AsyncWrite(1, src.data(), 10000);
  EXPECT_THROW(off.Discard(1), std::invalid_argument);
  EXPECT_TRUE(off.pending(1));
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kWrite), {1}));
  HostBuffer dst(10000, 0);
  off.AsyncRead(1, dst.data(), 10000);
  EXPECT_THROW(off.Discard(1), std::invalid_argument);
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kRead), {1}));
  EXPECT_TRUE(MatchesPattern(dst.data(), 10000, 1));
  off.Trim();  // freed tail space goes back in the background; now
  EXPECT_EQ(off.file_bytes(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Close and destruction

TEST_P(OffloaderTest, CloseRemovesFilesAndIsIdempotent) {
  TempDir d1;
  Offloader off(Options({dir_.path(), d1.path()}));
  const std::vector<std::string> paths = off.paths();
  Store(off, 1, 10000, 1);
  for (const std::string& p : paths) EXPECT_TRUE(Exists(p)) << p;
  off.Close();
  for (const std::string& p : paths) EXPECT_FALSE(Exists(p)) << p;
  EXPECT_FALSE(off.stored(1));
  EXPECT_EQ(off.stored_bytes(), 0u);
  off.Close();
  EXPECT_TRUE(off.Wait(OffloadKind::kWrite).empty());
  EXPECT_TRUE(off.Wait(OffloadKind::kRead).empty());
  EXPECT_NO_THROW(off.Synchronize());
  EXPECT_NO_THROW(off.Discard(1));
  HostBuffer buf = PatternBuffer(100, 0, 1);
  EXPECT_THROW(off.AsyncWrite(2, buf.data(), 100), std::logic_error);
  EXPECT_THROW(off.AsyncRead(1, buf.data(), 10000), std::logic_error);
  std::vector<OffloadPiece> pieces{{3, buf.data(), 100}};
  EXPECT_THROW(off.AsyncWritev(pieces), std::logic_error);
  EXPECT_THROW(off.AsyncReadv(pieces), std::logic_error);
  for (const std::string& p : paths) EXPECT_FALSE(Exists(p)) << p;
}

TEST_P(OffloaderTest, CloseWithOperationsInFlight) {
  FaultPlan plan = Plan(FaultPlan::Kind::kDelay, true, true, /*nth=*/1, /*count=*/1000);
  plan.delay = std::chrono::microseconds(500);
  Offloader off(FaultyOptions(plan));
  Store(off, 1, 200000, 1);
  HostBuffer src = PatternBuffer(kMiB + 3, 1, 2);
  HostBuffer dst(200000, 0);
  off.AsyncWrite(2, src.data(), kMiB + 3);
  off.AsyncRead(1, dst.data(), 200000);
  off.Close();
  EXPECT_TRUE(MatchesPattern(dst.data(), 200000, 1)) << "Close waited for the read";
  EXPECT_FALSE(Exists(off.paths()[0]));
  for (OffloadKind kind : {OffloadKind::kWrite, OffloadKind::kRead}) {
    for (const OffloadOutcome& o : off.Wait(kind)) {
      EXPECT_TRUE(o.key == 1 || o.key == 2) << o.key;
    }
  }
  EXPECT_FALSE(off.stored(1));
  EXPECT_FALSE(off.stored(2));
  EXPECT_FALSE(off.pending(2));
  EXPECT_EQ(off.stored_bytes(), 0u);
}

TEST_P(OffloaderTest, DestructorWaitsForOperationsInFlight) {
  FaultPlan plan = Plan(FaultPlan::Kind::kDelay, true, true, /*nth=*/1, /*count=*/1000);
  plan.delay = std::chrono::microseconds(500);
  constexpr uint64_t kSize = 300000;
  HostBuffer src = PatternBuffer(kMiB + 3, 1, 2);
  HostBuffer dst(kSize, 5);
  std::memset(dst.data(), 0xEE, kSize);
  std::vector<std::string> paths;
  {
    Offloader off(FaultyOptions(plan));
    paths = off.paths();
    Store(off, 1, kSize, 1);
    off.AsyncWrite(2, src.data(), kMiB + 3);
    off.AsyncRead(1, dst.data(), kSize);
    EXPECT_TRUE(Exists(paths[0]));
  }
  EXPECT_TRUE(MatchesPattern(dst.data(), kSize, 1)) << "the destructor waited for the read";
  EXPECT_FALSE(Exists(paths[0]));
  const uint64_t hits = injector_->hits();
  EXPECT_GT(hits, 2u);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(injector_->hits(), hits) << "requests still being submitted after destruction";
}

// ---------------------------------------------------------------------------------------------
// Concurrency

// Four threads on one offloader, each with its own keys, interleaving starts and waits of both
// kinds. Wait() must apply every operation of its kind started before it, also those whose
// futures another thread's Wait() is handling.
TEST_P(OffloaderTest, ConcurrentThreadsWithOwnKeys) {
  Offloader off(Options());
  constexpr int kThreads = 4, kRounds = 24;
  struct Key {
    uint64_t key;
    uint64_t size;
  };
  std::vector<std::vector<Key>> kept(kThreads);
  auto size_of = [](int t, int round) -> uint64_t {
    return (static_cast<uint64_t>(round) * 7919 + static_cast<uint64_t>(t) * 1237) % 90000 +
           (round % 5 == 0 ? 4096 : 1);
  };
  auto worker = [&](int t) {
    const uint64_t base = static_cast<uint64_t>(t) * 1000000;
    std::vector<HostBuffer> src, dst;
    src.reserve(kRounds);
    dst.reserve(kRounds);
    for (int r = 0; r < kRounds; ++r) {
      const uint64_t key = base + r;
      const uint64_t size = size_of(t, r);
      src.push_back(PatternBuffer(size, (t + r) % 64, key));
      dst.emplace_back(size, (t * 3 + r) % 64);
      off.AsyncWrite(key, src.back().data(), size);
      // Read back the previous round's key (stored by the previous Wait(kWrite)) unless kept.
      const bool read_previous = r > 0 && (r - 1) % 4 != 0;
      if (read_previous) {
        EXPECT_TRUE(off.stored(key - 1)) << key - 1;
        off.AsyncRead(key - 1, dst[r - 1].data(), size_of(t, r - 1));
      }
      for (const OffloadOutcome& o : off.Wait(OffloadKind::kWrite)) {
        EXPECT_TRUE(o.error == nullptr) << Describe(o.error);
      }
      EXPECT_TRUE(off.stored(key)) << "Wait(kWrite) returned before applying key " << key;
      EXPECT_FALSE(off.pending(key));
      if (read_previous) {
        for (const OffloadOutcome& o : off.Wait(OffloadKind::kRead)) {
          EXPECT_TRUE(o.error == nullptr) << Describe(o.error);
        }
        EXPECT_FALSE(off.stored(key - 1)) << "Wait(kRead) returned before applying key " << key - 1;
        EXPECT_TRUE(MatchesPattern(dst[r - 1].data(), size_of(t, r - 1), key - 1));
      } else if (r > 0) {
        kept[t].push_back(Key{key - 1, size_of(t, r - 1)});
      }
    }
    kept[t].push_back(Key{base + kRounds - 1, size_of(t, kRounds - 1)});
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (std::thread& th : threads) th.join();

  uint64_t total = 0;
  std::vector<OffloadPiece> pieces;
  std::vector<uint64_t> keys;
  std::vector<HostBuffer> dst;
  for (const std::vector<Key>& ks : kept) {
    for (const Key& k : ks) {
      EXPECT_TRUE(off.stored(k.key)) << k.key;
      total += k.size;
      dst.emplace_back(k.size, k.key % 64);
      pieces.push_back(OffloadPiece{k.key, dst.back().data(), k.size});
      keys.push_back(k.key);
    }
  }
  EXPECT_EQ(off.stored_bytes(), total);
  off.AsyncReadv(pieces);
  EXPECT_TRUE(AllOk(off.Wait(OffloadKind::kRead), keys));
  for (size_t i = 0; i < pieces.size(); ++i) {
    EXPECT_TRUE(MatchesPattern(dst[i].data(), pieces[i].length, pieces[i].key)) << pieces[i].key;
  }
  EXPECT_EQ(off.stored_bytes(), 0u);
  off.Trim();  // freed tail space goes back in the background; now
  EXPECT_EQ(off.file_bytes(), 0u);
  EXPECT_EQ(FileSize(off.paths()[0]), 0);
}

TEST_P(OffloaderTest, FreedTailShrinksInTheBackgroundOnceIdle) {
  OffloaderOptions o = Options();
  // Long enough that a slow (sanitized, loaded) machine checks the size before the janitor's
  // idle period ends: the check below must not race the shrink it wants to precede.
  o.shrink_idle = std::chrono::milliseconds(2000);
  o.shrink_step = 64 << 10;  // several steps for this file
  Offloader off(o);
  const std::string path = off.paths()[0];
  constexpr uint64_t kSize = (1 << 20) + 3;
  Store(off, 1, kSize, 1);
  Load(off, 1, kSize, 1);
  EXPECT_GT(FileSize(path), 0) << "shrunk before the offloader was idle for shrink_idle";
  for (int i = 0; i < 1500 && (FileSize(path) != 0 || off.file_bytes() != 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(FileSize(path), 0);
  EXPECT_EQ(off.file_bytes(), 0u);
}

TEST_P(OffloaderTest, WritesDuringBackgroundShrinkKeepTheirData) {
  OffloaderOptions o = Options();
  o.shrink_idle = std::chrono::milliseconds(0);
  o.shrink_step = 4096;  // many small truncates racing the writes below
  Offloader off(o);
  constexpr uint64_t kSize = 256 << 10;
  for (int round = 0; round < 20; ++round) {
    Store(off, 1, kSize, 1 + round);
    Load(off, 1, kSize, 1 + round);  // frees the whole file: the janitor starts shrinking
    Store(off, 2, kSize / 2, 100 + round);
    Store(off, 3, kSize, 200 + round);
    Load(off, 2, kSize / 2, 100 + round);
    Load(off, 3, kSize, 200 + round);
  }
  off.Trim();
  EXPECT_EQ(off.file_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, OffloaderTest, ::testing::ValuesIn(CompiledBackends()),
                         testing::BackendParamName());

// ---------------------------------------------------------------------------------------------
// Stale files (one backend is enough: this is about file names)

// Field 22 of /proc/self/stat: this process's start time in clock ticks since boot.
uint64_t OwnStartTime() {
  std::ifstream in("/proc/self/stat");
  std::string stat;
  std::getline(in, stat);
  std::istringstream fields(stat.substr(stat.rfind(')') + 2));
  std::string field;
  for (int i = 3; i <= 22; ++i) fields >> field;
  return std::stoull(field);
}

OffloaderOptions ThreadsOptions(const std::string& dir) {
  OffloaderOptions o;
  o.dirs = {dir};
  o.engine = testing::SmallEngineOptions(BackendKind::kThreads);
  return o;
}

class OffloaderStaleFilesTest : public ::testing::Test {
 protected:
  void CreateFiles() {
    for (const std::string& name :
         {dead_, reused_pid_, unrelated_, prefix_only_, bad_pid_, other_namespace_, no_tag_,
          held_other_namespace_, held_no_tag_}) {
      Touch(dir_.File(name));
      ASSERT_TRUE(Exists(dir_.File(name))) << name;
    }
    // A live offloader of another container (or this one before an upgrade) holds its file.
    for (const std::string& name : {held_other_namespace_, held_no_tag_}) {
      const int fd = open(dir_.File(name).c_str(), O_RDONLY | O_CLOEXEC);
      ASSERT_GE(fd, 0) << name;
      held_.push_back(fd);
      ASSERT_EQ(flock(fd, LOCK_SH), 0) << name;
    }
  }
  void TearDown() override {
    for (int fd : held_) close(fd);
  }
  void ExpectOnlyStaleRemoved() {
    EXPECT_FALSE(Exists(dir_.File(dead_)));
    EXPECT_FALSE(Exists(dir_.File(reused_pid_)));
    EXPECT_TRUE(Exists(dir_.File(unrelated_)));
    EXPECT_TRUE(Exists(dir_.File(prefix_only_)));
    EXPECT_TRUE(Exists(dir_.File(bad_pid_)));
    EXPECT_FALSE(Exists(dir_.File(other_namespace_)));
    EXPECT_FALSE(Exists(dir_.File(no_tag_)));
    EXPECT_TRUE(Exists(dir_.File(held_other_namespace_)));
    EXPECT_TRUE(Exists(dir_.File(held_no_tag_)));
  }
  void SetUp() override {
    if (tag_ == "ffffffff") GTEST_SKIP() << "this machine's tag is the one standing for another's";
  }

  TempDir dir_;
  const std::string tag_ = PidNamespaceTag();
  // A pid above any pid_max: no such process.
  const std::string dead_ = StrCat("tensortier-offload-999999999-12345-", tag_, "-0-0.bin");
  // This process's pid with another start time: a dead process whose pid was reused.
  const std::string reused_pid_ =
      StrCat("tensortier-offload-", getpid(), "-", OwnStartTime() + 1, "-", tag_, "-0-0.bin");
  const std::string unrelated_ = "unrelated.bin";
  const std::string prefix_only_ = "tensortier-offload-notes.txt";
  const std::string bad_pid_ = StrCat("tensortier-offload-x1-12345-", tag_, "-0-0.bin");
  // Another container's process, or this machine's before a reboot: its pid means nothing here,
  // its lock tells. Nobody holds this one: its process is gone (kill -9, then a new container).
  const std::string other_namespace_ = "tensortier-offload-999999999-12345-ffffffff-0-0.bin";
  // No namespace tag (named before names had one): a dead pid here and nobody holds it.
  const std::string no_tag_ = "tensortier-offload-999999999-12345-0-0.bin";
  // The same, held open with a lock by a live process: kept.
  const std::string held_other_namespace_ =
      "tensortier-offload-999999999-12345-ffffffff-1-0.bin";
  const std::string held_no_tag_ = "tensortier-offload-999999999-12345-1-0.bin";
  std::vector<int> held_;
};

TEST_F(OffloaderStaleFilesTest, RemoveStaleOffloadFilesRemovesFilesOfDeadProcessesOnly) {
  ASSERT_NO_FATAL_FAILURE(CreateFiles());
  EXPECT_EQ(RemoveStaleOffloadFiles(dir_.path()), 4u);
  ExpectOnlyStaleRemoved();
  EXPECT_EQ(RemoveStaleOffloadFiles(dir_.path()), 0u);
  EXPECT_EQ(RemoveStaleOffloadFiles(dir_.File("missing")), 0u);
}

TEST_F(OffloaderStaleFilesTest, ConstructorRemovesStaleFiles) {
  ASSERT_NO_FATAL_FAILURE(CreateFiles());
  Offloader off(ThreadsOptions(dir_.path()));
  ExpectOnlyStaleRemoved();
  ASSERT_EQ(off.paths().size(), 1u);
  EXPECT_TRUE(Exists(off.paths()[0]));
  const std::string name = off.paths()[0].substr(dir_.path().size() + 1);
  EXPECT_EQ(name.rfind(StrCat("tensortier-offload-", getpid(), "-", OwnStartTime(), "-", tag_, "-"),
                       0),
            0u)
      << name;
}

TEST_F(OffloaderStaleFilesTest, FilesOfLiveOffloadersAreNeverRemoved) {
  Offloader a(ThreadsOptions(dir_.path()));
  HostBuffer src = PatternBuffer(50000, 0, 1);
  a.AsyncWrite(1, src.data(), 50000);
  ASSERT_TRUE(AllOk(a.Wait(OffloadKind::kWrite), {1}));

  Offloader b(ThreadsOptions(dir_.path()));
  EXPECT_NE(a.paths()[0], b.paths()[0]);
  EXPECT_TRUE(Exists(a.paths()[0]));
  EXPECT_TRUE(Exists(b.paths()[0]));
  EXPECT_EQ(RemoveStaleOffloadFiles(dir_.path()), 0u);
  EXPECT_TRUE(Exists(a.paths()[0]));
  // Each holds its file's lock while it runs: what a cleanup in another container looks at.
  for (const std::string& path : {a.paths()[0], b.paths()[0]}) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    EXPECT_EQ(flock(fd, LOCK_EX | LOCK_NB), -1) << path;
    EXPECT_EQ(errno, EWOULDBLOCK);
    close(fd);
  }

  HostBuffer src_b = PatternBuffer(7000, 0, 2);
  b.AsyncWrite(1, src_b.data(), 7000);  // keys are per offloader
  ASSERT_TRUE(AllOk(b.Wait(OffloadKind::kWrite), {1}));
  HostBuffer dst(50000, 0), dst_b(7000, 0);
  a.AsyncRead(1, dst.data(), 50000);
  b.AsyncRead(1, dst_b.data(), 7000);
  EXPECT_TRUE(AllOk(a.Wait(OffloadKind::kRead), {1}));
  EXPECT_TRUE(AllOk(b.Wait(OffloadKind::kRead), {1}));
  EXPECT_TRUE(MatchesPattern(dst.data(), 50000, 1));
  EXPECT_TRUE(MatchesPattern(dst_b.data(), 7000, 2));

  const std::string a_path = a.paths()[0];
  a.Close();
  EXPECT_FALSE(Exists(a_path));
  EXPECT_TRUE(Exists(b.paths()[0])) << "closing one offloader leaves the other's file";
}

// A forked child is another process: its files carry its own pid, so that once it dies (here
// without any cleanup, as after kill -9) they are recognised as stale while the parent still runs.
TEST_F(OffloaderStaleFilesTest, FilesOfACrashedForkedChildAreStale) {
  {
    // Constructed and destroyed before the fork: whatever names it caches must not leak into the
    // child, and no engine threads run at fork time.
    Offloader parent(ThreadsOptions(dir_.path()));
  }
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    int code = 0;
    try {
      auto* off = new Offloader(ThreadsOptions(dir_.path()));  // never destroyed: a crash
      std::vector<uint8_t> src = testing::Pattern(10000, 1);
      off->AsyncWrite(1, src.data(), src.size());
      for (const OffloadOutcome& o : off->Wait(OffloadKind::kWrite)) {
        if (o.error != nullptr) code = 2;
      }
      const std::string name = off->paths()[0].substr(dir_.path().size() + 1);
      if (name.rfind(StrCat("tensortier-offload-", getpid(), "-"), 0) != 0) code = 3;
    } catch (...) {
      code = 4;
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: the child's file is named after the parent";
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_.path())) {
    EXPECT_EQ(e.path().filename().string().rfind("tensortier-offload-", 0), 0u) << e.path();
    ++files;
  }
  EXPECT_EQ(files, 1u) << "the dead child's file is left behind";
  EXPECT_EQ(RemoveStaleOffloadFiles(dir_.path()), 1u);
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path()));
}

// A child made by fork() with an offloader live in the parent (a worker process that exits, or
// that drops what it inherited): closing or destroying its copy neither removes the parent's
// files nor waits for or joins threads the child does not have (that hung), and its engine
// refuses work instead of queueing it to no one. The parent's data is intact afterwards.
TEST_F(OffloaderStaleFilesTest, AForkedChildLeavesTheParentsFilesAndDoesNotHang) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "fork() of a process with running threads under TSan";
#endif
  auto off = std::make_unique<Offloader>(ThreadsOptions(dir_.path()));
  std::vector<uint8_t> src = testing::Pattern(100000, 7);
  off->AsyncWrite(1, src.data(), src.size());
  ASSERT_TRUE(AllOk(off->Wait(OffloadKind::kWrite), {1}));
  const std::string path = off->paths()[0];
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    alarm(20);  // a hang ends as SIGALRM, seen by the parent
    int code = 0;
    try {
      off->AsyncWrite(2, src.data(), src.size());
      code = 1;  // accepted: nobody would ever run it
    } catch (const std::logic_error&) {
    } catch (...) {
      code = 2;
    }
    off->Close();
    off.reset();
    if (access(path.c_str(), F_OK) != 0) code = 3;
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child hung (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: work accepted, 2: wrong error, 3: file removed";
  EXPECT_TRUE(Exists(path));
  std::vector<uint8_t> dst(src.size());
  off->AsyncRead(1, dst.data(), dst.size());
  ASSERT_TRUE(AllOk(off->Wait(OffloadKind::kRead), {1}));
  EXPECT_EQ(dst, src);
  off.reset();
  EXPECT_FALSE(Exists(path));
}

TEST(OffloaderOptionsTest, BadOptionsThrow) {
  TempDir dir;
  OffloaderOptions none = ThreadsOptions(dir.path());
  none.dirs.clear();
  EXPECT_THROW(Offloader{none}, std::invalid_argument);
  OffloaderOptions zero = ThreadsOptions(dir.path());
  zero.stripe_threshold = 0;
  EXPECT_THROW(Offloader{zero}, std::invalid_argument);
  OffloaderOptions missing = ThreadsOptions(dir.File("missing"));
  EXPECT_THROW(Offloader{missing}, IoError);
  // A failure on the second directory removes the file already made in the first.
  OffloaderOptions second_missing = ThreadsOptions(dir.path());
  second_missing.dirs.push_back(dir.File("missing"));
  EXPECT_THROW(Offloader{second_missing}, IoError);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

}  // namespace
}  // namespace tensortier
