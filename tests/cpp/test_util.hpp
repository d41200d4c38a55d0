// Shared helpers for the C++ tests: scoped temporary directories and mounts, scoped environment
// variables, a position-dependent byte pattern (so any sub-range of a file can be checked on its
// own), and the list of backends this build can run.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensortier/io/backend.hpp"
#include "tensortier/io/fault_injection.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier::testing {

inline constexpr uint64_t kMiB = 1 << 20;

// Writes `text` to `path`, making its folders.
inline void WriteText(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
}

// The pid of a process that has exited and been reaped: no process has it (until reused).
inline pid_t DeadPid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

// The message of the std::invalid_argument `fn` throws; a test failure if it throws none.
template <typename Fn>
std::string InvalidArgumentMessage(Fn&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than std::invalid_argument: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

// ---------------------------------------------------------------------------------------------
// Byte patterns

// The byte a pattern with `seed` has at file position `pos`. Every position differs from its
// neighbours and from the same position under another seed, so a shifted, duplicated or stale
// range never matches by accident.
inline uint8_t PatternByte(uint64_t seed, uint64_t pos) {
  uint64_t x = (pos >> 3) * 0x9E3779B97F4A7C15ull ^ (seed + 1) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x >> (8 * (pos & 7)));
}

// Fills `len` bytes at `buf` with the pattern for file positions [pos, pos+len).
inline void FillPattern(void* buf, size_t len, uint64_t seed, uint64_t pos = 0) {
  auto* p = static_cast<uint8_t*>(buf);
  for (size_t i = 0; i < len; ++i) p[i] = PatternByte(seed, pos + i);
}

inline std::vector<uint8_t> Pattern(size_t len, uint64_t seed, uint64_t pos = 0) {
  std::vector<uint8_t> v(len);
  FillPattern(v.data(), len, seed, pos);
  return v;
}

// Success iff `buf` holds the pattern for [pos, pos+len); otherwise names the first bad byte.
inline ::testing::AssertionResult MatchesPattern(const void* buf, size_t len, uint64_t seed,
                                                 uint64_t pos = 0) {
  const auto* p = static_cast<const uint8_t*>(buf);
  for (size_t i = 0; i < len; ++i) {
    uint8_t want = PatternByte(seed, pos + i);
    if (p[i] != want) {
      return ::testing::AssertionFailure()
             << "byte " << i << " of " << len << " (file position " << pos + i << ") is "
             << int{p[i]} << ", want " << int{want} << " (pattern seed " << seed << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// Success iff all `len` bytes at `buf` equal `value`.
inline ::testing::AssertionResult AllBytesAre(const void* buf, size_t len, uint8_t value) {
  const auto* p = static_cast<const uint8_t*>(buf);
  for (size_t i = 0; i < len; ++i) {
    if (p[i] != value) {
      return ::testing::AssertionFailure()
             << "byte " << i << " of " << len << " is " << int{p[i]} << ", want " << int{value};
    }
  }
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------------
// Files, without the engine (so the engine's own reads and writes are checked independently)

// Creates (or truncates) `path` and writes the pattern for [0, size) with plain pwrite().
inline void WritePatternFile(const std::string& path, uint64_t size, uint64_t seed) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  std::vector<uint8_t> block(1 << 20);
  for (uint64_t done = 0; done < size;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(block.size(), size - done));
    FillPattern(block.data(), n, seed, done);
    ssize_t rc = pwrite(fd, block.data(), n, static_cast<off_t>(done));
    ASSERT_EQ(rc, static_cast<ssize_t>(n)) << path << ": " << std::strerror(errno);
    done += n;
  }
  ASSERT_EQ(close(fd), 0);
}

// The whole content of `path`, read with plain pread().
inline std::vector<uint8_t> ReadWholeFile(const std::string& path) {
  std::vector<uint8_t> data;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path << ": " << std::strerror(errno);
  if (fd < 0) return data;
  struct stat st {};
  EXPECT_EQ(fstat(fd, &st), 0);
  data.resize(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t rc = pread(fd, data.data() + done, data.size() - done, static_cast<off_t>(done));
    if (rc <= 0) break;
    done += static_cast<size_t>(rc);
  }
  EXPECT_EQ(done, data.size()) << path;
  close(fd);
  return data;
}

// ---------------------------------------------------------------------------------------------
// Scoped resources

// A fresh directory, removed with its contents on destruction. O_DIRECT needs a real filesystem,
// so the default parent is $TENSORTIER_TEST_TMPDIR, else the test binary's own directory (the
// build tree, on disk), and only then $TMPDIR or /tmp (often tmpfs).
class TempDir {
 public:
  TempDir() {
    std::string tmpl = ParentDir() + "/tensortier-test-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp(" << tmpl << "): " << std::strerror(errno);
      return;
    }
    path_ = buf.data();
  }
  ~TempDir() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  static std::string ParentDir() {
    if (const char* d = std::getenv("TENSORTIER_TEST_TMPDIR"); d != nullptr && *d != '\0') {
      return d;
    }
    std::error_code ec;
    auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec && access(exe.parent_path().c_str(), W_OK) == 0) return exe.parent_path().string();
    if (const char* d = std::getenv("TMPDIR"); d != nullptr && *d != '\0') return d;
    return "/tmp";
  }

  std::string path_;
};

