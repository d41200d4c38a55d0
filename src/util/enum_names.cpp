#include "tensortier/util/enum_names.hpp"

#include "tensortier/util/strings.hpp"

namespace tensortier {

std::string JoinWords(std::span<const std::string_view> words, std::string_view separator,
                      std::string_view last_separator, std::string_view quote) {
  std::string out;
  for (size_t i = 0; i < words.size(); ++i) {
    if (i > 0) {
      out += i + 1 == words.size() && !last_separator.empty() ? last_separator : separator;
    }
    out += StrCat(quote, words[i], quote);
  }
  return out;
}

}  // namespace tensortier
