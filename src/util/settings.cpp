#include "tensortier/util/settings.hpp"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <vector>

#include "tensortier/util/enum_names.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr std::string_view kTrueWords[] = {"1", "true", "on", "yes"};
constexpr std::string_view kFalseWords[] = {"0", "false", "off", "no"};

// Words compare without regard to ASCII case: `str(True)` in Python gives "True", and KvikIO
// takes its words in any case.
bool SameWord(std::string_view a, std::string_view b) {
  // ASCII only: std::tolower follows the locale (a Turkish one maps 'I' elsewhere).
  auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
  return std::ranges::equal(a, b, [&](char x, char y) { return lower(x) == lower(y); });
}

bool IsOneOf(std::string_view word, std::span<const std::string_view> words) {
  for (std::string_view w : words) {
    if (SameWord(w, word)) return true;
  }
  return false;
}

// "4K", "1G": the shortest exact spelling ParseSize accepts.
std::string ShortSize(uint64_t bytes) {
  constexpr const char* kSuffixes[] = {"", "K", "M", "G", "T"};
  int unit = 0;
  while (bytes != 0 && bytes % 1024 == 0 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  return StrCat(bytes, kSuffixes[unit]);
}

uint64_t ParseUnsigned(std::string_view text, const char* what) {
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) {
    throw std::invalid_argument(StrCat(what, ": '", text, "' is not a non-negative integer"));
  }
  return value;
}

[[noreturn]] void ThrowInvalid(const Setting& setting, std::string_view value,
                               std::string_view why) {
  throw std::invalid_argument(StrCat(setting.env, "=", value, " is invalid: ", why,
                                     " (allowed: ", AllowedValues(setting), ")"));
}

// A boolean's spellings, and the words a kChoice row may have for it.
struct BooleanSpelling {
  std::span<const std::string_view> words;
  std::string_view word;   // on / off
  std::string_view digit;  // 1 / 0
};
constexpr BooleanSpelling kBooleanSpellings[] = {{kTrueWords, "on", "1"},
                                                 {kFalseWords, "off", "0"}};

// The row's own word for boolean `b` (its "on" or "1"), or "" when it has none.
std::string_view RowWord(std::span<const std::string_view> choices, const BooleanSpelling& b) {
  for (std::string_view c : choices) {
    if (c == b.word || c == b.digit) return c;
  }
  return "";
}


// Whether `text` is well formed for `setting` (digits, and a unit for sizes) but failed to parse:
// a number beyond 64 bits is out of range, not malformed.
bool TooLargeToParse(const Setting& setting, std::string_view text) {
  const size_t digits = std::min(text.find_first_not_of("0123456789"), text.size());
  if (digits == 0) return false;
  const std::string_view unit = text.substr(digits);
  if (unit.empty()) return true;
  if (setting.kind != SettingKind::kSize) return false;
  try {
    ParseSize(StrCat("1", unit));
    return true;
  } catch (const std::invalid_argument&) {
    return false;
  }
}

uint64_t CheckedNumber(const Setting& setting, std::string_view text) {
  uint64_t value = 0;
  try {
    value = setting.kind == SettingKind::kSize ? ParseSize(text) : ParseUnsigned(text, "value");
  } catch (const std::invalid_argument&) {
    ThrowInvalid(setting, text,
                 TooLargeToParse(setting, text)       ? "out of range"
                 : setting.kind == SettingKind::kSize ? "not a size like 4096, 64K, 1M or 2G"
                                                      : "not a whole number");
  }
  if (value < setting.min || value > setting.max) ThrowInvalid(setting, text, "out of range");
  if (setting.kind == SettingKind::kSize && value % setting.multiple != 0) {
    ThrowInvalid(setting, text, StrCat("not a multiple of ", ShortSize(setting.multiple)));
  }
  return value;
}

}  // namespace

std::string_view ChoiceWord(const Setting& setting, std::string_view text) {
  for (std::string_view c : setting.choices) {
    if (SameWord(c, text)) return c;
  }
  // Boolean spellings of the row's own off/on words.
  for (const BooleanSpelling& b : kBooleanSpellings) {
    if (IsOneOf(text, b.words)) return RowWord(setting.choices, b);
  }
  return "";
}

