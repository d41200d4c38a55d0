#include "tensortier/io/page_cache.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <thread>
#include <utility>
#include <vector>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/enum_names.hpp"

namespace tensortier {
namespace {

#ifndef __NR_cachestat
#define __NR_cachestat 451  // same number on every architecture since 6.5
#endif

struct CachestatRange {
  uint64_t off;
  uint64_t len;
};
struct Cachestat {
  uint64_t nr_cache;
  uint64_t nr_dirty;
  uint64_t nr_writeback;
  uint64_t nr_evicted;
  uint64_t nr_recently_evicted;
};

// 0 = not probed, 1 = cachestat works, 2 = use mincore.
std::atomic<int> g_method{0};

bool TryCachestat(int fd, uint64_t offset, uint64_t length, uint64_t* pages) {
  CachestatRange range{offset, length};
  Cachestat cs{};
  if (syscall(__NR_cachestat, fd, &range, &cs, 0) != 0) return false;
  *pages = cs.nr_cache;
  return true;
}

bool TryMincore(int fd, uint64_t offset, uint64_t length, uint64_t* pages) {
  const uint64_t page = SystemPageSize();  // mmap offsets and mincore entries are in pages
  uint64_t start = AlignDown(offset, page);
  uint64_t span = AlignUp(offset + length, page) - start;
  void* map = mmap(nullptr, span, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(start));
  if (map == MAP_FAILED) return false;
  std::vector<unsigned char> vec(span / page);
  bool ok = mincore(map, span, vec.data()) == 0;
  munmap(map, span);
  if (!ok) return false;
  *pages = static_cast<uint64_t>(
      std::count_if(vec.begin(), vec.end(), [](unsigned char v) { return (v & 1) != 0; }));
  return true;
}

}  // namespace

namespace {

constexpr EnumName<ResidencyMethod> kResidencyMethodNames[] = {
    {ResidencyMethod::kCachestat, "cachestat"},
    {ResidencyMethod::kMincore, "mincore"},
    {ResidencyMethod::kUnknown, "none"}};

}  // namespace

std::string_view ResidencyMethodName(ResidencyMethod method) {
  return NameOf(kResidencyMethodNames, method, "none");
}

Residency QueryResidency(int fd, uint64_t offset, uint64_t length, ResidencyMethod method,
                         std::optional<uint64_t> file_size) {
  Residency r;
  if (!file_size) {
    struct stat st{};
    if (fstat(fd, &st) != 0) return r;
    file_size = static_cast<uint64_t>(st.st_size);
  }
  const uint64_t size = *file_size;
  if (offset >= size || length == 0) {
    r.method = method == ResidencyMethod::kUnknown ? ResidencyMethodInUse() : method;
    return r;
  }
  length = std::min(length, size - offset);
  r.checked_bytes = length;
  uint64_t pages = 0;
  if (method == ResidencyMethod::kUnknown) method = ResidencyMethodInUse();
  bool ok = method == ResidencyMethod::kCachestat ? TryCachestat(fd, offset, length, &pages)
                                                  : TryMincore(fd, offset, length, &pages);
  if (!ok) return r;
  r.method = method;
  // Pages are counted whole; a partially covered page counts as its covered bytes at most.
  r.resident_bytes = std::min(pages * SystemPageSize(), length);
  return r;
}

Residency QueryFilesResidency(const std::vector<std::string>& paths) {
  Residency total;
  total.method = ResidencyMethodInUse();
  for (const std::string& path : paths) {
    struct ClosedAtExit {  // QueryResidency can throw (bad_alloc)
      int fd;
      ~ClosedAtExit() {
        if (fd >= 0) close(fd);
      }
    } file{open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    if (file.fd < 0) continue;
    struct stat st{};
    if (fstat(file.fd, &st) == 0 && S_ISREG(st.st_mode)) {
      const auto size = static_cast<uint64_t>(st.st_size);
      const Residency r = QueryResidency(file.fd, 0, size, ResidencyMethod::kUnknown, size);
      total.checked_bytes += size;
      total.resident_bytes += r.resident_bytes;
    }
  }
  return total;
}

ResidencyMethod ResidencyMethodInUse() {
  int method = g_method.load(std::memory_order_relaxed);
  if (method == 0) {
    uint64_t pages = 0;
    // cachestat on an invalid fd fails with EBADF when the syscall exists, ENOSYS when not.
    method = (TryCachestat(-1, 0, 0, &pages) || errno != ENOSYS) ? 1 : 2;
    g_method.store(method, std::memory_order_relaxed);
  }
  return method == 1 ? ResidencyMethod::kCachestat : ResidencyMethod::kMincore;
}

uint64_t ResidentMemoryBytes(const void* address, uint64_t length) {
  if (length == 0) return 0;
  const uint64_t page = SystemPageSize();
  const auto begin = reinterpret_cast<uintptr_t>(address);
  const uint64_t start = AlignDown(begin, page);
  const uint64_t span = AlignUp(begin + length, page) - start;
  std::vector<unsigned char> vec(span / page);
  if (mincore(reinterpret_cast<void*>(start), span, vec.data()) != 0) return 0;
  const auto pages = static_cast<uint64_t>(
      std::count_if(vec.begin(), vec.end(), [](unsigned char v) { return (v & 1) != 0; }));
  return std::min(pages * page, length);
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; older headers lack the names
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace {

// madvise(advice) over whole pages, retried on EINTR; 0 or the errno.
int PopulatePages(uintptr_t start, uint64_t span, int advice) {
  for (;;) {
    if (madvise(reinterpret_cast<void*>(start), span, advice) == 0) return 0;
    if (errno != EINTR) return errno;
  }
}

// Whether MADV_POPULATE_WRITE works here: probed once on a page of our own, because an old kernel
// answers EINVAL for every range, as a new one does for read-only memory.
bool KernelPopulatesWrites() {
  static const bool supported = [] {
    alignas(4096) static std::byte probe[4096];
    const uint64_t page = SystemPageSize();
    return page <= sizeof(probe) &&
           PopulatePages(reinterpret_cast<uintptr_t>(probe), page, MADV_POPULATE_WRITE) == 0;
  }();
  return supported;
}

}  // namespace

void PopulateForReading(std::span<const MemoryRange> ranges, unsigned threads) noexcept {
  constexpr uint64_t kPiece = 16u << 20;  // a thread's turn: faulting it in takes ~milliseconds
  const uint64_t page = SystemPageSize();
  std::vector<std::pair<uintptr_t, uint64_t>> pieces;  // whole pages, at most kPiece each
  try {
    for (const MemoryRange& r : ranges) {
      if (r.length == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(r.address);
      const uint64_t start = AlignDown(begin, page);
      const uint64_t end = AlignUp(begin + r.length, page);
      for (uint64_t at = start; at < end; at += kPiece) {
        pieces.emplace_back(at, std::min(kPiece, end - at));
      }
    }
  } catch (...) {  // no memory for the plan: a hint not taken
    return;
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  auto work = [&] {
    for (size_t i; !failed.load(std::memory_order_relaxed) &&
                   (i = next.fetch_add(1, std::memory_order_relaxed)) < pieces.size();) {
      if (PopulatePages(pieces[i].first, pieces[i].second, MADV_POPULATE_READ) != 0) {
        failed.store(true, std::memory_order_relaxed);
      }
    }
  };
  std::vector<std::thread> helpers;
  try {
    for (size_t t = 1; t < std::min<size_t>(std::max(threads, 1u), pieces.size()); ++t) {
      helpers.emplace_back(work);
    }
  } catch (...) {  // out of threads (or memory): those started share the work
  }
  work();
  for (auto& h : helpers) h.join();
}

bool MemoryIsWritable(void* address, uint64_t length) {
  if (length == 0 || !KernelPopulatesWrites()) return true;
  const uint64_t page = SystemPageSize();
  const auto begin = reinterpret_cast<uintptr_t>(address);
  const uint64_t start = AlignDown(begin, page);
  const uint64_t span = AlignUp(begin + length, page) - start;
  const int error = PopulatePages(start, span, MADV_POPULATE_WRITE);
  if (error == 0) return true;
  if (error != EINVAL) return false;  // ENOMEM: unmapped; EFAULT: past the end of a mapped file
  // EINVAL: read-only memory, or a driver mapping that refuses reads the same way.
  return PopulatePages(start, span, MADV_POPULATE_READ) == EINVAL;
}

}  // namespace tensortier
