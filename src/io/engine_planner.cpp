#include "tensortier/io/engine_planner.hpp"

#include <algorithm>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/page_cache.hpp"

namespace tensortier {
namespace detail {

namespace {

std::unique_ptr<Task> MakeTask(const std::shared_ptr<Operation>& op, uint32_t piece, int fd,
                               bool direct, uint64_t offset, uint64_t length, std::byte* user,
                               bool needs_bounce) {
  auto t = std::make_unique<Task>();
  t->op = op;
  t->piece = piece;
  t->fd = fd;
  t->direct = direct;
  t->needs_bounce = needs_bounce;
  t->offset = offset;
  t->length = length;
  t->user = user;
  t->charged = length;
  return t;
}

}  // namespace

Planner::Planner(const EngineOptions& options, const SubmitOptions& submit,
                 const std::shared_ptr<Operation>& op, std::vector<std::unique_ptr<Task>>& tasks)
    : options_(options),
      stage_reads_(submit.stage_reads && op->op == IoOp::kRead &&
                   options.stage_reads != ReadStaging::kOff),
      op_(op),
      tasks_(tasks),
      stats_(op->result.stats) {}

void Planner::Plan(uint32_t index) {
  const IoDesc& piece = op_->pieces[index];
  const File& file = piece.file;
  auto* user = static_cast<std::byte*>(piece.buf);
  stats_.requested_bytes += piece.length;
  if (piece.length == 0) return;
  if (!file.direct()) {
    stats_.direct_fallback |= !file.direct_fallback_reason().empty();
    Buffered(index, piece.offset, piece.length, user);
    return;
  }
  // Writes go direct only in whole pages. A buffered write of part of a page reads the rest of
  // the page into the cache; if a direct write lands on that rest meanwhile, writeback of the
  // stale page overwrites it (the kernel cannot invalidate a dirty page). Whole pages keep
  // buffered and direct writes, of this operation or of any other, on separate pages.
  const uint64_t align = op_->op == IoOp::kWrite
                             ? std::max<uint64_t>(file.offset_alignment(), SystemPageSize())
                             : file.offset_alignment();
  const uint64_t end = piece.offset + piece.length;
  // A direct read of the block holding end of file lets the kernel fill the whole block, zeroing
  // the caller's bytes past EOF. Reads stop going direct at the last whole block before EOF; the
  // rest goes through the page cache, which copies only what exists (and sees a file that grew).
  uint64_t direct_end = end;
  if (op_->op == IoOp::kRead && !piece.may_fill_past_eof) {
    direct_end = std::min(end, std::max(piece.offset, SizeOf(file)));
  }
  const uint64_t mid_begin = AlignUp(piece.offset, align);
  const uint64_t mid_end = AlignDown(direct_end, align);
  if (mid_begin >= mid_end) {  // smaller than one aligned block: the page cache does it exactly
    Buffered(index, piece.offset, piece.length, user);
    return;
  }
  Buffered(index, piece.offset, mid_begin - piece.offset, user);
  Direct(index, mid_begin, mid_end - mid_begin, user + (mid_begin - piece.offset));
  Buffered(index, mid_end, end - mid_end, user + (mid_end - piece.offset));
}

void Planner::Buffered(uint32_t index, uint64_t offset, uint64_t length, std::byte* user) {
  const int fd = op_->pieces[index].file.buffered_fd();
  for (uint64_t done = 0; done < length;) {
    uint64_t n = std::min(length - done, options_.chunk_size);
    tasks_.push_back(MakeTask(op_, index, fd, false, offset + done, n, user + done, false));
    done += n;
  }
  stats_.buffered_bytes += length;
}

void Planner::Direct(uint32_t index, uint64_t offset, uint64_t length, std::byte* user) {
  const File& file = op_->pieces[index].file;
  const uint64_t chunk = AlignUp(options_.chunk_size, file.offset_alignment());
  // Resident chunks are read through the page cache. One query for the whole range first: the
  // common cases (nothing or everything cached) need no per-chunk queries.
  Residency whole;
  const bool check =
      op_->op == IoOp::kRead && options_.page_cache_check && MayHaveCachedPages(file);
  if (check) {
    whole = QueryResidency(file.buffered_fd(), offset, length);
    stats_.residency_method = ResidencyMethodName(whole.method);
  }
  const bool all_cached =
      check && whole.checked_bytes > 0 && whole.resident_bytes == whole.checked_bytes;
  const bool some_cached = check && whole.resident_bytes > 0;
  const bool stage = Stages(file);
  for (uint64_t done = 0; done < length;) {
    uint64_t n = std::min(length - done, chunk);
    bool cached = all_cached;
    if (some_cached && !all_cached) {
      Residency r = QueryResidency(file.buffered_fd(), offset + done, n, whole.method);
      cached = r.checked_bytes > 0 && r.resident_bytes * 2 >= r.checked_bytes;
    }
    if (cached) {
      tasks_.push_back(
          MakeTask(op_, index, file.buffered_fd(), false, offset + done, n, user + done, false));
      stats_.buffered_bytes += n;
      stats_.cached_bytes += n;
    } else {
      const bool aligned = IsAligned(user + done, file.memory_alignment());
      const bool bounce = !aligned || (stage && StagesInto(user + done, n));
      tasks_.push_back(
          MakeTask(op_, index, file.direct_fd(), true, offset + done, n, user + done, bounce));
      // The budget bounds memory in flight: a bounced piece holds a whole bounce buffer (at
      // least chunk_size), however few of its bytes it moves. Charged by length, a batch of
      // small unaligned pieces made one buffer per request slot, twice the budget.
      if (bounce) tasks_.back()->charged = std::max(n, options_.chunk_size);
      tasks_.back()->bounced = bounce;
      if (op_->op == IoOp::kRead && op_->pieces[index].may_fill_past_eof) {
        tasks_.back()->eof_block_size = SizeOf(file);
      }
      stats_.direct_bytes += n;
      if (bounce) stats_.bounced_bytes += n;
      if (aligned && bounce) stats_.staged_bytes += n;
    }
    done += n;
  }
}

bool Planner::MayHaveCachedPages(const File& file) {
  if (op_->pieces.size() < 2 || ResidencyMethodInUse() != ResidencyMethod::kCachestat) {
    return true;
  }
  const int fd = file.buffered_fd();
  auto [it, inserted] = file_may_be_cached_.try_emplace(fd, true);
  if (inserted) {
    uint64_t begin = UINT64_MAX;
    uint64_t end = 0;
    for (const IoDesc& piece : op_->pieces) {
      if (piece.length == 0 || piece.file.buffered_fd() != fd) continue;
      begin = std::min(begin, piece.offset);
      end = std::max(end, piece.offset + piece.length);
    }
    Residency r = QueryResidency(fd, begin, end - begin, ResidencyMethod::kCachestat);
    it->second = r.method == ResidencyMethod::kUnknown || r.resident_bytes > 0;
    if (!it->second) stats_.residency_method = ResidencyMethodName(r.method);
  }
  return it->second;
}

bool Planner::StagesInto(const std::byte* user, uint64_t length) const {
  if (options_.stage_reads == ReadStaging::kOn || options_.copy_threads > 0) return true;
  return ResidentMemoryBytes(user, length) * 2 >= length;
}

uint64_t Planner::SizeOf(const File& file) {
  auto [it, inserted] = file_size_.try_emplace(file.buffered_fd(), 0);
  if (inserted) it->second = file.Size();
  return it->second;
}

}  // namespace detail

bool StagesReads(const EngineOptions& options, const File& file) {
  switch (options.stage_reads) {
    case ReadStaging::kOff:
      return false;
    case ReadStaging::kOn:
      return true;
    case ReadStaging::kAuto:
      break;
  }
  const auto& limits = file.block_queue_limits();
  return limits && ScatteredMemorySplitsRequests(*limits, options.chunk_size) &&
         GetsHugePages(options.chunk_size, Pages::kReused);
}

}  // namespace tensortier