std::optional<std::string> SettingFromEnvironment(const Setting& setting) {
  const std::string env(setting.env);
  const char* v = std::getenv(env.c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

uint64_t NumberSetting(const Setting& setting) {
  if (setting.kind != SettingKind::kSize && setting.kind != SettingKind::kCount) {
    throw std::logic_error(StrCat(setting.env, " is not a number"));
  }
  const std::optional<std::string> text = SettingFromEnvironment(setting);
  return text ? CheckedNumber(setting, *text) : setting.default_number;
}

void CheckNumberSetting(const Setting& setting, uint64_t value) {
  if (value < setting.min || value > setting.max || value % setting.multiple != 0) {
    throw std::invalid_argument(StrCat(setting.name, " (", setting.env, "): ", value,
                                       " is out of range (allowed: ", AllowedValues(setting), ")"));
  }
}

std::string WordSetting(const Setting& setting) {
  if (setting.kind != SettingKind::kChoice && setting.kind != SettingKind::kText) {
    throw std::logic_error(StrCat(setting.env, " is not a word"));
  }
  const std::optional<std::string> text = SettingFromEnvironment(setting);
  if (!text) return std::string(setting.default_text);
  if (setting.kind == SettingKind::kText) return *text;
  const std::string_view word = ChoiceWord(setting, *text);
  if (word.empty()) ThrowInvalid(setting, *text, "not one of the allowed words");
  return std::string(word);
}

std::string AllowedValues(const Setting& setting) {
  switch (setting.kind) {
    case SettingKind::kChoice: {
      std::string out = JoinWords(setting.choices);
      // The boolean spellings ChoiceWord takes for the row's own off/on words.
      std::string aliases;
      for (const BooleanSpelling& b : kBooleanSpellings) {
        const std::string_view row = RowWord(setting.choices, b);
        if (row.empty()) continue;
        std::string same;
        for (std::string_view w : b.words) {
          if (w != row) same += StrCat(same.empty() ? "" : "/", w);
        }
        aliases += StrCat(aliases.empty() ? "" : ", ", same, " for ", row);
      }
      if (!aliases.empty()) out += StrCat("; also ", aliases);
      return out;
    }
    case SettingKind::kSize: {
      std::string out = StrCat(ShortSize(setting.min), " to ", ShortSize(setting.max));
      if (setting.multiple > 1) out += StrCat(", a multiple of ", ShortSize(setting.multiple));
      return out;
    }
    case SettingKind::kCount:
      return StrCat(setting.min, " to ", setting.max);
    case SettingKind::kText:
      break;
  }
  return "a library name or path";
}

std::string EffectiveValue(const Setting& setting) {
  switch (setting.kind) {
    case SettingKind::kSize:
      return FormatSize(NumberSetting(setting));
    case SettingKind::kCount:
      return std::to_string(NumberSetting(setting));
    case SettingKind::kChoice:
    case SettingKind::kText:
      break;
  }
  return WordSetting(setting);
}

bool ParseBool(std::string_view text, const char* what) {
  if (IsOneOf(text, kTrueWords)) return true;
  if (IsOneOf(text, kFalseWords)) return false;
  throw std::invalid_argument(StrCat(what, ": '", text, "' is not a boolean (use 0 or 1)"));
}

namespace {

// The edit distance of `a` and `b` (insertions, deletions, substitutions).
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

std::vector<UnknownSettingVariable> UnknownSettingVariables() {
  std::vector<UnknownSettingVariable> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (!name.starts_with("TENSORTIER_")) continue;
    UnknownSettingVariable unknown{std::string(name), ""};
    size_t best = 4;  // closer than this, or nothing is suggested
    bool known = false;
    for (const Setting& s : kSettings) {
      if (s.env == name) known = true;
      if (const size_t d = EditDistance(s.env, name); d < best) {
        best = d;
        unknown.meant = s.env;
      }
    }
    if (!known) out.push_back(std::move(unknown));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

uint64_t ParseSize(std::string_view text) {
  std::string_view digits = text;
  for (std::string_view suffix : {"iB", "B"}) {
    if (digits.size() > suffix.size() && digits.ends_with(suffix)) {
      digits.remove_suffix(suffix.size());
      break;
    }
  }
  uint64_t multiplier = 1;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'k':
      case 'K':
        multiplier = 1ull << 10;
        break;
      case 'm':
      case 'M':
        multiplier = 1ull << 20;
        break;
      case 'g':
      case 'G':
        multiplier = 1ull << 30;
        break;
      case 't':
      case 'T':
        multiplier = 1ull << 40;
        break;
      default:
        break;
    }
    if (multiplier != 1) digits.remove_suffix(1);
  }
  uint64_t value = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() ||
      (value != 0 && value > UINT64_MAX / multiplier)) {
    throw std::invalid_argument(StrCat("'", text, "' is not a size like 4096, 64K, 1M or 2G"));
  }
  return value * multiplier;
}

std::string FormatSize(uint64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024 && unit < 4) {
    v /= 1024;
    ++unit;
  }
  if (unit == 0 || v == static_cast<double>(static_cast<uint64_t>(v))) {
    return StrCat(static_cast<uint64_t>(v), " ", kUnits[unit]);
  }
  return StrCat(Fixed(v, 1), " ", kUnits[unit]);
}

}  // namespace tensortier
