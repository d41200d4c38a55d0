// `tensortier bench`: sequential write, cold read, warm read and random reads through the engine.
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <random>
#include <string>
#include <tuple>
#include "tensortier/util/strings.hpp"

#include "cli.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/settings.hpp"

namespace tensortier::cli {
namespace {

constexpr const char* kBenchHelp = R"(usage: tensortier bench [options]
  --dir DIR           where the scratch file goes (default .; an existing directory)
  --file NAME         scratch file name (default tensortier-bench.dat)
  --size SIZE         bytes to write/read, e.g. 2G (default 1G)
  --block-size SIZE   request size (default TENSORTIER_CHUNK_SIZE where set, else 1M)
  --queue-depth N     requests in flight per thread (default TENSORTIER_QUEUE_DEPTH, else 32)
  --threads N         worker threads (default TENSORTIER_WORKERS where set, else 2)
  --backend NAME      auto | io_uring | libaio | threads (default TENSORTIER_BACKEND, else auto)
  --mode MODE         write | read | both | randread (default both)
  --ops N             random reads for --mode randread (default 20000)
  --buffered          page cache instead of O_DIRECT (cache dropped before cold reads)
  --warm              read: read the file once first, then time a page-cache-aware read
  --keep              keep the scratch file afterwards (a file bench did not write, such
                      as one of one's own to time reading, is never removed or written:
                      read modes only, and one smaller than --size is refused)
  --json              print one JSON object on stdout
  --sweep             try block size x queue depth x threads and print the best settings
)";

using Clock = std::chrono::steady_clock;

struct Settings {
  std::string dir, file, backend, mode;
  uint64_t size, block;
  unsigned depth, threads, ops;
  bool buffered, warm, keep, json;
  bool users_file = false;  // the file was there before the run: read as it is, never written
};

struct Phase {
  std::string name;
  double seconds = 0;
  uint64_t bytes = 0;
  uint64_t ops = 0;
  IoStats stats;
  double gbps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
  double iops() const { return seconds > 0 ? static_cast<double>(ops) / seconds : 0; }
};

EngineOptions OptionsFor(const Settings& s) {
  EngineOptions o = EngineOptions::FromEnvironment();
  o.backend = s.backend;
  o.chunk_size = s.block;
  o.queue_depth = s.depth;
  o.workers = s.threads;
  // Exactly `depth` requests per worker in flight, as fio's iodepth.
  o.max_inflight_bytes = s.block * s.depth * s.threads;
  return o;
}

// Streams `size` bytes through two alternating windows so the rings never drain between them.
Phase Stream(Engine& engine, const File& file, IoOp op, const Settings& s, AlignedBuffer& buf,
             const char* label) {
  const uint64_t window = buf.size() / 2;
  Phase phase;
  phase.name = label;
  Progress progress(label, s.size, !s.json);
  auto start = Clock::now();
  Future previous;
  uint64_t submitted_windows = 0;
  for (uint64_t off = 0; off < s.size; off += window) {
    uint64_t n = std::min(window, s.size - off);
    std::byte* mem = buf.data() + (submitted_windows++ % 2) * window;
    Future f = op == IoOp::kRead ? engine.Read(file, mem, n, off) : engine.Write(file, mem, n, off);
    if (previous.valid()) {
      const IoResult& r = previous.Wait();
      phase.bytes += r.bytes;
      phase.stats += r.stats;  // every window, not only the last
      progress.Update(phase.bytes);
    }
    previous = f;
  }
  if (previous.valid()) {
    const IoResult& r = previous.Wait();
    phase.bytes += r.bytes;
    phase.stats += r.stats;
  }
  if (op == IoOp::kWrite) file.DataSync();  // durable, as fio --end_fsync=1
  phase.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  progress.Update(s.size);
  return phase;
}

std::string FilePath(const Settings& s) {
  return (std::filesystem::path(s.dir) / s.file).string();
}

// Marks the files bench writes, so that one it kept is known as bench's and not taken for a file
// of the user's. The mark holds the file's identity when bench finished writing it (inode, size,
// modification time): a user's data copied into the file since changes that, and the file is
// the user's again.
constexpr const char* kScratchAttribute = "user.tensortier.bench";

std::string IdentityOf(const struct stat& st) {
  return StrCat(st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
}

bool MadeByBench(const std::string& path) {
  struct stat st{};
  if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  char mark[128];
  const ssize_t n = lgetxattr(path.c_str(), kScratchAttribute, mark, sizeof mark);
  return n > 0 && std::string(mark, static_cast<size_t>(n)) == IdentityOf(st);
}

// Where the file system keeps no user attributes, a file bench kept is taken for the user's.
void MarkAsBenchs(const File& f) {
  struct stat st{};
  if (fstat(f.buffered_fd(), &st) != 0) return;
  const std::string mark = IdentityOf(st);
  fsetxattr(f.buffered_fd(), kScratchAttribute, mark.data(), mark.size(), 0);
}

// The scratch file's path for the signal handler (a fixed buffer, armed by a flag: what an
// async-signal-safe handler may read).
char scratch_to_remove[4096];
volatile std::sig_atomic_t scratch_armed = 0;
constexpr int kEndingSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE};
struct sigaction previous_actions[std::size(kEndingSignals)];

// Ctrl-C, a kill (SIGTERM, SIGHUP, SIGQUIT) or a closed pipe (`bench ... | head`) during a run
// removes the scratch file as the end of a run does, then ends the process as the signal would
// have.
void RemoveScratchAndDie(int signal_number) {
  if (scratch_armed != 0) unlink(scratch_to_remove);
  std::signal(signal_number, SIG_DFL);
  std::raise(signal_number);
}

// Removes the scratch file when the run ends, failed, interrupted or not, unless --keep, and only
// if the run made it: a file that was there before (`--mode read --file data.bin`, timing one's
// own file) is the user's. Signals the process ignored when it started (nohup's SIGHUP, SIGINT in
// a background job) stay ignored.
class ScratchFile {
 public:
  explicit ScratchFile(const Settings& s) : path_(FilePath(s)), remove_(!s.keep && !s.users_file) {
    if (!remove_ || path_.size() >= sizeof scratch_to_remove) return;
    std::memcpy(scratch_to_remove, path_.c_str(), path_.size() + 1);
    scratch_armed = 1;
    struct sigaction action{};
    action.sa_handler = &RemoveScratchAndDie;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < std::size(kEndingSignals); ++i) {
      sigaction(kEndingSignals[i], nullptr, &previous_actions[i]);
      if (previous_actions[i].sa_handler != SIG_IGN) {
        sigaction(kEndingSignals[i], &action, nullptr);
      }
    }
    handlers_ = true;
  }
  ~ScratchFile() {
    if (handlers_) {
      scratch_armed = 0;
      for (size_t i = 0; i < std::size(kEndingSignals); ++i) {
        sigaction(kEndingSignals[i], &previous_actions[i], nullptr);
      }
    }
    if (!remove_) return;
    std::error_code ec;  // a failed removal must not hide the run's outcome
    std::filesystem::remove(path_, ec);
  }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;

