// A stand-in for libcuda.so.1 with the entry points tensortier resolves, for machines without a
// GPU (CI): the GPU test suites run against it (TENSORTIER_CUDA_LIBRARY=<this library>), so the
// CUDA paths of cuda/ and transfer/ run on every commit, under ASan and TSan too.
//
// It models what those paths rely on, strictly:
//  - "Device memory" is host memory the caller cannot touch: cuMemAlloc hands out addresses of a
//    PROT_NONE reservation and keeps the bytes in a separate mapping, so a host access to a device
//    pointer crashes instead of silently working.
//  - Streams run their copies and event records in order on a thread of their own, each copy
//    after a delay (FAKE_CUDA_COPY_DELAY_US, default 100), so host memory reused before an event
//    says the copy is done is caught (wrong data, or a TSan report). As with the driver, a copy
//    from pageable memory returns once the source is staged (the device is written later, in
//    stream order) and a copy to pageable memory returns once it is done.
//  - Calls that need a current context fail with CUDA_ERROR_INVALID_CONTEXT without one.
//  - Misuse a real driver would not report, or would report as a later crash (unregistering host
//    memory a queued copy still uses, releasing a context more often than retained), is
//    recorded: fakecuda_violations() returns it; fakecuda_live() counts what is still allocated,
//    registered or retained, so tests can check that every RAII object gave its resource back.
//  - Virtual memory management (cuMemCreate & co): a physical allocation is a memfd (named after
//    its device), so its exported handle is a real descriptor that another process imports and
//    maps onto the same bytes. Mapped addresses stay PROT_NONE like cuMemAlloc's; copies reach
//    them only once cuMemSetAccess allowed it. Sizes, offsets and reservations are checked against
//    the granularity (FAKE_CUDA_GRANULARITY, default 2 MiB, as GPUs answer).
//  - Failures are injected per call (fakecuda_fail_next) and calls are counted (fakecuda_calls).
//  - cuFile (libcufile.so.0) too, in the same library: load it with CuFile::Load(path, false).
// Not modelled: the legacy default stream's implicit synchronisation with other streams (code
// must not rely on it), managed memory, peer access, timing.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using CUresult = int;
using CUdeviceptr = uint64_t;

constexpr CUresult kSuccess = 0;
constexpr CUresult kInvalidValue = 1;
constexpr CUresult kOutOfMemory = 2;
constexpr CUresult kNotInitialized = 3;
constexpr CUresult kInvalidDevice = 101;
constexpr CUresult kInvalidContext = 201;
constexpr CUresult kInvalidHandle = 400;
constexpr CUresult kNotReady = 600;
constexpr CUresult kAlreadyRegistered = 712;
constexpr CUresult kNotRegistered = 713;

constexpr unsigned kMemoryTypeHost = 1;
constexpr unsigned kMemoryTypeDevice = 2;
constexpr int kAttributeMemoryType = 2;
constexpr int kAttributeIsManaged = 8;
constexpr int kAttributeDeviceOrdinal = 9;

struct Context {
  int device = 0;
  int retained = 0;
};

struct DeviceAllocation {
  size_t bytes = 0;
  std::byte* shadow = nullptr;  // where the bytes live
  size_t mapped = 0;
  int device = 0;
  bool vmm = false;        // a cuMemMap of a physical allocation (else cuMemAlloc)
  bool accessible = true;  // cuMemMap'ped ranges: once cuMemSetAccess allowed it
};

// A cuMemCreate'd or imported allocation: its bytes are the memfd's.
struct PhysicalAllocation {
  int fd = -1;
  size_t bytes = 0;
  int device = 0;
};

// A cuMemAddressReserve'd range: PROT_NONE host addresses nobody else gets.
struct Reservation {
  size_t bytes = 0;
  void* raw = nullptr;  // the mmap holding it (aligned inside)
  size_t raw_bytes = 0;
};

struct HostRange {
  size_t bytes = 0;
  bool allocated = false;  // cuMemAllocHost (else cuMemHostRegister)
};

// One queued operation: a copy, or an event record.
struct Op {
  std::function<void()> run;
  uintptr_t host = 0;  // host range a copy uses, for the use-after-release checks
  size_t host_bytes = 0;
  uint64_t device = 0;  // device range
  size_t device_bytes = 0;
};

struct Stream {
  std::deque<Op> queue;  // guarded by the global mutex; the front stays queued while it runs
  bool stopping = false;
  std::condition_variable idle;
  std::condition_variable work;
  std::thread worker;
};

struct Event {
  uint64_t recorded = 0;  // records issued
  uint64_t reached = 0;   // records their streams have reached
  std::condition_variable done;
};

struct Driver {
  std::mutex mu;
  bool initialized = false;
  int devices = 1;
  std::vector<Context> contexts;
  std::map<uintptr_t, DeviceAllocation> device_memory;  // by address
  std::map<uintptr_t, HostRange> host_memory;           // registered or allocated, by address
  std::map<Stream*, std::unique_ptr<Stream>> streams;
  std::map<Event*, std::shared_ptr<Event>> events;  // a pending record shares its event
  Stream* null_stream = nullptr;
  std::vector<std::string> violations;
  std::chrono::microseconds delay{100};
  std::condition_variable progress;  // an operation finished, on any stream
  // cuFile
  std::map<void*, int> file_handles;         // handle -> a buffered descriptor of the file
  std::map<uintptr_t, size_t> file_buffers;  // cuFileBufRegister'ed ranges
  long next_transfer_result = 0;             // injected: 0 none, >0 short, <0 returned as is
  int next_transfer_errno = 0;
  int driver_opens = 0;             // cuFileDriverOpen calls
  int next_driver_open_result = 0;  // what the next cuFileDriverOpen answers
  bool bool_parameters[16] = {};    // cuFileGetParameterBool's answers, set by the hook below
  CUresult next_host_register_result = kSuccess;  // injected: what cuMemHostRegister answers
  // Virtual memory management
  size_t granularity = 2u << 20;
  unsigned long long next_physical = 1;
  std::map<unsigned long long, PhysicalAllocation> physical;
  std::map<uintptr_t, Reservation> reservations;
  std::map<std::string, CUresult> fail_next;  // call name -> what its next call answers
  std::map<std::string, int> calls;           // call name -> how many times it was called
};

