#include "tensortier/util/aligned_buffer.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {
constexpr size_t kHugePageThreshold = 4u << 20;
constexpr size_t kHugePageSize = 2u << 20;  // x86-64's and arm64's (4 KiB granule) PMD size
// Feature bit VIRTIO_BALLOON_F_REPORTING: the guest reports free pages, the host discards them.
constexpr size_t kBalloonFreePageReportingBit = 5;

// The name of a virtio balloon device that reports free pages, or "".
std::string FreePageReportingDevice() {
  const std::filesystem::path drivers = "/sys/bus/virtio/drivers/virtio_balloon";
  std::error_code ec;  // no balloon driver, or sysfs unreadable: no reporting we know of
  for (std::filesystem::directory_iterator it(drivers, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("virtio", 0) != 0) continue;
    std::ifstream in(it->path() / "features");
    std::string bits;  // one character per feature bit, bit 0 first
    if (in >> bits && bits.size() > kBalloonFreePageReportingBit &&
        bits[kBalloonFreePageReportingBit] == '1') {
      return name;
    }
  }
  return "";
}

struct HugePageChoice {
  bool touched_once;
  bool reused;
  std::string why;
};

const HugePageChoice& Choice() {
  static const HugePageChoice choice = [] {
    const Setting& setting = SettingFor("TENSORTIER_HUGE_PAGES");
    if (const std::string word = WordSetting(setting); word != "auto") {
      const bool on = word == "1";
      return HugePageChoice{on, on, StrCat(setting.env, "=", *SettingFromEnvironment(setting))};
    }
    const std::string device = FreePageReportingDevice();
    if (!device.empty()) {
      return HugePageChoice{
          false, true,
          StrCat("reused buffers only: the guest reports free pages to its host (", device,
                 "), which makes first touches of huge pages slow")};
    }
    return HugePageChoice{true, true, "all buffers of 4 MiB and more"};
  }();
  return choice;
}
std::atomic<int (*)(void*, size_t, int)> residency_madvise{&madvise};
std::atomic<int (*)(const void*, size_t)> residency_mlock{&mlock};
}  // namespace

ResidencyCalls SetResidencyCallsForTest(ResidencyCalls calls) noexcept {
  ResidencyCalls previous;
  previous.madvise =
      residency_madvise.exchange(calls.madvise != nullptr ? calls.madvise : &madvise);
  previous.mlock = residency_mlock.exchange(calls.mlock != nullptr ? calls.mlock : &mlock);
  return previous;
}

bool UsesHugePages(Pages use) {
  return use == Pages::kReused ? Choice().reused : Choice().touched_once;
}

bool GetsHugePages(size_t size, Pages use) {
  return AlignUp(size, kPageSize) >= kHugePageThreshold && UsesHugePages(use);
}

std::string HugePagesPolicy() {
  return Choice().why;
}

size_t SystemPageSize() {
  static const size_t size = [] {
    long n = sysconf(_SC_PAGESIZE);
    return n > 0 ? static_cast<size_t>(n) : kPageSize;
  }();
  return size;
}

AlignedBuffer::AlignedBuffer(size_t size, Pages use, Populate populate) : size_(size) {
  if (size == 0) return;
  const size_t mapped = AlignUp(size, kPageSize);
  const bool huge = GetsHugePages(size, use);  // may throw: map after
  // A huge page needs a 2 MiB-aligned range, which mmap does not promise (a 4 MiB mapping at an
  // unaligned address got one huge page at most): map 2 MiB more, then unmap the ends around an
  // aligned start.
  // (Only with 4 KiB pages: elsewhere a huge page is another size, and `mapped` may not be a
  // whole number of pages.)
  const size_t slack = huge && SystemPageSize() == kPageSize ? kHugePageSize : 0;
  void* p =
      mmap(nullptr, mapped + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  if (slack != 0) {
    auto* start = static_cast<std::byte*>(p);
    auto* aligned =
        reinterpret_cast<std::byte*>(AlignUp(reinterpret_cast<uintptr_t>(start), kHugePageSize));
    const size_t head = static_cast<size_t>(aligned - start);
    if (head != 0) munmap(start, head);
    if (slack - head != 0) munmap(aligned + mapped, slack - head);
    p = aligned;
  }
  data_ = static_cast<std::byte*>(p);
  mapped_ = mapped;
  // Advisory only. Saying no explicitly matters where transparent huge pages are "always".
  if (mapped_ >= kHugePageThreshold) madvise(p, mapped_, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  if (populate == Populate::kUpFront) MakeResident();
}

void AlignedBuffer::MakeResident() {
  // Fault in first, lock second: a granted mlock() faults pages in as well, but sanitizer
  // runtimes replace it with a no-op that reports success.
  if (residency_madvise.load()(data_, mapped_, MADV_POPULATE_WRITE) != 0) {
    const int error = errno;
    if (error != EINVAL) {
      const size_t mapped = mapped_;
      Release();
      if (error == ENOMEM) throw std::bad_alloc();
      throw std::system_error(error, std::generic_category(),
                              StrCat("faulting in a buffer of ", mapped, " bytes"));
    }
    // Kernels before 5.14: touch one byte per page (the memory is zeros).
    for (size_t at = 0; at < mapped_; at += kPageSize) {
      reinterpret_cast<volatile std::byte*>(data_)[at] = std::byte{0};
    }
  }
  locked_ = residency_mlock.load()(data_, mapped_) == 0;
}

AlignedBuffer::~AlignedBuffer() {
  Release();
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      locked_(std::exchange(other.locked_, false)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    locked_ = std::exchange(other.locked_, false);
  }
  return *this;
}

void AlignedBuffer::Release() noexcept {
  if (data_ != nullptr) munmap(data_, mapped_);  // also drops any mlock
  data_ = nullptr;
  size_ = mapped_ = 0;
  locked_ = false;
}

}  // namespace tensortier
