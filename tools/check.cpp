// `tensortier check [DIR]`: what works on this machine and this directory.
#include <dlfcn.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include "tensortier/util/strings.hpp"

#include "cli.hpp"
#include "tensortier/cuda/cufile.hpp"
#include "tensortier/io/block_device.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/io/page_cache.hpp"
#include "tensortier/transfer/transfer.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/error.hpp"

namespace tensortier::cli {
namespace {

// Presence only: the CUDA layer (dlopen shims) reports details once it exists.
std::string LibraryPresence(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_LAZY | RTLD_LOCAL);
  if (handle == nullptr) return StrCat("not found (", dlerror(), ")");
  dlclose(handle);
  return "found";
}

const char* YesNo(bool v) {
  return v ? "yes" : "no";
}

// Whether reads into new tensors are staged here (TENSORTIER_STAGE_READS), and why.
void PrintReadStaging(const File& f) {
  const EngineOptions o = EngineOptions::FromEnvironment();
  const auto& limits = f.block_queue_limits();
  std::string queue = "no block device queue";
  if (limits) {
    queue = StrCat(limits->queue_dir, ": ", limits->max_segments, " segments, requests up to ",
                   FormatSize(limits->max_request));
  }
  const bool staged = StagesReads(o, f);
  std::string how = "direct";
  if (staged && o.copy_threads > 0) {
    how = StrCat("staged through the engine's bounce buffers, copied out by ", o.copy_threads,
                 " copy threads");
  } else if (staged) {
    how = o.stage_reads == ReadStaging::kOn
              ? "staged through the engine's bounce buffers, copied out by its workers"
              : "staged through the engine's bounce buffers where already faulted in, copied out "
                "by its workers (no copy threads)";
  }
  std::printf("reads into new tensors (TENSORTIER_STAGE_READS=%s): %s (%s)\n",
              std::string(ReadStagingName(o.stage_reads)).c_str(), how.c_str(),
              TerminalText(queue).c_str());
}

}  // namespace

