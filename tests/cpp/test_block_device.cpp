// Block queue limits from sysfs and the staging rule built on them: a fabricated sysfs tree for
// every shape the reader must handle, the real device of the test directory, and the rule's
// answers for the queues it was written for.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tensortier/io/block_device.hpp"
#include "tensortier/io/file.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::TempDir;
using testing::WriteText;

TEST(BlockQueueLimitsTest, ReadsADisksOwnQueue) {
  TempDir dir;
  WriteText(dir.File("vda/queue/max_segments"), "254\n");
  WriteText(dir.File("vda/queue/max_sectors_kb"), "4096\n");
  WriteText(dir.File("vda/queue/max_segment_size"), "4294967295\n");
  auto limits = ReadBlockQueueLimits(dir.File("vda"));
  ASSERT_TRUE(limits);
  EXPECT_EQ(limits->max_segment, 4294967295u);
  EXPECT_EQ(limits->max_segments, 254u);
  EXPECT_EQ(limits->max_request, 4096u * 1024);
  EXPECT_EQ(limits->queue_dir, dir.File("vda/queue"));
}

TEST(BlockQueueLimitsTest, APartitionUsesItsDisksQueue) {
  TempDir dir;
  WriteText(dir.File("nvme0n1/queue/max_segments"), "127");
  WriteText(dir.File("nvme0n1/queue/max_sectors_kb"), "512");
  WriteText(dir.File("nvme0n1/nvme0n1p1/partition"), "1");
  auto limits = ReadBlockQueueLimits(dir.File("nvme0n1/nvme0n1p1"));
  ASSERT_TRUE(limits);
  EXPECT_EQ(limits->max_segments, 127u);
  EXPECT_EQ(limits->max_request, 512u * 1024);
  EXPECT_EQ(limits->max_segment, 0u);  // not reported
  EXPECT_EQ(limits->queue_dir,
            (std::filesystem::canonical(dir.path()) / "nvme0n1" / "queue").string());
}

TEST(BlockQueueLimitsTest, MissingOrMalformedLimitsGiveNothing) {
  TempDir dir;
  EXPECT_FALSE(ReadBlockQueueLimits(dir.File("absent")));
  // A device without a queue that is not a partition does not borrow its parent's.
  WriteText(dir.File("queue/max_segments"), "254");
  WriteText(dir.File("queue/max_sectors_kb"), "4096");
  WriteText(dir.File("dm-0/dev"), "253:0");
  EXPECT_FALSE(ReadBlockQueueLimits(dir.File("dm-0")));
  WriteText(dir.File("only-segments/queue/max_segments"), "128");
  EXPECT_FALSE(ReadBlockQueueLimits(dir.File("only-segments")));
  for (const char* bad : {"", "abc", "12x", "-5", "0", "99999999999999999999999"}) {
    SCOPED_TRACE(bad);
    WriteText(dir.File("bad/queue/max_segments"), bad);
    WriteText(dir.File("bad/queue/max_sectors_kb"), "1024");
    EXPECT_FALSE(ReadBlockQueueLimits(dir.File("bad")));
  }
}

TEST(BlockQueueLimitsTest, HugeRequestLimitDoesNotOverflow) {
  TempDir dir;
  WriteText(dir.File("d/queue/max_segments"), "4294967296");  // more than 32 bits: clamped
  WriteText(dir.File("d/queue/max_sectors_kb"), "18446744073709551615");
  auto limits = ReadBlockQueueLimits(dir.File("d"));
  ASSERT_TRUE(limits);
  EXPECT_EQ(limits->max_segments, UINT32_MAX);
  EXPECT_EQ(limits->max_request, UINT64_MAX / 1024 * 1024);
}

TEST(BlockQueueLimitsTest, FilesOfTheTestDirectoryAndBadDescriptors) {
  EXPECT_FALSE(BlockQueueLimitsOf(-1));
  TempDir dir;
  { std::ofstream(dir.File("f")) << "x"; }
  // /proc has no block device.
  int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_FALSE(BlockQueueLimitsOf(fd));
  close(fd);
  File f = File::Open(dir.File("f"), OpenMode::kRead, /*direct=*/false);
  const auto& limits = f.block_queue_limits();
  if (!limits) GTEST_SKIP() << "the test directory has no block device (tmpfs, overlay?)";
  EXPECT_GT(limits->max_segments, 0u);
  EXPECT_GE(limits->max_request, 4096u);
  EXPECT_TRUE(std::filesystem::exists(limits->queue_dir + "/max_segments"));
  const auto again = BlockQueueLimitsOf(f.buffered_fd());
  ASSERT_TRUE(again);
  EXPECT_EQ(again->queue_dir, limits->queue_dir);
  EXPECT_EQ(again->max_segments, limits->max_segments);
}

TEST(ScatteredMemoryTest, TheRuleForTheQueuesItWasWrittenFor) {
  auto queue = [](uint32_t segments, uint64_t request_kb) {
    BlockQueueLimits q;
    q.max_segments = segments;
    q.max_request = request_kb * 1024;
    return q;
  };
  constexpr uint64_t kChunk = 4 << 20;
  // Our virtio disks: 254 pages make ~1 MiB, a quarter of the 4 MiB request.
  EXPECT_TRUE(ScatteredMemorySplitsRequests(queue(254, 4096), kChunk));
  EXPECT_TRUE(ScatteredMemorySplitsRequests(queue(128, 1280), kChunk));
  // NVMe whose request size binds first.
  EXPECT_FALSE(ScatteredMemorySplitsRequests(queue(33, 128), kChunk));
  EXPECT_FALSE(ScatteredMemorySplitsRequests(queue(127, 512), kChunk));
  // Segments enough for a megabyte and more.
  EXPECT_FALSE(ScatteredMemorySplitsRequests(queue(257, 4096), kChunk));
  EXPECT_FALSE(ScatteredMemorySplitsRequests(queue(2048, 32768), kChunk));
  // Segments of at most 4 KiB: contiguous memory makes no larger requests.
  BlockQueueLimits small_segments = queue(254, 4096);
  small_segments.max_segment = 4096;
  EXPECT_FALSE(ScatteredMemorySplitsRequests(small_segments, kChunk));
  small_segments.max_segment = 64 << 10;  // 254 x 64 KiB: large requests again
  EXPECT_TRUE(ScatteredMemorySplitsRequests(small_segments, kChunk));
  // The engine's own chunk caps what contiguous memory could gain.
  EXPECT_FALSE(ScatteredMemorySplitsRequests(queue(254, 4096), 1 << 20));
  EXPECT_TRUE(ScatteredMemorySplitsRequests(queue(64, 4096), 1 << 20));
}

}  // namespace
}  // namespace tensortier
