// File <-> device transfers through a ring of pinned bounce buffers ("slots"), so that disk I/O
// (the Engine) and host<->device copies (a DeviceCopier) overlap.
//
// A transfer is cut into slot-sized chunks whose file boundaries (after the first) are page
// aligned, and each chunk's bytes sit in its slot at the same offset within a page as in the file,
// so the engine can read and write slots with O_DIRECT without staging them again.
//   FileToDevice: up to `slots` engine reads are in flight; as each completes, in order, its
//     host-to-device copy is queued and a fence recorded; a slot is read into again only once its
//     fence is done.
//   DeviceToFile: device-to-host copies are queued ahead into free slots; as each fence is done,
//     in order, the engine write of that slot is submitted; a slot is copied into again only once
//     its write has completed.
// Errors: the first error of any step (engine I/O as IoError, copies as CudaError or the copier's
// error) is thrown after every read, write and copy still in flight has finished, so no slot is
// reused or freed while in use; the ring is usable again afterwards. A read that reaches end of
// file returns the bytes before it with eof set.
//
// Thread-compatible: one transfer at a time per ring; use one ring (and copier) per thread. The
// engine may be shared. The device memory and the file must stay valid during the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tensortier/device_copier.hpp"
#include "tensortier/engine.hpp"
#include "tensortier/file.hpp"
#include "tensortier/pinned_pool.hpp"

namespace tensortier {

struct TransferResult {
  uint64_t bytes = 0;   // transferred (for reads: up to end of file)
  bool eof = false;     // a read reached end of file before `length`
  std::string path;     // how the bytes moved: "bounce" (this ring), later also "gds"
  std::string copier;   // DeviceCopier::name()
  uint64_t chunks = 0;  // engine operations submitted
  IoStats io;           // the engine's stats, summed over the chunks
};

struct BounceRingOptions {
  size_t slots = 4;                 // chunks in flight
  uint64_t slot_bytes = 4u << 20;   // a multiple of 4 KiB
};

class BounceRing {
 public:
  // Slots taken from `pool` now (blocking while its budget is lent out, see PinnedPool), held
  // until the ring is destroyed. Throws std::invalid_argument for bad options or a pool whose
  // budget is smaller than the ring.
  BounceRing(Engine& engine, PinnedPool& pool, DeviceCopier& copier, BounceRingOptions options);
  // With a pool of its own of exactly slots x slot_bytes, registered with CUDA through the
  // copier's pinning_context() when it has one.
  BounceRing(Engine& engine, DeviceCopier& copier, BounceRingOptions options = {});
  ~BounceRing();
  BounceRing(const BounceRing&) = delete;
  BounceRing& operator=(const BounceRing&) = delete;

  // Reads [file_offset, file_offset+length) of `file` into device memory at `device_address`.
  // Stops at end of file (result.eof). Throws the first error (see above).
  TransferResult FileToDevice(const File& file, uint64_t file_offset, uint64_t length,
                              uint64_t device_address);
  // Writes `length` bytes from device memory at `device_address` to `file` at `file_offset`.
  TransferResult DeviceToFile(uint64_t device_address, uint64_t length, const File& file,
                              uint64_t file_offset);

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
  TransferResult NewResult() const;

  Engine& engine_;
  DeviceCopier& copier_;
  BounceRingOptions options_;
  std::optional<PinnedPool> own_pool_;
  std::vector<PinnedBuffer> slots_;
};

}  // namespace tensortier