Driver& D() {
  static Driver* driver = new Driver;  // leaked: worker threads may outlive static destruction
  return *driver;
}

thread_local std::vector<Context*> current;  // this thread's context stack

bool HasContext() {
  return !current.empty() && current.back() != nullptr;
}

void Violation(std::string what) {  // with D().mu held
  D().violations.push_back(std::move(what));
}

// The allocation that contains [address, address + bytes), or null. With D().mu held.
DeviceAllocation* FindDevice(uint64_t address, size_t bytes, uintptr_t* base = nullptr) {
  auto& memory = D().device_memory;
  auto it = memory.upper_bound(static_cast<uintptr_t>(address));
  if (it == memory.begin()) return nullptr;
  --it;
  if (!it->second.accessible) return nullptr;
  if (address < it->first || address - it->first > it->second.bytes ||
      bytes > it->second.bytes - (address - it->first)) {
    return nullptr;
  }
  if (base != nullptr) *base = it->first;
  return &it->second;
}

const HostRange* FindHost(const void* p, uintptr_t* base = nullptr) {  // with D().mu held
  const auto address = reinterpret_cast<uintptr_t>(p);
  auto& memory = D().host_memory;
  auto it = memory.upper_bound(address);
  if (it == memory.begin()) return nullptr;
  --it;
  if (address - it->first >= it->second.bytes) return nullptr;
  if (base != nullptr) *base = it->first;
  return &it->second;
}

bool Overlaps(uintptr_t a, size_t a_bytes, uintptr_t b, size_t b_bytes) {
  return a < b + b_bytes && b < a + a_bytes;
}

// Queued or running copies that use host [p, p + bytes) or device [d, d + bytes). With mu held.
bool InFlight(uintptr_t host, size_t host_bytes, uint64_t device, size_t device_bytes) {
  for (const auto& [key, stream] : D().streams) {
    for (const Op& op : stream->queue) {
      if (host_bytes > 0 && op.host_bytes > 0 && Overlaps(op.host, op.host_bytes, host, host_bytes))
        return true;
      if (device_bytes > 0 && op.device_bytes > 0 &&
          Overlaps(op.device, op.device_bytes, device, device_bytes))
        return true;
    }
  }
  return false;
}

// Waits until no queued copy uses those ranges (with the lock of D().mu).
void WaitUntilUnused(std::unique_lock<std::mutex>& lock, uintptr_t host, size_t host_bytes,
                     uint64_t device, size_t device_bytes) {
  D().progress.wait(lock, [&] { return !InFlight(host, host_bytes, device, device_bytes); });
}

void RunStream(Stream* s) {
  std::unique_lock lock(D().mu);
  for (;;) {
    s->work.wait(lock, [&] { return s->stopping || !s->queue.empty(); });
    if (s->queue.empty()) return;
    std::function<void()> run = s->queue.front().run;
    const std::chrono::microseconds delay = D().delay;
    lock.unlock();
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    run();
    lock.lock();
    s->queue.pop_front();
    s->idle.notify_all();
    D().progress.notify_all();
  }
}

Stream* NewStream() {  // with D().mu held
  auto owned = std::make_unique<Stream>();
  Stream* s = owned.get();
  D().streams.emplace(s, std::move(owned));
  s->worker = std::thread(RunStream, s);
  return s;
}

Stream* Resolve(void* handle) {  // null, CU_STREAM_LEGACY (1) and PER_THREAD (2): one stream
  if (reinterpret_cast<uintptr_t>(handle) <= 2) {
    if (D().null_stream == nullptr) D().null_stream = NewStream();
    return D().null_stream;
  }
  auto it = D().streams.find(static_cast<Stream*>(handle));
  return it == D().streams.end() ? nullptr : it->second.get();
}

void Drain(Stream* s, std::unique_lock<std::mutex>& lock) {
  s->idle.wait(lock, [&] { return s->queue.empty(); });
}

// Enqueues `op` on `stream`, or runs it at once after the stream's earlier work (`synchronous`:
// copies to pageable memory, which the driver finishes before returning).
CUresult Copy(void* stream, Op op, bool synchronous) {
  std::unique_lock lock(D().mu);
  Stream* s = Resolve(stream);
  if (s == nullptr) return kInvalidHandle;
  if (synchronous) {
    Drain(s, lock);
    lock.unlock();
    op.run();
    return kSuccess;
  }
  s->queue.push_back(std::move(op));
  s->work.notify_one();
  return kSuccess;
}

}  // namespace

