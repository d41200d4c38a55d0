// The training-data reader's inputs (fn.readers.file's combinations) and the digest its state
// names them by, which must stay hashlib.sha256's.
#include <gtest/gtest.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "tensortier/data/sample_inputs.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/sha256.hpp"
#include "test_util.hpp"

namespace tensortier {
namespace {

std::string Sha256Of(const std::string& bytes) {
  Sha256 hash;
  hash.Update(bytes);
  return hash.HexDigest();
}

TEST(Sha256Test, MatchesKnownDigests) {
  EXPECT_EQ(Sha256Of(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Of("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // Across blocks, fed whole and in uneven pieces.
  EXPECT_EQ(Sha256Of(std::string(1000, 'a')),
            "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3");
  Sha256 pieces;
  for (size_t fed = 0, piece = 1; fed < 1000; fed += piece, piece = piece % 97 + 1) {
    pieces.Update(std::string(std::min(piece, 1000 - fed), 'a'));
  }
  EXPECT_EQ(pieces.HexDigest(), Sha256Of(std::string(1000, 'a')));
}

TEST(SampleInputsTest, SpelledDigestIsPathsThenLittleEndianLabels) {
  // hashlib.sha256(b"/x/a\0" b"/b\0" + np.array([1, -2], "<i4").tobytes()).hexdigest()
  EXPECT_EQ(FilesDigest({"/x/a", "/b"}, {1, -2}, true),
            "af1b0471f4dea3c0f088696b6ed290b87612ee91eb91e6b042f17c45d5a6d913");
  // The root's folders are real already: resolving them changes nothing.
  EXPECT_EQ(FilesDigest({"/b"}, {0}, false), FilesDigest({"/b"}, {0}, true));
  EXPECT_EQ(FilesDigest({"//b"}, {0}, false), FilesDigest({"/b"}, {0}, true));
  EXPECT_NE(FilesDigest({"/b"}, {0}, false), FilesDigest({"/b"}, {1}, false));
}

TEST(SampleInputsTest, FilesAreJoinedToTheRootAndLabelledByPosition) {
  SampleInputs in;
  in.root = "/data/";
  in.files = std::vector<std::string>{"a.jpg", "/abs/b.jpg"};
  in.check_files = false;
  const SampleList list = ResolveSampleInputs(in);
  EXPECT_EQ(list.paths, (std::vector<std::string>{"/data/a.jpg", "/abs/b.jpg"}));
  EXPECT_EQ(list.labels, (std::vector<int32_t>{0, 1}));
}

TEST(SampleInputsTest, CombinationsDaliRefusesAreRefused) {
  SampleInputs both;
  both.files = std::vector<std::string>{"a"};
  both.file_list = "list.txt";
  EXPECT_THROW(ResolveSampleInputs(both), std::invalid_argument);
  SampleInputs labels_only;
  labels_only.labels = std::vector<int64_t>{1};
  EXPECT_THROW(ResolveSampleInputs(labels_only), std::invalid_argument);
  EXPECT_THROW(ResolveSampleInputs(SampleInputs{}), std::invalid_argument);
  SampleInputs miscounted;
  miscounted.files = std::vector<std::string>{"a", "b"};
  miscounted.labels = std::vector<int64_t>{1};
  EXPECT_THROW(ResolveSampleInputs(miscounted), std::invalid_argument);
  SampleInputs too_big;
  too_big.files = std::vector<std::string>{"a"};
  too_big.labels = std::vector<int64_t>{int64_t{1} << 31};
  too_big.check_files = false;
  EXPECT_THROW(ResolveSampleInputs(too_big), std::invalid_argument);
}

// A file_root's links: to a file, listed; to a folder, not a file; to nothing, refused when the
// list is made (as files= refuses a missing file), not when its batch is read.
TEST(SampleInputsTest, AFileRootsLinksAreFollowedAndALinkToNothingRefused) {
  testing::TempDir dir;
  std::filesystem::create_directories(dir.File("c0/folder.jpg"));
  std::ofstream(dir.File("c0/a.jpg")) << "a";
  std::filesystem::create_symlink(dir.File("c0/a.jpg"), dir.File("c0/b.jpg"));
  std::filesystem::create_directory_symlink(dir.File("c0/folder.jpg"), dir.File("c0/c.jpg"));
  SampleInputs in;
  in.root = dir.path();
  EXPECT_EQ(ResolveSampleInputs(in).paths,
            (std::vector<std::string>{dir.File("c0/a.jpg"), dir.File("c0/b.jpg")}));
  std::filesystem::create_symlink(dir.File("gone.jpg"), dir.File("c0/d.jpg"));
  try {
    ResolveSampleInputs(in);
    FAIL() << "a link to nothing was listed";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_EQ(e.path(), dir.File("c0/d.jpg"));
  }
}

}  // namespace
}  // namespace tensortier
