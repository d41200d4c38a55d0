#include "tensortier/io/engine_reservation.hpp"

#include <algorithm>
#include <cerrno>
#include <unordered_map>

#include "tensortier/util/error.hpp"

namespace tensortier::detail {

namespace {

// A refused fallocate may have kept what fit: ext4 allocates up to the full filesystem and moves
// the size there before it says ENOSPC, which left a write that moved no byte holding the space.
// The file goes back to `keep` (its size before, or the write's offset past it) while its size
// still lies within the range [keep, end): anything below the write's offset may have been
// reserved since by a concurrent write. A size beyond the range (a later piece of the operation
// past a gap kept it there, or another operation moved it) cannot come back: the range's blocks
// are given back instead, the size staying. Best effort: the refusal is the error to report,
// whatever happens here.
void GiveBackPartialReservation(const File& file, uint64_t keep, uint64_t end) noexcept {
  try {
    const uint64_t now = file.Size();
    if (now > keep && now <= end) {
      file.Truncate(keep);
    } else if (now > end) {
      file.PunchHole(keep, end - keep);
    }
  } catch (...) {  // the refusal is what the caller hears about
  }
}

}  // namespace

void GiveBackReservations(const std::vector<Reservation>& reserved) noexcept {
  for (auto it = reserved.rbegin(); it != reserved.rend(); ++it) {
    GiveBackPartialReservation(*it->file, it->keep, it->end);
  }
}

void ReserveExtendingWrites(std::span<const IoDesc> pieces, std::vector<Reservation>& reserved) {
  std::unordered_map<int, uint64_t> sizes;  // one fstat per file, not per piece
  for (const IoDesc& piece : pieces) {
    if (piece.length == 0 || !piece.file.direct()) continue;
    const uint64_t end = piece.offset + piece.length;
    auto [size, inserted] = sizes.try_emplace(piece.file.buffered_fd(), 0);
    if (inserted) size->second = piece.file.Size();
    if (end <= size->second) continue;
    reserved.push_back({&piece.file, std::max(size->second, piece.offset), end});
    try {
      piece.file.Allocate(piece.offset, piece.length);
      size->second = end;  // fallocate mode 0 moved the size
    } catch (const IoError& e) {
      // A filesystem without fallocate still takes plain writes; real failures are reported.
      if (e.error_code() != EOPNOTSUPP && e.error_code() != ENOSYS) throw;
      reserved.pop_back();  // nothing was reserved
    }
  }
}

}  // namespace tensortier::detail
