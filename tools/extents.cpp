// `tensortier extents build|verify`: extent maps for raw block-device reads of a data set.
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/data/extent_map.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier::cli {
namespace {

constexpr const char* kExtentsHelp =
    R"(usage: tensortier extents build ROOT -o MAP [--allow-refused]
       tensortier extents verify MAP

build   maps every regular file under ROOT (recursively) to its extents on its block device
        (FIEMAP with FIEMAP_FLAG_SYNC, every extent, neighbours merged), with the device, its
        partition offset, each file's identity (device, inode, size, mtime, ctime) and the
        XXH64 of its bytes (every file is read once; raw reads are checked against it), and
        writes the map as JSON to MAP (readers refuse a MAP others can write or own; MAP
        itself, where it lies under ROOT, is not mapped). Files whose bytes the filesystem
        does not keep at fixed blocks (unwritten, inline, encoded, encrypted, shared or
        sparse) are refused by name: the map is not written, unless --allow-refused, which
        lists them in the map as refused (readers then read them through the filesystem). Only ext4 and XFS are mapped.
        Exit status: 0 when the map was written, 1 otherwise (2: a usage error).
verify  re-checks MAP against the files: identity, extents and checksum. Lists each file
        that changed.
        Exit status: 0 when every file matches, 1 when any changed or MAP cannot be read
        (2: a usage error).
)";

int Build(const std::vector<std::string>& argv) {
  // "-o MAP" as well as "--output MAP".
  std::vector<std::string> args;
  for (const std::string& a : argv) args.push_back(a == "-o" ? "--output" : a);
  Args parsed(args, {"allow-refused"}, {"output"});
  if (parsed.positionals().size() != 1) throw UsageError("extents build takes one ROOT");
  if (parsed.Get("output", "").empty()) throw UsageError("extents build needs -o MAP");
  const std::string& root = parsed.positionals()[0];
  const std::string output = parsed.Get("output", "");
  ExtentMap map = BuildExtentMap(root, BuildOptions{.allow_refused = true, .leave_out = output});
  for (const RefusedFile& r : map.refused) {
    std::fprintf(stderr, "refused %s: %s\n", TerminalText(r.path).c_str(),
                 TerminalText(r.reason).c_str());
  }
  if (!map.refused.empty() && !parsed.Flag("allow-refused")) {
    std::fprintf(stderr,
                 "tensortier: %s cannot be read from the device; map not written (--allow-refused "
                 "maps the others)\n",
                 Count(map.refused.size(), "file").c_str());
    return 1;
  }
  uint64_t bytes = 0;
  uint64_t extents = 0;
  for (const MappedFile& f : map.files) {
    bytes += f.identity.size;
    extents += f.extents.size();
  }
  SaveExtentMap(map, output);
  std::printf("mapped %s (%s, %s) under %s", Count(map.files.size(), "file").c_str(),
              FormatSize(bytes).c_str(), Count(extents, "extent").c_str(),
              TerminalText(map.root).c_str());
  for (const MappedDevice& d : map.devices) {
    std::printf("\n  %s on %s (device %llu:%llu, partition offset %llu)",
                TerminalText(d.filesystem).c_str(), TerminalText(d.disk).c_str(),
                static_cast<unsigned long long>(d.major), static_cast<unsigned long long>(d.minor),
                static_cast<unsigned long long>(d.partition_offset));
  }
  std::printf("\n");
  if (!map.refused.empty()) std::printf("%s refused\n", Count(map.refused.size(), "file").c_str());
  std::printf("map written to %s\n", TerminalText(output).c_str());
  return 0;
}

int Verify(const std::vector<std::string>& argv) {
  Args parsed(argv, {}, {});
  if (parsed.positionals().size() != 1) throw UsageError("extents verify takes one MAP");
  const ExtentMap map = LoadExtentMap(parsed.positionals()[0]);
  const std::vector<ChangedFile> changed = VerifyExtentMap(map);
  for (const ChangedFile& c : changed) {
    std::printf("changed %s: %s\n", TerminalText(c.path).c_str(), TerminalText(c.what).c_str());
  }
  if (changed.empty()) {
    std::printf("all %s match the map\n", Count(map.files.size(), "file").c_str());
    return 0;
  }
  std::printf("%zu of %s changed\n", changed.size(), Count(map.files.size(), "file").c_str());
  return 1;
}

}  // namespace

const char* ExtentsHelp() {
  return kExtentsHelp;
}

int RunExtents(const std::vector<std::string>& argv) {
  if (argv.empty()) throw UsageError("extents needs a command: build or verify");
  for (const std::string& a : argv) {
    if (a == "--help" || a == "-h") {
      std::fputs(kExtentsHelp, stdout);
      return 0;
    }
  }
  const std::vector<std::string> rest(argv.begin() + 1, argv.end());
  if (argv[0] == "build") return Build(rest);
  if (argv[0] == "verify") return Verify(rest);
  throw UsageError(StrCat("unknown extents command '", argv[0], "' (build or verify)"));
}

}  // namespace tensortier::cli
