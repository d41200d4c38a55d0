// torch.save zip files (PyTorch >= 1.6): "<prefix>/data.pkl" describes the object, each storage
// is a stored entry "<prefix>/data/<key>" that the engine can read in place. The legacy format
// (a bare pickle stream) is recognised and refused with a clear message.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tensortier/checkpoint/byte_source.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/checkpoint/zip_archive.hpp"

namespace tensortier {

struct TorchCheckpoint {
  std::string prefix;  // the archive's top folder ("archive" by default)
  ZipDirectory zip;
  TorchPickle pickle;  // storages have data_offset set
  // The CRC-32 of data.pkl's bytes as read: its entry's record is checked against it without
  // reading the entry again.
  uint32_t pickle_crc32 = 0;
  // The "byteorder" record says "big": every element's bytes are in big-endian order (torch.save
  // on a big-endian machine). Files without the record are read as little-endian, as torch does
  // on little-endian machines.
  bool big_endian = false;
  // data.pkl is byte for byte what torch.save writes for a plain dict {name: tensor} of its
  // tensors (SerializeTorchPickle), little-endian: torch.load gives that dict, each tensor
  // contiguous in a storage of its own.
  bool plain_dict = false;
};

// Whether the "byteorder" record's `value` says big-endian ("big") rather than "little";
// FormatError naming `path` for anything else. Every reader of torch files checks it here.
bool TorchByteOrderIsBig(const std::string& path, std::string_view value);

// Whether `data` (data.pkl, parsed as `pickle`) is exactly what SerializeTorchPickle writes for
// pickle's tensors: a plain dict of tensors, each alone in its storage, nothing else.
bool IsPlainDict(const TorchPickle& pickle, std::string_view data);

// The file format versions torch's reader accepts (caffe2/serialize/versions.h): a later
// version may lay data out in ways this reader does not know, so it is refused, as torch refuses
// it, rather than read into possibly wrong tensors.
inline constexpr uint64_t kTorchMinFileVersion = 1;
inline constexpr uint64_t kTorchMaxFileVersion = 10;

// Checks the archive's format version: the "<prefix>/.data/version" record, else
// "<prefix>/version" (a decimal number, as torch parses it; an empty prefix: at the top), from
// kTorchMinFileVersion to kTorchMaxFileVersion. An archive with neither record is refused, as
// torch refuses it. Throws FormatError naming the file, IoError.
void CheckTorchFileVersion(const ByteSource& source, const ZipDirectory& zip,
                           const std::string& prefix);

// The folder of the archive's records: that of its one "<folder>/data.pkl" entry (torch's reader
// takes records only inside a folder). Throws FormatError naming `path` for an archive without
// one or with several, and for a TorchScript archive (a "constants.pkl" beside it).
std::string TorchArchivePrefix(const ZipDirectory& zip, const std::string& path);

// Reads the zip directory and data.pkl, checks that every storage has a stored entry of the right
// size and reads the byte order and the format version. Throws FormatError / IoError.
// `opaque_objects`: as ParseTorchPickle's.
TorchCheckpoint ReadTorchCheckpoint(const ByteSource& source, bool opaque_objects = false);
// The same with the archive's directory read already (ReadZipDirectory of `source`).
TorchCheckpoint ReadTorchCheckpoint(const ByteSource& source, ZipDirectory zip,
                                    bool opaque_objects = false);

// True when the first bytes look like a zip file (local header or empty-archive end record).
bool LooksLikeZip(const ByteSource& source);

// Throws the UnsupportedFormatError (a FormatError) naming `path` that refuses a legacy (non-zip,
// PyTorch < 1.6) torch.save file: a pickle stream from its first byte.
[[noreturn]] void ThrowLegacyTorchFile(const std::string& path);

}  // namespace tensortier
