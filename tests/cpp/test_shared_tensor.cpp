// Shared tensors across real processes: each test forks its ranks (bounded by alarm()), which
// rendezvous through the built-in Unix-socket store.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shared_ranks.hpp"
#include "tensortier/shared/shared_store.hpp"
#include "tensortier/shared/shared_tensor.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

using namespace std::chrono_literals;

SharedTensorSpec Spec(std::vector<int64_t> shape, uint64_t element_size, SharedLayout layout,
                      std::string name = "") {
  SharedTensorSpec s;
  s.shape = std::move(shape);
  s.element_size = element_size;
  s.dtype = StrCat("bytes", element_size);
  s.layout = layout;
  s.name = std::move(name);
  return s;
}

// The value every element of row `row` holds after its owner wrote it.
uint32_t RowValue(uint64_t row, uint64_t column) {
  return static_cast<uint32_t>(row * 131 + column);
}

TEST(SharedPartitionTest, UnequalAndEmptyPartitionsCoverEveryRow) {
  // 12-byte rows on 4 KiB granules: 1024-row units. 5000 rows = 5 units over 3 ranks.
  auto p = PartitionRows(5000, 12, 3, 4096);
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[0].rows, 2048u);
  EXPECT_EQ(p[1].rows, 2048u);
  EXPECT_EQ(p[2].rows, 904u);
  EXPECT_EQ(p[2].row_begin, 4096u);
  // Fewer units than ranks: the last ranks hold nothing.
  auto q = PartitionRows(1001, 12, 4, 4096);
  EXPECT_EQ(q[0].rows, 1001u);
  EXPECT_EQ(q[1].rows + q[2].rows + q[3].rows, 0u);
  EXPECT_EQ(q[3].row_begin, 1001u);
  // No granule: rows split evenly, the first ranks one more.
  auto c = PartitionRows(7, 3, 3, 1);
  EXPECT_EQ(c[0].rows, 3u);
  EXPECT_EQ(c[1].rows, 2u);
  EXPECT_EQ(c[2].rows, 2u);
  auto z = PartitionRows(0, 8, 2, 4096);
  EXPECT_EQ(z[0].rows + z[1].rows, 0u);
  EXPECT_THROW(PartitionRows(4, 4, 0, 1), std::invalid_argument);
}

TEST(SharedPartitionTest, SpecDescribeParsesBack) {
  auto s = Spec({5, 3, 2}, 4, SharedLayout::kChunked, "feat ures");
  auto back = SharedTensorSpec::Parse(s.Describe());
  EXPECT_EQ(back.Describe(), s.Describe());
  EXPECT_EQ(back.shape, s.shape);
  auto scalar = SharedTensorSpec::Parse(Spec({}, 8, SharedLayout::kContinuous).Describe());
  EXPECT_TRUE(scalar.shape.empty());
  EXPECT_EQ(scalar.rows(), 1u);
  EXPECT_THROW(SharedTensorSpec::Parse("nonsense"), std::invalid_argument);
  EXPECT_THROW(ParseSharedLayout("distributed-ish"), std::invalid_argument);
  EXPECT_EQ(ParseSharedLayout("distributed"), SharedLayout::kDistributed);
}

TEST(SharedPartitionTest, LayoutAndMemoryNamesBothWays) {
  for (SharedLayout layout :
       {SharedLayout::kContinuous, SharedLayout::kChunked, SharedLayout::kDistributed}) {
    EXPECT_EQ(ParseSharedLayout(SharedLayoutName(layout)), layout) << SharedLayoutName(layout);
  }
  EXPECT_STREQ(SharedLayoutName(SharedLayout::kContinuous), "continuous");
  EXPECT_STREQ(SharedLayoutName(SharedLayout::kChunked), "chunked");
  EXPECT_STREQ(SharedLayoutName(SharedLayout::kDistributed), "distributed");
  for (SharedMemory memory : {SharedMemory::kHost, SharedMemory::kDevice}) {
    EXPECT_EQ(ParseSharedMemory(SharedMemoryName(memory)), memory) << SharedMemoryName(memory);
  }
  EXPECT_STREQ(SharedMemoryName(SharedMemory::kHost), "host");
  EXPECT_STREQ(SharedMemoryName(SharedMemory::kDevice), "device");
  try {
    ParseSharedLayout("rows");
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "layout must be 'continuous', 'chunked' or 'distributed', not 'rows'");
  }
  try {
    ParseSharedMemory("gpu");
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "memory must be 'host' or 'device', not 'gpu'");
  }
}

