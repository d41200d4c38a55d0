#include "tensortier/offload/offloader.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <stdexcept>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "tensortier/io/backend.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/process_identity.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr std::string_view kFilePrefix = "tensortier-offload-";
constexpr std::string_view kFileSuffix = ".bin";

// "<prefix><stamp>-" for this process (see ProcessStamp, not cached: a child made by fork() is
// another process, and its files must carry its own stamp to be recognised as stale once it dies).
std::string ProcessFileStem() { return StrCat(kFilePrefix, ProcessStamp(), "-"); }

std::atomic<uint64_t> next_instance{0};

bool IsDecimal(std::string_view s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
}

// Whether no process holds `name` (in `dir_fd`) open: a live offloader keeps a shared flock on
// each of its files, which the kernel drops when the process dies, in any pid namespace or
// container (and through NFS's lock manager across machines). Only a lock taken proves it.
bool NobodyHolds(int dir_fd, const char* name) {
  const int fd = openat(dir_fd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return false;
  const bool free = flock(fd, LOCK_EX | LOCK_NB) == 0;
  close(fd);
  return free;
}

// For "<prefix><stamp>-<instance>-<dir index><suffix>": whether the process that made it is gone.
// A stamp of this pid namespace is judged by its pid and start time; one of another namespace
// (another container, or this machine before a reboot) by its lock alone, since its pid means
// nothing here. Names without a namespace tag (made before stamps had one) are judged by both.
bool IsStale(int dir_fd, const char* file_name) {
  std::string_view name = file_name;
  if (!name.starts_with(kFilePrefix) || !name.ends_with(kFileSuffix)) return false;
  name.remove_prefix(kFilePrefix.size());
  name.remove_suffix(kFileSuffix.size());
  // <pid>-<start>-[<tag>-]<instance>-<dir index>
  std::vector<std::string_view> fields;
  for (size_t begin = 0;;) {
    const size_t dash = name.find('-', begin);
    fields.push_back(name.substr(begin, dash == std::string_view::npos ? dash : dash - begin));
    if (dash == std::string_view::npos) break;
    begin = dash + 1;
  }
  if (fields.size() != 4 && fields.size() != 5) return false;
  for (size_t i : {size_t{0}, size_t{1}, fields.size() - 2, fields.size() - 1}) {
    if (!IsDecimal(fields[i])) return false;
  }
  if (fields.size() == 4) {
    // Untagged: a pid of this namespace whose start time differs, and nobody holds the file.
    const std::string tag = PidNamespaceTag();
    if (tag.empty()) return false;
    return IsDeadProcessStamp(StrCat(fields[0], "-", fields[1], "-", tag)) &&
           NobodyHolds(dir_fd, file_name);
  }
  const std::string_view stamp =
      name.substr(0, name.size() - fields[3].size() - fields[4].size() - 2);
  if (fields[2] == PidNamespaceTag()) return IsDeadProcessStamp(stamp);
  if (fields[2].size() != 8 ||
      fields[2].find_first_not_of("0123456789abcdef") != std::string_view::npos) {
    return false;
  }
  return NobodyHolds(dir_fd, file_name);
}

}  // namespace

size_t RemoveStaleOffloadFiles(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;
  size_t removed = 0;
  while (const dirent* e = readdir(d)) {
    if (IsStale(dirfd(d), e->d_name) && unlinkat(dirfd(d), e->d_name, 0) == 0) ++removed;
  }
  closedir(d);
  return removed;
}

std::string_view OffloadBackendName(std::string_view name) {
  if (name == "auto") return "auto";
  if (const auto kind = ValueOf(kBackendKindNames, name)) return BackendName(*kind);
  if (const auto kind = ValueOf(kTensorNvmeBackendNames, name)) return BackendName(*kind);
  std::vector<std::string_view> names = {"auto"};
  for (const auto& n : kBackendKindNames) names.push_back(n.name);
  for (const auto& n : kTensorNvmeBackendNames) names.push_back(n.name);
  std::ranges::sort(names);
  throw std::invalid_argument(StrCat("backend '", name, "' is not one of ", JoinWords(names)));
}

