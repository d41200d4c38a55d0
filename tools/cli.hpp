// Pieces shared by the `tensortier` subcommands.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tensortier/checkpoint/checkpoint_pipeline.hpp"

namespace tensortier::cli {

// A command line the command cannot run: missing or extra arguments, an unknown option, a bad
// option value. main() prints it with the command's usage line and exits 2, as getopt and
// argparse tools do; a damaged file or a failed I/O is any other exception, exit status 1.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// "--name value", "--name=value" and bare "--flag" arguments, plus positionals. Unknown options are
// a UsageError (reported with the list of known ones), so a typo never silently changes a
// benchmark; so are bad values of Size() and Unsigned() options.
class Args {
 public:
  // `flags`: options that take no value. `options`: options that take one.
  Args(const std::vector<std::string>& argv, const std::vector<std::string>& flags,
       const std::vector<std::string>& options);
  bool Flag(const std::string& name) const { return flags_.contains(name); }
  std::string Get(const std::string& name, const std::string& fallback) const;
  bool Has(const std::string& name) const { return values_.contains(name); }  // given a value
  uint64_t Size(const std::string& name, uint64_t fallback) const;
  unsigned Unsigned(const std::string& name, unsigned fallback) const;  // up to 2^20
  uint64_t Unsigned64(const std::string& name, uint64_t fallback) const;
  const std::vector<std::string>& positionals() const { return positionals_; }

 private:
  std::map<std::string, bool> flags_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positionals_;
};

// A progress bar on stderr (the pipeline's ProgressLine), drawn only when stderr is a terminal
// and `enabled`; erased at 100%.
class Progress {
 public:
  Progress(std::string label, uint64_t total, bool enabled)
      : label_(std::move(label)), total_(total), enabled_(enabled && isatty(STDERR_FILENO)) {}
  void Update(uint64_t done) {
    if (!enabled_ || total_ == 0) return;
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start_;
    std::fputs(ProgressLine(label_, done, total_, elapsed.count()).c_str(), stderr);
    if (done >= total_) std::fputs("\r\033[K", stderr);
    std::fflush(stderr);
  }

 private:
  std::string label_;
  uint64_t total_;
  bool enabled_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

int RunCheck(const std::vector<std::string>& argv);
int RunBench(const std::vector<std::string>& argv);
// `tensortier bench --help`.
const char* BenchHelp();
// tools/bench_files.cpp
int RunBenchFiles(const std::vector<std::string>& argv);
const char* BenchFilesHelp();
// tools/checkpoint.cpp
int RunInfo(const std::vector<std::string>& argv);
int RunVerify(const std::vector<std::string>& argv);
int RunConvert(const std::vector<std::string>& argv);
// tools/extents.cpp
int RunExtents(const std::vector<std::string>& argv);
const char* ExtentsHelp();
// "1 tensor", "3 tensors": `n` and `noun`, plural unless n is 1.
std::string Count(uint64_t n, const std::string& noun);

}  // namespace tensortier::cli
