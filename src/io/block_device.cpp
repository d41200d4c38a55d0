#include "tensortier/io/block_device.hpp"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr uint64_t kSmallPage = 4096;

std::optional<uint64_t> ReadNumber(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) return std::nullopt;
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<BlockQueueLimits> ReadQueue(const std::string& queue_dir) {
  const auto segments = ReadNumber(queue_dir + "/max_segments");
  const auto sectors_kb = ReadNumber(queue_dir + "/max_sectors_kb");
  if (!segments || !sectors_kb || *segments == 0 || *sectors_kb == 0) return std::nullopt;
  BlockQueueLimits limits;
  limits.queue_dir = queue_dir;
  limits.max_segments = static_cast<uint32_t>(std::min<uint64_t>(*segments, UINT32_MAX));
  limits.max_request = std::min<uint64_t>(*sectors_kb, UINT64_MAX / 1024) * 1024;
  limits.max_segment = ReadNumber(queue_dir + "/max_segment_size").value_or(0);
  return limits;
}

}  // namespace

std::optional<BlockQueueLimits> ReadBlockQueueLimits(const std::string& device_dir) {
  if (auto own = ReadQueue(device_dir + "/queue")) return own;
  std::error_code ec;
  if (!std::filesystem::exists(device_dir + "/partition", ec)) return std::nullopt;
  // A partition: its disk's queue, one level up (named without "..", for messages).
  const auto disk = std::filesystem::weakly_canonical(device_dir + "/..", ec);
  if (ec) return std::nullopt;
  return ReadQueue((disk / "queue").string());
}

std::optional<BlockQueueLimits> BlockQueueLimitsOf(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || major(st.st_dev) == 0) return std::nullopt;  // 0: no block device
  return ReadBlockQueueLimits(StrCat("/sys/dev/block/", major(st.st_dev), ":", minor(st.st_dev)));
}

bool ScatteredMemorySplitsRequests(const BlockQueueLimits& limits, uint64_t chunk) {
  const uint64_t segments = limits.max_segments;
  const uint64_t scattered = segments * kSmallPage;
  uint64_t contiguous = std::min(limits.max_request, chunk);
  if (limits.max_segment != 0 && limits.max_segment < UINT64_MAX / segments) {
    contiguous = std::min(contiguous, segments * limits.max_segment);
  }
  return scattered < (1u << 20) && scattered * 2 <= contiguous;
}

}  // namespace tensortier
