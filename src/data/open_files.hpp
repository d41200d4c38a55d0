// How many files a reader may keep open at once, from the process's descriptor limit. Internal to
// src/data: the batch reader and the extent reader's fallback reads each take one such share.
#pragma once

#include <cstddef>

namespace tensortier::detail {

// The most files a reader keeps open at once, however many descriptors it may have.
inline constexpr size_t kMaxOpenFiles = size_t{1} << 16;

// Files a reader may keep open at once: a quarter of the descriptors the process may still open
// (RLIMIT_NOFILE's soft limit less those open now, counted in /proc/self/fd), so that two readers'
// shares leave half to the application, each file counted as two descriptors (buffered and
// O_DIRECT). At least 1, at most kMaxOpenFiles.
size_t OpenFileWindow();

}  // namespace tensortier::detail
