#include "tensortier/shared/shared_exchange.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "tensortier/shared/shared_rows.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr size_t kHeader = kSharedExchangeHeader;

uint64_t Sum(const std::vector<uint64_t>& v) {
  return std::accumulate(v.begin(), v.end(), uint64_t{0});
}

// Where each of pieces of `counts` laid end to end starts.
std::vector<uint64_t> Offsets(const std::vector<uint64_t>& counts) {
  std::vector<uint64_t> at(counts.size());
  uint64_t next = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    at[r] = next;
    next += counts[r];
  }
  return at;
}

}  // namespace

uint64_t NextSlots(uint64_t slots, uint64_t count) {
  if (count > slots || 4 * count < slots) return count + count / 4 + 16;
  return slots;
}

uint8_t* SharedRowExchange::Store::Size(uint64_t n) {
  if (n > capacity) {
    data.reset();  // the old contents are never kept: free them before asking for more
    capacity = n + n / 4;
    data.reset(new uint8_t[capacity]);
  }
  bytes = n;
  return data.get();
}

void SharedRowExchange::Store::Trim() {
  if (capacity > kSharedExchangeKeptBytes) {  // a rare huge batch: not kept
    data.reset();
    capacity = 0;
  }
  bytes = 0;
}

SharedRowExchange::SharedRowExchange(std::vector<uint64_t> ends, int rank, uint64_t row_bytes)
    : ends_(std::move(ends)),
      rank_(rank),
      world_(static_cast<int>(ends_.size())),
      row_bytes_(row_bytes),
      send_slots_(ends_.size(), 0),
      recv_slots_(ends_.size(), 0) {
  if (world_ <= 0 || rank < 0 || rank >= world_) {
    throw std::invalid_argument(
        StrCat("rank ", rank, " is not in a group of ", world_, " processes"));
  }
}

SharedRowExchange::Splits SharedRowExchange::Route(const int64_t* indices, size_t count, Kind kind,
                                                   bool refused) {
  send_.Trim();
  recv_.Trim();
  if (refused) count = 0;
  kind_ = kind;
  count_ = count;
  order_.resize(count);
  RowRoute route = RouteRows(indices, count, ends_, order_.data());
  // The header's second field: 0, 1 for an index out of range, 2 for a refused call.
  const int64_t bad = refused ? 2 : route.bad >= 0 ? 1 : 0;
  counts_ = std::move(route.counts);  // all zero when an index is bad
  bool overflow = false;
  for (int r = 0; r < world_; ++r) overflow = overflow || counts_[r] > send_slots_[r];

  Splits splits;
  uint64_t send_count = 0;
  for (int r = 0; r < world_; ++r) {
    splits.send.push_back(kHeader + send_slots_[r]);
    splits.recv.push_back(kHeader + recv_slots_[r]);
    send_count += kHeader + send_slots_[r];
  }
  auto* send = reinterpret_cast<int64_t*>(send_.Size(send_count * sizeof(int64_t)));
  extra_.clear();
  uint64_t at = 0;  // position in the batch grouped by owner
  for (int r = 0; r < world_; ++r) {
    const uint64_t fit = std::min(counts_[r], send_slots_[r]);
    *send++ = static_cast<int64_t>(counts_[r]);
    *send++ = bad;
    *send++ = overflow ? 1 : 0;
    *send++ = kind;
    for (uint64_t i = 0; i < counts_[r]; ++i) {
      const int64_t row = indices[order_[at + i]];
      if (i < fit) {
        *send++ = row;
      } else {
        extra_.push_back(row);
      }
    }
    std::fill(send, send + (send_slots_[r] - fit), int64_t{0});
    send += send_slots_[r] - fit;
    at += counts_[r];
  }
  recv_.Size((kHeader * world_ + Sum(recv_slots_)) * sizeof(int64_t));
  return splits;
}

