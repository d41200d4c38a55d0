// The restricted pickle reader's memory is bounded by its input: crafted 1 MiB pickles that make
// a Value per byte, rebuild 64-dimension tensors for 5 bytes each, or list one tensor a million
// times are refused before they allocate more than a few tens of MiB. Allocations are counted by
// replacing the global operator new for this test binary (counting only while a test asks).
#include <gtest/gtest.h>
#include <malloc.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

#include "tensortier/util/format_error.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"

namespace {

std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};

void Count(void* p, bool add) {
  if (p == nullptr || !g_counting.load(std::memory_order_relaxed)) return;
  auto n = static_cast<int64_t>(malloc_usable_size(p));
  int64_t live = g_live.fetch_add(add ? n : -n, std::memory_order_relaxed) + (add ? n : -n);
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
}

}  // namespace

void* operator new(std::size_t n) {
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  Count(p, true);
  return p;
}
void operator delete(void* p) noexcept {
  Count(p, false);
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  operator delete(p);
}

namespace tensortier {
namespace {

using namespace std::string_literals;

constexpr size_t kMiB = 1u << 20;
const std::string kProto = "\x80\x02"s;

// Peak bytes allocated while parsing `pickle`; `error` gets the FormatError's message, if any.
int64_t PeakWhileParsing(const std::string& pickle, std::string& error) {
  g_live = 0;
  g_peak = 0;
  g_counting = true;
  try {
    ParseTorchPickle(pickle, "crafted.pkl");
  } catch (const FormatError& e) {
    g_counting = false;
    error = e.what();
  }
  g_counting = false;
  return g_peak;
}

std::string Repeat(const std::string& s, size_t bytes) {
  std::string out;
  out.reserve(bytes + s.size());
  while (out.size() + s.size() <= bytes) out += s;
  return out;
}

// memo 0: _rebuild_tensor_v2; memo 1: the arguments of a 64-dimension float tensor of 1 element.
std::string TensorPrelude() {
  std::string ones = "(";
  for (int i = 0; i < 64; ++i) ones += "K\x01"s;
  ones += "t";
  return kProto + "ctorch._utils\n_rebuild_tensor_v2\nq\x00"s +
         "((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x00"s +
         "0X\x03\x00\x00\x00"s + "cpuK\x01tQK\x00"s + ones + ones + "\x89" +
         "ccollections\nOrderedDict\n)Rtq\x01"s + "00";
}

struct Case {
  const char* name;
  std::string pickle;
  const char* error;
};

TEST(CheckpointPickleMemory, CraftedPicklesStayWithinTensOfMiB) {
  std::string tensor = TensorPrelude();
  // memo 2: a tensor; memo 3: _rebuild_parameter; memo 4: its arguments (memo 2, False, {}).
  std::string param = tensor + "h\x00h\x01Rq\x02"s + "ctorch._utils\n_rebuild_parameter\nq\x03" +
                      "(h\x02\x89"
                      "ccollections\nOrderedDict\n)Rtq\x04" +
                      "000";
  const Case cases[] = {
      {"a Value per 2 bytes (the most a pickle may hold)", kProto + Repeat("]0", kMiB) + "N.", ""},
      {"a Value per byte", kProto + "N" + Repeat("\x85", kMiB) + ".", "values in a"},
      {"a memo entry per byte", kProto + "N" + Repeat("\x94", kMiB) + ".", "memo key"},
      {"a 64-dim tensor rebuilt per 5 bytes", tensor + "](" + Repeat("h\x00h\x01R"s, kMiB) + "e.",
       "tensor sizes and strides hold more than"},
      {"a 64-dim parameter per 5 bytes", param + "](" + Repeat("h\x03h\x04R"s, kMiB) + "e.",
       "the tensors listed would take more than"},
      {"one 64-dim tensor listed per 2 bytes",
       tensor + "h\x00h\x01Rq\x02"s + "0](" + Repeat("h\x02"s, kMiB) + "e.",
       "the tensors listed would take more than"},
  };
  for (const Case& c : cases) {
    std::string error;
    int64_t peak = PeakWhileParsing(c.pickle, error);
    if (*c.error == '\0') {
      EXPECT_EQ(error, "") << c.name;
    } else {
      EXPECT_NE(error.find(c.error), std::string::npos) << c.name << ": " << error;
    }
    std::printf("%s: peak %.1f MiB\n", c.name, static_cast<double>(peak) / kMiB);
    EXPECT_LT(peak, int64_t{64} * kMiB) << c.name << ": peak " << peak / kMiB << " MiB";
  }
}

// The caps scale with the input: a large legitimate pickle is not refused by them.
TEST(CheckpointPickleMemory, LargePlainPicklesStillParse) {
  // A list of 300000 small ints, 300000 Nones and a dict of 20000 memoized empty lists.
  std::string p = kProto + "](" + Repeat("K\x07"s, 600000) + Repeat("N", 300000) + "e0}(";
  for (int i = 0; i < 20000; ++i) {
    p += 'J';
    p.append(reinterpret_cast<const char*>(&i), 4);
    p += "]r";
    p.append(reinterpret_cast<const char*>(&i), 4);
  }
  p += "u.";
  std::string error;
  PeakWhileParsing(p, error);
  EXPECT_EQ(error, "");
}

}  // namespace
}  // namespace tensortier
