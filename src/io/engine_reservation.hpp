// What the engine reserves before an operation's O_DIRECT writes that extend a file, and how it
// gives that back when the operation fails before writing. Internal to the engine.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"

namespace tensortier::detail {

// A range ReserveExtendingWrites asked the filesystem for: what to give back if the operation
// fails before any byte of it is written (see GiveBackPartialReservation).
struct Reservation {
  const File* file;
  uint64_t keep;  // the file's size before, or the piece's offset past it
  uint64_t end;   // the piece's end
};

// Gives back `reserved`, latest first: each piece then finds the size its own reservation left,
// and the file ends at the size it had before the operation (or at a piece's offset past it).
void GiveBackReservations(const std::vector<Reservation>& reserved) noexcept;

// O_DIRECT writes past end of file are serialised by the filesystem (ext4 and XFS take the inode
// lock to update the size), which halves sequential write speed. Reserving the range first
// (fallocate mode 0 also moves the size) makes the writes non-extending and fully parallel, and
// reports ENOSPC before any byte is written. Holes before the range stay holes. Each range asked
// for is added to `reserved` (the refused one included: it may have kept what fit), so that a
// failure of the operation before it writes gives all of them back, not only the refused one.
void ReserveExtendingWrites(std::span<const IoDesc> pieces, std::vector<Reservation>& reserved);

}  // namespace tensortier::detail
