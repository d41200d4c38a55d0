// EngineOptions, the TENSORTIER_* environment, the defaults table and the size syntax.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "tensortier/util/aligned_buffer.hpp"
#include "tensortier/io/config.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::ScopedEnv;

// The message of the std::invalid_argument `fn` throws ("" and a test failure if none).
using testing::InvalidArgumentMessage;

// ---------------------------------------------------------------------------------------------
// ParseSize / FormatSize

TEST(ParseSizeTest, PlainBytes) {
  EXPECT_EQ(ParseSize("0"), 0u);
  EXPECT_EQ(ParseSize("4096"), 4096u);
  EXPECT_EQ(ParseSize("18446744073709551615"), UINT64_MAX);
}

TEST(ParseSizeTest, BinarySuffixes) {
  EXPECT_EQ(ParseSize("64K"), 64u << 10);
  EXPECT_EQ(ParseSize("64k"), 64u << 10);
  EXPECT_EQ(ParseSize("1M"), 1u << 20);
  EXPECT_EQ(ParseSize("2G"), 2ull << 30);
  EXPECT_EQ(ParseSize("3T"), 3ull << 40);
}

TEST(ParseSizeTest, TrailingBAndIBAreAccepted) {
  EXPECT_EQ(ParseSize("1MiB"), 1u << 20);
  EXPECT_EQ(ParseSize("1MB"), 1u << 20);
  EXPECT_EQ(ParseSize("8KiB"), 8u << 10);
  EXPECT_EQ(ParseSize("512B"), 512u);
}

TEST(ParseSizeTest, LargestValueThatFitsIsAccepted) {
  // 16777215 TiB = 2^64 - 2^40.
  EXPECT_EQ(ParseSize("16777215T"), (UINT64_MAX / (1ull << 40)) << 40);
}

TEST(ParseSizeTest, EmptyIsRejected) {
  EXPECT_THROW(ParseSize(""), std::invalid_argument);
}

TEST(ParseSizeTest, NonNumericIsRejected) {
  EXPECT_THROW(ParseSize("abc"), std::invalid_argument);
  EXPECT_THROW(ParseSize("K"), std::invalid_argument);
  EXPECT_THROW(ParseSize("B"), std::invalid_argument);
  EXPECT_THROW(ParseSize("MiB"), std::invalid_argument);
}

TEST(ParseSizeTest, UnknownSuffixIsRejected) {
  EXPECT_THROW(ParseSize("1X"), std::invalid_argument);
  EXPECT_THROW(ParseSize("1P"), std::invalid_argument);
  EXPECT_THROW(ParseSize("1KK"), std::invalid_argument);
}

TEST(ParseSizeTest, NegativeIsRejected) {
  EXPECT_THROW(ParseSize("-1"), std::invalid_argument);
  EXPECT_THROW(ParseSize("-1K"), std::invalid_argument);
}

TEST(ParseSizeTest, WhitespaceAndFractionsAreRejected) {
  EXPECT_THROW(ParseSize(" 1"), std::invalid_argument);
  EXPECT_THROW(ParseSize("1 "), std::invalid_argument);
  EXPECT_THROW(ParseSize("1.5M"), std::invalid_argument);
}

TEST(ParseSizeTest, OverflowIsRejected) {
  EXPECT_THROW(ParseSize("99999999999T"), std::invalid_argument);
  EXPECT_THROW(ParseSize("16777216T"), std::invalid_argument);  // exactly 2^64
  EXPECT_THROW(ParseSize("18446744073709551616"), std::invalid_argument);
}

TEST(ParseSizeTest, ErrorMessageQuotesTheInput) {
  std::string msg = InvalidArgumentMessage([] { ParseSize("1X"); });
  EXPECT_NE(msg.find("1X"), std::string::npos) << msg;
}

TEST(FormatSizeTest, BytesBelowOneKiB) {
  EXPECT_EQ(FormatSize(0), "0 B");
  EXPECT_EQ(FormatSize(1), "1 B");
  EXPECT_EQ(FormatSize(1023), "1023 B");
}

