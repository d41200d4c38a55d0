// Parks byte ranges (tensor data) in backing files under numeric keys and brings them back.
//
// Each directory gets one backing file, named after this process so that files left by a process
// that died are recognised and removed by the next offloader on that directory. Space comes from a
// SpaceManager per file (page-aligned extents, reused after reads, file shrunk when its tail is
// free). Ranges of at least `stripe_threshold` bytes are striped over all directories, as over
// several drives; smaller ones go to the directory with the least data. A directory whose
// filesystem refused a write for want of space (ENOSPC) is passed over, striping included, while
// another has not refused, until space is freed in its file or every directory has refused: the
// write that met the refusal fails, the next ones go where there is room.
//
// Operations are asynchronous and of two kinds, waited for separately (TensorNVMe's model): a
// write makes its key "stored" only when the data is on disk; a read frees the key's space only
// when the data has arrived. A failed operation changes nothing: a failed write leaves the key
// unknown, a failed read leaves it stored. Wait() reports each key's outcome instead of throwing,
// so the caller can act per key (free the memory of written tensors, keep the others).
//
// Bytes the offloader cannot address (device memory) are moved by the caller instead: Begin*()
// claims the key and returns where its bytes live in the backing files, the caller moves them
// (see transfer/device_offload), and Finish*() applies the outcome as Wait() does for engine
// operations. Such an operation is the caller's to wait for; Wait() does not see it.
//
// Thread-safe. The caller keeps buffers alive until the operation's Wait() returns.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tensortier/io/backend.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/offload/space_manager.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/process_identity.hpp"

namespace tensortier {

// TensorNVMe's names of the engine's backends, which an offloader takes as well as the engine's.
inline constexpr EnumName<BackendKind> kTensorNvmeBackendNames[] = {
    {BackendKind::kIoUring, "uring"},
    {BackendKind::kLibaio, "aio"},
    {BackendKind::kThreads, "pthread"}};

// The engine's name of the backend `name` names: "auto", an engine backend's name or TensorNVMe's.
// Throws std::invalid_argument listing the names taken.
std::string_view OffloadBackendName(std::string_view name);

// EngineOptions::FromEnvironment(), except that bounce_idle_ms is 0 unless
// TENSORTIER_BOUNCE_IDLE_MS sets it: a caller offloads tensors to get their memory back, the
// engine's bounce buffers included, as soon as the transfer is done.
EngineOptions OffloaderEngineDefaults();

struct OffloaderOptions {
  std::vector<std::string> dirs;  // at least one; each must exist
  EngineOptions engine = OffloaderEngineDefaults();
  uint64_t stripe_threshold = 16 << 20;
  // Freed space at the end of a backing file goes back to the filesystem once the offloader has
  // been idle this long, in the background and in steps of `shrink_step` bytes: truncating is
  // slow on some filesystems (online discard), and space freed by a read is often needed again
  // by the next write.
  std::chrono::milliseconds shrink_idle{1000};
  uint64_t shrink_step = 64 << 20;
  // Test seam: when set, the engine's backends come from here (e.g. fault-injecting ones).
  BackendFactory backend_factory;
};

enum class OffloadKind { kWrite, kRead };
inline constexpr EnumName<OffloadKind> kOffloadKindNames[] = {{OffloadKind::kWrite, "write"},
                                                              {OffloadKind::kRead, "read"}};

// One tensor's bytes in an Async*v call.
struct OffloadPiece {
  uint64_t key;
  void* data;
  uint64_t length;
};

// Where part of a key's bytes live: bytes [data_offset, data_offset+length) of the key's range
// are at `file_offset` of `file` (page-aligned). The File keeps its descriptors open after the
// offloader closes.
struct OffloadExtent {
  File file;
  uint64_t file_offset;
  uint64_t data_offset;
  uint64_t length;
};

struct OffloadOutcome {
  uint64_t key;
  std::exception_ptr error;  // null on success
};

class Offloader {
 public:
  // Opens one backing file per directory after removing those left by dead processes.
  // Throws std::invalid_argument (no directory, bad options) or IoError.
  explicit Offloader(OffloaderOptions options);
  // Close().
  ~Offloader();
  Offloader(const Offloader&) = delete;
  Offloader& operator=(const Offloader&) = delete;

