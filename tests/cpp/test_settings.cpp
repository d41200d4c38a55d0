// The settings table (settings.hpp): every row is consistent, every variable is parsed and checked
// by its row, and the library honours each (TENSORTIER_GDS included).
#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>

#include "tensortier/cuda/cufile.hpp"
#include "tensortier/offload/device_offload.hpp"
#include "tensortier/util/settings.hpp"
#include "tensortier/transfer/transfer.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::ScopedEnv;

// The message of the std::invalid_argument `fn` throws ("" and a test failure if none).
using testing::InvalidArgumentMessage;

TEST(SettingsTableTest, RowsAreUniqueAndTheirDefaultsPassTheirOwnChecks) {
  std::set<std::string_view> envs, names;
  for (const Setting& s : kSettings) {
    EXPECT_TRUE(s.env.starts_with("TENSORTIER_")) << s.env;
    EXPECT_TRUE(envs.insert(s.env).second) << s.env;
    EXPECT_TRUE(names.insert(s.name).second) << s.name;
    EXPECT_FALSE(s.description.empty()) << s.env;
    EXPECT_FALSE(s.default_text.empty()) << s.env;
    ScopedEnv e(std::string(s.env), std::string(s.default_text));
    switch (s.kind) {
      case SettingKind::kSize:
        EXPECT_EQ(ParseSize(s.default_text), s.default_number) << s.env;
        [[fallthrough]];
      case SettingKind::kCount:
        EXPECT_EQ(NumberSetting(s), s.default_number) << s.env;
        EXPECT_LE(s.min, s.default_number) << s.env;
        EXPECT_LE(s.default_number, s.max) << s.env;
        break;
      case SettingKind::kChoice:
      case SettingKind::kText:
        EXPECT_EQ(WordSetting(s), s.default_text) << s.env;
        break;
    }
  }
}

TEST(SettingsTableTest, UnsetOrEmptyGivesTheDefault) {
  for (const Setting& s : kSettings) {
    for (std::optional<std::string> value :
         {std::optional<std::string>(), std::optional<std::string>("")}) {
      ScopedEnv e(std::string(s.env), value);
      EXPECT_FALSE(SettingFromEnvironment(s).has_value()) << s.env;
      EXPECT_FALSE(EffectiveValue(s).empty()) << s.env;
    }
  }
}

TEST(SettingsTableTest, UnknownNameIsAnError) {
  EXPECT_THROW(SettingFor("TENSORTIER_NO_SUCH_SETTING"), std::invalid_argument);
}

TEST(SettingsTableTest, BadValuesNameTheVariableAndWhatItAllows) {
  struct Bad {
    const char* env;
    const char* value;
    const char* allowed;
  };
  for (const Bad& bad : {
           Bad{"TENSORTIER_CHUNK_SIZE", "5000", "4K to 1G, a multiple of 4K"},
           Bad{"TENSORTIER_CHUNK_SIZE", "2G", "4K to 1G, a multiple of 4K"},
           Bad{"TENSORTIER_QUEUE_DEPTH", "4097", "1 to 4096"},
           Bad{"TENSORTIER_WORKERS", "-3", "1 to 256"},
           Bad{"TENSORTIER_BOUNCE_SLOTS", "0", "1 to 4096"},
           Bad{"TENSORTIER_BOUNCE_SLOT_SIZE", "3", "4K to 1T, a multiple of 4K"},
           Bad{"TENSORTIER_BOUNCE_RINGS", "many", "1 to 4096"},
           Bad{"TENSORTIER_BOUNCE_IDLE_MS", "99999999999999999999", "0 to 3600000"},
           Bad{"TENSORTIER_HUGE_PAGES", "maybe", "auto, 0, 1"},
           Bad{"TENSORTIER_GDS", "sometimes", "off, auto, on, require"},
           Bad{"TENSORTIER_BACKEND", "spdk", "auto, io_uring, libaio, threads"},
           Bad{"TENSORTIER_STAGE_READS", "automatic", "off, auto, on"},
       }) {
    ScopedEnv e(bad.env, bad.value);
    const Setting& s = SettingFor(bad.env);
    const std::string msg = InvalidArgumentMessage([&] { EffectiveValue(s); });
    EXPECT_NE(msg.find(std::string(bad.env) + "=" + bad.value), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("allowed: ") + bad.allowed), std::string::npos) << msg;
  }
}

