// The checkpoint pipeline: every read, check and rewrite of a checkpoint file goes through these
// steps, whoever asks (tensortier.save/load, `tensortier info|verify|convert`).
//   plan:    what a file holds (CheckpointLayout: each tensor's bytes, byte order), and what a new
//            file will hold (PlanSafetensorsLayout: offsets; checksum metadata; packed shapes).
//   stream:  tensor bytes moved by the engine in groups of kCheckpointGroupBytes through two
//            buffers (StreamRange), checked as they pass (xxh64, CRC-32).
//   commit:  the new file made durable (DurableFile, checkpoint_file.hpp).
//   convert: the three above from one format to the other (ConvertCheckpoint).
// A writer of many items into one file plans the whole file first (offsets and a fixed-length
// header), streams each item's bytes to its offset in any order, then writes the header and
// commits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensortier/checkpoint/checkpoint_format.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/util/aligned_buffer.hpp"

namespace tensortier {

// The bytes one streamed read (or group of tensor reads) covers: progress, checksums and device
// copies of one group overlap the reads of the next. The one setting for every reader.
inline constexpr uint64_t kCheckpointGroupBytes = 64u << 20;

// Tensors smaller than this are read gathered (pieces close together share one large request
// through a staging buffer) and allocated as any tensor; larger ones are read on their own and
// allocated at their file offset modulo the page size, so that O_DIRECT needs no bounce copy.
inline constexpr uint64_t kCheckpointGatherBelow = 1u << 20;

// The host copies a save makes of tensors it cannot write from where they are (GPU memory,
// views that are not contiguous): at most about this many bytes of them are alive at once.
inline constexpr uint64_t kCheckpointStagingBytes = 256u << 20;

// The alignment of tensor data in the files tensortier writes.
inline constexpr uint64_t kCheckpointAlignment = 4096;

// ---- plan: what a file holds ------------------------------------------------------------------

// One tensor's bytes in a checkpoint file.
struct CheckpointItem {
  std::string name;
  std::string dtype;  // tensortier's dtype name (dtypes.hpp)
  std::vector<uint64_t> shape;
  uint64_t offset = 0;  // absolute file offset of the first byte
  uint64_t nbytes = 0;
  // A big-endian torch file's tensor: the width of the units whose bytes to reverse for this
  // machine's order (0: none). torch.load swaps by the storage's type, each half of a complex
  // number on its own; untyped storages (_rebuild_tensor_v3) it leaves as they are.
  unsigned swap_width = 0;
  // ... and its bytes do not start and end on those units (a view as a dtype of another size,
  // which torch.save never writes): a stream cannot swap them.
  bool swap_misaligned = false;
  bool meta = false;  // a torch meta tensor: no data in the file (offset and nbytes 0)
};

struct CheckpointLayout {
  CheckpointFormat format = CheckpointFormat::kSafetensors;
  std::vector<CheckpointItem> items;  // safetensors: file order; torch: pickle order
  SafetensorsFileInfo st;             // safetensors files
  TorchCheckpoint torch;              // torch.save files
};

// Reads and validates the headers of the checkpoint file at `path` (every zip entry of a torch
// file must be stored). `opaque_objects`: as ParseTorchPickle's (tensortier info and verify).
// Throws FormatError naming the path (a shard index is one), IoError.
CheckpointLayout ReadCheckpointLayout(const std::string& path, bool opaque_objects = false);

// The largest power of two (up to kCheckpointAlignment) dividing every non-empty tensor's offset.
uint64_t DataAlignment(const std::vector<CheckpointItem>& items);

// One sentence for each of `names` (tensors a shard index puts in the file) the file lacks.
std::vector<std::string> MissingTensorProblems(const CheckpointLayout& layout,
                                               const std::vector<std::string>& names);

// ---- plan: byte order -------------------------------------------------------------------------

// The width of the units torch.load reverses in a big-endian storage of dtype `storage_dtype`
// (tensortier's name): the element size, a complex number's half; 0 for bytes and untyped data.
unsigned BigEndianSwapWidth(std::string_view storage_dtype);

// Reverses the bytes of each `width`-byte unit of p[0, n) (n a multiple of width).
void ReverseUnits(std::byte* p, size_t n, unsigned width) noexcept;

// ---- plan: what a new file holds --------------------------------------------------------------

// The offset (relative to the data section) of each of a safetensors file's tensors, of `sizes`
// bytes and elements of `widths` bytes: the one layout rule of every safetensors writer. The
// format allows no gaps, so tensors whose size is a multiple of kCheckpointAlignment go first
// (each starting aligned, read with direct I/O and no bounce copy); the rest follow, widest
// elements first (in their order otherwise), so every tensor stays naturally aligned.
std::vector<uint64_t> PlanSafetensorsLayout(const std::vector<uint64_t>& sizes,
                                            const std::vector<unsigned>& widths);

// The kTensorChecksumsKey value: a JSON object of name -> 16 hex digits, in `sums`' order.
std::string TensorChecksumsJson(const std::vector<std::pair<std::string, uint64_t>>& sums);

// Sets `metadata`'s checksum keys for a file of `entries`: kTensorChecksumsKey from `sums`, then
// kHeaderChecksumKey (SafetensorsHeaderDigest). Both have fixed lengths: a header planned with
// zeros for sums keeps its size once the real ones are known.
void SetChecksumMetadata(const std::vector<SafetensorsEntry>& entries,
                         const std::vector<std::pair<std::string, uint64_t>>& sums,
                         SafetensorsMetadata& metadata);

// The safetensors shape of a tensor of dtype `dtype` (tensortier's name) and torch shape `shape`:
// a packed dtype (F4_X2) counts its last dimension in elements of several safetensors values.
// Throws std::invalid_argument naming the tensor where there is no such shape (a scalar).
std::vector<uint64_t> SafetensorsShape(std::string_view name, std::string_view dtype,
                                       std::vector<uint64_t> shape);

// The torch shape of a safetensors tensor of safetensors dtype `st_dtype` and `shape` (the inverse
// of SafetensorsShape). Throws std::invalid_argument naming the tensor when the last dimension
// is not a multiple of the values one torch element packs.
std::vector<uint64_t> TorchShape(std::string_view name, std::string_view st_dtype,
                                 std::vector<uint64_t> shape);

// ---- stream -----------------------------------------------------------------------------------

// Two buffers of kCheckpointGroupBytes, or of `largest` bytes (the longest range to stream) where
// that is less: the engine fills one while the other is consumed. Made before the engine that
// reads into them (its destructor waits for reads still in flight).
struct StreamBuffers {
  explicit StreamBuffers(uint64_t largest = kCheckpointGroupBytes);
  uint64_t size;
  AlignedBuffer bufs[2];
};

// Streams [offset, offset+length) of `file` through `buffers`, calling `consume` on each group
// in order while the next one is read. A file that ends early is a FormatError.
void StreamRange(Engine& engine, const File& file, uint64_t offset, uint64_t length,
                 StreamBuffers& buffers, const std::function<void(std::byte*, size_t)>& consume);

// One drawing of the progress bar of a long transfer (tensortier.load's and the CLI's):
// "\rLABEL [####      ]  42.0% 0.50/1.20 GiB 1.23 GB/s", 30 characters of bar, the rate from
// `seconds` since the start. The caller writes it (Python through sys.stderr).
std::string ProgressLine(std::string_view label, uint64_t done, uint64_t total, double seconds);

// ---- checks -----------------------------------------------------------------------------------

// What a safetensors file's own checksums (tensortier.save(..., checksum=True)) say: the xxh64
// each tensor's bytes must have, and what is wrong with the checksums themselves (a header that
// no longer matches its checksum, a tensor without one...).
struct SafetensorsChecks {
  bool present = false;         // the file has per-tensor checksums
  bool header_checked = false;  // the file has a header checksum, compared
  std::vector<std::string> problems;
  std::vector<std::optional<uint64_t>> want;  // per item: its xxh64, if it has a usable one
};
SafetensorsChecks ReadSafetensorsChecks(const CheckpointLayout& layout);

// What is wrong with a safetensors header against its own checksum, where it has one: a
// checksum that is not 16 hex digits, or does not match; where it has none, a tensortier.* key
// tensortier does not write (its key's name damaged). nullopt when it matches or there is none
// (files from other writers pass: their data checksums still count). verify reports it, and
// load(verify=True) raises it (CheckSafetensorsHeaderChecksum: FormatError naming `path`).
std::optional<std::string> HeaderChecksumProblem(const SafetensorsHeader& header);
void CheckSafetensorsHeaderChecksum(const std::string& path, const SafetensorsHeader& header);

// torch.save with set_crc32_options(False) records 0 for every entry: nothing to check against.
bool RecordsCrcs(const ZipDirectory& zip);

// The CRC-32 of zip entry `e` of `torch`'s file: data.pkl's from the read that parsed it, any
// other's streamed from `file`.
uint32_t ZipEntryCrc(Engine& engine, const File& file, const TorchCheckpoint& torch,
                     const ZipEntry& e, StreamBuffers& buffers);

// ChecksumMismatch (piece_reader.hpp) of a tensor's or a zip entry's bytes.
std::string XxhMismatch(const std::string& name, uint64_t stored, uint64_t actual);
std::string CrcMismatch(const ZipEntry& e, uint32_t actual);

// What `tensortier verify` found in a file whose layout was read.
struct VerifyReport {
  uint64_t checked = 0;               // tensor checksums or zip entry CRC-32s compared
  bool header_checked = false;        // safetensors: the header checksum compared
  bool header_unsumed = false;        // safetensors with data checksums but no header checksum
  std::vector<std::string> problems;  // one sentence each; none: the file is sound
};

// Checks every byte of the file at `path` (laid out as `layout`) against its checksums: a
// safetensors file's xxh64s, a torch file's CRC-32s. A file without checksums is a problem (it
// cannot be verified), as for tensortier.load(verify=True). `names`: tensors a shard index puts
// in the file (a missing one is a problem). Throws IoError, FormatError (truncation).
VerifyReport VerifyCheckpointData(const std::string& path, const CheckpointLayout& layout,
                                  const std::vector<std::string>& names = {});

// ---- convert ----------------------------------------------------------------------------------

struct ConvertReport {
  CheckpointFormat written = CheckpointFormat::kSafetensors;
  size_t tensors = 0;
  uint64_t data_bytes = 0;
  uint64_t data_start = 0;      // safetensors written: the data section's offset
  std::string folder;           // torch written: the archive's folder
  uint64_t dropped_values = 0;  // torch read: non-tensor values safetensors cannot hold
  size_t dropped_metadata = 0;  // safetensors read: metadata keys torch.load does not return
  bool unchecked = false;       // the input had no checksums: its data was not checked
};

// Writes the checkpoint file `in` in the other format to `out` (durably, replacing it), checking
// the input's checksums as its bytes pass: a damaged file is refused before `out` is touched.
// Refuses a shard index, an `out` that is `in` or whose suffix names `in`'s format
// (std::invalid_argument), what the other format cannot hold (FormatError naming `in`).
ConvertReport ConvertCheckpoint(const std::string& in, const std::string& out);

}  // namespace tensortier
