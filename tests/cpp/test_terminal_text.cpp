// TerminalText: untrusted bytes (names from files, paths) rendered for a terminal or a log line;
// JsonQuote's escapes for JSON printed to a terminal.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

std::string Bytes(std::initializer_list<unsigned> values) {
  std::string s;
  for (unsigned v : values) s += static_cast<char>(v);
  return s;
}

std::string HexEscape(unsigned c) {
  static constexpr char kHex[] = "0123456789abcdef";
  return std::string("\\x") + kHex[c >> 4] + kHex[c & 15];
}

// What a terminal could act on: C0 controls, DEL and C1 controls (also as raw bytes 0x80-0x9f,
// which some terminals take as C1 in 8-bit mode; none of them is in valid UTF-8 output except as
// continuation bytes, which IsUtf8 checks separately).
bool HasControlCodePoint(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8Length(p + i, s.size() - i);
    if (n == 0) return true;
    if (p[i] < 0x20 || p[i] == 0x7f) return true;
    if (n == 2 && p[i] == 0xc2 && p[i + 1] < 0xa0) return true;  // U+0080..U+009F
    i += n;
  }
  return false;
}

TEST(TerminalTextTest, PrintableAsciiPassesUnchanged) {
  std::string all;
  for (int c = 0x20; c < 0x7f; ++c) {
    if (c != '\\') all += static_cast<char>(c);
  }
  EXPECT_EQ(TerminalText(all), all);
  EXPECT_EQ(TerminalText(""), "");
  EXPECT_EQ(TerminalText("model.layers.0.weight"), "model.layers.0.weight");
}

TEST(TerminalTextTest, MultibyteUtf8PassesUnchanged) {
  for (const std::string s : {"模型.权重", "caf\u00e9", "\u00a0nbsp", "emoji \U0001F600", "\uffff",
                              "\U0010FFFF", "Ω≈ç√∫"}) {
    EXPECT_EQ(TerminalText(s), s) << s;
  }
}

TEST(TerminalTextTest, EveryC0ControlAndDelBecomesAnEscape) {
  for (unsigned c = 0; c < 0x20; ++c) {
    std::string want = HexEscape(c);
    if (c == '\n') want = "\\n";
    if (c == '\r') want = "\\r";
    if (c == '\t') want = "\\t";
    EXPECT_EQ(TerminalText(Bytes({'a', c, 'b'})), "a" + want + "b") << c;
  }
  EXPECT_EQ(TerminalText("\x7f"), "\\x7f");
}

