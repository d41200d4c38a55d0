#include "tensortier/checkpoint/torch_file_writer.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string_view>

#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr uint64_t kChunk = kCheckpointGroupBytes;  // the input's reads
// The file's image: this many buffers of up to kImageBuffer bytes, all but one being written
// while one fills (on our virtio disk, a few writes in flight keep it busy).
constexpr int kImageBuffers = 4;
constexpr uint64_t kImageBuffer = 8u << 20;
// Tensors with an address and at least this many bytes are written from their own memory; the
// others are copied into the file's image (a write per tensor would cost more than the copy).
constexpr uint64_t kDirectMin = 1u << 20;
constexpr size_t kIdDigits = 40;

size_t BufferSize(uint64_t file_size) {
  return static_cast<size_t>(
      std::clamp<uint64_t>(AlignUp(file_size, kPageSize), kPageSize, kImageBuffer));
}

}  // namespace

// The file from offset 0 to its end: bytes are appended to one of kImageBuffers buffers, each
// written out (at a page-aligned offset, in whole pages but for the file's last) when full while
// the next fills. Bytes of a buffer already written out are patched at the end, after its write.
class TorchImageWriter {
 public:
  TorchImageWriter(Engine& engine, const File& out, uint64_t file_size)
      : engine_(engine), out_(out) {
    const size_t size = BufferSize(file_size);
    // Only as many buffers as the file fills.
    const uint64_t needed = std::max<uint64_t>(1, (file_size + size - 1) / size);
    for (uint64_t b = 0; b < std::min<uint64_t>(kImageBuffers, needed); ++b) {
      bufs_.emplace_back(size, Pages::kReused);
    }
    pending_.resize(bufs_.size());
  }
  // Writes in flight read the buffers: wait for them before the buffers go (on an error).
  ~TorchImageWriter() {
    for (auto& f : pending_) Settle(f);
    for (auto& f : direct_) Settle(f);
    for (auto& f : patch_writes_) Settle(f);
  }
  TorchImageWriter(const TorchImageWriter&) = delete;
  TorchImageWriter& operator=(const TorchImageWriter&) = delete;

  uint64_t pos() const { return base_ + used_; }

  // Room for up to `*n` bytes at pos() (at least one); `*n` becomes what fits. Advance() after.
  std::byte* Room(size_t* n) {
    if (used_ == bufs_[slot_].size()) Flush();
    *n = std::min(*n, bufs_[slot_].size() - used_);
    return bufs_[slot_].data() + used_;
  }
  void Advance(size_t n) { used_ += n; }

  void Append(const void* data, size_t n) {
    const auto* p = static_cast<const std::byte*>(data);
    while (n > 0) {
      size_t k = n;
      std::byte* dst = Room(&k);  // sets k: not in the call's arguments (unordered)
      std::memcpy(dst, p, k);
      Advance(k);
      p += k;
      n -= k;
    }
  }
  void Zeros(size_t n) {
    while (n > 0) {
      size_t k = n;
      std::byte* dst = Room(&k);
      std::memset(dst, 0, k);
      Advance(k);
      n -= k;
    }
  }

  // Bytes at `at` (< pos()) set again: in the buffer when it still holds them, else written once
  // the buffer's write has finished.
  void Put(uint64_t at, const std::string& data) {
    if (at >= base_) {
      std::memcpy(bufs_[slot_].data() + (at - base_), data.data(), data.size());
      return;
    }
    patches_.push_back({at, data});
  }

  // `n` bytes at `data` (alive until WaitDirect or Finish) appended at pos(), which must be page
  // aligned: written from there in whole pages, the rest copied into the next buffer.
  void AppendDirect(const std::byte* data, uint64_t n) {
    if (pos() % kPageSize != 0) throw std::logic_error("TorchImageWriter: direct bytes off a page");
    Flush();
    const uint64_t whole = AlignDown(n, kPageSize);
    if (whole > 0) {
      direct_.push_back(engine_.Write(out_, data, whole, base_));
      base_ += whole;
    }
    Append(data + whole, n - whole);
  }