TEST(FormatSizeTest, WholeUnits) {
  EXPECT_EQ(FormatSize(1024), "1 KiB");
  EXPECT_EQ(FormatSize(4u << 20), "4 MiB");
  EXPECT_EQ(FormatSize(2ull << 30), "2 GiB");
  EXPECT_EQ(FormatSize(1ull << 40), "1 TiB");
}

TEST(FormatSizeTest, FractionsHaveOneDecimal) {
  EXPECT_EQ(FormatSize(1536), "1.5 KiB");
  EXPECT_EQ(FormatSize(3ull << 29), "1.5 GiB");
  EXPECT_EQ(FormatSize((1u << 20) + (1u << 20) / 4), "1.2 MiB");  // 1.25 rounds to even
}

TEST(FormatSizeTest, TiBIsTheLargestUnit) {
  EXPECT_EQ(FormatSize(1ull << 50), "1024 TiB");
}

TEST(FormatSizeTest, RoundTripsThroughParseSizeForWholeUnits) {
  for (uint64_t v : {1ull, 4096ull, 64ull << 10, 4ull << 20, 2ull << 30, 1ull << 40}) {
    std::string text = FormatSize(v);
    std::string compact;
    for (char c : text) {
      if (c != ' ') compact += c;
    }
    EXPECT_EQ(ParseSize(compact), v) << text;
  }
}

// ---------------------------------------------------------------------------------------------
// EngineOptions::Validate

TEST(ValidateTest, DefaultsAreValid) {
  EXPECT_NO_THROW(EngineOptions{}.Validate());
}

TEST(ValidateTest, ZeroChunkSizeIsRejected) {
  EngineOptions o;
  o.chunk_size = 0;
  EXPECT_NE(InvalidArgumentMessage([&] { o.Validate(); }).find("chunk_size"), std::string::npos);
}

TEST(ValidateTest, ChunkSizeNotAMultipleOf4096IsRejected) {
  EngineOptions o;
  for (uint64_t bad : {512ull, 4095ull, 4097ull, (64ull << 10) + 512}) {
    o.chunk_size = bad;
    EXPECT_NE(InvalidArgumentMessage([&] { o.Validate(); }).find("chunk_size"), std::string::npos)
        << bad;
  }
  o.chunk_size = 4096;
  EXPECT_NO_THROW(o.Validate());
}

TEST(ValidateTest, ChunkSizeAboveOneGiBIsRejected) {
  EngineOptions o;
  o.chunk_size = (1ull << 30) + 4096;
  o.max_inflight_bytes = 4ull << 30;
  EXPECT_THROW(o.Validate(), std::invalid_argument);
  o.chunk_size = 1ull << 30;
  EXPECT_NO_THROW(o.Validate());
}

TEST(ValidateTest, ZeroQueueDepthIsRejected) {
  EngineOptions o;
  o.queue_depth = 0;
  EXPECT_NE(InvalidArgumentMessage([&] { o.Validate(); }).find("queue_depth"), std::string::npos);
}

TEST(ValidateTest, ZeroWorkersIsRejected) {
  EngineOptions o;
  o.workers = 0;
  EXPECT_NE(InvalidArgumentMessage([&] { o.Validate(); }).find("workers"), std::string::npos);
}

TEST(ValidateTest, MaxInflightBelowChunkSizeIsRejected) {
  EngineOptions o;
  o.chunk_size = 1 << 20;
  o.max_inflight_bytes = (1 << 20) - 4096;
  EXPECT_NE(InvalidArgumentMessage([&] { o.Validate(); }).find("max_inflight_bytes"),
            std::string::npos);
  o.max_inflight_bytes = 1 << 20;  // equal is enough
  EXPECT_NO_THROW(o.Validate());
}

TEST(ValidateTest, UnknownBackendIsRejected) {
  EngineOptions o;
  for (const char* bad : {"", "uring", "IO_URING", "aio", "spdk"}) {
    o.backend = bad;
    std::string msg = InvalidArgumentMessage([&] { o.Validate(); });
    EXPECT_NE(msg.find("backend"), std::string::npos) << "'" << bad << "': " << msg;
  }
  for (const char* good : {"auto", "io_uring", "libaio", "threads"}) {
    o.backend = good;
    EXPECT_NO_THROW(o.Validate()) << good;
  }
}

