#include "tensortier/shared/shared_group.hpp"

#include <sys/mman.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <exception>
#include <map>
#include <stdexcept>
#include <thread>

#include "tensortier/shared/partition_server.hpp"
#include "tensortier/shared/shared_tensor.hpp"
#include "tensortier/shared/tensor_memory.hpp"
#include "tensortier/shared/unix_socket.hpp"
#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

using shared::Clock;
using shared::UniqueFd;

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

// What attach reads from the store: the record the owners of `name` published (checked by
// SharedTensorRecord::Parse before anything is mapped).
SharedTensorRecord ReadRecord(Store& store, const std::string& name,
                              std::chrono::milliseconds timeout) {
  if (name.empty()) throw std::invalid_argument("attach needs the tensor's name");
  std::string value;
  try {
    value = store.Get(SharedTensorRecordKey(name), timeout);
  } catch (const IoError& e) {
    if (e.error_code() != ETIMEDOUT) throw;
    ThrowIoError(ETIMEDOUT,
                 StrCat("attach: wait ", timeout.count(),
                        " ms for a shared tensor of that name (no shared tensor named '", name,
                        "' appeared: create_tensor makes it, with the same store)"),
                 name);
  }
  return SharedTensorRecord::Parse(name, value);
}

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
  socket_name_ = shared::PartitionSocketName(token_, rank_);
  leave_key_ = StrCat("tensortier/shared/left/tensortier.", token_);
  server_ = std::make_shared<shared::PartitionServer>(socket_name_);
  Barrier("shared group start");
}

SharedGroup::~SharedGroup() {
  Close();
}

const std::string& SharedGroup::socket_name() const noexcept {
  return socket_name_;
}

uint64_t SharedGroup::refused_peers() const {
  std::shared_ptr<shared::PartitionServer> server;
  {
    std::lock_guard lock(members_mu_);
    server = server_;
  }
  return server ? server->refused() : 0;
}

std::shared_ptr<shared::PartitionServer> SharedGroup::Server(const std::string& what) const {
  std::lock_guard lock(members_mu_);
  if (!server_) throw std::logic_error(StrCat(what, ": the shared group was closed"));
  return server_;
}

void SharedGroup::Close() {
  std::vector<std::weak_ptr<SharedTensor>> tensors;
  std::shared_ptr<shared::PartitionServer> server;
  {
    std::lock_guard lock(members_mu_);
    tensors.swap(tensors_);
    server.swap(server_);
  }
  for (auto& weak : tensors) {
    if (auto t = weak.lock()) t->Close();
  }
}

void SharedGroup::CountOut() noexcept {
  try {
    store_->Add(leave_key_, 1);
  } catch (const std::exception&) {
    // The store is gone (its host died): nobody waits for this rank.
  }
}

void SharedGroup::MarkClosed() noexcept {
  try {
    store_->Add(StrCat(leave_key_, "/", rank_), 1);
  } catch (const std::exception&) {
    // The store is gone: nobody waits for this rank in a collective call any more.
  }
}

