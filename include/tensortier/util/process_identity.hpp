// Naming a process so that the name stays unique after its pid is reused: files a process leaves
// behind (offloader backing files, temporary checkpoint files) carry its stamp (pid, start time,
// pid namespace), and are recognised as left over once no process with that stamp runs.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace tensortier {

// The process that made an object. A child made by fork() holds copies of its parent's objects
// but none of their threads, and must not end what the parent still uses (its sockets, files,
// groups): each such object asks here, the one rule for all of them.
class MakerProcess {
 public:
  MakerProcess() noexcept : pid_(getpid()) {}
  // Whether the caller runs in another process than the maker (a child made by fork()).
  bool Forked() const noexcept { return getpid() != pid_; }
  pid_t pid() const noexcept { return pid_; }

 private:
  pid_t pid_;
};

// The error of using `what` (made in process `maker`) in a child made by fork(): "this WHAT was
// made in process P; in process Q, a child made by fork(), MISSING: REMEDY".
std::string ForkedUseMessage(std::string_view what, pid_t maker, std::string_view missing,
                             std::string_view remedy);

// The start time of process `pid` in clock ticks since boot (field 22 of /proc/PID/stat), as
// text; "" when no such process runs or /proc cannot be read.
std::string ProcessStartTime(pid_t pid);

// 8 hex digits naming this machine's boot and this process's pid namespace: a pid and a start
// time name the same process only where this tag is the same (another machine sharing the
// directory, or another container, has pids of its own). "" when neither can be read.
std::string PidNamespaceTag();

// "PID-START-TAG": this process's pid, start time and PidNamespaceTag(), the stamp the files it
// leaves behind carry in their names. Not cached: a child made by fork() is another process, whose
// files must carry its own stamp to be recognised once it dies.
std::string ProcessStamp();

// Splits "PID-START-TAG-REST" into the stamp "PID-START-TAG" and REST; nullopt when `text` has
// fewer than three dashes.
std::optional<std::pair<std::string_view, std::string_view>> SplitProcessStamp(
    std::string_view text);

// The one rule for files of dead processes: whether `stamp`, as ProcessStamp() writes it, names a
// process that no longer runs. Only a stamp of this boot and pid namespace can (its TAG is
// PidNamespaceTag()): another machine's or container's pids and start times mean nothing here.
// False for text that is no stamp (a pid no process can have included: no process wrote it), for
// a process that runs, and where /proc cannot tell (this process's own start time is unreadable).
bool IsDeadProcessStamp(std::string_view stamp);

}  // namespace tensortier
