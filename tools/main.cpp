// tensortier: checks a machine, benchmarks it, inspects files.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cli.hpp"
#include "tensortier/config.hpp"

namespace {

constexpr const char* kUsage = R"(usage: tensortier <command> [options]

commands:
  check [DIR]   which I/O backends work here, verified round trips on DIR (default .),
                O_DIRECT support, CUDA driver and cuFile presence, effective defaults
  bench         sequential write and cold read (and random reads) on a scratch file;
                `tensortier bench --help` lists the options
  info FILE     a checkpoint's format, tensors, dtypes, shapes, bytes, alignment, metadata
                (safetensors or torch.save zip)
  verify FILE   full structure check, then the data: xxh64 checksums stored by tensortier
                (safetensors) or every zip entry's CRC-32 (torch.save); exit 1 on a problem
  convert IN OUT
                torch.save zip -> safetensors, data 4 KiB aligned, with xxh64 checksums
  help          this text

Defaults can be set with environment variables:
)";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
      std::fputs(kUsage, args.empty() ? stderr : stdout);
      for (const auto& d : tensortier::Defaults()) {
        std::fprintf(args.empty() ? stderr : stdout, "  %-28s %s\n", d.env.c_str(),
                     d.description.c_str());
      }
      return args.empty() ? 2 : 0;
    }
    std::vector<std::string> rest(args.begin() + 1, args.end());
    if (args[0] == "check") return tensortier::cli::RunCheck(rest);
    if (args[0] == "bench") return tensortier::cli::RunBench(rest);
    if (args[0] == "info") return tensortier::cli::RunInfo(rest);
    if (args[0] == "verify") return tensortier::cli::RunVerify(rest);
    if (args[0] == "convert") return tensortier::cli::RunConvert(rest);
    std::fprintf(stderr, "tensortier: unknown command '%s' (try 'tensortier help')\n",
                 args[0].c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tensortier: %s\n", e.what());
    return 1;
  }
}