bool SharedGroup::WaitForOthersToLeave(Store& store, const std::string& leave_key, int world_size,
                                       std::chrono::milliseconds timeout) noexcept {
  const auto deadline = Clock::now() + timeout;
  try {
    for (;;) {
      if (store.Add(leave_key, 0) >= world_size - 1) return true;
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {
    return true;  // the store is gone: nobody is left to serve
  }
}

std::string SharedGroup::GetUnlessClosed(const std::string& what, const std::string& key, int r,
                                         Clock::time_point deadline) {
  for (;;) {
    const auto wait = std::min(Remaining(deadline), kClosedCheck);
    try {
      return store_->Get(key, wait);
    } catch (const IoError& e) {
      if (e.error_code() != ETIMEDOUT || Clock::now() >= deadline) throw;
    }
    if (store_->Add(StrCat(leave_key_, "/", r), 0) > 0) {
      // Rank r posts its entry before it can close: it may have made this call, and closed,
      // since the wait above gave up.
      try {
        return store_->Get(key, std::chrono::milliseconds(1));
      } catch (const IoError& e) {
        if (e.error_code() != ETIMEDOUT) throw;
      }
      ThrowIoError(ECONNABORTED,
                   StrCat(what, ": rank ", r, " of ", world_size_,
                          " closed its group (close(), finalize_lib() or its exit) without making "
                          "this call (every rank must make the same collective calls)"),
                   key);
    }
  }
}

void SharedGroup::RequireRank(const std::string& what) const {
  if (maker_.Forked()) {
    throw std::logic_error(StrCat(
        what, ": ",
        ForkedUseMessage("shared group", maker_.pid(),
                         "it is not one of the group's ranks (its parent is)",
                         "make the group's calls in the rank's own process; a worker reads and "
                         "writes the tensors through the views it inherited, or attaches one "
                         "with tensortier.shared.attach(name)")));
  }
}

std::vector<std::string> SharedGroup::AllGather(const std::string& what, const std::string& value,
                                                uint64_t* number) {
  Server(what);  // closed: refused
  RequireRank(what);
  const uint64_t n = next_collective_++;
  if (number != nullptr) *number = n;
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
      std::string entry = GetUnlessClosed(what, base + std::to_string(r), r, deadline);
      const size_t colon = std::min(entry.find(':'), entry.size());
      uint64_t length = 0;
      auto [end, ec] = std::from_chars(entry.data(), entry.data() + colon, length);
      if (colon == entry.size() || ec != std::errc() || end != entry.data() + colon ||
          length > entry.size() - colon - 1) {
        throw std::invalid_argument(
            StrCat(what, ": rank ", r, " left an entry of no call at ", base, r, " in the store"));
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
  // Every rank has made this call, so each has read the entries of the one before: this rank's
  // entry there is read by no one again. Removed, the store keeps one call's entries, not one
  // per call of the job. A store that cannot remove keys only keeps them (its error is not this
  // call's).
  if (n > 0 && deletes_keys_) {
    try {
      store_->Delete(StrCat(prefix_, "/c", n - 1, "/", rank_));
    } catch (const std::exception&) {
      deletes_keys_ = false;
    }
  }
  return all;
}

void SharedGroup::Remember(const std::shared_ptr<SharedTensor>& tensor) {
  // Tensors dropped since are forgotten: a job that makes and drops many keeps no trace of them.
  std::lock_guard lock(members_mu_);
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

uint64_t SharedGroup::Agree(const std::string& what, const std::string& value) {
  uint64_t number = 0;
  std::vector<std::string> all = AllGather(what, value, &number);
  std::string refused;  // the ranks that took part only to say they refused (Refuse)
  for (int r = 0; r < world_size_; ++r) {
    if (all[r].starts_with('!')) {
      refused += StrCat(refused.empty() ? "" : "; ", "rank ", r, ": ", all[r].substr(1));
    }
  }
  if (!refused.empty()) throw std::invalid_argument(StrCat(what, " was refused on ", refused));
  if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all[0]; })) {
    return number;
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

void SharedGroup::Refuse(const std::string& what, const std::string& why) {
  try {
    Agree(what, StrCat("!", why));
  } catch (const std::exception&) {
    // The caller raises its own error: it is why the others fail.
  }
}

std::shared_ptr<SharedTensor> SharedGroup::Create(const SharedTensorSpec& spec, int device) {
  try {
    spec.Validate();
    if (spec.layout == SharedLayout::kDistributed) {
      throw std::invalid_argument(
          "the distributed layout is not mapped: tensortier.shared builds it");
    }
  } catch (const std::exception& e) {
    Refuse("create_tensor", e.what());
    throw;
  }
  // Named by this call's number, not the count now: another thread's calls may have come since.
  const uint64_t agreed = Agree("create_tensor", spec.Describe());
  std::string key = spec.name.empty() ? StrCat("#", agreed + 1) : spec.name;
  auto tensor = spec.memory == SharedMemory::kDevice ? MapDevice(spec, key, device)
                                                     : Map(spec, key, true, device);
  if (!spec.name.empty() && rank_ == 0) {
    // Published after every rank serves its partition: whoever reads it can map them all.
    store_->Set(SharedTensorRecordKey(spec.name),
                SharedTensorRecord{token_, world_size_, spec}.Format());
  }
  return tensor;
}

std::shared_ptr<SharedTensor> SharedGroup::Attach(const std::string& name, int device) {
  Server("attach");       // closed: refused
  RequireRank("attach");  // the store's connection is the parent's
  SharedTensorRecord record = ReadRecord(*store_, name, timeout_);
  RefuseDeviceAttach(record.spec, name);
  std::shared_ptr<SharedTensor> tensor;
  if (record.token == token_ && record.world_size == world_size_) {
    tensor = Map(record.spec, name, false, device);
  } else {
    tensor = SharedTensor::Layout(record.spec, name, record.world_size, -1);
    tensor->FetchPartitions(record.token, -1, timeout_);
    tensor->RegisterWithCuda(device);
    Remember(tensor);
  }
  return tensor;
}

std::shared_ptr<SharedTensor> AttachSharedTensor(Store& store, const std::string& name,
                                                 std::chrono::milliseconds timeout) {
  SharedTensorRecord record = ReadRecord(store, name, timeout);
  RefuseDeviceAttach(record.spec, name);
  auto tensor = SharedTensor::Layout(record.spec, name, record.world_size, -1);
  tensor->FetchPartitions(record.token, -1, timeout);
  return tensor;
}

// Creates (when `own_partition`) and maps the partitions of `spec`; `key` names them on every
// rank's server. With own_partition, ends with two barriers: every rank serves before any
// fetches, and every rank has fetched before any may close.
std::shared_ptr<SharedTensor> SharedGroup::Map(const SharedTensorSpec& spec, const std::string& key,
                                               bool own_partition, int device) {
  const uint64_t page = SystemPageSize();
  const bool huge = IsHugeSharedTensor(spec, world_size_);
  const std::string shmem_policy = huge ? ShmemHugePolicy() : "";
  // With own_partition every step that can fail on one rank ends in Settle, as in MapDevice: the
  // others throw at once naming it, instead of waiting out the timeout for a rank that never
  // arrives (and blaming it for not arriving).
  std::shared_ptr<SharedTensor> tensor;
  std::exception_ptr failure;
  try {
    tensor = SharedTensor::Layout(spec, key, world_size_, rank_);
    if (own_partition) {
      std::shared_ptr<shared::PartitionServer> server = Server("create_tensor");
      server->Serve(key, tensor->CreateLocalPartition(huge, shmem_policy));
      tensor->server_ = std::move(server);
    }
  } catch (...) {
    if (!own_partition) throw;
    failure = std::current_exception();
  }
  if (own_partition) Settle(StrCat("create_tensor '", key, "' (serving)"), failure);

  try {
    tensor->FetchPartitions(token_, own_partition ? rank_ : -1, timeout_);
    if (huge && ShmemHugeOnAdvice(shmem_policy)) {
      for (int r = 0; r < world_size_; ++r) {
        if ((own_partition && r == rank_) || tensor->partitions_[r].bytes == 0) continue;
        // The owner's huge pages are mapped huge here only where this mapping asks for them
        // too; advice, so a refusal costs speed, not correctness.
        ::madvise(tensor->partitions_[r].address, AlignUp(tensor->partitions_[r].bytes, page),
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

}  // namespace tensortier
