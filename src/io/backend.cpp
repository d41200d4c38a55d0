#include "tensortier/io/backend.hpp"

#include <stdexcept>

#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

// Defined in the backend_*.cpp files.
std::unique_ptr<Backend> MakeUringBackend(unsigned depth);
std::unique_ptr<Backend> MakeAioBackend(unsigned depth);
std::unique_ptr<Backend> MakeThreadPoolBackend(unsigned depth);
bool UringCompiledIn();
bool AioCompiledIn();

std::string_view BackendName(BackendKind kind) {
  return NameOf(kBackendKindNames, kind, "unknown");
}

BackendKind ParseBackendKind(std::string_view name) {
  if (const auto kind = ValueOf(kBackendKindNames, name)) return *kind;
  throw std::invalid_argument(
      StrCat("backend '", name, "' is not one of ", JoinNames(kBackendKindNames)));
}

bool BackendCompiledIn(BackendKind kind) {
  switch (kind) {
    case BackendKind::kIoUring:
      return UringCompiledIn();
    case BackendKind::kLibaio:
      return AioCompiledIn();
    case BackendKind::kThreads:
      return true;
  }
  return false;
}

std::unique_ptr<Backend> MakeBackend(BackendKind kind, unsigned depth) {
  switch (kind) {
    case BackendKind::kIoUring:
      return MakeUringBackend(depth);
    case BackendKind::kLibaio:
      return MakeAioBackend(depth);
    case BackendKind::kThreads:
      return MakeThreadPoolBackend(depth);
  }
  throw std::invalid_argument("unknown backend kind");
}

}  // namespace tensortier
