// What a load decides without tensor objects: when its progress bar draws, and the storages a
// torch pickle's persistent ids describe against their zip records.
#include <gtest/gtest.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tensortier/checkpoint/load_checks.hpp"

namespace tensortier {
namespace {

TEST(ProgressBar, DrawsTheFinalStateOnceAndEndsTheLine) {
  std::vector<std::string> written;
  ProgressBar bar("loading m.pt", 100, true, [&](const std::string& s) { written.push_back(s); });
  bar.Update(10);  // the first update draws
  bar.Update(10);  // drawn only if 100 ms have passed
  bar.Update(80);  // the end: drawn
  bar.Close();     // drawn already: only the newline
  ASSERT_GE(written.size(), 3u);
  EXPECT_NE(written[0].find("loading m.pt"), std::string::npos);
  EXPECT_NE(written[written.size() - 2].find("100.0%"), std::string::npos);
  EXPECT_EQ(written.back(), "\n");
  EXPECT_EQ(bar.done(), 100u);
}

TEST(ProgressBar, DisabledOrEmptyWritesNothingButCounts) {
  std::vector<std::string> written;
  ProgressBar off("x", 10, false, [&](const std::string& s) { written.push_back(s); });
  ProgressBar empty("x", 0, true, [&](const std::string& s) { written.push_back(s); });
  off.Update(10);
  off.Close();
  empty.Close();
  EXPECT_TRUE(written.empty());
  EXPECT_EQ(off.done(), 10u);
  EXPECT_FALSE(empty.enabled());
}

std::string StorageError(std::optional<int64_t> nbytes, const std::string& text,
                         std::optional<uint64_t> record,
                         std::optional<std::pair<std::string, uint64_t>> prior = std::nullopt) {
  try {
    CheckTorchStorage("m.pt", "m/data/0", "0", "torch.float32", nbytes, text, record, prior);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(CheckTorchStorage, ChecksTheRecordAndEarlierDescriptions) {
  EXPECT_EQ(CheckTorchStorage("m.pt", "m/data/0", "0", "torch.float32", 40, "40", 40, {}), 40u);
  EXPECT_EQ(StorageError(40, "40", std::nullopt), "m.pt: storage record m/data/0 is missing");
  EXPECT_EQ(StorageError(-4, "-4", 40), "m.pt: storage 0 has a negative size");
  EXPECT_EQ(StorageError(44, "44", 40), "m.pt: storage 0 should hold 44 bytes, its record has 40");
  EXPECT_EQ(StorageError(std::nullopt, "40000000000000000000000", 40),
            "m.pt: storage 0 should hold 40000000000000000000000 bytes, its record has 40");
  // Described again: the same dtype and size, or empty both times, is the same storage.
  using Prior = std::pair<std::string, uint64_t>;
  EXPECT_EQ(StorageError(40, "40", std::nullopt, Prior{"torch.float32", 40}), "");
  EXPECT_EQ(StorageError(0, "0", std::nullopt, Prior{"torch.int8", 0}), "");
  EXPECT_EQ(StorageError(40, "40", 40, Prior{"torch.int32", 40}),
            "m.pt: storage '0' is described twice, differently (torch.int32, 40 bytes; "
            "torch.float32, 40 bytes): the file is damaged");
}

TEST(CheckLoadOptions, RefusesVerifyWithoutBytesAndMapsOffTheCpu) {
  EXPECT_NO_THROW(CheckLoadOptions("cpu", true, true, ""));
  EXPECT_NO_THROW(CheckLoadOptions("cuda:0", true, false, ""));
  EXPECT_THROW(CheckLoadOptions("meta", true, false, ""), std::invalid_argument);
  EXPECT_NO_THROW(CheckLoadOptions("meta", false, false, ""));
  EXPECT_NO_THROW(CheckLoadOptions("meta", false, true, ""));  // mmap reads nothing there either
  try {
    CheckLoadOptions("cpu", true, false, "['cuda:1']");
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("saved at ['cuda:1'] to the meta device"),
              std::string::npos);
  }
  try {
    CheckLoadOptions("cuda:0", false, true, "");
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("needs device='cpu', not cuda:0 ("), std::string::npos);
  }
}

}  // namespace
}  // namespace tensortier
