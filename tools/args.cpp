#include <algorithm>
#include <charconv>
#include <stdexcept>
#include "tensortier/util/strings.hpp"

#include "cli.hpp"
#include "tensortier/io/config.hpp"

namespace tensortier::cli {

Args::Args(const std::vector<std::string>& argv, const std::vector<std::string>& flags,
           const std::vector<std::string>& options) {
  auto known = [](const std::vector<std::string>& list, const std::string& name) {
    return std::find(list.begin(), list.end(), name) != list.end();
  };
  bool options_end = false;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (options_end || a == "-" || !a.starts_with("-")) {
      positionals_.push_back(a);
      continue;
    }
    if (a == "--") {  // what follows is positional, as with getopt: a file named "-x"
      options_end = true;
      continue;
    }
    // A single-dash "-x" is no option of ours: unknown, not a file named so.
    std::string name = a.starts_with("--") ? a.substr(2) : std::string();
    std::string value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (!name.empty() && known(flags, name) && !has_value) {
      flags_[name] = true;
      continue;
    }
    if (!name.empty() && known(options, name)) {
      if (!has_value) {
        if (i + 1 >= argv.size()) throw UsageError(StrCat("--", name, " needs a value"));
        value = argv[++i];
      }
      values_[name] = value;
      continue;
    }
    std::string all;
    for (const auto& f : flags) all += " --" + f;
    for (const auto& o : options) all += " --" + o;
    throw UsageError(
        StrCat("unknown option '", a, "'",
               all.empty() ? " (the command takes none)" : StrCat(" (known:", all, ")")));
  }
}

std::string Args::Get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

uint64_t Args::Size(const std::string& name, uint64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  try {
    return ParseSize(it->second);
  } catch (const std::invalid_argument& e) {
    throw UsageError(StrCat("--", name, ": ", e.what()));
  }
}

uint64_t Args::Unsigned64(const std::string& name, uint64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  // from_chars, not stoull: stoull takes "-3" as 2^64 - 3 and skips leading blanks.
  const std::string& text = it->second;
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range) {
    throw UsageError(StrCat("--", name, ": ", text, " is too large"));
  }
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    throw UsageError(StrCat("--", name, ": '", text, "' is not a number"));
  }
  return v;
}

unsigned Args::Unsigned(const std::string& name, unsigned fallback) const {
  const uint64_t v = Unsigned64(name, fallback);
  if (v > 1u << 20) throw UsageError(StrCat("--", name, ": ", v, " is too large"));
  return static_cast<unsigned>(v);
}

std::string Count(uint64_t n, const std::string& noun) {
  return StrCat(n, " ", noun, n == 1 ? "" : "s");
}

}  // namespace tensortier::cli
