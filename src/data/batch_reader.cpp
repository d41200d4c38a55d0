#include "tensortier/data/batch_reader.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <limits>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "tensortier/data/extent_reader.hpp"
#include "tensortier/data/open_files.hpp"
#include "tensortier/data/open_gang.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/io/page_cache.hpp"
#include "tensortier/transfer/pinned_pool.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace detail {

// Arenas grow in steps of this many bytes, so that batches of similar sizes reuse one.
constexpr uint64_t kArenaGranule = 2u << 20;
// Where samples start in an arena: O_DIRECT's memory alignment on every filesystem we meet.
constexpr uint64_t kSampleAlignment = 4096;
// Pinned arenas come from a pool whose budget only guards against runaway growth.
constexpr uint64_t kPinnedBudget = 64ull << 30;
// BatchReader::map_index_ of a path the extent map does not hold.
constexpr uint64_t kNotMapped = std::numeric_limits<uint64_t>::max();

struct Arena {
  AlignedBuffer plain;
  std::optional<PinnedBuffer> pinned;
  std::byte* data() const noexcept { return pinned ? pinned->data() : plain.data(); }
  size_t size() const noexcept { return pinned ? pinned->size() : plain.size(); }
};

// Arenas that batches gave back, kept for the next batches. Thread-safe.
struct ArenaPoolState {
  std::mutex mu;
  std::vector<std::unique_ptr<Arena>> idle;
  size_t max_idle = 4;
  std::unique_ptr<PinnedPool> pinned_pool;  // set when arenas are pinned

  std::unique_ptr<Arena> Acquire(uint64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu);
      auto best = idle.end();
      for (auto it = idle.begin(); it != idle.end(); ++it) {
        if ((*it)->size() >= bytes && (best == idle.end() || (*it)->size() < (*best)->size())) {
          best = it;
        }
      }
      if (best != idle.end()) {
        std::unique_ptr<Arena> arena = std::move(*best);
        idle.erase(best);
        return arena;
      }
    }
    auto arena = std::make_unique<Arena>();
    const uint64_t size = AlignUp(std::max<uint64_t>(bytes, 1), kArenaGranule);
    if (pinned_pool) {
      arena->pinned = pinned_pool->Acquire(size);
    } else {
      arena->plain = AlignedBuffer(size, Pages::kReused);
    }
    return arena;
  }

  void Return(std::unique_ptr<Arena> arena) noexcept {
    std::lock_guard<std::mutex> lock(mu);
    idle.push_back(std::move(arena));
    if (idle.size() > max_idle) {
      // The smallest goes: the larger ones fit more batches.
      auto smallest = std::min_element(idle.begin(), idle.end(), [](const auto& a, const auto& b) {
        return a->size() < b->size();
      });
      idle.erase(smallest);
      if (pinned_pool) pinned_pool->Trim();
    }
  }
};

// One file of a batch being read.
struct FileSlot {
  uint64_t index = 0;
  File file;
  uint64_t size = 0;
  uint64_t offset = 0;    // in the arena
  bool resident = false;  // wholly in the page cache when opened (read buffered)
  bool raw = false;       // read from the block device by the extent map (not opened)
  bool fallback = false;  // the map holds it, but it changed: read through the filesystem
  bool deferred = false;  // sized by stat, to be opened in a later window of the batch
  dev_t device = 0;       // of a deferred file, checked when it is opened
  ino_t inode = 0;
  std::exception_ptr error;
};

struct PendingBatch {
  std::vector<uint64_t> order;    // the batch's file indices, in order
  std::vector<size_t> slot_of;    // per position of `order`: its slot
  std::vector<FileSlot> slots;    // distinct files
  std::vector<size_t> submitted;  // slots submitted to the engine, in piece order
  std::vector<size_t> deferred;   // slots sized but not opened yet, in order
  std::unique_ptr<Arena> arena;
  Future future;
  std::exception_ptr error;  // the batch fails with this (set before submission)
};

}  // namespace detail

using detail::FileSlot;
using detail::kNotMapped;
using detail::kSampleAlignment;
using detail::PendingBatch;

