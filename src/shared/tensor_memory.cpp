#include "tensortier/shared/tensor_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>

#include "tensortier/shared/unix_socket.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

namespace {

// The host address ranges of the shared tensors alive in this process: begin -> (end, the
// Memory holding it).
struct TrackedRange {
  uintptr_t end = 0;
  const void* owner = nullptr;
  std::string name;
};
struct TrackedRanges {
  std::mutex mutex;
  std::map<uintptr_t, TrackedRange> ranges;
};

TrackedRanges& Tracked() {
  static auto* tracked = new TrackedRanges();  // never destroyed: used until the process ends
  return *tracked;
}

}  // namespace

void SharedTensor::Memory::Track(const void* address, uint64_t length) {
  if (length == 0) return;
  const auto begin = reinterpret_cast<uintptr_t>(address);
  TrackedRanges& t = Tracked();
  std::lock_guard lock(t.mutex);
  t.ranges[begin] = {begin + length, this, name};
}

std::optional<std::string> SharedTensorNameAt(const void* address) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  TrackedRanges& t = Tracked();
  std::lock_guard lock(t.mutex);
  auto it = t.ranges.upper_bound(at);
  if (it == t.ranges.begin()) return std::nullopt;
  --it;
  if (at >= it->second.end) return std::nullopt;
  return it->second.name;
}

SharedTensor::Memory::~Memory() {
  {
    TrackedRanges& t = Tracked();
    std::lock_guard lock(t.mutex);
    std::erase_if(t.ranges, [this](const auto& r) { return r.second.owner == this; });
  }
  device_mappings.clear();
  device_allocations.clear();
  device_range.reset();
  registrations.clear();  // CUDA lets go of the pages before they are unmapped
  if (reserved != nullptr) ::munmap(reserved, reserved_bytes);
  for (auto [address, length] : mappings) ::munmap(address, length);
}

void SharedTensor::Memory::Reserve(uint64_t span, uint64_t align, const std::string& key) {
  const uint64_t ask = AlignUp(span, align) + align;
  void* raw = ::mmap(nullptr, ask, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) ThrowIoError(errno, "reserve address range for", key, 0, ask);
  auto base = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = AlignUp(base, align);
  if (aligned > base) ::munmap(raw, aligned - base);
  reserved = reinterpret_cast<uint8_t*>(aligned);
  reserved_bytes = ask - (aligned - base);
  Track(reserved, reserved_bytes);
}

std::string ShmemHugePolicy() {
  shared::UniqueFd fd(
      ::open("/sys/kernel/mm/transparent_hugepage/shmem_enabled", O_RDONLY | O_CLOEXEC));
  if (!fd) return "";
  char text[256];
  ssize_t n = ::read(fd.get(), text, sizeof(text) - 1);
  if (n <= 0) return "";
  std::string all(text, static_cast<size_t>(n));
  size_t open = all.find('['), close = all.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return "";
  return all.substr(open + 1, close - open - 1);
}

bool ShmemHugeOnAdvice(const std::string& policy) {
  return policy == "advise" || policy == "always" || policy == "within_size" || policy == "force";
}

int PopulateForWrite(uint8_t* address, uint64_t length, uint64_t page) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;
#endif
  if (::madvise(address, length, MADV_POPULATE_WRITE) == 0) return 0;
  // Only a kernel without the advice (EINVAL) is worked around; ENOMEM and the like are errors.
  if (errno != EINVAL) return errno;
  for (uint64_t at = 0; at < length; at += page) {
    reinterpret_cast<volatile uint8_t*>(address)[at] = 0;  // the memfd is zero-filled
  }
  return 0;
}

namespace {

// The first line of a small file, "" where it cannot be read.
std::string FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The limit in a cgroup's memory file ("max" or a byte count), nullopt where there is none.
std::optional<uint64_t> CgroupLimit(const std::string& path) {
  const std::string text = FirstLine(path);
  uint64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end == text.data()) return std::nullopt;
  return value;
}

}  // namespace

MemoryLimit ProcessMemoryLimit() {
  MemoryLimit limit{PhysicalMemoryBytes(), "this machine's memory"};
  std::ifstream cgroups("/proc/self/cgroup");
  for (std::string line; std::getline(cgroups, line);) {
    // "0::/path" (v2), or "N:memory:/path" (v1's memory controller).
    const size_t first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    std::optional<uint64_t> bytes;
    if (controllers.empty()) {  // v2: mounted at /sys/fs/cgroup, or beside v1 ("hybrid")
      bytes = CgroupLimit(StrCat("/sys/fs/cgroup", path, "/memory.max"));
      if (!bytes) bytes = CgroupLimit(StrCat("/sys/fs/cgroup/unified", path, "/memory.max"));
    } else if (controllers == "memory" || controllers.find("memory,") != std::string::npos ||
               controllers.ends_with(",memory")) {
      bytes = CgroupLimit(StrCat("/sys/fs/cgroup/memory", path, "/memory.limit_in_bytes"));
    }
    if (bytes && *bytes < limit.bytes) limit = {*bytes, "this process's cgroup memory limit"};
  }
  return limit;
}

uint64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long size = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && size > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(size)
                               : UINT64_MAX;
}

}  // namespace tensortier