// Each rank writes its own rows; after a barrier every rank reads every row, directly (where the
// layout gives one array) and through Gather in a shuffled order, then scatters and re-checks.
void HostWritesSeenByAll(SharedLayout layout, uint64_t rows, uint64_t columns, int world) {
  auto statuses = RunRanks(world, [&](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, world, 20s);
    auto t =
        group.Create(Spec({static_cast<int64_t>(rows), static_cast<int64_t>(columns)}, 4, layout));
    const SharedPartition& mine = t->local();
    auto* local = reinterpret_cast<uint32_t*>(mine.address);
    for (uint64_t r = 0; r < mine.rows; ++r) {
      for (uint64_t c = 0; c < columns; ++c)
        local[r * columns + c] = RowValue(mine.row_begin + r, c);
    }
    group.Barrier("written");
    uint64_t covered = 0;
    for (const auto& p : t->partitions()) {
      covered += p.rows;
      auto* rowsp = reinterpret_cast<const uint32_t*>(p.address);
      for (uint64_t r = 0; r < p.rows; ++r) {
        for (uint64_t c = 0; c < columns; ++c) {
          Check(rowsp[r * columns + c] == RowValue(p.row_begin + r, c),
                StrCat("row ", p.row_begin + r));
        }
      }
    }
    Check(covered == rows, "partitions cover the rows");
    if (layout == SharedLayout::kContinuous) {
      auto* all = reinterpret_cast<const uint32_t*>(t->data());
      for (uint64_t r = 0; r < rows; ++r) Check(all[r * columns] == RowValue(r, 0), "continuous");
    }
    std::vector<int64_t> idx(rows * 2);
    std::mt19937_64 rng(rank);
    for (auto& i : idx) i = static_cast<int64_t>(rng() % rows);
    std::vector<uint32_t> out(idx.size() * columns);
    t->Gather(idx.data(), idx.size(), out.data());
    for (size_t i = 0; i < idx.size(); ++i) {
      Check(out[i * columns + columns - 1] == RowValue(idx[i], columns - 1), "gathered row");
    }
    group.Barrier("gathered");
    // Rank 0 rewrites every row through Scatter; all see it.
    if (rank == 0) {
      std::vector<int64_t> every(rows);
      std::vector<uint32_t> values(rows * columns);
      for (uint64_t r = 0; r < rows; ++r) {
        every[r] = static_cast<int64_t>(rows - 1 - r);
        for (uint64_t c = 0; c < columns; ++c) values[r * columns + c] = 7 * (rows - 1 - r) + 1;
      }
      t->Scatter(every.data(), every.size(), values.data());
    }
    group.Barrier("scattered");
    for (const auto& p : t->partitions()) {
      auto* rowsp = reinterpret_cast<const uint32_t*>(p.address);
      for (uint64_t r = 0; r < p.rows; ++r) {
        Check(rowsp[r * columns] == 7 * (p.row_begin + r) + 1, "scattered row");
      }
    }
    group.Barrier("checked");
  });
  ExpectAllZero(statuses);
}

TEST(SharedTensorTest, ContinuousUnequalPartitions) {
  HostWritesSeenByAll(SharedLayout::kContinuous, 5000, 3, 3);
}
TEST(SharedTensorTest, ContinuousZeroSizePartitions) {
  HostWritesSeenByAll(SharedLayout::kContinuous, 1001, 3, 4);
}
TEST(SharedTensorTest, ChunkedOddRows) {
  HostWritesSeenByAll(SharedLayout::kChunked, 1001, 3, 3);
}
TEST(SharedTensorTest, ChunkedFewerRowsThanRanks) {
  HostWritesSeenByAll(SharedLayout::kChunked, 2, 5, 3);
}
TEST(SharedTensorTest, LargeGatherRunsOnThreads) {
  // 4096 rows of 1 KiB: gathers of 8192 rows cross the threaded threshold.
  HostWritesSeenByAll(SharedLayout::kContinuous, 4096, 256, 2);
}

// 64 MiB+ per rank: partitions on 2 MiB boundaries, hugetlb pages tried; without reserved huge
// pages (nr_hugepages 0, as on CI) ordinary pages serve and the stats say why.
TEST(SharedTensorTest, LargeTensorsTryHugePagesAndReportTheFallback) {
  auto statuses = RunRanks(2, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 2, 30s);
    const int64_t rows = (129ll << 20) / 12;  // 12-byte rows, not a multiple of 2 MiB in all
    auto t = group.Create(Spec({rows, 3}, 4, SharedLayout::kContinuous));
    Check(t->partitions()[0].bytes % (2 << 20) == 0, "first partition on a huge-page boundary");
    Check(t->partitions()[0].rows + t->partitions()[1].rows == static_cast<uint64_t>(rows), "rows");
    const SharedTensorStats& s = t->stats();
    Check(s.huge_pages || s.huge_pages_reason.find("hugetlb pages unavailable") == 0,
          s.huge_pages_reason);
    // Without hugetlb pages: transparent huge pages asked for, or the kernel's policy named.
    Check(s.huge_pages || s.shmem_huge_pages ||
              s.shmem_huge_pages_reason.find("shmem_enabled") != std::string::npos,
          s.shmem_huge_pages_reason);
    uint8_t* last = t->data() + static_cast<uint64_t>(rows) * 12 - 1;
    if (rank == 1) *last = 7;
    group.Barrier("written");
    Check(*last == 7, "last byte seen by rank 0");
    group.Barrier("read");
  });
  ExpectAllZero(statuses);
}

// GatherRows/ScatterRows against a plain per-row reference: unaligned row sizes (1 byte to past
// the prefetched part of a row), a table that starts at a row other than 0, repeats, and batches
// shorter and longer than the prefetch distance.
TEST(SharedRowCopyTest, GatherAndScatterEqualAPerRowCopyForEveryRowSize) {
  std::mt19937_64 rng(7);
  for (uint64_t row_bytes :
       {1ull, 3ull, 12ull, 63ull, 64ull, 100ull, 512ull, 515ull, 1000ull, 4099ull}) {
    for (size_t count : {0ul, 1ul, 5ul, 9ul, 333ul}) {
      const uint64_t rows = 257, first = 1000;
      std::vector<uint8_t> table(rows * row_bytes);
      for (auto& b : table) b = static_cast<uint8_t>(rng());
      std::vector<int64_t> idx(count);
      for (auto& i : idx) i = static_cast<int64_t>(first + rng() % rows);
      std::vector<uint8_t> out(count * row_bytes + 1, 0xEE);
      GatherRows(table.data(), rows, row_bytes, first, idx.data(), count, out.data());
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(0, std::memcmp(out.data() + i * row_bytes,
                                 table.data() + (idx[i] - first) * row_bytes, row_bytes))
            << "row_bytes " << row_bytes << " position " << i;
      }
      EXPECT_EQ(out.back(), 0xEE) << "wrote past the output";
      // Scatter distinct indices (a permutation's prefix) and compare with a per-row write.
      std::vector<int64_t> perm(rows);
      for (uint64_t r = 0; r < rows; ++r) perm[r] = static_cast<int64_t>(first + r);
      std::shuffle(perm.begin(), perm.end(), rng);
      perm.resize(std::min<size_t>(count, rows));
      std::vector<uint8_t> in(perm.size() * row_bytes);
      for (auto& b : in) b = static_cast<uint8_t>(rng());
      std::vector<uint8_t> want = table;
      for (size_t i = 0; i < perm.size(); ++i) {
        std::memcpy(want.data() + (perm[i] - first) * row_bytes, in.data() + i * row_bytes,
                    row_bytes);
      }
      ScatterRows(table.data(), rows, row_bytes, first, perm.data(), perm.size(), in.data());
      ASSERT_EQ(table, want) << "row_bytes " << row_bytes << " count " << count;
    }
  }
}