// ---------------------------------------------------------------------------------------------
// EngineOptions::FromEnvironment and Defaults()

// Starts every test with none of the TENSORTIER_* variables set (whatever the caller exported).
class EnvironmentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const Setting& s : kSettings) {
      cleared_.push_back(std::make_unique<ScopedEnv>(std::string(s.env).c_str(), std::nullopt));
    }
  }
  std::vector<std::unique_ptr<ScopedEnv>> cleared_;
};

TEST_F(EnvironmentTest, NoVariablesGiveTheBuiltInDefaults) {
  EngineOptions env = EngineOptions::FromEnvironment();
  EngineOptions built_in;
  EXPECT_EQ(env.backend, "auto");
  EXPECT_EQ(env.backend, built_in.backend);
  EXPECT_EQ(env.chunk_size, built_in.chunk_size);
  EXPECT_EQ(env.queue_depth, built_in.queue_depth);
  EXPECT_EQ(env.workers, built_in.workers);
  EXPECT_EQ(env.max_inflight_bytes, built_in.max_inflight_bytes);
  EXPECT_EQ(env.page_cache_check, built_in.page_cache_check);
  EXPECT_EQ(env.stage_reads, ReadStaging::kAuto);
  EXPECT_EQ(env.stage_reads, built_in.stage_reads);
  EXPECT_EQ(env.bounce_idle_ms, 1000u);
  EXPECT_EQ(env.bounce_idle_ms, built_in.bounce_idle_ms);
  EXPECT_EQ(env.max_staged_bytes, 32u << 20);
  EXPECT_EQ(env.copy_threads, 2u);
}

TEST_F(EnvironmentTest, EmptyValueMeansUnset) {
  ScopedEnv e("TENSORTIER_CHUNK_SIZE", "");
  EXPECT_EQ(EngineOptions::FromEnvironment().chunk_size, EngineOptions{}.chunk_size);
}

TEST_F(EnvironmentTest, BackendVariableIsApplied) {
  ScopedEnv e("TENSORTIER_BACKEND", "threads");
  EXPECT_EQ(EngineOptions::FromEnvironment().backend, "threads");
}

TEST_F(EnvironmentTest, ChunkSizeVariableIsApplied) {
  ScopedEnv e("TENSORTIER_CHUNK_SIZE", "1M");
  EXPECT_EQ(EngineOptions::FromEnvironment().chunk_size, 1u << 20);
}

TEST_F(EnvironmentTest, QueueDepthVariableIsApplied) {
  ScopedEnv e("TENSORTIER_QUEUE_DEPTH", "7");
  EXPECT_EQ(EngineOptions::FromEnvironment().queue_depth, 7u);
}

TEST_F(EnvironmentTest, WorkersVariableIsApplied) {
  ScopedEnv e("TENSORTIER_WORKERS", "5");
  EXPECT_EQ(EngineOptions::FromEnvironment().workers, 5u);
}

TEST_F(EnvironmentTest, MaxInflightVariableIsApplied) {
  ScopedEnv e("TENSORTIER_MAX_INFLIGHT", "256MiB");
  EXPECT_EQ(EngineOptions::FromEnvironment().max_inflight_bytes, 256u << 20);
}

TEST_F(EnvironmentTest, PageCacheCheckVariableIsApplied) {
  for (const char* off : {"0", "false", "off", "no"}) {
    ScopedEnv e("TENSORTIER_PAGE_CACHE_CHECK", off);
    EXPECT_FALSE(EngineOptions::FromEnvironment().page_cache_check) << off;
  }
  for (const char* on : {"1", "true", "on", "yes"}) {
    ScopedEnv e("TENSORTIER_PAGE_CACHE_CHECK", on);
    EXPECT_TRUE(EngineOptions::FromEnvironment().page_cache_check) << on;
  }
}

