#include "tensortier/checkpoint/staging_arenas.hpp"

#include <algorithm>

namespace tensortier {

StagingArena::StagingArena(size_t nbytes, std::optional<int> pinned_device)
    : pinned_device_(pinned_device) {
  if (!pinned_device) {
    memory_ = AlignedBuffer(nbytes);
    return;
  }
  const CudaDriver& driver = CudaDriver::Get();
  if (!driver.available()) {
    throw CudaError(cuda::kUnavailable, "pinned host memory (cuMemHostRegister)",
                    "CUDA driver unavailable: " + driver.why_unavailable());
  }
  memory_ = AlignedBuffer(nbytes, Pages::kReused);
  registration_.emplace(PrimaryContext(driver, *pinned_device), memory_.data(), nbytes);
}

StagingLayout LayOutStaging(const std::vector<std::optional<uint64_t>>& nbytes) {
  constexpr uint64_t kPage = 4096;
  constexpr uint64_t kSmallAlign = 64;
  StagingLayout out;
  for (const std::optional<uint64_t>& n : nbytes) {
    if (!n) {
      out.offsets.emplace_back();
      continue;
    }
    const uint64_t align = *n >= kPage ? kPage : kSmallAlign;
    out.size = (out.size + align - 1) / align * align;
    out.offsets.emplace_back(out.size);
    out.size += *n;
  }
  out.size = (out.size + kPage - 1) / kPage * kPage;
  return out;
}

std::shared_ptr<StagingArena> StagingArenas::Take(size_t nbytes, std::optional<int> pinned_device) {
  std::lock_guard lock(mu_);
  std::shared_ptr<StagingArena> best;
  std::vector<std::shared_ptr<StagingArena>> kept;
  for (std::shared_ptr<StagingArena>& a : arenas_) {
    // In use: its save has not written its file, and someone holds it besides this list.
    const bool free = a->written_ || a.use_count() == 1;
    if (free && a->pinned_device_ == pinned_device && a->size() >= nbytes &&
        (!best || a->size() < best->size())) {
      best = a;
    }
  }
  if (best) {
    best->written_ = false;
    return best;
  }
  for (std::shared_ptr<StagingArena>& a : arenas_) {
    const bool free = a->written_ || a.use_count() == 1;
    if (!(free && a->pinned_device_ == pinned_device)) kept.push_back(std::move(a));
  }
  arenas_ = std::move(kept);
  return arenas_.emplace_back(
      std::make_shared<StagingArena>(std::max<size_t>(nbytes, 1), pinned_device));
}

void StagingArenas::MarkWritten(std::span<const uintptr_t> addresses) {
  std::lock_guard lock(mu_);
  for (const std::shared_ptr<StagingArena>& a : arenas_) {
    const auto begin = reinterpret_cast<uintptr_t>(a->data());
    const uintptr_t end = begin + a->size();
    a->written_ = a->written_ || std::any_of(addresses.begin(), addresses.end(),
                                             [&](uintptr_t p) { return begin <= p && p < end; });
  }
}

size_t StagingArenas::count() const {
  std::lock_guard lock(mu_);
  return arenas_.size();
}

StagingArenas& StagingArenas::Process() {
  static StagingArenas* arenas = new StagingArenas;  // never destroyed: lent arenas outlive exit
  return *arenas;
}

}  // namespace tensortier