namespace {

// Opens `path` for reading and sizes it, refusing anything but a regular file (the open does not
// block on a FIFO: File::Open opens non-blocking). A file wholly in the page cache is opened
// buffered only: its O_DIRECT descriptor would never be used, and opening one costs more system
// calls than reading a small cached file (the engine's residency check then has nothing to
// decide). System calls per cached file: open, fcntl, fstat, cachestat (and the close).
void OpenSlot(const std::string& path, bool direct, FileSlot& slot) {
  try {
    struct stat opened{};
    slot.file = File::Open(path, OpenMode::kRead, /*direct=*/false, &opened);
    if (!S_ISREG(opened.st_mode)) ThrowIoError(EINVAL, "open (not a regular file)", path);
    slot.size = static_cast<uint64_t>(opened.st_size);
    if (slot.size == 0) {
      // Sizes come from stat: a file that says 0 bytes but has some (/proc, /sys) would give an
      // empty sample. One byte read tells it from an empty file.
      std::byte probe{};
      ssize_t n;
      do {
        n = pread(slot.file.buffered_fd(), &probe, 1, 0);
      } while (n < 0 && errno == EINTR);
      if (n < 0) ThrowIoError(errno, "read", path, 0, 1);
      struct stat now{};
      if (n > 0 && fstat(slot.file.buffered_fd(), &now) == 0 && now.st_size > 0) {
        // Written since it was opened (empty then): read as it is now, as any file is read at
        // the size it has when opened.
        slot.size = static_cast<uint64_t>(now.st_size);
      } else if (n > 0) {
        ThrowIoError(EINVAL,
                     "read (the file reports a size of 0 bytes but has data, as most /proc "
                     "files do: its size is unknown; copy it to a regular file)",
                     path);
      } else {
        return;
      }
    }
    if (!direct) return;
    const Residency cached =
        QueryResidency(slot.file.buffered_fd(), 0, slot.size, ResidencyMethod::kUnknown, slot.size);
    if (cached.method != ResidencyMethod::kUnknown &&
        cached.resident_bytes >= cached.checked_bytes) {
      slot.resident = true;
      return;
    }
    struct stat again{};
    File with_direct = File::Open(path, OpenMode::kRead, /*direct=*/true, &again);
    if (again.st_ino != opened.st_ino || again.st_dev != opened.st_dev) {
      ThrowIoError(EIO, "open (the file was replaced while opened)", path);
    }
    slot.file = std::move(with_direct);
  } catch (...) {
    slot.file.Close();
    slot.error = std::current_exception();
  }
}

// Sizes `path` by stat without opening it, for a window of the batch after the first:
// OpenDeferredSlot opens it then. The same refusals as OpenSlot's.
void SizeSlot(const std::string& path, FileSlot& slot) noexcept try {
  struct stat st{};
  if (stat(path.c_str(), &st) != 0) {
    slot.error = std::make_exception_ptr(IoError(errno, "stat", path, 0, 0));
    return;
  }
  if (!S_ISREG(st.st_mode)) {
    slot.error = std::make_exception_ptr(IoError(EINVAL, "open (not a regular file)", path, 0, 0));
    return;
  }
  slot.size = static_cast<uint64_t>(st.st_size);
  slot.device = st.st_dev;
  slot.inode = st.st_ino;
  slot.deferred = true;
} catch (...) {  // runs on the open gang's threads, which must not throw (bad_alloc)
  slot.error = std::current_exception();
}

// Opens a file SizeSlot sized, checking that it is still the file it sized.
void OpenDeferredSlot(const std::string& path, bool direct, FileSlot& slot) noexcept try {
  const uint64_t sized = slot.size;
  OpenSlot(path, direct, slot);
  slot.deferred = false;
  if (slot.error) return;
  struct stat now{};
  if (fstat(slot.file.buffered_fd(), &now) != 0) {
    slot.error = std::make_exception_ptr(IoError(errno, "fstat", path, 0, 0));
  } else if (now.st_dev != slot.device || now.st_ino != slot.inode) {
    slot.error = std::make_exception_ptr(
        IoError(EIO, "open (the file was replaced after it was sized)", path, 0, sized));
  } else if (slot.size != sized) {
    slot.error =
        std::make_exception_ptr(IoError(EIO,
                                        StrCat("read (the file changed size while read: ", sized,
                                               " bytes when sized, ", slot.size, " when opened)"),
                                        path, 0, sized));
  }
  if (slot.error) slot.file.Close();
} catch (...) {  // runs on the open gang's threads, which must not throw (bad_alloc)
  slot.error = std::current_exception();
  slot.file.Close();
}

// Whether `error` says the process or the machine ran out of something (descriptors, memory):
// not a fault of the file, so never a file to leave out.
bool IsResourceError(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const IoError& e) {
    return e.error_code() == EMFILE || e.error_code() == ENFILE || e.error_code() == ENOMEM;
  } catch (const std::bad_alloc&) {
    return true;
  } catch (...) {
    return false;
  }
}

