// File <-> device transfers: through a ring of pinned bounce buffers ("slots") so that disk I/O
// (the Engine) and host<->device copies (a DeviceCopier) overlap, or straight through GPUDirect
// Storage (cuFile) when it accepts the file.
//
// BounceRing: one transfer at a time over `slots` pinned buffers taken from a PinnedPool.
//   A transfer is cut into slot-sized chunks whose file boundaries (after the first) are page
//   aligned, and each chunk's bytes sit in its slot at the same offset within a page as in the
//   file, so the engine reads and writes slots with O_DIRECT without staging them again.
//   FileToDevice: up to `slots` engine reads are in flight; as each completes, in order, its
//     host-to-device copy is queued and a fence recorded; a slot is read into again only once its
//     fence is done.
//   DeviceToFile: device-to-host copies are queued ahead into free slots; as each fence is done,
//     in order, the engine write of that slot is submitted; a slot is copied into again only once
//     its write has completed.
//   Bytes in flight are bounded by slots x slot_bytes (plus what the engine holds for one chunk).
//   The copier is given per transfer: CudaCopier queues its copies on the caller's stream, so a
//   read's copies run after work already queued there (e.g. kernels still using the old
//   contents) and a write's copies see the results of that work. Both calls return only once
//   every copy is done (the slots are free again), so the data is in place when they return.
//
// Errors: the first error of any step (engine I/O as IoError, copies as CudaError or the copier's
// error) is thrown after every read, write and copy still in flight has finished, so no slot is
// reused or freed while in use; the ring is usable again afterwards. What the destination holds
// after a failure:
//   FileToDevice: device bytes outside [address, address+length) are untouched; inside, every
//     chunk before the failing one holds the file's data, the rest is unspecified.
//   DeviceToFile: file bytes outside [offset, offset+length) are untouched (the file may have
//     grown up to offset+length); inside, the range is unspecified (chunks are written in order,
//     several at once). The device memory is never written.
// A read that reaches end of file moves the bytes before it and sets eof; device bytes past them
// are untouched.
//
// DeviceTransfer: what the Python layer uses. Picks the path per file (GDS when the DeviceFile was
// registered with cuFile, else a bounce ring; in GdsMode::kAuto a GDS transfer that cuFile fails
// with a cuFile status, CuFileTransferError, runs again through a bounce ring, the reason in
// TransferResult::gds_reason, while errno failures (-1) stay errors), keeps a few rings (one per
// concurrent transfer, their slots from one pool with a byte budget) and makes a copier per
// transfer for the caller's device and stream. Thread-safe: transfers from several threads run at
// once, up to `max_rings` through rings (more wait for a free ring). Submit() runs a transfer on
// the DeviceTransfer's job queue (device_jobs.hpp), `max_rings` threads, so the caller goes on.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tensortier/cuda/cufile.hpp"
#include "tensortier/transfer/device_copier.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/transfer/pinned_pool.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/settings.hpp"

namespace tensortier {

class DeviceJob;       // device_jobs.hpp
class DeviceJobQueue;  // device_jobs.hpp

struct TransferResult {
  uint64_t bytes = 0;   // transferred (for reads: up to end of file)
  bool eof = false;     // a read reached end of file before `length`
  std::string path;     // how the bytes moved: "bounce" (a ring) or "gds" (cuFile)
  std::string copier;   // DeviceCopier::name() ("" for gds)
  uint64_t chunks = 0;  // engine operations (or cuFile calls) submitted
  IoStats io;           // the engine's stats, summed over the chunks (bounce path)
  // Bounce path of a DeviceTransfer: why GDS was not used (or failed). GDS path: why cuFile ran
  // in its compatibility mode (not GPUDirect), "" when it did not.
  std::string gds_reason;
};

struct BounceRingOptions {
  size_t slots = SettingFor("TENSORTIER_BOUNCE_SLOTS").default_number;  // chunks in flight
  // A multiple of 4 KiB.
  uint64_t slot_bytes = SettingFor("TENSORTIER_BOUNCE_SLOT_SIZE").default_number;
  // Throws std::invalid_argument naming the bad field.
  void Validate() const;
  uint64_t bytes() const { return slots * slot_bytes; }
};

class BounceRing {
 public:
  // Slots taken from `pool` now (blocking while its budget is lent out, see PinnedPool), held
  // until the ring is destroyed. Throws std::invalid_argument for bad options or a pool whose
  // budget is smaller than the ring.
  BounceRing(Engine& engine, PinnedPool& pool, BounceRingOptions options);
  ~BounceRing();
  BounceRing(const BounceRing&) = delete;
  BounceRing& operator=(const BounceRing&) = delete;

