// The checkpoint pipeline's planning rules: the safetensors layout every writer follows, the
// checksum metadata, packed-dtype shapes and big-endian byte order. Its streaming steps run end to
// end in the CLI tests (tests/python/test_cli*.py) and the Python package's tests.
#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/safetensors.hpp"

namespace tensortier {
namespace {

TEST(CheckpointPipeline, LayoutPutsWholePagesFirstThenWidestElements) {
  // 100 bytes of F16, 8192 of F32, 12 of I8, 4096 of F64, 24 of F64.
  const std::vector<uint64_t> sizes = {100, 8192, 12, 4096, 24};
  const std::vector<unsigned> widths = {2, 4, 1, 8, 8};
  const std::vector<uint64_t> starts = PlanSafetensorsLayout(sizes, widths);
  // 8192 and 4096 (in order), then F64 24, F16 100, I8 12.
  EXPECT_EQ(starts, (std::vector<uint64_t>{8192 + 4096 + 24, 0, 8192 + 4096 + 24 + 100, 8192,
                                           8192 + 4096}));
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(starts[i] % widths[i], 0u) << i;
    if (sizes[i] % kCheckpointAlignment == 0) {
      EXPECT_EQ(starts[i] % kCheckpointAlignment, 0u);
    }
  }
  EXPECT_TRUE(PlanSafetensorsLayout({}, {}).empty());
  EXPECT_THROW(PlanSafetensorsLayout({1, 2}, {1}), std::invalid_argument);
}

TEST(CheckpointPipeline, ChecksumMetadataHasFixedLengthAndVerifies) {
  std::vector<SafetensorsEntry> entries = {{"b", "F32", {2}, 0, 8}, {"a\"q", "U8", {3}, 8, 11}};
  std::vector<std::pair<std::string, uint64_t>> sums = {{"b", 0}, {"a\"q", 0}};
  SafetensorsMetadata planned = {{"format", "pt"}};
  SetChecksumMetadata(entries, sums, planned);
  sums = {{"b", 0xfedcba9876543210ull}, {"a\"q", 1}};
  SafetensorsMetadata final_md = {{"format", "pt"}};
  SetChecksumMetadata(entries, sums, final_md);
  EXPECT_EQ(planned.at(kTensorChecksumsKey).size(), final_md.at(kTensorChecksumsKey).size());
  EXPECT_EQ(final_md.at(kTensorChecksumsKey),
            R"({"b":"fedcba9876543210","a\"q":"0000000000000001"})");
  // The header checksum ignores the data checksums: planned and final headers agree on it.
  EXPECT_EQ(planned.at(kHeaderChecksumKey), final_md.at(kHeaderChecksumKey));
  EXPECT_EQ(ParseStoredChecksum(final_md.at(kHeaderChecksumKey)),
            SafetensorsHeaderDigest(entries, final_md));
  const TensorChecksums read =
      ReadTensorChecksums(final_md.at(kTensorChecksumsKey), {"b", "a\"q"});
  EXPECT_TRUE(read.problems.empty());
  EXPECT_EQ(read.want[0], 0xfedcba9876543210ull);
  EXPECT_EQ(read.want[1], 1u);
  EXPECT_EQ(
      SerializeSafetensorsHeader(entries, planned).size(),
      SerializeSafetensorsHeader(entries, final_md).size());
}

TEST(CheckpointPipeline, PackedShapesGoBothWays) {
  EXPECT_EQ(SafetensorsShape("w", "F4_X2", {3, 5}), (std::vector<uint64_t>{3, 10}));
  EXPECT_EQ(TorchShape("w", "F4", {3, 10}), (std::vector<uint64_t>{3, 5}));
  EXPECT_EQ(SafetensorsShape("w", "F32", {3, 5}), (std::vector<uint64_t>{3, 5}));
  EXPECT_EQ(TorchShape("w", "F32", {}), (std::vector<uint64_t>{}));
  EXPECT_THROW(SafetensorsShape("w", "F4_X2", {}), std::invalid_argument);
  EXPECT_THROW(TorchShape("w", "F4", {3, 7}), std::invalid_argument);
  EXPECT_THROW(TorchShape("w", "F4", {}), std::invalid_argument);
}

TEST(CheckpointPipeline, BigEndianUnitsAreReversedByElementOrComplexHalf) {
  EXPECT_EQ(BigEndianSwapWidth("F32"), 4u);
  EXPECT_EQ(BigEndianSwapWidth("C64"), 4u);  // each half of a complex number on its own
  EXPECT_EQ(BigEndianSwapWidth("F64"), 8u);
  EXPECT_EQ(BigEndianSwapWidth("U8"), 0u);  // untyped storages are left as they are
  EXPECT_EQ(BigEndianSwapWidth("I8"), 0u);
  std::array<std::byte, 8> b;
  for (size_t i = 0; i < b.size(); ++i) b[i] = std::byte(i);
  ReverseUnits(b.data(), b.size(), 4);
  EXPECT_EQ(b, (std::array<std::byte, 8>{std::byte(3), std::byte(2), std::byte(1), std::byte(0),
                                         std::byte(7), std::byte(6), std::byte(5), std::byte(4)}));
  ReverseUnits(b.data(), b.size(), 0);  // no-op
  EXPECT_EQ(b[0], std::byte(3));
}

TEST(CheckpointPipeline, ProgressLineShowsBarPercentBytesAndRate) {
  const uint64_t gib = 1ull << 30;
  EXPECT_EQ(ProgressLine("loading m", gib / 2, gib, 0.5),
            "\rloading m [" + std::string(15, '#') + std::string(15, ' ') +
                "]  50.0% 0.50/1.00 GiB 1.07 GB/s");
  EXPECT_EQ(ProgressLine("x", 0, 0, 0),
            "\rx [" + std::string(30, '#') + "] 100.0% 0.00/0.00 GiB 0.00 GB/s");
}

TEST(CheckpointPipeline, HexDigitsHaveFixedWidths) {
  EXPECT_EQ(Hex8(0xab), "000000ab");
  EXPECT_EQ(Hex16(0x1234), "0000000000001234");
}

}  // namespace
}  // namespace tensortier
