#include "tensortier/shared/shared_files.hpp"

#include <algorithm>
#include <cerrno>

#include "tensortier/checkpoint/checkpoint_format.hpp"
#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/io/test_hooks.hpp"
#include "tensortier/shared/shared_checkpoint.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

MissingTensorError Missing(const std::string& path, const std::string& key,
                           const std::vector<std::string>& keys) {
  std::string shown;
  for (size_t i = 0; i < keys.size() && i < 20; ++i) {
    shown += StrCat(i ? ", " : "", PyRepr(keys[i]));
  }
  if (keys.size() > 20) shown += StrCat(", ... (", keys.size(), " in all)");
  return MissingTensorError(StrCat(path, " has no tensor ", PyRepr(key),
                                   "; its tensors are: ", shown.empty() ? "none" : shown));
}

}  // namespace

RowSource CheckpointRowSource(const std::string& path, const std::string& key,
                              std::string_view dtype, const std::vector<uint64_t>& shape) {
  std::string stored_dtype;
  std::vector<uint64_t> stored_shape;
  RowSource out{path, 0, 0};
  switch (DetectCheckpointKind(path)) {  // the detection tensortier.load and the CLI use
    case CheckpointKind::kShardIndex:
      throw FormatError(StrCat(path,
                               ": a shard index, not a checkpoint file: pass the shard "
                               "holding ",
                               PyRepr(key)));
    case CheckpointKind::kTorch: {
      TorchTensorLookup found = LocateTorchTensor(path, key);
      if (!found.found) throw Missing(path, key, found.keys);
      stored_dtype = found.found->dtype;
      stored_shape.assign(found.found->shape.begin(), found.found->shape.end());
      out.offset = found.found->offset;
      out.length = found.found->nbytes;
      break;
    }
    case CheckpointKind::kSafetensors: {
      const SafetensorsFileInfo info = ReadSafetensorsHeader(path);
      const auto& entries = info.header.entries;
      auto e = std::find_if(entries.begin(), entries.end(),
                            [&](const SafetensorsEntry& x) { return x.name == key; });
      if (e == entries.end()) {
        std::vector<std::string> keys;
        for (const SafetensorsEntry& x : entries) keys.push_back(x.name);
        throw Missing(path, key, keys);
      }
      for (const Dtype& row : Dtypes()) {
        if (row.safetensors == e->dtype && !row.torch.empty()) stored_dtype = row.torch;
      }
      if (stored_dtype.empty()) {
        throw FormatError(StrCat(path, ": tensor ", PyRepr(key), " has dtype ", e->dtype,
                                 ", which torch cannot hold"));
      }
      try {
        stored_shape = TorchShape(key, e->dtype, e->shape);
      } catch (const std::invalid_argument& x) {
        throw FormatError(StrCat(path, ": ", x.what()));
      }
      out.offset = info.data_start + e->begin;
      out.length = e->end - e->begin;
      break;
    }
  }
  if (stored_shape != shape || stored_dtype != dtype) {
    throw FormatError(StrCat(path, ": ", PyRepr(key), " is ", stored_dtype, " of shape ",
                             PyTuple(stored_shape), "; this shared tensor is ", dtype, " of shape ",
                             PyTuple(shape)));
  }
  return out;
}

std::optional<IoStats> ReadRows(const std::vector<RowSource>& sources, std::string_view what,
                                std::string_view dtype, uint64_t element_size,
                                const std::vector<uint64_t>& shape, uint64_t begin, uint64_t end,
                                void* dest) {
  uint64_t row_bytes = element_size;
  for (size_t i = 1; i < shape.size(); ++i) row_bytes *= shape[i];
  const uint64_t need = (shape.empty() ? 0 : shape[0]) * row_bytes;
  uint64_t total = 0;
  for (const RowSource& s : sources) total += s.length;
  if (total != need) {
    throw FormatError(StrCat(what, ": the sources hold ", total, " bytes; a tensor of shape ",
                             PyTuple(shape), " and dtype torch.", dtype, " needs ", need));
  }
  const uint64_t lo = begin * row_bytes, hi = end * row_bytes;
  std::vector<IoDesc> pieces;
  uint64_t at = 0;
  for (const RowSource& s : sources) {
    const uint64_t from = std::max(at, lo), to = std::min(at + s.length, hi);
    if (from < to) {
      pieces.push_back({File::Open(s.path, OpenMode::kRead), static_cast<char*>(dest) + (from - lo),
                        s.offset + from - at, to - from});
    }
    at += s.length;
  }
  if (pieces.empty()) return std::nullopt;
  Engine engine;
  IoResult result = engine.Submit(IoOp::kRead, pieces).Wait();
  if (result.bytes != hi - lo) {
    ThrowIoError(EIO,
                 StrCat(what, ": read ", result.bytes, " of ", hi - lo, " bytes (a file shrank?)"),
                 pieces.front().file.path());
  }
  return result.stats;
}

