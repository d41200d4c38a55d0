// The bookkeeping of the distributed layout's rounds: which rows each rank asks of each other,
// in how many index slots, and where the rows that answer them go. The collectives themselves
// (all-to-all) belong to the caller (torch.distributed in Python): each step here fills the
// buffers of one all-to-all and says how they split between ranks, and the next step reads what
// came back.
//
// A round is one gather or scatter of one rank, paired across ranks by the order each process
// makes them (a rank's gather may meet another's scatter: a round serves every kind). Its steps:
//   Route          the request: per rank a header (rows asked, a bad index, an overflow, the
//                  call's kind) and as many indices as the pair's slots hold
//   ReadRequests   what each rank asked of this one; std::out_of_range on every rank when any
//                  passed an index out of range; the overflow, when a pair's slots were too few
//   Serve          the rows this rank sends: those it serves to gathering ranks, then its own
//                  writes to their owners
//   Finish         the rows received: written to this rank's rows, or to the caller's output
// with an all-to-all of the buffers between each step and the next (the overflow one only when
// ReadRequests says so). Slots follow the counts of earlier rounds (NextSlots): both ends of a pair
// compute them from the same counts, so they agree without talking. One round at a time per
// object; the buffers are kept between rounds up to kSharedExchangeKeptBytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace tensortier {

inline constexpr uint64_t kSharedExchangeKeptBytes = 256ull << 20;
inline constexpr size_t kSharedExchangeHeader = 4;  // int64s ahead of a pair's request

// Index slots for the next request between two ranks, from the rows asked this time: unchanged
// while the count fits and uses a quarter of them, else the count plus slack.
uint64_t NextSlots(uint64_t slots, uint64_t count);

class SharedRowExchange {
 public:
  enum Kind : int64_t { kGather = 0, kScatter = 1 };

  // A tensor of `row_bytes` rows whose rank r owns rows [ends[r - 1], ends[r]); this is `rank`.
  SharedRowExchange(std::vector<uint64_t> ends, int rank, uint64_t row_bytes);

  // A buffer of one step: `bytes` at `data`, split between ranks in `splits` (elements: int64
  // indices, or rows of row_bytes).
  struct Buffer {
    uint8_t* data = nullptr;
    uint64_t bytes = 0;
  };
  struct Splits {
    std::vector<uint64_t> send, recv;
  };

  // Step 1 of this rank's gather (kGather) or scatter of rows `indices[0..count)`: fills
  // send_buffer() (int64) and sizes recv_buffer(). `refused`: this rank's call was refused
  // before its round (its arguments): it asks for nothing and says so, so that every rank's
  // ReadRequests throws rather than pairing the others' round with this rank's next call.
  Splits Route(const int64_t* indices, size_t count, Kind kind, bool refused = false);
  // Step 2, after the all-to-all of step 1. Throws std::invalid_argument naming the ranks whose
  // call was refused, else std::out_of_range naming the ranks that passed an index out of range
  // (every rank throws alike). Returns true when an overflow all-to-all (LateSplits, send_buffer
  // and recv_buffer again) must run before Serve.
  bool ReadRequests();
  Splits LateSplits() const { return late_splits_; }
  // Step 3: gathers the rows this rank serves from `local` (its partition, rows [ends[rank - 1],
  // ends[rank])) and, for a scatter, its own `values` (count rows, in the order of `indices`)
  // into send_buffer(); sizes recv_buffer(). Splits in rows.
  Splits Serve(const uint8_t* local, const uint8_t* values);
  // Step 4, after the all-to-all of step 3: writes the rows other ranks scatter to this one into
  // `local`, and for a gather the rows fetched to `out` (count rows, in the order of `indices`).
  void Finish(uint8_t* local, uint8_t* out);

  Buffer send_buffer() const { return {send_.data.get(), send_.bytes}; }
  Buffer recv_buffer() const { return {recv_.data.get(), recv_.bytes}; }

 private:
  // Bytes kept between rounds (uninitialized), up to kSharedExchangeKeptBytes.
  struct Store {
    std::unique_ptr<uint8_t[]> data;
    uint64_t capacity = 0;
    uint64_t bytes = 0;
    uint8_t* Size(uint64_t n);
    void Trim();
  };

  const std::vector<uint64_t> ends_;
  const int rank_;
  const int world_;
  const uint64_t row_bytes_;
  std::vector<uint64_t> send_slots_, recv_slots_;

  // This round.
  Kind kind_ = kGather;
  size_t count_ = 0;
  std::vector<int64_t> order_;          // positions of the batch grouped by owner
  std::vector<uint64_t> counts_;        // rows this rank asks of each rank
  std::vector<int64_t> extra_;          // indices past the pairs' slots, grouped by owner
  std::vector<uint64_t> asked_, fits_;  // rows each rank asks of this one; in its slots
  std::vector<int64_t> kinds_;          // each rank's call
  bool late_ = false;
  Splits late_splits_;
  std::vector<int64_t> requested_;  // rows asked of this rank, grouped by asking rank
  std::vector<uint64_t> serve_, write_, back_, own_;  // rows per rank, see Serve
  Store send_, recv_;
};

}  // namespace tensortier
