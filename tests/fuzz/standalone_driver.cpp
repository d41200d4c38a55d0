// A stand-in for libFuzzer's main() where the compiler has no -fsanitize=fuzzer (GCC): runs every
// seed input, then deterministic random mutations of them until a time or run limit. Accepts the
// libFuzzer flags the scripts use (-max_total_time=S, -runs=N, -seed=N) and seed files or
// directories. A crash, sanitizer report or uncaught exception fails the run, as with libFuzzer.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

struct Rng {
  uint64_t s;
  uint64_t Next() {  // xorshift64*
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 0x2545F4914F6CDD1Dull;
  }
  size_t Below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(Next() % n); }
};

void Mutate(std::vector<uint8_t>& d, Rng& rng, const std::vector<std::vector<uint8_t>>& seeds) {
  static constexpr uint64_t kInteresting[] = {
      0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0xFFFFFFFF, 0x7FFFFFFF, 1ull << 32, ~0ull, 4096, 100000001};
  int steps = 1 + static_cast<int>(rng.Below(6));
  for (int i = 0; i < steps; ++i) {
    size_t pos = rng.Below(d.size() + 1);
    switch (rng.Below(8)) {
      case 0:  // flip a bit
        if (!d.empty()) d[rng.Below(d.size())] ^= static_cast<uint8_t>(1u << rng.Below(8));
        break;
      case 1:  // random byte
        if (!d.empty()) d[rng.Below(d.size())] = static_cast<uint8_t>(rng.Next());
        break;
      case 2: {  // interesting little-endian integer
        uint64_t v = kInteresting[rng.Below(std::size(kInteresting))];
        size_t width = size_t{1} << rng.Below(4);
        for (size_t k = 0; k < width && pos + k < d.size(); ++k) d[pos + k] = (v >> (8 * k)) & 0xFF;
        break;
      }
      case 3:  // truncate
        d.resize(rng.Below(d.size() + 1));
        break;
      case 4: {  // delete a range
        size_t n = rng.Below(std::min<size_t>(d.size() - std::min(pos, d.size()), 64) + 1);
        if (pos < d.size()) d.erase(d.begin() + pos, d.begin() + std::min(d.size(), pos + n));
        break;
      }
      case 5: {  // insert random bytes
        size_t n = 1 + rng.Below(16);
        for (size_t k = 0; k < n; ++k) d.insert(d.begin() + pos, static_cast<uint8_t>(rng.Next()));
        break;
      }
      case 6: {  // duplicate a chunk of this input
        if (d.empty()) break;
        size_t from = rng.Below(d.size());
        size_t n = std::min<size_t>(1 + rng.Below(64), d.size() - from);
        std::vector<uint8_t> chunk(d.begin() + from, d.begin() + from + n);
        d.insert(d.begin() + std::min(pos, d.size()), chunk.begin(), chunk.end());
        break;
      }
      case 7: {  // splice in a chunk of another seed
        const auto& other = seeds[rng.Below(seeds.size())];
        if (other.empty() || d.empty()) break;
        size_t from = rng.Below(other.size());
        size_t n = std::min<size_t>(1 + rng.Below(64), other.size() - from);
        for (size_t k = 0; k < n && pos + k < d.size(); ++k) d[pos + k] = other[from + k];
        break;
      }
    }
  }
  if (d.size() > (1u << 20)) d.resize(1u << 20);
}

void AddSeed(const std::filesystem::path& p, std::vector<std::vector<uint8_t>>& seeds) {
  std::ifstream in(p, std::ios::binary);
  seeds.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 20;
  uint64_t runs = UINT64_MAX;
  uint64_t seed = 1;
  std::vector<std::vector<uint8_t>> seeds;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("-max_total_time=", 0) == 0) {
      seconds = std::stod(a.substr(16));
    } else if (a.rfind("-runs=", 0) == 0) {
      runs = std::stoull(a.substr(6));
    } else if (a.rfind("-seed=", 0) == 0) {
      seed = std::stoull(a.substr(6));
    } else if (a.rfind("-", 0) == 0) {
      std::fprintf(stderr, "ignoring libFuzzer flag %s\n", a.c_str());
    } else if (std::filesystem::is_directory(a)) {
      for (const auto& e : std::filesystem::directory_iterator(a)) {
        if (e.is_regular_file()) AddSeed(e.path(), seeds);
      }
    } else {
      AddSeed(a, seeds);
    }
  }
  if (seeds.empty()) seeds.emplace_back();
  for (const auto& s : seeds) LLVMFuzzerTestOneInput(s.data(), s.size());
  Rng rng{seed * 0x9E3779B97F4A7C15ull | 1};
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  uint64_t done = 0;
  std::vector<uint8_t> input;
  while (done < runs && std::chrono::steady_clock::now() < deadline) {
    for (int batch = 0; batch < 64 && done < runs; ++batch, ++done) {
      input = seeds[rng.Below(seeds.size())];
      Mutate(input, rng, seeds);
      LLVMFuzzerTestOneInput(input.data(), input.size());
    }
  }
  std::printf("%s: %zu seeds, %llu mutated inputs, no crash\n", argv[0], seeds.size(),
              static_cast<unsigned long long>(done));
  return 0;
}