std::vector<std::string> WriteRowFile(const std::string& prefix, int rank, int world,
                                      const void* data, uint64_t nbytes, uint64_t offset,
                                      bool last) {
  std::vector<std::string> names;
  for (int r = 0; r < world; ++r) names.push_back(StrCat(prefix, "_part_", r, "_of_", world));
  File file = File::Open(names.at(static_cast<size_t>(rank)),
                         offset == 0 ? OpenMode::kWrite : OpenMode::kReadWrite);
  if (nbytes) {
    Engine engine;
    engine.Write(file, data, nbytes, offset).Wait();
  }
  if (last) file.DataSync();
  return names;
}

namespace {

std::vector<uint64_t> UnsignedShape(const SharedTensorSpec& spec) {
  return {spec.shape.begin(), spec.shape.end()};
}

std::string_view TorchDtypeName(const SharedTensorSpec& spec) {
  std::string_view dtype = spec.dtype;
  if (dtype.rfind("torch.", 0) == 0) dtype.remove_prefix(6);
  return dtype;
}

// kDeviceSlabBytes, or what a test installed (the test seam).
uint64_t DeviceSlabBytes() {
  TestHooks* hooks = InstalledTestHooks();
  return std::max<uint64_t>(1, hooks ? hooks->DeviceSlabBytes(kDeviceSlabBytes) : kDeviceSlabBytes);
}

}  // namespace

std::optional<IoStats> ReadPartitionRows(const std::vector<RowSource>& sources,
                                         std::string_view what, const SharedTensorSpec& spec,
                                         const SharedPartition& part, int device) {
  const uint64_t begin = part.row_begin, end = part.row_begin + part.rows;
  const std::vector<uint64_t> shape = UnsignedShape(spec);
  const std::string_view dtype = TorchDtypeName(spec);
  if (device < 0 || part.rows == 0) {
    return ReadRows(sources, what, dtype, spec.element_size, shape, begin, end, part.address);
  }
  const uint64_t row_bytes = std::max<uint64_t>(1, spec.row_bytes());
  const uint64_t slab_rows =
      std::max<uint64_t>(1, std::min(part.rows, DeviceSlabBytes() / row_bytes));
  PrimaryContext context(CudaDriver::Get(), device);
  PinnedHostMemory slab(context, slab_rows * row_bytes);
  Stream stream(context);
  std::optional<IoStats> stats;
  for (uint64_t b = begin; b < end; b += slab_rows) {
    const uint64_t e = std::min(b + slab_rows, end);
    if (auto read = ReadRows(sources, what, dtype, spec.element_size, shape, b, e, slab.data())) {
      if (stats) {
        *stats += *read;
      } else {
        stats = std::move(read);
      }
    }
    const auto dst = reinterpret_cast<cuda::CUdeviceptr>(part.address + (b - begin) * row_bytes);
    stream.CopyToDevice(dst, slab.data(), (e - b) * spec.row_bytes());
    stream.Synchronize();  // the slab is read into again next
  }
  return stats;
}

std::vector<std::string> WritePartitionRows(const std::string& prefix, int world,
                                            const SharedPartition& part, int device) {
  if (device < 0 || part.bytes == 0) {
    return WriteRowFile(prefix, part.rank, world, part.address, part.bytes);
  }
  // Through a bounded pinned slab, as reads: a rank's part never needs a host copy of its size.
  const uint64_t slab_bytes = std::min(part.bytes, DeviceSlabBytes());
  PrimaryContext context(CudaDriver::Get(), device);
  PinnedHostMemory slab(context, slab_bytes);
  Stream stream(context);
  std::vector<std::string> names;
  for (uint64_t offset = 0; offset < part.bytes; offset += slab_bytes) {
    const uint64_t n = std::min(slab_bytes, part.bytes - offset);
    stream.CopyFromDevice(slab.data(), reinterpret_cast<cuda::CUdeviceptr>(part.address + offset),
                          n);
    stream.Synchronize();  // the slab is written before it is filled again
    names =
        WriteRowFile(prefix, part.rank, world, slab.data(), n, offset, offset + n == part.bytes);
  }
  return names;
}

}  // namespace tensortier
