// What the DCP data file's write (dcp_file.cpp) and the checkpoint's commit (dcp_commit.cpp)
// share: their errors name the rank and the file the user knows.
#pragma once

#include <string>

#include "tensortier/util/error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

// Runs `step`; an IoError from it is thrown again naming `who` and `path` where it named a
// temporary file (removed by then: the user knows the file by its final name).
template <class Step>
auto NamingWho(const std::string& who, const std::string& path, Step&& step) {
  try {
    return step();
  } catch (const IoError& e) {
    if (who.empty()) throw;
    const bool temporary = e.path().find(".tmp-") != std::string::npos;
    throw IoError(e.error_code(), StrCat(who, ": ", e.op()), temporary ? path : e.path(),
                  e.offset(), e.length());
  }
}

}  // namespace tensortier