EngineOptions OffloaderEngineDefaults() {
  EngineOptions defaults;
  defaults.bounce_idle_ms = 0;
  return EngineOptions::FromEnvironment(defaults);
}

Offloader::Offloader(OffloaderOptions options) : options_(std::move(options)) {
  if (options_.dirs.empty()) throw std::invalid_argument("offloader: no directory given");
  if (options_.stripe_threshold == 0) {
    throw std::invalid_argument("offloader: stripe_threshold must be positive");
  }
  engine_ = options_.backend_factory
                ? std::make_unique<Engine>(options_.engine, options_.backend_factory)
                : std::make_unique<Engine>(options_.engine, options_.dirs.front());
  const uint64_t instance = next_instance.fetch_add(1);
  backings_.reserve(options_.dirs.size());
  try {
    for (size_t i = 0; i < options_.dirs.size(); ++i) {
      RemoveStaleOffloadFiles(options_.dirs[i]);
      std::string path =
          StrCat(options_.dirs[i], "/", ProcessFileStem(), instance, "-", i, kFileSuffix);
      // The owner's only, as shared tensors' memory is: parked weights and optimizer state are
      // not for other users of the machine to read.
      File file = File::Open(path, OpenMode::kWrite, /*direct=*/true, /*status=*/nullptr, 0600);
      // Held while the file is open, so that cleanups in other pid namespaces see it in use
      // (NobodyHolds). A filesystem without locks leaves those cleanups unable to lock it too.
      (void)flock(file.buffered_fd(), LOCK_SH | LOCK_NB);
      backings_.push_back(Backing{std::move(path), std::move(file), SpaceManager(kPageSize)});
    }
  } catch (...) {
    for (const Backing& b : backings_) unlink(b.path.c_str());
    throw;
  }
  last_activity_ = std::chrono::steady_clock::now();
  janitor_ = std::thread([this] { JanitorLoop(); });
}

Offloader::~Offloader() {
  Close();
}

void Offloader::CheckOpen() const {
  if (closed_) throw std::logic_error("offloader is closed");
}

std::vector<Offloader::Part> Offloader::Place(uint64_t length, std::unique_lock<std::mutex>& lock) {
  std::vector<Part> parts;
  if (length == 0) return parts;
  // Directories that refused space are passed over while another has not; once all have, each
  // may have room again.
  if (std::all_of(backings_.begin(), backings_.end(),
                  [](const Backing& b) { return b.refused_space; })) {
    for (Backing& b : backings_) b.refused_space = false;
  }
  const bool any_refused = std::any_of(backings_.begin(), backings_.end(),
                                       [](const Backing& b) { return b.refused_space; });
  try {
    if (backings_.size() > 1 && length >= options_.stripe_threshold && !any_refused) {
      const uint64_t n = backings_.size();
      const uint64_t stripe = AlignUp((length + n - 1) / n, kPageSize);
      for (uint64_t i = 0, done = 0; done < length; ++i, done += stripe) {
        const uint64_t part = std::min(stripe, length - done);
        parts.push_back(Part{static_cast<uint32_t>(i), backings_[i].space.Allocate(part), part});
      }
    } else {
      uint32_t least = UINT32_MAX;
      for (uint32_t i = 0; i < backings_.size(); ++i) {
        if (backings_[i].refused_space) continue;
        if (least == UINT32_MAX ||
            backings_[i].space.allocated_bytes() < backings_[least].space.allocated_bytes()) {
          least = i;
        }
      }
      parts.push_back(Part{least, backings_[least].space.Allocate(length), length});
    }
  } catch (...) {
    Release(parts);
    throw;
  }
  for (const Part& p : parts) {
    Backing& b = backings_[p.file];
    // A part past the end a running truncate aims at must wait for it, or the truncate could cut
    // the part's data after it is written.
    shrink_cv_.wait(
        lock, [&] { return !b.shrinking || p.extent.offset + p.extent.length <= b.shrink_to; });
    b.file_size = std::max(b.file_size, b.space.end());
  }
  return parts;
}

