#include "tensortier/shared/shared_tensor.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <exception>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/cuda/cuda_vmm.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"
#include "tensortier/shared/unix_socket.hpp"

namespace tensortier {
namespace {

using shared::Clock;
using shared::UniqueFd;

constexpr uint64_t kHugePage = 2ull << 20;
// Tensors at least this large per rank are partitioned on huge-page boundaries (the unevenness it
// costs is then small), and their partitions try hugetlb pages.
constexpr uint64_t kHugePartitionThreshold = 64ull << 20;
constexpr char kServed = 'k';
constexpr char kUnknown = 'n';
constexpr char kEmpty = 'z';
// The server's process had no descriptor free to take the connection (EMFILE, ENFILE); a string
// follows saying which limit.
constexpr char kOutOfDescriptors = 'm';
constexpr char kOutOfSystemFiles = 'f';

uint64_t PageSize() {
  return static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}
uint64_t RoundUp(uint64_t v, uint64_t to) {
  return (v + to - 1) / to * to;
}

std::chrono::milliseconds Remaining(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

std::string RandomToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno != EINTR) ThrowIoError(errno, "getrandom", "shared group token");
    if (n > 0) got += static_cast<size_t>(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token += kHex[b >> 4];
    token += kHex[b & 15];
  }
  return token;
}

// The kernel's policy for transparent huge pages in shared memory: the bracketed word of
// shmem_enabled ("never", "advise", "always"...), or "" where it cannot be read.
std::string ShmemHugePolicy() {
  UniqueFd fd(::open("/sys/kernel/mm/transparent_hugepage/shmem_enabled", O_RDONLY | O_CLOEXEC));
  if (!fd) return "";
  char text[256];
  ssize_t n = ::read(fd.get(), text, sizeof(text) - 1);
  if (n <= 0) return "";
  std::string all(text, static_cast<size_t>(n));
  size_t open = all.find('['), close = all.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return "";
  return all.substr(open + 1, close - open - 1);
}

// Whether MADV_HUGEPAGE on a shared-memory mapping gets it huge pages under `policy`.
bool ShmemHugeOnAdvice(const std::string& policy) {
  return policy == "advise" || policy == "always" || policy == "within_size" || policy == "force";
}

// Faults in [address, address + length) for writing: MADV_POPULATE_WRITE, or one write per page
// on kernels without it (before 5.14).
void PopulateForWrite(uint8_t* address, uint64_t length, uint64_t page) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;
#endif
  if (::madvise(address, length, MADV_POPULATE_WRITE) == 0) return;
  for (uint64_t at = 0; at < length; at += page) {
    reinterpret_cast<volatile uint8_t*>(address)[at] = 0;  // the memfd is zero-filled
  }
}

// How many groups of `world_size` processes rank `rank` has created on a store: counted in the
// store itself (an atomic add), so that the nth such group of every rank gets the same keys
// whatever groups the process made on other stores or of other sizes.
std::string GroupCountKey(int world_size, int rank) {
  return StrCat("tensortier/shared/groups/", world_size, "/rank", rank);
}

const char* OrdinalSuffix(uint64_t n) {
  if (n % 100 >= 11 && n % 100 <= 13) return "th";
  return n % 10 == 1 ? "st" : n % 10 == 2 ? "nd" : n % 10 == 3 ? "rd" : "th";
}

// Whether a tensor is big enough per rank for huge-page partitions: every process that maps it
// must decide alike, so it depends on the spec and the owners' world size only.
bool IsHuge(const SharedTensorSpec& spec, int world_size) {
  return spec.rows() * spec.row_bytes() >=
         kHugePartitionThreshold * static_cast<uint64_t>(world_size);
}

// Named tensors are published store-wide (not under a group's prefix) so that processes outside
// the group can find them: the owners' socket token and world size, then the spec.
std::string NamedKey(const std::string& name) {
  return StrCat("tensortier/shared/named/", name);
}

// The decimal integer `text` is, all of it; std::invalid_argument naming `field` otherwise (out of
// range included: a record in the store is anyone's writing).
template <typename T>
T ParseField(const std::string& field, const std::string& text, const std::string& record) {
  T v{};
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
    throw std::invalid_argument(
        StrCat("shared tensor record: ", field, " '", text, "' is not a number in range: ",
               record));
  }
  return v;
}

struct NamedRecord {
  std::string token;
  int world_size = 0;
  SharedTensorSpec spec;

  std::string Format() const { return StrCat(token, " ", world_size, " ", spec.Describe()); }

