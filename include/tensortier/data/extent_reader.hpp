// Reads files straight from their block device by an extent map (extent_map.hpp): each file's
// extents become O_DIRECT reads of the disk, many files in flight through the engine, into the
// caller's buffers. A file whose identity (stat by path: device, inode, size, mtime, ctime)
// differs from the map's, before or after its raw read, is read through the filesystem instead,
// so a changed file never yields stale bytes.
//
// What identity cannot see: tools that move a file's blocks without changing its times (online
// defragmentation, deduplication), after which the old blocks may hold anything. So each raw
// read is also checked against the file's XXH64 in the map, and a file whose bytes differ is read
// through the filesystem instead (as is a file the map has no checksum for). verify_checksums =
// false skips both, for files known never to move (a read-only filesystem): then a moved file
// reads wrong bytes.
//
// Thread-safe: any thread may call ReadBatch; the reader's state is fixed at construction.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tensortier/io/config.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/data/extent_map.hpp"
#include "tensortier/io/file.hpp"

namespace tensortier {

// One file of a batch: the map's file `file` into [dest, dest + capacity).
struct ExtentReadRequest {
  size_t file = 0;
  void* dest = nullptr;
  uint64_t capacity = 0;
};

struct ExtentReadResult {
  uint64_t bytes = 0;    // the file's bytes now in dest
  bool raw = false;      // read from the device by the map (else through the filesystem)
  std::string fallback;  // why it was read through the filesystem ("" when raw)
};

struct ExtentBatch {
  std::vector<ExtentReadResult> files;  // per request, in order
  IoStats io;                           // of every read of the batch
};

class ExtentReader {
 public:
  // Opens each device of `map` read-only with O_DIRECT. Throws IoError naming the device node
  // when it cannot be opened (EACCES: raw reads need read access to the disk, usually root), when
  // the node is no longer the disk the map names (ENODEV), or when it refuses O_DIRECT
  // (EOPNOTSUPP). The engine is made from `options` with its page-cache check off: a disk's page
  // cache is not the files' and may hold stale blocks, so every device read goes direct.
  // Throws std::invalid_argument for an extent past the end of its filesystem's device (a map
  // edited to read other blocks of the disk).
  explicit ExtentReader(ExtentMap map, EngineOptions options = EngineOptions::FromEnvironment(),
                        bool verify_checksums = true);
  // Test seam: the engine's backends are made by `factory` (a fault-injecting backend).
  ExtentReader(ExtentMap map, EngineOptions options, BackendFactory factory,
               bool verify_checksums = true);
  ~ExtentReader();
  ExtentReader(const ExtentReader&) = delete;
  ExtentReader& operator=(const ExtentReader&) = delete;

  // Reads every requested file, all of them in flight together, and returns when all are in
  // their buffers (files read through the filesystem are opened a window at a time, bounded
  // by RLIMIT_NOFILE when the reader was made). Throws std::out_of_range for a file index not in the map,
  // std::invalid_argument when a capacity is smaller than the file's size in the map (a file that
  // changed and grew past its capacity: IoError EFBIG naming it), IoError naming the file for a
  // failed read (a file that vanished: ENOENT). REQUIRES: buffers do not overlap.
  ExtentBatch ReadBatch(std::span<const ExtentReadRequest> requests);

  const ExtentMap& map() const noexcept { return map_; }
  const Engine& engine() const noexcept { return *engine_; }

 private:
  struct Plan;
  ExtentMap map_;
  bool verify_checksums_;
  size_t fallback_window_;  // files read through the filesystem open at once (RLIMIT_NOFILE)
  std::vector<File> devices_;  // per map_.devices
  std::unique_ptr<Engine> engine_;
};

}  // namespace tensortier
