// Reads batches of whole files (training samples) into one memory arena per batch, many files at
// once, ahead of the caller.
//
// For each batch the files are opened and sized together on a gang of threads (`open_threads`
// at a time: on cold metadata an open waits for the disk), then all their bytes are submitted
// to the engine as one operation: O_DIRECT where the data is not in the page cache, buffered
// where it is (the engine's page-cache check). Up to `prefetch` batches are read ahead on a
// background thread while the caller works on the current one; opening batch k+1 overlaps
// reading batch k. Each arena is sized by its batch's real bytes (every sample starts on a
// 4 KiB boundary, as O_DIRECT needs) and reused when its batch is released.
//
// Files open at once are bounded, whatever the batch size: a quarter of the descriptors
// RLIMIT_NOFILE leaves when the reader is made, two per file (open_files.hpp). A batch that does
// not fit is read in windows (its files sized by stat first, then opened, read and closed a window
// at a time).
//
// A file that vanished, cannot be read, is not a regular file, or changes size while read fails
// its batch with an IoError naming it; with skip_errors it is left out of the batch instead, and
// reported in Batch::skipped and stats(). Running out of descriptors or memory (EMFILE, ENFILE,
// ENOMEM) is never a file's fault: it fails the batch even with skip_errors. Empty files give
// empty samples; a file that reports 0 bytes but has data (/proc) is refused (EINVAL). No sample
// is short.
//
// With an extent map (extent_map.hpp) the files the map holds are read from the block device by
// their extents (ExtentReader: O_DIRECT, the batch's reads in flight together) instead of being
// opened: each file's identity is checked against the map first, and a file that changed since
// is read through the filesystem (counted in stats().fallback_files). Files the map does not
// hold are read as usual.
//
// Thread-safety: one consumer thread calls Start() and Next(); stats() from any thread. Batches
// may outlive the reader. In a child made by fork() the reader's threads do not exist: Start()
// and Next() there throw std::logic_error, and the destructor leaves the threads' state as it is
// (joining them would never return).
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tensortier/data/extent_map.hpp"
#include "tensortier/io/backend.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/process_identity.hpp"

namespace tensortier {

namespace detail {
struct ArenaPoolState;
struct Arena;
class OpenGang;
struct PendingBatch;
}  // namespace detail

struct BatchReaderOptions {
  // Batches read ahead of the one the caller holds.
  unsigned prefetch = 2;
  // Files opened and sized at the same time.
  unsigned open_threads = 16;
  // Leave unreadable files out of their batch (counted) instead of failing the batch.
  bool skip_errors = false;
  // Read with O_DIRECT where the data is not cached (false: always through the page cache).
  bool direct = true;
  // Arenas page-locked and registered with CUDA (PinnedPool), for one copy to a GPU.
  bool pin_memory = false;
  int device = 0;
  EngineOptions engine = EngineOptions::FromEnvironment();
  // Test seam: the engine's backends are made by this factory when set (fault injection).
  BackendFactory backend_factory;
  // Read the files this map holds from its block devices (needs read access to them: root).
  std::optional<ExtentMap> extent_map;
  // Check each raw read against the file's checksum in the map (ExtentReader); false only for
  // files known never to move.
  bool extent_checksums = true;
};

struct SkippedFile {
  uint64_t index;       // the file's index in the reader's path list
  std::string message;  // the error that made it skipped
};

struct BatchReaderStats {
  uint64_t batches = 0;
  uint64_t files = 0;  // samples returned (a padded repeat counts once per repeat)
  uint64_t bytes = 0;  // bytes read from files
  uint64_t skipped = 0;
  uint64_t direct_bytes = 0;    // of bytes: planned O_DIRECT
  uint64_t cached_bytes = 0;    // of bytes: read through the page cache as resident
  uint64_t raw_files = 0;       // files read from the block device by the extent map
  uint64_t fallback_files = 0;  // files the map holds that changed: read through the filesystem
};

// One batch: its samples are [offsets[i], offsets[i] + sizes[i]) of data(). Immutable.
class Batch {
 public:
  ~Batch();
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

