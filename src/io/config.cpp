#include "tensortier/io/config.hpp"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "tensortier/util/strings.hpp"

namespace tensortier {

ReadStaging ParseReadStaging(std::string_view text) {
  const std::string_view word = ChoiceWord(SettingFor("TENSORTIER_STAGE_READS"), text);
  if (const auto staging = ValueOf(kReadStagingNames, word)) return *staging;
  throw std::invalid_argument(
      StrCat("stage_reads: '", text, "' is not one of ", JoinNames(kReadStagingNames)));
}

std::string BackendWord(std::string_view text) {
  const Setting& row = SettingFor("TENSORTIER_BACKEND");
  const std::string_view word = ChoiceWord(row, text);
  if (word.empty()) {
    throw std::invalid_argument(StrCat("backend: '", text, "' is not one of ", AllowedValues(row)));
  }
  return std::string(word);
}

std::string_view ReadStagingName(ReadStaging staging) {
  return NameOf(kReadStagingNames, staging, "auto");
}

void EngineOptions::Validate() const {
  const Setting& backend_row = SettingFor("TENSORTIER_BACKEND");
  if (std::ranges::find(backend_row.choices, backend) == backend_row.choices.end()) {
    throw std::invalid_argument(
        StrCat("backend: '", backend, "' is not one of ", AllowedValues(backend_row)));
  }
  CheckNumberSetting(SettingFor("TENSORTIER_CHUNK_SIZE"), chunk_size);
  CheckNumberSetting(SettingFor("TENSORTIER_QUEUE_DEPTH"), queue_depth);
  CheckNumberSetting(SettingFor("TENSORTIER_WORKERS"), workers);
  CheckNumberSetting(SettingFor("TENSORTIER_MAX_INFLIGHT"), max_inflight_bytes);
  CheckNumberSetting(SettingFor("TENSORTIER_MAX_STAGED"), max_staged_bytes);
  CheckNumberSetting(SettingFor("TENSORTIER_COPY_THREADS"), copy_threads);
  CheckNumberSetting(SettingFor("TENSORTIER_BOUNCE_IDLE_MS"), bounce_idle_ms);
  if (max_inflight_bytes < chunk_size) {
    throw std::invalid_argument(
        StrCat("max_inflight_bytes (TENSORTIER_MAX_INFLIGHT): ", max_inflight_bytes,
               " must be at least chunk_size (TENSORTIER_CHUNK_SIZE: ", chunk_size, ")"));
  }
}

EngineOptions EngineOptions::FromEnvironment() {
  return FromEnvironment(EngineOptions{});
}

EngineOptions EngineOptions::FromEnvironment(EngineOptions base) {
  EngineOptions o = std::move(base);
  // Each variable is parsed and range-checked by its row; an unset one leaves `base` as it is.
  const auto set = [](std::string_view env) -> const Setting* {
    const Setting& s = SettingFor(env);
    return SettingFromEnvironment(s) ? &s : nullptr;
  };
  if (const Setting* s = set("TENSORTIER_BACKEND")) o.backend = WordSetting(*s);
  if (const Setting* s = set("TENSORTIER_CHUNK_SIZE")) o.chunk_size = NumberSetting(*s);
  if (const Setting* s = set("TENSORTIER_QUEUE_DEPTH")) {
    o.queue_depth = static_cast<unsigned>(NumberSetting(*s));
  }
  if (const Setting* s = set("TENSORTIER_WORKERS")) {
    o.workers = static_cast<unsigned>(NumberSetting(*s));
  }
  if (const Setting* s = set("TENSORTIER_MAX_INFLIGHT")) o.max_inflight_bytes = NumberSetting(*s);
  if (const Setting* s = set("TENSORTIER_PAGE_CACHE_CHECK")) {
    o.page_cache_check = WordSetting(*s) == "1";
  }
  if (const Setting* s = set("TENSORTIER_STAGE_READS")) {
    o.stage_reads = ParseReadStaging(WordSetting(*s));
  }
  if (const Setting* s = set("TENSORTIER_MAX_STAGED")) o.max_staged_bytes = NumberSetting(*s);
  if (const Setting* s = set("TENSORTIER_COPY_THREADS")) {
    o.copy_threads = static_cast<unsigned>(NumberSetting(*s));
  }
  if (const Setting* s = set("TENSORTIER_BOUNCE_IDLE_MS")) {
    o.bounce_idle_ms = static_cast<uint32_t>(NumberSetting(*s));
  }
  try {
    o.Validate();
  } catch (const std::invalid_argument& error) {
    // Only a combination can fail here (each value passed its row): name the variables.
    throw std::invalid_argument(StrCat("environment (TENSORTIER_*): ", error.what()));
  }
  return o;
}

std::vector<DefaultSetting> Defaults() {
  EngineOptions::FromEnvironment();  // the engine's variables, checked together
  std::vector<DefaultSetting> rows;
  for (const Setting& s : kSettings) {
    rows.push_back({std::string(s.name), std::string(s.env), EffectiveValue(s),
                    std::string(s.default_text), AllowedValues(s), std::string(s.description),
                    SettingFromEnvironment(s).has_value()});
  }
  return rows;
}

}  // namespace tensortier