 private:
  std::string path_;
  bool remove_;
  bool handlers_ = false;
};

Phase RunWrite(Engine& engine, const Settings& s, AlignedBuffer& buf) {
  File f = File::Open(FilePath(s), OpenMode::kWrite, !s.buffered);
  Phase phase = Stream(engine, f, IoOp::kWrite, s, buf, "write");
  MarkAsBenchs(f);  // written and synced: its identity is final
  return phase;
}

void EnsureFile(Engine& engine, const Settings& s, AlignedBuffer& buf) {
  std::error_code ec;
  const uint64_t size = std::filesystem::file_size(FilePath(s), ec);
  if (!ec && size >= s.size) return;
  if (s.users_file) {
    // Filling it would overwrite the user's data with the benchmark's.
    throw std::invalid_argument(StrCat(
        "bench: '", FilePath(s), "' holds ", ec ? 0 : size, " bytes, fewer than --size ", s.size,
        ": a file that was there before the run is only read, never written (give a --size it "
        "holds, or another --file)"));
  }
  Settings quiet = s;
  quiet.json = true;  // no progress bar for the untimed fill
  RunWrite(engine, quiet, buf);
}

Phase RunRead(Engine& engine, const Settings& s, AlignedBuffer& buf) {
  if (s.warm) {
    File warm = File::Open(FilePath(s), OpenMode::kRead, false);
    Settings quiet = s;
    quiet.json = true;
    Stream(engine, warm, IoOp::kRead, quiet, buf, "warm");
  }
  File f = File::Open(FilePath(s), OpenMode::kRead, !s.buffered);
  if (!s.warm) f.DropCache();  // a cold read: nothing of the file left in the page cache
  return Stream(engine, f, IoOp::kRead, s, buf, s.warm ? "warm" : "read");
}

