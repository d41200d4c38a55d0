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

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
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

constexpr uint64_t kPage = 4096;
constexpr uint64_t kSmallAlign = 64;
// Tensors of this size or more go from their memory to the file in requests of their own; the
// rest are gathered (with the zip records around them) into large writes and reads.
constexpr uint64_t kOwnRequest = 1u << 20;
constexpr const char* kFolder = "archive/";

std::string Range(uint64_t offset, uint64_t length) {
  return StrCat("bytes [", offset, ", ", offset + length, ")");
}

// [offset, offset + length) of another source, as a source of its own (offsets from 0).
class RangeSource : public ByteSource {
 public:
  RangeSource(const ByteSource& whole, const std::string& item, uint64_t offset, uint64_t length)
      : whole_(whole),
        offset_(offset),
        length_(length),
        name_(StrCat(whole.name(), ": item '", item, "' at ", Range(offset, length))) {
    if (offset > whole.size() || length > whole.size() - offset) {
      throw FormatError(StrCat(name_, " runs past the end of the file (", whole.size(),
                               " bytes): the file is truncated"));
    }
  }
  uint64_t size() const override { return length_; }
  const std::string& name() const override { return name_; }
  void ReadAt(uint64_t offset, void* buf, size_t len) const override {
    if (offset > length_ || len > length_ - offset) {
      throw FormatError(StrCat(name_, ": a read at ", Range(offset, len), " past the item"));
    }
    whole_.ReadAt(offset_ + offset, buf, len);
  }

 private:
  const ByteSource& whole_;
  uint64_t offset_;
  uint64_t length_;
  std::string name_;
};

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

// Runs `step`; an IoError from it is thrown again naming `who` and `path` where it named a
// temporary file (removed by then: the user knows the file by its final name).
template <class Step>
auto Naming(const std::string& who, const std::string& path, Step&& step) {
  try {
    return step();
  } catch (const IoError& e) {
    if (who.empty()) throw;
    const bool temporary = e.path().find(".tmp-") != std::string::npos;
    throw IoError(e.error_code(), StrCat(who, ": ", e.op()), temporary ? path : e.path(),
                  e.offset(), e.length());
  }
}

