// The host memory DCP's asynchronous saves stage into (staging_arenas.hpp): reused once free.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "tensortier/checkpoint/staging_arenas.hpp"

namespace tensortier {
namespace {

TEST(StagingArenas, HeldArenasAreNotLentUntilWrittenOrLetGo) {
  StagingArenas arenas;
  std::shared_ptr<StagingArena> a = arenas.Take(8192, std::nullopt);
  ASSERT_GE(a->size(), 8192u);
  std::byte* first = a->data();
  std::shared_ptr<StagingArena> b = arenas.Take(4096, std::nullopt);  // a is held: a new one
  EXPECT_NE(b->data(), first);
  EXPECT_EQ(arenas.count(), 2u);
  std::byte* second = b->data();
  b.reset();  // let go (a save that failed before writing): lent again
  std::shared_ptr<StagingArena> c = arenas.Take(4096, std::nullopt);
  EXPECT_EQ(c->data(), second);
  const std::vector<uintptr_t> written = {reinterpret_cast<uintptr_t>(first) + 100};
  arenas.MarkWritten(written);  // a's save wrote its file: lent again, though still held
  std::shared_ptr<StagingArena> d = arenas.Take(8192, std::nullopt);
  EXPECT_EQ(d->data(), first);
  EXPECT_EQ(arenas.count(), 2u);
  a.reset();
  c.reset();
  d.reset();
  // Free arenas too small are given back when a larger one is needed.
  std::shared_ptr<StagingArena> big = arenas.Take(1 << 20, std::nullopt);
  EXPECT_EQ(arenas.count(), 1u);
  EXPECT_GE(big->size(), 1u << 20);
}

}  // namespace
}  // namespace tensortier