TEST_F(EnvironmentTest, StageReadsVariableIsApplied) {
  for (const char* off : {"off", "0", "false", "no"}) {
    ScopedEnv e("TENSORTIER_STAGE_READS", off);
    EXPECT_EQ(EngineOptions::FromEnvironment().stage_reads, ReadStaging::kOff) << off;
  }
  for (const char* on : {"on", "1", "true", "yes"}) {
    ScopedEnv e("TENSORTIER_STAGE_READS", on);
    EXPECT_EQ(EngineOptions::FromEnvironment().stage_reads, ReadStaging::kOn) << on;
  }
  ScopedEnv e("TENSORTIER_STAGE_READS", "auto");
  EXPECT_EQ(EngineOptions::FromEnvironment().stage_reads, ReadStaging::kAuto);
}

TEST_F(EnvironmentTest, BounceIdleVariableIsApplied) {
  for (auto [text, ms] :
       {std::pair{"0", 0u}, std::pair{"250", 250u}, std::pair{"3600000", 3600000u}}) {
    ScopedEnv e("TENSORTIER_BOUNCE_IDLE_MS", text);
    EXPECT_EQ(EngineOptions::FromEnvironment().bounce_idle_ms, ms) << text;
  }
}

TEST_F(EnvironmentTest, ABaseIsOverriddenOnlyWhereAVariableIsSet) {
  EngineOptions base;
  base.workers = 7;
  base.bounce_idle_ms = 0;
  ScopedEnv e("TENSORTIER_WORKERS", "3");
  EngineOptions o = EngineOptions::FromEnvironment(base);
  EXPECT_EQ(o.workers, 3u);
  EXPECT_EQ(o.bounce_idle_ms, 0u);
  EXPECT_EQ(o.chunk_size, base.chunk_size);
}

TEST(ValidateTest, BounceIdleAboveAnHourIsRejected) {
  EngineOptions o;
  o.bounce_idle_ms = 3'600'001;
  std::string msg = InvalidArgumentMessage([&] { o.Validate(); });
  EXPECT_NE(msg.find("bounce_idle_ms"), std::string::npos) << msg;
  o.bounce_idle_ms = 0;
  EXPECT_NO_THROW(o.Validate());
}

TEST(ReadStagingTest, NamesRoundTripAndBadWordsAreRejected) {
  for (ReadStaging s : {ReadStaging::kOff, ReadStaging::kAuto, ReadStaging::kOn}) {
    EXPECT_EQ(ParseReadStaging(ReadStagingName(s)), s);
  }
  // Any case, and the boolean words, as the environment's words are taken.
  EXPECT_EQ(ParseReadStaging("AUTO"), ReadStaging::kAuto);
  EXPECT_EQ(ParseReadStaging("On"), ReadStaging::kOn);
  EXPECT_EQ(ParseReadStaging("false"), ReadStaging::kOff);
  EXPECT_EQ(ParseReadStaging("1"), ReadStaging::kOn);
  std::string why = InvalidArgumentMessage([] { ParseReadStaging("sometimes"); });
  EXPECT_NE(why.find("stage_reads"), std::string::npos) << why;
  EXPECT_NE(why.find("off, auto, on"), std::string::npos) << why;
}

TEST(BackendWordTest, AnyCaseGivesTheSettingsOwnWord) {
  EXPECT_EQ(BackendWord("IO_URING"), "io_uring");
  EXPECT_EQ(BackendWord("Threads"), "threads");
  EXPECT_EQ(BackendWord("auto"), "auto");
  std::string why = InvalidArgumentMessage([] { BackendWord("io-uring"); });
  EXPECT_NE(why.find("backend: 'io-uring' is not one of"), std::string::npos) << why;
  EXPECT_NE(why.find("libaio"), std::string::npos) << why;
  EXPECT_THROW(BackendWord(""), std::invalid_argument);
}

