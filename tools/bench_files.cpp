// `tensortier bench-files ROOT`: reads a training set (one folder per class) in batches with the
// same C++ reader as tensortier.data.FileReader, and reports files/s and GB/s.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

#include "cli.hpp"
#include "tensortier/data/batch_reader.hpp"
#include "tensortier/data/sample_inputs.hpp"
#include "tensortier/data/sample_list.hpp"
#include "tensortier/data/shard_plan.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier::cli {
namespace {

constexpr const char* kBenchFilesHelp = R"(usage: tensortier bench-files ROOT [options]
       tensortier bench-files [ROOT] --file-list LIST [options]

Reads the files under ROOT's class folders (DALI's file_root layout and default file_filters:
image and audio extensions), or those LIST names (DALI's file_list: "path label" lines, paths
relative to ROOT or to LIST's folder), in batches, as tensortier.data.FileReader does, and
reports files/s and GB/s.

  --file-filters G,G  the file names read under ROOT, as globs (FileReader's file_filters)
  --case-sensitive-filter
                      match --file-filters with case (default: without)
  --dir-filters G,G   the class folders read under ROOT, as globs (FileReader's dir_filters)
  --file-list LIST    the files LIST names instead of ROOT's class folders
  --batch-size N      files per batch (default 256)
  --shuffle           a seeded permutation of the files (default: list order)
  --seed N            the shuffle's seed (default 0)
  --epochs N          full passes over the files (default 1)
  --prefetch N        batches read ahead (default 2)
  --open-threads N    files opened at once (default 16)
  --cold              drop the files from the page cache before each epoch (posix_fadvise)
  --buffered          read through the page cache only (no O_DIRECT for uncached files)
  --json              print one JSON object on stdout
)";

using Clock = std::chrono::steady_clock;

void DropFromCache(const std::vector<std::string>& paths) {
  for (const std::string& path : paths) File::Open(path, OpenMode::kRead, false).DropCache();
}

}  // namespace

const char* BenchFilesHelp() {
  return kBenchFilesHelp;
}

int RunBenchFiles(const std::vector<std::string>& argv) {
  Args args(argv, {"shuffle", "cold", "buffered", "json", "help", "case-sensitive-filter"},
            {"batch-size", "seed", "epochs", "prefetch", "open-threads", "file-filters",
             "dir-filters", "file-list"});
  if (args.Flag("help")) {
    std::fputs(kBenchFilesHelp, stdout);
    return 0;
  }
  const std::string file_list = args.Get("file-list", "");
  if (args.positionals().size() > 1 || (args.positionals().empty() && file_list.empty())) {
    throw UsageError("bench-files takes one ROOT folder (optional with --file-list)");
  }
  const std::string root = args.positionals().empty() ? "" : args.positionals()[0];
  SampleInputs inputs;
  if (!root.empty()) inputs.root = root;
  if (!file_list.empty()) inputs.file_list = file_list;
  // Comma-separated globs, as the options of DALI's command-line examples take them.
  auto globs = [&](const std::string& option) {
    std::vector<std::string> out;
    const std::string text = args.Get(option, "");
    for (size_t at = 0; at <= text.size();) {
      const size_t comma = std::min(text.find(',', at), text.size());
      if (comma > at) out.push_back(text.substr(at, comma - at));
      at = comma + 1;
    }
    if (out.empty()) throw UsageError(StrCat("--", option, " needs at least one glob"));
    return out;
  };
  if (args.Has("file-filters")) {
    inputs.filter.patterns = globs("file-filters");
  }
  inputs.filter.case_sensitive = args.Flag("case-sensitive-filter");
  if (args.Has("dir-filters")) {
    inputs.dir_filters = globs("dir-filters");
  }
  const unsigned epochs = args.Unsigned("epochs", 1);
  const bool json = args.Flag("json");
  const bool cold = args.Flag("cold");
  ShardSpec spec;
  spec.batch_size = args.Unsigned("batch-size", 256);
  spec.shuffle = args.Flag("shuffle");
  spec.seed = args.Unsigned64("seed", 0);  // any 64-bit seed, as FileReader's
  BatchReaderOptions options;
  options.prefetch = args.Unsigned("prefetch", 2);
  options.open_threads = args.Unsigned("open-threads", 16);
  options.direct = !args.Flag("buffered");
  // Refused before ROOT is listed, as the command line's errors (ShardPlan and BatchReader
  // would refuse these zeros too, once ROOT's files were found).
  for (const auto& [option, value] : {std::pair<const char*, unsigned>{"--epochs", epochs},
                                      {"--batch-size", spec.batch_size},
                                      {"--prefetch", options.prefetch},
                                      {"--open-threads", options.open_threads}}) {
    if (value == 0) throw UsageError(StrCat(option, " must be at least 1"));
  }

  SampleList list = ResolveSampleInputs(std::move(inputs));
  ShardPlan plan(spec, list.paths.size());
  BatchReader reader(list.paths, options);

  double seconds = 0;
  uint64_t files = 0, bytes = 0;
  for (unsigned epoch = 0; epoch < epochs; ++epoch) {
    if (cold) DropFromCache(list.paths);
    auto batches = plan.EpochBatches(epoch);
    Progress progress(StrCat("epoch ", epoch), batches.size(), !json);
    const auto start = Clock::now();
    reader.Start(std::move(batches));
    uint64_t done = 0;
    while (auto batch = reader.Next()) {
      files += batch->indices().size();
      for (uint64_t size : batch->sizes()) bytes += size;
      progress.Update(++done);
    }
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }
  const BatchReaderStats stats = reader.stats();
  const double files_per_s = seconds > 0 ? static_cast<double>(files) / seconds : 0;
  const double gbps = seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
  if (json) {
    std::printf(
        "{\"root\": %s, \"files\": %llu, \"bytes\": %llu, \"epochs\": %u, "
        "\"batch_size\": %llu, \"shuffle\": %s, \"cold\": %s, \"seconds\": %.6f, "
        "\"files_per_s\": %.1f, \"gbps\": %.4f, \"direct_bytes\": %llu, \"cached_bytes\": %llu, "
        "\"backend\": \"%s\"}\n",
        JsonQuoteBytes(root, JsonEscapes::kTerminalControls).c_str(),
        static_cast<unsigned long long>(files), static_cast<unsigned long long>(bytes), epochs,
        static_cast<unsigned long long>(spec.batch_size), spec.shuffle ? "true" : "false",
        cold ? "true" : "false", seconds, files_per_s, gbps,
        static_cast<unsigned long long>(stats.direct_bytes),
        static_cast<unsigned long long>(stats.cached_bytes), reader.backend().c_str());
  } else {
    std::printf("%s: %s, %s in %.3f s (%u epoch%s, batch %llu%s%s, %s)\n",
                TerminalText(root.empty() ? file_list : root).c_str(), Count(files, "file").c_str(),
                FormatSize(bytes).c_str(), seconds, epochs, epochs == 1 ? "" : "s",
                static_cast<unsigned long long>(spec.batch_size), spec.shuffle ? ", shuffled" : "",
                cold ? ", cold" : ", warm", reader.backend().c_str());
    std::printf("  %.0f files/s  %.3f GB/s  (O_DIRECT %s, from page cache %s)\n", files_per_s, gbps,
                FormatSize(stats.direct_bytes).c_str(), FormatSize(stats.cached_bytes).c_str());
  }
  return 0;
}

}  // namespace tensortier::cli