TEST(SharedRowCopyTest, LargeBatchesOnThreadsEqualTheReference) {
  const uint64_t rows = 3001, row_bytes = 1028;  // batches past kParallelRowCopyBytes
  std::vector<uint8_t> table(rows * row_bytes);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<uint8_t>(i * 31 + i / 977);
  const size_t count = kParallelRowCopyBytes / row_bytes * 2 + 7;
  std::vector<int64_t> idx(count);
  for (size_t i = 0; i < count; ++i) idx[i] = static_cast<int64_t>((i * 7919) % rows);
  std::vector<uint8_t> out(count * row_bytes);
  GatherRows(table.data(), rows, row_bytes, 0, idx.data(), count, out.data());
  for (size_t i = 0; i < count; ++i) {
    ASSERT_EQ(
        0, std::memcmp(out.data() + i * row_bytes, table.data() + idx[i] * row_bytes, row_bytes));
  }
  std::vector<uint8_t> copy(table.size(), 0);
  std::vector<int64_t> every(rows);
  for (uint64_t r = 0; r < rows; ++r) every[r] = static_cast<int64_t>(rows - 1 - r);
  std::vector<uint8_t> reversed(table.size());
  GatherRows(table.data(), rows, row_bytes, 0, every.data(), rows, reversed.data());
  ScatterRows(copy.data(), rows, row_bytes, 0, every.data(), rows, reversed.data());
  EXPECT_EQ(copy, table);
}

TEST(SharedRowCopyTest, OutOfRangeIndicesAreRefusedBeforeAnyCopy) {
  const uint64_t rows = 10, row_bytes = 8, first = 20;
  std::vector<uint8_t> table(rows * row_bytes, 1);
  for (int64_t bad : {int64_t{-1}, int64_t{19}, int64_t{30}, int64_t{1} << 62}) {
    std::vector<int64_t> idx = {20, 29, bad, 21};
    std::vector<uint8_t> out(idx.size() * row_bytes, 0);
    try {
      GatherRows(table.data(), rows, row_bytes, first, idx.data(), idx.size(), out.data());
      FAIL() << "index " << bad << " accepted";
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find(StrCat("index ", bad, " (position 2)")),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(out, std::vector<uint8_t>(out.size(), 0)) << "copied before refusing";
    std::vector<uint8_t> in(out.size(), 9);
    EXPECT_THROW(
        ScatterRows(table.data(), rows, row_bytes, first, idx.data(), idx.size(), in.data()),
        std::out_of_range);
    EXPECT_EQ(table, std::vector<uint8_t>(table.size(), 1)) << "written before refusing";
  }
}

TEST(SharedRowCopyTest, RouteGroupsByOwnerStably) {
  // Partitions [0,3) [3,3) [3,10) [10,11): one empty.
  const std::vector<uint64_t> ends = {3, 3, 10, 11};
  const std::vector<int64_t> idx = {9, 0, 10, 3, 2, 9, 5, 0};
  std::vector<int64_t> order(idx.size(), -1);
  RowRoute route = RouteRows(idx.data(), idx.size(), ends, order.data());
  EXPECT_EQ(route.bad, -1);
  EXPECT_EQ(route.counts, (std::vector<uint64_t>{3, 0, 4, 1}));
  EXPECT_EQ(order, (std::vector<int64_t>{1, 4, 7, 0, 3, 5, 6, 2}));

  route = RouteRows(nullptr, 0, ends, nullptr);
  EXPECT_EQ(route.bad, -1);
  EXPECT_EQ(route.counts, (std::vector<uint64_t>{0, 0, 0, 0}));

  for (int64_t bad : {int64_t{11}, int64_t{-1}}) {
    const std::vector<int64_t> with_bad = {1, 4, bad, 2};
    route = RouteRows(with_bad.data(), with_bad.size(), ends, order.data());
    EXPECT_EQ(route.bad, 2);
    EXPECT_EQ(route.counts, (std::vector<uint64_t>{0, 0, 0, 0}));
  }
}

TEST(SharedTensorTest, EmptyTensor) {
  auto statuses = RunRanks(2, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 2, 20s);
    auto t = group.Create(Spec({0, 4}, 4, SharedLayout::kContinuous));
    Check(t->local().rows == 0, "no rows");
    try {
      group.Create(Spec({4, 4}, 4, SharedLayout::kDistributed));
      Check(false, "a distributed tensor mapped");
    } catch (const std::invalid_argument&) {
    }
    t->Gather(nullptr, 0, nullptr);
    int64_t bad = 0;
    try {
      t->Gather(&bad, 1, nullptr);
      Check(false, "index 0 of an empty tensor accepted");
    } catch (const std::out_of_range&) {
    }
  });
  ExpectAllZero(statuses);
}

