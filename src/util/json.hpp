// A small strict JSON tokenizer for file headers we parse (safetensors) and the JSON strings we
// keep in their metadata. Strict RFC 8259: UTF-8 checked, no control characters or lone surrogates
// in strings, no trailing commas, no comments. Callers drive it by the shape they expect, so
// nothing recurses and nothing is built for values a caller does not want.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace tensortier {

// What a JSON string may hold. kUtf8: text (RFC 8259; a lone surrogate escape is an error).
// kBytes: a file name, which on Linux is any bytes: each byte that is not part of well-formed
// UTF-8 is the escape \udcXX of a lone low surrogate U+DC80..U+DCFF (byte 0x80..0xFF), the
// "surrogateescape" of PEP 383. Python's json.dumps(os.fsdecode(name)) writes exactly this, and
// os.fsencode(json.loads(text)) restores the bytes. Unambiguous: well-formed UTF-8 never holds a
// surrogate, so a name's UTF-8 characters stay themselves and only its other bytes are escaped.
enum class JsonStrings { kUtf8, kBytes };

class JsonReader {
 public:
  // `what` prefixes every error message ("safetensors header").
  JsonReader(std::string_view text, std::string what) : text_(text), what_(std::move(what)) {}

  void SkipSpace();
  // The next non-space character without consuming it; '\0' at the end of the text.
  char Peek();
  // Consumes `c` (after spaces) or throws "expected `c`".
  void Expect(char c);
  // Consumes `c` if it is next (after spaces).
  bool Consume(char c);
  // Consumes the literal `null` if it is next.
  bool ConsumeNull();
  // kBytes also takes a lone \udc80..\udcff escape, as the byte 0x80..0xff (JsonStrings).
  std::string ReadString(JsonStrings strings = JsonStrings::kUtf8);
  // A non-negative integer without sign, fraction or exponent, fitting in 64 bits.
  uint64_t ReadUint();
  // Checks and passes over one value of any kind (containers nested at most kMaxSkipDepth deep,
  // without recursion).
  void SkipValue();
  static constexpr size_t kMaxSkipDepth = 64;
  // Throws unless only spaces remain.
  void ExpectEnd();
  size_t position() const { return pos_; }

  // Throws FormatError "<what>: at byte <position>: <message>".
  [[noreturn]] void Fail(std::string_view message) const;

 private:
  void AppendEscape(std::string& out, JsonStrings strings);
  void SkipNumber();
  void SkipLiteral();
  // Reads `"key":` of an object member.
  void SkipMemberName();
  void AppendUtf8(std::string& out);

  std::string_view text_;
  std::string what_;
  size_t pos_ = 0;
};

// Whether `s` is well-formed UTF-8 (RFC 3629: no overlongs, nothing above U+10FFFF; no surrogates
// unless `surrogates`, as Python's "surrogatepass" decoding of pickled strings allows).
bool IsUtf8(std::string_view s, bool surrogates = false);

// Which characters JsonQuote writes as escapes. kRequired: those JSON requires (", \\ and C0
// controls; what file formats are written with). kTerminalControls: also DEL, C1 controls and the
// other characters that act on a terminal (IsTerminalControl), for JSON printed where a person
// may read it; the string decoded is the same.
enum class JsonEscapes { kRequired, kTerminalControls };

// `s` as a JSON string literal, quotes included. Throws std::invalid_argument if `s` is not UTF-8.
std::string JsonQuote(std::string_view s, JsonEscapes escapes = JsonEscapes::kRequired);
// `bytes` (a file name) as a JSON string literal: like JsonQuote, and each byte that is not part
// of well-formed UTF-8 written \udcXX (JsonStrings::kBytes). Never throws.
std::string JsonQuoteBytes(std::string_view bytes, JsonEscapes escapes = JsonEscapes::kRequired);

// Parses a JSON object whose values are all strings ({"a": "x", ...}); duplicate keys are an
// error. Throws FormatError prefixed with `what`.
std::map<std::string, std::string> ParseJsonStringMap(std::string_view text,
                                                      const std::string& what);

}  // namespace tensortier
