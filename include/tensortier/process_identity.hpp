// Naming a process so that the name stays unique after its pid is reused: files a process leaves
// behind (offloader backing files, temporary checkpoint files) carry its pid and start time, and
// are recognised as left over once no process with both runs.
#pragma once

#include <sys/types.h>

#include <string>

namespace tensortier {

// The start time of process `pid` in clock ticks since boot (field 22 of /proc/PID/stat), as
// text; "" when no such process runs or /proc cannot be read.
std::string ProcessStartTime(pid_t pid);

// 8 hex digits naming this machine's boot and this process's pid namespace: a pid and a start
// time name the same process only where this tag is the same (another machine sharing the
// directory, or another container, has pids of its own). "" when neither can be read.
std::string PidNamespaceTag();

}  // namespace tensortier
