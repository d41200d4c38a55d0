// The data files of torch.distributed.checkpoint (DCP) checkpoints: one per rank (and per writer
// thread, for torch's writer), each a run of items located by the (offset, length) pairs of the
// pickled `.metadata`. A tensor item is a torch.save zip of that one tensor, which torch's
// FileSystemReader loads with torch.load; a bytes item is a pickle of a non-tensor value.
//
// Files tensortier writes: items in the writer's order, each tensor's storage on a 4 KiB
// boundary of the file once it has 4 KiB or more (read with O_DIRECT, no bounce), smaller ones
// packed on 64-byte boundaries; zip CRC-32s left 0 (torch.save's set_crc32_options(False)), the
// xxh64 of each item's whole byte range going to the metadata instead. Reading accepts any
// torch.save zip of one tensor (torch's own writer's items included) and checks either the
// item's xxh64 or, without one, its zip CRC-32 as the bytes come in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"

namespace tensortier {

// One item to write: a tensor's contiguous bytes, or a bytes item (`dtype` empty).
struct DcpWriteItem {
  std::string dtype;  // tensortier's dtype name (dtypes.hpp); empty for a bytes item
  std::vector<uint64_t> shape;
  uint64_t nbytes = 0;
  // nbytes of host memory, alive until Write() returns; null: staged (WriteDcpFile's `stage`)
  const std::byte* src = nullptr;
  std::string name;  // for errors (the state dict key); "item <i>" when empty
};

// A tensor's data is also checksummed in blocks of this many bytes, counted from its first byte
// (the last block may be shorter): a load that reads part of the tensor checks every block it
// touches, reading the blocks whole. Runs narrower than a block cost the whole block (a column
// of a row-major matrix: a block of each row), so it is small; its sums, 8 bytes per block, go to
// the metadata (1/4096 of the data).
inline constexpr uint64_t kDcpBlockBytes = 32u << 10;

// The xxh64 of each kDcpBlockBytes block of `n` bytes at `data`, packed as little-endian 64-bit
// values (what _StorageInfo.xxh64_blocks holds); empty for n == 0.
std::string DcpBlockXxh64s(const std::byte* data, uint64_t n);

// Throws FormatError naming `where` (the file and item) and the first block whose sum in
// `actual` differs from `expected`'s (both packed, of the tensor data at `data_offset` of
// `data_length` bytes; `actual` holds the sums of blocks `first`, `first` + 1...), by its byte
// range in the file, and for an `expected` that is not one sum per block of the data.
void CheckDcpBlockXxh64s(const std::string& where, std::string_view expected, uint64_t first,
                         std::string_view actual, uint64_t data_offset, uint64_t data_length);

// Where an item lies in its file.
struct DcpItemPlace {
  uint64_t offset = 0;       // the item's first byte (what _StorageInfo.offset holds)
  uint64_t length = 0;       // _StorageInfo.length
  uint64_t data_offset = 0;  // the tensor's bytes (a bytes item: its offset)
  uint64_t xxh64 = 0;        // of [offset, offset + length), set by Write()
  std::string block_xxh64;   // a tensor's DcpBlockXxh64s, set by Write()
};

// The plan of one rank file: made from the items' sizes alone, before any byte is written.
class DcpFilePlan {
 public:
  // Throws std::invalid_argument naming the item (its name, else its index) for a dtype torch
  // cannot pickle as a plain tensor or a size that does not match its shape.
  explicit DcpFilePlan(std::vector<DcpWriteItem> items);

  uint64_t size() const { return size_; }
  uint64_t item_bytes(size_t i) const { return items_.at(i).nbytes; }
  const std::vector<DcpItemPlace>& places() const { return places_; }

  // Writes every item to `file` (reserved to size() or empty) with `engine`: large tensors
  // straight from their memory, everything else gathered into few large writes. Sets each place's
  // xxh64. Throws IoError after every write in flight has finished. Once only.
  void Write(Engine& engine, const File& file);

  // Write() of items `indices` only, item indices[k]'s bytes at srcs[k] (its src ignored): the
  // items of a file may be written in several calls, each item once. The file is not empty.
  void WriteItems(Engine& engine, const File& file, std::span<const size_t> indices,
                  std::span<const std::byte* const> srcs);

