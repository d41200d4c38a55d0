// Page-cache residency of whole files, and mapped file pages put in the page tables up front.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "tensortier/io/file.hpp"
#include "tensortier/io/page_cache.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::TempDir;

constexpr uint64_t kCachedFileSize = 1u << 20;

// A file of kCachedFileSize bytes, its pages in the page cache (as written) or dropped.
std::string MakeFile(const TempDir& dir, const std::string& name, bool cached) {
  const std::string path = dir.File(name);
  std::ofstream(path, std::ios::binary) << std::string(kCachedFileSize, 'x');
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  if (cached) {
    std::vector<char> data(kCachedFileSize);
    EXPECT_EQ(pread(fd, data.data(), kCachedFileSize, 0), static_cast<ssize_t>(kCachedFileSize));
  } else {
    EXPECT_EQ(fdatasync(fd), 0);  // clean pages only can be dropped
    EXPECT_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  }
  close(fd);
  return path;
}

TEST(PageCache, FilesResidencySumsWholeFiles) {
  TempDir dir;
  const std::string warm = MakeFile(dir, "warm", true);
  const std::string cold = MakeFile(dir, "cold", false);
  const Residency r = QueryFilesResidency({warm, cold, dir.File("missing")});
  EXPECT_EQ(r.checked_bytes, 2 * kCachedFileSize);  // the missing file counts as nothing cached
  if (QueryFilesResidency({cold}).resident_bytes != 0) GTEST_SKIP() << "the cache kept the file";
  EXPECT_EQ(r.resident_bytes, kCachedFileSize);
  EXPECT_EQ(QueryFilesResidency({warm}).resident_bytes, kCachedFileSize);
  EXPECT_EQ(QueryFilesResidency({}).checked_bytes, 0u);
}

TEST(PageCache, DropCacheDropsAFileJustWrittenToo) {
  TempDir dir;
  if (QueryFilesResidency({MakeFile(dir, "probe", false)}).resident_bytes != 0) {
    GTEST_SKIP() << "the cache keeps files here (tmpfs)";
  }
  const std::string path = dir.File("dirty");
  std::ofstream(path, std::ios::binary)
      << std::string(kCachedFileSize, 'x');  // dirty pages, unsynced
  File::Open(path, OpenMode::kRead, /*direct=*/false).DropCache();
  EXPECT_EQ(QueryFilesResidency({path}).resident_bytes, 0u);
}

TEST(PageCache, PopulateForReadingMapsEveryPage) {
  TempDir dir;
  const std::string path = MakeFile(dir, "data", false);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  void* map = mmap(nullptr, kCachedFileSize, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  ASSERT_NE(map, MAP_FAILED);
  const MemoryRange halves[] = {
      {map, kCachedFileSize / 2 + 1},
      {static_cast<char*>(map) + kCachedFileSize / 2, kCachedFileSize / 2}};
  PopulateForReading(halves, 4);
  // Read from the file where it was not cached; every page now mapped (mincore sees the pages
  // of the page cache, all of them there).
  EXPECT_EQ(ResidentMemoryBytes(map, kCachedFileSize), kCachedFileSize);
  EXPECT_EQ(static_cast<const char*>(map)[kCachedFileSize - 1], 'x');
  PopulateForReading({}, 4);  // nothing to do
  munmap(map, kCachedFileSize);
}

}  // namespace
}  // namespace tensortier
