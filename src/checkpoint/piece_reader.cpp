#include "tensortier/checkpoint/piece_reader.hpp"

#include <algorithm>
#include <exception>

#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/small_pieces.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

FormatError EndedEarly(const std::string& path, const PieceRead& p, uint64_t got) {
  return FormatError(StrCat(path, ": file ended early: tensor ", PyRepr(p.name), " needs ",
                            p.nbytes, " bytes at offset ", p.offset, ", got ", got,
                            " (truncated file?)"));
}

void Check(const std::string& path, const PieceRead& p, const std::byte* data) {
  switch (p.check) {
    case PieceCheck::kNone:
      return;
    case PieceCheck::kXxh64: {
      if (!p.expected) {
        throw FormatError(
            StrCat(path, ": verify=True but tensor ", PyRepr(p.name), " has no stored checksum"));
      }
      const uint64_t actual = Xxh64(data, p.nbytes);
      if (actual != *p.expected) {
        throw FormatError(LoadChecksumMismatch(path, p.name, p.check, *p.expected, actual));
      }
      return;
    }
    case PieceCheck::kCrc32: {
      const uint64_t actual = Crc32(data, p.nbytes);
      const uint64_t stored = p.expected.value_or(0);
      if (actual != stored) {
        throw FormatError(LoadChecksumMismatch(path, p.name, p.check, stored, actual));
      }
      return;
    }
  }
}

// Waits for every future still in flight when a read or check throws: the reads write into the
// caller's memory, which may be freed as soon as the error reaches it.
struct SettleOnUnwind {
  std::vector<Future>& futures;
  int uncaught = std::uncaught_exceptions();
  ~SettleOnUnwind() {
    if (std::uncaught_exceptions() <= uncaught) return;
    for (const Future& f : futures) {
      if (!f.valid()) continue;
      try {
        f.Wait();
      } catch (...) {  // the error being thrown already is the one to report
      }
    }
  }
};

}  // namespace

void CheckReadLength(const std::string& path, const PieceRead& p, uint64_t got) {
  if (got != p.nbytes) throw EndedEarly(path, p, got);
}

std::string ChecksumMismatch(PieceCheck check, const std::string& name, uint64_t stored,
                             uint64_t actual) {
  const bool crc = check == PieceCheck::kCrc32;
  const auto hex = [crc](uint64_t v) { return crc ? Hex8(static_cast<uint32_t>(v)) : Hex16(v); };
  return StrCat(crc ? "entry " : "tensor ", PyRepr(name), ": ", crc ? "CRC-32" : "xxh64",
                " checksum mismatch (stored ", hex(stored), ", data has ", hex(actual), ")");
}

std::string LoadChecksumMismatch(const std::string& path, const std::string& name, PieceCheck check,
                                 uint64_t stored, uint64_t actual) {
  return StrCat(path, ": ", ChecksumMismatch(check, name, stored, actual), ": the file is corrupt");
}

void CheckPieces(const std::string& path, std::span<const PieceRead> pieces) {
  for (const PieceRead& p : pieces) Check(path, p, p.dest);
}

std::vector<IoStats> ReadPieces(Engine& engine, const File& file, const std::string& path,
                                std::span<const PieceRead> pieces, const PieceReadOptions& options,
                                const std::function<void(uint64_t)>& progress) {
  // Small pieces first: one ReadScattered of them all, then their checks.
  std::vector<ScatteredRead> small;
  std::vector<size_t> small_index;
  std::vector<size_t> large;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const PieceRead& p = pieces[i];
    if (p.nbytes > 0 && p.nbytes < options.gather_below) {
      small.push_back({p.offset, p.nbytes, p.dest});
      small_index.push_back(i);
    } else {
      large.push_back(i);
    }
  }
  if (!small.empty()) {
    const std::vector<uint64_t> got = ReadScattered(engine, file, small);
    uint64_t bytes = 0;
    for (size_t k = 0; k < small.size(); ++k) {
      const PieceRead& p = pieces[small_index[k]];
      if (got[k] != p.nbytes) throw EndedEarly(path, p, got[k]);
      Check(path, p, p.dest);
      bytes += p.nbytes;
    }
    if (progress) progress(bytes);
  }

  // Large pieces: groups of about group_bytes, all submitted, then checked in order as they
  // complete (the engine bounds what is really in flight).
  struct Group {
    size_t first = 0;  // into `large`
    size_t last = 0;
    uint64_t bytes = 0;
  };
  std::vector<Group> groups;
  for (size_t k = 0; k < large.size(); ++k) {
    if (groups.empty() || groups.back().bytes >= options.group_bytes) groups.push_back({k, k, 0});
    groups.back().last = k + 1;
    groups.back().bytes += pieces[large[k]].nbytes;
  }
  std::vector<Future> futures(groups.size());
  SettleOnUnwind settle{futures};
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<IoDesc> descs;
    for (size_t k = groups[g].first; k < groups[g].last; ++k) {
      const PieceRead& p = pieces[large[k]];
      if (p.nbytes > 0) descs.push_back({file, p.dest, p.offset, p.nbytes});
    }
    if (!descs.empty()) {
      futures[g] =
          engine.Submit(IoOp::kRead, descs, SubmitOptions{.stage_reads = options.stage_reads});
    }
  }
  std::vector<IoStats> stats;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (futures[g].valid()) {
      const IoResult result = futures[g].Wait();
      size_t seg = 0;
      for (size_t k = groups[g].first; k < groups[g].last; ++k) {
        const PieceRead& p = pieces[large[k]];
        if (p.nbytes == 0) continue;
        const uint64_t got = seg < result.segment_bytes.size() ? result.segment_bytes[seg] : 0;
        ++seg;
        if (got != p.nbytes) throw EndedEarly(path, p, got);
      }
      stats.push_back(result.stats);
    }
    for (size_t k = groups[g].first; k < groups[g].last; ++k) {
      const PieceRead& p = pieces[large[k]];
      Check(path, p, p.dest);
    }
    if (progress) progress(groups[g].bytes);
  }
  return stats;
}

void CheckRecords(Engine& engine, const File& file, const std::string& path,
                  std::span<const RecordCheck> records) {
  uint64_t largest = 0;
  for (const RecordCheck& r : records) largest = std::max(largest, r.size);
  if (largest == 0) largest = 1;
  StreamBuffers buffers(largest);
  for (const RecordCheck& r : records) {
    uint32_t crc = 0;
    try {
      StreamRange(engine, file, r.offset, r.size, buffers,
                  [&](std::byte* data, size_t n) { crc = Crc32(data, n, crc); });
    } catch (const FormatError&) {  // the file ended inside the record
      throw FormatError(StrCat(path, ": record ", r.name,
                               " is truncated (the file ends before offset ", r.offset + r.size,
                               ")"));
    }
    if (crc != r.crc32) {
      throw FormatError(LoadChecksumMismatch(path, r.name, PieceCheck::kCrc32, r.crc32, crc));
    }
  }
}

}  // namespace tensortier
