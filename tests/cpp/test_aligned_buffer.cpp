// AlignedBuffer: alignment, zero fill, and which page policy the kernel was given.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "tensortier/util/aligned_buffer.hpp"

namespace tensortier {
namespace {

// The VmFlags line of the /proc/self/smaps entry that contains `address`, or "" if none does.
std::string VmFlagsOf(const void* address) {
  const auto target = reinterpret_cast<uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream header(line);
    if (header >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= target && target < end;
      continue;
    }
    if (inside && line.rfind("VmFlags:", 0) == 0) return line;
  }
  return "";
}

// True if the VmFlags line names `flag` as a whole two-letter word.
bool HasFlag(const std::string& vm_flags, const std::string& flag) {
  return (vm_flags + " ").find(" " + flag + " ") != std::string::npos;
}

TEST(AlignedBufferTest, PageAlignedAndZeroFilled) {
  for (size_t size : {size_t{1}, size_t{4095}, size_t{4097}, size_t{5} << 20}) {
    AlignedBuffer buffer(size);
    EXPECT_EQ(buffer.size(), size);
    EXPECT_TRUE(IsAligned(buffer.data(), kPageSize));
    for (size_t i = 0; i < size; i += 997) ASSERT_EQ(buffer.data()[i], std::byte{0}) << i;
  }
}

TEST(AlignedBufferTest, EmptyBufferHasNoMemory) {
  AlignedBuffer buffer(0);
  EXPECT_EQ(buffer.data(), nullptr);
  EXPECT_EQ(buffer.size(), 0u);
}

// Reused buffers ask for huge pages; memory touched once does unless the guest reports free
// pages (see the header for why). VM_HUGEPAGE shows as "hg" in smaps; the kernel may still not
// give huge pages. TENSORTIER_HUGE_PAGES overrides both (tested from Python, per process).
TEST(AlignedBufferTest, HugePagesFollowThePolicy) {
  AlignedBuffer once(8 << 20);
  AlignedBuffer reused(8 << 20, Pages::kReused);
  AlignedBuffer small(64 << 10, Pages::kReused);  // below the threshold: not worth a huge page
  const std::string once_flags = VmFlagsOf(once.data());
  const std::string reused_flags = VmFlagsOf(reused.data());
  ASSERT_FALSE(once_flags.empty()) << "no smaps entry for the buffer";
  ASSERT_FALSE(reused_flags.empty());
  EXPECT_EQ(HasFlag(once_flags, "hg"), UsesHugePages(Pages::kTouchedOnce)) << once_flags;
  // Saying no explicitly (VM_NOHUGEPAGE, "nh"): THP "always" would give huge pages otherwise.
  EXPECT_EQ(HasFlag(once_flags, "nh"), !UsesHugePages(Pages::kTouchedOnce)) << once_flags;
  EXPECT_EQ(HasFlag(reused_flags, "hg"), UsesHugePages(Pages::kReused)) << reused_flags;
  EXPECT_FALSE(HasFlag(VmFlagsOf(small.data()), "hg"));
  EXPECT_FALSE(HugePagesPolicy().empty());
  if (std::getenv("TENSORTIER_HUGE_PAGES") == nullptr) {
    EXPECT_TRUE(UsesHugePages(Pages::kReused)) << HugePagesPolicy();
  }
}

// A huge page needs a 2 MiB-aligned range: mmap alone gave 4 KiB-aligned addresses, so a 4 MiB
// buffer held one huge page at most.
TEST(AlignedBufferTest, HugePageBuffersStartOnAHugePageBoundary) {
  if (!GetsHugePages(4 << 20, Pages::kReused)) GTEST_SKIP() << HugePagesPolicy();
  std::vector<AlignedBuffer> buffers;
  for (size_t size : {size_t{4} << 20, (size_t{4} << 20) + 4096, size_t{6} << 20}) {
    for (int i = 0; i < 4; ++i) {  // several: one may land aligned by chance
      buffers.emplace_back(size, Pages::kReused);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(buffers.back().data()) % (2 << 20), 0u) << size;
      // The whole buffer is usable, and nothing past it was kept mapped.
      std::fill_n(buffers.back().data(), size, std::byte{1});
    }
  }
}

// Bytes of [data, data + size) in memory now (mincore: per page, unlike smaps, which counts the
// whole mapping the kernel may have merged neighbouring buffers into).
size_t ResidentBytesOf(const std::byte* data, size_t size) {
  const size_t pages = AlignUp(size, kPageSize) / kPageSize;
  std::vector<unsigned char> in_core(pages);
  if (mincore(const_cast<std::byte*>(data), pages * kPageSize, in_core.data()) != 0) return 0;
  return static_cast<size_t>(std::count_if(in_core.begin(), in_core.end(),
                                           [](unsigned char v) { return (v & 1) != 0; })) *
         kPageSize;
}

