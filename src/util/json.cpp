#include "tensortier/util/json.hpp"

#include <stdexcept>

#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

void AppendCodePoint(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace

void JsonReader::Fail(std::string_view message) const {
  throw FormatError(StrCat(what_, ": at byte ", pos_, ": ", message));
}

void JsonReader::SkipSpace() {
  while (pos_ < text_.size()) {
    char c = text_[pos_];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    ++pos_;
  }
}

char JsonReader::Peek() {
  SkipSpace();
  return pos_ < text_.size() ? text_[pos_] : '\0';
}

void JsonReader::Expect(char c) {
  if (!Consume(c)) {
    if (pos_ >= text_.size()) Fail(StrCat("expected '", c, "', found the end of the text"));
    Fail(StrCat("expected '", c, "', found '", text_[pos_], "'"));
  }
}

bool JsonReader::Consume(char c) {
  if (Peek() != c || pos_ >= text_.size()) return false;
  ++pos_;
  return true;
}

bool JsonReader::ConsumeNull() {
  if (Peek() != 'n') return false;
  if (text_.substr(pos_, 4) != "null") Fail("invalid literal (expected null)");
  pos_ += 4;
  return true;
}

void JsonReader::SkipLiteral() {
  for (std::string_view word : {"true", "false", "null"}) {
    if (text_.substr(pos_, word.size()) == word) {
      pos_ += word.size();
      return;
    }
  }
  Fail("invalid literal (expected true, false or null)");
}

void JsonReader::SkipNumber() {
  auto digits = [&] {
    size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
    if (pos_ == start) Fail("expected a number");
    return pos_ - start;
  };
  if (pos_ < text_.size() && text_[pos_] == '-') ++pos_;
  size_t start = pos_;
  if (digits() > 1 && text_[start] == '0') Fail("number with a leading zero");
  if (pos_ < text_.size() && text_[pos_] == '.') {
    ++pos_;
    digits();
  }
  if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
    ++pos_;
    if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
    digits();
  }
}

void JsonReader::SkipMemberName() {
  if (Peek() != '"') Fail("expected a string key");
  ReadString();
  Expect(':');
}

void JsonReader::SkipValue() {
  std::string open;  // the containers entered, innermost last: '{' or '['
  for (;;) {
    const char c = Peek();
    if (c == '{' || c == '[') {
      if (open.size() == kMaxSkipDepth) Fail("values nested too deep");
      ++pos_;
      if (!Consume(c == '{' ? '}' : ']')) {  // not empty: its first member's value is next
        open += c;
        if (c == '{') SkipMemberName();
        continue;
      }
    } else if (c == '"') {
      ReadString();
    } else if (c == 't' || c == 'f' || c == 'n') {
      SkipLiteral();
    } else {
      SkipNumber();
    }
    // A whole value is behind: the next member of its container, or the container's end.
    for (;;) {
      if (open.empty()) return;
      if (Consume(',')) {
        if (open.back() == '{') SkipMemberName();
        break;
      }
      Expect(open.back() == '{' ? '}' : ']');
      open.pop_back();
    }
  }
}

void JsonReader::ExpectEnd() {
  SkipSpace();
  if (pos_ != text_.size()) Fail("unexpected text after the end of the JSON value");
}

namespace {

uint32_t ReadHex4(std::string_view text, size_t pos, bool& ok) {
  uint32_t v = 0;
  ok = pos + 4 <= text.size();
  for (size_t i = 0; ok && i < 4; ++i) {
    char c = text[pos + i];
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= static_cast<uint32_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v |= static_cast<uint32_t>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      v |= static_cast<uint32_t>(c - 'A' + 10);
    } else {
      ok = false;
    }
  }
  return v;
}

}  // namespace

void JsonReader::AppendEscape(std::string& out, JsonStrings strings) {
  // pos_ is on the character after the backslash.
  if (pos_ >= text_.size()) Fail("unterminated string");
  char c = text_[pos_++];
  switch (c) {
    case '"':
    case '\\':
    case '/':
      out += c;
      return;
    case 'b':
      out += '\b';
      return;
    case 'f':
      out += '\f';
      return;
    case 'n':
      out += '\n';
      return;
    case 'r':
      out += '\r';
      return;
    case 't':
      out += '\t';
      return;
    case 'u':
      break;
    default:
      --pos_;
      Fail(StrCat("invalid escape '\\", c, "' in string"));
  }
  bool ok;
  uint32_t cp = ReadHex4(text_, pos_, ok);
  if (!ok) Fail("invalid \\u escape (needs 4 hex digits)");
  pos_ += 4;
  if (strings == JsonStrings::kBytes && cp >= 0xDC80 && cp <= 0xDCFF) {
    out += static_cast<char>(cp - 0xDC00);  // a byte that is not UTF-8, as surrogateescape
    return;
  }
  if (cp >= 0xDC00 && cp <= 0xDFFF) Fail("lone low surrogate in \\u escape");
  if (cp >= 0xD800 && cp <= 0xDBFF) {
    uint32_t low = 0;
    if (pos_ + 2 <= text_.size() && text_[pos_] == '\\' && text_[pos_ + 1] == 'u') {
      low = ReadHex4(text_, pos_ + 2, ok);
    } else {
      ok = false;
    }
    if (!ok || low < 0xDC00 || low > 0xDFFF) Fail("lone high surrogate in \\u escape");
    pos_ += 6;
    cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
  }
  AppendCodePoint(out, cp);
}