extern "C" {

// ---- test hooks (not part of the CUDA API) ---------------------------------------------------

// Writes the recorded misuse, one per line, into `out` (NUL-terminated, truncated to `size`);
// returns how many there are.
int fakecuda_violations(char* out, size_t size) {
  std::lock_guard lock(D().mu);
  std::string all;
  for (const std::string& v : D().violations) all += v + "\n";
  if (size > 0) {
    const size_t n = std::min(all.size(), size - 1);
    std::memcpy(out, all.data(), n);
    out[n] = '\0';
  }
  return static_cast<int>(D().violations.size());
}

// Resources held now: device allocations + host registrations and allocations + streams (the
// null stream excluded) + events + primary context retains + cuFile handles and buffers.
int fakecuda_live() {
  std::lock_guard lock(D().mu);
  size_t n = D().device_memory.size() + D().host_memory.size() + D().streams.size() +
             D().physical.size() + D().reservations.size() + D().events.size() -
             (D().null_stream != nullptr ? 1 : 0) + D().file_handles.size() +
             D().file_buffers.size();
  for (const Context& c : D().contexts) n += static_cast<size_t>(c.retained);
  return static_cast<int>(n);
}

// Sets the delay before each queued operation (microseconds); returns the previous one.
int fakecuda_set_copy_delay_us(int us) {
  std::lock_guard lock(D().mu);
  const auto old = static_cast<int>(D().delay.count());
  D().delay = std::chrono::microseconds(us);
  return old;
}

// The next cuFileRead/cuFileWrite returns min(`result`, size) bytes when `result` > 0, or
// `result` itself when negative (-1 with errno = `error`, or a negated cuFile status).
void fakecuda_cufile_next_result(long result, int error) {
  std::lock_guard lock(D().mu);
  D().next_transfer_result = result;
  D().next_transfer_errno = error;
}

// cuFileDriverOpen calls so far.
int fakecuda_cufile_driver_opens() {
  std::lock_guard lock(D().mu);
  return D().driver_opens;
}

// What the next cuFileDriverOpen answers (a cuFile status; 0: success).
void fakecuda_cufile_next_driver_open_result(int status) {
  std::lock_guard lock(D().mu);
  D().next_driver_open_result = status;
}

// What the next cuMemHostRegister answers (a CUresult; 0: it registers).
void fakecuda_next_host_register_result(int result) {
  std::lock_guard lock(D().mu);
  D().next_host_register_result = static_cast<CUresult>(result);
}

// The next call of `call` (e.g. "cuMemMap") in this process answers `result` and does nothing.
void fakecuda_fail_next(const char* call, int result) {
  std::lock_guard lock(D().mu);
  D().fail_next[call] = static_cast<CUresult>(result);
}

// How many times `call` was made in this process (counted: host registration, the virtual
// memory management calls and the asynchronous copies between host and device).
int fakecuda_calls(const char* call) {
  std::lock_guard lock(D().mu);
  auto it = D().calls.find(call);
  return it == D().calls.end() ? 0 : it->second;
}

// What cuFileGetParameterBool answers for `param` from now on.
void fakecuda_cufile_set_bool_parameter(int param, int value) {
  std::lock_guard lock(D().mu);
  if (param >= 0 && param < 16) D().bool_parameters[param] = value != 0;
}

// ---- initialisation, errors, devices, contexts -------------------------------------------------

CUresult cuInit(unsigned flags) {
  if (flags != 0) return kInvalidValue;
  std::lock_guard lock(D().mu);
  if (!D().initialized) {
    if (const char* v = std::getenv("FAKE_CUDA_DEVICES")) D().devices = std::atoi(v);
    if (const char* v = std::getenv("FAKE_CUDA_GRANULARITY")) {
      D().granularity = static_cast<size_t>(std::atoll(v));
    }
    if (const char* v = std::getenv("FAKE_CUDA_COPY_DELAY_US")) {
      D().delay = std::chrono::microseconds(std::atoi(v));
    }
    D().contexts.resize(static_cast<size_t>(std::max(D().devices, 0)));
    for (size_t i = 0; i < D().contexts.size(); ++i) D().contexts[i].device = static_cast<int>(i);
    D().initialized = true;
  }
  return kSuccess;
}

CUresult cuDriverGetVersion(int* version) {
  if (version == nullptr) return kInvalidValue;
  *version = 13000;
  return kSuccess;
}

CUresult cuGetErrorName(CUresult error, const char** name) {
  switch (error) {
    case kSuccess:
      *name = "CUDA_SUCCESS";
      return kSuccess;
    case kInvalidValue:
      *name = "CUDA_ERROR_INVALID_VALUE";
      return kSuccess;
    case kOutOfMemory:
      *name = "CUDA_ERROR_OUT_OF_MEMORY";
      return kSuccess;
    case kNotInitialized:
      *name = "CUDA_ERROR_NOT_INITIALIZED";
      return kSuccess;
    case kInvalidDevice:
      *name = "CUDA_ERROR_INVALID_DEVICE";
      return kSuccess;
    case kInvalidContext:
      *name = "CUDA_ERROR_INVALID_CONTEXT";
      return kSuccess;
    case kInvalidHandle:
      *name = "CUDA_ERROR_INVALID_HANDLE";
      return kSuccess;
    case kNotReady:
      *name = "CUDA_ERROR_NOT_READY";
      return kSuccess;
    case kAlreadyRegistered:
      *name = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
      return kSuccess;
    case kNotRegistered:
      *name = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
      return kSuccess;
    default:
      *name = nullptr;
      return kInvalidValue;
  }
}

CUresult cuGetErrorString(CUresult error, const char** text) {
  const char* name = nullptr;
  if (cuGetErrorName(error, &name) != kSuccess) return kInvalidValue;
  *text = "(fake CUDA driver)";
  return kSuccess;
}

CUresult cuDeviceGetCount(int* count) {
  std::lock_guard lock(D().mu);
  if (!D().initialized) return kNotInitialized;
  *count = D().devices;
  return kSuccess;
}

CUresult cuDeviceGet(int* device, int ordinal) {
  std::lock_guard lock(D().mu);
  if (ordinal < 0 || ordinal >= D().devices) return kInvalidDevice;
  *device = ordinal;
  return kSuccess;
}

CUresult cuDevicePrimaryCtxRetain(Context** context, int device) {
  std::lock_guard lock(D().mu);
  if (device < 0 || device >= D().devices) return kInvalidDevice;
  Context& c = D().contexts[static_cast<size_t>(device)];
  ++c.retained;
  *context = &c;
  return kSuccess;
}

CUresult cuDevicePrimaryCtxRelease_v2(int device) {
  std::lock_guard lock(D().mu);
  if (device < 0 || device >= D().devices) return kInvalidDevice;
  Context& c = D().contexts[static_cast<size_t>(device)];
  if (c.retained == 0) {
    Violation("cuDevicePrimaryCtxRelease of a context retained 0 times");
    return kInvalidContext;
  }
  --c.retained;
  return kSuccess;
}

CUresult cuCtxPushCurrent_v2(Context* context) {
  if (context == nullptr) return kInvalidContext;
  current.push_back(context);
  return kSuccess;
}

CUresult cuCtxPopCurrent_v2(Context** context) {
  if (current.empty()) return kInvalidContext;
  if (context != nullptr) *context = current.back();
  current.pop_back();
  return kSuccess;
}

CUresult cuPointerGetAttributes(unsigned count, int* attributes, void** data, CUdeviceptr p) {
  std::lock_guard lock(D().mu);
  unsigned type = 0;
  int ordinal = -2;  // CU_DEVICE_INVALID, as the driver answers for unknown memory
  if (const DeviceAllocation* a = FindDevice(p, 0)) {
    type = kMemoryTypeDevice;
    ordinal = a->device;
  } else if (FindHost(reinterpret_cast<const void*>(p)) != nullptr) {
    type = kMemoryTypeHost;
    ordinal = 0;
  }
  for (unsigned i = 0; i < count; ++i) {
    switch (attributes[i]) {
      case kAttributeMemoryType:
        *static_cast<unsigned*>(data[i]) = type;
        break;
      case kAttributeIsManaged:
        *static_cast<unsigned*>(data[i]) = 0;
        break;
      case kAttributeDeviceOrdinal:
        *static_cast<int*>(data[i]) = ordinal;
        break;
      default:
        return kInvalidValue;
    }
  }
  return kSuccess;
}

// ---- streams and events -----------------------------------------------------------------------

CUresult cuStreamCreate(void** stream, unsigned flags) {
  if (!HasContext()) return kInvalidContext;
  if (flags > 1) return kInvalidValue;
  std::lock_guard lock(D().mu);
  *stream = NewStream();
  return kSuccess;
}

CUresult cuStreamDestroy_v2(void* stream) {
  std::unique_ptr<Stream> owned;
  {
    std::unique_lock lock(D().mu);
    auto it = D().streams.find(static_cast<Stream*>(stream));
    if (it == D().streams.end() || it->first == D().null_stream) return kInvalidHandle;
    Stream* s = it->first;
    Drain(s, lock);  // the driver finishes queued work after destroy returns; we finish it now
    s->stopping = true;
    s->work.notify_one();
    owned = std::move(it->second);
    D().streams.erase(it);
  }
  owned->worker.join();
  return kSuccess;
}

CUresult cuStreamSynchronize(void* stream) {
  std::unique_lock lock(D().mu);
  Stream* s = Resolve(stream);
  if (s == nullptr) return kInvalidHandle;
  Drain(s, lock);
  return kSuccess;
}

CUresult cuEventCreate(void** event, unsigned flags) {
  if (!HasContext()) return kInvalidContext;
  if (flags > 7) return kInvalidValue;
  std::lock_guard lock(D().mu);
  auto owned = std::make_shared<Event>();
  *event = owned.get();
  D().events.emplace(owned.get(), std::move(owned));
  return kSuccess;
}

CUresult cuEventDestroy_v2(void* event) {
  std::lock_guard lock(D().mu);
  // The driver lets a recorded event be destroyed before its stream reaches it; so do we (the
  // pending record holds the event).
  return D().events.erase(static_cast<Event*>(event)) == 1 ? kSuccess : kInvalidHandle;
}

CUresult cuEventRecord(void* event, void* stream) {
  std::lock_guard lock(D().mu);
  auto it = D().events.find(static_cast<Event*>(event));
  if (it == D().events.end()) return kInvalidHandle;
  Stream* s = Resolve(stream);
  if (s == nullptr) return kInvalidHandle;
  std::shared_ptr<Event> e = it->second;
  const uint64_t ticket = ++e->recorded;
  Op op;
  op.run = [e, ticket] {
    std::lock_guard inner(D().mu);
    if (e->reached < ticket) e->reached = ticket;
    e->done.notify_all();
  };
  s->queue.push_back(std::move(op));
  s->work.notify_one();
  return kSuccess;
}

CUresult cuEventQuery(void* event) {
  std::lock_guard lock(D().mu);
  auto it = D().events.find(static_cast<Event*>(event));
  if (it == D().events.end()) return kInvalidHandle;
  return it->second->reached >= it->second->recorded ? kSuccess : kNotReady;
}

CUresult cuEventSynchronize(void* event) {
  std::unique_lock lock(D().mu);
  auto it = D().events.find(static_cast<Event*>(event));
  if (it == D().events.end()) return kInvalidHandle;
  std::shared_ptr<Event> e = it->second;
  const uint64_t ticket = e->recorded;
  e->done.wait(lock, [&] { return e->reached >= ticket; });
  return kSuccess;
}

// ---- copies -------------------------------------------------------------------------------------

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, void* stream) {
  if (!HasContext()) return kInvalidContext;
  Op op;
  op.device = dst;
  op.device_bytes = bytes;
  std::unique_lock lock(D().mu);
  ++D().calls["cuMemcpyHtoDAsync_v2"];
  uintptr_t base = 0;
  DeviceAllocation* a = FindDevice(dst, bytes, &base);
  Stream* s = Resolve(stream);
  if (a == nullptr || (src == nullptr && bytes > 0)) return kInvalidValue;
  if (s == nullptr) return kInvalidHandle;
  std::byte* to = a->shadow + (dst - base);
  uintptr_t host_base = 0;
  const HostRange* h = FindHost(src, &host_base);
  if (h != nullptr && reinterpret_cast<uintptr_t>(src) + bytes <= host_base + h->bytes) {
    op.run = [to, src, bytes] { std::memcpy(to, src, bytes); };
    op.host = reinterpret_cast<uintptr_t>(src);
    op.host_bytes = bytes;
  } else {
    // Pageable memory: the driver waits for the stream's earlier work, stages the source and
    // returns; the device is written later, in stream order.
    Drain(s, lock);
    auto staged = std::make_shared<std::vector<std::byte>>(bytes);
    if (bytes > 0) std::memcpy(staged->data(), src, bytes);
    op.run = [to, staged, bytes] { std::memcpy(to, staged->data(), bytes); };
  }
  s->queue.push_back(std::move(op));
  s->work.notify_one();
  return kSuccess;
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, void* stream) {
  if (!HasContext()) return kInvalidContext;
  Op op;
  bool registered = false;
  {
    std::lock_guard lock(D().mu);
    ++D().calls["cuMemcpyDtoHAsync_v2"];
    uintptr_t base = 0;
    DeviceAllocation* a = FindDevice(src, bytes, &base);
    if (a == nullptr || (dst == nullptr && bytes > 0)) return kInvalidValue;
    const std::byte* from = a->shadow + (src - base);
    op.run = [dst, from, bytes] { std::memcpy(dst, from, bytes); };
    uintptr_t host_base = 0;
    const HostRange* h = FindHost(dst, &host_base);
    registered = h != nullptr && reinterpret_cast<uintptr_t>(dst) + bytes <= host_base + h->bytes;
  }
  op.host = reinterpret_cast<uintptr_t>(dst);
  op.host_bytes = bytes;
  op.device = src;
  op.device_bytes = bytes;
  return Copy(stream, std::move(op), /*synchronous=*/!registered);
}