  // What attach reads from the store: the store has no authentication, so every field is
  // checked before anything is mapped (the served memory's size is checked as it arrives).
  static NamedRecord Read(Store& store, const std::string& name,
                          std::chrono::milliseconds timeout) {
    if (name.empty()) throw std::invalid_argument("attach needs the tensor's name");
    std::string value;
    try {
      value = store.Get(NamedKey(name), timeout);
    } catch (const IoError& e) {
      if (e.error_code() != ETIMEDOUT) throw;
      ThrowIoError(ETIMEDOUT,
                   StrCat("attach: no shared tensor named '", name, "' appeared within ",
                          timeout.count(), " ms"),
                   name);
    }
    size_t a = value.find(' ');
    size_t b = a == std::string::npos ? a : value.find(' ', a + 1);
    if (b == std::string::npos) {
      throw std::invalid_argument(StrCat("bad shared tensor record for '", name, "': ", value));
    }
    NamedRecord r;
    r.token = value.substr(0, a);
    auto is_hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
    const bool hex =
        r.token.size() == 32 && std::all_of(r.token.begin(), r.token.end(), is_hex);
    if (!hex) {
      throw std::invalid_argument(
          StrCat("shared tensor record for '", name, "': token is not 32 hex digits: ", value));
    }
    r.world_size = ParseField<int>("world_size", value.substr(a + 1, b - a - 1), value);
    if (r.world_size <= 0 || r.world_size > kMaxSharedWorldSize) {
      throw std::invalid_argument(StrCat("shared tensor record for '", name, "': world_size ",
                                         r.world_size, " is not in [1, ", kMaxSharedWorldSize,
                                         "]: ", value));
    }
    r.spec = SharedTensorSpec::Parse(value.substr(b + 1));
    if (r.spec.name != name) {
      throw std::invalid_argument(StrCat("shared tensor record for '", name, "': name is '",
                                         r.spec.name, "': ", value));
    }
    if (r.spec.layout == SharedLayout::kDistributed) {
      throw std::invalid_argument(StrCat("shared tensor record for '", name,
                                         "': layout distributed is never published: ", value));
    }
    try {
      r.spec.Validate();
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(StrCat("shared tensor record for '", name, "': ", e.what()));
    }
    return r;
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Spec and partitioning

const char* SharedLayoutName(SharedLayout layout) {
  switch (layout) {
    case SharedLayout::kContinuous:
      return "continuous";
    case SharedLayout::kChunked:
      return "chunked";
    case SharedLayout::kDistributed:
      return "distributed";
  }
  return "?";
}

SharedLayout ParseSharedLayout(const std::string& name) {
  if (name == "continuous") return SharedLayout::kContinuous;
  if (name == "chunked") return SharedLayout::kChunked;
  if (name == "distributed") return SharedLayout::kDistributed;
  throw std::invalid_argument(
      StrCat("layout must be 'continuous', 'chunked' or 'distributed', not '", name, "'"));
}

const char* SharedMemoryName(SharedMemory memory) {
  return memory == SharedMemory::kDevice ? "device" : "host";
}

SharedMemory ParseSharedMemory(const std::string& name) {
  if (name == "host") return SharedMemory::kHost;
  if (name == "device") return SharedMemory::kDevice;
  throw std::invalid_argument(StrCat("memory must be 'host' or 'device', not '", name, "'"));
}

uint64_t SharedTensorSpec::rows() const {
  return shape.empty() ? 1 : shape[0];
}

uint64_t SharedTensorSpec::row_bytes() const {
  uint64_t n = element_size;
  for (size_t i = 1; i < shape.size(); ++i) n *= static_cast<uint64_t>(shape[i]);
  return n;
}

std::string SharedTensorSpec::Describe() const {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += StrCat(i ? "," : "", shape[i]);
  return StrCat("shape=[", dims, "] dtype=", dtype, " element_size=", element_size,
                " layout=", SharedLayoutName(layout), " memory=", SharedMemoryName(memory),
                " name='", name, "'");
}

SharedTensorSpec SharedTensorSpec::Parse(const std::string& described) {
  SharedTensorSpec s;
  auto field = [&](const std::string& key, char end) {
    size_t at = described.find(" " + key + "=");
    size_t start = at == std::string::npos ? std::string::npos : at + key.size() + 2;
    if (described.rfind(key + "=", 0) == 0) start = key.size() + 1;
    if (start == std::string::npos) {
      throw std::invalid_argument(StrCat("shared tensor record lacks ", key, ": ", described));
    }
    size_t stop = end == '\0' ? described.size() : described.find(end, start);
    if (stop == std::string::npos) stop = described.size();
    return described.substr(start, stop - start);
  };
  std::string dims = field("shape", ' ');
  if (dims.size() < 2 || dims.front() != '[' || dims.back() != ']') {
    throw std::invalid_argument(StrCat("bad shape in shared tensor record: ", described));
  }
  std::stringstream in(dims.substr(1, dims.size() - 2));
  for (std::string d; std::getline(in, d, ',');) {
    s.shape.push_back(ParseField<int64_t>("shape", d, described));
  }
  s.dtype = field("dtype", ' ');
  s.element_size = ParseField<uint64_t>("element_size", field("element_size", ' '), described);
  s.layout = ParseSharedLayout(field("layout", ' '));
  s.memory = ParseSharedMemory(field("memory", ' '));
  std::string quoted = field("name", '\0');
  if (quoted.size() < 2) throw std::invalid_argument(StrCat("bad name in: ", described));
  s.name = quoted.substr(1, quoted.size() - 2);
  return s;
}

void SharedTensorSpec::Validate() const {
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument(StrCat("shape has a negative dimension: ", Describe()));
  }
  if (element_size == 0) {
    throw std::invalid_argument(StrCat("element_size must be positive: ", Describe()));
  }
  // Every product is checked before it is formed: rows x row_bytes must not wrap.
  uint64_t bytes = element_size;
  for (size_t i = 0; i < shape.size(); ++i) {
    const auto d = static_cast<uint64_t>(shape[i]);
    if (i == 0 && d == 0) continue;  // no rows: the row's size must still be sane
    if (bytes > kMaxSharedTensorBytes || (d != 0 && bytes > kMaxSharedTensorBytes / d)) {
      throw std::invalid_argument(StrCat("shape and element_size make more than 2^56 bytes, ",
                                         "more than an address space holds: ", Describe()));
    }
    bytes *= d;
  }
  if (bytes > kMaxSharedTensorBytes) {
    throw std::invalid_argument(StrCat("shape and element_size make more than 2^56 bytes, ",
                                       "more than an address space holds: ", Describe()));
  }
  if (dtype.empty() || std::any_of(dtype.begin(), dtype.end(), [](char c) {
        return std::isspace(static_cast<unsigned char>(c));
      })) {
    throw std::invalid_argument(StrCat("dtype must be a word: ", Describe()));
  }
  constexpr std::string_view kTorch = "torch.";
  if (dtype.rfind(kTorch, 0) == 0) {
    const Dtype* known = DtypeOfTorch(std::string_view(dtype).substr(kTorch.size()));
    if (known != nullptr && known->bits % 8 == 0 && known->bits / 8 != element_size) {
      throw std::invalid_argument(StrCat("element_size ", element_size, " is not the size of ",
                                         dtype, " (", known->bits / 8, "): ", Describe()));
    }
  }
}

std::vector<SharedPartition> PartitionRows(uint64_t rows, uint64_t row_bytes, int world_size,
                                           uint64_t granule_bytes) {
  if (world_size <= 0) throw std::invalid_argument("world_size must be positive");
  uint64_t unit = 1;  // rows per indivisible unit: a whole number of granules
  if (row_bytes > 0 && granule_bytes > 1) unit = granule_bytes / std::gcd(granule_bytes, row_bytes);
  uint64_t units = (rows + unit - 1) / unit;
  uint64_t base = units / world_size;
  uint64_t extra = units % world_size;
  std::vector<SharedPartition> parts(world_size);
  uint64_t begin = 0;
  for (int r = 0; r < world_size; ++r) {
    uint64_t n = (base + (static_cast<uint64_t>(r) < extra ? 1 : 0)) * unit;
    n = std::min(n, rows - begin);
    parts[r] = SharedPartition{r, begin, n, n * row_bytes, nullptr};
    begin += n;
  }
  return parts;
}

// ---------------------------------------------------------------------------------------------
// Memory: the mappings of one tensor in this process

struct SharedTensor::Memory {
  // Host memory.
  uint8_t* reserved = nullptr;  // kContinuous: the whole range, partitions mapped inside it
  uint64_t reserved_bytes = 0;
  std::vector<std::pair<void*, uint64_t>> mappings;  // kChunked: each partition
  std::vector<HostRegistration> registrations;       // of the partitions' mappings
  // Device memory, given back in reverse: mappings, then allocations, then the range.
  std::optional<DeviceAddressRange> device_range;
  std::vector<DeviceAllocation> device_allocations;
  std::vector<DeviceMapping> device_mappings;