std::string JsonReader::ReadString(JsonStrings strings) {
  SkipSpace();
  if (pos_ >= text_.size() || text_[pos_] != '"') Fail("expected a string");
  ++pos_;
  std::string out;
  for (;;) {
    if (pos_ >= text_.size()) Fail("unterminated string");
    auto c = static_cast<unsigned char>(text_[pos_]);
    if (c == '"') {
      ++pos_;
      return out;
    }
    if (c == '\\') {
      ++pos_;
      AppendEscape(out, strings);
    } else if (c < 0x20) {
      Fail("control character in string (must be escaped)");
    } else if (c < 0x80) {
      out += static_cast<char>(c);
      ++pos_;
    } else {
      size_t n = Utf8Length(reinterpret_cast<const unsigned char*>(text_.data()) + pos_,
                            text_.size() - pos_);
      if (n == 0) Fail("invalid UTF-8 in string");
      out.append(text_.substr(pos_, n));
      pos_ += n;
    }
  }
}

uint64_t JsonReader::ReadUint() {
  SkipSpace();
  size_t start = pos_;
  uint64_t v = 0;
  while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
    auto d = static_cast<uint64_t>(text_[pos_] - '0');
    if (v > (UINT64_MAX - d) / 10) Fail("integer does not fit in 64 bits");
    v = v * 10 + d;
    ++pos_;
  }
  if (pos_ == start) Fail("expected a non-negative integer");
  if (text_[start] == '0' && pos_ - start > 1) Fail("integer with a leading zero");
  if (pos_ < text_.size() && (text_[pos_] == '.' || text_[pos_] == 'e' || text_[pos_] == 'E')) {
    Fail("expected an integer, found a fraction or exponent");
  }
  return v;
}

bool IsUtf8(std::string_view s, bool surrogates) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8Length(p + i, s.size() - i, surrogates);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

namespace {

constexpr char kJsonHexDigits[] = "0123456789abcdef";

void AppendUnicodeEscape(std::string& out, uint32_t cp) {
  out += "\\u";
  for (int shift = 12; shift >= 0; shift -= 4) out += kJsonHexDigits[(cp >> shift) & 15];
}

std::string Quote(std::string_view s, JsonEscapes escapes, JsonStrings strings) {
  const bool terminal = escapes == JsonEscapes::kTerminalControls;
  std::string out;
  out.reserve(s.size() + 2);
  out += '"';
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
      size_t n = Utf8Length(p, s.size() - i);
      if (n == 0) {
        if (strings == JsonStrings::kUtf8) {
          throw std::invalid_argument(StrCat("string is not valid UTF-8 at byte ", i));
        }
        AppendUnicodeEscape(out, 0xDC00 + c);  // surrogateescape (JsonStrings::kBytes)
        ++i;
        continue;
      }
      if (const uint32_t cp = Utf8CodePoint(p, n); terminal && IsTerminalControl(cp)) {
        AppendUnicodeEscape(out, cp);
      } else {
        out.append(s.substr(i, n));
      }
      i += n;
      continue;
    }
    ++i;
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (terminal && c == 0x7F)) {
          out += "\\u00";
          out += kJsonHexDigits[c >> 4];
          out += kJsonHexDigits[c & 15];
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
  return out;
}

}  // namespace

std::string JsonQuote(std::string_view s, JsonEscapes escapes) {
  return Quote(s, escapes, JsonStrings::kUtf8);
}

std::string JsonQuoteBytes(std::string_view bytes, JsonEscapes escapes) {
  return Quote(bytes, escapes, JsonStrings::kBytes);
}

std::map<std::string, std::string> ParseJsonStringMap(std::string_view text,
                                                      const std::string& what) {
  JsonReader r(text, what);
  std::map<std::string, std::string> out;
  r.Expect('{');
  if (!r.Consume('}')) {
    do {
      std::string key = r.ReadString();
      r.Expect(':');
      if (r.Peek() != '"') r.Fail(StrCat("value of '", key, "' is not a string"));
      std::string value = r.ReadString();
      if (!out.emplace(std::move(key), std::move(value)).second) {
        r.Fail("duplicate key");
      }
    } while (r.Consume(','));
    r.Expect('}');
  }
  r.ExpectEnd();
  return out;
}

}  // namespace tensortier