TEST(SharedTensorTest, DisagreeingRanksAllGetAnErrorNamingThem) {
  auto statuses = RunRanks(3, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 3, 20s);
    int64_t rows = rank == 1 ? 11 : 10;
    try {
      group.Create(Spec({rows, 4}, 4, SharedLayout::kContinuous));
    } catch (const std::invalid_argument& e) {
      std::string msg = e.what();
      Check(msg.find("rank 1 asked for shape=[11,4]") != std::string::npos, msg);
      Check(msg.find("rank 0,2 asked for shape=[10,4]") != std::string::npos, msg);
      return;
    }
    Check(false, "no error");
  });
  ExpectAllZero(statuses);
}

TEST(SharedTensorTest, DeadRankMakesEverySurvivorFailWithinTheTimeout) {
  auto statuses = RunRanks(3, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 3, 2s);
    if (rank == 2) ::_exit(0);  // dies before the collective
    auto start = std::chrono::steady_clock::now();
    try {
      group.Create(Spec({64, 4}, 4, SharedLayout::kContinuous));
    } catch (const IoError& e) {
      auto waited = std::chrono::steady_clock::now() - start;
      Check(e.error_code() == ETIMEDOUT, e.what());
      Check(std::string(e.what()).find("rank 2 of 3 did not arrive") != std::string::npos,
            e.what());
      Check(waited < 15s, "bounded wait");
      return;
    }
    Check(false, "no error");
  });
  ExpectAllZero(statuses);
}

// Rank 1 cannot map memory past `headroom` bytes more than it has (RLIMIT_AS): with 32 MiB
// chunked partitions, 16 MiB fails making its own, 48 MiB mapping its peers'. Rank 1 throws
// that ENOMEM; every other rank throws too, naming rank 1 and the step, long before the group's
// timeout (they used to wait it out, then blame rank 1 for not arriving).
void OneRankCannotMap(uint64_t headroom, const std::string& step) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers reserve address space that RLIMIT_AS would refuse";
#endif
  constexpr auto kTimeout = 60s;
  auto statuses = RunRanks(3, [&](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 3, kTimeout);
    const auto spec = Spec({3 * 8192, 1024}, 4, SharedLayout::kChunked);  // 32 MiB per rank
    if (rank == 1) {
      uint64_t pages = 0;
      std::FILE* statm = std::fopen("/proc/self/statm", "r");
      Check(statm != nullptr && std::fscanf(statm, "%lu", &pages) == 1, "read /proc/self/statm");
      std::fclose(statm);
      const rlimit limit{pages * ::sysconf(_SC_PAGESIZE) + headroom, RLIM_INFINITY};
      Check(::setrlimit(RLIMIT_AS, &limit) == 0, "setrlimit");
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      group.Create(spec);
      Check(false, "no error");
    } catch (const IoError& e) {
      Check(rank == 1, StrCat("rank ", rank, " threw an IoError: ", e.what()));
      Check(e.error_code() == ENOMEM, e.what());
    } catch (const std::runtime_error& e) {
      Check(rank != 1, StrCat("rank 1 threw: ", e.what()));
      const std::string msg = e.what();
      Check(msg.find(StrCat("(", step, ") failed on rank 1: ")) != std::string::npos, msg);
      Check(msg.find("Cannot allocate memory") != std::string::npos, msg);
    }
    Check(std::chrono::steady_clock::now() - start < kTimeout / 2, "thrown at once");
  });
  ExpectAllZero(statuses);
}

TEST(SharedTensorTest, RankThatCannotMakeItsPartitionFailsEveryRankAtOnce) {
  OneRankCannotMap(16 << 20, "serving");
}

TEST(SharedTensorTest, RankThatCannotMapItsPeersFailsEveryRankAtOnce) {
  OneRankCannotMap(48 << 20, "mapped");
}

TEST(SharedTensorTest, UseAfterCloseThrows) {
  auto statuses = RunRanks(2, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 2, 20s);
    auto t = group.Create(Spec({100, 2}, 8, SharedLayout::kChunked));
    auto view = t->memory();  // a view keeps the memory after close
    group.Barrier("mapped");
    group.Close();
    Check(t->closed(), "closed");
    Check(group.socket_name().rfind("tensortier.", 0) == 0, "socket name kept after close");
    int64_t i = 0;
    uint64_t out[2];
    try {
      t->Gather(&i, 1, out);
      Check(false, "gather after close");
    } catch (const std::logic_error& e) {
      Check(std::string(e.what()).find("closed") != std::string::npos, e.what());
    }
    Check(t->partitions()[0].address[0] == 0, "view still readable");
    try {
      group.Create(Spec({1}, 1, SharedLayout::kChunked));
      Check(false, "create after close");
    } catch (const std::logic_error&) {
    }
  });
  ExpectAllZero(statuses);
}

TEST(SharedTensorTest, AttachByNameSeesTheSameMemory) {
  auto statuses = RunRanks(2, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 2, 20s);
    auto t = group.Create(Spec({9, 1}, 4, SharedLayout::kContinuous, "table"));
    if (rank == 1) reinterpret_cast<uint32_t*>(t->data())[8] = 42;
    group.Barrier("written");
    auto again = group.Attach("table");
    Check(again->spec().Describe() == t->spec().Describe(), "same spec");
    Check(reinterpret_cast<uint32_t*>(again->data())[8] == 42, "same memory");
    Check(again->data() != t->data(), "a second mapping");
    try {
      group.Create(Spec({9, 1}, 4, SharedLayout::kContinuous, "table"));
      Check(false, "second tensor with the same name");
    } catch (const std::invalid_argument&) {
    }
    group.Barrier("attached");
  });
  ExpectAllZero(statuses);
}

