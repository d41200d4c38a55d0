#include "tensortier/shared/shared_checkpoint.hpp"

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"

namespace tensortier {

TorchTensorLookup LocateTorchTensor(const std::string& path, const std::string& key) {
  TorchCheckpoint c;
  try {
    c = ReadTorchCheckpoint(FileSource(OpenCheckpointForReading(path, false)));
  } catch (const FormatError& e) {
    throw FormatError(StrCat("cannot load '", key, "' in place: ", e.what()));
  }
  TorchTensorLookup out;
  const TorchTensor* t = nullptr;
  for (const auto& candidate : c.pickle.tensors) {
    if (candidate.path == key) t = &candidate;
  }
  if (t == nullptr) {
    for (const auto& candidate : c.pickle.tensors) out.keys.push_back(candidate.path);
    return out;
  }
  auto refuse = [&](const std::string& why) {
    throw FormatError(StrCat(path, ": tensor '", key, "' cannot be loaded in place: ", why));
  };
  if (t->meta) refuse("it is a meta tensor (saved without data)");
  if (t->conj || t->neg) refuse("it was saved as a conjugate or negative view");
  if (c.big_endian) refuse("the file was saved on a big-endian machine (byteorder 'big')");
  if (!t->contiguous()) {
    std::string strides;
    for (size_t i = 0; i < t->stride.size(); ++i) strides += StrCat(i ? "," : "", t->stride[i]);
    refuse(StrCat("its strides (", strides,
                  ") do not give contiguous rows (save tensor.contiguous())"));
  }
  std::string_view torch_name = TorchDtypeAttribute(t->dtype);
  const unsigned element = TorchDtypeBytes(t->dtype);
  if (torch_name.empty() || element == 0) refuse(StrCat("unknown dtype ", t->dtype));
  auto storage = c.pickle.storages.find(t->storage_key);
  if (storage == c.pickle.storages.end()) refuse("its storage is missing from data.pkl");
  const uint64_t begin = static_cast<uint64_t>(t->storage_offset) * element;
  const uint64_t nbytes = t->nbytes();
  if (t->storage_offset < 0 || begin > storage->second.nbytes ||
      nbytes > storage->second.nbytes - begin) {
    refuse(StrCat("storage offset ", t->storage_offset, " and ", nbytes,
                  " bytes reach past its storage of ", storage->second.nbytes, " bytes"));
  }
  out.found = TorchTensorBytes{std::string(torch_name), t->shape,
                               storage->second.data_offset + begin, nbytes};
  return out;
}

}  // namespace tensortier
