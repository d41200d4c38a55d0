#include "tensortier/checkpoint/torch_checkpoint.hpp"

#include <cctype>
#include <cstring>
#include <stdexcept>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

bool LooksLikeZip(const ByteSource& source) {
  if (source.size() < 4) return false;
  unsigned char magic[4];
  source.ReadAt(0, magic, 4);
  return std::memcmp(magic, "PK\x03\x04", 4) == 0 || std::memcmp(magic, "PK\x05\x06", 4) == 0;
}

void ThrowLegacyTorchFile(const std::string& path) {
  throw UnsupportedFormatError(
      StrCat(path,
             ": legacy torch.save format (PyTorch < 1.6, not a zip file) is not "
             "supported; load it with torch.load and save it again"));
}

void CheckTorchFileVersion(const ByteSource& source, const ZipDirectory& zip,
                           const std::string& prefix) {
  const std::string folder = prefix.empty() ? prefix : prefix + "/";
  const ZipEntry* record = zip.Find(folder + ".data/version");
  if (record == nullptr) record = zip.Find(folder + "version");
  const std::string& path = source.name();
  if (record == nullptr) {
    // torch's reader requires the record (PyTorchStreamReader::init): without it torch.load
    // refuses the file, so a file that loads here would not load in torch.
    throw FormatError(StrCat(path, ": zip file without a format version record ('", folder,
                             "version' or '", folder,
                             ".data/version'): not a torch.save file (torch.load refuses it)"));
  }
  RequireStored(*record, path);
  // torch reads it with std::stoull: leading white space, digits, anything after them ignored.
  std::string text(record->size > 32 ? 32 : record->size, '\0');
  source.ReadAt(record->data_offset, text.data(), text.size());
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i < text.size() && text[i] == '+') ++i;
  size_t first = i;
  uint64_t version = 0;  // stops growing past the limit: only whether it is in range matters
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    if (version <= kTorchMaxFileVersion)
      version = version * 10 + static_cast<uint64_t>(text[i] - '0');
  }
  if (i == first) {
    throw FormatError(StrCat(path, ": zip entry '", record->name,
                             "' is not a format version number: not a torch.save file"));
  }
  if (version < kTorchMinFileVersion || version > kTorchMaxFileVersion) {
    throw FormatError(StrCat(path, ": torch.save format version ", text.substr(first, i - first),
                             " (zip entry '", record->name, "') is not one torch reads (",
                             kTorchMinFileVersion, " to ", kTorchMaxFileVersion,
                             "): written by a newer PyTorch, or damaged"));
  }
}

std::string TorchArchivePrefix(const ZipDirectory& zip, const std::string& path) {
  // data.pkl sits one folder deep; the folder name is whatever the writer chose. torch's reader
  // takes records only inside a folder: a data.pkl at the top is not a torch.save file.
  const ZipEntry* pkl = nullptr;
  for (const auto& e : zip.entries) {
    const size_t slash = e.name.find('/');
    if (slash != std::string::npos && e.name.substr(slash) == "/data.pkl") {
      if (pkl != nullptr) {
        throw FormatError(StrCat(path, ": more than one data.pkl ('", pkl->name, "', '", e.name,
                                 "'): not a torch.save file"));
      }
      pkl = &e;
    }
  }
  if (pkl == nullptr) {
    throw FormatError(StrCat(path,
                             ": zip file without a <folder>/data.pkl entry: not a torch.save "
                             "file (missing entry)"));
  }
  std::string prefix = pkl->name.substr(0, pkl->name.find('/'));
  if (zip.Find(prefix + "/constants.pkl") != nullptr) {
    throw FormatError(
        StrCat(path, ": a TorchScript archive, not a torch.save checkpoint: use torch.jit.load"));
  }
  return prefix;
}

bool IsPlainDict(const TorchPickle& pickle, std::string_view data) {
  if (pickle.other_values != 0 || pickle.tensors.empty()) return false;
  std::vector<TorchPickleTensor> plain;
  plain.reserve(pickle.tensors.size());
  for (const TorchTensor& t : pickle.tensors) {
    if (t.meta || t.requires_grad || t.parameter || t.conj || t.neg || t.storage_offset != 0 ||
        !t.contiguous()) {
      return false;
    }
    plain.push_back(
        {t.path, t.dtype, std::vector<uint64_t>(t.shape.begin(), t.shape.end()), t.storage_key});
  }
  try {
    return SerializeTorchPickle(plain) == data;
  } catch (const std::invalid_argument&) {  // what SerializeTorchPickle cannot write
    return false;
  }
}

bool TorchByteOrderIsBig(const std::string& path, std::string_view value) {
  if (value == "big") return true;
  if (value == "little") return false;
  throw FormatError(
      StrCat(path, ": byte order ", PyRepr(value.substr(0, 16)), " is neither 'little' nor 'big'"));
}

TorchCheckpoint ReadTorchCheckpoint(const ByteSource& source, bool opaque_objects) {
  const std::string& path = source.name();
  if (!LooksLikeZip(source)) {
    unsigned char first = 0;
    if (source.size() > 0) source.ReadAt(0, &first, 1);
    if (first == 0x80) ThrowLegacyTorchFile(path);
    throw FormatError(StrCat(path, ": not a torch.save zip file"));
  }
  return ReadTorchCheckpoint(source, ReadZipDirectory(source), opaque_objects);
}

TorchCheckpoint ReadTorchCheckpoint(const ByteSource& source, ZipDirectory zip,
                                    bool opaque_objects) {
  const std::string& path = source.name();
  TorchCheckpoint out;
  out.zip = std::move(zip);
  out.prefix = TorchArchivePrefix(out.zip, path);
  const ZipEntry* pkl = out.zip.Find(out.prefix + "/data.pkl");
  RequireStored(*pkl, path);  // within the file: torch.load reads a pickle of any size
  CheckTorchFileVersion(source, out.zip, out.prefix);
  if (const ZipEntry* order = out.zip.Find(out.prefix + "/byteorder")) {
    RequireStored(*order, path);
    std::string value(order->size > 16 ? 16 : order->size, '\0');
    source.ReadAt(order->data_offset, value.data(), value.size());
    out.big_endian = TorchByteOrderIsBig(path, value);
  }
  std::string data(pkl->size, '\0');
  source.ReadAt(pkl->data_offset, data.data(), data.size());
  out.pickle_crc32 = Crc32(data.data(), data.size());
  out.pickle = ParseTorchPickle(data, StrCat(path, ": ", pkl->name), opaque_objects);
  std::unordered_map<std::string_view, const ZipEntry*> by_name;
  for (const auto& e : out.zip.entries) by_name.emplace(e.name, &e);
  for (auto& [key, storage] : out.pickle.storages) {
    std::string name = StrCat(out.prefix, "/data/", key);
    auto it = by_name.find(name);
    const ZipEntry* e = it == by_name.end() ? nullptr : it->second;
    if (e == nullptr) throw FormatError(StrCat(path, ": missing entry '", name, "'"));
    RequireStored(*e, path);
    if (e->size != storage.nbytes) {
      throw FormatError(StrCat(path, ": entry '", name, "' has ", e->size,
                               " bytes but its storage needs ", storage.nbytes));
    }
    storage.data_offset = e->data_offset;
  }
  out.plain_dict = !out.big_endian && IsPlainDict(out.pickle, data);
  return out;
}

}  // namespace tensortier
