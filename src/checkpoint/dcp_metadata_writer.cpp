// Writes a DCP .metadata without Python objects: its index (dcp_metadata_index.cpp), then the
// pickle of the Metadata object, as pickle.dumps would give it field for field (each dataclass
// made by cls.__new__ and filled by BUILD with its __dict__, TensorProperties by its __setstate__
// tuple, torch.Size and the memory-format enum by REDUCE). A save of many small tensors spends most
// of its time making and pickling these objects in Python; this makes the same file from plain
// values.
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "dcp_metadata_index.hpp"
#include "pickle_emitter.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

// Python's unpickler decodes BINUNICODE as UTF-8 with "surrogatepass": a string must be UTF-8,
// lone surrogates allowed where `surrogates` (a path's bytes that are not UTF-8, which Python
// holds as lone surrogates and pickle writes so). State dict keys stay strict UTF-8.
void CheckUtf8(std::string_view s, std::string_view what, bool surrogates = false) {
  if (!IsUtf8(s, surrogates)) {
    throw std::invalid_argument(StrCat("DCP metadata: ", what, " is not valid UTF-8"));
  }
}

class MetadataEmitter {
 public:
  std::string Emit(const DcpMetadataContents& md) {
    Object("Metadata", [&] {
      e_.Op('}');
      e_.Put();
      e_.Op('(');
      Key("state_dict_metadata");
      e_.Dict(md.entries.size(), [&](size_t i) { Entry(md.entries[i]); });
      Key("planner_data");
      if (md.planner_data) {
        e_.Dict(md.planner_data->size(), [&](size_t i) {
          const auto& [fqn, path] = (*md.planner_data)[i];
          Text(fqn, "a planner_data key");
          KeyPath(path);
        });
      } else {
        e_.None();
      }
      Key("storage_data");
      e_.Dict(md.storage.size(), [&](size_t i) { Storage(md.storage[i]); });
      Key("storage_meta");
      StorageMeta(md);
      Key("version");
      Text(md.version, "the version");
      e_.Op('u');  // SETITEMS
    });
    e_.Op('.');
    return e_.Take();
  }

 private:
  // An instance of the metadata module's class `name`, its state pushed by `state`, then BUILD.
  template <typename F>
  void Object(std::string_view name, F&& state, std::string_view module = kDcpMetadataModule) {
    e_.Global(module, name);
    e_.NewObj();
    state();
    e_.Op('b');
  }
  // A dict's field name: one interned string in Python, memoized once.
  void Key(std::string_view name) { e_.SharedStr(name); }
  void Text(std::string_view s, std::string_view what, bool surrogates = false) {
    CheckUtf8(s, what, surrogates);
    e_.Str(s);
  }
  void OptionalText(const std::optional<std::string>& s, std::string_view what) {
    if (s) {
      Text(*s, what);
    } else {
      e_.None();
    }
  }
  void Size(const std::vector<int64_t>& v) {  // torch.Size(tuple): REDUCE of ((v...),)
    e_.Global("torch", "Size");
    e_.IntTuple(v);
    e_.TupleEnd(1);
    e_.Op('R');
    e_.Put();
  }
  // A dataclass's __dict__ state: MARK, the pairs `fields` pushes, SETITEMS, after EMPTY_DICT.
  template <typename F>
  void Fields(F&& fields) {
    e_.Op('}');
    e_.Put();
    e_.Op('(');
    fields();
    e_.Op('u');
  }