// Ranks 0-1 create "late" (with an odd row count: rank 1's partition is smaller); rank 2 maps it
// from outside their group, and ranks 0-1 again through a second group of another size: all see
// the owners' writes, and theirs are seen. The attached mappings outlive the owners' close.
TEST(SharedTensorTest, AttachFromOutsideTheGroup) {
  auto statuses = RunRanks(3, [](int rank, std::shared_ptr<Store> store) {
    const uint64_t rows = 1031;
    if (rank < 2) {
      SharedGroup owners(store, rank, 2, 20s);
      auto t =
          owners.Create(Spec({static_cast<int64_t>(rows), 1}, 4, SharedLayout::kChunked, "late"));
      const SharedPartition& mine = t->local();
      for (uint64_t i = 0; i < mine.rows; ++i) {
        reinterpret_cast<uint32_t*>(mine.address)[i] = RowValue(mine.row_begin + i, 0);
      }
      owners.Barrier("written");
      store->Set(StrCat("written/", rank), "");
      // A second group, of another size, over the same store: its own token.
      SharedGroup pair(store, rank, 2, 20s);
      auto other = pair.Attach("late");
      Check(other->rank() == -1, "another group's tensor has no local partition");
      try {
        other->local();
        Check(false, "local() of a tensor attached from outside");
      } catch (const std::logic_error&) {
      }
      int64_t last = rows - 1;
      uint32_t got = 0;
      other->Gather(&last, 1, &got);
      Check(got == RowValue(rows - 1, 0), "second group reads the owners' rows");
      // Neither owner closes before both have attached through the second group: a slow rank
      // would otherwise fetch a partition its peer has stopped serving.
      owners.Barrier("attached");
      store->Get("outsider/wrote", 20s);
      int64_t row = 7;
      t->Gather(&row, 1, &got);
      Check(got == 777, "the outsider's write is seen by the owners");
      t->Close();  // stops serving it; the group goes on
      store->Set(StrCat("closed/", rank), "");
      store->Get("outsider/done", 30s);  // serving (nothing) until the outsider has tried
    } else {
      store->Get("written/0", 20s);
      store->Get("written/1", 20s);
      auto t = AttachSharedTensor(*store, "late", 20s);
      Check(t->rank() == -1 && t->partitions().size() == 2, "two owners");
      std::vector<int64_t> all(rows);
      for (uint64_t i = 0; i < rows; ++i) all[i] = static_cast<int64_t>(i);
      std::vector<uint32_t> got(rows);
      t->Gather(all.data(), rows, got.data());
      for (uint64_t i = 0; i < rows; ++i) Check(got[i] == RowValue(i, 0), StrCat("row ", i));
      uint32_t value = 777;
      int64_t row = 7;
      t->Scatter(&row, 1, &value);
      store->Set("outsider/wrote", "");
      store->Get("closed/0", 20s);
      store->Get("closed/1", 20s);
      t->Gather(all.data(), rows, got.data());  // still mapped after the owners closed it
      Check(got[7] == 777 && got[rows - 1] == RowValue(rows - 1, 0), "mapping outlives owners");
      try {
        AttachSharedTensor(*store, "late", 5s);
        Check(false, "attached a tensor its owners closed");
      } catch (const IoError& e) {
        Check(e.error_code() == ENOENT, e.what());
      }
      try {
        AttachSharedTensor(*store, "never", 300ms);
        Check(false, "attached a tensor nobody created");
      } catch (const IoError& e) {
        Check(e.error_code() == ETIMEDOUT, e.what());
      }
      store->Set("outsider/done", "");
    }
  });
  ExpectAllZero(statuses);
}

// Raw connection to `name`'s abstract socket: whether a descriptor came back for `key`.
bool FetchAsCurrentUser(const std::string& name, const std::string& key) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  socklen_t len = offsetof(sockaddr_un, sun_path) + 1 + name.size();
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) return false;
  uint32_t n = key.size();
  (void)!::send(fd, &n, 4, MSG_NOSIGNAL);
  (void)!::send(fd, key.data(), key.size(), MSG_NOSIGNAL);
  char status = 0;
  char control[CMSG_SPACE(sizeof(int))];
  iovec iov{&status, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t got = ::recvmsg(fd, &msg, 0);
  bool passed = got == 1 && CMSG_FIRSTHDR(&msg) != nullptr;
  ::close(fd);
  return passed;
}

// Two jobs of 2 processes over one store: job B makes its group after job A made its own and a
// tensor. B's collectives must meet only B's keys (A's tensor has another shape: a stale key of
// A's read by B would fail B's agreement), and B attaches A's named tensor from outside.
TEST(SharedTensorTest, TwoJobsOnOneStoreKeepTheirKeysApart) {
  auto statuses = RunRanks(4, [](int process, std::shared_ptr<Store> store) {
    const bool job_a = process < 2;
    const int rank = process % 2;
    if (job_a) {
      SharedGroup group(store, rank, 2, 20s);
      auto t = group.Create(Spec({10, 1}, 4, SharedLayout::kContinuous, "a"));
      const SharedPartition& mine = t->local();
      for (uint64_t i = 0; i < mine.rows; ++i) {
        reinterpret_cast<uint32_t*>(mine.address)[i] = RowValue(mine.row_begin + i, 0);
      }
      group.Barrier("written");
      store->Set(StrCat("a_ready/", rank), "");
      store->Get("b_done/0", 30s);
      store->Get("b_done/1", 30s);
      group.Barrier("done");
      return;
    }
    store->Get("a_ready/0", 20s);
    store->Get("a_ready/1", 20s);
    SharedGroup group(store, rank, 2, 20s);
    auto t = group.Create(Spec({20, 2}, 4, SharedLayout::kChunked, "b"));
    const SharedPartition& mine = t->local();
    for (uint64_t i = 0; i < mine.rows * 2; ++i) {
      reinterpret_cast<uint32_t*>(mine.address)[i] = RowValue(mine.row_begin + i / 2, i % 2);
    }
    group.Barrier("written");
    std::vector<int64_t> all(20);
    for (int64_t i = 0; i < 20; ++i) all[i] = i;
    std::vector<uint32_t> got(40);
    t->Gather(all.data(), all.size(), got.data());
    for (size_t i = 0; i < got.size(); ++i) Check(got[i] == RowValue(i / 2, i % 2), "job B's rows");
    auto a = group.Attach("a");
    Check(a->rank() == -1, "job A's tensor is attached from outside");
    a->Gather(all.data(), 10, got.data());
    for (size_t i = 0; i < 10; ++i) Check(got[i] == RowValue(i, 0), "job A's rows");
    group.Barrier("attached");
    store->Set(StrCat("b_done/", rank), "");
  });
  ExpectAllZero(statuses);
}

