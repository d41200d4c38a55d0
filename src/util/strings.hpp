// String building for messages (GCC 12's libstdc++ has no <format>).
#pragma once

#include <sstream>
#include <string>
#include <utility>

namespace tensortier {

// Concatenates anything an ostream can print: StrCat("offset ", 42, " of '", path, "'").
template <typename... Parts>
std::string StrCat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}

// `value` with exactly `decimals` digits after the point: Fixed(2.34567, 2) == "2.35".
inline std::string Fixed(double value, int decimals) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(decimals);
  out << value;
  return out.str();
}

}  // namespace tensortier
