#include "tensortier/util/process_identity.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <system_error>

#include "tensortier/util/strings.hpp"

namespace tensortier {

std::string ProcessStartTime(pid_t pid) {
  if (pid <= 0) return "";
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!in || !std::getline(in, stat)) return "";
  // The command name (field 2) is in parentheses and may hold spaces: count fields after it.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 > stat.size()) return "";
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && (fields >> field); ++i) {
    if (i == 22) return field;
  }
  return "";
}

std::string PidNamespaceTag() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char ns[64] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  const std::string pid_ns = n > 0 ? std::string(ns, static_cast<size_t>(n)) : "";
  if (boot.empty() && pid_ns.empty()) return "";
  uint32_t hash = 2166136261u;  // FNV-1a: a stable tag, not a secret
  for (char c : boot + "/" + pid_ns) hash = (hash ^ static_cast<unsigned char>(c)) * 16777619u;
  char tag[9];
  std::snprintf(tag, sizeof(tag), "%08x", hash);
  return tag;
}

namespace {

bool IsDecimal(std::string_view s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
}

bool IsHex8(std::string_view s) {
  return s.size() == 8 && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

}  // namespace

std::string ForkedUseMessage(std::string_view what, pid_t maker, std::string_view missing,
                             std::string_view remedy) {
  return StrCat("this ", what, " was made in process ", maker, "; in process ", getpid(),
                ", a child made by fork(), ", missing, ": ", remedy);
}

std::string ProcessStamp() {
  const pid_t pid = getpid();
  return std::to_string(pid) + "-" + ProcessStartTime(pid) + "-" + PidNamespaceTag();
}

std::optional<std::pair<std::string_view, std::string_view>> SplitProcessStamp(
    std::string_view text) {
  size_t dash = std::string_view::npos;
  for (int i = 0; i < 3; ++i) {
    dash = text.find('-', dash == std::string_view::npos ? 0 : dash + 1);
    if (dash == std::string_view::npos) return std::nullopt;
  }
  return std::make_pair(text.substr(0, dash), text.substr(dash + 1));
}

bool IsDeadProcessStamp(std::string_view stamp) {
  const size_t dash1 = stamp.find('-');
  if (dash1 == std::string_view::npos) return false;
  const size_t dash2 = stamp.find('-', dash1 + 1);
  if (dash2 == std::string_view::npos) return false;
  const std::string_view pid_text = stamp.substr(0, dash1);
  const std::string_view start = stamp.substr(dash1 + 1, dash2 - dash1 - 1);
  const std::string_view tag = stamp.substr(dash2 + 1);
  if (!IsDecimal(pid_text) || !IsDecimal(start) || !IsHex8(tag)) return false;
  uint64_t pid = 0;
  const auto [end, ec] = std::from_chars(pid_text.data(), pid_text.data() + pid_text.size(), pid);
  if (ec != std::errc() || end != pid_text.data() + pid_text.size() || pid == 0 ||
      pid > static_cast<uint64_t>(std::numeric_limits<pid_t>::max())) {
    return false;
  }
  if (tag != PidNamespaceTag()) return false;
  // Without /proc no process can be told alive.
  if (ProcessStartTime(getpid()).empty()) return false;
  const std::string now = ProcessStartTime(static_cast<pid_t>(pid));
  // An unreadable /proc/PID (hidepid, another user's process) is no proof of death: only a pid
  // no process has is dead then.
  if (now.empty()) return kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH;
  return now != start;
}

}  // namespace tensortier