  // Waits for the writes from the callers' memory (AppendDirect). Throws the first error.
  void WaitDirect() {
    for (auto& f : direct_) Wait(f);
    direct_.clear();
  }

  // Writes what is left and the patches; waits for every write. Throws the first error.
  void Finish() {
    Flush();
    for (auto& f : pending_) Wait(f);
    for (auto& f : direct_) Wait(f);
    for (const auto& p : patches_) {
      patch_writes_.push_back(engine_.Write(out_, p.data.data(), p.data.size(), p.at));
    }
    for (auto& f : patch_writes_) Wait(f);
  }

 private:
  struct Patch {
    uint64_t at;
    std::string data;
  };

  static void Settle(Future& f) {
    if (!f.valid()) return;
    try {
      f.Wait();
    } catch (...) {  // the error being thrown already is the one to report
    }
  }
  static void Wait(Future& f) {
    if (f.valid()) {
      Future done = std::move(f);
      f = Future();
      done.Wait();
    }
  }

  // Writes the current buffer (if it holds anything) and moves to the other one.
  void Flush() {
    if (used_ == 0) return;
    pending_[slot_] = engine_.Write(out_, bufs_[slot_].data(), used_, base_);
    base_ += used_;
    used_ = 0;
    slot_ = (slot_ + 1) % bufs_.size();
    Wait(pending_[slot_]);  // its earlier write read from it
  }

  Engine& engine_;
  const File& out_;
  std::vector<AlignedBuffer> bufs_;
  std::vector<Future> pending_;
  size_t slot_ = 0;
  uint64_t base_ = 0;  // file offset of the current buffer's first byte
  size_t used_ = 0;
  std::vector<Future> direct_;
  std::vector<Patch> patches_;
  std::vector<Future> patch_writes_;
};

namespace {

constexpr const char* kByteorder = "little";
constexpr const char* kVersion = "3\n";

}  // namespace

void HostTensorBytes::Copy(size_t index, std::byte* dst, size_t n) {
  std::memcpy(dst, addresses_[index] + done_[index], n);
  done_[index] += n;
}

FileTensorBytes::FileTensorBytes(Engine& engine, const File& file, std::vector<uint64_t> offsets,
                                 std::vector<uint64_t> nbytes)
    : engine_(engine), file_(file), offsets_(std::move(offsets)), done_(offsets_.size(), 0) {
  for (size_t i = 0; i < offsets_.size(); ++i) {
    if (i > 0 && offsets_[i] < end_ && nbytes[i] > 0) {
      throw std::invalid_argument("FileTensorBytes: tensors out of order or overlapping");
    }
    if (nbytes[i] > 0) end_ = offsets_[i] + nbytes[i];
  }
  // No larger than what there is to read: a file of tiny tensors maps no 64 MiB buffers.
  const uint64_t span = !offsets_.empty() && end_ > offsets_.front() ? end_ - offsets_.front() : 0;
  bufs_[0] = AlignedBuffer(std::min(kChunk, span), Pages::kReused);
  bufs_[1] = AlignedBuffer(std::min(kChunk, span), Pages::kReused);
}

FileTensorBytes::~FileTensorBytes() {
  for (auto& f : pending_) {
    if (!f.valid()) continue;
    try {
      f.Wait();
    } catch (...) {  // an error of a read nobody needs
    }
  }
}

void FileTensorBytes::Fetch(int slot, uint64_t offset) {
  chunk_offset_[slot] = offset;
  chunk_bytes_[slot] = std::min<uint64_t>(kChunk, end_ - offset);
  pending_[slot] = engine_.Read(file_, bufs_[slot].data(), chunk_bytes_[slot], offset);
}