  // Reads [file_offset, file_offset+length) of `file` into device memory at `device_address`
  // with `copier`. Stops at end of file (result.eof). Throws the first error (see above), or
  // std::invalid_argument when the range overflows.
  TransferResult FileToDevice(DeviceCopier& copier, const File& file, uint64_t file_offset,
                              uint64_t length, uint64_t device_address);
  // Writes `length` bytes from device memory at `device_address` to `file` at `file_offset`.
  TransferResult DeviceToFile(DeviceCopier& copier, uint64_t device_address, uint64_t length,
                              const File& file, uint64_t file_offset);

  const BounceRingOptions& options() const noexcept { return options_; }
  // Whether the slots are registered with CUDA.
  bool pinned() const noexcept;

 private:
  struct Chunk {
    uint64_t file_offset;
    uint64_t length;
    size_t slot;
    size_t slot_offset;  // where in the slot the bytes start (file_offset's offset in its page)
  };
  std::vector<Chunk> Plan(uint64_t file_offset, uint64_t length) const;
  std::byte* SlotData(const Chunk& c) const;
  TransferResult NewResult(const DeviceCopier& copier) const;

  Engine& engine_;
  BounceRingOptions options_;
  std::vector<PinnedBuffer> slots_;
};

// How a DeviceFile uses GPUDirect Storage.
enum class GdsMode {
  kOff,      // never: always the bounce ring
  kAuto,     // when cuFile is available and registers the file, else the bounce ring
  kRequire,  // always: DeviceFile throws CuFileError when cuFile cannot serve the file
};
// The words of TENSORTIER_GDS: "on" and "require" both name kRequire, and "on", first, is the
// name GdsModeName gives it.
inline constexpr auto kGdsModeNames =
    NamesFromWords(SettingFor("TENSORTIER_GDS").choices,
                   {GdsMode::kOff, GdsMode::kAuto, GdsMode::kRequire, GdsMode::kRequire});
// "off", "auto", "on"/"require" (also "0"/"false", "1"/"true"). Throws std::invalid_argument
// otherwise.
GdsMode ParseGdsMode(const std::string& text);
// TENSORTIER_GDS, else its default (off). Throws std::invalid_argument on a bad value.
GdsMode GdsModeFromEnvironment();
// "off", "auto", "on".
const char* GdsModeName(GdsMode mode) noexcept;

// A File, registered with cuFile when the mode asks for it and cuFile accepts it (through the
// O_DIRECT descriptor; a file that refused O_DIRECT never uses GDS). Cheap to copy (copies share
// the registration, which lasts as long as the last copy). The decision is made once, here.
class DeviceFile {
 public:
  DeviceFile() = default;
  // Throws CuFileError only for GdsMode::kRequire. The first overload loads cuFile
  // (CuFile::Get()) only for kAuto and kRequire: "off" never opens its driver.
  DeviceFile(File file, GdsMode mode);
  DeviceFile(File file, GdsMode mode, const CuFile& cufile);
  // Under TENSORTIER_GDS (GdsModeFromEnvironment()).
  explicit DeviceFile(File file);
  // Test seam: a file whose transfers take the GDS path (gds() is true) without a cuFile
  // registration (handle() is null): only a DeviceTransfer made with a GdsFunction can move it.
  static DeviceFile FakeGdsForTest(File file, GdsMode mode);

  const File& file() const noexcept { return file_; }
  GdsMode mode() const noexcept { return mode_; }
  bool gds() const noexcept { return gds_; }
  // Why GDS is not used ("" when it is, "GDS off" for kOff).
  const std::string& gds_reason() const noexcept { return reason_; }
  // When gds(): why cuFile moves this file's bytes in its compatibility mode (POSIX I/O through
  // host buffers of its own, not GPUDirect), "" when it does not.
  const std::string& gds_compat_mode() const noexcept { return compat_mode_; }
  // Null unless gds() (and for FakeGdsForTest files).
  const CuFileHandle* handle() const noexcept { return handle_.get(); }

 private:
  DeviceFile(File file, GdsMode mode, const CuFile* cufile_or_null);  // null only for kOff

  File file_;
  GdsMode mode_ = GdsMode::kOff;
  bool gds_ = false;
  std::shared_ptr<const CuFileHandle> handle_;
  std::string reason_;
  std::string compat_mode_;
};

// A File whose DeviceFile (under `mode`) is made on the first Get(), by the transfer that needs it
// (on the thread running it), then kept: a file's cuFile registration happens once, and its
// error (CuFileError for GdsMode::kRequire) is the error of that transfer. A failed Get() keeps
// nothing: the next tries again. Thread-safe.
class LazyDeviceFile {
 public:
  LazyDeviceFile(File file, GdsMode mode) : file_(std::move(file)), mode_(mode) {}
  DeviceFile Get();
  const File& file() const noexcept { return file_; }

