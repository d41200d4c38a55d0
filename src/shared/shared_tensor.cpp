#include "tensortier/shared/shared_tensor.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/shared/partition_server.hpp"
#include "tensortier/shared/tensor_memory.hpp"
#include "tensortier/shared/unix_socket.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

using shared::UniqueFd;

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

void SharedTensor::CopyRows(const int64_t* indices, size_t count, uint8_t* buffer,
                            bool gather) const {
  std::shared_ptr<Memory> hold = Hold();
  if (spec_.memory == SharedMemory::kDevice) {
    throw std::logic_error(
        StrCat("shared tensor ", spec_.Describe(),
               " is in device memory: gather and scatter rows through a CUDA view"));
  }
  std::vector<uint8_t*> bases;
  std::vector<uint64_t> ends;
  if (hold->reserved != nullptr) {  // continuous: one array
    bases.push_back(hold->reserved);
    ends.push_back(spec_.rows());
  } else {  // chunked: the partition holding the row
    for (const auto& p : partitions_) {
      bases.push_back(p.address);
      ends.push_back(p.row_begin + p.rows);
    }
  }
  CopyPieceRows(bases, ends, spec_.row_bytes(), indices, count, buffer, gather, "a shared tensor");
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
  const uint64_t page = SystemPageSize();
  std::vector<HostRegistration> registrations;
  try {
    PrimaryContext context(driver, device);
    for (const SharedPartition& p : partitions_) {
      if (p.bytes > 0) registrations.emplace_back(context, p.address, AlignUp(p.bytes, page));
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
// Host memory: the partitions' memfds and their mappings

std::shared_ptr<SharedTensor> SharedTensor::Layout(const SharedTensorSpec& spec,
                                                   const std::string& key, int world_size,
                                                   int rank) {
  const uint64_t page = SystemPageSize();
  const bool continuous = spec.layout == SharedLayout::kContinuous;
  const bool huge = IsHugeSharedTensor(spec, world_size);
  uint64_t granule = continuous ? (huge ? kHugePage : page) : 1;

  auto tensor = std::shared_ptr<SharedTensor>(new SharedTensor());
  tensor->spec_ = spec;
  tensor->rank_ = rank;
  tensor->key_ = key;
  tensor->partitions_ = PartitionRows(spec.rows(), spec.row_bytes(), world_size, granule);
  auto memory = std::make_shared<SharedTensor::Memory>();
  memory->name = spec.name;
  uint64_t span = 0;
  for (const auto& p : tensor->partitions_) span += AlignUp(p.bytes, page);
  // One PROT_NONE range, aligned for huge pages, that the partitions are mapped into.
  if (continuous && span > 0) memory->Reserve(span, huge ? kHugePage : page, key);
  // Not visible to anyone before it is returned; unmapped with the tensor if mapping fails.
  tensor->memory_ = std::move(memory);
  return tensor;
}

int SharedTensor::MapPartition(int r, int fd, bool populate) {
  const uint64_t page = SystemPageSize();
  SharedPartition& p = partitions_[r];
  uint64_t length = AlignUp(p.bytes, page);
  int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
  void* want = nullptr;
  if (memory_->reserved != nullptr) {
    uint64_t offset = 0;
    for (int q = 0; q < r; ++q) offset += AlignUp(partitions_[q].bytes, page);
    want = memory_->reserved + offset;
    flags |= MAP_FIXED;
  }
  void* got = ::mmap(want, length, PROT_READ | PROT_WRITE, flags, fd, 0);
  if (got == MAP_FAILED) return errno;
  if (memory_->reserved == nullptr) {
    memory_->mappings.emplace_back(got, length);
    memory_->Track(got, length);
  }
  p.address = static_cast<uint8_t*>(got);
  return 0;
}

UniqueFd SharedTensor::CreateLocalPartition(bool huge, const std::string& shmem_policy) {
  const uint64_t page = SystemPageSize();
  SharedPartition& p = partitions_[rank_];
  stats_.local_bytes = p.bytes;
  UniqueFd fd;
  if (p.bytes == 0) return fd;
  // Every page is faulted in below: more than the memory this process may use would end in the
  // OOM killer.
  if (const MemoryLimit limit = ProcessMemoryLimit(); p.bytes > limit.bytes) {
    ThrowIoError(
        ENOMEM,
        StrCat("create this rank's rows of a shared tensor (", p.bytes, " bytes, more than the ",
               limit.bytes, " bytes of ", limit.what, ": every page is filled when created)"),
        spec_.name.empty() ? "(unnamed)" : spec_.name, 0, p.bytes);
  }
  // hugetlb where the partitioning allows and the kernel has pages; else ordinary pages.
  if (!huge) {
    stats_.huge_pages_reason =
        StrCat("tensor under ", kHugePartitionThreshold >> 20, " MiB per rank");
  } else {
    fd = UniqueFd(
        ::memfd_create("tensortier-shared", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB));
    int err = !fd ? errno : 0;
    if (fd && ::ftruncate(fd.get(), AlignUp(p.bytes, kHugePage)) != 0) err = errno;
    if (fd && err == 0) err = MapPartition(rank_, fd.get(), true);
    if (err != 0) {
      fd = UniqueFd();
      stats_.huge_pages_reason = StrCat("hugetlb pages unavailable (", std::strerror(err), ")");
    } else {
      stats_.huge_pages = true;
    }
  }
  if (!fd) {
    fd = UniqueFd(::memfd_create("tensortier-shared", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!fd) {
      const int err = errno;
      ThrowIoError(err, shared::WithDescriptorLimit("memfd_create for", err), key_, 0, p.bytes);
    }
    if (::ftruncate(fd.get(), AlignUp(p.bytes, page)) != 0) {
      ThrowIoError(errno, "ftruncate memfd of", key_, 0, p.bytes);
    }
    // Transparent huge pages where the kernel gives them to shared memory on advice: the
    // advice must come before the pages are faulted in.
    const bool advise = huge && ShmemHugeOnAdvice(shmem_policy);
    // Pages this rank touches first (populated here) sit on its NUMA node.
    if (int err = MapPartition(rank_, fd.get(), !advise); err != 0) {
      ThrowIoError(err, "mmap partition of", key_, 0, p.bytes);
    }
    if (advise) {
      const uint64_t length = AlignUp(p.bytes, page);
      stats_.shmem_huge_pages = ::madvise(p.address, length, MADV_HUGEPAGE) == 0;
      if (!stats_.shmem_huge_pages) {
        stats_.shmem_huge_pages_reason =
            StrCat("madvise(MADV_HUGEPAGE) failed (", std::strerror(errno), ")");
      }
      if (int err = PopulateForWrite(p.address, length, page); err != 0) {
        ThrowIoError(err, "fault in shared memory of", key_, 0, length);
      }
    } else if (!stats_.huge_pages) {
      stats_.shmem_huge_pages_reason =
          !huge                  ? stats_.huge_pages_reason
          : shmem_policy.empty() ? std::string("the kernel's shmem_enabled policy cannot be read")
                                 : StrCat("the kernel's shmem_enabled is '", shmem_policy, "'");
    }
  }
  if (::fchmod(fd.get(), 0600) != 0) ThrowIoError(errno, "fchmod memfd of", key_);
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    ThrowIoError(errno, "seal memfd of", key_);
  }
  return fd;
}

void SharedTensor::FetchPartitions(const std::string& token, int skip_rank,
                                   std::chrono::milliseconds timeout) {
  const uint64_t page = SystemPageSize();
  auto deadline = shared::DeadlineAfter(timeout);
  for (int r = 0; r < static_cast<int>(partitions_.size()); ++r) {
    if (r == skip_rank || partitions_[r].bytes == 0) continue;
    std::string what = StrCat("rank ", r, " (serving '", key_, "')");
    UniqueFd fd =
        shared::FetchDescriptor(shared::PartitionSocketName(token, r), key_, deadline, what);
    // The size the partition needs comes from the record: the memory served must hold it all
    // (a mapping past its end faults with SIGBUS), and must not be able to shrink later.
    struct stat st{};
    if (::fstat(fd.get(), &st) != 0) {
      ThrowIoError(errno, StrCat("fstat partition of ", what), key_);
    }
    const uint64_t need = AlignUp(partitions_[r].bytes, page);
    if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < need) {
      throw std::invalid_argument(
          StrCat("shared tensor '", key_, "': its shape ", spec_.Describe(), " needs ", need,
                 " bytes in ", what, ", which serves ",
                 S_ISREG(st.st_mode) ? StrCat(st.st_size, " bytes") : std::string("no file")));
    }
    const int seals = ::fcntl(fd.get(), F_GET_SEALS);
    if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
      throw std::invalid_argument(StrCat("shared tensor '", key_, "': ", what,
                                         " serves memory that is not sealed against shrinking"));
    }
    if (int err = MapPartition(r, fd.get(), false); err != 0) {
      ThrowIoError(err, StrCat("mmap partition of rank ", r, " of"), key_, 0, partitions_[r].bytes);
    }
  }
}

// ---------------------------------------------------------------------------------------------

void SharedTensor::Close() {
  std::shared_ptr<Memory> drop;
  std::shared_ptr<shared::PartitionServer> server;
  {
    std::lock_guard lock(mutex_);
    drop = std::move(memory_);
    server = std::move(server_);
  }
  if (server) server->Unserve(key_);
}

SharedTensor::~SharedTensor() {
  Close();
}

}  // namespace tensortier