TEST_F(EnvironmentTest, AllVariablesTogether) {
  ScopedEnv a("TENSORTIER_BACKEND", "libaio");
  ScopedEnv b("TENSORTIER_CHUNK_SIZE", "128K");
  ScopedEnv c("TENSORTIER_QUEUE_DEPTH", "64");
  ScopedEnv d("TENSORTIER_WORKERS", "3");
  ScopedEnv e("TENSORTIER_MAX_INFLIGHT", "1G");
  ScopedEnv f("TENSORTIER_PAGE_CACHE_CHECK", "0");
  ScopedEnv g("TENSORTIER_STAGE_READS", "on");
  ScopedEnv h("TENSORTIER_BOUNCE_IDLE_MS", "5");
  ScopedEnv i("TENSORTIER_MAX_STAGED", "16M");
  ScopedEnv j("TENSORTIER_COPY_THREADS", "4");
  EngineOptions o = EngineOptions::FromEnvironment();
  EXPECT_EQ(o.backend, "libaio");
  EXPECT_EQ(o.chunk_size, 128u << 10);
  EXPECT_EQ(o.queue_depth, 64u);
  EXPECT_EQ(o.workers, 3u);
  EXPECT_EQ(o.max_inflight_bytes, 1ull << 30);
  EXPECT_FALSE(o.page_cache_check);
  EXPECT_EQ(o.stage_reads, ReadStaging::kOn);
  EXPECT_EQ(o.bounce_idle_ms, 5u);
  EXPECT_EQ(o.max_staged_bytes, 16u << 20);
  EXPECT_EQ(o.copy_threads, 4u);
}

// Each malformed or out-of-range value is rejected, and the message names the variable so the
// user knows which export to fix.
struct BadEnvValue {
  const char* var;
  const char* value;
};
void PrintTo(const BadEnvValue& v, std::ostream* os) {
  *os << v.var << "=" << v.value;
}

class BadEnvironmentTest : public EnvironmentTest,
                           public ::testing::WithParamInterface<BadEnvValue> {};

// A number too large for 64 bits is out of range, not malformed; the message lists every word
// a choice takes, the boolean spellings of its on/off words included.
TEST_F(EnvironmentTest, MessagesSayWhyAndListEveryAcceptedWord) {
  auto expect_says = [](const char* var, const char* value, std::string_view text) {
    ScopedEnv e(var, value);
    const std::string msg = InvalidArgumentMessage([] { EngineOptions::FromEnvironment(); });
    EXPECT_NE(msg.find(text), std::string::npos) << var << "=" << value << " gave: " << msg;
  };
  expect_says("TENSORTIER_QUEUE_DEPTH", "99999999999999999999",
              "is invalid: out of range (allowed: 1 to 4096)");
  expect_says("TENSORTIER_CHUNK_SIZE", "99999999999999999999K", "is invalid: out of range");
  expect_says("TENSORTIER_QUEUE_DEPTH", "12abc", "is invalid: not a whole number");
  expect_says("TENSORTIER_CHUNK_SIZE", "99999999999999999999X", "is invalid: not a size");
  expect_says("TENSORTIER_STAGE_READS", "always",
              "(allowed: off, auto, on; also 1/true/yes for on, 0/false/no for off)");
  expect_says("TENSORTIER_PAGE_CACHE_CHECK", "2",
              "(allowed: 0, 1; also true/on/yes for 1, false/off/no for 0)");
  expect_says("TENSORTIER_BACKEND", "spdk", "(allowed: auto, io_uring, libaio, threads)");
  // Every spelling the message lists is taken.
  for (const char* word : {"1", "true", "yes", "on"}) {
    ScopedEnv e("TENSORTIER_STAGE_READS", word);
    EXPECT_EQ(EngineOptions::FromEnvironment().stage_reads, ReadStaging::kOn) << word;
  }
  for (const char* word : {"0", "false", "no", "off"}) {
    ScopedEnv e("TENSORTIER_PAGE_CACHE_CHECK", word);
    EXPECT_FALSE(EngineOptions::FromEnvironment().page_cache_check) << word;
  }
}

TEST_P(BadEnvironmentTest, IsRejectedNamingTheVariable) {
  ScopedEnv e(GetParam().var, GetParam().value);
  std::string msg = InvalidArgumentMessage([] { EngineOptions::FromEnvironment(); });
  EXPECT_NE(msg.find(GetParam().var), std::string::npos)
      << GetParam().var << "=" << GetParam().value << " gave: " << msg;
}