void FileTensorBytes::Advance() {
  const int next = current_ < 0 ? 0 : 1 - current_;
  if (!pending_[next].valid()) throw std::logic_error("FileTensorBytes: read past the end");
  Future f = std::move(pending_[next]);
  pending_[next] = Future();
  const IoResult r = f.Wait();
  if (r.bytes != chunk_bytes_[next]) {
    throw FormatError(
        StrCat(file_.path(), ": truncated: end of file at offset ", chunk_offset_[next] + r.bytes));
  }
  current_ = next;
  const uint64_t after = chunk_offset_[next] + chunk_bytes_[next];
  if (after < end_) Fetch(1 - next, after);
}

void FileTensorBytes::Copy(size_t index, std::byte* dst, size_t n) {
  if (current_ < 0 && !pending_[0].valid()) Fetch(0, offsets_.front());
  uint64_t at = offsets_[index] + done_[index];
  done_[index] += n;
  while (n > 0) {
    if (current_ < 0 || at >= chunk_offset_[current_] + chunk_bytes_[current_]) {
      Advance();
      continue;
    }
    const uint64_t skip = at - chunk_offset_[current_];
    const size_t k = static_cast<size_t>(std::min<uint64_t>(n, chunk_bytes_[current_] - skip));
    std::memcpy(dst, bufs_[current_].data() + skip, k);
    dst += k;
    at += k;
    n -= k;
  }
}

TorchFileWriter::TorchFileWriter(const std::vector<TorchPickleTensor>& tensors,
                                 std::vector<uint64_t> nbytes, TorchFileOptions options)
    : pickle_(SerializeTorchPickle(tensors)),
      nbytes_(std::move(nbytes)),
      options_(std::move(options)),
      zip_(kPageSize) {
  if (nbytes_.size() != tensors.size()) {
    throw std::invalid_argument("TorchFileWriter: one size per tensor");
  }
  keys_.reserve(tensors.size());
  for (const auto& t : tensors) keys_.push_back(t.storage_key);
  AddRecords();
}

TorchFileWriter::TorchFileWriter(std::string pickle, std::vector<uint64_t> nbytes,
                                 TorchFileOptions options)
    : pickle_(std::move(pickle)),
      nbytes_(std::move(nbytes)),
      options_(std::move(options)),
      zip_(kPageSize) {
  keys_.reserve(nbytes_.size());
  for (size_t i = 0; i < nbytes_.size(); ++i) keys_.push_back(std::to_string(i));
  AddRecords();
}

TorchFileWriter::~TorchFileWriter() = default;

void TorchFileWriter::AddRecords() {
  const std::string& f = options_.folder;  // names concatenated: StrCat costs per tensor
  zip_.Add(f + "/data.pkl", pickle_.size());
  zip_.Add(f + "/byteorder", std::strlen(kByteorder));
  const std::string data = f + "/data/";
  for (size_t i = 0; i < keys_.size(); ++i) {
    storage_entries_.push_back(zip_.Add(data + keys_[i], nbytes_[i]));
  }
  zip_.Add(f + "/version", std::strlen(kVersion));
  zip_.Add(f + "/.data/serialization_id", kIdDigits);
}

uint64_t TorchFileWriter::size() const {
  return zip_.directory_offset() + zip_.Directory().size();
}

void TorchFileWriter::Write(Engine& engine, const File& out, TensorBytes& bytes) {
  Begin(engine, out);
  WriteStorages(bytes, nbytes_.size(), false);  // End() waits for the direct writes
  End();
}

namespace {

// A record whose bytes are known: its header, then them.
void SmallRecord(ZipPlanner& zip, TorchImageWriter& image, size_t index, std::string_view data,
                 bool crcs) {
  zip.SetCrc(index, crcs ? Crc32(data.data(), data.size()) : 0u);
  const std::string header = zip.LocalHeader(index);
  image.Append(header.data(), header.size());
  image.Append(data.data(), data.size());
}

}  // namespace

