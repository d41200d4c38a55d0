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

class DcpFileReads {
 public:
  struct Item {
    std::string name;  // for errors
    uint64_t offset = 0;
    uint64_t length = 0;
    bool tensor = false;  // a tensor item, whose zip records are read (else a bytes item)
    bool whole = false;   // the load reads all of it (only such items are held)
    std::optional<std::vector<int64_t>> expected_shape;  // ReadDcpTensorItem's
    std::string fqn;                                     // ReadDcpTensorItem's
  };

  // Opens `path` (OpenDcpDataFile, naming the first item), reads the small items' bytes and the
  // records of each tensor item (ReadDcpTensorItem's rules and errors).
  DcpFileReads(Engine& engine, const std::string& path, std::span<const Item> items);

  // The tensor items' layouts, in the order of `items`.
  const std::vector<DcpTensorItem>& tensors() const { return tensors_; }
  // The bytes the constructor read from the file.
  uint64_t bytes_read() const { return bytes_read_; }
  // ReadDcpItems on the file, the pieces inside the held bytes copied from them. Returns the
  // bytes it read from the file.
  uint64_t Read(Engine& engine, std::span<const DcpRead> reads) const;

 private:
  File file_;
  std::vector<std::unique_ptr<std::byte[]>> buffers_;
  std::vector<DcpHeldBytes> held_;  // sorted by offset, disjoint
  std::vector<DcpTensorItem> tensors_;
  uint64_t bytes_read_ = 0;
};

}  // namespace tensortier
