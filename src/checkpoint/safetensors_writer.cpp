#include "tensortier/checkpoint/safetensors_writer.hpp"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/checkpoint/small_pieces.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// Tensors smaller than this are gathered with their neighbours into large writes; larger ones
// are written from their own memory (a copy would cost more than the request).
constexpr uint64_t kGatherBelow = 1u << 20;

void SettleWrites(std::vector<Future>& writes) {
  for (auto& f : writes) {
    try {
      f.Wait();
    } catch (...) {  // the error being thrown already is the one to report
    }
  }
}

}  // namespace

SafetensorsFileWriter::SafetensorsFileWriter(std::vector<SafetensorsTensor> tensors,
                                             SafetensorsMetadata metadata, bool checksum)
    : metadata_(std::move(metadata)), checksum_(checksum) {
  std::string reserved;
  for (const char* key : {kTensorChecksumsKey, kHeaderChecksumKey}) {
    if (metadata_.count(key) != 0) reserved += StrCat(reserved.empty() ? "" : ", ", "'", key, "'");
  }
  if (!reserved.empty()) {
    // Without checksum=True they would be stale checksums a later verify fails on.
    throw std::invalid_argument(StrCat("metadata keys [", reserved,
                                       "] are tensortier's checksums: leave them out "
                                       "(save(..., checksum=True) writes fresh ones)"));
  }
  metadata_.emplace("format", "pt");  // as save_model / save_pretrained write it
  std::vector<uint64_t> sizes;
  std::vector<unsigned> widths;
  sizes.reserve(tensors.size());
  widths.reserve(tensors.size());
  entries_.reserve(tensors.size());
  for (auto& t : tensors) {
    const Dtype* row = DtypeNamed(t.dtype);
    if (row == nullptr || row->safetensors.empty()) {
      throw std::invalid_argument(
          StrCat("tensor '", t.name, "' has dtype ", t.dtype, ", which safetensors cannot store"));
    }
    std::vector<uint64_t> shape = SafetensorsShape(t.name, t.dtype, std::move(t.shape));
    sizes.push_back(t.nbytes);
    widths.push_back(TorchDtypeBytes(t.dtype));
    entries_.push_back({std::move(t.name), std::string(row->safetensors), std::move(shape), 0, 0});
  }
  const std::vector<uint64_t> starts = PlanSafetensorsLayout(sizes, widths);
  for (size_t i = 0; i < entries_.size(); ++i) {
    entries_[i].begin = starts[i];
    entries_[i].end = starts[i] + sizes[i];
    data_bytes_ = std::max(data_bytes_, entries_[i].end);
  }
  sums_.assign(entries_.size(), 0);
  written_.assign(entries_.size(), false);
  left_ = entries_.size();
  if (checksum_) {  // zeros of the final length: the real header replaces this one at the end
    std::vector<std::pair<std::string, uint64_t>> zeros;
    zeros.reserve(entries_.size());
    for (const auto& e : entries_) zeros.emplace_back(e.name, 0);
    SetChecksumMetadata(entries_, zeros, metadata_);
  }
  header_ = SerializeSafetensorsHeader(entries_, metadata_, kCheckpointAlignment);
  data_start_ = header_.size();
}

void SafetensorsFileWriter::WriteTensors(Engine& engine, const File& out,
                                         const std::vector<size_t>& indices,
                                         const std::vector<const std::byte*>& addresses) {
  if (addresses.size() != indices.size()) {
    throw std::invalid_argument("SafetensorsFileWriter: one address per tensor");
  }
  std::vector<GatheredWrite> small;
  std::vector<size_t> small_index;
  std::vector<size_t> large;
  for (size_t k = 0; k < indices.size(); ++k) {
    const size_t i = indices[k];
    if (i >= entries_.size() || written_[i]) {
      throw std::invalid_argument(StrCat("SafetensorsFileWriter: tensor ", i, " out of turn"));
    }
    written_[i] = true;
    --left_;
    const uint64_t n = entries_[i].end - entries_[i].begin;
    if (n == 0) {
      sums_[i] = Xxh64(nullptr, 0);
    } else if (n < kGatherBelow) {
      small.push_back({data_start_ + entries_[i].begin, n, addresses[k]});
      small_index.push_back(i);
    } else {
      large.push_back(k);
    }
  }
  std::vector<Future> writes;
  writes.reserve(large.size());
  try {
    for (size_t k : large) {
      const SafetensorsEntry& e = entries_[indices[k]];
      writes.push_back(engine.Write(out, addresses[k], e.end - e.begin, data_start_ + e.begin));
    }
    if (!small.empty()) {
      const std::vector<uint64_t> hashes = WriteGathered(engine, out, small, checksum_);
      for (size_t j = 0; j < hashes.size(); ++j) sums_[small_index[j]] = hashes[j];
    }
    if (checksum_) {  // while the engine writes them
      for (size_t k : large) {
        const SafetensorsEntry& e = entries_[indices[k]];
        sums_[indices[k]] = Xxh64(addresses[k], e.end - e.begin);
      }
    }
    for (auto& f : writes) {
      Future done = std::move(f);
      f = Future();
      done.Wait();
    }
  } catch (...) {
    SettleWrites(writes);
    throw;
  }
}

void SafetensorsFileWriter::WriteHeader(Engine& engine, const File& out) {
  if (left_ != 0) throw std::logic_error("SafetensorsFileWriter: tensors left to write");
  if (checksum_) {
    std::vector<std::pair<std::string, uint64_t>> sums;
    sums.reserve(entries_.size());
    for (size_t i = 0; i < entries_.size(); ++i) sums.emplace_back(entries_[i].name, sums_[i]);
    SetChecksumMetadata(entries_, sums, metadata_);
    header_ = SerializeSafetensorsHeader(entries_, metadata_, kCheckpointAlignment);
    if (header_.size() != data_start_) {  // cannot happen: fixed-width hex digits
      throw std::logic_error("safetensors header changed length after checksumming");
    }
  }
  engine.Write(out, header_.data(), header_.size(), 0).Wait();
}

}  // namespace tensortier