 private:
  std::vector<DcpWriteItem> items_;
  std::vector<DcpItemPlace> places_;
  std::vector<std::string> heads_;  // tensor items: the bytes before the data
  std::vector<std::string> tails_;  // ... and after it
  uint64_t size_ = 0;
};

// Where the bytes of items without a src come from (tensors in GPU memory, views to make
// contiguous): called with their indices, in order, in groups of about a staging budget; returns
// a host address of each one's bytes, valid until its next call or WriteDcpFile's return.
using DcpStageFn = std::function<std::vector<const std::byte*>(std::span<const size_t>)>;

// Writes `items` to a new file at `path` durably (DurableFile: a temporary name, fdatasync,
// rename, directory fsync) and returns their places. Throws IoError naming `who` (the writer,
// "rank 1"; may be empty), the step and `path` (not the temporary name, which is removed): a full
// disk leaves nothing behind. Items without a src are written from what `stage` gives, in groups
// of about `staging_bytes` (each written before the next is asked for: what is staged at once
// stays within the budget, not the state dict's size); the items in host memory first. `stage`'s
// errors propagate as they are, the temporary file removed.
std::vector<DcpItemPlace> WriteDcpFile(Engine& engine, const std::string& path,
                                       std::vector<DcpWriteItem> items, bool direct = true,
                                       const std::string& who = "",
                                       const DcpStageFn& stage = nullptr,
                                       uint64_t staging_bytes = kCheckpointStagingBytes);

// Opens the data file `path` that the metadata names for `items` (their names, for errors) to
// read them. Throws IoError naming the path and the first item (and how many more) when the file
// is missing or cannot be opened.
File OpenDcpDataFile(const std::string& path, std::span<const std::string> items, bool direct);

// A tensor item as stored: the one tensor torch.load gives back from the item's zip.
struct DcpTensorItem {
  std::string dtype;  // tensortier's dtype name of the storage's elements
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;
  int64_t storage_offset = 0;     // elements
  uint64_t data_offset = 0;       // absolute offset of the storage's bytes in the file
  uint64_t nbytes = 0;            // the storage's bytes
  std::optional<uint32_t> crc32;  // the storage's zip CRC-32, when the zip records them
  uint64_t bytes_read = 0;        // read from the file to find all this (zip records, pickle)
  bool conj = false;              // torch's conjugate bit: the values are the data's conjugates
  bool neg = false;               // torch's negative bit: the values are the data's negatives
  // Stored by torch's writer with serialization_format=SAFETENSORS: the data lies in the
  // safetensors section at the item's offset, not inside [offset, offset + length).
  bool safetensors = false;
};

// Reads the zip directory and pickle of the tensor item `name` at [offset, offset + length) of
// `file`. Throws FormatError naming the path, the item and its byte range: not a zip of exactly one
// tensor (a dict, a meta tensor, a big-endian file, a compressed entry), a range past the end of
// the file, or a tensor whose shape is not `expected_shape` (where given: the chunk sizes the
// metadata records for the item), naming both shapes.
//
// An item of torch's writer with serialization_format=SAFETENSORS is no zip: its offset is that of
// a safetensors section (header and data of all the file's tensors, which follows its bytes
// items), where the tensor named `fqn` is this item (a file holds one chunk of each tensor).
// Such an item is read from there (`fqn` given); FormatError where the section holds no `fqn`.
DcpTensorItem ReadDcpTensorItem(const File& file, const std::string& name, uint64_t offset,
                                uint64_t length,
                                const std::optional<std::vector<int64_t>>& expected_shape = {},
                                const std::string& fqn = "");
// The same, from the bytes of `whole` (the file, or what of it is in memory).
DcpTensorItem ReadDcpTensorItem(const ByteSource& whole, const std::string& name, uint64_t offset,
                                uint64_t length,
                                const std::optional<std::vector<int64_t>>& expected_shape,
                                const std::string& fqn);

// A part of a stored tensor (a contiguous tensor of `shape`, elements of `itemsize` bytes): the
// block at `offsets` of `lengths` along each dimension, which a load into another sharding needs.
struct DcpSlice {
  std::vector<int64_t> shape;
  uint64_t itemsize = 0;
  std::vector<int64_t> offsets;
  std::vector<int64_t> lengths;
};

// A contiguous run of a slice's bytes: `length` bytes at `offset` of the file go to byte
// `dest_offset` of the slice's contiguous copy (row-major, of shape `lengths`).
struct DcpRun {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t dest_offset = 0;
};

// The runs of the file that `slice` of the tensor whose data starts at `data_offset` selects, in
// the order of the slice's bytes: the innermost dimensions that the slice takes whole make one
// run, the outer ones repeat it. Throws FormatError naming `where` (the file and item) for a slice
// outside the tensor or offsets, lengths and shape of different ranks.
std::vector<DcpRun> DcpSliceRuns(const DcpSlice& slice, uint64_t data_offset,
                                 const std::string& where);

// One item to read: [offset, offset + length) of the file, of which [data_offset, data_offset +
// data_length) goes to `dest` (a bytes item: the whole range), or, with `slice`, only that part
// of the tensor stored at data_offset, as a contiguous tensor of its lengths: checked where
// `blocks` (the data's DcpBlockXxh64s) is given, by reading whole every block the part touches.
struct DcpRead {
  std::string name;  // for errors ("model.weight", chunk offsets...)
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t data_offset = 0;
  uint64_t data_length = 0;
  std::byte* dest = nullptr;
  std::optional<uint64_t> xxh64;  // of the whole range: checked when set
  std::optional<uint32_t> crc32;  // of the data: checked when set and xxh64 is not
  std::optional<DcpSlice> slice;  // read only this part (xxh64 and crc32 must be unset)
  std::string_view blocks;        // with `slice`: the data's block sums (unchecked when empty)
  // A bytes item without xxh64 (stock's: a torch.save zip of a pickled value): checked by its
  // zip records' CRC-32s (DcpZipRecordsProblem) once read.
  bool zip_records = false;
};

// A stock bytes item (`item`: a source of its bytes alone, a torch.save zip) checked by its zip
// records' CRC-32s: nullopt where there is nothing to check (bytes that are not a torch.save zip,
// whose first record is "<folder>/data.pkl": a planner's own, zips among them; a zip recording
// no CRC-32s, as torch.save's set_crc32_options(False) writes), "" where every stored record
// matches, else which does not. Throws FormatError for a torch.save zip whose directory is
// damaged.
std::optional<std::string> DcpZipRecordsProblem(const ByteSource& item);

// Bytes of a file already in memory: [offset, offset + bytes.size()) of it.
struct DcpHeldBytes {
  uint64_t offset = 0;
  std::span<const std::byte> bytes;
};

// The bytes at [offset, offset + length) in `held` (sorted by offset, disjoint), or nullptr where
// no one range holds them all.
const std::byte* FindDcpHeldBytes(std::span<const DcpHeldBytes> held, uint64_t offset,
                                  uint64_t length);

// Reads every item of `reads` from `file` with `engine` and checks it (xxh64 of the item, else
// CRC-32 of its data; a part: the sums of the blocks it touches). The byte ranges of all items
// are read sorted, those a page or less apart in one request, then the large ones (1 MiB or
// more) straight into their destination; an item checked whole is hashed piece by piece as its
// large data comes in, while the later pieces are read. Returns the bytes read from the file.
// Throws FormatError naming the file, the item and its byte range for a mismatch or a file that
// ends inside an item; IoError for I/O errors. Pieces that lie in one range of `held` are copied
// from it, not read.
uint64_t ReadDcpItems(Engine& engine, const File& file, std::span<const DcpRead> reads,
                      std::span<const DcpHeldBytes> held = {});

// Commits a DCP checkpoint whose data files are written: `metadata` (the pickled Metadata) goes to
// DIR/.metadata durably (temporary file, fdatasync, rename, directory fsync), which makes the new
// checkpoint the directory's; only then are the data files it does not name removed
// (RemoveUnreferencedDcpFiles). Returns how many went. Throws IoError naming `who` (may be
// empty), the step and DIR/.metadata: the old checkpoint stays whole, and the temporary file and
// the data files `referenced` (the new save's own: no other checkpoint may name them) are removed
// unless the new metadata was renamed into place. Commits into one directory take turns (an
// exclusive flock on DIR/.tensortier-dcp.lock); a data file of `referenced` that is gone (another
// save's commit removed it) throws IoError naming it before .metadata is touched.
size_t CommitDcpCheckpoint(Engine& engine, const std::string& dir, std::string_view metadata,
                           const std::vector<std::string>& referenced, const std::string& who = "");

// The data files of a DCP checkpoint directory `dir` that its new metadata does not name
// (`referenced`, relative paths): the files of the checkpoint the new one replaced, or of a save
// that died. Removes those ("__*.distcp"), an older save's rank-local metadata ("__N.metadata",
// which names such files) and the temporary files of dead processes' saves into
// the directory, then fsyncs it. Returns how many files went. Files it cannot remove are left.
size_t RemoveUnreferencedDcpFiles(const std::string& dir,
                                  const std::vector<std::string>& referenced);

// What `tensortier verify DIR` found in a DCP checkpoint directory.
struct DcpVerifyReport {
  uint64_t checked = 0;    // items whose xxh64 or zip CRC-32 was compared
  uint64_t unchecked = 0;  // items with neither (torch's bytes items; zips without CRC-32s)
  // Items torch's FileSystemWriter stored through stream transforms (its _extensions:
  // compression), which are not read.
  uint64_t transformed = 0;
  std::vector<std::string> problems;  // one sentence each; none: the checkpoint is sound
};

// Checks every item `metadata` (DIR/.metadata) names: its file exists and holds its byte range,
// its bytes match its xxh64 and its data its block sums (tensortier's checkpoints; the block rule
// of ReadDcpItems) or a tensor's data its zip CRC-32 (torch's). Problems are collected, not
// thrown, so one damaged item does not hide another.
DcpVerifyReport VerifyDcpCheckpoint(Engine& engine, const std::string& dir,
                                    const DcpMetadata& metadata);

}  // namespace tensortier