int RunCheck(const std::vector<std::string>& argv) {
  Args args(argv, {}, {});
  std::string dir = args.positionals().empty() ? "." : args.positionals()[0];
  if (args.positionals().size() > 1) throw UsageError("check takes one directory");
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    std::fflush(stdout);
    std::fprintf(stderr, "tensortier check: '%s' is not a directory\n", TerminalText(dir).c_str());
    return 2;
  }
  utsname u{};
  uname(&u);
  std::printf("tensortier check: %s\n",
              TerminalText(std::filesystem::absolute(dir).string()).c_str());
  std::printf("kernel %s, page-cache residency via %s\n\n", u.release,
              std::string(ResidencyMethodName(ResidencyMethodInUse())).c_str());

  std::printf("%-9s %-6s %-7s %-9s %-9s %s\n", "backend", "built", "starts", "O_DIRECT", "buffered",
              "detail");
  int working = 0;
  bool writes_untested = false;
  std::string first;
  for (BackendKind kind : kAllBackends) {
    BackendProbe p = ProbeBackend(kind, dir);
    bool works = p.available && (p.direct_ok || p.buffered_ok);
    if (works && first.empty()) first = std::string(BackendName(kind));
    working += works ? 1 : 0;
    writes_untested = writes_untested || (works && !p.writes_tested);
    std::printf("%-9s %-6s %-7s %-9s %-9s %s\n", std::string(BackendName(kind)).c_str(),
                YesNo(BackendCompiledIn(kind)), YesNo(p.available),
                p.available ? (p.direct_ok ? "ok" : "FAILED") : "-",
                p.available ? (p.buffered_ok ? "ok" : "FAILED") : "-",
                TerminalText(p.detail).c_str());
  }
  std::printf("auto -> %s%s\n\n", first.empty() ? "(none)" : first.c_str(),
              writes_untested ? " (reads only: the directory takes no files)" : "");

  // A file of our own (a random name, created exclusively, never through a symlink: DIR may be
  // shared), removed whatever happens after; in a read-only directory, a file already there.
  std::string probe_path;
  std::string read_path;
  try {
    probe_path = CreateUniqueFile(
        [&](uint32_t n) { return StrCat(dir, "/.tensortier-check-align-", getpid(), "-", n); },
        0600, "create a file in the directory", dir);
  } catch (const IoError& e) {
    // As the backends' probes: only where the directory takes no files, a file already there.
    const int code = e.error_code();
    if (TakesNoFiles(code)) read_path = FileToProbeByReading(dir);
    if (read_path.empty()) {
      std::printf("O_DIRECT: could not test (%s)\n", TerminalText(e.what()).c_str());
    }
  }
  const std::string& tested = probe_path.empty() ? read_path : probe_path;
  if (!tested.empty()) {
    struct RemoveProbe {
      const std::string& path;
      ~RemoveProbe() {
        if (!path.empty()) unlink(path.c_str());
      }
    } remove_probe{probe_path};
    std::optional<File> f;
    try {
      f.emplace(
          File::Open(tested, probe_path.empty() ? OpenMode::kRead : OpenMode::kReadWrite, true));
    } catch (const std::exception& e) {
      std::printf("O_DIRECT: could not test (%s)\n", TerminalText(e.what()).c_str());
    }
    if (f && f->direct()) {
      std::printf(
          "O_DIRECT alignment: offset %u B, memory %u B%s\n", f->offset_alignment(),
          f->memory_alignment(),
          read_path.empty() ? "" : StrCat(" (by reading ", TerminalText(read_path), ")").c_str());
      try {
        PrintReadStaging(*f);
      } catch (const std::exception& e) {
        std::printf("reads into new tensors: could not tell (%s)\n",
                    TerminalText(e.what()).c_str());
      }
    } else if (f) {
      std::printf("O_DIRECT: not available (%s)\n",
                  TerminalText(f->direct_fallback_reason()).c_str());
    }
  }
  // The libraries tensortier would load (TENSORTIER_CUDA_LIBRARY, TENSORTIER_CUFILE_LIBRARY).
  const std::string cuda_library = CudaDriver::DefaultLibrary();
  const std::string cufile_library = CuFile::DefaultLibrary();
  const std::string cufile_presence = LibraryPresence(cufile_library);
  std::printf("CUDA driver (%s): %s\n", TerminalText(cuda_library).c_str(),
              TerminalText(LibraryPresence(cuda_library)).c_str());
  std::printf("cuFile (%s): %s\n", TerminalText(cufile_library).c_str(),
              TerminalText(cufile_presence).c_str());
  // What the platform allows cuFile, without opening it (cuFileDriverOpen can take seconds).
  const CuFilePlatform gds = CuFilePlatform::Probe();
  std::string gds_auto = "cuFile where it opens the file (nvidia-fs loaded)";
  if (cufile_presence != "found") {
    gds_auto = StrCat("the bounce ring: ", cufile_library, " ", cufile_presence);
  } else if (!gds.unusable.empty()) {
    gds_auto = StrCat("the bounce ring: ", gds.unusable);
  } else if (!gds.compat_mode.empty()) {
    gds_auto = StrCat("the bounce ring: cuFile would run in compatibility mode: ", gds.compat_mode,
                      " (unless its configuration sets use_pci_p2pdma)");
  }
  const Setting& gds_setting = SettingFor("TENSORTIER_GDS");
  const GdsMode gds_mode = GdsModeFromEnvironment();
  std::printf("GDS for CUDA tensors (TENSORTIER_GDS): %s%s\n", GdsModeName(gds_mode),
              SettingFromEnvironment(gds_setting) ? "" : " (default)");
  std::printf("GDS with TENSORTIER_GDS=auto: %s\n", TerminalText(gds_auto).c_str());
  const DeviceTransferOptions transfer = DeviceTransferOptions::FromEnvironment();
  std::printf(
      "CUDA bounce rings (TENSORTIER_BOUNCE_SLOTS, _SLOT_SIZE, _RINGS): %zu x %s pinned per "
      "transfer, up to %zu at once\n",
      transfer.ring.slots, FormatSize(transfer.ring.slot_bytes).c_str(), transfer.max_rings);
  std::printf("huge pages (TENSORTIER_HUGE_PAGES): %s\n\n", HugePagesPolicy().c_str());

  std::printf("settings (environment overrides applied):\n");
  for (const auto& d : Defaults()) {
    std::printf("  %-28s %-15s %s\n", d.env.c_str(),
                TerminalText(StrCat(d.value, d.from_environment ? "" : " (default)")).c_str(),
                d.description.c_str());
  }
  for (const UnknownSettingVariable& v : UnknownSettingVariables()) {
    std::printf(
        "  note: %s is set but names no setting%s\n", TerminalText(v.name).c_str(),
        v.meant.empty() ? " (it has no effect)" : StrCat(" (did you mean ", v.meant, "?)").c_str());
  }
  if (working == 0) {
    std::fflush(stdout);  // the lines above come first in a shared pipe
    std::fprintf(stderr, "tensortier check: no I/O backend works on %s\n",
                 TerminalText(dir).c_str());
    return 1;
  }
  if (writes_untested) {
    // Reads work, but a save, an offload or a benchmark there would fail: a problem to report.
    std::fflush(stdout);
    std::fprintf(stderr,
                 "tensortier check: %s takes no files (read-only, or not this user's): reads "
                 "work, writes were not tested\n",
                 TerminalText(dir).c_str());
    return 1;
  }
  return 0;
}

}  // namespace tensortier::cli