  const std::byte* data() const noexcept;
  // Bytes of data() in use (the arena may be larger).
  uint64_t size() const noexcept { return used_; }
  bool pinned() const noexcept;
  // Per sample, in batch order (skipped files left out): file index, offset, size.
  const std::vector<uint64_t>& indices() const noexcept { return indices_; }
  const std::vector<uint64_t>& offsets() const noexcept { return offsets_; }
  const std::vector<uint64_t>& sizes() const noexcept { return sizes_; }
  const std::vector<SkippedFile>& skipped() const noexcept { return skipped_; }

 private:
  friend class BatchReader;
  Batch() = default;

  std::shared_ptr<detail::ArenaPoolState> pool_;
  std::unique_ptr<detail::Arena> arena_;
  uint64_t used_ = 0;
  std::vector<uint64_t> indices_, offsets_, sizes_;
  std::vector<SkippedFile> skipped_;
};

class ExtentReader;

class BatchReader {
 public:
  // Throws std::invalid_argument for bad options or an empty path list, IoError when the engine
  // cannot start or the extent map's disk cannot be opened (EACCES without read access to it).
  BatchReader(std::vector<std::string> paths, BatchReaderOptions options = {});
  // Stops reading ahead and waits for reads in flight.
  ~BatchReader();
  BatchReader(const BatchReader&) = delete;
  BatchReader& operator=(const BatchReader&) = delete;

  // Drops whatever was queued or read ahead, then reads `batches` (lists of indices into the
  // path list; an index may repeat) in order. Throws std::out_of_range for an index past the list.
  // Returns the start's number, for Next(start).
  uint64_t Start(std::vector<std::vector<uint64_t>> batches);
  // The next batch of the last Start(), in order; null after the last. Blocks. Throws the
  // batch's error (IoError naming the file); reading goes on with the batches after it.
  std::shared_ptr<const Batch> Next();
  // Next() of the batches of start `start` (what Start() returned): null, at once or while it
  // waits, once a later Start() (FileReader.close() from another thread) has replaced them,
  // however close to the call it came.
  std::shared_ptr<const Batch> Next(uint64_t start);

  BatchReaderStats stats() const;
  // Whether this process is a child made by fork() since the reader was made.
  bool forked() const noexcept;
  const std::vector<std::string>& paths() const noexcept { return paths_; }
  const std::string& backend() const noexcept { return engine_->backend(); }

 private:
  void Stop();
  void StopLocked();  // Stop() with lifecycle_mu_ held
  void CheckNotForked() const;
  void Produce();
  // Opens up to `budget` of the batch's files (sizing the rest by stat) and submits their reads.
  std::unique_ptr<detail::PendingBatch> Prepare(const std::vector<uint64_t>& batch, size_t budget);
  void OpenWindow(detail::PendingBatch& pending);
  std::shared_ptr<const Batch> Finish(detail::PendingBatch& pending);
  void ReadRaw(detail::PendingBatch& pending, IoStats& io);

  MakerProcess maker_;  // the process whose threads read ahead
  std::vector<std::string> paths_;
  BatchReaderOptions options_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<detail::OpenGang> gang_;
  size_t open_window_ = 1;  // files open at once, over every batch in flight (RLIMIT_NOFILE)
  std::unique_ptr<ExtentReader> extents_;  // with an extent map
  std::vector<uint64_t> map_index_;        // per path: its file in the map, or kNotMapped
  std::shared_ptr<detail::ArenaPoolState> arenas_;

  // Held by Start() and Stop() (FileReader.close() may come from another thread, and two threads
  // may start iterations): the producer is joined and replaced by one caller at a time.
  std::mutex lifecycle_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<uint64_t>> batches_;  // of the current Start()
  size_t next_to_read_ = 0;                     // producer's position in batches_
  size_t next_to_return_ = 0;                   // consumer's position
  struct Ready {
    std::shared_ptr<const Batch> batch;
    std::exception_ptr error;
  };
  std::deque<Ready> ready_;  // read, in order, not yet returned
  bool stop_ = false;
  uint64_t stops_ =
      0;  // Stop() calls (a Start() makes one): a Next() of an earlier one returns null
  BatchReaderStats stats_;
  std::thread producer_;
};

}  // namespace tensortier