void Offloader::Release(const std::vector<Part>& parts) {
  bool shrinkable = false;
  for (const Part& p : parts) {
    Backing& b = backings_[p.file];
    b.space.Free(p.extent);
    b.refused_space = false;  // the freed extent takes a write without asking the filesystem
    shrinkable |= b.space.end() < b.file_size;
  }
  if (shrinkable) shrink_cv_.notify_all();
}

std::exception_ptr Offloader::ShrinkStep(Backing& b, std::unique_lock<std::mutex>& lock) {
  const uint64_t used = b.space.end();
  const uint64_t to = std::max(used, b.file_size - std::min(b.file_size, options_.shrink_step));
  b.shrinking = true;
  b.shrink_to = to;
  lock.unlock();
  std::exception_ptr error;
  try {
    b.file.Truncate(to);
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  b.shrinking = false;
  if (error == nullptr) {
    b.file_size = std::max(to, b.space.end());
    b.failed_shrink_to = UINT64_MAX;
  } else {
    b.failed_shrink_to = used;  // costs only disk space; retried when the used end moves
  }
  shrink_cv_.notify_all();
  return error;
}

void Offloader::JanitorLoop() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    Backing* target = nullptr;
    for (Backing& b : backings_) {
      if (!b.shrinking && b.space.end() < b.file_size && b.space.end() != b.failed_shrink_to) {
        target = &b;
        break;
      }
    }
    if (target == nullptr) {
      shrink_cv_.wait(lock);
      continue;
    }
    const auto due = last_activity_ + options_.shrink_idle;
    if (std::chrono::steady_clock::now() < due) {
      shrink_cv_.wait_until(lock, due);
      continue;
    }
    ShrinkStep(*target, lock);
  }
}

void Offloader::Trim() {
  std::unique_lock lock(mu_);
  CheckOpen();
  for (Backing& b : backings_) {
    for (;;) {
      shrink_cv_.wait(lock, [&] { return !b.shrinking; });
      if (closed_ || b.space.end() >= b.file_size) break;
      if (std::exception_ptr error = ShrinkStep(b, lock)) std::rethrow_exception(error);
    }
  }
}

void Offloader::Claim(OffloadKind kind, std::span<const OffloadPiece> pieces,
                      std::unique_lock<std::mutex>& lock) {
  CheckOpen();
  const std::string_view verb = NameOf(kOffloadKindNames, kind, "read");
  std::unordered_set<uint64_t> seen;
  for (const OffloadPiece& p : pieces) {
    if (!seen.insert(p.key).second) {
      throw std::invalid_argument(StrCat("offload ", verb, ": key ", p.key, " given twice"));
    }
    if (p.length > 0 && p.data == nullptr) {
      throw std::invalid_argument(StrCat("offload ", verb, ": null buffer for key ", p.key));
    }
    auto it = entries_.find(p.key);
    if (kind == OffloadKind::kWrite) {
      if (it == entries_.end()) continue;
      throw std::invalid_argument(StrCat("offload write: key ", p.key,
                                         it->second.state == State::kStored
                                             ? " is already offloaded"
                                             : " has an operation in flight"));
    }
    if (it == entries_.end()) {
      throw std::invalid_argument(
          StrCat("offload read: key ", p.key, " is not offloaded (never written or already read)"));
    }
    if (it->second.state != State::kStored) {
      throw std::invalid_argument(StrCat("offload read: key ", p.key,
                                         it->second.state == State::kWriting
                                             ? " has a write in flight; wait for writes first"
                                             : " has a read in flight"));
    }
    if (it->second.length != p.length) {
      throw std::invalid_argument(StrCat("offload read: key ", p.key, " holds ", it->second.length,
                                         " bytes, not ", p.length));
    }
  }

  last_activity_ = std::chrono::steady_clock::now();
  // Claim the keys before placing anything: a placement may wait with mu_ released, and the
  // claims keep other starts (and Discard) off these keys meanwhile.
  for (const OffloadPiece& p : pieces) {
    if (kind == OffloadKind::kWrite) {
      entries_.emplace(p.key, Entry{State::kWriting, p.length, {}, false});
    } else {
      entries_[p.key].state = State::kReading;
    }
  }
  if (kind == OffloadKind::kRead) return;
  try {
    for (const OffloadPiece& p : pieces) {
      std::vector<Part> parts = Place(p.length, lock);
      if (closed_) {
        Release(parts);
        throw std::logic_error("offloader is closed");
      }
      entries_[p.key].parts = std::move(parts);
    }
  } catch (...) {
    Unclaim(kind, pieces);
    throw;
  }
}