// The bytes asked of the engine for a file: with O_DIRECT, the whole file rounded up to the
// alignment (the arena has room: samples start 4 KiB apart at least), so that it is one direct
// read which stops at end of file (IoDesc::may_fill_past_eof), rather than a direct middle and a
// buffered tail (a second request, and on a cold file a synchronous page-cache miss).
uint64_t ReadLength(const FileSlot& slot) {
  if (!slot.file.direct() || slot.file.offset_alignment() > kSampleAlignment) return slot.size;
  return AlignUp(slot.size, slot.file.offset_alignment());
}

// The engine's request for a file's bytes, into its place in the arena.
IoDesc ReadPiece(const FileSlot& slot, const detail::Arena& arena) {
  IoDesc piece{slot.file, arena.data() + slot.offset, 0, ReadLength(slot)};
  piece.may_fill_past_eof = piece.length > slot.size;
  return piece;
}

[[noreturn]] void ThrowSizeChanged(const std::string& path, uint64_t was, uint64_t now) {
  ThrowIoError(
      EIO,
      StrCat("read (the file changed size while read: ", was, " bytes when opened, ", now, " now)"),
      path, 0, was);
}

[[noreturn]] void ThrowSizeChanged(const FileSlot& slot, uint64_t now) {
  ThrowSizeChanged(slot.file.path(), slot.size, now);
}

// A file the extent map holds: read raw when its identity is still the map's (sized by the map,
// not opened), else opened and read as any other file.
template <typename Open>
void PrepareMappedSlot(const std::string& path, const MappedFile& mapped, FileSlot& slot,
                       const Open& open) {
  try {
    std::optional<FileIdentity> now = StatIdentity(path);
    if (now && *now == mapped.identity) {
      slot.raw = true;
      slot.size = mapped.identity.size;
      return;
    }
  } catch (...) {
    slot.error = std::current_exception();
    return;
  }
  slot.fallback = true;
  open();
}

// Per path: its file in `map`, or kNotMapped. A path is looked up as spelled (made absolute:
// relative paths are the caller's, relative to the working directory, not the map root's), then
// by its real folder under the map root's real path, so that a root reached through a symbolic
// link (the reader's file_root or the map's) finds the same files; the identity check before each
// raw read still decides whether the map's extents are the file's. Throws std::invalid_argument
// when the map holds none of the paths: a map of other files would silently never be used.
std::vector<uint64_t> MapIndices(const std::vector<std::string>& paths, const ExtentMap& map) {
  namespace fs = std::filesystem;
  std::vector<uint64_t> index(paths.size(), kNotMapped);
  std::error_code ec;
  const fs::path real_root = fs::canonical(map.root, ec);
  std::unordered_map<std::string, std::optional<fs::path>> real_dirs;  // a few class folders
  size_t found_count = 0;
  for (size_t i = 0; i < paths.size(); ++i) {
    const fs::path absolute = fs::absolute(paths[i], ec).lexically_normal();
    if (ec) continue;
    std::optional<size_t> found = map.Find(absolute.string());
    if (!found && !real_root.empty()) {
      auto [dir, inserted] = real_dirs.try_emplace(absolute.parent_path().string());
      if (inserted) {
        fs::path real = fs::canonical(absolute.parent_path(), ec);
        if (!ec) dir->second = std::move(real);
      }
      if (dir->second) {
        const fs::path relative =
            (*dir->second / absolute.filename()).lexically_relative(real_root);
        if (!relative.empty() && *relative.begin() != "..") found = map.Find(relative.string());
      }
    }
    if (found) {
      index[i] = *found;
      ++found_count;
    }
  }
  if (found_count == 0) {
    throw std::invalid_argument(StrCat("the extent map of '", map.root, "' holds none of the ",
                                       paths.size(), " files read (the first: '", paths.front(),
                                       "'): it was built for other files"));
  }
  return index;
}