  ~Memory() {
    device_mappings.clear();
    device_allocations.clear();
    device_range.reset();
    registrations.clear();  // CUDA lets go of the pages before they are unmapped
    if (reserved != nullptr) ::munmap(reserved, reserved_bytes);
    for (auto [address, length] : mappings) ::munmap(address, length);
  }
};

const SharedPartition& SharedTensor::local() const {
  if (rank_ < 0) {
    throw std::logic_error(StrCat("shared tensor '", spec_.name,
                                  "' was attached from outside its group: it owns no rows here"));
  }
  return partitions_.at(rank_);
}

uint8_t* SharedTensor::data() const {
  if (spec_.layout != SharedLayout::kContinuous) {
    throw std::logic_error("a chunked shared tensor has no single address: use its partitions");
  }
  std::shared_ptr<Memory> hold = Hold();
  if (hold->device_range) return reinterpret_cast<uint8_t*>(hold->device_range->address());
  return hold->reserved;
}

std::shared_ptr<void> SharedTensor::memory() const {
  return Hold();
}

std::shared_ptr<SharedTensor::Memory> SharedTensor::Hold() const {
  std::lock_guard lock(mutex_);
  if (!memory_) {
    throw std::logic_error(StrCat("shared tensor ", spec_.Describe(), " was closed (finalized)"));
  }
  return memory_;
}

bool SharedTensor::closed() const {
  std::lock_guard lock(mutex_);
  return !memory_;
}

// ---------------------------------------------------------------------------------------------
// Gather / scatter

namespace {

// Rows this far ahead are prefetched: enough misses in flight to cover memory latency.
constexpr size_t kPrefetchAhead = 8;
// Only a row's first cache lines: the hardware prefetcher follows a longer row by itself.
constexpr uint64_t kPrefetchBytes = 512;

template <bool kForWrite>
inline void PrefetchRow(const uint8_t* row, uint64_t row_bytes) {
  const uint64_t n = std::min(row_bytes, kPrefetchBytes);
  for (uint64_t b = 0; b < n; b += 64) __builtin_prefetch(row + b, kForWrite ? 1 : 0, 3);
}

void CheckIndices(const int64_t* indices, size_t count, uint64_t first_row, uint64_t rows,
                  const char* what) {
  for (size_t i = 0; i < count; ++i) {
    const int64_t v = indices[i];
    if (v < 0 || static_cast<uint64_t>(v) < first_row ||
        static_cast<uint64_t>(v) - first_row >= rows) {
      throw std::out_of_range(
          first_row == 0 ? StrCat("index ", v, " (position ", i, ") is out of range for ", what,
                                  " of ", rows, " rows")
                         : StrCat("index ", v, " (position ", i, ") is out of range for ", what,
                                  " holding rows [", first_row, ", ", first_row + rows, ")"));
    }
  }
}

// Copies row `indices[i]` (at address(indices[i])) to or from row i of `packed`, for i in
// [0, count), on one thread for small batches and several for large ones.
template <typename Address>
void CopyIndexedRows(Address address, const int64_t* indices, size_t count, uint64_t row_bytes,
                     uint8_t* packed, bool gather) {
  if (count == 0 || row_bytes == 0) return;
  auto run = [&](size_t begin, size_t end) {
    const size_t ahead = std::min(end, begin + kPrefetchAhead);
    for (size_t i = begin; i < ahead; ++i) {
      PrefetchRow<false>(address(static_cast<uint64_t>(indices[i])), row_bytes);
    }
    for (size_t i = begin; i < end; ++i) {
      if (i + kPrefetchAhead < end) {
        const uint8_t* next = address(static_cast<uint64_t>(indices[i + kPrefetchAhead]));
        if (gather) {
          PrefetchRow<false>(next, row_bytes);
        } else {
          PrefetchRow<true>(next, row_bytes);
        }
      }
      uint8_t* row = address(static_cast<uint64_t>(indices[i]));
      if (gather) {
        std::memcpy(packed + i * row_bytes, row, row_bytes);
      } else {
        std::memcpy(row, packed + i * row_bytes, row_bytes);
      }
    }
  };
  size_t threads = 1;
  if (count * row_bytes >= kParallelRowCopyBytes) {
    threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
    threads = std::min(threads, count);
  }
  if (threads == 1) return run(0, count);
  std::vector<std::thread> pool;
  size_t per = (count + threads - 1) / threads;
  for (size_t t = 1; t < threads; ++t) {
    size_t b = std::min(count, t * per), e = std::min(count, (t + 1) * per);
    pool.emplace_back(run, b, e);  // memcpy cannot throw: nothing to carry back
  }
  run(0, std::min(count, per));
  for (auto& th : pool) th.join();
}

}  // namespace

void GatherRows(const void* table, uint64_t table_rows, uint64_t row_bytes, uint64_t first_row,
                const int64_t* indices, size_t count, void* out) {
  CheckIndices(indices, count, first_row, table_rows, "a table");
  auto* base = static_cast<uint8_t*>(const_cast<void*>(table));
  CopyIndexedRows([&](uint64_t row) { return base + (row - first_row) * row_bytes; }, indices,
                  count, row_bytes, static_cast<uint8_t*>(out), true);
}

void ScatterRows(void* table, uint64_t table_rows, uint64_t row_bytes, uint64_t first_row,
                 const int64_t* indices, size_t count, const void* in) {
  CheckIndices(indices, count, first_row, table_rows, "a table");
  auto* base = static_cast<uint8_t*>(table);
  CopyIndexedRows([&](uint64_t row) { return base + (row - first_row) * row_bytes; }, indices,
                  count, row_bytes, static_cast<uint8_t*>(const_cast<void*>(in)), false);
}

RowRoute RouteRows(const int64_t* indices, size_t count, const std::vector<uint64_t>& ends,
                   int64_t* order) {
  RowRoute route;
  route.counts.assign(ends.size(), 0);
  if (ends.empty()) {
    if (count > 0) route.bad = 0;
    return route;
  }
  const uint64_t rows = ends.back();
  // Owners are found twice (count, then place) rather than stored: a batch's owners would be
  // one more array as large as the batch.
  auto owner = [&](uint64_t row) {
    return static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), row) - ends.begin());
  };
  for (size_t i = 0; i < count; ++i) {
    if (indices[i] < 0 || static_cast<uint64_t>(indices[i]) >= rows) {
      route.bad = static_cast<int64_t>(i);
      route.counts.assign(ends.size(), 0);
      return route;
    }
    route.counts[owner(static_cast<uint64_t>(indices[i]))]++;
  }
  std::vector<uint64_t> next(ends.size(), 0);
  for (size_t r = 1; r < ends.size(); ++r) next[r] = next[r - 1] + route.counts[r - 1];
  for (size_t i = 0; i < count; ++i) {
    order[next[owner(static_cast<uint64_t>(indices[i]))]++] = static_cast<int64_t>(i);
  }
  return route;
}