void Offloader::Unclaim(OffloadKind kind, std::span<const OffloadPiece> pieces) {
  for (const OffloadPiece& p : pieces) {
    auto it = entries_.find(p.key);
    if (it == entries_.end()) continue;  // cleared by Close meanwhile
    if (kind == OffloadKind::kWrite) {
      Release(it->second.parts);
      entries_.erase(it);
    } else {
      it->second.state = State::kStored;
    }
  }
}

void Offloader::Start(OffloadKind kind, std::span<const OffloadPiece> pieces) {
  std::unique_lock lock(mu_);
  Claim(kind, pieces, lock);
  std::vector<IoDesc> descs;
  std::vector<uint64_t> keys;
  uint64_t total = 0;
  try {
    for (const OffloadPiece& p : pieces) {
      uint64_t done = 0;
      for (const Part& part : entries_.at(p.key).parts) {
        descs.push_back(IoDesc{backings_[part.file].file, static_cast<std::byte*>(p.data) + done,
                               part.extent.offset, part.length});
        done += part.length;
      }
      keys.push_back(p.key);
      total += p.length;
    }
    // An I/O error the engine throws at submission (a backing file it may not write) is the
    // operation's outcome, delivered by Wait() as a failed transfer is (the engine's future
    // already carries those of its preparation, such as out of space reserving the range).
    Future future;
    std::exception_ptr submit_error;
    try {
      future = engine_->Submit(kind == OffloadKind::kWrite ? IoOp::kWrite : IoOp::kRead, descs);
    } catch (const IoError&) {
      submit_error = std::current_exception();
    }
    Pending p{next_pending_id_++,
              kind,
              std::move(future),
              std::move(submit_error),
              std::move(keys),
              total,
              "",
              0};
    if (!descs.empty()) {
      p.path = descs.front().file.path();
      p.offset = descs.front().offset;
    }
    pending_.push_back(std::move(p));
  } catch (...) {
    Unclaim(kind, pieces);
    throw;
  }
}

std::vector<OffloadExtent> Offloader::Begin(OffloadKind kind, uint64_t key, uint64_t length) {
  // The caller's memory is not ours to touch; any non-null address passes Claim's check.
  OffloadPiece piece{key, reinterpret_cast<void*>(uintptr_t{1}), length};
  std::unique_lock lock(mu_);
  Claim(kind, {&piece, 1}, lock);
  Entry& e = entries_.at(key);
  std::vector<OffloadExtent> extents;
  try {
    uint64_t done = 0;
    for (const Part& part : e.parts) {
      extents.push_back(
          OffloadExtent{backings_[part.file].file, part.extent.offset, done, part.length});
      done += part.length;
    }
  } catch (...) {  // bad_alloc: nothing begun
    Unclaim(kind, {&piece, 1});
    throw;
  }
  // Counted only once nothing can fail: Close() waits for a Finish of each.
  e.external = true;
  ++external_in_flight_;
  return extents;
}

void Offloader::Finish(OffloadKind kind, uint64_t key, std::exception_ptr error) noexcept {
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  const State expected = kind == OffloadKind::kWrite ? State::kWriting : State::kReading;
  if (it == entries_.end() || !it->second.external || it->second.state != expected) {
    return;  // never begun, or finished already
  }
  it->second.external = false;
  last_activity_ = std::chrono::steady_clock::now();
  Apply(kind, key, error);
  if (--external_in_flight_ == 0) external_done_.notify_all();
}

std::vector<OffloadExtent> Offloader::BeginWrite(uint64_t key, uint64_t length) {
  return Begin(OffloadKind::kWrite, key, length);
}

