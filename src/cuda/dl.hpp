// dlopen/dlsym with messages that say which library and which symbol, for the runtime-loaded
// libraries of this layer (libcuda, libcufile). Internal to src/cuda.
#pragma once

#include <dlfcn.h>

#include <string>

#include "tensortier/util/strings.hpp"

namespace tensortier::detail {

// dlopen(`library`, RTLD_NOW | RTLD_LOCAL). On failure returns null and sets *why to
// "<library> not found: <dlerror>" (no such file) or "<library> could not be loaded: <dlerror>"
// (e.g. not a shared library, wrong architecture). Handles are never closed: the vendor libraries
// must not be unloaded while any of their state (threads, contexts) may live.
void* DlOpen(const std::string& library, std::string* why);

// Resolves `name` into `out`. On failure leaves `out` alone, sets *why and returns false.
template <typename Fn>
bool DlSym(void* handle, const std::string& library, const char* name, Fn*& out, std::string* why) {
  dlerror();  // clear any earlier error
  void* p = dlsym(handle, name);
  if (p == nullptr) {
    const char* error = dlerror();
    *why = StrCat(library, " lacks ", name,
                  " (driver too old?): ", error != nullptr ? error : "symbol is null");
    return false;
  }
  out = reinterpret_cast<Fn*>(p);
  return true;
}

}  // namespace tensortier::detail
