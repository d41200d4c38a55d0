// tensortier: checks a machine, benchmarks it, inspects files.
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cli.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"

namespace {

constexpr const char* kUsage = R"(usage: tensortier <command> [options]

commands:
  check [DIR]   which I/O backends work here, verified round trips on DIR (default .),
                O_DIRECT support, CUDA driver and cuFile presence, effective defaults
  bench         sequential write and cold read (and random reads) on a scratch file
  info FILE     a checkpoint's format, tensors, dtypes, shapes, bytes, alignment, metadata
                (safetensors or torch.save zip; a shard index, a Hugging Face model
                directory or a DCP directory: every file)
  verify FILE   full structure check, then the data: xxh64 checksums stored by tensortier
                (safetensors) or every zip entry's CRC-32 (torch.save); exit 1 on a problem
                or when the file has no checksums to verify
  convert IN OUT
                torch.save zip <-> safetensors (the other format than IN's), data 4 KiB
                aligned, with checksums (safetensors) or CRC-32s (torch)
  extents build ROOT -o MAP | extents verify MAP
                extent maps of a data set for raw block-device reads (FIEMAP, every
                extent, device and partition offset, each file's identity); verify
                re-checks a map against the files
  bench-files ROOT
                read a training set (one folder per class) in batches as
                tensortier.data.FileReader does: files/s and GB/s
  help          this text (`tensortier COMMAND --help`: one command's)
  --version     the version

Exit status: 0 on success; 2 for a command line a command cannot run (a missing or extra
argument, an unknown option, a bad option value), printed with the command's usage line; 1 for
anything else (a damaged file, a failed read or write, a check that found a problem).

Settings come from environment variables (bad values are rejected):
)";

// `tensortier COMMAND --help` for the commands whose options are parsed in one line.
struct CommandHelp {
  const char* name;
  const char* text;
};
constexpr CommandHelp kCommandHelp[] = {
    {"check", R"(usage: tensortier check [DIR]

Which I/O backends (io_uring, libaio, threads) are built and start here, a verified write and
read round trip with each on DIR (default .), O_DIRECT support and alignment of DIR's
filesystem, the CUDA driver and cuFile libraries tensortier would load, what GDS would do, and
every setting in effect (environment overrides applied; a bad value is an error). Where DIR
takes no files (a read-only mount), the backends are tested by reading a file already there.
Exit status: 0 when at least one backend works on DIR, 1 otherwise (or when DIR takes no
files: writes were not tested), 2 when DIR is not a directory or the command line is wrong
(extra arguments, an option).
)"},
    {"info", R"(usage: tensortier info FILE [--shapes N]

A checkpoint's format (safetensors or torch.save zip), tensor count, bytes, dtypes, data
alignment, safetensors metadata, and the first N tensors' names, dtypes, shapes and offsets.
FILE may be a shard index (model.safetensors.index.json: every shard, each checked to hold
what the index puts there), a Hugging Face model directory (the file transformers reads: its
model.safetensors, else its model.safetensors.index.json) or a torch.distributed.checkpoint
directory.

  --shapes N    how many tensors to list (default 20)
)"},
    {"verify", R"(usage: tensortier verify FILE

Checks FILE's whole structure (header, zip directory, pickle, every tensor inside the file),
then its data: each tensor's xxh64 (safetensors saved with checksum=True, plus the header's own
checksum) or each zip record's CRC-32 (torch.save files). A shard index, a Hugging Face
model directory (as for info) or a DCP directory: every file, and the index's coverage.
Exit status: 0 when the data was verified, 1 on a problem or when FILE stores no checksums
(nothing to verify; tensortier.load(..., verify=True) refuses such files too), 2 when the
command line is wrong (no FILE or more than one, an option).
)"},
    {"convert", R"(usage: tensortier convert IN OUT

Writes IN's tensors to OUT in the other format: a torch.save zip becomes safetensors (data
4 KiB aligned, with xxh64 checksums), a safetensors file becomes a torch.save zip (with
CRC-32s) that torch.load reads. OUT's suffix, when it names a format (.safetensors, .st / .pt,
.pth, .bin, .ckpt, .tar), must name that other format, and OUT must not be IN. OUT is written
durably under a temporary name and renamed into place.
IN's own checksums (safetensors: tensortier's xxh64 and header checksum; torch.save: every zip
record's CRC-32) are checked while its data is copied: on a mismatch convert exits 1 naming
the tensor or record and leaves OUT as it was (absent if it was). An IN without checksums is
converted with a note that its data was not checked.
)"},
};

const char* CommandHelpText(const std::string& command) {
  for (const auto& h : kCommandHelp) {
    if (command == h.name) return h.text;
  }
  return nullptr;
}

