// The distributed layout's round bookkeeping (SharedRowExchange), with the all-to-alls that
// torch.distributed makes in production played here between the ranks' objects in one process.
#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensortier/shared/shared_exchange.hpp"
#include "tensortier/shared/shared_spec.hpp"

namespace tensortier {
namespace {

using Splits = SharedRowExchange::Splits;

// What all_to_all_single does: rank r receives, in rank order, the piece each rank sends it.
void AllToAll(std::vector<SharedRowExchange>& ranks, const std::vector<Splits>& splits,
              uint64_t width) {
  const size_t world = ranks.size();
  std::vector<std::vector<uint64_t>> send_at(world, std::vector<uint64_t>(world + 1, 0));
  for (size_t q = 0; q < world; ++q) {
    for (size_t r = 0; r < world; ++r) send_at[q][r + 1] = send_at[q][r] + splits[q].send[r];
    ASSERT_EQ(send_at[q][world] * width, ranks[q].send_buffer().bytes);
  }
  for (size_t r = 0; r < world; ++r) {
    uint64_t at = 0;
    for (size_t q = 0; q < world; ++q) {
      ASSERT_EQ(splits[q].send[r], splits[r].recv[q]) << "rank " << q << " to rank " << r;
      std::memcpy(ranks[r].recv_buffer().data + at * width,
                  ranks[q].send_buffer().data + send_at[q][r] * width, splits[q].send[r] * width);
      at += splits[q].send[r];
    }
    ASSERT_EQ(at * width, ranks[r].recv_buffer().bytes);
  }
}

// A table of `rows` rows of two int32 (row, column) split as the distributed layout splits it.
struct Job {
  static constexpr uint64_t kRowBytes = 8;
  std::vector<SharedPartition> parts;
  std::vector<std::vector<int32_t>> locals;
  std::vector<SharedRowExchange> ranks;

  Job(uint64_t rows, int world) {
    parts = PartitionRows(rows, kRowBytes, world, 1);
    std::vector<uint64_t> ends;
    for (const auto& p : parts) ends.push_back(p.row_begin + p.rows);
    for (int r = 0; r < world; ++r) {
      ranks.emplace_back(ends, r, kRowBytes);
      std::vector<int32_t> local;
      for (uint64_t i = parts[r].row_begin; i < parts[r].row_begin + parts[r].rows; ++i) {
        local.push_back(static_cast<int32_t>(i));
        local.push_back(0);
      }
      locals.push_back(local);
    }
  }