void SharedTensor::CopyRows(const int64_t* indices, size_t count, uint8_t* buffer,
                            bool gather) const {
  std::shared_ptr<Memory> hold = Hold();
  if (spec_.memory == SharedMemory::kDevice) {
    throw std::logic_error(
        StrCat("shared tensor ", spec_.Describe(),
               " is in device memory: gather and scatter rows through a CUDA view"));
  }
  const uint64_t rows = spec_.rows();
  const uint64_t row_bytes = spec_.row_bytes();
  CheckIndices(indices, count, 0, rows, "a shared tensor");
  if (hold->reserved != nullptr) {
    uint8_t* base = hold->reserved;
    return CopyIndexedRows([&](uint64_t row) { return base + row * row_bytes; }, indices, count,
                           row_bytes, buffer, gather);
  }
  // Chunked: the partition holding the row.
  std::vector<uint64_t> ends;
  for (const auto& p : partitions_) ends.push_back(p.row_begin + p.rows);
  CopyIndexedRows(
      [&](uint64_t row) {
        size_t r = std::upper_bound(ends.begin(), ends.end(), row) - ends.begin();
        const SharedPartition& p = partitions_[r];
        return p.address + (row - p.row_begin) * row_bytes;
      },
      indices, count, row_bytes, buffer, gather);
}

void SharedTensor::Gather(const int64_t* indices, size_t count, void* out) const {
  CopyRows(indices, count, static_cast<uint8_t*>(out), true);
}

void SharedTensor::Scatter(const int64_t* indices, size_t count, const void* in) {
  CopyRows(indices, count, static_cast<uint8_t*>(const_cast<void*>(in)), false);
}

// ---------------------------------------------------------------------------------------------
// Host memory registered with CUDA (page-locked for fast copies), when a driver is present.

void SharedTensor::RegisterWithCuda(int device) {
  const CudaDriver& driver = CudaDriver::Get();
  if (!driver.available()) {
    stats_.cuda_registered_reason = StrCat("no CUDA driver (", driver.why_unavailable(), ")");
    return;
  }
  const uint64_t page = PageSize();
  std::vector<HostRegistration> registrations;
  try {
    PrimaryContext context(driver, device);
    for (const SharedPartition& p : partitions_) {
      if (p.bytes > 0) registrations.emplace_back(context, p.address, RoundUp(p.bytes, page));
    }
  } catch (const CudaError& e) {
    // Registration only speeds copies up: the tensor works without it, and the stats say why.
    stats_.cuda_registered_reason = e.what();
    return;
  }
  memory_->registrations = std::move(registrations);
  stats_.cuda_registered = true;
}

// ---------------------------------------------------------------------------------------------
// The partition server: hands this rank's partition descriptors to same-user peers.

struct SharedGroup::Server {
  std::string name;
  UniqueFd listener, wake_read, wake_write;
  std::mutex mutex;
  std::map<std::string, int> served;  // key -> descriptor (-1: an empty partition)
  std::atomic<uint64_t> refused{0};
  // Opened here, before the thread: the group's descriptors are all open once it is made.
  shared::SpareFd spare;
  std::thread thread;