// A rank whose peer has already created more groups of its size on the store is told so at
// once (the peer gave up on two groups this rank never joined).
TEST(SharedTensorTest, GroupsCreatedOutOfOrderAreRefused) {
  auto statuses = RunRanks(2, [](int rank, std::shared_ptr<Store> store) {
    if (rank == 0) {
      for (int i = 0; i < 2; ++i) {
        try {
          SharedGroup lonely(store, 0, 2, 300ms);
          Check(false, "a group without its peer");
        } catch (const IoError& e) {
          Check(e.error_code() == ETIMEDOUT, e.what());
        }
      }
      store->Set("gave_up", "");
      store->Get("refused", 20s);
      return;
    }
    store->Get("gave_up", 20s);
    try {
      SharedGroup late(store, 1, 2, 20s);
      Check(false, "joined a group its peer gave up on");
    } catch (const std::invalid_argument& e) {
      Check(std::string(e.what()).find("rank 0 has created 2 already") != std::string::npos,
            e.what());
    }
    store->Set("refused", "");
  });
  ExpectAllZero(statuses);
}

TEST(SharedTensorTest, AnotherUsersProcessIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another user";
  auto statuses = RunRanks(2, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 2, 20s);
    auto t = group.Create(Spec({4096, 1}, 4, SharedLayout::kContinuous, "secret"));
    if (rank == 0) {
      Check(FetchAsCurrentUser(group.socket_name(), "secret"), "same user is served");
      pid_t pid = ::fork();
      if (pid == 0) {
        if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
        ::_exit(FetchAsCurrentUser(group.socket_name(), "secret") ? 2 : 0);
      }
      int st = 0;
      ::waitpid(pid, &st, 0);
      Check(WIFEXITED(st) && WEXITSTATUS(st) == 0, StrCat("other user's fetch: status ", st));
      Check(group.refused_peers() == 1, "refusal counted");
    }
    group.Barrier("done");
  });
  ExpectAllZero(statuses);
}

// A child made by fork() holds a copy of its parent's group, not a rank: a collective call there
// would stand in for the parent's (std::logic_error instead), and closing the copy, from any
// thread, must not end the process (the partition server's thread is the parent's).
TEST(SharedTensorTest, AForkedChildMakesNoCollectiveCallAndClosesItsCopy) {
  auto statuses = RunRanks(2, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 2, 20s);
    auto t = group.Create(Spec({1024, 1}, 4, SharedLayout::kContinuous, "t"));
    if (rank == 1) {
      pid_t pid = ::fork();
      if (pid == 0) {
        int code = 0;
        const std::vector<std::function<void()>> calls = {
            [&] { group.Barrier("child"); },
            [&] { group.Attach("t"); },  // the store's connection is the parent's
        };
        for (const auto& call : calls) {
          try {
            call();
            code = code ? code : 2;  // the call returned
          } catch (const std::logic_error& e) {
            const bool named =
                std::string(e.what()).find("a child made by fork()") != std::string::npos;
            code = code ? code : named ? 0 : 3;
          } catch (...) {
            code = code ? code : 4;
          }
        }
#if defined(__SANITIZE_THREAD__)
        group.Close();  // TSan starts no thread after a fork of a process with threads
#else
        std::thread closing([&] { group.Close(); });
        closing.join();
#endif
        ::_exit(code);
      }
      int st = 0;
      ::waitpid(pid, &st, 0);
      Check(WIFEXITED(st) && WEXITSTATUS(st) == 0, StrCat("child: status ", st));
    }
    group.Barrier("after the child");  // paired with rank 0's, not taken by the child
    Check(t->rank() == rank, "the group's tensor is still this rank's");
  });
  ExpectAllZero(statuses);
}