  void Entry(const DcpMetadataEntry& entry) {
    Text(entry.fqn, "a state dict key");
    if (entry.bytes) {
      e_.Global(kDcpMetadataModule, "BytesStorageMetadata");
      e_.NewObj();  // no state: an empty __dict__ is not pickled
      return;
    }
    if (entry.dtype.empty() || entry.dtype.find_first_not_of(
                                   "abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos) {
      throw std::invalid_argument(
          StrCat("DCP metadata: '", entry.fqn, "' has dtype '", entry.dtype, "'"));
    }
    Object("TensorStorageMetadata", [&] {
      Fields([&] {
        Key("properties");
        Object("TensorProperties", [&] {  // __setstate__'s tuple
          e_.Op('(');
          e_.Global("torch", entry.dtype);
          e_.Global("torch.serialization", "_get_layout");
          Text(entry.layout, "a layout");
          e_.TupleEnd(1);
          e_.Op('R');
          e_.Put();
          e_.Bool(entry.requires_grad);
          e_.Global(kDcpMetadataModule, "_MEM_FORMAT_ENCODING");
          e_.IntTuple(std::vector<int64_t>{entry.memory_format});
          e_.Op('R');
          e_.Put();
          e_.Bool(entry.pin_memory);
          e_.TupleEnd(5);
        });
        Key("size");
        Size(entry.size);
        Key("chunks");
        e_.List(entry.chunks.size(), [&](size_t i) {
          Object("ChunkStorageMetadata", [&] {
            Fields([&] {
              Key("offsets");
              Size(entry.chunks[i].first);
              Key("sizes");
              Size(entry.chunks[i].second);
            });
          });
        });
      });
    });
  }

  void KeyPath(const DcpKeyPath& path) {
    if (path.empty()) {
      e_.Op(')');
      return;
    }
    if (path.size() > 3) e_.Op('(');
    for (const auto& part : path) {
      if (const auto* s = std::get_if<std::string>(&part)) {
        Text(*s, "a planner_data path");
      } else {
        e_.SignedInt(std::get<int64_t>(part));
      }
    }
    e_.TupleEnd(path.size());
  }

  void Storage(const DcpStorageEntry& s) {
    Object("MetadataIndex", [&] {
      Fields([&] {
        Key("fqn");
        Text(s.fqn, "a state dict key");
        Key("index");
        if (s.index) {
          e_.SignedInt(*s.index);
        } else {
          e_.None();
        }
        if (s.offset) {  // MetadataIndex.__init__ sets no offset where it is None
          Key("offset");
          Size(*s.offset);
        }
      });
    });
    Object(
        "_StorageInfo",
        [&] {
          Fields([&] {  // its __getstate__: the fields that are not None
            Key("relative_path");
            e_.SharedStr(s.relative_path);  // one string per file, as the writer's
            Key("offset");
            e_.Int(s.offset_in_file);
            Key("length");
            e_.Int(s.length);
            if (s.xxh64) {
              Key("xxh64");
              e_.Int(*s.xxh64);
            }
            if (!s.block_xxh64.empty()) {
              Key("xxh64_blocks");
              e_.Bytes(s.block_xxh64);
            }
          });
        },
        "torch.distributed.checkpoint.filesystem");
  }

  void StorageMeta(const DcpMetadataContents& md) {
    Object("StorageMeta", [&] {
      Fields([&] {
        Key("checkpoint_id");
        e_.Global("pathlib", "PosixPath");
        Text(md.checkpoint_id, "the checkpoint id", /*surrogates=*/true);
        e_.TupleEnd(1);
        e_.Op('R');
        e_.Put();
        Key("save_id");
        OptionalText(md.save_id, "the save id");
        Key("load_id");
        OptionalText(md.load_id, "the load id");
        Key("modules");
        e_.List(md.modules.size(), [&](size_t i) { Text(md.modules[i], "a module"); });
        if (md.format) {
          Key("tensortier_format");
          e_.SignedInt(*md.format);
        }
      });
    });
  }

  Emitter e_{4};
};

}  // namespace

std::string SerializeDcpMetadata(const DcpMetadataContents& md) {
  const std::string body = MetadataEmitter().Emit(md);
  const std::string index = EncodeDcpMetadataIndex(md, body);
  std::string out(
      "\x80\x04"
      "B",
      3);  // PROTO 4 (as pickle.dumps), BINBYTES: the index
  for (int i = 0; i < 4; ++i) out += static_cast<char>((index.size() >> (8 * i)) & 0xFF);
  out += index;
  out += '0';  // POP: the Metadata's readers never see it
  out += body;
  return out;
}

}  // namespace tensortier