// ---- host memory
// ----------------------------------------------------------------------------------

CUresult cuMemHostRegister_v2(void* p, size_t bytes, unsigned flags) {
  if (!HasContext()) return kInvalidContext;
  if (p == nullptr || bytes == 0 || flags > 15) return kInvalidValue;
  std::lock_guard lock(D().mu);
  ++D().calls["cuMemHostRegister"];
  if (CUresult injected = std::exchange(D().next_host_register_result, kSuccess)) return injected;
  const auto address = reinterpret_cast<uintptr_t>(p);
  for (const auto& [base, range] : D().host_memory) {
    if (Overlaps(base, range.bytes, address, bytes)) return kAlreadyRegistered;
  }
  D().host_memory.emplace(address, HostRange{bytes, false});
  return kSuccess;
}

CUresult cuMemHostUnregister(void* p) {
  std::unique_lock lock(D().mu);
  ++D().calls["cuMemHostUnregister"];
  auto it = D().host_memory.find(reinterpret_cast<uintptr_t>(p));
  if (it == D().host_memory.end() || it->second.allocated) return kNotRegistered;
  const uintptr_t base = it->first;
  const size_t bytes = it->second.bytes;
  if (InFlight(base, bytes, 0, 0)) {  // the caller is about to free memory DMA still uses
    Violation("cuMemHostUnregister of memory that a queued copy still uses");
    WaitUntilUnused(lock, base, bytes, 0, 0);
  }
  D().host_memory.erase(base);
  return kSuccess;
}

