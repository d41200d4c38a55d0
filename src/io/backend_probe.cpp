#include "tensortier/io/backend_probe.hpp"

#include <cstring>
#include <exception>
#include <memory>
#include <string_view>

#include <unistd.h>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

namespace {

// A new file of ours in `dir` for a probe: a random name, created exclusively and never through
// a symlink (a probe directory may be shared, such as /tmp: a planted link must not get its
// target truncated). Throws IoError naming `dir`.
std::string CreateProbeFile(const std::string& dir, std::string_view tag) {
  return CreateUniqueFile(
      [&](uint32_t n) { return StrCat(dir, "/.tensortier-probe-", getpid(), "-", tag, "-", n); },
      0600, "create a file in the directory", dir);
}

// Writes a pattern, reads it back through `engine`, compares. Returns "" or what went wrong.
std::string RoundTrip(Engine& engine, const std::string& path, bool direct, std::string* fallback) {
  constexpr size_t kBytes = 8192;
  AlignedBuffer out(kBytes), in(kBytes);
  for (size_t i = 0; i < kBytes; ++i) out.data()[i] = static_cast<std::byte>(i * 131 + 7);
  try {
    File f = File::Open(path, OpenMode::kReadWrite, direct);  // made by CreateProbeFile
    if (direct && !f.direct()) {
      *fallback = f.direct_fallback_reason();
      return "O_DIRECT not available: " + f.direct_fallback_reason();
    }
    engine.Write(f, out.data(), kBytes, 0).Wait();
    uint64_t got = engine.Read(f, in.data(), kBytes, 0).Wait().bytes;
    if (got != kBytes || std::memcmp(out.data(), in.data(), kBytes) != 0) {
      return "data read back differs from data written";
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

namespace detail {

void RequireDirectoryTakesFiles(const std::string& dir) {
  unlink(CreateProbeFile(dir, "dir").c_str());
}

}  // namespace detail

BackendProbe ProbeBackend(BackendKind kind, const std::string& dir) {
  BackendProbe probe;
  probe.kind = kind;
  if (!BackendCompiledIn(kind)) {
    probe.detail = "not built (library not found at build time)";
    return probe;
  }
  EngineOptions options;
  options.workers = 1;
  options.queue_depth = 4;
  options.chunk_size = 4096;  // two requests per round trip: exercises the ring, not just one call
  options.max_inflight_bytes = 1 << 20;
  options.page_cache_check = false;
  std::unique_ptr<Engine> engine;
  try {
    engine = std::make_unique<Engine>(options,
                                      [kind](unsigned depth) { return MakeBackend(kind, depth); });
  } catch (const std::exception& e) {
    probe.detail = e.what();
    return probe;
  }
  probe.available = true;
  std::string path;
  try {
    path = CreateProbeFile(dir, BackendName(kind));
  } catch (const std::exception& e) {
    probe.detail = e.what();
    return probe;
  }
  std::string fallback;
  std::string direct_error = RoundTrip(*engine, path, true, &fallback);
  std::string buffered_error = RoundTrip(*engine, path, false, &fallback);
  unlink(path.c_str());
  probe.direct_ok = direct_error.empty();
  probe.buffered_ok = buffered_error.empty();
  if (!buffered_error.empty()) {
    probe.detail = "buffered: " + buffered_error;
  } else if (!direct_error.empty()) {
    probe.detail = direct_error;
  }
  return probe;
}

}  // namespace tensortier
