#include <algorithm>
#include <cerrno>
#include <deque>
#include <exception>
#include <limits>
#include <stdexcept>
#include <utility>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"
#include "tensortier/transfer/transfer.hpp"

namespace tensortier {
namespace {

void CheckRange(uint64_t file_offset, uint64_t length, uint64_t device_address) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  if (length > kMax - file_offset || length > kMax - device_address ||
      file_offset + length > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    throw std::invalid_argument(StrCat("BounceRing: the range of ", length,
                                       " bytes at file offset ", file_offset, " (device address ",
                                       device_address, ") overflows"));
  }
}

// Waits for a future whose outcome no longer matters (draining after an error).
void WaitQuietly(const Future& f) noexcept {
  try {
    f.Wait();
  } catch (...) {
  }
}

}  // namespace

void BounceRingOptions::Validate() const {
  // Each field by its row of the settings table (whether it came from there or from the API).
  CheckNumberSetting(SettingFor("TENSORTIER_BOUNCE_SLOTS"), slots);
  CheckNumberSetting(SettingFor("TENSORTIER_BOUNCE_SLOT_SIZE"), slot_bytes);
  static_assert(SettingFor("TENSORTIER_BOUNCE_SLOT_SIZE").multiple % kPageSize == 0);
  if (slot_bytes > (uint64_t{1} << 40) / slots) {
    throw std::invalid_argument("BounceRing: slots x slot_bytes is over 1 TiB");
  }
}

BounceRing::BounceRing(Engine& engine, PinnedPool& pool, BounceRingOptions options)
    : engine_(engine), options_(options) {
  options_.Validate();
  if (options_.bytes() > pool.budget()) {
    throw std::invalid_argument(
        StrCat("BounceRing: ", options_.slots, " slots of ", FormatSize(options_.slot_bytes),
               " exceed the pinned pool's budget of ", FormatSize(pool.budget())));
  }
  slots_.reserve(options_.slots);
  for (size_t i = 0; i < options_.slots; ++i) slots_.push_back(pool.Acquire(options_.slot_bytes));
}

BounceRing::~BounceRing() = default;  // transfers are synchronous: no slot is in use here

bool BounceRing::pinned() const noexcept {
  return !slots_.empty() && slots_.front().registered();
}

std::vector<BounceRing::Chunk> BounceRing::Plan(uint64_t file_offset, uint64_t length) const {
  std::vector<Chunk> chunks;
  chunks.reserve(static_cast<size_t>(length / options_.slot_bytes + 2));
  for (uint64_t pos = file_offset, end = file_offset + length; pos < end;) {
    // The first chunk keeps the file offset's position within its page, so every later chunk
    // starts on a page boundary both in the file and in its slot.
    const size_t in_page = static_cast<size_t>(pos % kPageSize);
    const uint64_t n = std::min(end - pos, options_.slot_bytes - in_page);
    chunks.push_back({pos, n, chunks.size() % options_.slots, in_page});
    pos += n;
  }
  return chunks;
}

std::byte* BounceRing::SlotData(const Chunk& c) const {
  return slots_[c.slot].data() + c.slot_offset;
}

TransferResult BounceRing::NewResult(const DeviceCopier& copier) const {
  TransferResult r;
  r.path = "bounce";
  r.copier = std::string(copier.name());
  r.io.backend = engine_.backend();
  return r;
}