// The record attach reads is anyone's writing (a TCPStore has no authentication): a field no
// tensor has, or a shape needing more memory than the owners serve, is refused with
// std::invalid_argument naming the field, before anything is read (no SIGBUS, no segfault, no
// uninitialised bytes, no bad_alloc).
TEST(SharedTensorTest, AttachRefusesARecordThatIsNoTensorOrNeedsMoreThanIsServed) {
  auto statuses = RunRanks(2, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 2, 20s);
    auto t = group.Create(Spec({10, 4}, 4, SharedLayout::kContinuous, "t"));
    group.Barrier("created");
    if (rank == 1) {
      const std::string key = "tensortier/shared/named/t";
      const std::string good = store->Get(key, 5s);
      auto with = [&](const std::string& from, const std::string& to) {
        const size_t at = good.find(from);
        Check(at != std::string::npos, StrCat(from, " in ", good));
        return good.substr(0, at) + to + good.substr(at + from.size());
      };
      const std::pair<std::string, std::string> cases[] = {
          {with("shape=[10,4]", "shape=[-5,4]"), "negative dimension"},
          {with("shape=[10,4]", "shape=[100000,4]"), "needs 802816 bytes in rank 0"},
          {with("element_size=4", "element_size=0"), "element_size must be positive"},
          {with(" 2 shape=", " 2147483647 shape="), "world_size 2147483647 is not in"},
          {with(" 2 shape=", " 99999999999 shape="), "world_size '99999999999'"},
          {with(" 2 shape=", " 0 shape="), "world_size 0 is not in"},
          {with("shape=[10,4]", "shape=[1e3,4]"), "shape '1e3'"},
          {with("shape=[10,4]", "shape=[4294967296,4294967296]"), "more than 2^56 bytes"},
          {with("shape=[10,4]", "shape=[0,4294967296,4294967296]"), "more than 2^56 bytes"},
          {with("dtype=bytes4", "dtype=torch.float64"), "not the size of torch.float64 (8)"},
          {with("layout=continuous", "layout=distributed"), "layout distributed"},
          {"zz" + good.substr(2), "token"},
          {good.substr(0, 32) + "/x" + good.substr(32), "token"},
      };
      for (const auto& [record, says] : cases) {
        store->Set(key, record);
        try {
          AttachSharedTensor(*store, "t", 5s);
          Check(false, StrCat("attached record ", record));
        } catch (const std::invalid_argument& e) {
          Check(std::string(e.what()).find(says) != std::string::npos,
                StrCat("'", e.what(), "' does not say ", says));
        }
      }
      store->Set(key, good);
      auto again = AttachSharedTensor(*store, "t", 5s);
      int64_t last = 9;
      uint32_t out[4];
      again->Gather(&last, 1, out);
    }
    group.Barrier("attached");
  });
  ExpectAllZero(statuses);
}

// Ranks 0 and 2 create a tensor while rank 1 calls a barrier at that point: every rank throws
// std::invalid_argument naming who called what (rank 1's barrier used to return).
TEST(SharedTensorTest, RanksMakingDifferentCollectiveCallsAllThrow) {
  auto statuses = RunRanks(3, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 3, 20s);
    try {
      if (rank == 1) {
        group.Barrier("barrier");
      } else {
        group.Create(Spec({10, 4}, 4, SharedLayout::kContinuous));
      }
      Check(false, "no error");
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      Check(msg.find("rank 1 called barrier") != std::string::npos, msg);
      Check(msg.find("rank 0,2 called create_tensor") != std::string::npos, msg);
    }
    // The group goes on: the next calls pair up again.
    group.Barrier("after");
    auto t = group.Create(Spec({10, 4}, 4, SharedLayout::kChunked));
    Check(t->partitions().size() == 3, "created after the mismatch");
  });
  ExpectAllZero(statuses);
}

// Opens /dev/null until this process is out of descriptors; returns what it opened.
std::vector<int> ExhaustDescriptors() {
  std::vector<int> fds;
  for (;;) {
    int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      Check(errno == EMFILE, StrCat("open: ", std::strerror(errno)));
      return fds;
    }
    fds.push_back(fd);
  }
}

// UBSan's vptr check opens a pipe to probe memory: with no descriptor free it reports every
// virtual call as a bad object. The plain and TSan builds run these tests.
#if defined(__SANITIZE_ADDRESS__)
#define SKIP_WHERE_SANITIZERS_NEED_DESCRIPTORS() GTEST_SKIP() << "UBSan's checks need descriptors"
#else
#define SKIP_WHERE_SANITIZERS_NEED_DESCRIPTORS() static_cast<void>(0)
#endif

// Lowers this process's soft RLIMIT_NOFILE so that `headroom` descriptors are left to open.
void LimitDescriptors(int headroom) {
  int highest = 0;
  for (int fd = 0; fd < 1 << 16; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0) highest = fd;
  }
  rlimit limit{};
  Check(::getrlimit(RLIMIT_NOFILE, &limit) == 0, "getrlimit");
  limit.rlim_cur = static_cast<rlim_t>(highest + 1 + headroom);
  Check(::setrlimit(RLIMIT_NOFILE, &limit) == 0, "setrlimit");
}

// Rank 1 has no descriptor free: its partition server cannot accept a peer's connection. The
// peers fetching from it learn that at once (EMFILE, naming ulimit -n) instead of waiting out
// the timeout while its server retries accept in a busy loop; its own fetch says so too.
TEST(SharedTensorTest, ARankOutOfDescriptorsSaysSoAtOnce) {
  SKIP_WHERE_SANITIZERS_NEED_DESCRIPTORS();
  constexpr auto kTimeout = 60s;
  auto statuses = RunRanks(3, [&](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 3, kTimeout);
    auto t = group.Create(Spec({3 * 1024, 1024}, 4, SharedLayout::kChunked, "t"));
    auto attach_fails = [&](const std::string& naming) {
      const auto start = std::chrono::steady_clock::now();
      try {
        group.Attach("t");
        Check(false, "attached through a rank out of descriptors");
      } catch (const IoError& e) {
        Check(e.error_code() == EMFILE, e.what());
        Check(std::string(e.what()).find("ulimit -n") != std::string::npos, e.what());
        Check(std::string(e.what()).find(naming) != std::string::npos, e.what());
      }
      Check(std::chrono::steady_clock::now() - start < kTimeout / 2, "said at once");
    };
    std::vector<int> held;
    if (rank == 1) {
      LimitDescriptors(16);
      held = ExhaustDescriptors();
      attach_fails("socket");  // its own connection to rank 0
    }
    group.Barrier("rank 1 tried");
    if (rank != 1) attach_fails("rank 1");
    group.Barrier("peers tried");
    for (int fd : held) ::close(fd);
    group.Barrier("freed");
    auto again = group.Attach("t");  // served again once descriptors are free
    group.Barrier("attached");
  });
  ExpectAllZero(statuses);
}