INSTANTIATE_TEST_SUITE_P(
    Values, BadEnvironmentTest,
    ::testing::Values(
        BadEnvValue{"TENSORTIER_BACKEND", "spdk"}, BadEnvValue{"TENSORTIER_CHUNK_SIZE", "abc"},
        BadEnvValue{"TENSORTIER_CHUNK_SIZE", "1X"}, BadEnvValue{"TENSORTIER_CHUNK_SIZE", "1000"},
        BadEnvValue{"TENSORTIER_CHUNK_SIZE", "0"}, BadEnvValue{"TENSORTIER_QUEUE_DEPTH", "many"},
        BadEnvValue{"TENSORTIER_QUEUE_DEPTH", "-1"}, BadEnvValue{"TENSORTIER_QUEUE_DEPTH", "0"},
        BadEnvValue{"TENSORTIER_QUEUE_DEPTH", "99999999999999999999"},
        BadEnvValue{"TENSORTIER_WORKERS", "two"}, BadEnvValue{"TENSORTIER_WORKERS", "0"},
        BadEnvValue{"TENSORTIER_MAX_INFLIGHT", "lots"},
        BadEnvValue{"TENSORTIER_MAX_INFLIGHT", "4K"},  // below the 4 MiB chunk
        BadEnvValue{"TENSORTIER_PAGE_CACHE_CHECK", "maybe"},
        BadEnvValue{"TENSORTIER_PAGE_CACHE_CHECK", "2"},
        BadEnvValue{"TENSORTIER_STAGE_READS", "always"},
        BadEnvValue{"TENSORTIER_BOUNCE_IDLE_MS", "1s"},
        BadEnvValue{"TENSORTIER_BOUNCE_IDLE_MS", "-1"},
        BadEnvValue{"TENSORTIER_BOUNCE_IDLE_MS", "3600001"},
        BadEnvValue{"TENSORTIER_BOUNCE_IDLE_MS", "99999999999999999999"},
        BadEnvValue{"TENSORTIER_MAX_STAGED", "some"}, BadEnvValue{"TENSORTIER_MAX_STAGED", "0"},
        BadEnvValue{"TENSORTIER_COPY_THREADS", "-1"},
        BadEnvValue{"TENSORTIER_COPY_THREADS", "257"}),
    [](const ::testing::TestParamInfo<BadEnvValue>& info) {
      std::string name = std::string(info.param.var).substr(11) + "_" + std::to_string(info.index);
      return name;
    });

std::map<std::string, std::string> ValuesByVariable(const std::vector<DefaultSetting>& rows) {
  std::map<std::string, std::string> values;
  for (const DefaultSetting& row : rows) values[row.env] = row.value;
  return values;
}

TEST_F(EnvironmentTest, DefaultsListEveryVariable) {
  std::vector<DefaultSetting> rows = Defaults();
  std::set<std::string> envs, names;
  for (const DefaultSetting& row : rows) {
    envs.insert(row.env);
    names.insert(row.name);
    EXPECT_FALSE(row.value.empty()) << row.env;
    EXPECT_FALSE(row.description.empty()) << row.env;
  }
  EXPECT_EQ(rows.size(), std::size(kSettings));
  EXPECT_EQ(envs.size(), std::size(kSettings));
  EXPECT_EQ(names.size(), std::size(kSettings));
  for (const char* name :
       {"backend", "chunk_size", "queue_depth", "workers", "max_inflight_bytes", "page_cache_check",
        "stage_reads", "bounce_idle_ms", "huge_pages", "gds", "bounce_slots", "bounce_slot_size",
        "bounce_rings", "cuda_library", "cufile_library", "max_staged_bytes", "copy_threads"}) {
    EXPECT_EQ(names.count(name), 1u) << name;
  }
}

