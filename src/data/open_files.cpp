#include "tensortier/data/open_files.hpp"

#include <dirent.h>
#include <sys/resource.h>

#include <algorithm>

namespace tensortier::detail {
namespace {

// Descriptors open in this process now, or 0 when they cannot be counted.
size_t OpenDescriptors() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  size_t count = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count > 0 ? count - 1 : 0;  // less the listing's own
}

}  // namespace

size_t OpenFileWindow() {
  struct rlimit limit {};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return kMaxOpenFiles;
  }
  const size_t used = OpenDescriptors();
  const size_t free = limit.rlim_cur > used ? static_cast<size_t>(limit.rlim_cur) - used : 0;
  return std::clamp<size_t>(free / 8, 1, kMaxOpenFiles);
}

}  // namespace tensortier::detail
