// The engine's planner: splits the pieces of an operation into the tasks its workers run, and
// fills the operation's statistics. Internal to the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "tensortier/io/engine_task.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/io/engine.hpp"

namespace tensortier::detail {

// Splits [offset, offset+length) of one piece into tasks and fills the plan's statistics.
class Planner {
 public:
  Planner(const EngineOptions& options, const SubmitOptions& submit,
          const std::shared_ptr<Operation>& op, std::vector<std::unique_ptr<Task>>& tasks);

  void Plan(uint32_t index);

 private:
  void Buffered(uint32_t index, uint64_t offset, uint64_t length, std::byte* user);

  // REQUIRES: offset and length aligned to the file's O_DIRECT offset alignment.
  void Direct(uint32_t index, uint64_t offset, uint64_t length, std::byte* user);

  // A batch of many small reads (random reads, many tensors of one file) would pay two system
  // calls per piece for residency; one cachestat per file per batch settles the common cold case.
  // It covers only the span the batch reads: its cost grows with the cached pages it walks
  // (~13 ms for a warm 2 GiB file), and a load reading a large file in 30 batches paid a
  // whole-file walk in each. (mincore would map the range: only per-piece queries there.)
  bool MayHaveCachedPages(const File& file);

  // Whether this operation's direct reads of `file` go through bounce buffers (see ReadStaging).
  bool Stages(const File& file) const { return stage_reads_ && StagesReads(options_, file); }

  // Whether a staged chunk goes through a bounce buffer, given its destination. With copy
  // threads always: the workers only read, into huge pages. Without them, under kAuto only where
  // most of the destination is faulted in already: into memory never touched (the tensors of a
  // load in a new process) the copy out would fault each small page on a worker thread, which
  // then neither reaps nor submits; a direct read faults them in the kernel, without the copy.
  bool StagesInto(const std::byte* user, uint64_t length) const;

  // The file's size when the batch is planned, one fstat per file (not per piece).
  uint64_t SizeOf(const File& file);

  const EngineOptions& options_;
  const bool stage_reads_;  // the operation allows staging and the options do not forbid it
  const std::shared_ptr<Operation>& op_;
  std::vector<std::unique_ptr<Task>>& tasks_;
  IoStats& stats_;
  std::unordered_map<int, bool> file_may_be_cached_;  // buffered fd -> any page cached
  std::unordered_map<int, uint64_t> file_size_;       // buffered fd -> size at planning
};

}  // namespace tensortier::detail