// Slots are used in chunk order (chunk i in slot i % slots) and freed in chunk order, so the
// slots in use are always those of the last (reads + copies) chunks started: the slot of the next
// chunk is free exactly when fewer than `slots` are in use.
TransferResult BounceRing::FileToDevice(DeviceCopier& copier, const File& file,
                                        uint64_t file_offset, uint64_t length,
                                        uint64_t device_address) {
  CheckRange(file_offset, length, device_address);
  TransferResult result = NewResult(copier);
  const std::vector<Chunk> chunks = Plan(file_offset, length);
  const size_t n_slots = options_.slots;
  std::deque<std::pair<size_t, Future>> reads;     // chunk, read in flight
  std::deque<std::pair<size_t, uint64_t>> copies;  // chunk, fence after its copy
  size_t next = 0;
  bool at_eof = false;
  std::exception_ptr error;
  try {
    for (;;) {
      while (!copies.empty() && copier.Done(copies.front().second)) copies.pop_front();
      while (!at_eof && next < chunks.size() && reads.size() + copies.size() < n_slots) {
        const Chunk& c = chunks[next];
        reads.emplace_back(next, engine_.Read(file, SlotData(c), c.length, c.file_offset));
        ++result.chunks;
        ++next;
      }
      if (reads.empty()) {
        if (at_eof || next == chunks.size()) break;
        copier.Wait(copies.front().second);  // every slot holds a copy in flight
        copies.pop_front();
        continue;
      }
      const size_t index = reads.front().first;
      const Future read = std::move(reads.front().second);
      reads.pop_front();
      const IoResult r = read.Wait();
      result.io += r.stats;
      if (at_eof) continue;  // a read past an earlier end of file: drained, not used
      const Chunk& c = chunks[index];
      if (r.bytes > 0) {
        copier.CopyToDevice(device_address + (c.file_offset - file_offset), SlotData(c),
                            static_cast<size_t>(r.bytes));
        copies.emplace_back(index, copier.Record());
        result.bytes += r.bytes;
      }
      if (r.bytes < c.length) at_eof = true;
    }
    if (!copies.empty()) copier.Wait(copies.back().second);
  } catch (...) {
    error = std::current_exception();
  }
  if (error) {
    // Nothing may still write into a slot, or read from one, once this returns.
    for (auto& [index, read] : reads) WaitQuietly(read);
    try {
      copier.Synchronize();
    } catch (...) {
    }
    std::rethrow_exception(error);
  }
  result.eof = at_eof;
  return result;
}

TransferResult BounceRing::DeviceToFile(DeviceCopier& copier, uint64_t device_address,
                                        uint64_t length, const File& file, uint64_t file_offset) {
  CheckRange(file_offset, length, device_address);
  TransferResult result = NewResult(copier);
  const std::vector<Chunk> chunks = Plan(file_offset, length);
  const size_t n_slots = options_.slots;
  std::deque<std::pair<size_t, uint64_t>> copies;  // chunk, fence after its copy
  std::deque<std::pair<size_t, Future>> writes;    // chunk, write in flight
  size_t next = 0;
  std::exception_ptr error;
  // Takes the result of the oldest write (it must be complete, or this blocks).
  auto finish_write = [&] {
    const size_t index = writes.front().first;
    const Future write = std::move(writes.front().second);
    writes.pop_front();
    const IoResult r = write.Wait();
    result.io += r.stats;
    const Chunk& c = chunks[index];
    if (r.bytes != c.length) {  // the engine continues short writes: this would be a bug
      ThrowIoError(EIO, "bounce ring write (short)", file.path(), c.file_offset, c.length);
    }
    result.bytes += r.bytes;
  };
  try {
    for (;;) {
      while (!writes.empty() && writes.front().second.done()) finish_write();
      while (next < chunks.size() && copies.size() + writes.size() < n_slots) {
        const Chunk& c = chunks[next];
        copier.CopyFromDevice(SlotData(c), device_address + (c.file_offset - file_offset),
                              static_cast<size_t>(c.length));
        copies.emplace_back(next, copier.Record());
        ++next;
      }
      if (copies.empty()) {
        if (writes.empty()) break;  // then next == chunks.size(): all written
        finish_write();             // every slot holds a write in flight
        continue;
      }
      // Submit the write of every copy that is done, waiting for the oldest one at least.
      copier.Wait(copies.front().second);
      do {
        const Chunk& c = chunks[copies.front().first];
        writes.emplace_back(copies.front().first,
                            engine_.Write(file, SlotData(c), c.length, c.file_offset));
        ++result.chunks;
        copies.pop_front();
      } while (!copies.empty() && copier.Done(copies.front().second));
    }
  } catch (...) {
    error = std::current_exception();
  }
  if (error) {
    for (auto& [index, write] : writes) WaitQuietly(write);
    try {
      copier.Synchronize();
    } catch (...) {
    }
    std::rethrow_exception(error);
  }
  return result;
}

}  // namespace tensortier