  // Starts writing `length` bytes under `key`. Throws std::invalid_argument when the key is stored
  // or has an operation in flight, std::logic_error after Close(). I/O errors, reserving the
  // space on disk included (ENOSPC from fallocate), are never thrown here: Wait() reports them
  // as the key's outcome, on every filesystem alike (where fallocate is missing, ENOSPC comes
  // from the write itself).
  void AsyncWrite(uint64_t key, const void* data, uint64_t length);
  // Starts reading the bytes stored under `key` into `data` (`length` must equal what was
  // written). Throws std::invalid_argument when the key is not stored (never written, a write
  // still in flight, already read back) or the length differs.
  void AsyncRead(uint64_t key, void* data, uint64_t length);
  // Several keys in one engine submission; all are checked before any is started.
  void AsyncWritev(std::span<const OffloadPiece> pieces);
  void AsyncReadv(std::span<const OffloadPiece> pieces);

  // For bytes the caller moves itself. BeginWrite claims `key` and places `length` bytes, with
  // the checks and errors of AsyncWrite; BeginRead checks and claims a stored key as AsyncRead
  // does. Both return the key's extents in data order (none for zero bytes). Every Begin must be
  // followed by the Finish of the same kind, with the caller's outcome (null: every extent was
  // moved whole): a finished write makes the key stored, a failed one unknown with its space
  // freed; a finished read frees the key, a failed one leaves it stored. Close() waits for the
  // Finish of every operation begun. Finish of a key without such an operation (after Close())
  // is a no-op.
  std::vector<OffloadExtent> BeginWrite(uint64_t key, uint64_t length);
  void FinishWrite(uint64_t key, std::exception_ptr error) noexcept;
  std::vector<OffloadExtent> BeginRead(uint64_t key, uint64_t length);
  void FinishRead(uint64_t key, std::exception_ptr error) noexcept;

  // Waits for every operation of `kind` started before the call and applies the outcomes; one
  // outcome per key, in start order. Does not throw for I/O errors: they are in the outcomes.
  // When several threads wait for the same kind at once, each outcome goes to exactly one of them
  // (the one that applies it), and none returns before all operations it covers are applied.
  std::vector<OffloadOutcome> Wait(OffloadKind kind);
  // Wait(kind) for the operations of `kind` started before the call that move any of `keys`
  // (each whole: the other keys of a vector operation too); the others stay in flight.
  std::vector<OffloadOutcome> Wait(OffloadKind kind, std::span<const uint64_t> keys);
  // Waits for both kinds; throws the first error.
  void Synchronize();

  // Forgets a stored key and frees its space (its tensor died). No-op for unknown keys; throws
  // std::invalid_argument when an operation on the key is in flight.
  void Discard(uint64_t key);

  // Gives all freed space at the ends of the backing files back to the filesystem now (the
  // background does it after `shrink_idle`). Throws IoError when a truncate fails.
  void Trim();

  bool stored(uint64_t key) const;
  bool pending(uint64_t key) const;
  uint64_t stored_bytes() const;  // bytes of stored keys
  uint64_t file_bytes() const;    // bytes the backing files span now
  uint64_t bounce_bytes() const;  // the engine's bounce buffers held now (Engine::bounce_bytes)
  uint64_t bounce_allocations() const;          // and made so far (Engine::bounce_allocations)
  const EngineOptions& engine_options() const;  // the engine's effective settings
  // The engine that moves the backing files' bytes; callers moving device memory share it.
  Engine& engine() noexcept { return *engine_; }
  std::vector<std::string> paths() const;
  const std::string& backend() const;

  // Waits for everything in flight (errors dropped), closes and removes the backing files.
  // Stored data is gone afterwards. Idempotent.
  void Close() noexcept;

