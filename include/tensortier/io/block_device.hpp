// What the block layer does with a file's direct requests, from the queue limits in sysfs.
//
// A direct read into memory of scattered small pages becomes a request with one segment per
// page, so a device that takes few segments per request gets it cut into small requests, while
// the same read into physically contiguous memory (huge pages) goes out in large ones. On the
// virtio disks of our machines (254 segments, 4 MiB requests) a cold 2 GiB read runs ~1.4 GB/s
// into fresh small pages and ~2.9 GB/s into huge pages (BENCHMARKS.md): there, staging reads
// through the engine's huge-page buffers and copying out is the faster way.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace tensortier {

struct BlockQueueLimits {
  std::string queue_dir;      // the sysfs "queue" folder the limits came from
  uint32_t max_segments = 0;  // queue/max_segments
  uint64_t max_request = 0;   // queue/max_sectors_kb, in bytes
  uint64_t max_segment = 0;   // queue/max_segment_size (0: not reported, no limit)
};

// The limits of the queue at `device_dir` (a /sys/dev/block/MAJ:MIN folder: its own queue/, or
// its disk's for a partition, one with a `partition` file). Nothing when there is none or it
// cannot be read. Never throws.
std::optional<BlockQueueLimits> ReadBlockQueueLimits(const std::string& device_dir);

// The limits of the block device holding the file open at `fd`. Nothing for files on
// filesystems without one (tmpfs, overlay, network filesystems). Never throws.
std::optional<BlockQueueLimits> BlockQueueLimitsOf(int fd);

// Whether requests into scattered small pages are capped well below what contiguous memory
// gets: max_segments pages of 4 KiB each make under 1 MiB and at most half of the largest
// request contiguous memory could make (max_sectors_kb, max_segments x max_segment_size,
// and `chunk`, the engine's largest request). Queues whose request size limit binds first
// (NVMe with 33 segments and 128 KiB, or 127 and 512 KiB) are not; one with 128 segments and
// 1280 KiB requests is. A heuristic: TENSORTIER_STAGE_READS=on/off overrides it.
bool ScatteredMemorySplitsRequests(const BlockQueueLimits& limits, uint64_t chunk);

}  // namespace tensortier