// On demand, a fresh buffer has no pages; a resident one has all of them before any access
// (locked or not: RLIMIT_MEMLOCK decides, either is correct), still zero-filled. Sizes that are
// not whole pages get their last page too; the huge-page size exercises MADV_HUGEPAGE as well.
TEST(AlignedBufferTest, ResidentBuffersHaveEveryPageBeforeFirstUse) {
  for (size_t size : {size_t{1}, size_t{4097}, size_t{3} << 20, (size_t{8} << 20) + 5}) {
    AlignedBuffer lazy(size, Pages::kReused);
    // Checked before the next buffer exists: the kernel may merge neighbouring mappings, and a
    // huge page faulted in for one can then cover the other's first pages.
    EXPECT_EQ(ResidentBytesOf(lazy.data(), size), 0u) << size;
    AlignedBuffer resident(size, Pages::kReused, Populate::kUpFront);
    EXPECT_EQ(ResidentBytesOf(resident.data(), size), AlignUp(size, kPageSize)) << size;
    EXPECT_FALSE(lazy.locked());
    for (size_t i = 0; i < size; i += 4093) ASSERT_EQ(resident.data()[i], std::byte{0}) << i;
  }
  AlignedBuffer none(0, Pages::kReused, Populate::kUpFront);
  EXPECT_EQ(none.data(), nullptr);
}

// Injected failures of the MADV_POPULATE_WRITE that faults a resident buffer's pages in.
int injected_errno = 0;
void* populated_at = nullptr;
// Written into a buffer whose population fails, so that the test can tell the buffer's own
// mapping from one made later at the same address.
constexpr uint64_t kMarker = 0x7e57'b0ff'e12d'a7a5;
int FailingPopulate(void* address, size_t /*length*/, int /*advice*/) {
  populated_at = address;
  // Not where the caller goes on (EINVAL): that buffer must stay untouched zeros.
  if (injected_errno != EINVAL) std::memcpy(address, &kMarker, sizeof kMarker);
  errno = injected_errno;
  return -1;
}
// A refused lock: a granted mlock() faults every page in by itself, which would hide whether
// the code under test did.
int RefusedLock(const void* /*address*/, size_t /*length*/) {
  errno = EPERM;
  return -1;
}

class PopulateFailure {
 public:
  explicit PopulateFailure(int error) {
    injected_errno = error;
    populated_at = nullptr;
    previous_ = SetResidencyCallsForTest({.madvise = &FailingPopulate, .mlock = &RefusedLock});
  }
  ~PopulateFailure() { SetResidencyCallsForTest(previous_); }
  PopulateFailure(const PopulateFailure&) = delete;
  PopulateFailure& operator=(const PopulateFailure&) = delete;

 private:
  ResidencyCalls previous_;
};

// Whether the buffer that FailingPopulate saw at `address` is still mapped. The address being
// mapped is not enough: a buffer unmapped at the bottom of the mmap area leaves a gap that the
// process's next mapping of any size overlaps (a malloc arena, a message catalog). Reading
// through process_vm_readv fails instead of faulting where the address is unmapped or PROT_NONE.
bool StillMapped(void* address) {
  uint64_t value = 0;
  iovec local{&value, sizeof value};
  iovec remote{address, sizeof value};
  return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) ==
             static_cast<ssize_t>(sizeof value) &&
         value == kMarker;
}

TEST(AlignedBufferTest, KernelsWithoutPopulateWriteGetEveryPageTouched) {
  PopulateFailure before_5_14(EINVAL);
  constexpr size_t kSize = (size_t{1} << 20) + 5;
  AlignedBuffer resident(kSize, Pages::kReused, Populate::kUpFront);
  EXPECT_EQ(populated_at, resident.data());
  EXPECT_FALSE(resident.locked());  // so the pages below were touched, not locked in
  EXPECT_EQ(ResidentBytesOf(resident.data(), kSize), AlignUp(kSize, kPageSize));
  for (size_t i = 0; i < kSize; i += 4093) ASSERT_EQ(resident.data()[i], std::byte{0}) << i;
}

TEST(AlignedBufferTest, ResidentBufferWithoutMemoryThrowsBadAllocAndUnmaps) {
  PopulateFailure no_memory(ENOMEM);
  EXPECT_THROW(AlignedBuffer(3 << 20, Pages::kReused, Populate::kUpFront), std::bad_alloc);
  ASSERT_NE(populated_at, nullptr);
  EXPECT_FALSE(StillMapped(populated_at));
}

TEST(AlignedBufferTest, OtherPopulateFailuresThrowSystemErrorAndUnmap) {
  PopulateFailure refused(EPERM);
  try {
    AlignedBuffer buffer(8192, Pages::kReused, Populate::kUpFront);
    FAIL() << "no exception";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), EPERM);
    EXPECT_NE(std::string(e.what()).find("faulting in a buffer of 8192 bytes"), std::string::npos)
        << e.what();
  }
  ASSERT_NE(populated_at, nullptr);
  EXPECT_FALSE(StillMapped(populated_at));
  AlignedBuffer lazy(8192, Pages::kReused);  // on demand: never asks
  EXPECT_EQ(ResidentBytesOf(lazy.data(), 8192), 0u);
}

TEST(AlignedBufferTest, MoveTransfersOwnership) {
  AlignedBuffer a(3 << 20, Pages::kReused);
  std::byte* data = a.data();
  AlignedBuffer b(std::move(a));
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.size(), size_t{3} << 20);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is API
  a = std::move(b);
  EXPECT_EQ(a.data(), data);
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move)
}

}  // namespace
}  // namespace tensortier