void Offloader::FinishWrite(uint64_t key, std::exception_ptr error) noexcept {
  Finish(OffloadKind::kWrite, key, std::move(error));
}

std::vector<OffloadExtent> Offloader::BeginRead(uint64_t key, uint64_t length) {
  return Begin(OffloadKind::kRead, key, length);
}

void Offloader::FinishRead(uint64_t key, std::exception_ptr error) noexcept {
  Finish(OffloadKind::kRead, key, std::move(error));
}

void Offloader::AsyncWrite(uint64_t key, const void* data, uint64_t length) {
  OffloadPiece piece{key, const_cast<void*>(data), length};
  Start(OffloadKind::kWrite, {&piece, 1});
}

void Offloader::AsyncRead(uint64_t key, void* data, uint64_t length) {
  OffloadPiece piece{key, data, length};
  Start(OffloadKind::kRead, {&piece, 1});
}

void Offloader::AsyncWritev(std::span<const OffloadPiece> pieces) {
  Start(OffloadKind::kWrite, pieces);
}

void Offloader::AsyncReadv(std::span<const OffloadPiece> pieces) {
  Start(OffloadKind::kRead, pieces);
}

std::vector<OffloadOutcome> Offloader::Wait(OffloadKind kind) {
  return WaitFor(kind, [](const Pending&) { return true; });
}

std::vector<OffloadOutcome> Offloader::Wait(OffloadKind kind, std::span<const uint64_t> keys) {
  return WaitFor(kind, [keys](const Pending& p) {
    return std::any_of(p.keys.begin(), p.keys.end(), [keys](uint64_t k) {
      return std::find(keys.begin(), keys.end(), k) != keys.end();
    });
  });
}

std::vector<OffloadOutcome> Offloader::WaitFor(OffloadKind kind,
                                               const std::function<bool(const Pending&)>& wanted) {
  // Operations stay in pending_ while waited for: another thread's Wait may take them first, and
  // it must then also wait for them (and see them applied) before it returns.
  std::vector<Future> futures;
  std::vector<uint64_t> ids;  // of the operations this call waits for
  {
    std::lock_guard lock(mu_);
    for (const Pending& p : pending_) {
      if (p.kind != kind || !wanted(p)) continue;
      ids.push_back(p.id);
      if (p.future.valid()) futures.push_back(p.future);
    }
  }
  for (const Future& f : futures) {
    try {
      f.Wait();
    } catch (...) {  // seen below by whoever applies the outcome
    }
  }
  std::lock_guard lock(mu_);
  // Those of our operations no other Wait (or Close) has applied meanwhile; all complete.
  std::vector<Pending> mine;
  auto split = std::stable_partition(pending_.begin(), pending_.end(), [&](const Pending& p) {
    return p.kind != kind || !std::binary_search(ids.begin(), ids.end(), p.id);
  });
  std::move(split, pending_.end(), std::back_inserter(mine));
  pending_.erase(split, pending_.end());
  std::vector<std::exception_ptr> errors(mine.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    if (mine[i].submit_error != nullptr) {
      errors[i] = mine[i].submit_error;
      continue;
    }
    try {
      const IoResult& r = mine[i].future.Wait();
      if (r.bytes != mine[i].expect_bytes) {  // a backing file was cut short behind our back
        throw IoError(EIO, "offload read (backing file shorter than written)", mine[i].path,
                      mine[i].offset, mine[i].expect_bytes);
      }
    } catch (...) {
      errors[i] = std::current_exception();
    }
  }
  last_activity_ = std::chrono::steady_clock::now();
  std::vector<OffloadOutcome> outcomes;
  for (size_t i = 0; i < mine.size(); ++i) {
    for (uint64_t key : mine[i].keys) {
      outcomes.push_back(OffloadOutcome{key, errors[i]});
      Apply(kind, key, errors[i]);
    }
  }
  return outcomes;
}

void Offloader::NoteRefusedSpace(const std::vector<Part>& parts, const std::exception_ptr& error) {
  std::string path;
  try {
    std::rethrow_exception(error);
  } catch (const IoError& e) {
    if (e.error_code() != ENOSPC) return;
    path = e.path();
  } catch (...) {
    return;
  }
  const bool named = std::any_of(parts.begin(), parts.end(),
                                 [&](const Part& p) { return backings_[p.file].path == path; });
  for (const Part& p : parts) {
    if (!named || backings_[p.file].path == path) backings_[p.file].refused_space = true;
  }
}

