// Checks of a state dict that need no tensor objects, only what the Python layer reads off them:
// the names a safetensors save would store twice (memory shared between tensors), the byte ranges
// a memory-mapped load may touch, and what load_into reports when names or shapes differ from a
// checkpoint's (torch.nn.Module.load_state_dict's words).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tensortier {

// `size` bytes of memory at `address` on `device` ("" for host memory) that tensor `name` spans.
struct MemoryArea {
  std::string device;
  uint64_t address = 0;
  uint64_t size = 0;
  std::string name;
};

// The groups of two names or more whose areas meet on one device (chains of overlaps are one
// group), each in address order, the groups in (device, address) order.
std::vector<std::vector<std::string>> OverlappingGroups(std::vector<MemoryArea> areas);

// A named byte range of a file, as a header or zip directory says where a tensor or record lies
// (signed: what a caller passes on is checked here).
struct FileRange {
  std::string name;
  int64_t offset = 0;
  int64_t size = 0;
};

// The span [begin, end) of the non-empty `ranges` ({0, 0} when none). FormatError naming `path`
// and the range for one that ends past `file_size` (touching a mapped page past the end of a file
// is SIGBUS, not an error), or whose offset or size is negative or whose end overflows.
std::pair<uint64_t, uint64_t> SpanInFile(const std::string& path, uint64_t file_size,
                                         const std::vector<FileRange>& ranges);

// A tensor load_into reads into (its memory, to find names tied to one memory) or one a
// checkpoint holds (address 0 and size 0 there).
struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;
  uint64_t address = 0;
  uint64_t size = 0;
};

struct StateDictMatch {
  std::vector<std::string> missing;     // targets the checkpoint lacks, in the targets' order
  std::vector<std::string> unexpected;  // saved names no target has, in the checkpoint's order
  // load_state_dict's error lines, in its order: missing and unexpected names (when `strict`),
  // then every shape mismatch (strict or not). Empty when the load may go on.
  std::vector<std::string> errors;
};

// Matches `targets` against the `saved` tensors. A target the checkpoint lacks is not missing
// when its memory (address, size, dtype, shape) is that of a target it holds: tied weights,
// stored once in safetensors files.
StateDictMatch MatchStateDict(const std::vector<NamedTensor>& targets,
                              const std::vector<NamedTensor>& saved, bool strict);

}  // namespace tensortier
