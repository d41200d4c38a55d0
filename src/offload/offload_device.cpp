#include "tensortier/offload/offload_device.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <utility>

namespace tensortier {
namespace {

size_t Index(OffloadKind kind) {
  return kind == OffloadKind::kWrite ? 0 : 1;
}

// Whether a job moving `key` is one a wait for `keys` (sorted; none: all) takes.
bool Wanted(const std::optional<std::vector<uint64_t>>& keys, uint64_t key) {
  return !keys || std::binary_search(keys->begin(), keys->end(), key);
}

std::optional<std::vector<uint64_t>> Sorted(std::optional<std::vector<uint64_t>> keys) {
  if (keys) std::sort(keys->begin(), keys->end());
  return keys;
}

}  // namespace

OffloadDevice::OffloadDevice(Offloader& offloader, GdsMode gds, TransferFactory make_transfer)
    : offloader_(offloader), gds_(gds), make_transfer_(std::move(make_transfer)) {}

OffloadDevice::~OffloadDevice() = default;

DeviceTransfer& OffloadDevice::Transfer() {
  if (!transfer_) {
    files_ = std::make_unique<OffloadDeviceFiles>(gds_);
    transfer_ = make_transfer_(offloader_.engine());
  }
  return *transfer_;
}

void OffloadDevice::Submit(OffloadKind kind, uint64_t key, const DeviceSpan& span,
                           uint64_t length) {
  DeviceTransfer& transfer = Transfer();
  OffloadDeviceFiles* files = files_.get();
  DeviceJob job = kind == OffloadKind::kWrite
                      ? OffloadFromDeviceAsync(offloader_, transfer, key, span, length, files)
                      : RestoreToDeviceAsync(offloader_, transfer, key, span, length, files);
  jobs_[Index(kind)].push_back({key, std::move(job)});
}

std::vector<DeviceJob> OffloadDevice::Jobs(OffloadKind kind,
                                           const std::optional<std::vector<uint64_t>>& keys) const {
  const auto sorted = Sorted(keys);
  std::vector<DeviceJob> out;
  for (const Job& j : jobs_[Index(kind)]) {
    if (Wanted(sorted, j.key)) out.push_back(j.job);
  }
  return out;
}

std::vector<OffloadOutcome> OffloadDevice::Wait(OffloadKind kind,
                                                const std::optional<std::vector<uint64_t>>& keys) {
  const auto sorted = Sorted(keys);
  std::vector<Job>& all = jobs_[Index(kind)];
  for (const Job& j : all) {
    if (Wanted(sorted, j.key)) {
      while (!j.job.WaitFor(std::chrono::hours(1))) {
      }
    }
  }
  std::vector<OffloadOutcome> out = keys ? offloader_.Wait(kind, *keys) : offloader_.Wait(kind);
  std::vector<Job> done;
  std::vector<Job> kept;
  for (Job& j : all) (Wanted(sorted, j.key) ? done : kept).push_back(std::move(j));
  all = std::move(kept);
  for (const Job& j : done) {  // the jobs applied their outcome to the offloader already
    TransferResult r;
    try {
      r = j.job.Wait();
    } catch (...) {
      out.push_back({j.key, std::current_exception()});
      continue;
    }
    // Outside the try: a move that was applied is never reported as failed (its caller would
    // free a restored range whose key is gone).
    bytes_[r.path.empty() ? "bounce" : r.path] += r.bytes;  // zero bytes: no path taken
    out.push_back({j.key, nullptr});
  }
  return out;
}

void OffloadDevice::Forget() noexcept {
  for (std::vector<Job>& jobs : jobs_) jobs.clear();
}

void OffloadDevice::Close() {
  files_.reset();
  transfer_.reset();
}

}  // namespace tensortier