// The "usage:" lines at the top of `command`'s help (the tool's own for a command it lacks).
std::string UsageLines(const std::string& command) {
  const char* help = CommandHelpText(command);
  if (command == "bench") help = tensortier::cli::BenchHelp();
  if (command == "bench-files") help = tensortier::cli::BenchFilesHelp();
  if (command == "extents") help = tensortier::cli::ExtentsHelp();
  const std::string text = help != nullptr ? help : kUsage;
  std::string lines;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    end = end == std::string::npos ? text.size() : end + 1;
    const std::string line = text.substr(at, end - at);
    if (!line.starts_with(at == 0 ? "usage: " : "       tensortier ")) break;
    lines += line;
    at = end;
  }
  return lines;
}

bool AsksForHelp(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "--") return false;  // what follows are names (a file named --help)
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

int RunTool(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    // "tensortier help info": info's help, as "tensortier info --help".
    if (args.size() == 2 && args[0] == "help" &&
        (CommandHelpText(args[1]) != nullptr || args[1] == "bench" || args[1] == "bench-files" ||
         args[1] == "extents")) {
      args = {args[1], "--help"};
    }
    if (args.size() > 2 && args[0] == "help") {
      std::fprintf(stderr, "tensortier help: takes one command, not %zu arguments\n",
                   args.size() - 1);
      return 2;
    }
    if (args.size() == 2 && args[0] == "help" && !args[1].starts_with("-")) {
      std::fprintf(stderr, "tensortier: unknown command '%s' (try 'tensortier help')\n",
                   tensortier::TerminalText(args[1]).c_str());
      return 2;
    }
    if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
      std::fputs(kUsage, args.empty() ? stderr : stdout);
      for (const tensortier::Setting& s : tensortier::kSettings) {
        std::fprintf(args.empty() ? stderr : stdout,
                     "  %-28s %s\n  %-28s default %s; allowed: %s\n", std::string(s.env).c_str(),
                     std::string(s.description).c_str(), "", std::string(s.default_text).c_str(),
                     tensortier::AllowedValues(s).c_str());
      }
      return args.empty() ? 2 : 0;
    }
    if (args[0] == "--version" || args[0] == "version") {
      if (args.size() > 1) {
        std::fprintf(stderr, "tensortier: %s takes no arguments, not '%s'\n", args[0].c_str(),
                     tensortier::TerminalText(args[1]).c_str());
        return 2;
      }
      std::printf("tensortier %s\n", TENSORTIER_VERSION);
      return 0;
    }
    std::vector<std::string> rest(args.begin() + 1, args.end());
    if (const char* help = CommandHelpText(args[0]); help != nullptr && AsksForHelp(rest)) {
      std::fputs(help, stdout);
      return 0;
    }
    if (args[0] == "check") return tensortier::cli::RunCheck(rest);
    if (args[0] == "bench") {
      return tensortier::cli::RunBench(AsksForHelp(rest) ? std::vector<std::string>{"--help"}
                                                         : rest);
    }
    if (args[0] == "bench-files") return tensortier::cli::RunBenchFiles(rest);
    if (args[0] == "info") return tensortier::cli::RunInfo(rest);
    if (args[0] == "verify") return tensortier::cli::RunVerify(rest);
    if (args[0] == "convert") return tensortier::cli::RunConvert(rest);
    if (args[0] == "extents") return tensortier::cli::RunExtents(rest);
    std::fprintf(stderr, "tensortier: unknown command '%s' (try 'tensortier help')\n",
                 tensortier::TerminalText(args[0]).c_str());
    return 2;
  } catch (const tensortier::cli::UsageError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "tensortier %s: %s\n%s(tensortier %s --help for more)\n",
                 tensortier::TerminalText(args[0]).c_str(),
                 tensortier::TerminalText(e.what()).c_str(), UsageLines(args[0]).c_str(),
                 tensortier::TerminalText(args[0]).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);  // what was printed before the error comes first in a shared pipe
    // Messages embed names from files and arguments: escaped here, where every error ends up.
    std::fprintf(stderr, "tensortier: %s\n", tensortier::TerminalText(e.what()).c_str());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // A write past the file size limit (ulimit -f) fails with EFBIG, reported and cleaned up (no
  // temporary file left), instead of killing the tool with SIGXFSZ; Python does the same.
  std::signal(SIGXFSZ, SIG_IGN);
  const int rc = RunTool(argc, argv);
  // Output lost to a full disk must not pass for success (`bench --json > out.json`), as it
  // does not for GNU tools.
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout) != 0) {
    std::fprintf(stderr, "tensortier: write error on standard output: %s\n",
                 errno != 0 ? std::strerror(errno) : "an earlier write failed");
    return rc == 0 ? 1 : rc;
  }
  return rc;
}
