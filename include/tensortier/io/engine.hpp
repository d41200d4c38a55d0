// The I/O engine: asynchronous reads and writes of any (file offset, length, host address).
//
// Each operation is planned into requests: the unaligned head and tail of a range go through the
// page cache (byte-exact, no read-modify-write), the aligned middle goes O_DIRECT in chunks of
// `chunk_size` spread over the worker rings, through an internal aligned bounce buffer when the
// host address does not meet the O_DIRECT memory alignment. Reads of page-cache-resident chunks go
// buffered (O_DIRECT would fetch them from the disk again). Every completion is checked: short
// transfers are continued, reads stop at end of file and say so, errors are kept (the first one
// per operation) and thrown by Future::Wait() with errno, path, offset and length.
//
// Thread-safe: any thread may submit and wait. The caller keeps host buffers alive until the
// operation completes; files are kept open by the operation itself.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "tensortier/io/backend.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/process_identity.hpp"

namespace tensortier {

// One contiguous piece of an operation.
struct IoDesc {
  File file;
  void* buf;
  uint64_t offset;
  uint64_t length;
  // A read whose `length` runs past end of file into memory the caller does not need there (a
  // batch arena rounding each file up to the O_DIRECT alignment): it may go direct through the
  // block holding end of file, the kernel zeroing buf's bytes past EOF within that block, and stops
  // there. One request per file instead of a direct read and a buffered tail, which on a cold
  // file is a second, synchronous request to the disk. Otherwise no byte past EOF is written.
  bool may_fill_past_eof = false;
};

// Per operation.
struct SubmitOptions {
  // The destinations are memory the direct reads may stage through the engine's huge-page
  // bounce buffers, copying out on the worker threads, when StagesReads says so for the file:
  // small-page memory (tensors from torch's allocator, new or not), physically scattered; not
  // huge-page buffers, which the device reads into at full speed. Ignored for writes.
  bool stage_reads = false;
};

struct IoStats {
  std::string backend;
  uint64_t requested_bytes = 0;
  uint64_t transferred_bytes = 0;
  uint64_t direct_bytes = 0;     // planned through O_DIRECT
  uint64_t buffered_bytes = 0;   // planned through the page cache (heads, tails, fallback, cached)
  uint64_t bounced_bytes = 0;    // of direct_bytes: staged through internal aligned buffers
  uint64_t staged_bytes = 0;     // of bounced_bytes: staged by SubmitOptions::stage_reads
  uint64_t cached_bytes = 0;     // of buffered_bytes: reads chosen buffered as page-cache resident
  uint64_t requests = 0;         // requests submitted to the backend, resubmissions included
  uint64_t resubmits = 0;        // continuations of short transfers
  bool eof = false;              // a read reached end of file before its full length
  bool direct_fallback = false;  // a file refused O_DIRECT (File::direct_fallback_reason says why)
  std::string residency_method;  // how page-cache residency was checked ("" when not checked)

  // Adds `other`'s counts (one operation's stats into a total over several).
  IoStats& operator+=(const IoStats& other);
};

struct IoResult {
  uint64_t bytes = 0;                   // total transferred
  std::vector<uint64_t> segment_bytes;  // per IoDesc, in submission order
  IoStats stats;
};

namespace detail {
struct Operation;
class CopyPool;
class Worker;
}  // namespace detail

class Future {
 public:
  Future() = default;
  bool valid() const noexcept { return op_ != nullptr; }
  // Non-blocking.
  bool done() const;
  // Blocks until the operation completes; returns (a copy of) its result or throws its first
  // error (IoError). Can be called again and gives the same outcome.
  IoResult Wait() const;
  // Blocks until the operation completes or `timeout` passes; whether it completed. Takes no
  // outcome (an error stays for Wait()).
  bool WaitFor(std::chrono::milliseconds timeout) const;

