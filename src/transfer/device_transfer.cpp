#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "tensortier/transfer/device_jobs.hpp"
#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/util/strings.hpp"
#include "tensortier/transfer/transfer.hpp"

namespace tensortier {

GdsMode ParseGdsMode(const std::string& text) {
  if (const auto mode = ValueOf(kGdsModeNames, text)) return *mode;
  // The digit and true/false spellings of off and on (not yes/no, which ParseBool also takes).
  if (text == "0" || text == "false") return GdsMode::kOff;
  if (text == "1" || text == "true") return GdsMode::kRequire;
  // Each mode once, by its name: 'off', 'auto' or 'on'.
  const std::string_view modes[] = {GdsModeName(GdsMode::kOff), GdsModeName(GdsMode::kAuto),
                                    GdsModeName(GdsMode::kRequire)};
  throw std::invalid_argument(
      StrCat("gds must be ", JoinWords(modes, ", ", " or ", "'"), ", not '", text, "'"));
}

GdsMode GdsModeFromEnvironment() {
  return ParseGdsMode(WordSetting(SettingFor("TENSORTIER_GDS")));
}

const char* GdsModeName(GdsMode mode) noexcept {
  // The table's words are string literals, so data() is NUL-terminated.
  return NameOf(kGdsModeNames, mode, "on").data();
}

// ---------------------------------------------------------------------------------------------
// DeviceFile

DeviceFile::DeviceFile(File file, GdsMode mode)
    : DeviceFile(std::move(file), mode, mode == GdsMode::kOff ? nullptr : &CuFile::Get()) {}

DeviceFile::DeviceFile(File file) : DeviceFile(std::move(file), GdsModeFromEnvironment()) {}

DeviceFile::DeviceFile(File file, GdsMode mode, const CuFile& cufile)
    : DeviceFile(std::move(file), mode, &cufile) {}

DeviceFile::DeviceFile(File file, GdsMode mode, const CuFile* cufile_or_null)
    : file_(std::move(file)), mode_(mode) {
  if (!file_.is_open()) throw std::invalid_argument("DeviceFile: the file is not open");
  if (mode == GdsMode::kOff) {
    reason_ = "GDS off";
    return;
  }
  const CuFile& cufile = *cufile_or_null;
  if (!cufile.available()) {
    reason_ = StrCat("cuFile unavailable: ", cufile.why_unavailable());
  } else if (mode == GdsMode::kAuto && !cufile.compat_mode_reason().empty()) {
    // Not GPUDirect: cuFile would move the bytes through host buffers of its own (POSIX I/O),
    // as the ring does, which also overlaps disk and PCIe. "on" still uses cuFile.
    reason_ = StrCat("cuFile would run in compatibility mode: ", cufile.compat_mode_reason(),
                     " (GDS 'on' uses it anyway)");
  } else if (!file_.direct()) {
    reason_ = StrCat("GDS needs O_DIRECT, which ", file_.path(),
                     " refused: ", file_.direct_fallback_reason());
  } else {
    try {
      handle_ = std::make_shared<const CuFileHandle>(cufile, file_.direct_fd(), file_.path());
      gds_ = true;
      compat_mode_ = cufile.compat_mode_reason();  // only "on" and "require" get here with one
      return;
    } catch (const CuFileError& e) {
      if (mode == GdsMode::kRequire) throw;
      reason_ = e.what();
    }
  }
  if (mode == GdsMode::kRequire) {
    throw CuFileError(-1, 0, "GDS (required) for " + file_.path(), reason_);
  }
}

DeviceFile DeviceFile::FakeGdsForTest(File file, GdsMode mode) {
  DeviceFile f(std::move(file), GdsMode::kOff);
  f.mode_ = mode;
  f.gds_ = true;
  f.reason_.clear();
  return f;
}

// ---------------------------------------------------------------------------------------------
// DeviceTransferOptions

DeviceTransferOptions DeviceTransferOptions::FromEnvironment() {
  DeviceTransferOptions o;
  o.ring.slots = NumberSetting(SettingFor("TENSORTIER_BOUNCE_SLOTS"));
  o.ring.slot_bytes = NumberSetting(SettingFor("TENSORTIER_BOUNCE_SLOT_SIZE"));
  o.max_rings = NumberSetting(SettingFor("TENSORTIER_BOUNCE_RINGS"));
  try {
    o.Validate();
  } catch (const std::invalid_argument& e) {  // only a combination of settings fails here
    throw std::invalid_argument(
        StrCat("TENSORTIER_BOUNCE_SLOTS, TENSORTIER_BOUNCE_SLOT_SIZE, TENSORTIER_BOUNCE_RINGS: ",
               e.what()));
  }
  return o;
}

void DeviceTransferOptions::Validate() const {
  ring.Validate();
  CheckNumberSetting(SettingFor("TENSORTIER_BOUNCE_RINGS"), max_rings);
  if (ring.bytes() > (uint64_t{1} << 40) / max_rings) {
    throw std::invalid_argument("DeviceTransfer: max_rings x slots x slot_bytes is over 1 TiB");
  }
}

// ---------------------------------------------------------------------------------------------
// DeviceTransfer

// A ring lent to one transfer; goes back on destruction.
class DeviceTransfer::RingLease {
 public:
  RingLease(DeviceTransfer* owner, std::unique_ptr<BounceRing> ring)
      : owner_(owner), ring_(std::move(ring)) {}
  ~RingLease() {
    if (ring_ != nullptr) owner_->ReturnRing(std::move(ring_));
  }
  RingLease(RingLease&& other) noexcept : owner_(other.owner_), ring_(std::move(other.ring_)) {}
  RingLease& operator=(RingLease&&) = delete;
  RingLease(const RingLease&) = delete;
  RingLease& operator=(const RingLease&) = delete;
  BounceRing& operator*() const { return *ring_; }
  BounceRing* operator->() const { return ring_.get(); }

