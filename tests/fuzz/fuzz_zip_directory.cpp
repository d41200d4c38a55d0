// Fuzz target: a whole file through the zip directory reader and the torch.save reader (which
// also runs the pickle reader on data.pkl when the directory survives).
#include <cstdint>
#include <cstdlib>

#include "tensortier/byte_source.hpp"
#include "tensortier/format_error.hpp"
#include "tensortier/torch_checkpoint.hpp"
#include "tensortier/zip_archive.hpp"

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
