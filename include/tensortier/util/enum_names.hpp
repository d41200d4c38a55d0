// Names of enum values, declared once per enum as a constexpr array of {value, name} pairs, and
// the generic lookups over such arrays: a value's name, a name's value, the names for messages.
// Where a row of the settings table (settings.hpp) lists the words, the pairs are made from that
// row (NamesFromWords), so the words are written in one place.
#pragma once

#include <array>
#include <cstddef>
#include <iterator>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace tensortier {

template <typename E>
struct EnumName {
  E value;
  std::string_view name;
};

// The name of `value` in `names` (the first pair that has it), or `fallback` when none does.
template <typename Names, typename E>
constexpr std::string_view NameOf(const Names& names, E value, std::string_view fallback = "") {
  for (const auto& n : names) {
    if (n.value == value) return n.name;
  }
  return fallback;
}

// The value named `name` in `names`, or nullopt.
template <typename Names>
constexpr auto ValueOf(const Names& names, std::string_view name)
    -> std::optional<decltype(std::begin(names)->value)> {
  for (const auto& n : names) {
    if (n.name == name) return n.value;
  }
  return std::nullopt;
}

// Pairs `values[i]` with `words[i]`: the words as a row of the settings table lists them, the
// values in the same order. A count that differs does not build (in a constant expression).
template <typename E, size_t N>
constexpr std::array<EnumName<E>, N> NamesFromWords(std::span<const std::string_view> words,
                                                    const E (&values)[N]) {
  if (words.size() != N) throw std::logic_error("as many words as values");
  std::array<EnumName<E>, N> names{};
  for (size_t i = 0; i < N; ++i) names[i] = {values[i], words[i]};
  return names;
}

// "a, b, c" (separator ", "), "a, b or c" (last_separator " or "), "'a', 'b'" (quote "'"): the
// words as a message lists them.
std::string JoinWords(std::span<const std::string_view> words, std::string_view separator = ", ",
                      std::string_view last_separator = {}, std::string_view quote = {});

// The names of `names`, in order, joined as JoinWords does.
template <typename Names>
std::string JoinNames(const Names& names, std::string_view separator = ", ",
                      std::string_view last_separator = {}, std::string_view quote = {}) {
  std::vector<std::string_view> words;
  for (const auto& n : names) words.push_back(n.name);
  return JoinWords(words, separator, last_separator, quote);
}

}  // namespace tensortier
