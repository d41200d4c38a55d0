#include "tensortier/checkpoint/dcp_file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>

#include "dcp_item_source.hpp"
#include "dcp_naming.hpp"
#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/checkpoint/small_pieces.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/checkpoint/zip_writer.hpp"
#include "tensortier/io/file_system.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr uint64_t kSmallAlign = 64;
// Tensors of this size or more go from their memory to the file in requests of their own; the
// rest are gathered (with the zip records around them) into large writes and reads.
constexpr uint64_t kOwnRequest = 1u << 20;
// An item checked whole whose data is read in requests of its own is read in pieces that end at
// multiples of this in the file, each hashed as soon as it is in while the disk reads the later
// ones: the check then adds the hashing of one piece to a load, not a pass over all of its data
// after the last read (which, with more ranks than cores, the ranks' hashing turned into CPU
// time on the load's critical path).
constexpr uint64_t kCheckPiece = 8u << 20;
constexpr const char* kFolder = "archive/";

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += StrCat(i ? ", " : "", shape[i]);
  return out + "]";
}

void Settle(std::vector<Future>& futures) {
  for (auto& f : futures) {
    if (!f.valid()) continue;
    try {
      f.Wait();
    } catch (...) {  // the error being thrown already is the one to report
    }
  }
}

uint64_t LoadLe64(std::string_view packed, uint64_t k) {
  uint64_t v = 0;
  for (int b = 0; b < 8; ++b) {
    v |= uint64_t{static_cast<unsigned char>(packed[8 * k + b])} << (8 * b);
  }
  return v;
}

}  // namespace

std::string DcpBlockXxh64s(const std::byte* data, uint64_t n) {
  BlockHasher h;
  h.Update(data, n);
  return h.Finish();
}

void CheckDcpBlockXxh64s(const std::string& where, std::string_view expected, uint64_t first,
                         std::string_view actual, uint64_t data_offset, uint64_t data_length) {
  const uint64_t blocks = (data_length + kDcpBlockBytes - 1) / kDcpBlockBytes;
  if (expected.size() != 8 * blocks) {
    throw FormatError(StrCat(where, ": the metadata records ", expected.size(),
                             " bytes of block sums (xxh64_blocks) for ", data_length,
                             " bytes of data, not 8 per ", kDcpBlockBytes, "-byte block"));
  }
  for (uint64_t k = 0; k < actual.size() / 8 && first + k < blocks; ++k) {
    const uint64_t got = LoadLe64(actual, k);
    const uint64_t want = LoadLe64(expected, first + k);
    if (got != want) {
      const uint64_t at = (first + k) * kDcpBlockBytes;
      throw FormatError(StrCat(where, ": the xxh64 of its data's ",
                               Range(data_offset + at, std::min(kDcpBlockBytes, data_length - at)),
                               " is ", Hex16(got), ", the metadata records ", Hex16(want),
                               ": the file is damaged"));
    }
  }
}

DcpFilePlan::DcpFilePlan(std::vector<DcpWriteItem> items) : items_(std::move(items)) {
  places_.resize(items_.size());
  heads_.resize(items_.size());
  tails_.resize(items_.size());
  uint64_t cursor = 0;
  for (size_t i = 0; i < items_.size(); ++i) {
    const DcpWriteItem& it = items_[i];
    DcpItemPlace& p = places_[i];
    if (it.dtype.empty()) {
      p.offset = p.data_offset = cursor;
      p.length = it.nbytes;
      cursor += it.nbytes;
      continue;
    }
    const std::string what = it.name.empty() ? StrCat("item ", i) : it.name;
    const std::string pickle = SerializeTorchTensorPickle({what, it.dtype, it.shape, "0"});
    uint64_t elements = 1;  // within int64: the pickle checked the shape
    for (uint64_t d : it.shape) elements *= d;
    if (elements * (DtypeNamed(it.dtype)->bits / 8) != it.nbytes) {
      throw std::invalid_argument(
          StrCat(what, ": ", it.nbytes, " bytes for ", elements, " elements of ", it.dtype));
    }
    // The records torch.save writes for one tensor (CRC-32s 0, as with set_crc32_options(False)).
    ZipPlanner zip(1);
    zip.Add(StrCat(kFolder, "data.pkl"), pickle.size());
    zip.Add(StrCat(kFolder, "byteorder"), 6);
    const uint64_t align = it.nbytes >= kPageSize ? kPageSize : kSmallAlign;
    const size_t data = zip.Add(StrCat(kFolder, "data/0"), it.nbytes, align, cursor);
    zip.Add(StrCat(kFolder, "version"), 2);
    const auto& e = zip.entries();
    heads_[i] =
        StrCat(zip.LocalHeader(0), pickle, zip.LocalHeader(1), "little", zip.LocalHeader(data));
    tails_[i] = StrCat(zip.LocalHeader(3), "3\n", zip.Directory());
    p.offset = cursor;
    p.data_offset = cursor + e[data].data_offset;
    p.length = e[data].data_offset + it.nbytes + tails_[i].size();
    cursor += p.length;
  }
  size_ = cursor;
}

