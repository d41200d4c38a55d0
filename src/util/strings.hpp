// String building for messages (GCC 12's libstdc++ has no <format>), and showing untrusted bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

// Length of the well-formed UTF-8 sequence starting at p[0] (RFC 3629: no overlongs, nothing above
// U+10FFFF, no surrogates unless `surrogates`), or 0 when none starts there. REQUIRES: avail > 0.
size_t Utf8Length(const unsigned char* p, size_t avail, bool surrogates = false);
// The code point of the well-formed sequence p[0, n) (n from Utf8Length).
uint32_t Utf8CodePoint(const unsigned char* p, size_t n);

// Whether code point `cp` acts on a terminal or on the line a reader sees instead of printing:
// C0 controls, DEL, C1 controls (U+0080 to U+009F), the Unicode line and paragraph separators and
// the bidirectional controls (which reorder what follows them: Trojan Source, CVE-2021-42574).
bool IsTerminalControl(uint32_t cp);

// Bytes that come from a file, a directory or a command line (tensor names, dtypes, zip entry
// names, paths, messages that embed them), rendered for a terminal or a log line: printable UTF-8
// passes unchanged ("模型.权重" stays readable); each terminal control (IsTerminalControl) and each
// byte that is not part of well-formed UTF-8 becomes a visible escape: \n \r \t, \xHH for the
// other C0 controls, DEL and bytes that are not UTF-8, \uHHHH for the others. A backslash is
// doubled, so the renderings of two different strings always differ.
std::string TerminalText(std::string_view bytes);

// `text` quoted as Python's repr() quotes a str ('a', "it's"), as the Python layer's messages
// name tensors and keys.
std::string PyRepr(std::string_view text);

// `dims` written as Python writes a tuple of ints: "()", "(7,)", "(2, 3)".
template <typename Int>
std::string PyTuple(const std::vector<Int>& dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) out += StrCat(i ? ", " : "", dims[i]);
  return out + (dims.size() == 1 ? ",)" : ")");
}

}  // namespace tensortier
