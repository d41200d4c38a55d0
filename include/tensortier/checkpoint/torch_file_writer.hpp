// Writes a torch.save zip file holding a plain dict {name: tensor} from front to back in large
// aligned writes: the pickle (SerializeTorchPickle), the records torch.save writes and each
// tensor's storage on a 4 KiB boundary, its CRC-32 computed as its bytes go by. Small tensors are
// gathered into the file's image in memory (one write per ~8 MiB, whatever their count); large
// ones held in memory are written straight from it. tensortier.save and `tensortier convert` both
// write .pt files of plain tensors through it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/checkpoint/zip_writer.hpp"

namespace tensortier {

// Where the tensors' bytes come from, tensor by tensor in order, each from its start to its end.
class TensorBytes {
 public:
  virtual ~TensorBytes() = default;
  // Copies the next `n` bytes of tensor `index` to `dst`. Calls go through the tensors in order
  // and through each tensor's bytes in order.
  virtual void Copy(size_t index, std::byte* dst, size_t n) = 0;
  // Tensor `index`'s bytes in memory that stays valid until the file is written, or nullptr:
  // large tensors with an address are written from there, not copied.
  virtual const std::byte* Address(size_t /*index*/) { return nullptr; }
};

// Host memory: tensor i's bytes at addresses[i] (alive until the file is written).
class HostTensorBytes : public TensorBytes {
 public:
  explicit HostTensorBytes(std::vector<const std::byte*> addresses)
      : addresses_(std::move(addresses)), done_(addresses_.size(), 0) {}
  void Copy(size_t index, std::byte* dst, size_t n) override;
  const std::byte* Address(size_t index) override { return addresses_[index]; }

 private:
  std::vector<const std::byte*> addresses_;
  std::vector<uint64_t> done_;
};

// A file: tensor i's bytes at [offsets[i], offsets[i] + nbytes[i]), offsets in increasing order
// and not overlapping (a safetensors data section). Read front to back in reads of kCheckpointGroupBytes, the next
// one in flight while the current one is copied out. A file that ends early is a FormatError.
class FileTensorBytes : public TensorBytes {
 public:
  FileTensorBytes(Engine& engine, const File& file, std::vector<uint64_t> offsets,
                  std::vector<uint64_t> nbytes);
  ~FileTensorBytes() override;
  FileTensorBytes(const FileTensorBytes&) = delete;
  FileTensorBytes& operator=(const FileTensorBytes&) = delete;
  void Copy(size_t index, std::byte* dst, size_t n) override;

 private:
  void Fetch(int slot, uint64_t offset);  // starts reading the chunk at `offset` into `slot`
  void Advance();                         // makes the next chunk current

  Engine& engine_;
  const File& file_;
  std::vector<uint64_t> offsets_;
  std::vector<uint64_t> done_;
  uint64_t end_ = 0;  // of the last tensor
  AlignedBuffer bufs_[2];
  Future pending_[2];
  uint64_t chunk_offset_[2] = {0, 0};
  uint64_t chunk_bytes_[2] = {0, 0};  // asked for
  int current_ = -1;                  // slot of the chunk being copied out, -1 before the first
};

struct TorchFileOptions {
  std::string folder = "archive";  // the records' folder (torch.save names it after the file)
  bool crc32 = true;               // record CRC-32s (torch.save's default); else 0 for each
};

// A torch.save zip file of a plain dict: `tensors[i]` (contiguous, alone in its storage, see
// TorchPickleTensor) has `nbytes[i]` bytes. The records are the ones `tensortier convert` writes:
// data.pkl, byteorder, data/<key> for each tensor, version, .data/serialization_id (not
// .format_version: torch.load would compute the records' offsets itself, assuming its own
// writer's layout). The constructor throws std::invalid_argument (SerializeTorchPickle's) for
// what a plain dict cannot hold, before anything is written.
class TorchFileWriter {
 public:
  TorchFileWriter(const std::vector<TorchPickleTensor>& tensors, std::vector<uint64_t> nbytes,
                  TorchFileOptions options = {});
  // The file's size.
  uint64_t size() const;
  // Writes the file to `out` (opened for the engine; reserved to size() or empty) with
  // `engine`, tensor bytes from `bytes`. IoError for I/O errors, after every write in flight
  // has finished. Once only.
  void Write(Engine& engine, const File& out, TensorBytes& bytes);

 private:
  std::string pickle_;
  std::vector<uint64_t> nbytes_;
  TorchFileOptions options_;
  ZipPlanner zip_;
  std::vector<size_t> storage_entries_;
};

}  // namespace tensortier
