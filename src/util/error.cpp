#include "tensortier/util/error.hpp"

#include <cstring>
#include <system_error>

#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

std::string Describe(int error_code, std::string_view op, const std::string& path, uint64_t offset,
                     uint64_t length) {
  // Whole-file operations (open, rename, fsync...) have no byte range to name.
  std::string range =
      offset == 0 && length == 0 ? "" : StrCat(" at offset ", offset, " length ", length);
  return StrCat(op, " failed on '", path, "'", range, ": ", std::strerror(error_code), " (errno ",
                error_code, ")");
}

}  // namespace

IoError::IoError(int error_code, std::string_view op, std::string path, uint64_t offset,
                 uint64_t length)
    : std::runtime_error(Describe(error_code, op, path, offset, length)),
      error_code_(error_code),
      op_(op),
      path_(std::move(path)),
      offset_(offset),
      length_(length) {}

void ThrowIoError(int error_code, std::string_view op, const std::string& path, uint64_t offset,
                  uint64_t length) {
  throw IoError(error_code, op, path, offset, length);
}

[[noreturn]] void ThrowSystemError(int error_code, std::string_view what) {
  throw std::system_error(error_code, std::generic_category(), std::string(what));
}

}  // namespace tensortier
