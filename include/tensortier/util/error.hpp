// Errors raised by tensortier. Every I/O failure names the operation, the path, the byte range and
// the errno, so a user can tell which file and which bytes went wrong without a debugger.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tensortier {

// A failed system call or I/O completion. Thread-compatible (immutable after construction).
class IoError : public std::runtime_error {
 public:
  IoError(int error_code, std::string_view op, std::string path, uint64_t offset, uint64_t length);

  int error_code() const noexcept { return error_code_; }
  const std::string& op() const noexcept { return op_; }
  const std::string& path() const noexcept { return path_; }
  uint64_t offset() const noexcept { return offset_; }
  uint64_t length() const noexcept { return length_; }
  // What failed, without the path ("pread failed at offset 0 length 4096: Input/output error"):
  // for callers that show the path apart, as Python's OSError shows its filename.
  std::string reason() const;

 private:
  int error_code_;
  std::string op_;
  std::string path_;
  uint64_t offset_;
  uint64_t length_;
};

// Throws IoError for `error_code` (an errno value, positive).
[[noreturn]] void ThrowIoError(int error_code, std::string_view op, const std::string& path,
                               uint64_t offset = 0, uint64_t length = 0);

// Throws std::system_error (generic category) for a failure that concerns no file (a ring's
// setup, a submission queue, memory, threads): Python gets OSError(errno, message) without a
// filename. The message names the call and what it was given.
[[noreturn]] void ThrowSystemError(int error_code, std::string_view what);

}  // namespace tensortier