Phase RunRandomRead(Engine& engine, const Settings& s) {
  File f = File::Open(FilePath(s), OpenMode::kRead, !s.buffered);
  if (!s.warm) f.DropCache();
  const uint64_t blocks = std::max<uint64_t>(f.Size() / s.block, 1);
  // One buffer per request in flight (the engine keeps depth x threads), as fio's iodepth; at
  // most 1024 (requests beyond share them: their bytes are not looked at).
  const unsigned slots = std::min({s.ops, s.depth * s.threads, 1024u});
  AlignedBuffer buf(static_cast<size_t>(s.block) * slots, Pages::kReused);
  std::mt19937_64 rng(42);
  std::vector<IoDesc> pieces;
  pieces.reserve(s.ops);
  for (unsigned i = 0; i < s.ops; ++i) {
    pieces.push_back({f, buf.data() + (i % slots) * s.block, (rng() % blocks) * s.block, s.block});
  }
  Phase phase;
  phase.name = "randread";
  auto start = Clock::now();
  const IoResult& r = engine.Submit(IoOp::kRead, pieces).Wait();
  phase.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  phase.bytes = r.bytes;
  phase.ops = s.ops;
  phase.stats = r.stats;
  return phase;
}

std::vector<Phase> RunOnce(const Settings& s) {
  Engine engine(OptionsFor(s), s.dir);
  const uint64_t window = std::min<uint64_t>(AlignUp(s.size, kPageSize), 256ull << 20);
  AlignedBuffer buf(static_cast<size_t>(std::max<uint64_t>(window, s.block)) * 2, Pages::kReused,
                    Populate::kUpFront);
  std::mt19937_64 rng(7);
  for (size_t i = 0; i + 8 <= buf.size(); i += 8) {
    uint64_t v = rng();
    std::memcpy(buf.data() + i, &v, 8);
  }
  std::vector<Phase> phases;
  if (s.mode == "write" || s.mode == "both") phases.push_back(RunWrite(engine, s, buf));
  if (s.mode == "read" || s.mode == "both") {
    EnsureFile(engine, s, buf);
    phases.push_back(RunRead(engine, s, buf));
  }
  if (s.mode == "randread") {
    EnsureFile(engine, s, buf);
    phases.push_back(RunRandomRead(engine, s));
  }
  return phases;
}

std::string PhaseJson(const Phase& p) {
  const IoStats& st = p.stats;
  return StrCat(R"({"seconds": )", Fixed(p.seconds, 6), R"(, "bytes": )", p.bytes,
                R"(, "direct_bytes": )", st.direct_bytes, R"(, "buffered_bytes": )",
                st.buffered_bytes, R"(, "cached_bytes": )", st.cached_bytes,
                R"(, "bounced_bytes": )", st.bounced_bytes, R"(, "requests": )", st.requests,
                R"(, "resubmits": )", st.resubmits, R"(})");
}