void TorchFileWriter::Begin(Engine& engine, const File& out) {
  if (image_ != nullptr || next_entry_ != 0) throw std::logic_error("TorchFileWriter: written");
  image_ = std::make_unique<TorchImageWriter>(engine, out, size());
  try {
    SmallRecord(zip_, *image_, next_entry_++, pickle_, options_.crc32);
    SmallRecord(zip_, *image_, next_entry_++, kByteorder, options_.crc32);
  } catch (...) {
    image_.reset();  // waits for every write in flight
    throw;
  }
}

void TorchFileWriter::Abandon() noexcept {
  image_.reset();
}

void TorchFileWriter::WriteStorages(TensorBytes& bytes, size_t count) {
  WriteStorages(bytes, count, true);
}

void TorchFileWriter::WriteStorages(TensorBytes& bytes, size_t count, bool release) {
  if (image_ == nullptr || next_storage_ + count > nbytes_.size()) {
    throw std::logic_error("TorchFileWriter: storages out of turn");
  }
  TorchImageWriter& image = *image_;
  const bool crcs = options_.crc32;
  try {
    for (size_t j = 0; j < count; ++j, ++next_storage_, ++next_entry_) {
      const size_t index = next_entry_;
      const ZipPlanEntry& e = zip_.entries()[index];
      const uint64_t n = nbytes_[next_storage_];
      const std::byte* address = n >= kDirectMin ? bytes.Address(j) : nullptr;
      if (address != nullptr) {
        zip_.SetCrc(index, crcs ? Crc32(address, n) : 0u);
        const std::string header = zip_.LocalHeader(index);
        image.Append(header.data(), header.size());
        image.AppendDirect(address, n);
        continue;
      }
      // Copied into the image, its CRC-32 computed on the way: the header goes in front after.
      const uint64_t header_at = image.pos();
      image.Zeros(e.data_offset - e.local_header_offset);
      uint32_t crc = 0;
      for (uint64_t left = n; left > 0;) {
        size_t k = static_cast<size_t>(std::min<uint64_t>(left, kChunk));
        std::byte* p = image.Room(&k);
        bytes.Copy(j, p, k);
        if (crcs) crc = Crc32(p, k, crc);
        image.Advance(k);
        left -= k;
      }
      zip_.SetCrc(index, crc);
      image.Put(header_at, zip_.LocalHeader(index));
    }
    if (release) image.WaitDirect();  // the callers' memory is theirs again
  } catch (...) {
    image_.reset();  // waits for every write in flight
    throw;
  }
}

void TorchFileWriter::End() {
  if (image_ == nullptr || next_storage_ != nbytes_.size()) {
    throw std::logic_error("TorchFileWriter: storages left to write");
  }
  std::unique_ptr<TorchImageWriter> image = std::move(image_);
  const bool crcs = options_.crc32;
  SmallRecord(zip_, *image, next_entry_++, kVersion, crcs);
  // Like torch's id: a hash of the record names and one of their CRCs, 20 decimal digits each.
  Xxh64State names;
  Xxh64State crc_hash;
  for (size_t k = 0; k < next_entry_; ++k) {
    const ZipPlanEntry& e = zip_.entries()[k];
    names.Update(e.name.data(), e.name.size() + 1);  // with the NUL: names stay delimited
    crc_hash.Update(&e.crc32, sizeof(e.crc32));
  }
  char id[kIdDigits + 1];
  std::snprintf(id, sizeof(id), "%020llu%020llu", static_cast<unsigned long long>(names.Digest()),
                static_cast<unsigned long long>(crc_hash.Digest()));
  SmallRecord(zip_, *image, next_entry_++, std::string_view(id, kIdDigits), crcs);
  const std::string directory = zip_.Directory();
  image->Append(directory.data(), directory.size());
  if (image->pos() != size()) throw std::logic_error("TorchFileWriter: file size changed");
  image->Finish();
}

}  // namespace tensortier