// Rank 1 has 24 descriptors left and every rank keeps creating tensors (each holds one): the
// call that runs out fails on every rank at once, each error naming ulimit -n.
TEST(SharedTensorTest, RunningOutOfDescriptorsFailsTheCallOnEveryRankAtOnce) {
  SKIP_WHERE_SANITIZERS_NEED_DESCRIPTORS();
  constexpr auto kTimeout = 60s;
  auto statuses = RunRanks(3, [&](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 3, kTimeout);
    std::vector<int> held;
    if (rank == 1) {
      LimitDescriptors(64);
      held = ExhaustDescriptors();
      Check(held.size() >= 24, "descriptors to free");
      for (int i = 0; i < 24; ++i) {
        ::close(held.back());
        held.pop_back();
      }
    }
    std::vector<std::shared_ptr<SharedTensor>> kept;
    for (int i = 0;; ++i) {
      Check(i < 100, "never ran out");
      const auto start = std::chrono::steady_clock::now();
      try {
        kept.push_back(group.Create(Spec({3, 1024}, 4, SharedLayout::kChunked)));
      } catch (const std::exception& e) {
        Check(std::chrono::steady_clock::now() - start < kTimeout / 2, "failed at once");
        Check(std::string(e.what()).find("ulimit -n") != std::string::npos, e.what());
        store->Set(StrCat("failed_at/", rank), std::to_string(i));
        break;
      }
    }
    const std::string mine = store->Get(StrCat("failed_at/", rank), 5s);
    for (int r = 0; r < 3; ++r) {
      Check(store->Get(StrCat("failed_at/", r), 30s) == mine, "every rank failed the same call");
    }
    kept.clear();
    for (int fd : held) ::close(fd);
    group.Barrier("done");
  });
  ExpectAllZero(statuses);
}

// A store in this process: what the leaving tests count with.
class CountingStore : public Store {
 public:
  explicit CountingStore(bool gone = false) : gone_(gone) {}
  void Set(const std::string&, const std::string&) override {}
  std::string Get(const std::string& key, std::chrono::milliseconds) override {
    ThrowIoError(ETIMEDOUT, "get", key);
  }
  int64_t Add(const std::string& key, int64_t delta) override {
    if (gone_) ThrowIoError(ECONNRESET, "the store is gone", key);
    return counts_[key] += delta;
  }
  void Delete(const std::string& key) override { counts_.erase(key); }

 private:
  bool gone_;
  std::map<std::string, int64_t> counts_;
};

TEST(SharedGroupLeaveTest, TheStoreHostWaitsForTheOthersToCountOutAtMostTheTimeout) {
  CountingStore store;
  bool all_left = false;
  auto waited = [&](int world, std::chrono::milliseconds timeout) {
    const auto start = std::chrono::steady_clock::now();
    all_left = SharedGroup::WaitForOthersToLeave(store, "left", world, timeout);
    return std::chrono::steady_clock::now() - start;
  };
  EXPECT_GE(waited(3, 200ms), 200ms);  // nobody counted out: the timeout
  EXPECT_FALSE(all_left);
  store.Add("left", 1);
  EXPECT_GE(waited(3, 200ms), 200ms);  // one of two
  EXPECT_FALSE(all_left);
  store.Add("left", 1);
  EXPECT_LT(waited(3, 20s), 5s);  // both
  EXPECT_TRUE(all_left);
  CountingStore gone(true);
  const auto start = std::chrono::steady_clock::now();
  // A store gone: nobody to wait for.
  EXPECT_TRUE(SharedGroup::WaitForOthersToLeave(gone, "left", 3, 20s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(SharedGroupLeaveTest, RanksCountThemselvesOutUnderTheGroupsOwnKey) {
  ExpectAllZero(RunRanks(2, [](int rank, std::shared_ptr<Store> store) {
    SharedGroup group(store, rank, 2, 20s);
    Check(group.leave_key().find("tensortier/shared/left/") == 0, group.leave_key());
    group.Barrier("start");
    const int64_t before = store->Add(group.leave_key(), 0);
    group.Barrier("read");
    group.Close();
    if (rank == 1) group.CountOut();
    if (rank == 0) SharedGroup::WaitForOthersToLeave(*store, group.leave_key(), 2, 20s);
    Check(before == 0, StrCat("counted before leaving: ", before));
    Check(store->Add(group.leave_key(), 0) == 1, "rank 1 counted out once");
  }));
}

TEST(UnixSocketStoreTest, SetGetAddDeleteAndTimeout) {
  auto statuses = RunRanks(2, [](int rank, std::shared_ptr<Store> store) {
    if (rank == 1) store->Set("k", std::string("v\0w", 3));
    Check(store->Get("k", 10s) == std::string("v\0w", 3), "value");
    int64_t n = store->Add("counter", 5);
    Check(n == 5 || n == 10, "add");
    store->Set(StrCat("added", rank), "");
    store->Get(StrCat("added", 1 - rank), 10s);
    Check(store->Add("counter", 0) == 10, "both adds");
    if (rank == 0) {
      auto start = std::chrono::steady_clock::now();
      try {
        store->Get("never", 300ms);
        Check(false, "no timeout");
      } catch (const IoError& e) {
        Check(e.error_code() == ETIMEDOUT, e.what());
        Check(std::chrono::steady_clock::now() - start < 10s, "bounded");
      }
      store->Set("gone", "x");
      store->Delete("gone");
      store->Delete("never");  // absent: nothing to do
      try {
        store->Get("gone", 300ms);
        Check(false, "a deleted key was read");
      } catch (const IoError& e) {
        Check(e.error_code() == ETIMEDOUT, e.what());
      }
      Check(store->Add("gone", 2) == 2, "a deleted key counts from 0");
    }
  });
  ExpectAllZero(statuses);
}

}  // namespace
}  // namespace tensortier
