#include "tensortier/io/backend_probe.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <string_view>

#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/error.hpp"
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

// Reads up to 8 KiB of an existing file through `engine` and compares them with what a plain
// pread gives. Returns "" or what went wrong.
std::string ReadBack(Engine& engine, const std::string& path, bool direct, std::string* fallback) {
  constexpr size_t kBytes = 8192;
  AlignedBuffer got(kBytes), want(kBytes);
  try {
    File f = File::Open(path, OpenMode::kRead, direct);
    if (direct && !f.direct()) {
      *fallback = f.direct_fallback_reason();
      return "O_DIRECT not available: " + f.direct_fallback_reason();
    }
    const uint64_t n = engine.Read(f, got.data(), kBytes, 0).Wait().bytes;
    // The same open file (not the path again: it may have been replaced meanwhile).
    const ssize_t expected = pread(f.buffered_fd(), want.data(), kBytes, 0);
    if (expected < 0) ThrowIoError(errno, "pread", path, 0, kBytes);
    if (n != static_cast<uint64_t>(expected) || std::memcmp(got.data(), want.data(), n) != 0) {
      return "data read differs from the file's bytes";
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

bool TakesNoFiles(int error_code) {
  return error_code == EROFS || error_code == EACCES || error_code == EPERM;
}

std::string FileToProbeByReading(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec);
  // A data set's files sit in class folders: one level down is enough, and a huge tree is not
  // walked.
  for (int seen = 0; !ec && it != fs::recursive_directory_iterator() && seen < 4096;
       it.increment(ec), ++seen) {
    if (it.depth() >= 1) it.disable_recursion_pending();
    std::error_code file_ec;
    if (it->is_regular_file(file_ec) && it->file_size(file_ec) > 0 && !file_ec &&
        access(it->path().c_str(), R_OK) == 0) {
      return it->path().string();
    }
  }
  return "";
}

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
  std::string fallback;
  try {
    path = CreateProbeFile(dir, BackendName(kind));
  } catch (const IoError& e) {
    // A read-only directory (a data set's mount) takes no probe file: its backends are tested
    // by reading a file already there, and writes are not tested.
    const int code = e.error_code();
    const std::string file = TakesNoFiles(code) ? FileToProbeByReading(dir) : "";
    if (file.empty()) {
      probe.detail = e.what();
      return probe;
    }
    const std::string direct_error = ReadBack(*engine, file, true, &fallback);
    const std::string buffered_error = ReadBack(*engine, file, false, &fallback);
    probe.direct_ok = direct_error.empty();
    probe.buffered_ok = buffered_error.empty();
    probe.detail = StrCat("reads of ", file, " tested; writes not (", std::strerror(code), ")");
    if (!buffered_error.empty()) {
      probe.detail += StrCat("; buffered: ", buffered_error);
    } else if (!direct_error.empty()) {
      probe.detail += StrCat("; ", direct_error);
    }
    return probe;
  } catch (const std::exception& e) {
    probe.detail = e.what();
    return probe;
  }
  probe.writes_tested = true;
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