// An exclusive flock on DIR/.tensortier-dcp.lock, held while alive: commits into one directory
// (the rename of .metadata and the cleanup after it) take turns. The cleanup and readers ignore
// the file (not "__*.distcp", not ".__*").
class CommitLock {
 public:
  explicit CommitLock(const std::string& dir) : path_(StrCat(dir, "/.tensortier-dcp.lock")) {
    fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw IoError(errno, "open the commit lock", path_, 0, 0);
    while (flock(fd_, LOCK_EX) != 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      close(fd_);
      throw IoError(err, "lock the commit lock", path_, 0, 0);
    }
  }
  ~CommitLock() { close(fd_); }  // closing releases the flock
  CommitLock(const CommitLock&) = delete;
  CommitLock& operator=(const CommitLock&) = delete;

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace

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
    const uint64_t align = it.nbytes >= kPage ? kPage : kSmallAlign;
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
  std::vector<GatheredWrite> gathered;
  std::vector<Future> own;
  struct SettleOwn {
    std::vector<Future>& f;
    ~SettleOwn() { Settle(f); }
  } settle{own};
  // The large tensors first: the disk works on them while the rest is hashed and gathered.
  std::vector<bool> alone(items_.size(), false);
  for (size_t i = 0; i < items_.size(); ++i) {
    const DcpWriteItem& it = items_[i];
    if (it.nbytes >= kOwnRequest && places_[i].data_offset % kPage == 0) {
      alone[i] = true;
      own.push_back(engine.Write(file, it.src, it.nbytes, places_[i].data_offset));
    }
  }
  for (size_t i = 0; i < items_.size(); ++i) {
    const DcpWriteItem& it = items_[i];
    DcpItemPlace& p = places_[i];
    Xxh64State h;
    h.Update(heads_[i].data(), heads_[i].size());
    h.Update(it.src, it.nbytes);
    h.Update(tails_[i].data(), tails_[i].size());
    p.xxh64 = h.Digest();
    const auto* head = reinterpret_cast<const std::byte*>(heads_[i].data());
    const auto* tail = reinterpret_cast<const std::byte*>(tails_[i].data());
    gathered.push_back({p.offset, heads_[i].size(), head});
    if (!alone[i]) gathered.push_back({p.data_offset, it.nbytes, it.src});
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
                                       const std::string& who) {
  DcpFilePlan plan(std::move(items));
  Naming(who.empty() ? who : StrCat(who, " saving its DCP data file"), path, [&] {
    DurableFile out(path, direct);
    out.Reserve(plan.size());
    plan.Write(engine, out.file());
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
    throw IoError(e.error_code(),
                  StrCat(e.op(), " of the data file the metadata names for item '", items[0],
                         "'", more),
                  e.path(), e.offset(), e.length());
  }
}

DcpTensorItem ReadDcpTensorItem(const File& file, const std::string& name, uint64_t offset,
                                uint64_t length,
                                const std::optional<std::vector<int64_t>>& expected_shape) {
  FileSource whole(file);
  RangeSource item(whole, name, offset, length);
  const TorchCheckpoint c = ReadTorchCheckpoint(item);
  const auto& tensors = c.pickle.tensors;
  if (tensors.size() != 1 || !tensors[0].path.empty() || c.pickle.other_values != 0) {
    throw FormatError(StrCat(item.name(), ": not a torch.save zip of one tensor"));
  }
  const TorchTensor& t = tensors[0];
  if (t.meta || c.big_endian || t.conj || t.neg) {
    throw FormatError(
        StrCat(item.name(), ": a meta, big-endian, conjugate or negative tensor (not supported)"));
  }
  if (expected_shape && *expected_shape != t.shape) {
    throw FormatError(StrCat(item.name(), ": the metadata gives it the shape ",
                             ShapeText(*expected_shape), ", the tensor stored in the file has ",
                             ShapeText(t.shape), ": the metadata does not match the data file"));
  }
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
  if (RecordsCrcs(c.zip)) out.crc32 = e->crc32;
  return out;
}

void ReadDcpItems(Engine& engine, const File& file, std::span<const DcpRead> reads) {
  // Each item in up to three pieces: the zip records before its data (kept for the xxh64), the
  // data into its destination, the records after it.
  std::vector<std::string> heads(reads.size()), tails(reads.size());
  std::vector<ScatteredRead> scattered;
  std::vector<std::pair<size_t, uint64_t>> piece_of;  // scattered index -> (item, expected)
  std::vector<Future> own;
  std::vector<size_t> own_item;
  struct SettleOwn {
    std::vector<Future>& f;
    ~SettleOwn() { Settle(f); }
  } settle{own};
  for (size_t i = 0; i < reads.size(); ++i) {
    const DcpRead& r = reads[i];
    if (r.data_offset < r.offset || r.data_length > r.offset + r.length - r.data_offset) {
      throw std::invalid_argument(StrCat(file.path(), ": item '", r.name, "': data outside it"));
    }
    if (r.data_length >= kOwnRequest) {
      own.push_back(engine.Read(file, r.dest, r.data_length, r.data_offset));
      own_item.push_back(i);
    } else if (r.data_length > 0) {
      scattered.push_back({r.data_offset, r.data_length, r.dest});
      piece_of.emplace_back(i, r.data_length);
    }
    if (!r.xxh64) continue;
    heads[i].resize(r.data_offset - r.offset);
    tails[i].resize(r.offset + r.length - r.data_offset - r.data_length);
    if (!heads[i].empty()) {
      scattered.push_back(
          {r.offset, heads[i].size(), reinterpret_cast<std::byte*>(heads[i].data())});
      piece_of.emplace_back(i, heads[i].size());
    }
    if (!tails[i].empty()) {
      scattered.push_back({r.data_offset + r.data_length, tails[i].size(),
                           reinterpret_cast<std::byte*>(tails[i].data())});
      piece_of.emplace_back(i, tails[i].size());
    }
  }
  auto truncated = [&](size_t i) {
    const DcpRead& r = reads[i];
    return FormatError(StrCat(file.path(), ": item '", r.name, "' at ", Range(r.offset, r.length),
                              ": the file ends inside it (truncated)"));
  };
  const std::vector<uint64_t> got = ReadScattered(engine, file, scattered);
  for (size_t k = 0; k < got.size(); ++k) {
    if (got[k] != piece_of[k].second) throw truncated(piece_of[k].first);
  }
  for (size_t k = 0; k < own.size(); ++k) {
    Future f = std::move(own[k]);
    own[k] = Future();
    if (f.Wait().bytes != reads[own_item[k]].data_length) throw truncated(own_item[k]);
  }
  for (size_t i = 0; i < reads.size(); ++i) {
    const DcpRead& r = reads[i];
    if (r.xxh64) {
      Xxh64State h;
      h.Update(heads[i].data(), heads[i].size());
      h.Update(r.dest, r.data_length);
      h.Update(tails[i].data(), tails[i].size());
      const uint64_t actual = h.Digest();
      if (actual != *r.xxh64) {
        throw FormatError(StrCat(
            file.path(), ": item '", r.name, "' at ", Range(r.offset, r.length), ": its xxh64 is ",
            Hex16(actual), ", the metadata records ", Hex16(*r.xxh64), ": the file is damaged"));
      }
    } else if (r.crc32) {
      const uint32_t actual = Crc32(r.dest, r.data_length);
      if (actual != *r.crc32) {
        throw FormatError(StrCat(file.path(), ": item '", r.name, "' at ",
                                 Range(r.offset, r.length), ": the CRC-32 of its data (",
                                 Range(r.data_offset, r.data_length), ") is ", Hex8(actual),
                                 ", its zip records ", Hex8(*r.crc32), ": the file is damaged"));
      }
    }
  }
}

uint64_t DcpRangeXxh64(Engine& engine, const File& file, uint64_t offset, uint64_t length) {
  StreamBuffers buffers(std::max<uint64_t>(1, std::min(length, kCheckpointGroupBytes)));
  Xxh64State h;
  StreamRange(engine, file, offset, length, buffers,
              [&](std::byte* p, size_t n) { h.Update(p, n); });
  return h.Digest();
}

size_t RemoveUnreferencedDcpFiles(const std::string& dir,
                                  const std::vector<std::string>& referenced) {
  const std::set<std::string> keep(referenced.begin(), referenced.end());
  std::vector<std::string> unreferenced;
  std::set<std::string> saved_names;  // NAME of each ".NAME.tmp-..." file
  {
    std::unique_ptr<DIR, int (*)(DIR*)> d(opendir(dir.c_str()), closedir);
    if (!d) throw IoError(errno, "opendir", dir, 0, 0);
    while (const dirent* e = readdir(d.get())) {
      const std::string name = e->d_name;
      if (name.starts_with("__") && name.ends_with(".distcp") && !keep.contains(name)) {
        unreferenced.push_back(name);
      }
      const size_t tmp = name.find(".tmp-");
      if (name.starts_with(".__") && tmp != std::string::npos) {
        saved_names.insert(name.substr(1, tmp - 1));
      }
    }
  }
  size_t removed = 0;
  for (const auto& name : unreferenced) {
    if (unlink(StrCat(dir, "/", name).c_str()) == 0) ++removed;
  }
  for (const auto& name : saved_names) removed += RemoveStaleTemporaryFiles(StrCat(dir, "/", name));
  FileSystem().SyncDirectory(dir, dir);
  return removed;
}

size_t CommitDcpCheckpoint(Engine& engine, const std::string& dir, std::string_view metadata,
                           const std::vector<std::string>& referenced, const std::string& who) {
  const std::string path = StrCat(dir, "/.metadata");
  bool replaced = false;  // the rename made the new metadata the directory's
  const CommitLock lock(dir);
  try {
    // A save that committed into the directory meanwhile removed the files its metadata does not
    // name: this one's, if they were written before its commit. Committing would name them.
    for (const auto& name : referenced) {
      struct stat st;
      const std::string file = StrCat(dir, "/", name);
      if (stat(file.c_str(), &st) != 0) {
        throw IoError(errno, StrCat(who.empty() ? "" : StrCat(who, ": "),
                                    "commit the DCP checkpoint (its data file is gone: another "
                                    "save into this directory committed meanwhile and removed it; "
                                    "the directory keeps that save's checkpoint)"),
                      file, 0, 0);
      }
    }
    Naming(who.empty() ? who : StrCat(who, " committing the checkpoint"), path, [&] {
      DurableFile out(path, /*direct=*/false);
      try {
        if (!metadata.empty()) engine.Write(out.file(), metadata.data(), metadata.size(), 0).Wait();
        out.Commit();
      } catch (...) {
        replaced = out.committed();
        throw;
      }
    });
  } catch (...) {
    // The new checkpoint never became the directory's: its data files would only hold space
    // (on a full disk, the space the next save needs).
    if (!replaced) {
      for (const auto& name : referenced) unlink(StrCat(dir, "/", name).c_str());
    }
    throw;
  }
  return RemoveUnreferencedDcpFiles(dir, referenced);
}

DcpVerifyReport VerifyDcpCheckpoint(Engine& engine, const std::string& dir,
                                    const DcpMetadata& metadata) {
  DcpVerifyReport report;
  std::map<std::string, std::optional<File>> files;  // nullopt: could not be opened
  for (const DcpStoredItem& item : metadata.items) {
    const std::string path = StrCat(dir, "/", item.relative_path);
    auto [it, added] = files.try_emplace(item.relative_path);
    if (added) {
      try {
        it->second = OpenCheckpointForReading(path, /*direct=*/true);
      } catch (const IoError& e) {
        report.problems.push_back(e.what());
      }
    }
    if (!it->second) continue;
    const File& file = *it->second;
    const std::string where =
        StrCat(path, ": item '", item.name, "' at ", Range(item.offset, item.length));
    try {
      if (item.transformed) {
        report.problems.push_back(StrCat(where, ": stored through stream transforms (not read)"));
      } else if (item.offset > file.Size() || item.length > file.Size() - item.offset) {
        report.problems.push_back(StrCat(where, ": past the end of the file (", file.Size(),
                                         " bytes): the file is truncated"));
      } else if (item.xxh64) {
        const uint64_t actual = DcpRangeXxh64(engine, file, item.offset, item.length);
        ++report.checked;
        if (actual != *item.xxh64) {
          report.problems.push_back(StrCat(where, ": its xxh64 is ", Hex16(actual),
                                           ", the metadata records ", Hex16(*item.xxh64)));
        }
      } else if (!item.bytes) {
        const DcpTensorItem t = ReadDcpTensorItem(file, item.name, item.offset, item.length);
        if (!t.crc32) {
          ++report.unchecked;
          continue;
        }
        StreamBuffers buffers(std::max<uint64_t>(1, std::min(t.nbytes, kCheckpointGroupBytes)));
        uint32_t crc = 0;
        StreamRange(engine, file, t.data_offset, t.nbytes, buffers,
                    [&](std::byte* p, size_t n) { crc = Crc32(p, n, crc); });
        ++report.checked;
        if (crc != *t.crc32) {
          report.problems.push_back(StrCat(where, ": its data's CRC-32 is ", Hex8(crc),
                                           ", its zip records ", Hex8(*t.crc32)));
        }
      } else {
        ++report.unchecked;
      }
    } catch (const FormatError& e) {
      report.problems.push_back(e.what());
    }
  }
  return report;
}

}  // namespace tensortier