  explicit Server(std::string socket_name) : name(std::move(socket_name)) {
    listener = shared::ListenAbstract(name);
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) ThrowIoError(errno, "pipe2", name);
    wake_read = UniqueFd(fds[0]);
    wake_write = UniqueFd(fds[1]);
    thread = std::thread([this] { Run(); });
  }

  ~Server() {
    char b = 0;
    while (::write(wake_write.get(), &b, 1) < 0 && errno == EINTR) {
    }
    thread.join();
    for (auto& [key, fd] : served) {
      if (fd >= 0) ::close(fd);
    }
  }

  void Serve(const std::string& key, UniqueFd fd) {
    std::lock_guard lock(mutex);
    auto [it, inserted] = served.emplace(key, fd.get());
    if (!inserted) throw std::invalid_argument(StrCat("a shared tensor named '", key, "' exists"));
    fd.release();
  }

  void Unserve(const std::string& key) {
    std::lock_guard lock(mutex);
    auto it = served.find(key);
    if (it == served.end()) return;
    if (it->second >= 0) ::close(it->second);
    served.erase(it);
  }

  void Run() {
    bool pause = false;
    for (;;) {
      pollfd p[2] = {{wake_read.get(), POLLIN, 0}, {listener.get(), POLLIN, 0}};
      // After a connection that could not be taken at all (out of descriptors, the spare
      // gone), the listener, still ready, is left alone a moment: polling it would spin.
      if (::poll(p, pause ? 1 : 2, pause ? 50 : -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      pause = false;
      if (p[0].revents) return;
      if (p[1].revents == 0) continue;
      spare.Refill();  // lost to another thread the last time descriptors ran out
      shared::Accepted accepted = shared::AcceptWithSpare(listener.get(), spare);
      UniqueFd c = std::move(accepted.connection);
      if (!c) {
        pause = accepted.error == EMFILE || accepted.error == ENFILE;
        continue;
      }
      if (!shared::PeerIsSameUser(c.get())) {
        refused.fetch_add(1);
        c = UniqueFd();
        spare.Refill();
        continue;  // closed unanswered
      }
      if (accepted.error != 0) {
        // Taken with the spare descriptor: the peer learns at once why it cannot be served
        // (it would pass a descriptor it could not receive anyway) instead of waiting out its
        // timeout.
        try {
          auto deadline = shared::DeadlineAfter(std::chrono::seconds(5));
          // The request is read first: closing a socket with unread data resets the peer's
          // end before it reads the answer.
          shared::RecvString(c.get(), deadline, name, 4096);
          shared::SendStatusAndFd(
              c.get(), accepted.error == ENFILE ? kOutOfSystemFiles : kOutOfDescriptors, -1,
              deadline, name);
          shared::SendString(c.get(), shared::WithDescriptorLimit("accept", accepted.error),
                             deadline, name);
        } catch (const std::exception&) {
        }
        c = UniqueFd();
        spare.Refill();
        continue;
      }
      try {
        auto deadline = shared::DeadlineAfter(std::chrono::seconds(5));
        std::string key = shared::RecvString(c.get(), deadline, name, 4096);
        std::lock_guard lock(mutex);
        auto it = served.find(key);
        char status = it == served.end() ? kUnknown : it->second < 0 ? kEmpty : kServed;
        shared::SendStatusAndFd(c.get(), status, status == kServed ? it->second : -1, deadline,
                                name);
      } catch (const std::exception&) {
        // A peer that vanished mid-request: it sees its own error; keep serving the others.
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Group

SharedGroup::SharedGroup(std::shared_ptr<Store> store, int rank, int world_size,
                         std::chrono::milliseconds timeout)
    : store_(std::move(store)), rank_(rank), world_size_(world_size), timeout_(timeout) {
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument(
        StrCat("rank ", rank, " is not in a group of ", world_size, " processes"));
  }
  if (!store_) throw std::invalid_argument("a shared group needs a store");
  // The group's keys are its own: the nth group of world_size processes that each rank creates
  // on this store. A peer already past this group (it created more such groups on this store)
  // is never coming: it made its groups in another order, or gave up on this one.
  const uint64_t ordinal = static_cast<uint64_t>(store_->Add(GroupCountKey(world_size_, rank_), 1));
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    const auto theirs = static_cast<uint64_t>(store_->Add(GroupCountKey(world_size_, r), 0));
    if (theirs > ordinal) {
      throw std::invalid_argument(
          StrCat("shared group: this is rank ", rank_, "'s ", ordinal, OrdinalSuffix(ordinal),
                 " group of ", world_size_, " processes on this store, but rank ", r,
                 " has created ", theirs,
                 " already: every rank must create its groups on one store in the same order "
                 "(processes of different groups that create them on one store at the same time "
                 "each need a PrefixStore of their own)"));
    }
  }
  prefix_ = StrCat("tensortier/shared/group/", world_size_, "/", ordinal);
  std::string key = prefix_ + "/token";
  if (rank_ == 0) {
    token_ = RandomToken();
    store_->Set(key, token_);
  } else {
    try {
      token_ = store_->Get(key, timeout_);
    } catch (const IoError& e) {
      if (e.error_code() != ETIMEDOUT) throw;
      ThrowIoError(
          ETIMEDOUT,
          StrCat("shared group: rank 0 did not publish the job token within ", timeout_.count(),
                 " ms (it died, is not creating this group, or "
                 "creates its groups on this store in another order)"),
          key);
    }
  }
  socket_name_ = StrCat("tensortier.", token_, ".", rank_);
  server_ = std::make_shared<Server>(socket_name_);
  Barrier("shared group start");
}

SharedGroup::~SharedGroup() {
  Close();
}

const std::string& SharedGroup::socket_name() const noexcept {
  return socket_name_;
}

uint64_t SharedGroup::refused_peers() const {
  return server_ ? server_->refused.load() : 0;
}

void SharedGroup::Close() {
  for (auto& weak : tensors_) {
    if (auto t = weak.lock()) t->Close();
  }
  tensors_.clear();
  server_.reset();
}

std::vector<std::string> SharedGroup::AllGather(const std::string& what, const std::string& value) {
  if (!server_) throw std::logic_error(StrCat(what, ": the shared group was closed"));
  const uint64_t n = next_collective_++;
  std::string base = StrCat(prefix_, "/c", n, "/");
  // Each rank's entry names its call ahead of its value: a rank making another call at this
  // point (a barrier where the others create a tensor) is seen by every rank, itself included.
  store_->Set(base + std::to_string(rank_), StrCat(what.size(), ":", what, value));
  auto deadline = shared::DeadlineAfter(timeout_);
  std::vector<std::string> all(world_size_);
  std::vector<std::string> calls(world_size_);
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) {
      all[r] = value;
      calls[r] = what;
      continue;
    }
    try {
      std::string entry = store_->Get(base + std::to_string(r), Remaining(deadline));
      const size_t colon = std::min(entry.find(':'), entry.size());
      uint64_t length = 0;
      auto [end, ec] = std::from_chars(entry.data(), entry.data() + colon, length);
      if (colon == entry.size() || ec != std::errc() || end != entry.data() + colon ||
          length > entry.size() - colon - 1) {
        throw std::invalid_argument(StrCat(what, ": rank ", r, " left an entry of no call at ",
                                           base, r, " in the store"));
      }
      calls[r] = entry.substr(colon + 1, length);
      all[r] = entry.substr(colon + 1 + length);
    } catch (const IoError& e) {
      if (e.error_code() != ETIMEDOUT) throw;
      ThrowIoError(ETIMEDOUT,
                   StrCat(what, ": rank ", r, " of ", world_size_, " did not arrive within ",
                          timeout_.count(), " ms (it died, or is not making the same call)"),
                   base + std::to_string(r));
    }
  }
  if (std::any_of(calls.begin(), calls.end(), [&](const std::string& c) { return c != what; })) {
    std::map<std::string, std::string> ranks_by_call;
    for (int r = 0; r < world_size_; ++r) {
      auto& ranks = ranks_by_call[calls[r]];
      ranks += StrCat(ranks.empty() ? "" : ",", r);
    }
    std::string msg =
        StrCat("collective call ", n + 1, " of the shared group: ranks made different calls ",
               "(every rank must make the same collective calls in the same order):");
    for (const auto& [call, ranks] : ranks_by_call) {
      msg += StrCat(" rank ", ranks, " called ", call, ";");
    }
    msg.pop_back();
    throw std::invalid_argument(msg);
  }
  return all;
}

void SharedGroup::Remember(const std::shared_ptr<SharedTensor>& tensor) {
  // Tensors dropped since are forgotten: a job that makes and drops many keeps no trace of them.
  std::erase_if(tensors_, [](const std::weak_ptr<SharedTensor>& t) { return t.expired(); });
  tensors_.push_back(tensor);
}

std::vector<std::string> SharedGroup::Settle(const std::string& what, std::exception_ptr failure,
                                             const std::string& value) {
  std::string mine = StrCat("+", value);
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      mine = StrCat("!", e.what());
    }
    // A failing rank still waits for the others (it keeps serving what they may be fetching
    // from it), but raises its own error even when a peer never arrives: a peer gone is often
    // why it failed, and the timeout would hide that.
    try {
      AllGather(what, mine);
    } catch (...) {
    }
    std::rethrow_exception(failure);
  }
  std::vector<std::string> all = AllGather(what, mine);
  std::string failed;
  for (int r = 0; r < world_size_; ++r) {
    if (!all[r].empty() && all[r][0] == '!') {
      failed += StrCat(failed.empty() ? "" : "; ", "rank ", r, ": ", all[r].substr(1));
    }
    all[r] = all[r].substr(1);
  }
  if (!failed.empty()) throw std::runtime_error(StrCat(what, " failed on ", failed));
  return all;
}