std::string Message(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

Batch::~Batch() {
  if (pool_ && arena_) pool_->Return(std::move(arena_));
}

const std::byte* Batch::data() const noexcept {
  return arena_ ? arena_->data() : nullptr;
}

bool Batch::pinned() const noexcept {
  return arena_ && arena_->pinned && arena_->pinned->registered();
}

BatchReader::BatchReader(std::vector<std::string> paths, BatchReaderOptions options)
    : paths_(std::move(paths)), options_(std::move(options)) {
  if (paths_.empty()) throw std::invalid_argument("the reader was given no files");
  if (options_.prefetch == 0) throw std::invalid_argument("prefetch must be at least 1");
  if (options_.open_threads == 0) throw std::invalid_argument("open_threads must be at least 1");
  engine_ = options_.backend_factory
                ? std::make_unique<Engine>(options_.engine, options_.backend_factory)
                : std::make_unique<Engine>(options_.engine);
  if (options_.extent_map) {
    map_index_ = MapIndices(paths_, *options_.extent_map);
    extents_ = std::make_unique<ExtentReader>(std::move(*options_.extent_map), options_.engine,
                                              options_.extent_checksums);
    options_.extent_map.reset();
  }
  open_window_ = detail::OpenFileWindow();
  // The caller's thread opens files too: the gang adds open_threads - 1.
  gang_ = std::make_unique<detail::OpenGang>(options_.open_threads - 1);
  arenas_ = std::make_shared<detail::ArenaPoolState>();
  arenas_->max_idle = options_.prefetch + 2;
  if (options_.pin_memory) {
    PinnedPoolOptions pinned;
    pinned.budget_bytes = detail::kPinnedBudget;
    pinned.device = options_.device;
    arenas_->pinned_pool = std::make_unique<PinnedPool>(pinned);
  }
}

BatchReader::~BatchReader() {
  if (forked()) {
    // Only the thread that called fork() was copied into this child: the producer and the open
    // gang are gone, and the locks and condition variables they held or waited on stay so
    // (joining, or destroying a condition variable with waiters, would block). Their state is
    // left in place; the engines see the fork themselves.
    if (producer_.joinable()) producer_.detach();
    gang_.release();  // NOLINT(bugprone-unused-return-value): left in place
    new std::deque<Ready>(std::move(ready_));
    new std::shared_ptr<detail::ArenaPoolState>(std::move(arenas_));  // pinned: the parent's
    new (&mu_) std::mutex;
    new (&lifecycle_mu_) std::mutex;
    new (&cv_) std::condition_variable;
    return;
  }
  Stop();
}

bool BatchReader::forked() const noexcept {
  return maker_.Forked();
}

void BatchReader::CheckNotForked() const {
  if (forked()) {
    throw std::logic_error(ForkedUseMessage(
        "batch reader", maker_.pid(), "its read-ahead threads do not exist",
        "make the reader in the process that reads from it (in a DataLoader worker, not before "
        "the workers start)"));
  }
}

void BatchReader::Stop() {
  std::lock_guard<std::mutex> lifecycle(lifecycle_mu_);
  StopLocked();
}

void BatchReader::StopLocked() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    ++stops_;
  }
  cv_.notify_all();
  if (producer_.joinable()) producer_.join();
  std::lock_guard<std::mutex> lock(mu_);
  ready_.clear();
  stop_ = false;
}

uint64_t BatchReader::Start(std::vector<std::vector<uint64_t>> batches) {
  CheckNotForked();
  for (const auto& batch : batches) {
    for (uint64_t index : batch) {
      if (index >= paths_.size()) {
        throw std::out_of_range(
            StrCat("file index ", index, " is past the ", paths_.size(), " files of the reader"));
      }
    }
  }
  std::lock_guard<std::mutex> lifecycle(lifecycle_mu_);
  StopLocked();
  uint64_t start = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batches_ = std::move(batches);
    next_to_read_ = 0;
    next_to_return_ = 0;
    start = stops_;
  }
  producer_ = std::thread([this] { Produce(); });
  return start;
}

std::shared_ptr<const Batch> BatchReader::Next() {
  // Before the lock: in a forked child, the parent's producer may have held it at the fork, and
  // nothing would ever release it.
  CheckNotForked();
  uint64_t start = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    start = stops_;
  }
  return Next(start);
}