void DcpFilePlan::Write(Engine& engine, const File& file) {
  std::vector<size_t> all(items_.size());
  std::vector<const std::byte*> srcs(items_.size());
  for (size_t i = 0; i < items_.size(); ++i) {
    all[i] = i;
    srcs[i] = items_[i].src;
  }
  WriteItems(engine, file, all, srcs);
}

void DcpFilePlan::WriteItems(Engine& engine, const File& file, std::span<const size_t> indices,
                             std::span<const std::byte* const> srcs) {
  if (srcs.size() != indices.size()) {
    throw std::invalid_argument("DcpFilePlan::WriteItems: one src per index");
  }
  std::vector<GatheredWrite> gathered;
  std::vector<Future> own;
  struct SettleOwn {
    std::vector<Future>& f;
    ~SettleOwn() { Settle(f); }
  } settle{own};
  // The large tensors first: the disk works on them while the rest is hashed and gathered.
  std::vector<bool> alone(indices.size(), false);
  for (size_t k = 0; k < indices.size(); ++k) {
    const size_t i = indices[k];
    if (items_.at(i).nbytes >= kOwnRequest && places_[i].data_offset % kPageSize == 0) {
      alone[k] = true;
      own.push_back(engine.Write(file, srcs[k], items_[i].nbytes, places_[i].data_offset));
    }
  }
  for (size_t k = 0; k < indices.size(); ++k) {
    const size_t i = indices[k];
    const DcpWriteItem& it = items_[i];
    DcpItemPlace& p = places_[i];
    Xxh64State h;
    h.Update(heads_[i].data(), heads_[i].size());
    h.Update(srcs[k], it.nbytes);
    h.Update(tails_[i].data(), tails_[i].size());
    p.xxh64 = h.Digest();
    if (!it.dtype.empty()) p.block_xxh64 = DcpBlockXxh64s(srcs[k], it.nbytes);
    const auto* head = reinterpret_cast<const std::byte*>(heads_[i].data());
    const auto* tail = reinterpret_cast<const std::byte*>(tails_[i].data());
    gathered.push_back({p.offset, heads_[i].size(), head});
    if (!alone[k]) gathered.push_back({p.data_offset, it.nbytes, srcs[k]});
    gathered.push_back({p.data_offset + it.nbytes, tails_[i].size(), tail});
  }
  WriteGathered(engine, file, gathered);
  for (auto& f : own) {
    Future done = std::move(f);
    f = Future();
    done.Wait();
  }
}

