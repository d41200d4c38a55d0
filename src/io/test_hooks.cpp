#include "tensortier/io/test_hooks.hpp"

#include <atomic>

namespace tensortier {
namespace {

std::atomic<TestHooks*> g_hooks{nullptr};

}  // namespace

void InstallTestHooks(TestHooks* hooks) noexcept {
  g_hooks.store(hooks, std::memory_order_release);
}

TestHooks* InstalledTestHooks() noexcept {
  return g_hooks.load(std::memory_order_acquire);
}

}  // namespace tensortier
