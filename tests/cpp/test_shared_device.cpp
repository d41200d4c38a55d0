// Shared tensors in device memory, and host memory registered with CUDA, against the stand-in
// driver (fake_cuda/): its device memory is memfd-backed, so the handles one forked rank exports
// are imported and mapped by the others onto the same bytes. Each rank checks through CUDA copies
// what every rank wrote, and that everything it made is given back. Failures are injected into
// each driver step on one rank; every rank must throw, within the timeout, with nothing left.
#include <dirent.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fake_cuda/fake_cuda_hooks.hpp"
#include "shared_ranks.hpp"
#include "tensortier/cuda/cuda_driver.hpp"
#include "tensortier/shared/shared_tensor.hpp"

namespace tensortier {
namespace {

using namespace std::chrono_literals;
using testing::FakeCudaLibrary;

// The stand-in's hooks this suite uses (resolved in each rank).
struct FakeHooks {
  void (*fail_next)(const char*, int) = nullptr;
  int (*calls)(const char*) = nullptr;
  int (*live)() = nullptr;
  void (*next_register)(int) = nullptr;

  FakeHooks() {
    void* h = dlopen(FakeCudaLibrary().c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (h == nullptr) throw std::runtime_error("the fake CUDA driver is not loaded");
    fail_next = reinterpret_cast<void (*)(const char*, int)>(dlsym(h, "fakecuda_fail_next"));
    calls = reinterpret_cast<int (*)(const char*)>(dlsym(h, "fakecuda_calls"));
    live = reinterpret_cast<int (*)()>(dlsym(h, "fakecuda_live"));
    next_register = reinterpret_cast<void (*)(int)>(dlsym(h, "fakecuda_next_host_register_result"));
    dlclose(h);
    if (!fail_next || !calls || !live || !next_register) {
      throw std::runtime_error("the fake CUDA driver lacks its hooks");
    }
  }
};

int OpenFds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (d != nullptr && ::readdir(d) != nullptr) ++n;
  if (d != nullptr) ::closedir(d);
  return n;
}

// Open descriptors once they come back to `want`: the partition server thread closes a peer's
// connection just after answering it, which may be after the peer has gone on (5 s at most).
int OpenFdsSettled(int want) {
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  int n = OpenFds();
  while (n != want && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
    n = OpenFds();
  }
  return n;
}

SharedTensorSpec DeviceSpec(std::vector<int64_t> shape, uint64_t element_size,
                            SharedLayout layout) {
  SharedTensorSpec s;
  s.shape = std::move(shape);
  s.element_size = element_size;
  s.dtype = StrCat("bytes", element_size);
  s.layout = layout;
  s.memory = SharedMemory::kDevice;
  return s;
}

uint32_t Value(uint64_t row, uint64_t column) {
  return static_cast<uint32_t>(row * 977 + column + 1);
}

class SharedDeviceTest : public testing::FakeCudaDriverSuite {};

TEST(SharedDeviceSpecTest, MemoryIsPartOfTheSpecRanksAgreeOn) {
  SharedTensorSpec s = DeviceSpec({5, 3}, 4, SharedLayout::kChunked);
  SharedTensorSpec back = SharedTensorSpec::Parse(s.Describe());
  EXPECT_EQ(back.memory, SharedMemory::kDevice);
  EXPECT_NE(s.Describe().find("memory=device"), std::string::npos);
  s.memory = SharedMemory::kHost;
  EXPECT_EQ(SharedTensorSpec::Parse(s.Describe()).memory, SharedMemory::kHost);
  EXPECT_THROW(ParseSharedMemory("gpu"), std::invalid_argument);
  EXPECT_STREQ(SharedMemoryName(SharedMemory::kDevice), "device");
}

// Each rank writes its rows through CUDA into its partition; every rank then reads every
// partition (and, when continuous, every row at its offset in the one range) through CUDA.
void WritesSeenByAll(SharedLayout layout, uint64_t rows, uint64_t columns, int world) {
  auto statuses = RunRanks(world, [&](int rank, std::shared_ptr<Store> store) {
    FakeHooks fake;
    const int live = fake.live();
    const int creates = fake.calls("cuMemCreate");
    const int imports = fake.calls("cuMemImportFromShareableHandle");
    SharedGroup group(store, rank, world, 20s);
    const int fds = OpenFds();  // every rank is connected to the store by now
    {
      const uint64_t row_bytes = columns * 4;
      auto t = group.Create(
          DeviceSpec({static_cast<int64_t>(rows), static_cast<int64_t>(columns)}, 4, layout));
      const uint64_t granularity = t->stats().granularity;
      Check(granularity == (2u << 20), StrCat("granularity ", granularity));
      Check(t->stats().device == 0, "device");
      Check(!t->stats().cuda_registered, "device memory is not host-registered");
      PrimaryContext context(CudaDriver::Get(), 0);
      Stream stream(context);
      const SharedPartition& mine = t->local();
      std::vector<uint32_t> host(mine.rows * columns);
      for (uint64_t r = 0; r < mine.rows; ++r) {
        for (uint64_t c = 0; c < columns; ++c) host[r * columns + c] = Value(mine.row_begin + r, c);
      }
      if (mine.bytes > 0) {
        stream.CopyToDevice(reinterpret_cast<cuda::CUdeviceptr>(mine.address), host.data(),
                            mine.bytes);
        stream.Synchronize();
      }
      group.Barrier("written");
      uint64_t covered = 0;
      int nonempty_peers = 0;
      for (const SharedPartition& p : t->partitions()) {
        covered += p.rows;
        if (p.bytes == 0) {
          Check(p.address == nullptr, "an empty partition has no address");
          continue;
        }
        if (p.rank != rank) ++nonempty_peers;
        if (layout == SharedLayout::kContinuous) {
          Check(p.address == t->data() + p.row_begin * row_bytes, "continuous offsets");
          Check(p.rank == world - 1 || p.bytes % granularity == 0 ||
                    t->partitions()[p.rank + 1].bytes == 0,
                "continuous partitions are whole granules");
        } else {
          Check(reinterpret_cast<uintptr_t>(p.address) % granularity == 0, "aligned mapping");
        }
        std::vector<uint32_t> back(p.rows * columns);
        stream.CopyFromDevice(back.data(), reinterpret_cast<cuda::CUdeviceptr>(p.address), p.bytes);
        stream.Synchronize();
        for (uint64_t r = 0; r < p.rows; ++r) {
          for (uint64_t c = 0; c < columns; ++c) {
            Check(back[r * columns + c] == Value(p.row_begin + r, c),
                  StrCat("rank ", rank, " reads row ", p.row_begin + r));
          }
        }
      }
      Check(covered == rows, "partitions cover the rows");
      if (layout == SharedLayout::kContinuous && rows > 0) {
        for (uint64_t row : {uint64_t{0}, rows / 2, rows - 1}) {
          uint32_t first = 0;
          stream.CopyFromDevice(
              &first, reinterpret_cast<cuda::CUdeviceptr>(t->data()) + row * row_bytes, 4);
          stream.Synchronize();
          Check(first == Value(row, 0), StrCat("continuous row ", row));
        }
      }
      Check(fake.calls("cuMemCreate") - creates == (mine.bytes > 0 ? 1 : 0), "one cuMemCreate");
      Check(fake.calls("cuMemImportFromShareableHandle") - imports == nonempty_peers,
            "one import per non-empty peer partition");
      int64_t zero = 0;
      uint32_t out = 0;
      bool refused = false;
      try {
        t->Gather(&zero, 1, &out);
      } catch (const std::logic_error&) {
        refused = true;
      }
      Check(refused, "gather of device memory throws");
      group.Barrier("read");
    }
    Check(fake.live() == live, StrCat("driver resources left: ", fake.live() - live));
    Check(OpenFdsSettled(fds) == fds, StrCat("descriptors left: ", OpenFds() - fds));
    group.Barrier("closed");
  });
  ExpectAllZero(statuses);
}

TEST_F(SharedDeviceTest, ContinuousUnequalPartitionsTwoRanks) {
  // 64-byte rows: 32768 rows per 2 MiB granule. 2 granules + 1000 rows: 65536 / 1000 rows.
  WritesSeenByAll(SharedLayout::kContinuous, 2 * 32768 + 1000, 16, 2);
}

TEST_F(SharedDeviceTest, ContinuousUnequalPartitionsThreeRanks) {
  WritesSeenByAll(SharedLayout::kContinuous, 32768 + 77, 16, 3);  // 32768, 77, 0 rows
}

TEST_F(SharedDeviceTest, ContinuousZeroSizePartitions) {
  WritesSeenByAll(SharedLayout::kContinuous, 1000, 16, 3);  // 1000, 0, 0 rows
}

TEST_F(SharedDeviceTest, ChunkedOddRowsRoundEachPartitionToTheGranularity) {
  WritesSeenByAll(SharedLayout::kChunked, 7, 3, 3);  // 3, 2, 2 rows, 2 MiB allocations each
}

TEST_F(SharedDeviceTest, ChunkedFewerRowsThanRanks) {
  WritesSeenByAll(SharedLayout::kChunked, 2, 5, 3);  // 1, 1, 0 rows
}

TEST_F(SharedDeviceTest, EmptyTensor) {
  WritesSeenByAll(SharedLayout::kContinuous, 0, 4, 2);
}

// A failure injected into one driver step on rank 1: rank 1 throws the CudaError naming the call,
// the others a runtime_error naming rank 1, all within the timeout; nothing stays allocated,
// reserved, mapped or open; and the group still works (the next tensor is created).
void FailureOnOneRank(const char* call, SharedLayout layout) {
  const int world = 3;
  auto statuses = RunRanks(world, [&](int rank, std::shared_ptr<Store> store) {
    FakeHooks fake;
    const int live = fake.live();
    SharedGroup group(store, rank, world, 20s);
    const int fds = OpenFds();  // every rank is connected to the store by now
    {
      auto spec = DeviceSpec({3 * 32768, 16}, 4, layout);  // every partition non-empty
      if (rank == 1) fake.fail_next(call, cuda::kErrorOutOfMemory);
      const auto start = std::chrono::steady_clock::now();
      bool thrown = false;
      try {
        group.Create(spec);
      } catch (const CudaError& e) {
        thrown = true;
        Check(rank == 1, StrCat("rank ", rank, " threw a CudaError: ", e.what()));
        Check(e.call() == call, StrCat("the error names ", e.call(), ", not ", call));
        Check(e.code() == cuda::kErrorOutOfMemory, "the error carries the CUresult");
        Check(std::string(e.what()).find("CUDA_ERROR_OUT_OF_MEMORY") != std::string::npos,
              e.what());
      } catch (const std::runtime_error& e) {
        thrown = true;
        Check(rank != 1, StrCat("rank 1 threw: ", e.what()));
        Check(std::string(e.what()).find("rank 1: ") != std::string::npos, e.what());
        Check(std::string(e.what()).find(call) != std::string::npos, e.what());
      }
      Check(thrown, StrCat("rank ", rank, " did not throw"));
      Check(std::chrono::steady_clock::now() - start < 20s, "thrown within the timeout");
      Check(fake.live() == live,
            StrCat("driver resources left after the failure: ", fake.live() - live));
      Check(OpenFdsSettled(fds) == fds,
            StrCat("descriptors left after the failure: ", OpenFds() - fds));
      auto t = group.Create(spec);  // the group goes on
      Check(t->partitions()[rank].address != nullptr, "the next tensor is mapped");
      group.Barrier("mapped");
    }
    Check(fake.live() == live, StrCat("driver resources left: ", fake.live() - live));
    Check(OpenFdsSettled(fds) == fds, StrCat("descriptors left: ", OpenFds() - fds));
    group.Barrier("closed");
  });
  ExpectAllZero(statuses);
}

TEST_F(SharedDeviceTest, FailedGranularityQueryRaisesOnEveryRank) {
  FailureOnOneRank("cuMemGetAllocationGranularity", SharedLayout::kContinuous);
}
TEST_F(SharedDeviceTest, FailedCreateRaisesOnEveryRank) {
  FailureOnOneRank("cuMemCreate", SharedLayout::kContinuous);
}
TEST_F(SharedDeviceTest, FailedExportRaisesOnEveryRank) {
  FailureOnOneRank("cuMemExportToShareableHandle", SharedLayout::kChunked);
}
TEST_F(SharedDeviceTest, FailedImportRaisesOnEveryRank) {
  FailureOnOneRank("cuMemImportFromShareableHandle", SharedLayout::kContinuous);
}
TEST_F(SharedDeviceTest, FailedReserveRaisesOnEveryRank) {
  FailureOnOneRank("cuMemAddressReserve", SharedLayout::kChunked);
}
TEST_F(SharedDeviceTest, FailedMapRaisesOnEveryRank) {
  FailureOnOneRank("cuMemMap", SharedLayout::kContinuous);
}
TEST_F(SharedDeviceTest, FailedSetAccessRaisesOnEveryRank) {
  FailureOnOneRank("cuMemSetAccess", SharedLayout::kChunked);
}

// A rank that dies before creating its partition: the others throw within the timeout and give
// everything back.
TEST_F(SharedDeviceTest, DeadRankMakesEverySurvivorFailWithinTheTimeout) {
  auto statuses = RunRanks(2, [&](int rank, std::shared_ptr<Store> store) {
    FakeHooks fake;
    const int live = fake.live();
    SharedGroup group(store, rank, 2, 3s);
    if (rank == 1) ::_exit(0);
    const auto start = std::chrono::steady_clock::now();
    bool thrown = false;
    try {
      group.Create(DeviceSpec({1000, 4}, 4, SharedLayout::kContinuous));
    } catch (const IoError& e) {
      thrown = e.error_code() == ETIMEDOUT || e.error_code() == ECONNREFUSED ||
               e.error_code() == ECONNRESET;
    }
    Check(thrown, "rank 0 throws IoError");
    Check(std::chrono::steady_clock::now() - start < 15s, "within the timeout");
    Check(fake.live() == live, "nothing left");
  });
  EXPECT_EQ(statuses[0], 0);
}

// Host memory: each partition's mapping registered once in each process (portable), seen by the
// driver as registered host memory, unregistered before it is unmapped.
TEST_F(SharedDeviceTest, HostMemoryIsRegisteredWithCudaAndUnregisteredOnClose) {
  for (SharedLayout layout : {SharedLayout::kContinuous, SharedLayout::kChunked}) {
    auto statuses = RunRanks(3, [&](int rank, std::shared_ptr<Store> store) {
      FakeHooks fake;
      const int live = fake.live();
      const int registers = fake.calls("cuMemHostRegister");
      const int unregisters = fake.calls("cuMemHostUnregister");
      SharedGroup group(store, rank, 3, 20s);
      SharedTensorSpec spec = DeviceSpec({5000, 3}, 4, layout);
      spec.memory = SharedMemory::kHost;
      auto t = group.Create(spec);
      Check(t->stats().cuda_registered, t->stats().cuda_registered_reason);
      int nonempty = 0;
      for (const SharedPartition& p : t->partitions()) {
        if (p.bytes == 0) continue;
        ++nonempty;
        Check(CudaDriver::Get().Locate(p.address).type == MemoryType::kRegisteredHost,
              StrCat("partition ", p.rank, " is registered"));
      }
      Check(fake.calls("cuMemHostRegister") - registers == nonempty, "one registration each");
      Check(fake.calls("cuMemHostUnregister") == unregisters, "none unregistered yet");
      group.Barrier("checked");
      t.reset();
      group.Close();
      Check(fake.calls("cuMemHostUnregister") - unregisters == nonempty, "all unregistered");
      Check(fake.live() == live, "registrations and contexts given back");
    });
    ExpectAllZero(statuses);
  }
}

// A registration the driver refuses leaves the tensor working, unregistered, and says why.
TEST_F(SharedDeviceTest, RefusedHostRegistrationIsReportedNotFatal) {
  auto statuses = RunRanks(2, [&](int rank, std::shared_ptr<Store> store) {
    FakeHooks fake;
    const int live = fake.live();
    SharedGroup group(store, rank, 2, 20s);
    if (rank == 0) fake.next_register(cuda::kErrorOutOfMemory);
    SharedTensorSpec spec = DeviceSpec({5000, 3}, 4, SharedLayout::kContinuous);
    spec.memory = SharedMemory::kHost;
    auto t = group.Create(spec);
    if (rank == 0) {
      Check(!t->stats().cuda_registered, "not registered");
      Check(t->stats().cuda_registered_reason.find("cuMemHostRegister") != std::string::npos,
            t->stats().cuda_registered_reason);
    } else {
      Check(t->stats().cuda_registered, t->stats().cuda_registered_reason);
    }
    auto* local = reinterpret_cast<uint32_t*>(t->local().address);
    local[0] = 40 + rank;
    group.Barrier("written");
    for (const SharedPartition& p : t->partitions()) {
      if (p.bytes > 0) {
        Check(*reinterpret_cast<uint32_t*>(p.address) == 40u + p.rank, "shared bytes");
      }
    }
    group.Barrier("read");
    t.reset();
    group.Close();
    Check(fake.live() == live, "nothing left");
  });
  ExpectAllZero(statuses);
}

TEST(SharedDeviceWithoutDriverTest, DeviceMemoryRaisesNoDriverOnEveryRank) {
  if (CudaDriver::Get().available()) GTEST_SKIP() << "a CUDA driver is present";
  auto statuses = RunRanks(2, [&](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 2, 20s);
    try {
      group.Create(DeviceSpec({10, 4}, 4, SharedLayout::kContinuous));
    } catch (const CudaError& e) {
      Check(e.code() == cuda::kUnavailable, e.what());
      Check(std::string(e.what()).find("CUDA driver unavailable") != std::string::npos, e.what());
      SharedTensorSpec spec = DeviceSpec({10, 4}, 4, SharedLayout::kContinuous);
      spec.memory = SharedMemory::kHost;
      auto t = group.Create(spec);  // host memory works, unregistered
      Check(!t->stats().cuda_registered, "no driver: not registered");
      Check(t->stats().cuda_registered_reason.find("no CUDA driver") != std::string::npos,
            t->stats().cuda_registered_reason);
      return;
    }
    throw std::runtime_error("device memory without a driver did not throw");
  });
  ExpectAllZero(statuses);
}

}  // namespace
}  // namespace tensortier