CUresult cuMemAllocHost_v2(void** p, size_t bytes) {
  if (!HasContext()) return kInvalidContext;
  if (bytes == 0) return kInvalidValue;
  void* memory = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (memory == nullptr) return kOutOfMemory;
  std::lock_guard lock(D().mu);
  D().host_memory.emplace(reinterpret_cast<uintptr_t>(memory), HostRange{bytes, true});
  *p = memory;
  return kSuccess;
}

CUresult cuMemFreeHost(void* p) {
  std::unique_lock lock(D().mu);
  auto it = D().host_memory.find(reinterpret_cast<uintptr_t>(p));
  if (it == D().host_memory.end() || !it->second.allocated) return kInvalidValue;
  const uintptr_t base = it->first;
  WaitUntilUnused(lock, base, it->second.bytes, 0, 0);  // cuMemFreeHost synchronises
  D().host_memory.erase(base);
  std::free(p);
  return kSuccess;
}

// ---- device memory
// ----------------------------------------------------------------------------------

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
  if (!HasContext()) return kInvalidContext;
  if (bytes == 0) return kInvalidValue;
  const size_t mapped = (bytes + 4095) / 4096 * 4096;
  // The address the caller gets: reserved, inaccessible. The bytes: a mapping of our own.
  void* address =
      mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (address == MAP_FAILED) return kOutOfMemory;
  void* shadow = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (shadow == MAP_FAILED) {
    munmap(address, mapped);
    return kOutOfMemory;
  }
  std::lock_guard lock(D().mu);
  const int device = current.back()->device;
  D().device_memory.emplace(
      reinterpret_cast<uintptr_t>(address),
      DeviceAllocation{bytes, static_cast<std::byte*>(shadow), mapped, device});
  *p = reinterpret_cast<uintptr_t>(address);
  return kSuccess;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
  std::unique_lock lock(D().mu);
  auto it = D().device_memory.find(static_cast<uintptr_t>(p));
  if (it == D().device_memory.end() || it->second.vmm) return kInvalidValue;
  const uintptr_t base = it->first;
  const DeviceAllocation a = it->second;
  WaitUntilUnused(lock, 0, 0, base, a.bytes);  // cuMemFree synchronises
  munmap(reinterpret_cast<void*>(base), a.mapped);
  munmap(a.shadow, a.mapped);
  D().device_memory.erase(base);
  return kSuccess;
}