std::vector<DcpItemPlace> WriteDcpFile(Engine& engine, const std::string& path,
                                       std::vector<DcpWriteItem> items, bool direct,
                                       const std::string& who, const DcpStageFn& stage,
                                       uint64_t staging_bytes) {
  std::vector<size_t> resident, staged;
  std::vector<const std::byte*> resident_srcs;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].src != nullptr || items[i].nbytes == 0) {
      resident.push_back(i);
      resident_srcs.push_back(items[i].src);
    } else {
      staged.push_back(i);
    }
  }
  if (!staged.empty() && !stage) {
    throw std::invalid_argument(StrCat("WriteDcpFile: item ", staged[0], " has no bytes to write"));
  }
  DcpFilePlan plan(std::move(items));
  NamingWho(who.empty() ? who : StrCat(who, " saving its DCP data file"), path, [&] {
    DurableFile out(path, direct);
    out.Reserve(plan.size());
    plan.WriteItems(engine, out.file(), resident, resident_srcs);
    std::vector<size_t> group;
    uint64_t group_bytes = 0;
    for (size_t k = 0; k < staged.size(); ++k) {
      group.push_back(staged[k]);
      group_bytes += plan.item_bytes(staged[k]);
      if (group_bytes < staging_bytes && k + 1 < staged.size()) continue;
      const std::vector<const std::byte*> srcs = stage(group);
      if (srcs.size() != group.size()) {
        throw std::invalid_argument("WriteDcpFile: stage gave not one address per item");
      }
      plan.WriteItems(engine, out.file(), group, srcs);
      group.clear();
      group_bytes = 0;
    }
    out.Commit();
  });
  return plan.places();
}

File OpenDcpDataFile(const std::string& path, std::span<const std::string> items, bool direct) {
  try {
    return OpenCheckpointForReading(path, direct);
  } catch (const IoError& e) {
    if (items.empty()) throw;
    const std::string more = items.size() > 1 ? StrCat(" and ", items.size() - 1, " more") : "";
    throw IoError(
        e.error_code(),
        StrCat(e.op(), " of the data file the metadata names for item '", items[0], "'", more),
        e.path(), e.offset(), e.length());
  }
}

namespace {

void CheckShape(const std::string& where, const std::optional<std::vector<int64_t>>& expected,
                const std::vector<int64_t>& shape) {
  if (expected && *expected != shape) {
    throw FormatError(StrCat(where, ": the metadata gives it the shape ", ShapeText(*expected),
                             ", the tensor stored in the file has ", ShapeText(shape),
                             ": the metadata does not match the data file"));
  }
}

// The item `fqn` of a safetensors section at `offset` (torch's SAFETENSORS serialization).
DcpTensorItem ReadSafetensorsItem(const ByteSource& whole, const std::string& name,
                                  const std::string& fqn, uint64_t offset,
                                  const std::optional<std::vector<int64_t>>& expected_shape) {
  const std::string where =
      StrCat(whole.name(), ": item '", name, "' (safetensors data at ", offset, ")");
  unsigned char len[8];
  if (whole.size() < 8 || offset > whole.size() - 8) {
    throw FormatError(StrCat(where, ": past the end of the file (truncated)"));
  }
  whole.ReadAt(offset, len, 8);
  uint64_t n = 0;
  for (int k = 0; k < 8; ++k) n |= uint64_t{len[k]} << (8 * k);
  if (n > kSafetensorsMaxHeader || n > whole.size() - offset - 8) {
    throw FormatError(StrCat(where, ": neither a torch.save zip nor a safetensors header"));
  }
  std::string json(n, '\0');
  whole.ReadAt(offset + 8, json.data(), n);
  const uint64_t data = offset + 8 + n;
  const SafetensorsHeader header = ParseSafetensorsHeader(json, whole.size() - data);
  const auto e = std::find_if(header.entries.begin(), header.entries.end(),
                              [&](const SafetensorsEntry& x) { return x.name == fqn; });
  if (e == header.entries.end()) {
    throw FormatError(StrCat(where, ": its safetensors data hold no tensor '", fqn, "'"));
  }
  const Dtype* dtype = DtypeNamed(e->dtype);
  if (dtype == nullptr) throw FormatError(StrCat(where, ": dtype ", e->dtype, " is not read"));
  DcpTensorItem out;
  out.dtype = e->dtype;
  out.shape.assign(e->shape.begin(), e->shape.end());
  out.stride.assign(out.shape.size(), 1);
  for (size_t d = out.shape.size(); d-- > 1;) {
    out.stride[d - 1] = out.stride[d] * std::max<int64_t>(out.shape[d], 1);
  }
  out.data_offset = data + e->begin;
  out.nbytes = e->end - e->begin;
  out.bytes_read = 8 + n;
  out.safetensors = true;
  CheckShape(where, expected_shape, out.shape);
  return out;
}

}  // namespace

