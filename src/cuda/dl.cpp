#include "tensortier/cuda/dl.hpp"

#include <sys/stat.h>

#include <cerrno>

namespace tensortier::detail {

void* DlOpen(const std::string& library, std::string* why) {
  dlerror();
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle != nullptr) return handle;
  const char* error = dlerror();
  const std::string detail = error != nullptr ? error : "unknown dlopen error";
  // A name without '/' is searched for by the loader, which says "No such file" when it finds
  // none; a path is checked directly, so a file that exists but is no library is told apart.
  bool missing = detail.find("No such file") != std::string::npos;
  if (library.find('/') != std::string::npos) {
    struct stat st {};
    missing = stat(library.c_str(), &st) != 0 && errno == ENOENT;
  }
  *why = StrCat(library, missing ? " not found: " : " could not be loaded: ", detail);
  return nullptr;
}

}  // namespace tensortier::detail