 private:
  struct Part {
    uint32_t file;
    Extent extent;
    uint64_t length;  // bytes of the range in this part
  };
  enum class State { kWriting, kStored, kReading };
  struct Entry {
    State state;
    uint64_t length;
    std::vector<Part> parts;
    bool external;  // the operation in flight is a Begin*() whose Finish*() is due
  };
  struct Backing {
    std::string path;
    File file;
    SpaceManager space;
    uint64_t file_size = 0;  // as last set by this offloader (0 when fresh)
    bool shrinking = false;  // a truncate to shrink_to runs without mu_ held
    uint64_t shrink_to = 0;
    uint64_t failed_shrink_to = UINT64_MAX;  // not retried until the used end changes
    bool refused_space = false;  // a write here met ENOSPC since space was last freed in it
  };
  struct Pending {
    uint64_t id;  // start order
    OffloadKind kind;
    Future future;                    // invalid when the submission itself failed:
    std::exception_ptr submit_error;  // then this is the outcome
    std::vector<uint64_t> keys;
    uint64_t expect_bytes;
    std::string path;  // of the first piece, for errors
    uint64_t offset;
  };

  void Start(OffloadKind kind, std::span<const OffloadPiece> pieces);
  // Wait() for the operations of `kind` started before the call that `wanted` selects.
  std::vector<OffloadOutcome> WaitFor(OffloadKind kind,
                                      const std::function<bool(const Pending&)>& wanted);
  // Checks the pieces and claims their keys for `kind` (writes: placed too); undoes everything
  // and throws on any failure. REQUIRES: `lock` holds mu_.
  void Claim(OffloadKind kind, std::span<const OffloadPiece> pieces,
             std::unique_lock<std::mutex>& lock);
  // Undoes Claim() of these keys. REQUIRES: mu_ held.
  void Unclaim(OffloadKind kind, std::span<const OffloadPiece> pieces);
  // Applies one key's outcome. REQUIRES: mu_ held.
  void Apply(OffloadKind kind, uint64_t key, const std::exception_ptr& error);
  std::vector<OffloadExtent> Begin(OffloadKind kind, uint64_t key, uint64_t length);
  void Finish(OffloadKind kind, uint64_t key, std::exception_ptr error) noexcept;
  // REQUIRES: `lock` holds mu_ (released while waiting for a shrink of the file to finish).
  std::vector<Part> Place(uint64_t length, std::unique_lock<std::mutex>& lock);
  void Release(const std::vector<Part>& parts);  // REQUIRES: mu_ held
  // Marks the backings of a write that failed with `error` as out of space if it is ENOSPC (the
  // one the error names, else all of `parts`'). REQUIRES: mu_ held.
  void NoteRefusedSpace(const std::vector<Part>& parts, const std::exception_ptr& error);
  void CheckOpen() const;  // REQUIRES: mu_ held
  // Truncates `b` by one step towards its used end, with mu_ released during the syscall.
  std::exception_ptr ShrinkStep(Backing& b, std::unique_lock<std::mutex>& lock);
  void JanitorLoop();

  MakerProcess maker_;  // the process that made the offloader (its pid names the files)
  OffloaderOptions options_;
  std::unique_ptr<Engine> engine_;
  mutable std::mutex mu_;
  std::vector<Backing> backings_;
  std::unordered_map<uint64_t, Entry> entries_;
  std::vector<Pending> pending_;
  uint64_t stored_bytes_ = 0;
  uint64_t next_pending_id_ = 0;
  size_t external_in_flight_ = 0;  // Begin*() not yet Finish*()ed
  std::condition_variable external_done_;
  bool closed_ = false;
  // The janitor shrinks files in the background; shrink_cv_ wakes it (work, stop) and those
  // waiting for a shrink to finish.
  std::condition_variable shrink_cv_;
  std::chrono::steady_clock::time_point last_activity_;
  bool stopping_ = false;
  std::thread janitor_;
};

// Removes backing files in `dir` left by processes that no longer run; returns how many.
// Never throws (unreadable directories count as nothing to clean).
size_t RemoveStaleOffloadFiles(const std::string& dir);

}  // namespace tensortier
