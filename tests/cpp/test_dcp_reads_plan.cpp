// How a DCP load reads each stored item (DcpFileReads: whole, straight into its target, or in
// parts), and what each read checks.
#include <gtest/gtest.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensortier/checkpoint/dcp_file.hpp"
#include "tensortier/checkpoint/dcp_reads.hpp"
#include "tensortier/io/engine.hpp"
#include "tensortier/util/strings.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

using testing::Pattern;
using testing::TempDir;

TEST(DcpFileReads, PlansWholeDirectAndPartReads) {
  TempDir dir;
  Engine engine;
  const std::string path = dir.path() + "/__0_x.distcp";
  const std::vector<uint8_t> data = Pattern(64 * 64 * 4, 1);
  std::vector<DcpWriteItem> items;
  for (int i = 0; i < 3; ++i) {
    items.push_back({"F32",
                     {64, 64},
                     data.size(),
                     reinterpret_cast<const std::byte*>(data.data()),
                     StrCat("t", i)});
  }
  items.push_back({"", {}, 10, reinterpret_cast<const std::byte*>(data.data()), "note"});
  const std::vector<DcpItemPlace> p = WriteDcpFile(engine, path, items);
  const std::vector<int64_t> shape = {64, 64};
  auto item = [&](size_t i, std::vector<DcpFileReads::Request> requests) {
    DcpFileReads::Item it;
    it.name = StrCat("t", i);
    it.offset = p[i].offset;
    it.length = p[i].length;
    it.tensor = i < 3;
    if (it.tensor) it.expected_shape = shape;
    it.requests = std::move(requests);
    it.xxh64 = p[i].xxh64;
    it.blocks = p[i].block_xxh64;
    return it;
  };
  const std::vector<DcpFileReads::Item> wanted = {
      item(0, {{{0, 0}, {64, 64}}}),                       // all of it
      item(1, {{{0, 0}, {32, 64}}, {{32, 0}, {32, 64}}}),  // two halves
      item(2, {{{8, 8}, {4, 4}}}),                         // one block
      item(3, {})};
  const DcpFileReads reads(engine, path, wanted);
  EXPECT_EQ(reads.how(0), DcpItemRead::kDirect);
  EXPECT_EQ(reads.how(1), DcpItemRead::kParts);
  EXPECT_EQ(reads.how(2), DcpItemRead::kParts);
  EXPECT_EQ(reads.how(3), DcpItemRead::kWhole);
  EXPECT_EQ(reads.tensor(3), nullptr);
  std::vector<float> part(16);
  const DcpRead r = reads.ReadOf(2, 0, reinterpret_cast<std::byte*>(part.data()));
  ASSERT_TRUE(r.slice.has_value());
  EXPECT_EQ(r.slice->itemsize, 4u);
  EXPECT_FALSE(r.xxh64.has_value());  // a part is checked by its blocks
  EXPECT_EQ(r.blocks, p[2].block_xxh64);
  EXPECT_GT(reads.Read(engine, std::vector<DcpRead>{r}), 0u);
  const float* all = reinterpret_cast<const float*>(data.data());
  EXPECT_EQ(part[5], all[9 * 64 + 9]);
  EXPECT_THROW(reads.ReadOf(0, 0, nullptr), std::invalid_argument);  // read whole, no parts
  const DcpRead whole = reads.ReadOf(3, std::nullopt, nullptr);
  EXPECT_EQ(whole.xxh64, p[3].xxh64);
  // Reading everything whole: no parts, and none checked without verification.
  const DcpFileReads full(engine, path, wanted, DcpVerify::kFull);
  EXPECT_EQ(full.how(1), DcpItemRead::kWhole);
  const DcpFileReads unchecked(engine, path, wanted, DcpVerify::kNone);
  EXPECT_FALSE(unchecked.ReadOf(0, std::nullopt, nullptr).xxh64.has_value());
  EXPECT_TRUE(unchecked.ReadOf(1, 1, nullptr).blocks.empty());
}

}  // namespace
}  // namespace tensortier