std::shared_ptr<const Batch> BatchReader::Next(uint64_t start) {
  CheckNotForked();
  std::unique_lock<std::mutex> lock(mu_);
  // A Start() or Stop() from another thread (FileReader.close()) since `start` ends this call,
  // also one that came before it (between the caller's decision to read and this lock): those
  // batches are gone, and nothing would end the wait for them.
  if (stops_ != start || next_to_return_ >= batches_.size()) return nullptr;
  cv_.wait(lock, [&] { return !ready_.empty() || stops_ != start; });
  if (stops_ != start) return nullptr;
  Ready ready = std::move(ready_.front());
  ready_.pop_front();
  ++next_to_return_;
  lock.unlock();
  cv_.notify_all();
  if (ready.error) std::rethrow_exception(ready.error);
  return ready.batch;
}

BatchReaderStats BatchReader::stats() const {
  CheckNotForked();  // before the lock, as in Next(): a producer may have held it at the fork
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void BatchReader::Produce() {
  // Every batch read ahead is submitted as soon as there is room for it, so that the engine
  // always has the next batch queued while it finishes one (waiting on the oldest batch alone
  // would let the disk idle at each batch's end). A batch in flight is waited for in short
  // slices: the caller may make room meanwhile.
  constexpr auto kRecheck = std::chrono::milliseconds(1);
  // Open files are bounded by open_window_ over all batches in flight: a batch is opened with
  // what the batches before it leave; the files it cannot open yet are sized by stat and opened
  // in windows when it is finished, and no batch is started after one that has such files (so
  // that its windows have the whole budget, and a later batch never holds descriptors it waits
  // for).
  std::deque<std::unique_ptr<PendingBatch>> in_flight;
  while (true) {
    std::vector<uint64_t> batch;
    bool take = false;
    size_t held = 0;
    for (const auto& pending : in_flight) {
      for (const FileSlot& slot : pending->slots) held += slot.file.is_open() ? 1 : 0;
    }
    const size_t budget = held < open_window_ ? open_window_ - held : 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto room = [&] {
        return ready_.size() + in_flight.size() < options_.prefetch &&
               (in_flight.empty() || in_flight.back()->deferred.empty());
      };
      auto more = [&] { return next_to_read_ < batches_.size(); };
      if (in_flight.empty()) {
        cv_.wait(lock, [&] { return stop_ || (more() && room()); });
      }
      if (stop_) break;
      if (more() && room()) {
        batch = batches_[next_to_read_++];
        take = true;
      }
    }
    if (take) {
      std::unique_ptr<PendingBatch> pending;
      try {
        pending = Prepare(batch, budget);
      } catch (...) {
        pending = std::make_unique<PendingBatch>();
        pending->error = std::current_exception();
      }
      in_flight.push_back(std::move(pending));
      continue;
    }
    if (in_flight.empty()) continue;
    const Future& oldest = in_flight.front()->future;
    if (oldest.valid() && !oldest.WaitFor(kRecheck)) continue;
    Ready ready;
    try {
      ready.batch = Finish(*in_flight.front());
    } catch (...) {
      ready.error = std::current_exception();
    }
    in_flight.pop_front();
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_.push_back(std::move(ready));
    }
    cv_.notify_all();
  }
  // Stopped: the engine may still be writing into the arenas of batches in flight.
  for (auto& pending : in_flight) {
    if (pending->future.valid()) pending->future.WaitFor(std::chrono::hours(24 * 365));
  }
}

