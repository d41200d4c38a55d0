// The rank file a DCP load reads from, read in two steps: the zip records of its tensor items
// (which decide where each item's data goes), then the data. The bytes of its small items are
// read once, in few large requests, and serve both steps: a rank of thousands of small tensors
// reads each byte of its file once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tensortier/checkpoint/dcp_file.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"

namespace tensortier {

// Items a load reads whole (of under 1 MiB) no more than this many bytes apart in the file share a
// request; the bytes between them are read and dropped.
inline constexpr uint64_t kDcpCoalesceGap = 4096;
// The most bytes of small items held in memory between the two steps; the items past it are read
// as large ones are (records, then data).
inline constexpr uint64_t kDcpHeldBytes = 256u << 20;

// What a load checks of what it reads: nothing; each item read whole by its xxh64 (else its zip
// CRC-32) and each part by the block sums of the blocks it touches; or every item, read whole.
enum class DcpVerify { kNone, kRead, kFull };

// How a load reads a stored item: a bytes item or a tensor not stored as one contiguous run, whole
// (kWhole); the one request for all of a contiguous tensor, whole, perhaps straight into its
// target (kDirect); else only the elements each request selects (kParts: DcpSlice).
enum class DcpItemRead { kWhole, kDirect, kParts };

class DcpFileReads {
 public:
  // A block of a stored tensor a load asks for: its offsets and lengths per dimension.
  struct Request {
    std::vector<int64_t> offsets;
    std::vector<int64_t> lengths;
  };
  struct Item {
    std::string name;  // for errors
    uint64_t offset = 0;
    uint64_t length = 0;
    bool tensor = false;  // a tensor item, whose zip records are read (else a bytes item)
    bool whole = false;   // the load reads all of it (only such items are held): see below
    std::optional<std::vector<int64_t>> expected_shape;  // ReadDcpTensorItem's
    std::string fqn;                                     // ReadDcpTensorItem's
    std::vector<Request> requests;                       // of a tensor item
    std::optional<uint64_t> xxh64;                       // of [offset, +length), where recorded
    std::string blocks;  // the tensor's data's block sums (DcpBlockXxh64s), where recorded
  };

  // Opens `path` (OpenDcpDataFile, naming the first item), reads the small items' bytes and the
  // records of each tensor item (ReadDcpTensorItem's rules and errors). An item is read whole
  // where `whole` is set, it is a bytes item, `verify` is kFull, or its one request asks for all of
  // its expected_shape.
  DcpFileReads(Engine& engine, const std::string& path, std::span<const Item> items,
               DcpVerify verify = DcpVerify::kRead);

  // The tensor items' layouts, in the order of `items`.
  const std::vector<DcpTensorItem>& tensors() const { return tensors_; }
  // Item i's layout, or nullptr for a bytes item.
  const DcpTensorItem* tensor(size_t i) const {
    return tensor_of_[i] < 0 ? nullptr : &tensors_[static_cast<size_t>(tensor_of_[i])];
  }
  // How many items there are.
  size_t size() const { return how_.size(); }
  // How item i is read.
  DcpItemRead how(size_t i) const { return how_[i]; }
  // The read of item i into `dest`: all of its data (of a tensor, its storage's bytes), checked as
  // `verify` says, or, with `part`, the block its request `part` selects (kParts items only).
  DcpRead ReadOf(size_t i, std::optional<size_t> part, std::byte* dest) const;
  // The bytes the constructor read from the file.
  uint64_t bytes_read() const { return bytes_read_; }
  // ReadDcpItems on the file, the pieces inside the held bytes copied from them. Returns the
  // bytes it read from the file.
  uint64_t Read(Engine& engine, std::span<const DcpRead> reads) const;

 private:
  File file_;
  std::vector<Item> items_;
  DcpVerify verify_;
  std::vector<int64_t> tensor_of_;  // item -> index in tensors_, -1 for bytes items
  std::vector<DcpItemRead> how_;
  std::vector<std::unique_ptr<std::byte[]>> buffers_;
  std::vector<DcpHeldBytes> held_;  // sorted by offset, disjoint
  std::vector<DcpTensorItem> tensors_;
  uint64_t bytes_read_ = 0;
};

}  // namespace tensortier
