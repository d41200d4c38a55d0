// Writes a torch.save zip file from front to back in large aligned writes: the pickle (torch's,
// or SerializeTorchPickle's for a plain dict {name: tensor}), the records torch.save writes and
// each storage on a 4 KiB boundary, its CRC-32 computed as its bytes go by. Small storages are
// gathered into the file's image in memory (one write per ~8 MiB, whatever their count); large
// ones held in memory are written straight from it. Every .pt file tensortier.save and
// `tensortier convert` write goes through it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/checkpoint/zip_writer.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/aligned_buffer.hpp"

namespace tensortier {

// Where the tensors' bytes come from, tensor by tensor in order, each from its start to its end.
class TensorBytes {
 public:
  virtual ~TensorBytes() = default;
  // Copies the next `n` bytes of tensor `index` to `dst`. Calls go through the tensors in order
  // and through each tensor's bytes in order.
  virtual void Copy(size_t index, std::byte* dst, size_t n) = 0;
  // Tensor `index`'s bytes in memory that stays valid until the call writing them returns, or
  // nullptr: large tensors with an address are written from there, not copied.
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
// and not overlapping (a safetensors data section). Read front to back in reads of
// kCheckpointGroupBytes, the next one in flight while the current one is copied out. A file that
// ends early is a FormatError.
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

class TorchImageWriter;  // the file's image as it is written (torch_file_writer.cpp)

// A torch.save zip file: data.pkl (the pickle), byteorder, data/<key> for each storage (keys
// "0", "1"... in order, each 4 KiB aligned), version, .data/serialization_id: the records
// tensortier.save and `tensortier convert` write. No .format_version: torch.load would compute
// the records' offsets itself, assuming its own writer's layout.
class TorchFileWriter {
 public:
  // A plain dict: `tensors[i]` (contiguous, alone in its storage, see TorchPickleTensor) has
  // `nbytes[i]` bytes; the pickle is SerializeTorchPickle's. Throws std::invalid_argument for
  // what a plain dict cannot hold, before anything is written.
  TorchFileWriter(const std::vector<TorchPickleTensor>& tensors, std::vector<uint64_t> nbytes,
                  TorchFileOptions options = {});
  // Any object: `pickle` is the data.pkl torch's pickler wrote, whose persistent ids name
  // storages "0" ... "n-1" of `nbytes[0..n)` bytes.
  TorchFileWriter(std::string pickle, std::vector<uint64_t> nbytes, TorchFileOptions options = {});
  ~TorchFileWriter();
  TorchFileWriter(const TorchFileWriter&) = delete;
  TorchFileWriter& operator=(const TorchFileWriter&) = delete;

  // The file's size.
  uint64_t size() const;
  // Writes the file to `out` (opened for the engine; reserved to size() or empty) with
  // `engine`, storage bytes from `bytes`. IoError for I/O errors, after every write in flight
  // has finished. Once only.
  void Write(Engine& engine, const File& out, TensorBytes& bytes);

  // Write() in steps, for storages whose bytes are staged a few at a time: Begin() writes the
  // records before the storages; each WriteStorages() the next `count` storages (from `bytes`,
  // indexed from 0 for the first of them), returning once it no longer reads their memory;
  // End() the records after them, waiting for every write. `engine` and `out` stay alive until
  // End() or Abandon() returns, or the writer goes. After an exception, the writer is done and
  // has no write in flight.
  void Begin(Engine& engine, const File& out);
  void WriteStorages(TensorBytes& bytes, size_t count);
  void End();
  // Waits for the writes in flight: a caller failing between steps calls it before `out` goes.
  // The writer is done.
  void Abandon() noexcept;
  // Storages written so far.
  size_t storages_written() const { return next_storage_; }
  size_t storages() const { return nbytes_.size(); }

 private:
  void AddRecords();
  // `release`: wait for the writes from `bytes`' memory before returning.
  void WriteStorages(TensorBytes& bytes, size_t count, bool release);

  std::string pickle_;
  std::vector<uint64_t> nbytes_;
  std::vector<std::string> keys_;
  TorchFileOptions options_;
  ZipPlanner zip_;
  std::vector<size_t> storage_entries_;
  std::unique_ptr<TorchImageWriter> image_;
  size_t next_storage_ = 0;
  size_t next_entry_ = 0;
};

}  // namespace tensortier