  // One round: rank r gathers (values[r] empty) or scatters values[r] to rows indices[r].
  // Returns each gathering rank's rows.
  std::vector<std::vector<int32_t>> Round(const std::vector<std::vector<int64_t>>& indices,
                                          const std::vector<std::vector<int32_t>>& values) {
    const size_t world = ranks.size();
    std::vector<Splits> splits(world);
    for (size_t r = 0; r < world; ++r) {
      splits[r] = ranks[r].Route(
          indices[r].data(), indices[r].size(),
          values[r].empty() ? SharedRowExchange::kGather : SharedRowExchange::kScatter);
    }
    AllToAll(ranks, splits, 8);
    std::vector<bool> late(world);
    for (size_t r = 0; r < world; ++r) late[r] = ranks[r].ReadRequests();
    for (size_t r = 1; r < world; ++r) EXPECT_EQ(late[r], late[0]);
    if (late[0]) {
      for (size_t r = 0; r < world; ++r) splits[r] = ranks[r].LateSplits();
      AllToAll(ranks, splits, 8);
    }
    for (size_t r = 0; r < world; ++r) {
      splits[r] = ranks[r].Serve(reinterpret_cast<const uint8_t*>(locals[r].data()),
                                 reinterpret_cast<const uint8_t*>(values[r].data()));
    }
    AllToAll(ranks, splits, kRowBytes);
    std::vector<std::vector<int32_t>> out(world);
    for (size_t r = 0; r < world; ++r) {
      if (values[r].empty()) out[r].assign(indices[r].size() * 2, -1);
      ranks[r].Finish(reinterpret_cast<uint8_t*>(locals[r].data()),
                      reinterpret_cast<uint8_t*>(out[r].data()));
    }
    return out;
  }
};

std::vector<int32_t> Rows(const std::vector<int64_t>& rows, int32_t column) {
  std::vector<int32_t> out;
  for (int64_t r : rows) {
    out.push_back(static_cast<int32_t>(r));
    out.push_back(column);
  }
  return out;
}

TEST(SharedExchangeTest, SlotsGrowWithTheCountsAndShrinkWhenMostlyUnused) {
  EXPECT_EQ(NextSlots(0, 0), 0u);
  EXPECT_EQ(NextSlots(0, 8), 8u + 2 + 16);
  EXPECT_EQ(NextSlots(26, 8), 26u);             // fits, and uses a quarter or more
  EXPECT_EQ(NextSlots(100, 20), 20u + 5 + 16);  // uses under a quarter
  EXPECT_EQ(NextSlots(26, 27), 27u + 6 + 16);
}

TEST(SharedExchangeTest, GathersAndScattersOfOneRoundMeetAndOverflowTravelsLate) {
  Job job(10, 3);  // rows [0,4) [4,7) [7,10)
  // Round 1: no slots yet, so every request travels in the overflow all-to-all.
  std::vector<std::vector<int64_t>> idx = {{9, 0, 5, 5, 9}, {1, 8}, {}};
  auto out = job.Round(idx, {{}, Rows({1, 8}, 7), {}});
  EXPECT_EQ(out[0], Rows({9, 0, 5, 5, 9}, 0));
  EXPECT_TRUE(out[2].empty());
  EXPECT_EQ(job.locals[0][2 * 1 + 1], 7);  // row 1 on rank 0, written by rank 1
  EXPECT_EQ(job.locals[2][2 * 1 + 1], 7);  // row 8 on rank 2
  // Round 2: within the slots the first round left; rank 2 gathers what rank 1 wrote.
  out = job.Round({{3}, {}, {8, 1, 2}}, {{}, {}, {}});
  EXPECT_EQ(out[0], Rows({3}, 0));
  std::vector<int32_t> want = Rows({8, 1, 2}, 7);
  want[5] = 0;  // row 2 was never written
  EXPECT_EQ(out[2], want);
  // Round 3: far more rows than the slots hold.
  std::vector<int64_t> many;
  for (int i = 0; i < 200; ++i) many.push_back((i * 7) % 10);
  out = job.Round({many, many, {}}, {{}, {}, {}});
  std::vector<int32_t> expect = Rows(many, 0);
  for (size_t i = 0; i < many.size(); ++i) {
    if (many[i] == 1 || many[i] == 8) expect[2 * i + 1] = 7;
  }
  EXPECT_EQ(out[0], expect);
  EXPECT_EQ(out[1], expect);
}

TEST(SharedExchangeTest, AnIndexOutOfRangeFailsEveryRankNamingWhoPassedIt) {
  Job job(10, 3);
  const std::vector<std::vector<int64_t>> idx = {{1}, {10, 2}, {-1}};
  std::vector<Splits> splits;
  for (int r = 0; r < 3; ++r) {
    splits.push_back(job.ranks[r].Route(idx[r].data(), idx[r].size(), SharedRowExchange::kGather));
  }
  AllToAll(job.ranks, splits, 8);
  for (int r = 0; r < 3; ++r) {
    try {
      job.ranks[r].ReadRequests();
      ADD_FAILURE() << "rank " << r << " did not throw";
    } catch (const std::out_of_range& e) {
      EXPECT_STREQ(e.what(),
                   "rank 1,2 passed an index out of range for a shared tensor of 10 rows "
                   "(nothing was moved)");
    }
  }
  // The next exchange starts afresh: the one that failed left no index slots behind.
  auto out = job.Round({{9}, {0}, {}}, {{}, {}, {}});
  EXPECT_EQ(out[0], Rows({9}, 0));
  EXPECT_EQ(out[1], Rows({0}, 0));
}

// A rank whose call was refused for its arguments still takes part, saying so: every rank
// throws naming it (before any bad index), and the next calls pair up as before.
TEST(SharedExchangeTest, ARefusedCallFailsEveryRankNamingWhoseItWas) {
  Job job(10, 3);
  const std::vector<std::vector<int64_t>> idx = {{1}, {10}, {2}};
  std::vector<Splits> splits;
  for (int r = 0; r < 3; ++r) {
    splits.push_back(job.ranks[r].Route(idx[r].data(), idx[r].size(), SharedRowExchange::kGather,
                                        /*refused=*/r == 2));
  }
  AllToAll(job.ranks, splits, 8);
  for (int r = 0; r < 3; ++r) {
    try {
      job.ranks[r].ReadRequests();
      ADD_FAILURE() << "rank " << r << " did not throw";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("rank 2 refused its gather or scatter"),
                std::string::npos)
          << e.what();
    }
  }
  auto out = job.Round({{9}, {0}, {}}, {{}, {}, {}});
  EXPECT_EQ(out[0], Rows({9}, 0));
  EXPECT_EQ(out[1], Rows({0}, 0));
}

TEST(SharedExchangeTest, RanksWithoutRowsAndEmptyRowsTakePart) {
  Job job(2, 4);  // two ranks own nothing
  auto out = job.Round({{1, 0}, {}, {1}, {0, 0}}, {{}, {}, {}, {}});
  EXPECT_EQ(out[0], Rows({1, 0}, 0));
  EXPECT_EQ(out[2], Rows({1}, 0));
  EXPECT_EQ(out[3], Rows({0, 0}, 0));
}

}  // namespace
}  // namespace tensortier