// A filesystem of type `fstype` (no device: ramfs, tmpfs) mounted with `options` on a fresh
// directory for the lifetime of the object. Mounting needs CAP_SYS_ADMIN: check error() and skip
// when it is not empty.
class ScopedMount {
 public:
  ScopedMount(const std::string& parent, const std::string& fstype, const std::string& options = "")
      : path_(parent + "/" + fstype) {
    if (mkdir(path_.c_str(), 0755) != 0) {
      error_ = StrCat("mkdir ", path_, ": ", std::strerror(errno));
      return;
    }
    if (mount("none", path_.c_str(), fstype.c_str(), 0,
              options.empty() ? nullptr : options.c_str()) != 0) {
      error_ = StrCat("mount -t ", fstype, " on ", path_, ": ", std::strerror(errno),
                      " (needs root / CAP_SYS_ADMIN)");
      return;
    }
    mounted_ = true;
  }
  ~ScopedMount() {
    if (mounted_) umount2(path_.c_str(), MNT_DETACH);
  }
  ScopedMount(const ScopedMount&) = delete;
  ScopedMount& operator=(const ScopedMount&) = delete;

  const std::string& error() const { return error_; }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
  std::string error_;
  bool mounted_ = false;
};

// A ramfs: it refuses O_DIRECT on every kernel (tmpfs accepts it since 6.6), so it is the
// reliable "no O_DIRECT" filesystem.
class ScopedRamfs : public ScopedMount {
 public:
  explicit ScopedRamfs(const std::string& parent) : ScopedMount(parent, "ramfs") {}
};

// Sets (or with nullopt unsets) an environment variable; restores the old value on destruction.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, std::optional<std::string> value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) old_ = old;
    if (value) {
      setenv(name_.c_str(), value->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// ---------------------------------------------------------------------------------------------
// Backends and engines

}  // namespace tensortier::testing

namespace tensortier {
// gtest prints parameters with this (found by ADL): "io_uring" rather than a byte dump.
inline void PrintTo(BackendKind kind, std::ostream* os) {
  *os << BackendName(kind);
}
}  // namespace tensortier

namespace tensortier::testing {

// The backends this build has support for (the parameter list of the per-backend suites).
inline std::vector<BackendKind> CompiledBackends() {
  std::vector<BackendKind> kinds;
  for (BackendKind k : kAllBackends) {
    if (BackendCompiledIn(k)) kinds.push_back(k);
  }
  return kinds;
}

// Why a compiled-in backend cannot run on this kernel ("" when it can): io_uring refused by a
// container's seccomp profile, by gVisor or by kernel.io_uring_disabled. Asked once per kind.
inline const std::string& BackendRefusedHere(BackendKind kind) {
  static const std::vector<std::string> why = [] {
    std::vector<std::string> out;
    for (BackendKind k : kAllBackends) {
      std::string reason;
      try {
        MakeBackend(k, 4);
      } catch (const std::exception& e) {
        reason = e.what();
      }
      out.push_back(std::move(reason));
    }
    return out;
  }();
  return why[static_cast<size_t>(kind)];
}

// Base of the per-backend suites: a backend this kernel refuses skips its cases, with the
// reason, except on CI (CI set), whose machines must run every backend compiled in.
class BackendTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    const std::string& why = BackendRefusedHere(GetParam());
    if (!why.empty() && std::getenv("CI") == nullptr) {
      GTEST_SKIP() << BackendName(GetParam()) << " does not run here: " << why;
    }
  }
};

// Test name suffix: io_uring, libaio, threads.
struct BackendParamName {
  template <typename ParamInfo>
  std::string operator()(const ParamInfo& info) const {
    return std::string(BackendName(info.param));
  }
};

// A fault plan: `count` faults of `kind` from the `nth` eligible request (reads, writes or both).
inline FaultPlan Plan(FaultPlan::Kind kind, bool reads, bool writes, uint64_t nth = 1,
                      uint64_t count = 1) {
  FaultPlan p;
  p.kind = kind;
  p.reads = reads;
  p.writes = writes;
  p.nth = nth;
  p.count = count;
  return p;
}

// Small settings that make modest transfers span many chunks and both workers.
inline EngineOptions SmallEngineOptions(BackendKind kind, uint64_t chunk_size = 64 << 10) {
  EngineOptions o;
  o.backend = std::string(BackendName(kind));
  o.chunk_size = chunk_size;
  o.queue_depth = 8;
  o.workers = 2;
  o.max_inflight_bytes = 4 * chunk_size;
  o.page_cache_check = false;
  return o;
}

}  // namespace tensortier::testing