DcpTensorItem ReadDcpTensorItem(const File& file, const std::string& name, uint64_t offset,
                                uint64_t length,
                                const std::optional<std::vector<int64_t>>& expected_shape,
                                const std::string& fqn) {
  return ReadDcpTensorItem(FileSource(file), name, offset, length, expected_shape, fqn);
}

DcpTensorItem ReadDcpTensorItem(const ByteSource& whole, const std::string& name, uint64_t offset,
                                uint64_t length,
                                const std::optional<std::vector<int64_t>>& expected_shape,
                                const std::string& fqn) {
  if (!fqn.empty() && offset <= whole.size() && whole.size() - offset >= 4) {
    char magic[4];
    whole.ReadAt(offset, magic, 4);
    if (std::string_view(magic, 4) != std::string_view("PK\x03\x04", 4)) {
      DcpTensorItem out = ReadSafetensorsItem(whole, name, fqn, offset, expected_shape);
      out.bytes_read += 4;
      return out;
    }
  }
  RangeSource item(whole, name, offset, length);
  const TorchCheckpoint c = ReadTorchCheckpoint(item);
  const auto& tensors = c.pickle.tensors;
  if (tensors.size() != 1 || !tensors[0].path.empty() || c.pickle.other_values != 0) {
    throw FormatError(StrCat(item.name(), ": not a torch.save zip of one tensor"));
  }
  const TorchTensor& t = tensors[0];
  if (t.meta || c.big_endian) {
    throw FormatError(StrCat(item.name(), ": a meta or big-endian tensor (not supported)"));
  }
  CheckShape(item.name(), expected_shape, t.shape);
  const TorchStorage& s = c.pickle.storages.at(t.storage_key);
  const ZipEntry* e = c.zip.Find(StrCat(c.prefix, "/data/", t.storage_key));
  if (e == nullptr) throw FormatError(StrCat(item.name(), ": no storage record"));
  RequireStored(*e, item.name());
  DcpTensorItem out;
  out.dtype = t.dtype;
  out.shape = t.shape;
  out.stride = t.stride;
  out.storage_offset = t.storage_offset;
  out.data_offset = offset + s.data_offset;
  out.nbytes = s.nbytes;
  out.conj = t.conj;
  out.neg = t.neg;
  if (RecordsCrcs(c.zip)) out.crc32 = e->crc32;
  out.bytes_read = item.bytes_read();
  return out;
}

std::vector<DcpRun> DcpSliceRuns(const DcpSlice& slice, uint64_t data_offset,
                                 const std::string& where) {
  const auto& shape = slice.shape;
  const size_t rank = shape.size();
  if (slice.offsets.size() != rank || slice.lengths.size() != rank || slice.itemsize == 0) {
    throw FormatError(StrCat(where, ": a part of ", slice.offsets.size(), " offsets and ",
                             slice.lengths.size(), " lengths of a tensor of ", rank,
                             " dimensions"));
  }
  for (size_t d = 0; d < rank; ++d) {
    if (slice.offsets[d] < 0 || slice.lengths[d] < 0 ||
        slice.offsets[d] > shape[d] - slice.lengths[d]) {
      throw FormatError(StrCat(where, ": the load asks for elements [", slice.offsets[d], ", ",
                               slice.offsets[d] + slice.lengths[d], ") of dimension ", d,
                               ", the stored tensor has ", ShapeText(shape)));
    }
  }
  // The innermost dimensions the part takes whole, and the one outside them, make one run.
  size_t k = rank;
  uint64_t inner = slice.itemsize;  // bytes of one step along dimension k - 1
  while (k > 0 && slice.offsets[k - 1] == 0 && slice.lengths[k - 1] == shape[k - 1]) {
    inner *= static_cast<uint64_t>(shape[k - 1]);
    --k;
  }
  std::vector<DcpRun> runs;
  uint64_t run = inner;  // the run's bytes
  uint64_t first = 0;    // its offset from the tensor's data at index 0 of the outer dimensions
  if (k > 0) {
    --k;  // the partly taken dimension: a run covers its lengths[k] steps
    run = inner * static_cast<uint64_t>(slice.lengths[k]);
    first = inner * static_cast<uint64_t>(slice.offsets[k]);
  }
  uint64_t count = 1;
  for (size_t d = 0; d < k; ++d) count *= static_cast<uint64_t>(slice.lengths[d]);
  if (run == 0 || count == 0) return runs;
  // The stride of each outer dimension in bytes.
  std::vector<uint64_t> stride(k);
  uint64_t step = inner * (k < rank ? static_cast<uint64_t>(shape[k]) : 1);
  for (size_t d = k; d-- > 0;) {
    stride[d] = step;
    step *= static_cast<uint64_t>(shape[d]);
  }
  runs.reserve(count);
  std::vector<int64_t> index(k, 0);  // within the part, row-major
  for (uint64_t n = 0; n < count; ++n) {
    uint64_t at = data_offset + first;
    for (size_t d = 0; d < k; ++d) {
      at += stride[d] * static_cast<uint64_t>(slice.offsets[d] + index[d]);
    }
    runs.push_back({at, run, n * run});
    for (size_t d = k; d-- > 0;) {
      if (++index[d] < slice.lengths[d]) break;
      index[d] = 0;
    }
  }
  return runs;
}