// ---- virtual memory management
// ----------------------------------------------------------------------------------

// Counts `call` and answers its injected failure, if any (0 otherwise). With D().mu held.
static CUresult Enter(const char* call) {
  ++D().calls[call];
  auto it = D().fail_next.find(call);
  if (it == D().fail_next.end()) return kSuccess;
  const CUresult r = it->second;
  D().fail_next.erase(it);
  return r;
}

constexpr int kAllocationTypePinned = 1;
constexpr int kHandleTypePosixFd = 1;
constexpr int kLocationTypeDevice = 1;

struct MemLocation {
  int type;
  int id;
};
struct AllocationProp {
  int type;
  int requested_handle_types;
  MemLocation location;
  void* win32_handle_meta_data;
  unsigned char alloc_flags[8];
};
struct AccessDesc {
  MemLocation location;
  int flags;
};

static bool ValidProp(const AllocationProp* prop) {  // with D().mu held
  return prop != nullptr && prop->type == kAllocationTypePinned &&
         prop->location.type == kLocationTypeDevice && prop->location.id >= 0 &&
         prop->location.id < D().devices;
}

CUresult cuMemGetAllocationGranularity(size_t* granularity, const AllocationProp* prop,
                                       int option) {
  std::lock_guard lock(D().mu);
  if (CUresult r = Enter("cuMemGetAllocationGranularity")) return r;
  if (granularity == nullptr || !ValidProp(prop) || option < 0 || option > 1) return kInvalidValue;
  *granularity = D().granularity;
  return kSuccess;
}

CUresult cuMemCreate(unsigned long long* handle, size_t bytes, const AllocationProp* prop,
                     unsigned long long flags) {
  std::lock_guard lock(D().mu);
  if (CUresult r = Enter("cuMemCreate")) return r;
  if (handle == nullptr || !ValidProp(prop) || flags != 0 || bytes == 0 ||
      bytes % D().granularity != 0) {
    return kInvalidValue;
  }
  if (prop->requested_handle_types != kHandleTypePosixFd) return kInvalidValue;
  // The name carries the device, so that an importer knows where the memory is.
  const std::string name = "fakecuda-vmm." + std::to_string(prop->location.id);
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return kOutOfMemory;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    return kOutOfMemory;
  }
  *handle = D().next_physical++;
  D().physical.emplace(*handle, PhysicalAllocation{fd, bytes, prop->location.id});
  return kSuccess;
}

CUresult cuMemRelease(unsigned long long handle) {
  std::lock_guard lock(D().mu);
  if (CUresult r = Enter("cuMemRelease")) return r;
  auto it = D().physical.find(handle);
  if (it == D().physical.end()) return kInvalidValue;
  close(it->second.fd);  // mappings keep the bytes, as the driver's do until cuMemUnmap
  D().physical.erase(it);
  return kSuccess;
}

CUresult cuMemExportToShareableHandle(void* shareable, unsigned long long handle, int type,
                                      unsigned long long flags) {
  std::lock_guard lock(D().mu);
  if (CUresult r = Enter("cuMemExportToShareableHandle")) return r;
  auto it = D().physical.find(handle);
  if (shareable == nullptr || it == D().physical.end() || flags != 0) return kInvalidValue;
  if (type != kHandleTypePosixFd) return kInvalidValue;
  const int fd = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return kOutOfMemory;
  *static_cast<int*>(shareable) = fd;
  return kSuccess;
}

CUresult cuMemImportFromShareableHandle(unsigned long long* handle, void* os_handle, int type) {
  std::lock_guard lock(D().mu);
  if (CUresult r = Enter("cuMemImportFromShareableHandle")) return r;
  if (handle == nullptr || type != kHandleTypePosixFd) return kInvalidValue;
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(os_handle));
  // Only descriptors cuMemCreate made (in any process) are device memory.
  char target[256] = {};
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  if (readlink(link.c_str(), target, sizeof(target) - 1) < 0) return kInvalidValue;
  const std::string prefix = "/memfd:fakecuda-vmm.";
  const std::string name = target;
  struct stat st = {};
  if (name.rfind(prefix, 0) != 0 || fstat(fd, &st) != 0 || st.st_size <= 0) return kInvalidValue;
  const int device = std::atoi(name.c_str() + prefix.size());
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) return kOutOfMemory;
  *handle = D().next_physical++;
  D().physical.emplace(*handle, PhysicalAllocation{own, static_cast<size_t>(st.st_size), device});
  return kSuccess;
}

