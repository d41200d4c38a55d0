// Fuzz target: a whole file through the zip directory reader and the torch.save reader (which
// also runs the pickle reader on data.pkl when the directory survives).
#include <cstdint>
#include <cstdlib>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"
#include "tensortier/checkpoint/zip_archive.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tensortier;
  MemorySource source(data, size, "fuzz");
  try {
    ZipDirectory d = ReadZipDirectory(source);
    for (const auto& e : d.entries) {
      // Every accepted range must lie inside the input.
      if (e.data_offset > size || e.compressed_size > size - e.data_offset) std::abort();
    }
  } catch (const FormatError&) {
  }
  try {
    TorchCheckpoint c = ReadTorchCheckpoint(source);
    for (const auto& [key, s] : c.pickle.storages) {
      if (s.data_offset > size || s.nbytes > size - s.data_offset) std::abort();
    }
  } catch (const FormatError&) {
  }
  return 0;
}