std::unique_ptr<PendingBatch> BatchReader::Prepare(const std::vector<uint64_t>& batch,
                                                   size_t budget) {
  auto pending = std::make_unique<PendingBatch>();
  pending->order = batch;
  std::unordered_map<uint64_t, size_t> seen;
  for (uint64_t index : batch) {
    auto [it, inserted] = seen.emplace(index, pending->slots.size());
    if (inserted) {
      pending->slots.emplace_back();
      pending->slots.back().index = index;
    }
    pending->slot_of.push_back(it->second);
  }
  std::atomic<size_t> opening{0};  // files this batch opens now, of `budget`
  gang_->Run(pending->slots.size(), [&](size_t i) {
    FileSlot& slot = pending->slots[i];
    const std::string& path = paths_[slot.index];
    auto open = [&] {
      if (opening.fetch_add(1) < budget) {
        OpenSlot(path, options_.direct, slot);
      } else {
        SizeSlot(path, slot);
      }
    };
    const uint64_t mapped = map_index_.empty() ? kNotMapped : map_index_[slot.index];
    if (mapped == kNotMapped) {
      open();
    } else {
      PrepareMappedSlot(path, extents_->map().files[mapped], slot, open);
    }
  });
  uint64_t total = 0;
  for (size_t i = 0; i < pending->slots.size(); ++i) {
    FileSlot& slot = pending->slots[i];
    if (slot.error) {
      if (!options_.skip_errors || IsResourceError(slot.error)) {
        pending->error = slot.error;
        return pending;
      }
      continue;
    }
    if (slot.deferred) pending->deferred.push_back(i);
    slot.offset = total;
    total += AlignUp(slot.size, kSampleAlignment);
  }
  if (total == 0) return pending;
  pending->arena = arenas_->Acquire(total);
  std::vector<IoDesc> pieces;
  for (size_t i = 0; i < pending->slots.size(); ++i) {
    FileSlot& slot = pending->slots[i];
    if (slot.error || slot.raw || slot.deferred || slot.size == 0) continue;
    pieces.push_back(ReadPiece(slot, *pending->arena));
    pending->submitted.push_back(i);
  }
  if (!pieces.empty()) pending->future = engine_->Submit(IoOp::kRead, pieces);
  return pending;
}

// The batch's raw files, all in flight together, while its other files are read by the engine.
void BatchReader::ReadRaw(PendingBatch& pending, IoStats& io) {
  std::vector<size_t> raw;  // slots
  for (size_t i = 0; i < pending.slots.size(); ++i) {
    const FileSlot& slot = pending.slots[i];
    if (slot.raw && !slot.error && slot.size > 0) raw.push_back(i);
  }
  if (raw.empty()) return;
  auto request = [&](size_t i) {
    const FileSlot& slot = pending.slots[i];
    // The arena holds the file rounded up to the sample alignment: room for a file that grew a
    // little, which the size check below then refuses.
    return ExtentReadRequest{map_index_[slot.index], pending.arena->data() + slot.offset,
                             AlignUp(slot.size, kSampleAlignment)};
  };
  auto check = [&](size_t i, const ExtentReadResult& result) {
    FileSlot& slot = pending.slots[i];
    if (result.bytes != slot.size) ThrowSizeChanged(paths_[slot.index], slot.size, result.bytes);
    if (!result.raw) {
      // It changed between the check here and the read: the filesystem gave its bytes.
      slot.raw = false;
      slot.fallback = true;
    }
  };
  std::vector<ExtentReadRequest> requests;
  for (size_t i : raw) requests.push_back(request(i));
  try {
    ExtentBatch batch = extents_->ReadBatch(requests);
    io += batch.io;
    for (size_t j = 0; j < raw.size(); ++j) check(raw[j], batch.files[j]);
    return;
  } catch (const std::exception&) {
    if (!options_.skip_errors || IsResourceError(std::current_exception())) throw;
  }
  // A raw read failed and failures are skipped: read the files one by one to leave out only
  // those that fail (rare: a disk error, a file that vanished or grew).
  for (size_t i : raw) {
    const ExtentReadRequest one = request(i);
    try {
      ExtentBatch batch = extents_->ReadBatch({&one, 1});
      io += batch.io;
      check(i, batch.files[0]);
    } catch (const std::exception&) {
      if (IsResourceError(std::current_exception())) throw;
      pending.slots[i].error = std::current_exception();
    }
  }
}

// Opens the next window of a batch's deferred files (as many as open_window_) and submits their
// reads. Only the batch at the front of the queue has deferred files when it is finished, and no
// other batch holds files then: the window may take the whole budget.
void BatchReader::OpenWindow(PendingBatch& pending) {
  const size_t count = std::min(pending.deferred.size(), open_window_);
  gang_->Run(count, [&](size_t j) {
    FileSlot& slot = pending.slots[pending.deferred[j]];
    OpenDeferredSlot(paths_[slot.index], options_.direct, slot);
  });
  std::vector<IoDesc> pieces;
  pending.submitted.clear();
  for (size_t j = 0; j < count; ++j) {
    const size_t i = pending.deferred[j];
    FileSlot& slot = pending.slots[i];
    if (slot.error) {
      if (!options_.skip_errors || IsResourceError(slot.error)) std::rethrow_exception(slot.error);
      continue;
    }
    if (slot.size == 0) continue;
    pieces.push_back(ReadPiece(slot, *pending.arena));
    pending.submitted.push_back(i);
  }
  pending.deferred.erase(pending.deferred.begin(),
                         pending.deferred.begin() + static_cast<std::ptrdiff_t>(count));
  if (!pieces.empty()) pending.future = engine_->Submit(IoOp::kRead, pieces);
}