CUresult cuMemAddressReserve(CUdeviceptr* address, size_t bytes, size_t alignment, CUdeviceptr hint,
                             unsigned long long flags) {
  std::lock_guard lock(D().mu);
  if (CUresult r = Enter("cuMemAddressReserve")) return r;
  const size_t g = D().granularity;
  if (address == nullptr || bytes == 0 || bytes % g != 0 || flags != 0 ||
      (alignment != 0 && alignment % g != 0)) {
    return kInvalidValue;
  }
  (void)hint;  // a hint only
  const size_t align = std::max(alignment, g);
  const size_t raw_bytes = bytes + align;
  void* raw =
      mmap(nullptr, raw_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return kOutOfMemory;
  const uintptr_t base = (reinterpret_cast<uintptr_t>(raw) + align - 1) / align * align;
  D().reservations.emplace(base, Reservation{bytes, raw, raw_bytes});
  *address = base;
  return kSuccess;
}

CUresult cuMemAddressFree(CUdeviceptr address, size_t bytes) {
  std::lock_guard lock(D().mu);
  if (CUresult r = Enter("cuMemAddressFree")) return r;
  auto it = D().reservations.find(static_cast<uintptr_t>(address));
  if (it == D().reservations.end() || it->second.bytes != bytes) return kInvalidValue;
  for (const auto& [base, a] : D().device_memory) {
    if (a.vmm && Overlaps(base, a.bytes, it->first, bytes)) {
      Violation("cuMemAddressFree of a range that still has mappings");
      return kInvalidValue;
    }
  }
  munmap(it->second.raw, it->second.raw_bytes);
  D().reservations.erase(it);
  return kSuccess;
}

CUresult cuMemMap(CUdeviceptr address, size_t bytes, size_t offset, unsigned long long handle,
                  unsigned long long flags) {
  std::lock_guard lock(D().mu);
  if (CUresult r = Enter("cuMemMap")) return r;
  const size_t g = D().granularity;
  auto a = D().physical.find(handle);
  if (a == D().physical.end()) return kInvalidHandle;
  if (flags != 0 || bytes == 0 || bytes % g != 0 || offset % g != 0 || address % g != 0 ||
      offset + bytes > a->second.bytes) {
    return kInvalidValue;
  }
  // Inside one reservation, over nothing mapped.
  auto r = D().reservations.upper_bound(static_cast<uintptr_t>(address));
  if (r == D().reservations.begin()) return kInvalidValue;
  --r;
  if (address < r->first || address + bytes > r->first + r->second.bytes) return kInvalidValue;
  for (const auto& [base, m] : D().device_memory) {
    if (Overlaps(base, m.bytes, address, bytes)) return kInvalidValue;
  }
  void* shadow = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, a->second.fd,
                      static_cast<off_t>(offset));
  if (shadow == MAP_FAILED) return kOutOfMemory;
  DeviceAllocation m{bytes, static_cast<std::byte*>(shadow), bytes, a->second.device, true, false};
  D().device_memory.emplace(static_cast<uintptr_t>(address), m);
  return kSuccess;
}

CUresult cuMemUnmap(CUdeviceptr address, size_t bytes) {
  std::unique_lock lock(D().mu);
  if (CUresult r = Enter("cuMemUnmap")) return r;
  auto it = D().device_memory.find(static_cast<uintptr_t>(address));
  if (it == D().device_memory.end() || !it->second.vmm || it->second.bytes != bytes) {
    return kInvalidValue;
  }
  const DeviceAllocation m = it->second;
  WaitUntilUnused(lock, 0, 0, address, bytes);  // cuMemUnmap synchronises
  munmap(m.shadow, m.mapped);
  D().device_memory.erase(static_cast<uintptr_t>(address));
  return kSuccess;
}

CUresult cuMemSetAccess(CUdeviceptr address, size_t bytes, const AccessDesc* desc, size_t count) {
  std::lock_guard lock(D().mu);
  if (CUresult r = Enter("cuMemSetAccess")) return r;
  if (desc == nullptr || count == 0) return kInvalidValue;
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != kLocationTypeDevice || desc[i].location.id < 0 ||
        desc[i].location.id >= D().devices) {
      return kInvalidDevice;
    }
    if (desc[i].flags != 3 && desc[i].flags != 1) return kInvalidValue;
  }
  // Every byte of the range must be mapped (the mappings it covers become accessible).
  size_t covered = 0;
  std::vector<DeviceAllocation*> mappings;
  for (auto& [base, m] : D().device_memory) {
    if (!m.vmm || !Overlaps(base, m.bytes, address, bytes)) continue;
    if (base < address || base + m.bytes > address + bytes) return kInvalidValue;
    covered += m.bytes;
    mappings.push_back(&m);
  }
  if (covered != bytes) return kInvalidValue;
  for (DeviceAllocation* m : mappings) m->accessible = true;
  return kSuccess;
}

