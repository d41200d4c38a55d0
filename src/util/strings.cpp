#include "tensortier/util/strings.hpp"

#include <cstdint>

namespace tensortier {
namespace {

constexpr char kHex[] = "0123456789abcdef";

}  // namespace

uint32_t Utf8CodePoint(const unsigned char* p, size_t n) {
  if (n == 1) return p[0];
  uint32_t cp = p[0] & (0x7F >> n);
  for (size_t i = 1; i < n; ++i) cp = (cp << 6) | (p[i] & 0x3F);
  return cp;
}

bool IsTerminalControl(uint32_t cp) {
  return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F) || cp == 0x061C || cp == 0x200E || cp == 0x200F ||
         (cp >= 0x2028 && cp <= 0x202E) || (cp >= 0x2066 && cp <= 0x2069);
}

size_t Utf8Length(const unsigned char* p, size_t avail, bool surrogates) {
  unsigned char c = p[0];
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED && !surrogates) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (avail < n || p[1] < lo || p[1] > hi) return 0;
  for (size_t i = 2; i < n; ++i) {
    if (p[i] < 0x80 || p[i] > 0xBF) return 0;
  }
  return n;
}

std::string TerminalText(std::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::string out;
  out.reserve(bytes.size());
  auto byte_escape = [&out](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  for (size_t i = 0; i < bytes.size();) {
    const unsigned char c = p[i];
    if (c >= 0x20 && c < 0x7F) {
      out += c == '\\' ? "\\\\" : std::string_view(bytes.data() + i, 1);
      ++i;
    } else if (c == '\n') {
      out += "\\n";
      ++i;
    } else if (c == '\r') {
      out += "\\r";
      ++i;
    } else if (c == '\t') {
      out += "\\t";
      ++i;
    } else if (c < 0x80) {  // the other C0 controls, NUL included, and DEL
      byte_escape(c);
      ++i;
    } else if (const size_t n = Utf8Length(p + i, bytes.size() - i); n == 0) {
      byte_escape(c);  // one byte at a time: what follows a bad byte may be good text
      ++i;
    } else {
      const uint32_t cp = Utf8CodePoint(p + i, n);
      if (IsTerminalControl(cp)) {
        out += "\\u";
        for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(cp >> shift) & 15];
      } else {
        out.append(bytes.data() + i, n);
      }
      i += n;
    }
  }
  return out;
}

std::string PyRepr(std::string_view text) {
  const bool single = text.find('\'') != std::string_view::npos;
  const char q = single && text.find('"') == std::string_view::npos ? '"' : '\'';
  std::string out(1, q);
  for (char c : text) {
    if (c == '\\' || c == q) out += '\\';
    out += c;
  }
  out += q;
  return out;
}

}  // namespace tensortier