void Report(const Settings& s, const std::string& backend, const std::vector<Phase>& phases) {
  if (s.json) {
    std::string out =
        StrCat(R"({"backend": ")", backend, R"(", "block_size": )", s.block, R"(, "queue_depth": )",
               s.depth, R"(, "threads": )", s.threads, R"(, "size": )", s.size, R"(, "direct": )",
               s.buffered ? "false" : "true", R"(, "mode": ")", s.mode, R"(")");
    for (const Phase& p : phases) {
      if (p.name == "write") out += StrCat(R"(, "write_gbps": )", Fixed(p.gbps(), 4));
      if (p.name == "read") out += StrCat(R"(, "read_gbps": )", Fixed(p.gbps(), 4));
      if (p.name == "warm")
        out += StrCat(R"(, "read_gbps": )", Fixed(p.gbps(), 4), R"(, "warm": true)");
      if (p.name == "randread") out += StrCat(R"(, "randread_iops": )", Fixed(p.iops(), 1));
      out += StrCat(R"(, ")", p.name + "_stats", R"(": )", PhaseJson(p));
    }
    std::printf("%s}\n", out.c_str());
    return;
  }
  std::printf("tensortier bench: %s of %s, block %s, queue depth %u, %u threads, %s, %s\n",
              FormatSize(s.size).c_str(), TerminalText(FilePath(s)).c_str(),
              FormatSize(s.block).c_str(), s.depth, s.threads, backend.c_str(),
              s.buffered ? "buffered" : "O_DIRECT");
  std::printf("%-9s %12s %9s %10s %12s %12s %12s\n", "phase", "bytes", "seconds", "GB/s", "IOPS",
              "direct", "page cache");
  for (const Phase& p : phases) {
    // IOPS is a figure of random reads; sequential phases are measured in bytes.
    const std::string iops = p.name == "randread" ? StrCat(static_cast<uint64_t>(p.iops())) : "-";
    std::printf("%-9s %12s %9.3f %10.3f %12s %12s %12s\n", p.name.c_str(),
                FormatSize(p.bytes).c_str(), p.seconds, p.gbps(), iops.c_str(),
                FormatSize(p.stats.direct_bytes).c_str(),
                FormatSize(p.stats.buffered_bytes).c_str());
  }
}

int RunSweep(Settings s) {
  struct Point {
    uint64_t block;
    unsigned depth, threads;
    double write, read;
  };
  if (s.size < (256u << 10)) {
    throw UsageError("--sweep needs --size of at least 256K (its smallest block)");
  }
  ScratchFile scratch(s);
  std::vector<Point> points;
  s.mode = "both";
  s.json = true;
  std::printf("sweep: %s per point in %s\n%10s %6s %8s %10s %10s\n", FormatSize(s.size).c_str(),
              TerminalText(s.dir).c_str(), "block", "depth", "threads", "write GB/s", "read GB/s");
  for (uint64_t block : {256ull << 10, 1ull << 20, 4ull << 20, 8ull << 20}) {
    if (block > s.size) break;  // a block larger than the file measures nothing more
    for (unsigned depth : {4u, 16u, 64u}) {
      for (unsigned threads : {1u, 2u, 4u}) {
        s.block = block;
        s.depth = depth;
        s.threads = threads;
        auto phases = RunOnce(s);
        points.push_back({block, depth, threads, phases[0].gbps(), phases[1].gbps()});
        std::printf("%10s %6u %8u %10.3f %10.3f\n", FormatSize(block).c_str(), depth, threads,
                    points.back().write, points.back().read);
        std::fflush(stdout);
      }
    }
  }
  auto best_write = *std::max_element(points.begin(), points.end(),
                                      [](auto& a, auto& b) { return a.write < b.write; });
  auto best_read = *std::max_element(points.begin(), points.end(),
                                     [](auto& a, auto& b) { return a.read < b.read; });
  std::printf("best write: --block-size %s --queue-depth %u --threads %u (%.3f GB/s)\n",
              FormatSize(best_write.block).c_str(), best_write.depth, best_write.threads,
              best_write.write);
  std::printf("best read:  --block-size %s --queue-depth %u --threads %u (%.3f GB/s)\n",
              FormatSize(best_read.block).c_str(), best_read.depth, best_read.threads,
              best_read.read);
  return 0;
}

}  // namespace

const char* BenchHelp() {
  return kBenchHelp;
}

