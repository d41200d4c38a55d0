#include "tensortier/util/error.hpp"

#include <cstring>
#include <system_error>

#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// Whole-file operations (open, rename, fsync...) have no byte range to name.
std::string RangeOf(uint64_t offset, uint64_t length) {
  return offset == 0 && length == 0 ? "" : StrCat(" at offset ", offset, " length ", length);
}

std::string Describe(int error_code, std::string_view op, const std::string& path, uint64_t offset,
                     uint64_t length) {
  return StrCat(op, " failed on '", path, "'", RangeOf(offset, length), ": ",
                std::strerror(error_code), " (errno ", error_code, ")");
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

std::string IoError::reason() const {
  return StrCat(op_, " failed", RangeOf(offset_, length_), ": ", std::strerror(error_code_));
}

void ThrowIoError(int error_code, std::string_view op, const std::string& path, uint64_t offset,
                  uint64_t length) {
  throw IoError(error_code, op, path, offset, length);
}

[[noreturn]] void ThrowSystemError(int error_code, std::string_view what) {
  throw std::system_error(error_code, std::generic_category(), std::string(what));
}

}  // namespace tensortier