 private:
  DeviceTransfer* owner_;
  std::unique_ptr<BounceRing> ring_;
};

DeviceTransfer::DeviceTransfer(Engine& engine, DeviceTransferOptions options,
                               const CudaDriver& driver)
    : engine_(engine), options_(options), driver_(driver) {
  options_.Validate();
  if (!driver.available()) {
    throw CudaError(cuda::kUnavailable, "DeviceTransfer",
                    StrCat("CUDA driver unavailable: ", driver.why_unavailable()));
  }
  factory_ = [&driver](const DeviceSpan& span) -> std::unique_ptr<DeviceCopier> {
    return std::make_unique<CudaCopier>(driver, span.device, span.stream);
  };
  pool_options_.budget_bytes = options_.max_rings * options_.ring.bytes();
  pool_options_.register_with_cuda = true;
}

DeviceTransfer::DeviceTransfer(Engine& engine, DeviceTransferOptions options, CopierFactory factory,
                               PinnedPoolOptions pool, GdsFunction gds, const CudaDriver& driver)
    : engine_(engine),
      options_(options),
      driver_(driver),
      factory_(std::move(factory)),
      pool_options_(pool),
      gds_(std::move(gds)) {
  options_.Validate();
  if (!factory_) throw std::invalid_argument("DeviceTransfer: no copier factory");
}

DeviceTransfer::~DeviceTransfer() {
  // The queued jobs run first (they use the rings); then every ring is back. No lock: nothing
  // else calls Submit() now, and in a child made by fork() mu_ may be held for good.
  jobs_.reset();
}

DeviceJob DeviceTransfer::Submit(std::function<TransferResult()> work) {
  DeviceJobQueue* jobs;
  {
    std::lock_guard lock(mu_);
    if (!jobs_) {
      jobs_ = std::make_unique<DeviceJobQueue>(
          static_cast<unsigned>(options_.max_rings),
          "device transfer threads (one per bounce ring: TENSORTIER_BOUNCE_RINGS)");
    }
    jobs = jobs_.get();
  }
  return jobs->Submit(std::move(work));
}

DeviceFile LazyDeviceFile::Get() {
  std::lock_guard lock(mu_);
  if (!made_) made_.emplace(file_, mode_);
  return *made_;
}

const PinnedPool* DeviceTransfer::pool() const {
  std::lock_guard lock(mu_);
  return pool_.get();
}

size_t DeviceTransfer::rings() const {
  std::lock_guard lock(mu_);
  return made_rings_;
}

DeviceTransfer::RingLease DeviceTransfer::LeaseRing(int device) {
  std::unique_lock lock(mu_);
  if (pool_ == nullptr) {
    PinnedPoolOptions p = pool_options_;
    if (p.register_with_cuda) p.device = device;
    pool_ = std::make_unique<PinnedPool>(p, driver_);
  }
  for (;;) {
    if (!idle_rings_.empty()) {
      std::unique_ptr<BounceRing> ring = std::move(idle_rings_.back());
      idle_rings_.pop_back();
      return RingLease(this, std::move(ring));
    }
    if (made_rings_ < options_.max_rings) break;
    ring_returned_.wait(lock);
  }
  ++made_rings_;
  PinnedPool& pool = *pool_;
  lock.unlock();
  try {
    return RingLease(this, std::make_unique<BounceRing>(engine_, pool, options_.ring));
  } catch (...) {
    {
      std::lock_guard relock(mu_);
      --made_rings_;
    }
    ring_returned_.notify_one();
    throw;
  }
}

void DeviceTransfer::ReturnRing(std::unique_ptr<BounceRing> ring) noexcept {
  {
    std::lock_guard lock(mu_);
    idle_rings_.push_back(std::move(ring));
  }
  ring_returned_.notify_one();
}

TransferResult DeviceTransfer::Read(const File& file, uint64_t file_offset, uint64_t length,
                                    const DeviceSpan& span) {
  std::unique_ptr<DeviceCopier> copier = factory_(span);
  RingLease ring = LeaseRing(span.device);
  return ring->FileToDevice(*copier, file, file_offset, length, span.address);
}

TransferResult DeviceTransfer::Write(const DeviceSpan& span, uint64_t length, const File& file,
                                     uint64_t file_offset) {
  std::unique_ptr<DeviceCopier> copier = factory_(span);
  RingLease ring = LeaseRing(span.device);
  return ring->DeviceToFile(*copier, span.address, length, file, file_offset);
}

TransferResult DeviceTransfer::Read(const DeviceFile& file, uint64_t file_offset, uint64_t length,
                                    const DeviceSpan& span) {
  if (file.gds()) return Gds(true, file, span, length, file_offset);
  TransferResult r = Read(file.file(), file_offset, length, span);
  r.gds_reason = file.gds_reason();
  return r;
}

TransferResult DeviceTransfer::Write(const DeviceSpan& span, uint64_t length,
                                     const DeviceFile& file, uint64_t file_offset) {
  if (file.gds()) return Gds(false, file, span, length, file_offset);
  TransferResult r = Write(span, length, file.file(), file_offset);
  r.gds_reason = file.gds_reason();
  return r;
}

TransferResult DeviceTransfer::Gds(bool read, const DeviceFile& file, const DeviceSpan& span,
                                   uint64_t length, uint64_t file_offset) {
  TransferResult r;
  r.path = "gds";
  if (!file.gds_compat_mode().empty()) {
    r.gds_reason = StrCat("cuFile compatibility mode (not GPUDirect): ", file.gds_compat_mode());
  }
  if (length == 0) return r;
  try {
    r.bytes = gds_ ? gds_(read, file, span, length, file_offset)
                   : CuFileTransfer(read, file, span, length, file_offset);
  } catch (const CuFileTransferError& e) {
    // cuFile itself could not move the bytes (e.g. CU_FILE_IO_NOT_SUPPORTED on this file system
    // or device): "auto" promised a working transfer, so the bounce ring does all of it again.
    // An errno failure (-1: a real I/O error) is not retried: it would fail the same way.
    if (file.mode() != GdsMode::kAuto) throw;
    r = read ? Read(file.file(), file_offset, length, span)
             : Write(span, length, file.file(), file_offset);
    r.gds_reason = StrCat("GDS failed, the bounce ring ran instead: ", e.what());
    return r;
  }
  r.chunks = 1;
  r.eof = read && r.bytes < length;
  return r;
}

uint64_t DeviceTransfer::CuFileTransfer(bool read, const DeviceFile& file, const DeviceSpan& span,
                                        uint64_t length, uint64_t file_offset) {
  const CuFileHandle* handle = file.handle();
  if (handle == nullptr) {
    throw std::logic_error(
        StrCat("DeviceTransfer: ", file.file().path(), " has no cuFile registration"));
  }
  PrimaryContext context(driver_, span.device);
  ScopedContext current(context);
  // cuFile is not stream ordered: work already queued on the caller's stream may still use (read)
  // or produce (write) this memory.
  if (span.stream) {
    driver_.Check(driver_.api().StreamSynchronize(*span.stream), "cuStreamSynchronize");
  }
  void* base = reinterpret_cast<void*>(span.address);
  return read ? handle->Read(base, length, file_offset) : handle->Write(base, length, file_offset);
}

}  // namespace tensortier
