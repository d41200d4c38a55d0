// Writes 1 MiB + 3 bytes at an unaligned offset and reads it back through the engine.
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

#include "tensortier/io/engine.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: round_trip FILE\n");
    return 2;
  }
  std::vector<char> out((1 << 20) + 3), in(out.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 7 + 1);
  try {
    tensortier::Engine engine;
    tensortier::File file = tensortier::File::Open(argv[1], tensortier::OpenMode::kWrite);
    engine.Write(file, out.data(), out.size(), 4097).Wait();
    const tensortier::IoResult& r = engine.Read(file, in.data(), in.size(), 4097).Wait();
    bool same = r.bytes == out.size() && std::memcmp(out.data(), in.data(), out.size()) == 0;
    std::printf("%s: %llu bytes via %s\n", same ? "ok" : "MISMATCH",
                static_cast<unsigned long long>(r.bytes), r.stats.backend.c_str());
    return same ? 0 : 1;
  } catch (const std::exception& e) {  // tensortier::IoError: errno, path, offset, length
    std::fprintf(stderr, "round_trip: %s\n", e.what());
    return 1;
  }
}