void SharedGroup::Barrier(const std::string& what) {
  AllGather(what, "");
}

void SharedGroup::Agree(const std::string& what, const std::string& value) {
  std::vector<std::string> all = AllGather(what, value);
  if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all[0]; })) {
    return;
  }
  std::map<std::string, std::string> ranks_by_value;
  for (int r = 0; r < world_size_; ++r) {
    auto& ranks = ranks_by_value[all[r]];
    ranks += StrCat(ranks.empty() ? "" : ",", r);
  }
  std::string msg = StrCat(what, ": ranks disagree:");
  for (const auto& [v, ranks] : ranks_by_value)
    msg += StrCat(" rank ", ranks, " asked for ", v, ";");
  msg.pop_back();
  throw std::invalid_argument(msg);
}

namespace {

// Device memory is mapped collectively by the processes that made it (each imports every rank's
// allocation into its own context); a later process has no way to join that.
void RefuseDeviceAttach(const SharedTensorSpec& spec, const std::string& name) {
  if (spec.memory == SharedMemory::kDevice) {
    throw std::invalid_argument(StrCat("attach: '", name,
                                       "' is in device memory, which only the processes that "
                                       "created it collectively map"));
  }
}

}  // namespace

std::shared_ptr<SharedTensor> SharedGroup::Create(const SharedTensorSpec& spec, int device) {
  spec.Validate();
  if (spec.layout == SharedLayout::kDistributed) {
    throw std::invalid_argument(
        "the distributed layout is not mapped: tensortier.shared builds it");
  }
  Agree("create_tensor", spec.Describe());
  std::string key = spec.name.empty() ? StrCat("#", next_collective_) : spec.name;
  auto tensor = spec.memory == SharedMemory::kDevice ? MapDevice(spec, key, device)
                                                     : Map(spec, key, true, device);
  if (!spec.name.empty() && rank_ == 0) {
    // Published after every rank serves its partition: whoever reads it can map them all.
    store_->Set(NamedKey(spec.name), NamedRecord{token_, world_size_, spec}.Format());
  }
  return tensor;
}

std::shared_ptr<SharedTensor> SharedGroup::Attach(const std::string& name, int device) {
  if (!server_) throw std::logic_error("attach: the shared group was closed");
  NamedRecord record = NamedRecord::Read(*store_, name, timeout_);
  RefuseDeviceAttach(record.spec, name);
  std::shared_ptr<SharedTensor> tensor;
  if (record.token == token_ && record.world_size == world_size_) {
    tensor = Map(record.spec, name, false, device);
  } else {
    tensor = Layout(record.spec, name, record.world_size, -1);
    FetchPartitions(*tensor, record.token, -1, timeout_);
    tensor->RegisterWithCuda(device);
    Remember(tensor);
  }
  return tensor;
}

std::shared_ptr<SharedTensor> AttachSharedTensor(Store& store, const std::string& name,
                                                 std::chrono::milliseconds timeout) {
  NamedRecord record = NamedRecord::Read(store, name, timeout);
  RefuseDeviceAttach(record.spec, name);
  auto tensor = SharedGroup::Layout(record.spec, name, record.world_size, -1);
  SharedGroup::FetchPartitions(*tensor, record.token, -1, timeout);
  return tensor;
}

std::shared_ptr<SharedTensor> SharedGroup::Layout(const SharedTensorSpec& spec,
                                                  const std::string& key, int world_size,
                                                  int rank) {
  const uint64_t page = PageSize();
  const bool continuous = spec.layout == SharedLayout::kContinuous;
  const bool huge = IsHuge(spec, world_size);
  uint64_t granule = continuous ? (huge ? kHugePage : page) : 1;

  auto tensor = std::shared_ptr<SharedTensor>(new SharedTensor());
  tensor->spec_ = spec;
  tensor->rank_ = rank;
  tensor->key_ = key;
  tensor->partitions_ = PartitionRows(spec.rows(), spec.row_bytes(), world_size, granule);
  auto memory = std::make_shared<SharedTensor::Memory>();
  uint64_t span = 0;
  for (const auto& p : tensor->partitions_) span += RoundUp(p.bytes, page);
  if (continuous && span > 0) {
    // One PROT_NONE range, aligned for huge pages, that the partitions are mapped into.
    uint64_t align = huge ? kHugePage : page;
    uint64_t ask = RoundUp(span, huge ? kHugePage : page) + align;
    void* raw = ::mmap(nullptr, ask, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) ThrowIoError(errno, "reserve address range for", key, 0, ask);
    auto base = reinterpret_cast<uintptr_t>(raw);
    uintptr_t aligned = RoundUp(base, align);
    if (aligned > base) ::munmap(raw, aligned - base);
    uint64_t keep = ask - (aligned - base);
    memory->reserved = reinterpret_cast<uint8_t*>(aligned);
    memory->reserved_bytes = keep;
  }
  // Not visible to anyone before it is returned; unmapped with the tensor if mapping fails.
  tensor->memory_ = std::move(memory);
  return tensor;
}

int SharedGroup::MapPartition(SharedTensor& t, int r, int fd, bool populate) {
  const uint64_t page = PageSize();
  SharedPartition& p = t.partitions_[r];
  SharedTensor::Memory& memory = *t.memory_;
  uint64_t length = RoundUp(p.bytes, page);
  int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
  void* want = nullptr;
  if (memory.reserved != nullptr) {
    uint64_t offset = 0;
    for (int q = 0; q < r; ++q) offset += RoundUp(t.partitions_[q].bytes, page);
    want = memory.reserved + offset;
    flags |= MAP_FIXED;
  }
  void* got = ::mmap(want, length, PROT_READ | PROT_WRITE, flags, fd, 0);
  if (got == MAP_FAILED) return errno;
  if (memory.reserved == nullptr) memory.mappings.emplace_back(got, length);
  p.address = static_cast<uint8_t*>(got);
  return 0;
}

