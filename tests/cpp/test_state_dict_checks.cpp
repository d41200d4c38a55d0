// Checks of state dicts made without tensor objects: overlapping memory (what a safetensors save
// refuses), the span of ranges a mapped load touches, and load_into's name and shape matching
// (load_state_dict's error lines).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tensortier/checkpoint/state_dict_checks.hpp"
#include "tensortier/util/format_error.hpp"

namespace tensortier {
namespace {

using Names = std::vector<std::string>;

// A tensor as a checkpoint holds it: a name and a shape.
NamedTensor Saved(std::string name, std::vector<int64_t> shape) {
  return {std::move(name), std::move(shape), "", 0, 0};
}

TEST(StateDictChecksTest, OverlappingGroupsJoinChainsDeviceByDevice) {
  const std::vector<std::vector<std::string>> groups = OverlappingGroups({
      {"", 100, 10, "b"},  // meets a
      {"", 90, 20, "a"},
      {"", 120, 5, "alone"},     // starts where nothing reaches
      {"", 105, 0, "empty"},     // empty tensors overlap nothing
      {"cuda:0", 100, 50, "d"},  // the same addresses on a device are other memory
      {"cuda:0", 140, 20, "e"},
      {"cuda:0", 159, 1, "f"},  // meets e, not d: one chain
  });
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0], (Names{"a", "b"}));
  EXPECT_EQ(groups[1], (Names{"d", "e", "f"}));
  EXPECT_TRUE(OverlappingGroups({{"", 0, 8, "x"}, {"", 8, 8, "y"}}).empty());
}

TEST(StateDictChecksTest, SpanInFileRefusesRangesPastTheEnd) {
  EXPECT_EQ(SpanInFile("f", 100, {{"a", 40, 10}, {"b", 10, 5}, {"z", 99, 0}}),
            (std::pair<uint64_t, uint64_t>{10, 50}));
  EXPECT_EQ(SpanInFile("f", 100, {{"z", 100, 0}}), (std::pair<uint64_t, uint64_t>{0, 0}));
  try {
    SpanInFile("f.pt", 100, {{"a", 0, 10}, {"b", 95, 10}});
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_STREQ(e.what(),
                 "f.pt: file ended early: 'b' needs 10 bytes at offset 95, the file has 100 "
                 "(truncated file?)");
  }
  EXPECT_THROW(SpanInFile("f", 100, {{"a", INT64_MAX, 2}}), FormatError);
  EXPECT_THROW(SpanInFile("f", 100, {{"a", -8, 16}}), FormatError);
}

TEST(StateDictChecksTest, MatchStateDictSpeaksAsLoadStateDict) {
  const std::vector<NamedTensor> targets = {
      {"w", {2, 3}, "torch.float32", 1000, 24},
      {"tied", {2, 3}, "torch.float32", 1000, 24},  // w's memory: loaded with it
      {"gone", {4}, "torch.float32", 2000, 16},
      {"scalar", {}, "torch.int64", 3000, 8},
  };
  const std::vector<NamedTensor> saved = {Saved("extra", {1}), Saved("w", {2, 3}),
                                          Saved("scalar", {2})};
  const StateDictMatch strict = MatchStateDict(targets, saved, true);
  EXPECT_EQ(strict.missing, (Names{"gone"}));
  EXPECT_EQ(strict.unexpected, (Names{"extra"}));
  EXPECT_EQ(strict.errors,
            (Names{"Missing key(s) in state_dict: \"gone\". ",
                   "Unexpected key(s) in state_dict: \"extra\". ",
                   "size mismatch for scalar: copying a param with shape torch.Size([2]) from "
                   "checkpoint, the shape in current model is torch.Size([])."}));
  const StateDictMatch lax = MatchStateDict(targets, saved, false);
  EXPECT_EQ(lax.missing, strict.missing);
  EXPECT_EQ(lax.errors.size(), 1u);  // shape mismatches are errors either way
  EXPECT_TRUE(
      MatchStateDict(targets, {Saved("w", {2, 3}), Saved("gone", {4}), Saved("scalar", {})}, true)
          .errors.empty());
  // load_state_dict's rule for what older versions saved 1-dim: [1] fills a 0-dim target.
  EXPECT_TRUE(
      MatchStateDict(targets, {Saved("w", {2, 3}), Saved("gone", {4}), Saved("scalar", {1})}, true)
          .errors.empty());
}

// Shape mismatches in the model's order, as load_state_dict visits its modules, whatever the
// file's order (a safetensors file's is sorted by name: "lm_head" before "model.embed_tokens").
TEST(StateDictChecksTest, SizeMismatchesAreInTheModelsOrder) {
  const std::vector<NamedTensor> targets = {
      {"model.embed_tokens.weight", {100, 4}, "torch.float32", 1000, 1600},
      {"lm_head.weight", {100, 4}, "torch.float32", 3000, 1600},
  };
  const std::vector<NamedTensor> saved = {Saved("lm_head.weight", {128, 4}),
                                          Saved("model.embed_tokens.weight", {128, 4})};
  const StateDictMatch m = MatchStateDict(targets, saved, true);
  ASSERT_EQ(m.errors.size(), 2u);
  EXPECT_TRUE(m.errors[0].starts_with("size mismatch for model.embed_tokens.weight:"))
      << m.errors[0];
  EXPECT_TRUE(m.errors[1].starts_with("size mismatch for lm_head.weight:")) << m.errors[1];
}

}  // namespace
}  // namespace tensortier