// ---- cuFile (GPUDirect Storage)
// ------------------------------------------------------------------- Moves bytes between the file
// and device memory's shadow with pread/pwrite on a buffered descriptor of the same file (cuFile
// itself takes unaligned sizes and offsets). Not stream ordered, as cuFile is not: device memory a
// queued copy still uses is recorded as misuse.

struct CUfileError {
  int err;
  int cu_err;
};
struct CUfileDescr {
  int type;
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
};

constexpr int kFileSuccess = 0;
constexpr int kFileCudaDriverError = 5011;
constexpr int kFileCudaPointerInvalid = 5012;
constexpr int kFileInvalidFileType = 5018;
constexpr int kFileDioNotSet = 5020;
constexpr int kFileInvalidValue = 5022;
constexpr int kFileAlreadyRegistered = 5023;
constexpr int kFileNotRegistered = 5024;

CUfileError cuFileDriverOpen() {
  std::lock_guard lock(D().mu);
  ++D().driver_opens;
  return {std::exchange(D().next_driver_open_result, kFileSuccess), 0};
}

CUfileError cuFileGetParameterBool(int param, bool* value) {
  if (value == nullptr || param < 0 || param >= 16) return {kFileInvalidValue, 0};
  std::lock_guard lock(D().mu);
  *value = D().bool_parameters[param];
  return {kFileSuccess, 0};
}

CUfileError cuFileHandleRegister(void** handle, CUfileDescr* descr) {
  if (handle == nullptr || descr == nullptr) return {kFileInvalidValue, 0};
  if (descr->type != 1) return {kFileInvalidFileType, 0};
  const int flags = fcntl(descr->handle.fd, F_GETFL);
  if (flags < 0) return {kFileInvalidValue, 0};
  if ((flags & O_DIRECT) == 0) return {kFileDioNotSet, 0};
  const std::string self = "/proc/self/fd/" + std::to_string(descr->handle.fd);
  const int buffered = open(self.c_str(), (flags & O_ACCMODE) | O_CLOEXEC);
  if (buffered < 0) return {kFileInvalidValue, 0};
  std::lock_guard lock(D().mu);
  void* h = new char;  // a unique address
  D().file_handles.emplace(h, buffered);
  *handle = h;
  return {kFileSuccess, 0};
}

void cuFileHandleDeregister(void* handle) {
  std::lock_guard lock(D().mu);
  auto it = D().file_handles.find(handle);
  if (it == D().file_handles.end()) {
    Violation("cuFileHandleDeregister of a handle that is not registered");
    return;
  }
  close(it->second);
  delete static_cast<char*>(it->first);
  D().file_handles.erase(it);
}

CUfileError cuFileBufRegister(const void* base, size_t length, int flags) {
  if (!HasContext()) return {kFileCudaDriverError, kInvalidContext};
  if (base == nullptr || length == 0 || flags != 0) return {kFileInvalidValue, 0};
  std::lock_guard lock(D().mu);
  const auto address = reinterpret_cast<uintptr_t>(base);
  if (FindDevice(address, length) == nullptr && FindHost(base) == nullptr) {
    return {kFileCudaPointerInvalid, 0};
  }
  if (!D().file_buffers.emplace(address, length).second) return {kFileAlreadyRegistered, 0};
  return {kFileSuccess, 0};
}

CUfileError cuFileBufDeregister(const void* base) {
  std::lock_guard lock(D().mu);
  if (D().file_buffers.erase(reinterpret_cast<uintptr_t>(base)) == 0) {
    return {kFileNotRegistered, 0};
  }
  return {kFileSuccess, 0};
}

// The shadow bytes of device [address, address + size), or null. With D().mu held.
static std::byte* DeviceBytes(uint64_t address, size_t size) {
  uintptr_t base = 0;
  DeviceAllocation* a = FindDevice(address, size, &base);
  return a == nullptr ? nullptr : a->shadow + (address - base);
}

static ssize_t FileTransfer(bool read, void* handle, uint64_t address, size_t size,
                            off_t file_offset) {
  int fd = -1;
  std::byte* bytes = nullptr;
  {
    std::lock_guard lock(D().mu);
    auto it = D().file_handles.find(handle);
    if (it == D().file_handles.end()) return -kFileInvalidValue;
    fd = it->second;
    bytes = DeviceBytes(address, size);
    if (bytes == nullptr) return -kFileCudaPointerInvalid;  // (host buffers are not modelled)
    if (InFlight(0, 0, address, size)) {
      Violation(read ? "cuFileRead into device memory a queued copy still uses"
                     : "cuFileWrite of device memory a queued copy still writes");
    }
    if (D().next_transfer_result < 0) {
      const long result = std::exchange(D().next_transfer_result, 0);
      errno = D().next_transfer_errno;
      return result;
    }
    if (D().next_transfer_result > 0) {
      size = std::min(size, static_cast<size_t>(std::exchange(D().next_transfer_result, 0)));
    }
  }
  return read ? pread(fd, bytes, size, file_offset) : pwrite(fd, bytes, size, file_offset);
}

ssize_t cuFileRead(void* handle, void* base, size_t size, off_t file_offset, off_t base_offset) {
  return FileTransfer(true, handle, reinterpret_cast<uintptr_t>(base) + base_offset, size,
                      file_offset);
}

ssize_t cuFileWrite(void* handle, const void* base, size_t size, off_t file_offset,
                    off_t base_offset) {
  return FileTransfer(false, handle, reinterpret_cast<uintptr_t>(base) + base_offset, size,
                      file_offset);
}

}  // extern "C"
