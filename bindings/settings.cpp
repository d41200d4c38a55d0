// The TENSORTIER_* settings table: every setting with its value in effect, and what each allows.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gil.hpp"
#include "register.hpp"
#include "tensortier/io/config.hpp"
#include "tensortier/util/settings.hpp"

namespace py = pybind11;
using namespace tensortier;

void RegisterSettings(py::module_& m) {
  m.def(
      "defaults",
      [] {
        std::vector<DefaultSetting> rows;
        {
          GilReleased release;
          rows = Defaults();
        }
        py::list out;
        for (const auto& d : rows) {
          py::dict row;
          row["name"] = d.name;
          row["env"] = d.env;
          row["value"] = d.value;
          row["default"] = d.default_value;
          row["allowed"] = d.allowed;
          row["description"] = d.description;
          row["from_environment"] = d.from_environment;
          out.append(row);
        }
        return out;
      },
      "Every TENSORTIER_* setting: name, env, value in effect, default, allowed, description, "
      "from_environment. Raises ValueError naming a variable whose value is bad.");
  m.def(
      "setting_is_set",
      [](const std::string& env) { return SettingFromEnvironment(SettingFor(env)).has_value(); },
      py::arg("env"), "Whether the TENSORTIER_* variable `env` is set (and not empty).");
  m.def(
      "setting_range",
      [](const std::string& env) {
        const Setting& s = SettingFor(env);
        return std::pair<uint64_t, uint64_t>(s.min, s.max);
      },
      py::arg("env"),
      "(smallest, largest) value the numeric TENSORTIER_* setting `env` allows, from the "
      "settings table.");
  m.def(
      "clamp_to_setting",
      [](uint64_t value, const std::string& env) {
        const Setting& s = SettingFor(env);
        return std::clamp<uint64_t>(value, s.min, s.max);
      },
      py::arg("value"), py::arg("env"),
      "`value` within the range the numeric TENSORTIER_* setting `env` allows (the nearest "
      "value it takes), from the settings table.");
}