namespace {

// The descriptor rank `what` serves under `key` at abstract socket `peer`. Throws IoError:
// ECONNREFUSED/ENOENT (gone), ENOENT (not served), EMFILE/ENFILE (either side out of
// descriptors, naming the limit), ETIMEDOUT.
UniqueFd FetchDescriptor(const std::string& peer, const std::string& key,
                         Clock::time_point deadline, const std::string& what) {
  UniqueFd c;
  try {
    c = shared::ConnectAbstract(peer, deadline, false);
  } catch (const IoError& e) {
    if (e.error_code() != ECONNREFUSED && e.error_code() != ENOENT) throw;
    // Nothing listens under the rank's name: its process is gone.
    ThrowIoError(
        e.error_code(),
        StrCat("connect to ", what, ", which is gone (its process exited or closed its group),"),
        peer);
  }
  shared::RequireSameUser(c.get(), what);
  shared::SendString(c.get(), key, deadline, what);
  auto [status, fd] = shared::RecvStatusAndFd(c.get(), deadline, what);
  if (status == kOutOfDescriptors || status == kOutOfSystemFiles) {
    const std::string why = shared::RecvString(c.get(), deadline, what, 4096);
    ThrowIoError(status == kOutOfSystemFiles ? ENFILE : EMFILE,
                 StrCat("fetch partition from ", what, ", which is out of descriptors (its ", why,
                        ")"),
                 key);
  }
  if (status != kServed || !fd) {
    ThrowIoError(ENOENT, StrCat("fetch partition from ", what, " (it closed the tensor)"), key);
  }
  return std::move(fd);
}

}  // namespace

void SharedGroup::FetchPartitions(SharedTensor& t, const std::string& token, int skip_rank,
                                  std::chrono::milliseconds timeout) {
  const uint64_t page = PageSize();
  auto deadline = shared::DeadlineAfter(timeout);
  for (int r = 0; r < static_cast<int>(t.partitions_.size()); ++r) {
    if (r == skip_rank || t.partitions_[r].bytes == 0) continue;
    std::string peer = StrCat("tensortier.", token, ".", r);
    std::string what = StrCat("rank ", r, " (serving '", t.key_, "')");
    UniqueFd fd = FetchDescriptor(peer, t.key_, deadline, what);
    // The size the partition needs comes from the record: the memory served must hold it all
    // (a mapping past its end faults with SIGBUS), and must not be able to shrink later.
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
      ThrowIoError(errno, StrCat("fstat partition of ", what), t.key_);
    }
    const uint64_t need = RoundUp(t.partitions_[r].bytes, page);
    if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < need) {
      throw std::invalid_argument(
          StrCat("shared tensor '", t.key_, "': its shape ", t.spec_.Describe(), " needs ", need,
                 " bytes in ", what, ", which serves ",
                 S_ISREG(st.st_mode) ? StrCat(st.st_size, " bytes") : std::string("no file")));
    }
    const int seals = ::fcntl(fd.get(), F_GET_SEALS);
    if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
      throw std::invalid_argument(StrCat("shared tensor '", t.key_, "': ", what,
                                         " serves memory that is not sealed against shrinking"));
    }
    if (int err = MapPartition(t, r, fd.get(), false); err != 0) {
      ThrowIoError(err, StrCat("mmap partition of rank ", r, " of"), t.key_, 0,
                   t.partitions_[r].bytes);
    }
  }
}

// Creates (when `own_partition`) and maps the partitions of `spec`; `key` names them on every
// rank's server. With own_partition, ends with two barriers: every rank serves before any
// fetches, and every rank has fetched before any may close.
std::shared_ptr<SharedTensor> SharedGroup::Map(const SharedTensorSpec& spec, const std::string& key,
                                               bool own_partition, int device) {
  const uint64_t page = PageSize();
  const bool huge = IsHuge(spec, world_size_);
  const std::string shmem_policy = huge ? ShmemHugePolicy() : "";
  // With own_partition every step that can fail on one rank ends in Settle, as in MapDevice: the
  // others throw at once naming it, instead of waiting out the timeout for a rank that never
  // arrives (and blaming it for not arriving).
  std::shared_ptr<SharedTensor> tensor;
  std::exception_ptr failure;
  try {
    tensor = Layout(spec, key, world_size_, rank_);
    if (own_partition) {
      SharedPartition& p = tensor->partitions_[rank_];
      tensor->stats_.local_bytes = p.bytes;
      UniqueFd fd;
      if (p.bytes > 0) {
        // hugetlb where the partitioning allows and the kernel has pages; else ordinary pages.
        if (!huge) {
          tensor->stats_.huge_pages_reason =
              StrCat("tensor under ", kHugePartitionThreshold >> 20, " MiB per rank");
        } else {
          fd = UniqueFd(
              ::memfd_create("tensortier-shared", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB));
          int err = !fd ? errno : 0;
          if (fd && ::ftruncate(fd.get(), RoundUp(p.bytes, kHugePage)) != 0) err = errno;
          if (fd && err == 0) err = MapPartition(*tensor, rank_, fd.get(), true);
          if (err != 0) {
            fd = UniqueFd();
            tensor->stats_.huge_pages_reason =
                StrCat("hugetlb pages unavailable (", std::strerror(err), ")");
          } else {
            tensor->stats_.huge_pages = true;
          }
        }
        if (!fd) {
          fd = UniqueFd(::memfd_create("tensortier-shared", MFD_CLOEXEC | MFD_ALLOW_SEALING));
          if (!fd) {
            const int err = errno;
            ThrowIoError(err, shared::WithDescriptorLimit("memfd_create for", err), key, 0,
                         p.bytes);
          }
          if (::ftruncate(fd.get(), RoundUp(p.bytes, page)) != 0) {
            ThrowIoError(errno, "ftruncate memfd of", key, 0, p.bytes);
          }
          // Transparent huge pages where the kernel gives them to shared memory on advice: the
          // advice must come before the pages are faulted in.
          const bool advise = huge && ShmemHugeOnAdvice(shmem_policy);
          // Pages this rank touches first (populated here) sit on its NUMA node.
          if (int err = MapPartition(*tensor, rank_, fd.get(), !advise); err != 0) {
            ThrowIoError(err, "mmap partition of", key, 0, p.bytes);
          }
          if (advise) {
            const uint64_t length = RoundUp(p.bytes, page);
            tensor->stats_.shmem_huge_pages = ::madvise(p.address, length, MADV_HUGEPAGE) == 0;
            if (!tensor->stats_.shmem_huge_pages) {
              tensor->stats_.shmem_huge_pages_reason =
                  StrCat("madvise(MADV_HUGEPAGE) failed (", std::strerror(errno), ")");
            }
            PopulateForWrite(p.address, length, page);
          } else if (!tensor->stats_.huge_pages) {
            tensor->stats_.shmem_huge_pages_reason =
                !huge ? tensor->stats_.huge_pages_reason
                : shmem_policy.empty()
                    ? std::string("the kernel's shmem_enabled policy cannot be read")
                    : StrCat("the kernel's shmem_enabled is '", shmem_policy, "'");
          }
        }
        if (::fchmod(fd.get(), 0600) != 0) ThrowIoError(errno, "fchmod memfd of", key);
        if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
          ThrowIoError(errno, "seal memfd of", key);
        }
      }
      server_->Serve(key, std::move(fd));
      tensor->server_ = server_;
    }
  } catch (...) {
    if (!own_partition) throw;
    failure = std::current_exception();
  }
  if (own_partition) Settle(StrCat("create_tensor '", key, "' (serving)"), failure);

  try {
    FetchPartitions(*tensor, token_, own_partition ? rank_ : -1, timeout_);
    if (huge && ShmemHugeOnAdvice(shmem_policy)) {
      for (int r = 0; r < world_size_; ++r) {
        if ((own_partition && r == rank_) || tensor->partitions_[r].bytes == 0) continue;
        // The owner's huge pages are mapped huge here only where this mapping asks for them
        // too; advice, so a refusal costs speed, not correctness.
        ::madvise(tensor->partitions_[r].address, RoundUp(tensor->partitions_[r].bytes, page),
                  MADV_HUGEPAGE);
      }
    }
    tensor->RegisterWithCuda(device);
  } catch (...) {
    if (!own_partition) throw;
    failure = std::current_exception();
  }
  if (own_partition) Settle(StrCat("create_tensor '", key, "' (mapped)"), failure);
  Remember(tensor);
  return tensor;
}