bool SharedRowExchange::ReadRequests() {
  const auto* recv = reinterpret_cast<const int64_t*>(recv_.data.get());
  std::vector<uint64_t> heads(world_, 0);
  for (int r = 1; r < world_; ++r) heads[r] = heads[r - 1] + kHeader + recv_slots_[r - 1];
  std::string offenders, refused;
  for (int r = 0; r < world_; ++r) {
    std::string& to = recv[heads[r] + 1] == 2 ? refused : offenders;
    if (recv[heads[r] + 1] != 0) to += StrCat(to.empty() ? "" : ",", r);
  }
  if (!refused.empty()) {
    throw std::invalid_argument(
        StrCat("rank ", refused,
               " refused its gather or scatter (its arguments, or an error before the round: "
               "see the error it raised), so no rank moved rows; every rank must make the same "
               "calls"));
  }
  if (!offenders.empty()) {
    throw std::out_of_range(StrCat("rank ", offenders,
                                   " passed an index out of range for a shared tensor of ",
                                   ends_.back(), " rows (nothing was moved)"));
  }
  asked_.assign(world_, 0);
  fits_.assign(world_, 0);
  kinds_.assign(world_, kGather);
  late_ = false;
  requested_.clear();
  for (int r = 0; r < world_; ++r) {
    const int64_t* head = recv + heads[r];
    asked_[r] = static_cast<uint64_t>(std::max<int64_t>(head[0], 0));
    late_ = late_ || head[2] != 0;
    kinds_[r] = head[3];
    fits_[r] = std::min(asked_[r], recv_slots_[r]);
    requested_.insert(requested_.end(), head + kHeader, head + kHeader + fits_[r]);
  }
  late_splits_ = Splits();
  if (late_) {
    for (int r = 0; r < world_; ++r) {
      late_splits_.send.push_back(counts_[r] - std::min(counts_[r], send_slots_[r]));
      late_splits_.recv.push_back(asked_[r] - fits_[r]);
    }
    uint8_t* late_send = send_.Size(extra_.size() * sizeof(int64_t));
    if (!extra_.empty()) {  // memcpy's pointers must not be null, even for no bytes
      std::memcpy(late_send, extra_.data(), extra_.size() * sizeof(int64_t));
    }
    recv_.Size((Sum(asked_) - Sum(fits_)) * sizeof(int64_t));
  }
  for (int r = 0; r < world_; ++r) {
    send_slots_[r] = NextSlots(send_slots_[r], counts_[r]);
    recv_slots_[r] = NextSlots(recv_slots_[r], asked_[r]);
  }
  return late_;
}

SharedRowExchange::Splits SharedRowExchange::Serve(const uint8_t* local, const uint8_t* values) {
  if (late_) {  // each rank's request: the indices in its slots, then those that came late
    const auto* late = reinterpret_cast<const int64_t*>(recv_.data.get());
    std::vector<int64_t> all;
    all.reserve(Sum(asked_));
    uint64_t early_at = 0, late_at = 0;
    for (int r = 0; r < world_; ++r) {
      all.insert(all.end(), requested_.begin() + early_at,
                 requested_.begin() + early_at + fits_[r]);
      all.insert(all.end(), late + late_at, late + late_at + (asked_[r] - fits_[r]));
      early_at += fits_[r];
      late_at += asked_[r] - fits_[r];
    }
    requested_ = std::move(all);
    late_ = false;
  }
  serve_.assign(world_, 0);
  write_.assign(world_, 0);
  back_.assign(world_, 0);
  own_.assign(world_, 0);
  for (int r = 0; r < world_; ++r) {
    (kinds_[r] == kScatter ? write_ : serve_)[r] = asked_[r];  // rows served or written here
    (kind_ == kScatter ? own_ : back_)[r] = counts_[r];  // rows written there or sent back here
  }
  const uint64_t first = rank_ == 0 ? 0 : ends_[rank_ - 1];
  const uint64_t rows = ends_[rank_] - first;
  // To each rank: the rows it gathers from this one, then this rank's writes to its rows.
  Splits splits;
  for (int r = 0; r < world_; ++r) {
    splits.send.push_back(serve_[r] + own_[r]);
    splits.recv.push_back(back_[r] + write_[r]);
  }
  uint8_t* send = send_.Size((Sum(serve_) + Sum(own_)) * row_bytes_);
  const std::vector<uint64_t> starts = Offsets(asked_);
  uint64_t own_at = 0;
  for (int r = 0; r < world_; ++r) {
    GatherRows(local, rows, row_bytes_, first, requested_.data() + starts[r], serve_[r], send);
    send += serve_[r] * row_bytes_;
    GatherRows(values, count_, row_bytes_, 0, order_.data() + own_at, own_[r], send);
    send += own_[r] * row_bytes_;
    own_at += own_[r];
  }
  recv_.Size((Sum(back_) + Sum(write_)) * row_bytes_);
  return splits;
}

void SharedRowExchange::Finish(uint8_t* local, uint8_t* out) {
  const uint64_t first = rank_ == 0 ? 0 : ends_[rank_ - 1];
  const uint64_t rows = ends_[rank_] - first;
  const uint8_t* got = recv_.data.get();
  const std::vector<uint64_t> starts = Offsets(asked_);
  uint64_t at = 0, order_at = 0;
  // From each rank: the rows this rank gathers from it, then the rows it writes here.
  for (int r = 0; r < world_; ++r) {
    if (back_[r] > 0) {  // out[order[i]] = the fetched rows: they come back grouped by owner
      ScatterRows(out, count_, row_bytes_, 0, order_.data() + order_at, back_[r], got + at);
    }
    at += back_[r] * row_bytes_;
    order_at += counts_[r];
    if (write_[r] > 0) {
      ScatterRows(local, rows, row_bytes_, first, requested_.data() + starts[r], write_[r],
                  got + at);
    }
    at += write_[r] * row_bytes_;
  }
  send_.Trim();
  recv_.Trim();
}

}  // namespace tensortier
