// The backend probe: a verified round trip through an engine on a scratch file. Internal to io.
#pragma once

#include <string>

namespace tensortier::detail {

// A directory that cannot take a file (missing, not a directory, no permission, read-only
// filesystem) fails every backend's probe the same way: reported as that, with its errno,
// rather than as "no I/O backend works".
void RequireDirectoryTakesFiles(const std::string& dir);

}  // namespace tensortier::detail