 private:
  friend class Engine;
  explicit Future(std::shared_ptr<detail::Operation> op) : op_(std::move(op)) {}
  std::shared_ptr<detail::Operation> op_;
};

class Engine {
 public:
  // Throws std::invalid_argument for bad options, IoError when the chosen backend cannot start,
  // std::system_error (EAGAIN) when its copy threads cannot be started.
  // With backend "auto", tries io_uring, libaio, threads in order; when `probe_dir` is given each
  // must also pass a verified write/read round trip on a scratch file in that directory.
  explicit Engine(EngineOptions options = EngineOptions::FromEnvironment(),
                  const std::string& probe_dir = "");
  // Test seam: each worker's backend is made by `factory` (e.g. a fault-injecting backend).
  Engine(EngineOptions options, BackendFactory factory);
  // Waits for every operation in flight (errors are dropped: wait on futures to see them).
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Future Read(const File& file, void* buf, uint64_t length, uint64_t offset);
  Future Write(const File& file, const void* buf, uint64_t length, uint64_t offset);
  // Scatter/gather: all pieces are planned and submitted together; one future for the lot.
  // Throws std::invalid_argument (bad piece) or IoError (write to a read-only file) up front.
  // An I/O error while preparing the transfer (no space for the range a write extends the file
  // by, where the filesystem reserves it up front; a failed fstat) is the operation's outcome,
  // thrown by Wait() as a failed transfer's error is, nothing having been transferred; a refused
  // reservation gives back what the filesystem kept of it (the file's size comes back to what it
  // was, or to the write's offset past it).
  Future Submit(IoOp op, std::span<const IoDesc> pieces, const SubmitOptions& submit = {});
  // Waits for every operation submitted so far; throws the first error not yet seen by a Wait().
  void WaitAll();
  // In a child made by fork() the workers' threads do not exist (only the forking thread is
  // copied): Submit() and WaitAll() there throw std::logic_error, and the destructor leaves the
  // workers and operations as they are (joining or waiting would never return).
  bool forked() const noexcept;

  // Bytes of the workers' internal bounce buffers, in use or kept for the next burst (see
  // EngineOptions::bounce_idle_ms), and how many buffers they have made so far (each one memory
  // faulted in anew). Any thread; snapshots.
  uint64_t bounce_bytes() const;
  uint64_t bounce_allocations() const;

  const std::string& backend() const noexcept { return backend_; }
  const EngineOptions& options() const noexcept { return options_; }

 private:
  void StartCopyThreads();
  void Start(BackendFactory factory);
  void CheckNotForked() const;

  MakerProcess maker_;  // the process that made the engine
  EngineOptions options_;
  std::string backend_;
  std::unique_ptr<detail::CopyPool> copy_pool_;  // declared first: outlives the workers
  std::vector<std::unique_ptr<detail::Worker>> workers_;
  std::mutex mu_;  // guards outstanding_ and next_worker_
  std::vector<std::shared_ptr<detail::Operation>> outstanding_;
  size_t next_worker_ = 0;
};

// Whether reads of `file` whose operation allows staging (SubmitOptions::stage_reads) are
// staged under `options`: kOn always, kOff never, kAuto where the file's block queue cuts
// requests into scattered memory short (ScatteredMemorySplitsRequests) and the engine's bounce
// buffers (chunk_size bytes, Pages::kReused) get huge pages, without which staging gains nothing.
// Under kAuto every chunk is then staged when the engine has copy threads
// (EngineOptions::copy_threads); without them only where most of its destination is faulted in
// already (ResidentMemoryBytes): the copy into memory never touched pays a page fault per small
// page on a worker thread, which costs more than the disk's slower reads into scattered pages.
bool StagesReads(const EngineOptions& options, const File& file);

// A verified round trip (8 KiB written and read back, with and without O_DIRECT) on a scratch file
// in `dir` using `kind`; where `dir` takes no files (read-only), reads of a file already there
// (FileToProbeByReading) compared with a plain pread. Never throws.
struct BackendProbe {
  BackendKind kind;
  bool available = false;  // the backend starts here
  bool direct_ok = false;  // round trip with O_DIRECT verified
  bool buffered_ok = false;
  bool writes_tested = false;  // false: `dir` takes no files, and the ok's are of reads only
  std::string detail;  // why not, or the O_DIRECT fallback reason
};
BackendProbe ProbeBackend(BackendKind kind, const std::string& dir);

// A readable, non-empty regular file in `dir` or one level below it, "" if none.
std::string FileToProbeByReading(const std::string& dir);

// Whether making a file failed with `error_code` because the directory takes no files (read-only,
// or not this user's): where a probe reads a file already there instead.
bool TakesNoFiles(int error_code);

}  // namespace tensortier
