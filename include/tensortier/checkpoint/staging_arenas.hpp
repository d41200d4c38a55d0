// The host memory DCP's asynchronous saves stage state dicts into (tensortier.dcp's Writer.stage):
// arenas kept from save to save, their pages faulted in once. An arena is lent as a shared_ptr,
// which each user (the staged tensors) holds while it may read the arena. It is free again once
// the save that staged into it has written its file (MarkWritten: a staged copy is for one save,
// and a view of it kept after that save holds the next save's values), or once no one holds it (a
// save that failed before writing). A save that starts while another still writes gets an arena
// of its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/util/aligned_buffer.hpp"

namespace tensortier {

class StagingArena {
 public:
  // Page-aligned memory: pinned (registered with CUDA device `pinned_device`'s context, reused
  // pages) where a state dict has CUDA tensors, else pages touched once (each job's first save
  // faults them in while training waits, and huge pages cost more to fault in on some VMs).
  // Throws CudaError where pinned memory is asked for and the CUDA driver is unavailable.
  StagingArena(size_t nbytes, std::optional<int> pinned_device);

  std::byte* data() const noexcept { return memory_.data(); }
  size_t size() const noexcept { return memory_.size(); }

 private:
  friend class StagingArenas;
  AlignedBuffer memory_;
  std::optional<HostRegistration> registration_;  // destroyed before the memory
  std::optional<int> pinned_device_;
  bool written_ = false;  // the save that staged into it has written its file
};

// Where a state dict's tensors go in their arena: tensor i (nbytes[i] bytes; nullopt for one not
// staged in it) at offsets[i], those of a page or more on a page (written with O_DIRECT straight
// from it), smaller ones on 64 bytes (every dtype's alignment); `size`: the arena's, whole pages.
struct StagingLayout {
  std::vector<std::optional<uint64_t>> offsets;
  uint64_t size = 0;
};
StagingLayout LayOutStaging(const std::vector<std::optional<uint64_t>>& nbytes);

class StagingArenas {
 public:
  // A free arena of `nbytes` or more of the kind asked for (the smallest), or a new one of
  // max(nbytes, 1) bytes; free arenas of that kind too small for it are given back to the system.
  std::shared_ptr<StagingArena> Take(size_t nbytes, std::optional<int> pinned_device);
  // Marks free the arenas that hold any of `addresses` (the items a save has just written).
  void MarkWritten(std::span<const uintptr_t> addresses);
  // How many arenas there are (in use or free).
  size_t count() const;

  // This process's arenas.
  static StagingArenas& Process();

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<StagingArena>> arenas_;
};

}  // namespace tensortier