TEST_F(EnvironmentTest, DefaultsShowBuiltInValues) {
  EXPECT_EQ(ValuesByVariable(Defaults()), (std::map<std::string, std::string>{
                                              {"TENSORTIER_BACKEND", "auto"},
                                              {"TENSORTIER_CHUNK_SIZE", "4 MiB"},
                                              {"TENSORTIER_QUEUE_DEPTH", "32"},
                                              {"TENSORTIER_WORKERS", "2"},
                                              {"TENSORTIER_MAX_INFLIGHT", "128 MiB"},
                                              {"TENSORTIER_PAGE_CACHE_CHECK", "1"},
                                              {"TENSORTIER_STAGE_READS", "auto"},
                                              {"TENSORTIER_BOUNCE_IDLE_MS", "1000"},
                                              {"TENSORTIER_MAX_STAGED", "32 MiB"},
                                              {"TENSORTIER_COPY_THREADS", "2"},
                                              {"TENSORTIER_HUGE_PAGES", "auto"},
                                              {"TENSORTIER_GDS", "off"},
                                              {"TENSORTIER_BOUNCE_SLOTS", "8"},
                                              {"TENSORTIER_BOUNCE_SLOT_SIZE", "8 MiB"},
                                              {"TENSORTIER_BOUNCE_RINGS", "4"},
                                              {"TENSORTIER_CUDA_LIBRARY", "libcuda.so.1"},
                                              {"TENSORTIER_CUFILE_LIBRARY", "libcufile.so.0"},
                                          }));
}

TEST_F(EnvironmentTest, DefaultsShowTheEffectiveValueOfEachVariable) {
  ScopedEnv a("TENSORTIER_BACKEND", "threads");
  ScopedEnv b("TENSORTIER_CHUNK_SIZE", "2M");
  ScopedEnv c("TENSORTIER_QUEUE_DEPTH", "16");
  ScopedEnv d("TENSORTIER_WORKERS", "3");
  ScopedEnv e("TENSORTIER_MAX_INFLIGHT", "64M");
  ScopedEnv f("TENSORTIER_PAGE_CACHE_CHECK", "off");
  ScopedEnv g("TENSORTIER_STAGE_READS", "0");
  ScopedEnv h("TENSORTIER_BOUNCE_IDLE_MS", "0");
  ScopedEnv i("TENSORTIER_MAX_STAGED", "8M");
  ScopedEnv j("TENSORTIER_COPY_THREADS", "0");
  EXPECT_EQ(ValuesByVariable(Defaults()), (std::map<std::string, std::string>{
                                              {"TENSORTIER_BACKEND", "threads"},
                                              {"TENSORTIER_CHUNK_SIZE", "2 MiB"},
                                              {"TENSORTIER_QUEUE_DEPTH", "16"},
                                              {"TENSORTIER_WORKERS", "3"},
                                              {"TENSORTIER_MAX_INFLIGHT", "64 MiB"},
                                              {"TENSORTIER_PAGE_CACHE_CHECK", "0"},
                                              {"TENSORTIER_STAGE_READS", "off"},
                                              {"TENSORTIER_BOUNCE_IDLE_MS", "0"},
                                              {"TENSORTIER_MAX_STAGED", "8 MiB"},
                                              {"TENSORTIER_COPY_THREADS", "0"},
                                              {"TENSORTIER_HUGE_PAGES", "auto"},
                                              {"TENSORTIER_GDS", "off"},
                                              {"TENSORTIER_BOUNCE_SLOTS", "8"},
                                              {"TENSORTIER_BOUNCE_SLOT_SIZE", "8 MiB"},
                                              {"TENSORTIER_BOUNCE_RINGS", "4"},
                                              {"TENSORTIER_CUDA_LIBRARY", "libcuda.so.1"},
                                              {"TENSORTIER_CUFILE_LIBRARY", "libcufile.so.0"},
                                          }));
}

TEST_F(EnvironmentTest, DefaultsRejectABadEnvironment) {
  ScopedEnv e("TENSORTIER_WORKERS", "zero");
  EXPECT_THROW(Defaults(), std::invalid_argument);
}

}  // namespace
}  // namespace tensortier

namespace tensortier {
namespace {

TEST(SystemPageSizeTest, IsTheKernelsPageSize) {
  EXPECT_EQ(SystemPageSize(), static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  EXPECT_EQ(SystemPageSize() % kPageSize, 0u);
}

}  // namespace
}  // namespace tensortier
