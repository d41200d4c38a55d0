#include "tensortier/process_identity.hpp"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>

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

}  // namespace tensortier