const std::byte* FindDcpHeldBytes(std::span<const DcpHeldBytes> held, uint64_t offset,
                                  uint64_t length) {
  auto it = std::upper_bound(held.begin(), held.end(), offset,
                             [](uint64_t o, const DcpHeldBytes& h) { return o < h.offset; });
  if (it == held.begin()) return nullptr;
  --it;
  if (offset - it->offset > it->bytes.size() || length > it->bytes.size() - (offset - it->offset)) {
    return nullptr;
  }
  return it->bytes.data() + (offset - it->offset);
}

uint64_t ReadDcpItems(Engine& engine, const File& file, std::span<const DcpRead> reads,
                      std::span<const DcpHeldBytes> held) {
  // Each item in up to three pieces: the zip records before its data (kept for the xxh64), the
  // data into its destination, the records after it. A slice: its runs into its destination.
  // The small pieces are read first, then the large ones: an item checked whole is hashed as its
  // large data arrives, which needs the records before it in memory by then.
  std::vector<std::string> heads(reads.size()), tails(reads.size());
  std::vector<ScatteredRead> scattered;
  std::vector<std::pair<size_t, uint64_t>> piece_of;  // scattered index -> (item, expected)
  struct LargeRead {
    size_t item;
    uint64_t offset, length;
    std::byte* dest;
  };
  std::vector<LargeRead> large;  // read in requests of their own, after `scattered`
  std::vector<Future> own;
  struct OwnRead {
    size_t item;
    uint64_t length;
    const std::byte* dest;
  };
  std::vector<OwnRead> own_of;  // per `own`
  uint64_t bytes_read = 0;
  // Items checked whole whose data is large: their checksum, fed as the data arrives.
  constexpr size_t kNone = static_cast<size_t>(-1);
  struct Stream {
    Xxh64State xxh64;
    uint32_t crc32 = 0;
    uint64_t hashed = 0;  // bytes of the data
  };
  std::vector<size_t> stream_of(reads.size(), kNone);
  std::vector<Stream> streams;
  // Parts of items checked by their blocks: the spans of whole blocks read, and the runs to copy
  // out of them once they are checked.
  struct Span {
    size_t item;
    uint64_t first, last;  // blocks
    std::string where;
    std::unique_ptr<std::byte[]> buf;
  };
  std::vector<Span> spans;
  std::vector<std::vector<DcpRun>> runs_of(reads.size());
  struct SettleOwn {
    std::vector<Future>& f;
    ~SettleOwn() { Settle(f); }
  } settle{own};
  auto piece = [&](size_t i, uint64_t offset, uint64_t length, std::byte* dest) {
    if (const std::byte* p = FindDcpHeldBytes(held, offset, length)) {
      if (length > 0) std::memcpy(dest, p, length);
    } else if (length >= kOwnRequest) {
      large.push_back({i, offset, length, dest});
    } else if (length > 0) {
      scattered.push_back({offset, length, dest});
      piece_of.emplace_back(i, length);
    }
  };
  for (size_t i = 0; i < reads.size(); ++i) {
    const DcpRead& r = reads[i];
    if (r.data_offset < r.offset || r.data_length > r.offset + r.length - r.data_offset) {
      throw std::invalid_argument(StrCat(file.path(), ": item '", r.name, "': data outside it"));
    }
    if (r.slice) {
      const std::string where =
          StrCat(file.path(), ": item '", r.name, "' at ", Range(r.offset, r.length));
      const auto runs = DcpSliceRuns(*r.slice, r.data_offset, where);
      for (const DcpRun& run : runs) {
        if (run.offset + run.length > r.data_offset + r.data_length) {
          throw FormatError(StrCat(where, ": the tensor's ", ShapeText(r.slice->shape),
                                   " do not fit its ", r.data_length, " bytes of data"));
        }
        if (r.blocks.empty()) piece(i, run.offset, run.length, r.dest + run.dest_offset);
      }
      if (r.blocks.empty()) continue;
      // Checked: the blocks the runs touch, read whole into spans of consecutive blocks.
      CheckDcpBlockXxh64s(where, r.blocks, 0, {}, r.data_offset, r.data_length);
      for (const DcpRun& run : runs) {
        const uint64_t first = (run.offset - r.data_offset) / kDcpBlockBytes;
        const uint64_t last = (run.offset + run.length - 1 - r.data_offset) / kDcpBlockBytes;
        if (!spans.empty() && spans.back().item == i && first <= spans.back().last + 1) {
          spans.back().last = std::max(spans.back().last, last);
        } else {
          spans.push_back({i, first, last, where, nullptr});
        }
      }
      runs_of[i] = runs;
      continue;
    }
    const size_t large_before = large.size();
    piece(i, r.data_offset, r.data_length, r.dest);
    const bool data_large = large.size() > large_before;
    if (r.xxh64) {
      heads[i].resize(r.data_offset - r.offset);
      tails[i].resize(r.offset + r.length - r.data_offset - r.data_length);
      piece(i, r.offset, heads[i].size(), reinterpret_cast<std::byte*>(heads[i].data()));
      piece(i, r.data_offset + r.data_length, tails[i].size(),
            reinterpret_cast<std::byte*>(tails[i].data()));
    }
    // Streamed where the data alone is read large (the records are in memory before it).
    if (data_large && large.size() == large_before + 1 && (r.xxh64 || r.crc32)) {
      stream_of[i] = streams.size();
      streams.emplace_back();
    }
  }
  auto span_place = [&](const Span& sp) {  // (offset in the file, length) of a span's blocks
    const DcpRead& r = reads[sp.item];
    const uint64_t begin = sp.first * kDcpBlockBytes;
    return std::pair(r.data_offset + begin,
                     std::min((sp.last + 1) * kDcpBlockBytes, r.data_length) - begin);
  };
  for (Span& sp : spans) {
    const auto [offset, length] = span_place(sp);
    sp.buf = std::make_unique_for_overwrite<std::byte[]>(length);
    piece(sp.item, offset, length, sp.buf.get());
  }
  auto truncated = [&](size_t i) {
    const DcpRead& r = reads[i];
    return FormatError(StrCat(file.path(), ": item '", r.name, "' at ", Range(r.offset, r.length),
                              ": the file ends inside it (truncated)"));
  };
  // Ranges a page or less apart share a request: no byte is read that a page-aligned read of
  // each would not read too.
  const std::vector<uint64_t> got = ReadScattered(engine, file, scattered, kPageSize, &bytes_read);
  for (size_t k = 0; k < got.size(); ++k) {
    if (got[k] != piece_of[k].second) throw truncated(piece_of[k].first);
  }
  for (size_t i = 0; i < reads.size(); ++i) {
    if (stream_of[i] != kNone && reads[i].xxh64) {
      streams[stream_of[i]].xxh64.Update(heads[i].data(), heads[i].size());
    }
  }
  // All submitted at once (the engine bounds what is in flight), then waited for in order.
  for (const LargeRead& l : large) {
    const bool streamed = stream_of[l.item] != kNone;
    for (uint64_t at = 0; at < l.length;) {
      const uint64_t end = streamed ? (l.offset + at) / kCheckPiece * kCheckPiece + kCheckPiece
                                    : l.offset + l.length;
      const uint64_t n = std::min(end - l.offset, l.length) - at;
      own.push_back(engine.Read(file, l.dest + at, n, l.offset + at));
      own_of.push_back({l.item, n, l.dest + at});
      bytes_read += n;
      at += n;
    }
  }
  for (size_t k = 0; k < own.size(); ++k) {
    Future f = std::move(own[k]);
    own[k] = Future();
    const OwnRead& o = own_of[k];
    if (f.Wait().bytes != o.length) throw truncated(o.item);
    if (stream_of[o.item] == kNone) continue;
    Stream& st = streams[stream_of[o.item]];
    if (reads[o.item].xxh64) {
      st.xxh64.Update(o.dest, o.length);
    } else {
      st.crc32 = Crc32(o.dest, o.length, st.crc32);
    }
    st.hashed += o.length;
  }
  for (size_t k = 0; k < spans.size();) {  // each item's spans, then its runs out of them
    const size_t i = spans[k].item;
    const DcpRead& r = reads[i];
    size_t end = k;
    for (; end < spans.size() && spans[end].item == i; ++end) {
      const auto [offset, length] = span_place(spans[end]);
      CheckDcpBlockXxh64s(spans[end].where, r.blocks, spans[end].first,
                          DcpBlockXxh64s(spans[end].buf.get(), length), r.data_offset,
                          r.data_length);
    }
    size_t at = k;
    for (const DcpRun& run : runs_of[i]) {
      while (span_place(spans[at]).first + span_place(spans[at]).second < run.offset + run.length) {
        ++at;
      }
      std::memcpy(r.dest + run.dest_offset,
                  spans[at].buf.get() + (run.offset - span_place(spans[at]).first), run.length);
    }
    k = end;
  }
  for (size_t i = 0; i < reads.size(); ++i) {
    const DcpRead& r = reads[i];
    if (r.slice) continue;
    Stream* st = stream_of[i] == kNone ? nullptr : &streams[stream_of[i]];
    if (st != nullptr && st->hashed != r.data_length) {
      throw std::logic_error(StrCat(file.path(), ": item '", r.name, "': ", st->hashed, " of its ",
                                    r.data_length, " bytes of data hashed"));
    }
    if (r.xxh64) {
      Xxh64State h;
      if (st != nullptr) {
        h = st->xxh64;
      } else {
        h.Update(heads[i].data(), heads[i].size());
        h.Update(r.dest, r.data_length);
      }
      h.Update(tails[i].data(), tails[i].size());
      const uint64_t actual = h.Digest();
      if (actual != *r.xxh64) {
        throw FormatError(StrCat(
            file.path(), ": item '", r.name, "' at ", Range(r.offset, r.length), ": its xxh64 is ",
            Hex16(actual), ", the metadata records ", Hex16(*r.xxh64), ": the file is damaged"));
      }
    } else if (r.crc32) {
      const uint32_t actual = st != nullptr ? st->crc32 : Crc32(r.dest, r.data_length);
      if (actual != *r.crc32) {
        throw FormatError(StrCat(file.path(), ": item '", r.name, "' at ",
                                 Range(r.offset, r.length), ": the CRC-32 of its data (",
                                 Range(r.data_offset, r.data_length), ") is ", Hex8(actual),
                                 ", its zip records ", Hex8(*r.crc32), ": the file is damaged"));
      }
    } else if (r.zip_records) {
      const MemorySource item(
          r.dest, r.data_length,
          StrCat(file.path(), ": item '", r.name, "' at ", Range(r.offset, r.length)));
      const std::optional<std::string> problem = DcpZipRecordsProblem(item);
      if (problem && !problem->empty()) {
        throw FormatError(StrCat(item.name(), ": ", *problem, ": the file is damaged"));
      }
    }
  }
  return bytes_read;
}

}  // namespace tensortier