// Device memory: see the header. Every step that can fail on one rank ends in Settle, so that
// the others throw at once instead of waiting out the timeout; `memory` (and, once served, the
// tensor's Close) undoes whatever was done, in reverse.
std::shared_ptr<SharedTensor> SharedGroup::MapDevice(const SharedTensorSpec& spec,
                                                     const std::string& key, int device) {
  const std::string what = StrCat("create_tensor '", key, "' in device memory");
  std::optional<PrimaryContext> context;
  uint64_t granularity = 0;
  std::exception_ptr failure;
  try {
    context.emplace(CudaDriver::Get(), device);
    granularity = DeviceAllocationGranularity(*context);
  } catch (...) {
    failure = std::current_exception();
  }
  // Every rank's GPU and granularity: access is granted to all of them, and partitions are
  // rounded to the largest granularity so that they line up the same way in every process.
  std::vector<std::string> peers =
      Settle(StrCat(what, " (device)"), failure, StrCat(device, " ", granularity));
  std::set<int> devices;
  for (const std::string& p : peers) {
    std::istringstream in(p);
    int d = 0;
    uint64_t g = 0;
    in >> d >> g;
    if (d >= 0 && d < CudaDriver::Get().device_count()) devices.insert(d);
    granularity = std::max(granularity, g);
  }
  for (const std::string& p : peers) {
    uint64_t g = std::stoull(p.substr(p.find(' ') + 1));
    if (granularity % g != 0) {
      throw std::invalid_argument(StrCat(what, ": the GPUs' allocation granularities differ (", g,
                                         " does not divide ", granularity, ")"));
    }
  }
  const std::vector<int> access(devices.begin(), devices.end());
  const bool continuous = spec.layout == SharedLayout::kContinuous;

  auto tensor = std::shared_ptr<SharedTensor>(new SharedTensor());
  tensor->spec_ = spec;
  tensor->rank_ = rank_;
  tensor->key_ = key;
  tensor->partitions_ =
      PartitionRows(spec.rows(), spec.row_bytes(), world_size_, continuous ? granularity : 1);
  tensor->stats_.device = device;
  tensor->stats_.granularity = granularity;
  tensor->stats_.local_bytes = tensor->partitions_[rank_].bytes;
  auto memory = std::make_shared<SharedTensor::Memory>();
  std::vector<uint64_t> offsets(world_size_);
  uint64_t span = 0;
  for (int r = 0; r < world_size_; ++r) {
    offsets[r] = span;
    span += RoundUp(tensor->partitions_[r].bytes, granularity);
  }

  // This rank's partition: created, exported, served.
  std::optional<DeviceAllocation> own;
  try {
    const SharedPartition& p = tensor->partitions_[rank_];
    UniqueFd fd;
    if (p.bytes > 0) {
      own.emplace(DeviceAllocation::Create(*context, RoundUp(p.bytes, granularity)));
      fd = UniqueFd(own->Export());
    }
    server_->Serve(key, std::move(fd));
    tensor->server_ = server_;
  } catch (...) {
    failure = std::current_exception();
  }
  Settle(StrCat(what, " (serving)"), failure);

  // Every partition, this rank's included, mapped into one reserved range.
  try {
    if (span > 0) memory->device_range.emplace(*context, span, granularity);
    auto deadline = shared::DeadlineAfter(timeout_);
    for (int r = 0; r < world_size_; ++r) {
      SharedPartition& p = tensor->partitions_[r];
      if (p.bytes == 0) continue;
      if (r == rank_) {
        memory->device_allocations.push_back(std::move(*own));
        own.reset();
      } else {
        std::string peer = StrCat("tensortier.", token_, ".", r);
        std::string from = StrCat("rank ", r, " (serving '", key, "')");
        UniqueFd fd = FetchDescriptor(peer, key, deadline, from);
        memory->device_allocations.push_back(
            DeviceAllocation::Import(*context, fd.get(), RoundUp(p.bytes, granularity)));
      }
      const cuda::CUdeviceptr at = memory->device_range->address() + offsets[r];
      memory->device_mappings.emplace_back(*context, at, memory->device_allocations.back(), access);
      p.address = reinterpret_cast<uint8_t*>(at);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  Settle(StrCat(what, " (mapped)"), failure);
  tensor->memory_ = std::move(memory);
  Remember(tensor);
  return tensor;
}

// ---------------------------------------------------------------------------------------------

void SharedTensor::Close() {
  std::shared_ptr<Memory> drop;
  std::shared_ptr<void> server;
  {
    std::lock_guard lock(mutex_);
    drop = std::move(memory_);
    server = std::move(server_);
  }
  if (server) static_cast<SharedGroup::Server*>(server.get())->Unserve(key_);
}

SharedTensor::~SharedTensor() {
  Close();
}

}  // namespace tensortier