void Offloader::Apply(OffloadKind kind, uint64_t key, const std::exception_ptr& error) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return;  // closed meanwhile
  Entry& e = it->second;
  if (kind == OffloadKind::kWrite) {
    if (error == nullptr) {
      e.state = State::kStored;
      stored_bytes_ += e.length;
    } else {
      Release(e.parts);
      NoteRefusedSpace(e.parts, error);
      entries_.erase(it);
    }
  } else if (error == nullptr) {
    stored_bytes_ -= e.length;
    Release(e.parts);
    entries_.erase(it);
  } else {
    e.state = State::kStored;
  }
}

void Offloader::Synchronize() {
  std::exception_ptr first;
  for (OffloadKind kind : {OffloadKind::kWrite, OffloadKind::kRead}) {
    for (const OffloadOutcome& o : Wait(kind)) {
      if (first == nullptr) first = o.error;
    }
  }
  if (first != nullptr) std::rethrow_exception(first);
}

void Offloader::Discard(uint64_t key) {
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  if (it->second.state != State::kStored) {
    throw std::invalid_argument(StrCat("offload: key ", key, " has an operation in flight"));
  }
  stored_bytes_ -= it->second.length;
  if (!closed_) Release(it->second.parts);
  entries_.erase(it);
}

bool Offloader::stored(uint64_t key) const {
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  return it != entries_.end() && it->second.state != State::kWriting;
}

bool Offloader::pending(uint64_t key) const {
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  return it != entries_.end() && it->second.state != State::kStored;
}

uint64_t Offloader::stored_bytes() const {
  std::lock_guard lock(mu_);
  return stored_bytes_;
}

uint64_t Offloader::file_bytes() const {
  std::lock_guard lock(mu_);
  uint64_t total = 0;
  for (const Backing& b : backings_) total += b.file_size;
  return total;
}

std::vector<std::string> Offloader::paths() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> out;
  for (const Backing& b : backings_) out.push_back(b.path);
  return out;
}

uint64_t Offloader::bounce_bytes() const {
  return engine_->bounce_bytes();
}

uint64_t Offloader::bounce_allocations() const {
  return engine_->bounce_allocations();
}

const EngineOptions& Offloader::engine_options() const {
  return engine_->options();
}

const std::string& Offloader::backend() const {
  return engine_->backend();
}

void Offloader::Close() noexcept {
  if (maker_.Forked()) {
    if (closed_) return;
    // A child made by fork() (say, a worker process exiting): the files are the parent's, as
    // is the data in them, and the janitor's and engine's threads were not copied. Nothing is
    // removed, waited for or joined; the synchronisation objects those threads may have held
    // or waited on are made anew for the destructors (destroying a condition variable with
    // waiters can block). The engine leaves its own workers in place (see ~Engine).
    new std::thread(std::move(janitor_));
    new (&mu_) std::mutex;
    new (&external_done_) std::condition_variable;
    new (&shrink_cv_) std::condition_variable;
    closed_ = true;
    return;
  }
  std::vector<Pending> in_flight;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
    stopping_ = true;
    in_flight.swap(pending_);
  }
  shrink_cv_.notify_all();
  if (janitor_.joinable()) janitor_.join();  // after a truncate in progress, if any
  for (const Pending& p : in_flight) {
    if (!p.future.valid()) continue;  // its submission failed: nothing runs
    try {
      p.future.Wait();
    } catch (...) {  // the data is discarded with the files
    }
  }
  std::unique_lock lock(mu_);
  // Callers moving bytes themselves use the files (through copies of File) until they finish.
  external_done_.wait(lock, [&] { return external_in_flight_ == 0; });
  entries_.clear();
  stored_bytes_ = 0;
  for (Backing& b : backings_) {
    b.file.Close();
    unlink(b.path.c_str());
  }
}

}  // namespace tensortier