int RunBench(const std::vector<std::string>& argv) {
  Args args(
      argv, {"buffered", "warm", "keep", "json", "sweep", "help"},
      {"dir", "file", "size", "block-size", "queue-depth", "threads", "backend", "mode", "ops"});
  if (args.Flag("help")) {
    std::fputs(kBenchHelp, stdout);
    return 0;
  }
  if (!args.positionals().empty()) {
    throw UsageError(StrCat("bench takes options only, not '", args.positionals()[0], "'"));
  }
  // The engine's settings where the environment sets them, else the benchmark's own defaults.
  auto from_environment = [](const char* env, uint64_t fallback) {
    const Setting& setting = SettingFor(env);
    return SettingFromEnvironment(setting) ? NumberSetting(setting) : fallback;
  };
  const Setting& backend_setting = SettingFor("TENSORTIER_BACKEND");
  Settings s{
      args.Get("dir", "."),
      args.Get("file", "tensortier-bench.dat"),
      args.Get("backend", WordSetting(backend_setting)),
      args.Get("mode", "both"),
      args.Size("size", 1ull << 30),
      args.Size("block-size", from_environment("TENSORTIER_CHUNK_SIZE", 1ull << 20)),
      args.Unsigned("queue-depth",
                    static_cast<unsigned>(from_environment("TENSORTIER_QUEUE_DEPTH", 32))),
      args.Unsigned("threads", static_cast<unsigned>(from_environment("TENSORTIER_WORKERS", 2))),
      args.Unsigned("ops", 20000),
      args.Flag("buffered"),
      args.Flag("warm"),
      args.Flag("keep"),
      args.Flag("json")};
  if (s.mode != "write" && s.mode != "read" && s.mode != "both" && s.mode != "randread") {
    throw UsageError("--mode must be write, read, both or randread");
  }
  if (s.size == 0 || s.block == 0 || s.block % kPageSize != 0) {
    throw UsageError("--size must be > 0 and --block-size a multiple of 4K");
  }
  if (s.ops == 0) throw UsageError("--ops must be > 0");
  if (s.warm && s.mode == "write") {
    throw UsageError("--warm times reads: use it with --mode read, both or randread");
  }
  // The engine's ranges (the settings table's), named by this command's options.
  for (const auto& [option, env, value] : {std::tuple<const char*, const char*, uint64_t>{
                                               "--block-size", "TENSORTIER_CHUNK_SIZE", s.block},
                                           {"--queue-depth", "TENSORTIER_QUEUE_DEPTH", s.depth},
                                           {"--threads", "TENSORTIER_WORKERS", s.threads}}) {
    try {
      CheckNumberSetting(SettingFor(env), value);
    } catch (const std::invalid_argument& e) {
      throw UsageError(StrCat(option, ": ", e.what()));
    }
  }
  const EngineOptions options = OptionsFor(s);  // a bad TENSORTIER_* variable: not a usage error
  try {
    options.Validate();  // --backend, and what the options ask for together
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  // As fio's --directory: the directory is the user's to make (a typo would otherwise fill a
  // new folder on whatever disk holds it, and time that disk).
  if (std::error_code dir_error; !std::filesystem::is_directory(s.dir, dir_error)) {
    throw UsageError(StrCat("--dir '", s.dir,
                            "' is not a directory (bench makes none: create it "
                            "on the disk to measure)"));
  }
  std::error_code ec;
  s.users_file = std::filesystem::exists(std::filesystem::symlink_status(FilePath(s), ec)) &&
                 !MadeByBench(FilePath(s));
  const bool writes = args.Flag("sweep") || s.mode == "write" || s.mode == "both";
  if (s.users_file && writes) {
    // fio would write over it; a benchmark must not cost anyone a file.
    throw UsageError(
        StrCat("'", FilePath(s), "' is not a file bench wrote (it was there before, ",
               "or changed since): ", args.Flag("sweep") ? "--sweep" : StrCat("--mode ", s.mode),
               " would write over it (time reading it with --mode read or randread, "
               "give another --file, or remove it)"));
  }
  if (args.Flag("sweep")) return RunSweep(s);
  ScratchFile scratch(s);
  std::string backend;
  std::vector<Phase> phases;
  {
    Engine probe(OptionsFor(s), s.dir);  // resolves "auto" to the backend that works here
    backend = probe.backend();
  }
  s.backend = backend;
  phases = RunOnce(s);
  Report(s, backend, phases);
  return 0;
}

}  // namespace tensortier::cli