 private:
  std::mutex mu_;
  const File file_;
  const GdsMode mode_;
  std::optional<DeviceFile> made_;  // guarded by mu_
};

// Where device memory is, for a DeviceTransfer.
struct DeviceSpan {
  uint64_t address = 0;
  int device = 0;
  // The stream the copies are ordered on (the caller's, or one ordered after it); none: a stream of
  // the transfer's own, unordered with the caller's work.
  std::optional<cuda::CUstream> stream;
};

// Makes the copier for one transfer (test seam: MemcpyCopier on CI).
using CopierFactory = std::function<std::unique_ptr<DeviceCopier>(const DeviceSpan& span)>;

// One GDS transfer of `length` bytes between `span` and `file` at `file_offset` (a read when
// `read`); returns the bytes moved (fewer only for a read at end of file). The default makes the
// span's device's primary context current, waits for span.stream and calls the file's
// CuFileHandle. Test seam: a fake that throws CuFileTransferError exercises the fallback on CI.
using GdsFunction =
    std::function<uint64_t(bool read, const DeviceFile& file, const DeviceSpan& span,
                           uint64_t length, uint64_t file_offset)>;

struct DeviceTransferOptions {
  BounceRingOptions ring;  // per concurrent transfer. TENSORTIER_BOUNCE_SLOTS, _SLOT_SIZE.
  // Concurrent bounce transfers. TENSORTIER_BOUNCE_RINGS.
  size_t max_rings = SettingFor("TENSORTIER_BOUNCE_RINGS").default_number;
  // Defaults, overridden by the environment. Throws std::invalid_argument on a malformed value.
  static DeviceTransferOptions FromEnvironment();
  void Validate() const;
};

class DeviceTransfer {
 public:
  // CUDA copies through `driver` (the ring's slots registered with it); throws CudaError when
  // the driver is unavailable, naming what is missing.
  DeviceTransfer(Engine& engine,
                 DeviceTransferOptions options = DeviceTransferOptions::FromEnvironment(),
                 const CudaDriver& driver = CudaDriver::Get());
  // Test seam: copies made by `factory`, slots from a pool with `pool` options, GDS transfers
  // by `gds` (when set).
  DeviceTransfer(Engine& engine, DeviceTransferOptions options, CopierFactory factory,
                 PinnedPoolOptions pool, GdsFunction gds = {},
                 const CudaDriver& driver = CudaDriver::Get());
  ~DeviceTransfer();
  DeviceTransfer(const DeviceTransfer&) = delete;
  DeviceTransfer& operator=(const DeviceTransfer&) = delete;

  // As BounceRing::FileToDevice / DeviceToFile, through GDS when `file.gds()`. The GDS path
  // first waits for the work queued on `span.stream` (cuFile is not stream ordered). When GDS
  // fails with a cuFile status and the file's mode is kAuto, the whole transfer runs again
  // through a bounce ring (result.path "bounce", result.gds_reason says why); otherwise its
  // error is thrown.
  TransferResult Read(const DeviceFile& file, uint64_t file_offset, uint64_t length,
                      const DeviceSpan& span);
  TransferResult Write(const DeviceSpan& span, uint64_t length, const DeviceFile& file,
                       uint64_t file_offset);
  // Bounce path only.
  TransferResult Read(const File& file, uint64_t file_offset, uint64_t length,
                      const DeviceSpan& span);
  TransferResult Write(const DeviceSpan& span, uint64_t length, const File& file,
                       uint64_t file_offset);

  // Runs `work` (transfers through this DeviceTransfer, or anything else that moves device
  // bytes) on this transfer's job queue: max_rings threads, started on the first call. What
  // `work` uses must outlive its job; the destructor runs every job submitted first.
  DeviceJob Submit(std::function<TransferResult()> work);

  const DeviceTransferOptions& options() const noexcept { return options_; }
  // The pool of the rings' slots (made with the first bounce transfer, registered through the
  // primary context of that transfer's device; registrations are portable). Null before.
  const PinnedPool* pool() const;
  // Rings made so far (at most max_rings).
  size_t rings() const;

 private:
  class RingLease;
  RingLease LeaseRing(int device);
  void ReturnRing(std::unique_ptr<BounceRing> ring) noexcept;
  TransferResult Gds(bool read, const DeviceFile& file, const DeviceSpan& span, uint64_t length,
                     uint64_t file_offset);
  uint64_t CuFileTransfer(bool read, const DeviceFile& file, const DeviceSpan& span,
                          uint64_t length, uint64_t file_offset);

  Engine& engine_;
  DeviceTransferOptions options_;
  const CudaDriver& driver_;
  CopierFactory factory_;
  PinnedPoolOptions pool_options_;
  GdsFunction gds_;  // empty: CuFileTransfer

  mutable std::mutex mu_;
  std::unique_ptr<PinnedPool> pool_;  // guarded by mu_ (made once)
  std::condition_variable ring_returned_;
  std::vector<std::unique_ptr<BounceRing>> idle_rings_;  // guarded by mu_
  size_t made_rings_ = 0;                                // guarded by mu_
  std::unique_ptr<DeviceJobQueue> jobs_;                 // guarded by mu_ (made once)
};

}  // namespace tensortier
