// A load's stream step: the pieces of one checkpoint file (tensors, storage records) read into
// memory of the caller's and checked against their stored checksums as the bytes arrive. Every
// load reads through here (tensortier.load, load_into, their CUDA staging through pinned memory),
// so a checksum is computed and compared in one place and its mismatch worded once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/io/file.hpp"

namespace tensortier {

// What a piece's bytes are checked against.
enum class PieceCheck : uint8_t {
  kNone,
  kXxh64,  // a safetensors tensor's stored xxh64 (tensortier.save(..., checksum=True))
  kCrc32,  // a torch.save zip record's CRC-32 (the piece is the whole record)
};

struct PieceRead {
  std::string name;  // in messages: the tensor (kNone, kXxh64) or the zip record (kCrc32)
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  std::byte* dest = nullptr;  // nbytes of the caller's, alive until the call returns
  PieceCheck check = PieceCheck::kNone;
  // The stored checksum. None with kXxh64: the file stores none for this tensor (an error).
  std::optional<uint64_t> expected;
};

struct PieceReadOptions {
  // Large pieces are submitted in groups of about this many bytes, all at once: each group is
  // checked (and progress reported) while the engine reads the later ones.
  uint64_t group_bytes = kCheckpointGroupBytes;
  // Pieces smaller than this go through ReadScattered: pieces close together in the file share
  // one large request through a staging buffer (thousands of small tensors cost a few reads).
  uint64_t gather_below = kCheckpointGatherBelow;
  // The destinations are small-page memory (tensors from torch's allocator): direct reads may be
  // staged through the engine's bounce buffers (SubmitOptions::stage_reads).
  bool stage_reads = true;
};

// Reads every piece of `pieces` of `file` into its destination with `engine` and checks it.
// `progress`, when set, is called on the calling thread with the bytes of each group done.
// Returns the engine's stats of each group of large pieces, in order. Throws FormatError naming
// `path` and the piece for a file that ends before a piece's end ("file ended early") and for a
// checksum mismatch, IoError; every read in flight has finished when it throws.
std::vector<IoStats> ReadPieces(Engine& engine, const File& file, const std::string& path,
                                std::span<const PieceRead> pieces,
                                const PieceReadOptions& options = {},
                                const std::function<void(uint64_t)>& progress = {});

// Throws FormatError as ReadPieces does for a short file when `got` bytes of piece `p` (one read
// outside ReadPieces: the engine's GPU path) came back instead of all.
void CheckReadLength(const std::string& path, const PieceRead& p, uint64_t got);

// Checks pieces whose bytes are in memory already (at `dest`: a mapped file, a storage read
// while unpickling). Throws FormatError as ReadPieces does.
void CheckPieces(const std::string& path, std::span<const PieceRead> pieces);

// A zip record to check whole: its CRC-32 computed over the bytes streamed from the file.
struct RecordCheck {
  std::string name;
  uint64_t offset = 0;
  uint64_t size = 0;
  uint32_t crc32 = 0;
};

// Streams each of `records` of `file` through two bounded buffers and compares its CRC-32 with
// the stored one (records no tensor read covers whole: .format_version, data.pkl, a storage only
// partly viewed). Throws FormatError naming `path` and the record for a mismatch or a file that
// ends before a record's end, IoError.
void CheckRecords(Engine& engine, const File& file, const std::string& path,
                  std::span<const RecordCheck> records);

// "tensor 'name': xxh64 checksum mismatch (stored <16 hex>, data has <16 hex>)" (kCrc32:
// "entry 'name': CRC-32 checksum mismatch", 8 hex digits): how load, verify and convert say that
// bytes do not match the checksum stored for them.
std::string ChecksumMismatch(PieceCheck check, const std::string& name, uint64_t stored,
                             uint64_t actual);

// "<path>: " ChecksumMismatch ": the file is corrupt": what a load raises.
std::string LoadChecksumMismatch(const std::string& path, const std::string& name, PieceCheck check,
                                 uint64_t stored, uint64_t actual);

}  // namespace tensortier