std::shared_ptr<const Batch> BatchReader::Finish(PendingBatch& pending) {
  if (pending.error) std::rethrow_exception(pending.error);
  IoStats io;
  if (extents_) {
    try {
      ReadRaw(pending, io);
    } catch (...) {
      // The engine may still be writing into the arena: wait before it is given back.
      if (pending.future.valid()) {
        try {
          pending.future.Wait();
        } catch (...) {  // the raw read's error is the batch's
        }
      }
      throw;
    }
  }
  // Window by window: the files opened, read, checked and closed, then the next ones opened.
  while (true) {
    while (pending.future.valid()) {
      try {
        IoResult result = pending.future.Wait();
        pending.future = Future();
        io += result.stats;
        for (size_t j = 0; j < pending.submitted.size(); ++j) {
          FileSlot& slot = pending.slots[pending.submitted[j]];
          if (result.segment_bytes[j] != slot.size) {
            ThrowSizeChanged(slot, result.segment_bytes[j]);
          }
        }
      } catch (const IoError& e) {
        if (!options_.skip_errors || IsResourceError(std::current_exception())) throw;
        // Leave the failed file out and read the others again (their reads may not have run).
        auto failed =
            std::find_if(pending.submitted.begin(), pending.submitted.end(),
                         [&](size_t i) { return pending.slots[i].file.path() == e.path(); });
        if (failed == pending.submitted.end()) throw;
        pending.slots[*failed].error = std::current_exception();
        pending.slots[*failed].file.Close();  // its descriptor counts against the window
        pending.submitted.erase(failed);
        std::vector<IoDesc> pieces;
        for (size_t i : pending.submitted) {
          FileSlot& slot = pending.slots[i];
          pieces.push_back(ReadPiece(slot, *pending.arena));
        }
        if (!pieces.empty()) pending.future = engine_->Submit(IoOp::kRead, pieces);
      }
    }
    // A file that grew while read gave its old size in full: ask again.
    for (FileSlot& slot : pending.slots) {
      if (slot.error || !slot.file.is_open()) continue;
      try {
        struct stat now{};
        if (fstat(slot.file.buffered_fd(), &now) != 0) {
          ThrowIoError(errno, "fstat", slot.file.path());
        }
        if (static_cast<uint64_t>(now.st_size) != slot.size) {
          ThrowSizeChanged(slot, static_cast<uint64_t>(now.st_size));
        }
      } catch (const IoError&) {
        slot.file.Close();
        if (!options_.skip_errors || IsResourceError(std::current_exception())) throw;
        slot.error = std::current_exception();
      }
      slot.file.Close();
    }
    if (pending.deferred.empty()) break;
    OpenWindow(pending);
  }

  std::shared_ptr<Batch> batch(new Batch());
  batch->pool_ = arenas_;
  batch->arena_ = std::move(pending.arena);
  uint64_t bytes = 0;
  for (size_t position = 0; position < pending.order.size(); ++position) {
    const FileSlot& slot = pending.slots[pending.slot_of[position]];
    if (slot.error) continue;
    batch->indices_.push_back(slot.index);
    batch->offsets_.push_back(slot.offset);
    batch->sizes_.push_back(slot.size);
    batch->used_ = std::max(batch->used_, slot.offset + slot.size);
  }
  uint64_t resident_bytes = 0;
  uint64_t raw_files = 0;
  uint64_t fallback_files = 0;
  for (const FileSlot& slot : pending.slots) {
    if (slot.error) {
      batch->skipped_.push_back({slot.index, Message(slot.error)});
    } else {
      bytes += slot.size;
      if (slot.resident) resident_bytes += slot.size;
      raw_files += slot.raw ? 1 : 0;
      fallback_files += slot.fallback ? 1 : 0;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.batches += 1;
  stats_.files += batch->indices_.size();
  stats_.bytes += bytes;
  stats_.skipped += batch->skipped_.size();
  stats_.direct_bytes += io.direct_bytes;
  stats_.cached_bytes += io.cached_bytes + resident_bytes;
  stats_.raw_files += raw_files;
  stats_.fallback_files += fallback_files;
  return batch;
}

}  // namespace tensortier