TEST(TerminalTextTest, EmbeddedNulIsShown) {
  EXPECT_EQ(TerminalText(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(TerminalText(std::string(2, '\0')), "\\x00\\x00");
}

TEST(TerminalTextTest, TerminalEscapeSequencesAreDisarmed) {
  // OSC 52 (writes the clipboard), CSI (clears the screen), a title change, a forged line.
  EXPECT_EQ(TerminalText("w\x1b]52;c;aGk=\x07"), "w\\x1b]52;c;aGk=\\x07");
  EXPECT_EQ(TerminalText("\x1b[2J\x1b[H"), "\\x1b[2J\\x1b[H");
  EXPECT_EQ(TerminalText("x\x1b]0;title\x1b\\"), "x\\x1b]0;title\\x1b\\\\");
  EXPECT_EQ(TerminalText("a\ntensortier: data OK\r"), "a\\ntensortier: data OK\\r");
  EXPECT_EQ(TerminalText("abc\b\b\bxyz"), "abc\\x08\\x08\\x08xyz");
}

TEST(TerminalTextTest, EveryC1ControlBecomesACodePointEscape) {
  static constexpr char kHex[] = "0123456789abcdef";
  for (unsigned cp = 0x80; cp <= 0x9f; ++cp) {
    const std::string utf8 = Bytes({0xc0u | (cp >> 6), 0x80u | (cp & 0x3f)});
    const std::string want = std::string("\\u00") + kHex[cp >> 4] + kHex[cp & 15];
    EXPECT_EQ(TerminalText(utf8), want) << cp;
    // The same value as a raw byte (a C1 control to an 8-bit terminal) is not UTF-8.
    EXPECT_EQ(TerminalText(Bytes({cp})), HexEscape(cp)) << cp;
  }
  EXPECT_EQ(TerminalText("\u00a0"), "\u00a0");  // the first character after C1 is printable
}

TEST(TerminalTextTest, LineSeparatorsAndBidiControlsBecomeEscapes) {
  EXPECT_EQ(TerminalText("a\u2028b\u2029c"), "a\\u2028b\\u2029c");
  EXPECT_EQ(TerminalText("x\u202egpj.exe"), "x\\u202egpj.exe");
  for (const char* s : {"\u061c", "\u200e", "\u200f", "\u202a", "\u202b", "\u202c", "\u202d",
                        "\u2066", "\u2067", "\u2068", "\u2069"}) {
    const std::string out = TerminalText(s);
    EXPECT_TRUE(out.starts_with("\\u")) << out;
    EXPECT_EQ(out.size(), 6u) << out;
  }
  EXPECT_EQ(TerminalText("\u2027\u202f\u2065"), "\u2027\u202f\u2065");  // their neighbours pass
}

TEST(TerminalTextTest, OverlongEncodingsAreShownByteByByte) {
  EXPECT_EQ(TerminalText(Bytes({0xc0, 0x80})), "\\xc0\\x80");  // NUL, overlong
  EXPECT_EQ(TerminalText(Bytes({0xc1, 0xbf})), "\\xc1\\xbf");
  EXPECT_EQ(TerminalText(Bytes({0xc0, 0x9b})), "\\xc0\\x9b");  // ESC, overlong
  EXPECT_EQ(TerminalText(Bytes({0xe0, 0x80, 0x8a})), "\\xe0\\x80\\x8a");
  EXPECT_EQ(TerminalText(Bytes({0xf0, 0x80, 0x80, 0x8a})), "\\xf0\\x80\\x80\\x8a");
}

TEST(TerminalTextTest, InvalidBytesAreShownByteByByte) {
  for (unsigned c = 0xf5; c <= 0xff; ++c) EXPECT_EQ(TerminalText(Bytes({c})), HexEscape(c)) << c;
  EXPECT_EQ(TerminalText(Bytes({0xed, 0xa0, 0x80})), "\\xed\\xa0\\x80");             // a surrogate
  EXPECT_EQ(TerminalText(Bytes({0xf4, 0x90, 0x80, 0x80})), "\\xf4\\x90\\x80\\x80");  // > U+10FFFF
  EXPECT_EQ(TerminalText("na\xefve"), "na\\xefve");  // Latin-1, not UTF-8
}

TEST(TerminalTextTest, LoneContinuationBytesAreShown) {
  EXPECT_EQ(TerminalText(Bytes({0x80})), "\\x80");
  EXPECT_EQ(TerminalText(Bytes({'a', 0xbf, 'b'})), "a\\xbfb");
  // A valid sequence followed by one continuation byte too many.
  EXPECT_EQ(TerminalText(Bytes({0xc3, 0xa9, 0xa9})), "\u00e9\\xa9");
}

TEST(TerminalTextTest, TruncatedSequencesAreShownAndTheTextAfterThemKept) {
  EXPECT_EQ(TerminalText(Bytes({'a', 0xe6, 0xa8})), "a\\xe6\\xa8");  // 模 without its last byte
  EXPECT_EQ(TerminalText(Bytes({0xf0, 0x9f, 0x98})), "\\xf0\\x9f\\x98");
  EXPECT_EQ(TerminalText(Bytes({0xc3})), "\\xc3");
  // A truncated sequence in the middle: the good character after it is kept whole.
  EXPECT_EQ(TerminalText(Bytes({0xe6, 'x', 0xc3, 0xa9})), "\\xe6x\u00e9");
}

TEST(TerminalTextTest, BackslashIsDoubledSoRenderingsStayDistinct) {
  EXPECT_EQ(TerminalText("a\\b"), "a\\\\b");
  EXPECT_EQ(TerminalText("\\x1b"), "\\\\x1b");
  EXPECT_NE(TerminalText("\\x1b"), TerminalText("\x1b"));
  EXPECT_NE(TerminalText("\\n"), TerminalText("\n"));
  EXPECT_NE(TerminalText("\\u0085"), TerminalText("\u0085"));
  EXPECT_NE(TerminalText("\\xc3"), TerminalText(Bytes({0xc3})));
}

// Over random byte strings drawn from the characters that matter: the rendering is valid UTF-8
// without control characters, and two different strings never render the same.
TEST(TerminalTextTest, RandomBytesRenderAsDistinctControlFreeUtf8) {
  const std::vector<std::string> pieces = {"a",
                                           "x",
                                           "u",
                                           "0",
                                           "1",
                                           "b",
                                           "\\",
                                           "\n",
                                           "\x1b",
                                           "\x7f",
                                           "\x00",
                                           "\x80",
                                           "\x9b",
                                           "\xc2",
                                           "\xc3\xa9",
                                           "\xe6\xa8",
                                           "\xe6\xa8\xa1",
                                           "\u0085",
                                           "\u202e",
                                           "\xed\xa0\x80",
                                           "\xf0\x9f\x98\x80",
                                           "\xff"};
  std::mt19937 rng(12345);
  std::set<std::string> inputs;
  std::set<std::string> outputs;
  for (int i = 0; i < 20000; ++i) {
    std::string s;
    const int n = static_cast<int>(rng() % 6);
    for (int k = 0; k < n; ++k) {
      const std::string& piece = pieces[rng() % pieces.size()];
      s += piece.empty() ? std::string(1, '\0') : piece;
    }
    if (!inputs.insert(s).second) continue;
    const std::string out = TerminalText(s);
    ASSERT_TRUE(IsUtf8(out)) << out;
    ASSERT_FALSE(HasControlCodePoint(out)) << out;
    ASSERT_TRUE(outputs.insert(out).second) << "two inputs render as " << out;
  }
}

TEST(TerminalTextTest, JsonForFilesEscapesWhatJsonRequires) {
  for (unsigned c = 0; c < 0x20; ++c) {
    const std::string quoted = JsonQuote(Bytes({c}));
    EXPECT_TRUE(quoted.starts_with("\"\\")) << c;
    EXPECT_EQ(ParseJsonStringMap("{\"k\":" + quoted + "}", "test").at("k"), Bytes({c})) << c;
  }
  // What file headers hold is unchanged: DEL, C1 and separators are JSON text as they are.
  EXPECT_EQ(JsonQuote("\x7f\u0085\u202e"), "\"\x7f\u0085\u202e\"");
  EXPECT_THROW(JsonQuote(Bytes({0xff})), std::invalid_argument);
}

TEST(TerminalTextTest, JsonForATerminalEscapesEveryTerminalControl) {
  const auto quote = [](std::string_view s) {
    return JsonQuote(s, JsonEscapes::kTerminalControls);
  };
  EXPECT_EQ(quote("a\x1b]52;c;eA==\x07\n"), "\"a\\u001b]52;c;eA==\\u0007\\n\"");
  EXPECT_EQ(quote("\x7f"), "\"\\u007f\"");
  EXPECT_EQ(quote("\u009b\u2028\u202e"), "\"\\u009b\\u2028\\u202e\"");
  EXPECT_EQ(quote("模型.权重 \"q\" \\"), "\"模型.权重 \\\"q\\\" \\\\\"");
  EXPECT_THROW(quote(Bytes({'a', 0xc3})), std::invalid_argument);  // JSON text is UTF-8 only
  // Every code point up to U+FFFF (no surrogates) and some above: free of controls, and read
  // back as the same string.
  std::string all;
  for (uint32_t cp = 0; cp < 0x30000; cp += cp < 0x10000 ? 1 : 97) {
    if (cp >= 0xd800 && cp <= 0xdfff) continue;
    const unsigned char lead = cp < 0x80 ? 0 : cp < 0x800 ? 0xc0 : cp < 0x10000 ? 0xe0 : 0xf0;
    const int tail_bytes = cp < 0x80 ? 0 : cp < 0x800 ? 1 : cp < 0x10000 ? 2 : 3;
    all += static_cast<char>(lead | (cp >> (6 * tail_bytes)));
    for (int k = tail_bytes - 1; k >= 0; --k)
      all += static_cast<char>(0x80 | ((cp >> (6 * k)) & 0x3f));
  }
  ASSERT_TRUE(IsUtf8(all));
  const std::string quoted = quote(all);
  EXPECT_FALSE(HasControlCodePoint(quoted));
  EXPECT_EQ(ParseJsonStringMap("{\"k\":" + quoted + "}", "test").at("k"), all);
}

}  // namespace
}  // namespace tensortier
