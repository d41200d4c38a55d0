// Errors in the content of a file (a checkpoint header, a zip directory, a pickle): the bytes were
// read fine but do not describe a valid file. Derives from std::invalid_argument so the Python
// binding raises ValueError, as it does for every other bad input.
#pragma once

#include <stdexcept>
#include <string>

namespace tensortier {

// The message names the file (when known), the item (tensor, entry) and what is wrong with it.
class FormatError : public std::invalid_argument {
 public:
  explicit FormatError(const std::string& message) : std::invalid_argument(message) {}
};

// A well-formed file of a format (or version of one) that is not read here, such as a legacy
// torch.save file: not damage, so Python sees a plain ValueError, not a damaged-file error.
class UnsupportedFormatError : public FormatError {
 public:
  using FormatError::FormatError;
};

}  // namespace tensortier
