// Where one tensor of a torch.save file lies in the file, so that a shared tensor's ranks can each
// read their own rows of it in place (SharedTensor.load_checkpoint in Python). Only tensors whose
// elements are one contiguous run of bytes in the file qualify; anything else is refused with the
// reason, never copied through a slower path behind the caller's back.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tensortier {

struct TorchTensorBytes {
  std::string dtype;  // torch's name of the element type ("float32", "complex32")
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // absolute file offset of the first element
  uint64_t nbytes = 0;
};

struct TorchTensorLookup {
  std::optional<TorchTensorBytes> found;
  std::vector<std::string> keys;  // every tensor's key path, in pickle order (when not found)
};

// Looks up tensor `key` (its dotted key path: "feat", "model.emb.weight") of torch.save file
// `path` without running its pickle. Throws FormatError naming the file and `key` for a file that
// is not a readable torch.save zip (legacy format, compressed storage entries, damage) and for a
// tensor that is not one contiguous run of native-order bytes (strides, a storage offset past the
// storage, a conjugate/negative view, a meta tensor, a big-endian file); IoError when it cannot
// be read.
TorchTensorLookup LocateTorchTensor(const std::string& path, const std::string& key);

}  // namespace tensortier
