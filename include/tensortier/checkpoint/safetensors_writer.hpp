// Writes a safetensors file the way tensortier.save does: the layout planned once
// (PlanSafetensorsLayout), a header padded so the data starts on a 4 KiB boundary, optional
// checksum metadata of fixed length (so the header is written last, once the tensors' xxh64s are
// known), small tensors gathered into large writes and large ones written from their own memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"

namespace tensortier {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;            // tensortier's dtype name (dtypes.hpp)
  std::vector<uint64_t> shape;  // as torch holds it (a packed dtype's last dimension in elements)
  uint64_t nbytes = 0;
};

// Not thread-safe.
class SafetensorsFileWriter {
 public:
  // Plans the file of `tensors` (in this order in its header) and `metadata` ({"format": "pt"}
  // added unless given: transformers expects it); with `checksum`, the xxh64 of every tensor and
  // of the header (SetChecksumMetadata). Throws std::invalid_argument for a dtype safetensors
  // cannot store, metadata naming tensortier's checksum keys, a 0-dimensional packed tensor,
  // and FormatError for what a header cannot hold (a name given twice...).
  SafetensorsFileWriter(std::vector<SafetensorsTensor> tensors, SafetensorsMetadata metadata,
                        bool checksum);

  uint64_t size() const { return data_start_ + data_bytes_; }
  uint64_t data_start() const { return data_start_; }
  size_t tensors() const { return entries_.size(); }
  size_t tensors_left() const { return left_; }

  // Writes tensors `indices` to `out` from host memory `addresses` (alive until this returns),
  // each tensor once, in any order and over any number of calls: pieces smaller than 1 MiB that
  // meet in the file through staging buffers (WriteGathered), the others from their memory,
  // their xxh64s computed meanwhile. Throws IoError, after every write in flight has finished.
  void WriteTensors(Engine& engine, const File& out, const std::vector<size_t>& indices,
                    const std::vector<const std::byte*>& addresses);
  // Writes the header, once every tensor has been written.
  void WriteHeader(Engine& engine, const File& out);

 private:
  std::vector<SafetensorsEntry> entries_;
  SafetensorsMetadata metadata_;
  std::string header_;  // with zeros for the checksums until WriteHeader
  bool checksum_;
  std::vector<uint64_t> sums_;
  std::vector<bool> written_;
  size_t left_ = 0;
  uint64_t data_start_ = 0;
  uint64_t data_bytes_ = 0;
};

}  // namespace tensortier