TEST(SettingsTableTest, BooleanSpellingsOfOffAndOn) {
  for (const char* on : {"1", "true", "on", "yes"}) {
    ScopedEnv a("TENSORTIER_PAGE_CACHE_CHECK", on);
    ScopedEnv b("TENSORTIER_GDS", on);
    ScopedEnv c("TENSORTIER_HUGE_PAGES", on);
    EXPECT_EQ(WordSetting(SettingFor("TENSORTIER_PAGE_CACHE_CHECK")), "1") << on;
    EXPECT_EQ(WordSetting(SettingFor("TENSORTIER_GDS")), "on") << on;
    EXPECT_EQ(WordSetting(SettingFor("TENSORTIER_HUGE_PAGES")), "1") << on;
  }
  for (const char* off : {"0", "false", "off", "no"}) {
    ScopedEnv a("TENSORTIER_STAGE_READS", off);
    ScopedEnv b("TENSORTIER_GDS", off);
    EXPECT_EQ(WordSetting(SettingFor("TENSORTIER_STAGE_READS")), "off") << off;
    EXPECT_EQ(WordSetting(SettingFor("TENSORTIER_GDS")), "off") << off;
  }
  // In any case, as KvikIO takes them, and as Python's str(True) spells them.
  {
    ScopedEnv a("TENSORTIER_PAGE_CACHE_CHECK", "True");
    ScopedEnv b("TENSORTIER_STAGE_READS", "ON");
    ScopedEnv c("TENSORTIER_GDS", "Auto");
    ScopedEnv d("TENSORTIER_BACKEND", "IO_URING");
    EXPECT_EQ(WordSetting(SettingFor("TENSORTIER_PAGE_CACHE_CHECK")), "1");
    EXPECT_EQ(WordSetting(SettingFor("TENSORTIER_STAGE_READS")), "on");
    EXPECT_EQ(WordSetting(SettingFor("TENSORTIER_GDS")), "auto");
    EXPECT_EQ(WordSetting(SettingFor("TENSORTIER_BACKEND")), "io_uring");
  }
  ScopedEnv backend("TENSORTIER_BACKEND", "1");  // no off/on words: no boolean spellings
  EXPECT_THROW(WordSetting(SettingFor("TENSORTIER_BACKEND")), std::invalid_argument);
}

TEST(SettingsTableTest, TextSettingsTakeAnyValue) {
  ScopedEnv e("TENSORTIER_CUDA_LIBRARY", "/opt/x/libcuda.so.1");
  EXPECT_EQ(WordSetting(SettingFor("TENSORTIER_CUDA_LIBRARY")), "/opt/x/libcuda.so.1");
  EXPECT_EQ(CudaDriver::DefaultLibrary(), "/opt/x/libcuda.so.1");
  ScopedEnv f("TENSORTIER_CUFILE_LIBRARY", std::nullopt);
  EXPECT_EQ(CuFile::DefaultLibrary(), "libcufile.so.0");
}

TEST(SettingsTableTest, AKindMismatchIsALogicError) {
  EXPECT_THROW(NumberSetting(SettingFor("TENSORTIER_GDS")), std::logic_error);
  EXPECT_THROW(WordSetting(SettingFor("TENSORTIER_WORKERS")), std::logic_error);
}

// The C++ library reads TENSORTIER_GDS itself: DeviceFile(File) and OffloadDeviceFiles().
TEST(SettingsGdsTest, TheLibraryHonoursTheVariable) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/gds.bin";
  {
    ScopedEnv e("TENSORTIER_GDS", std::nullopt);
    EXPECT_EQ(GdsModeFromEnvironment(), GdsMode::kOff);
    DeviceFile f(File::Open(path, OpenMode::kWrite, true));
    EXPECT_EQ(f.mode(), GdsMode::kOff);
    EXPECT_EQ(OffloadDeviceFiles().mode(), GdsMode::kOff);
  }
  {
    ScopedEnv e("TENSORTIER_GDS", "auto");
    ScopedEnv lib("TENSORTIER_CUFILE_LIBRARY", "/nonexistent/libcufile.so.0");
    EXPECT_EQ(GdsModeFromEnvironment(), GdsMode::kAuto);
    EXPECT_EQ(OffloadDeviceFiles().mode(), GdsMode::kAuto);
  }
  {
    ScopedEnv e("TENSORTIER_GDS", "require");
    EXPECT_EQ(GdsModeFromEnvironment(), GdsMode::kRequire);
    EXPECT_STREQ(GdsModeName(GdsModeFromEnvironment()), "on");
  }
  {
    ScopedEnv e("TENSORTIER_GDS", "sometimes");
    EXPECT_THROW(GdsModeFromEnvironment(), std::invalid_argument);
    EXPECT_THROW(DeviceFile(File::Open(path, OpenMode::kWrite, true)), std::invalid_argument);
  }
}

}  // namespace
}  // namespace tensortier
