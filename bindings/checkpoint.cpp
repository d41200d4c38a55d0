// tensortier._core checkpoint functions: safetensors headers, zip directories of torch.save files,
// checksums. Parsing happens with the GIL released; results cross as plain tuples, lists and dicts
// so the Python layer (python/tensortier/checkpoint/) owns all torch glue. Format problems raise
// ValueError (FormatError derives from std::invalid_argument), I/O problems OSError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "binding_helpers.hpp"
#include "gil.hpp"
#include "gil_free_holder.hpp"
#include "paths.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checkpoint_format.hpp"
#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/checkpoint/checksum.hpp"
#include "tensortier/checkpoint/directory_commit.hpp"
#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/checkpoint/piece_reader.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/checkpoint/safetensors_writer.hpp"
#include "tensortier/checkpoint/small_pieces.hpp"
#include "tensortier/checkpoint/torch_checkpoint.hpp"
#include "tensortier/checkpoint/torch_file_writer.hpp"
#include "tensortier/checkpoint/torch_pickle.hpp"
#include "tensortier/checkpoint/zip_archive.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

py::list EntriesToList(const std::vector<SafetensorsEntry>& entries) {
  py::list out;
  for (const auto& e : entries) {
    py::tuple shape(e.shape.size());
    for (size_t i = 0; i < e.shape.size(); ++i) shape[i] = py::int_(e.shape[i]);
    out.append(py::make_tuple(e.name, e.dtype, shape, e.begin, e.end));
  }
  return out;
}

// [(name, data_offset, size, crc32, crcs_recorded)] in directory order; crcs_recorded: whether
// the archive records CRC-32s at all (RecordsCrcs), the same for every entry.
py::list ZipEntriesToPython(const ZipDirectory& dir) {
  py::list out;
  const bool recorded = RecordsCrcs(dir);
  for (const auto& e : dir.entries) {
    out.append(py::make_tuple(e.name, e.data_offset, e.size, e.crc32, recorded));
  }
  return out;
}

// TorchCheckpoint::plain_dict's tensors: ([name], [dtype], [shape], [data offset], [nbytes]).
py::tuple PlainDictToPython(const TorchCheckpoint& c) {
  const size_t n = c.pickle.tensors.size();
  py::list names(n), dtypes(n), shapes(n), offsets(n), sizes(n);
  for (size_t i = 0; i < n; ++i) {
    const TorchTensor& t = c.pickle.tensors[i];
    names[i] = py::str(t.path);
    dtypes[i] = py::str(t.dtype);
    py::tuple shape(t.shape.size());
    for (size_t d = 0; d < t.shape.size(); ++d) shape[d] = py::int_(t.shape[d]);
    shapes[i] = std::move(shape);
    offsets[i] = py::int_(c.pickle.storages.at(t.storage_key).data_offset);
    sizes[i] = py::int_(t.nbytes());
  }
  return py::make_tuple(names, dtypes, shapes, offsets, sizes);
}

py::dict MetadataToDict(const SafetensorsMetadata& metadata) {
  py::dict out;
  for (const auto& [k, v] : metadata) out[py::str(k)] = py::str(v);
  return out;
}

// A C-contiguous buffer export held for the lifetime of the object.
class BufferView {
 public:
  explicit BufferView(const py::object& obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) {
      throw py::error_already_set();
    }
  }
  ~BufferView() { PyBuffer_Release(&view_); }
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;
  const void* data() const { return view_.buf; }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

std::vector<const std::byte*> HostAddresses(const std::vector<uintptr_t>& addresses) {
  std::vector<const std::byte*> host;
  host.reserve(addresses.size());
  for (uintptr_t a : addresses) host.push_back(reinterpret_cast<const std::byte*>(a));
  return host;
}

// Writes items `indices` through write(indices, addresses) from host memory: addresses[k] where
// item indices[k] is in host memory, else the copy host(indices[k]) makes of it (a tensor or a
// storage: data_ptr and nbytes). The copies are made in order, in groups of about staging_bytes,
// each group's freed once written; the items in host memory go with the group they fall in.
template <typename Write>
void WriteStaged(const std::vector<size_t>& indices,
                 const std::vector<std::optional<uintptr_t>>& addresses, const py::function& host,
                 uint64_t staging_bytes, Write write) {
  std::vector<size_t> group;
  std::vector<uintptr_t> group_addresses;
  std::vector<py::object> copies;  // alive while their group is written
  uint64_t staged = 0;
  for (size_t k = 0; k < indices.size(); ++k) {
    group.push_back(indices[k]);
    if (addresses.at(k)) {
      group_addresses.push_back(*addresses[k]);
      continue;
    }
    copies.push_back(host(indices[k]));
    py::object nbytes = copies.back().attr("nbytes");
    if (PyCallable_Check(nbytes.ptr()) != 0) nbytes = nbytes();  // a storage's is a method
    group_addresses.push_back(copies.back().attr("data_ptr")().cast<uintptr_t>());
    staged += nbytes.cast<uint64_t>();
    if (staged >= staging_bytes) {
      write(group, group_addresses);
      group.clear();
      group_addresses.clear();
      copies.clear();
      staged = 0;
    }
  }
  if (!group.empty()) write(group, group_addresses);
}

// SafetensorsFileWriter.write: tensors `indices` from host memory at `addresses` into `out`,
// reserved by the first call; the call that writes the last tensor writes the header too.
void WriteSafetensors(SafetensorsFileWriter& w, Engine& engine, DurableFile& out,
                      const std::vector<size_t>& indices, const std::vector<uintptr_t>& addresses) {
  std::vector<const std::byte*> host = HostAddresses(addresses);
  GilReleased release;
  if (w.tensors_left() == w.tensors()) out.Reserve(w.size());
  w.WriteTensors(engine, out.file(), indices, host);
  if (w.tensors_left() == 0) w.WriteHeader(engine, out.file());
}

// "none", "xxh64" or "crc32".
PieceCheck PieceCheckOf(const std::string& check) {
  if (check == "none") return PieceCheck::kNone;
  if (check == "xxh64") return PieceCheck::kXxh64;
  if (check == "crc32") return PieceCheck::kCrc32;
  throw std::invalid_argument(
      StrCat("check must be 'none', 'xxh64' or 'crc32', not '", check, "'"));
}

}  // namespace

void RegisterCheckpoint(py::module_& m) {
  // The pipeline's settings and format constants (checkpoint_pipeline.hpp, safetensors.hpp).
  m.attr("CHECKPOINT_GROUP_BYTES") = kCheckpointGroupBytes;
  m.attr("CHECKPOINT_STAGING_BYTES") = kCheckpointStagingBytes;
  m.attr("CHECKPOINT_GATHER_BELOW") = kCheckpointGatherBelow;
  m.attr("CHECKPOINT_ALIGNMENT") = kCheckpointAlignment;
  m.attr("TENSOR_CHECKSUMS_KEY") = kTensorChecksumsKey;
  m.attr("HEADER_CHECKSUM_KEY") = kHeaderChecksumKey;
  m.def("big_endian_swap_width", &BigEndianSwapWidth, py::arg("storage_dtype"),
        "The width of the units torch.load reverses in a big-endian storage of dtype "
        "storage_dtype (tensortier's name): the element size, a complex number's half; 0 for "
        "bytes and untyped data.");
  m.def(
      "reverse_units_address",
      [](uintptr_t address, uint64_t nbytes, unsigned width) {
        if (width > 0 && nbytes % width != 0) {
          throw std::invalid_argument(StrCat("reverse_units_address: ", nbytes,
                                             " bytes are no whole number of ", width,
                                             "-byte units"));
        }
        GilReleased release;
        ReverseUnits(reinterpret_cast<std::byte*>(address), nbytes, width);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("width"),
      "Reverses the bytes of each width-byte unit of nbytes bytes of host memory at address "
      "(big-endian data to this machine's order; GIL released).");
  m.def("progress_line", &ProgressLine, py::arg("label"), py::arg("done"), py::arg("total"),
        py::arg("seconds"),
        "One drawing of a transfer's progress bar: '\\rLABEL [###   ]  42.0% 0.50/1.20 GiB "
        "1.23 GB/s' (the CLI draws the same).");
  m.def(
      "parse_safetensors_header",
      [](const py::bytes& header, uint64_t data_bytes) {
        std::string_view json(header);
        SafetensorsHeader parsed;
        {
          GilReleased release;
          parsed = ParseSafetensorsHeader(json, data_bytes);
        }
        return py::make_tuple(EntriesToList(parsed.entries), MetadataToDict(parsed.metadata));
      },
      py::arg("header"), py::arg("data_bytes"),
      "Validates a safetensors JSON header (without the 8-byte length) for a data section of "
      "data_bytes bytes. Returns ([(name, dtype, shape, begin, end)] sorted by begin, metadata); "
      "raises ValueError naming the tensor and the problem.");
  m.def(
      "read_safetensors_header",
      [](const FsPath& path, bool verify) {
        SafetensorsFileInfo info;
        {
          GilReleased release;
          info = ReadSafetensorsHeader(path);
          if (verify) CheckSafetensorsHeaderChecksum(path, info.header);
          for (SafetensorsEntry& e : info.header.entries) {
            try {
              e.shape = TorchShape(e.name, e.dtype, std::move(e.shape));
            } catch (const std::invalid_argument& x) {
              throw std::invalid_argument(StrCat(path.bytes, ": ", x.what()));
            }
            const uint64_t size = e.end - e.begin;
            e.begin += info.data_start;
            e.end = size;
          }
        }
        return py::make_tuple(EntriesToList(info.header.entries),
                              MetadataToDict(info.header.metadata));
      },
      py::arg("path"), py::arg("verify") = false,
      "Reads and validates a safetensors file's header: ([(name, dtype, torch shape, file "
      "offset, size)], metadata); with verify, also its stored header checksum. OSError for I/O "
      "errors, ValueError for bad files.");
  m.def(
      "zip_entries",
      [](const FsPath& path, bool require_stored) {
        ZipDirectory dir;
        {
          GilReleased release;
          dir = ReadZipDirectory(FileSource(OpenCheckpointForReading(path, false)));
          if (require_stored) {
            for (const auto& e : dir.entries) RequireStored(e, path);
          }
        }
        return ZipEntriesToPython(dir);
      },
      py::arg("path"), py::arg("require_stored") = true,
      "The entries of a zip archive (torch.save file): [(name, data_offset, size, crc32, "
      "crcs_recorded)] in directory order; data_offset is absolute; crcs_recorded: whether the "
      "archive records CRC-32s at all (torch.save with set_crc32_options(False) writes 0 for "
      "every entry). ValueError for a bad archive and, unless "
      "require_stored=False, for any compressed or encrypted entry (size is then the uncompressed "
      "size, not the bytes at data_offset).");

  m.def(
      "dtypes",
      [] {
        py::list out;
        for (const Dtype& d : Dtypes()) {
          py::dict row;
          row["name"] = d.name;
          row["safetensors"] = d.safetensors;
          row["packing"] = d.packing;
          row["torch"] = d.torch;
          row["torch_alias"] = d.torch_alias;
          row["storage"] = d.storage;
          row["bits"] = d.bits;
          row["quantized"] = d.quantized;
          out.append(std::move(row));
        }
        return out;
      },
      "The dtype table (include/tensortier/checkpoint/dtypes.hpp), one dict per dtype: name "
      "(tensortier's), "
      "safetensors (the dtype that stores it, '' when none), packing (values per element), torch "
      "(torch's dtype attribute, '' when none), torch_alias, storage (typed storage class, '' when "
      "torch pickles it untyped), bits (per element), quantized.");

  m.def(
      "safetensors_dtypes_for_torch",
      [] {
        py::list out;
        for (const TorchHeldDtype& d : SafetensorsDtypesForTorch()) {
          out.append(py::make_tuple(d.safetensors, d.torch, d.values_per_element));
        }
        return out;
      },
      "[(safetensors dtype name, torch dtype attribute, safetensors values per torch element)] for "
      "every safetensors dtype torch 2.x holds, in safetensors' order: the one table load, save "
      "and "
      "the CLI's convert use (F4 is float4_e2m1fn_x2, two values a byte).");

  m.def(
      "torch_zip_entries",
      [](const FsPath& path, bool plain) -> py::tuple {
        std::string prefix;
        ZipDirectory dir;
        TorchCheckpoint c;
        {
          GilReleased release;
          FileSource source(OpenCheckpointForReading(path, false));
          dir = ReadZipDirectory(source);
          // What the archive is first (a TorchScript one compresses its code records).
          prefix = TorchArchivePrefix(dir, path);
          for (const auto& e : dir.entries) RequireStored(e, path);
          CheckTorchFileVersion(source, dir, prefix);
          if (plain) {
            try {
              c = ReadTorchCheckpoint(source, dir);
            } catch (const std::exception&) {  // the general reader reports it, in its words
              c.plain_dict = false;
            }
          }
        }
        if (!plain) return py::make_tuple(prefix, ZipEntriesToPython(dir));
        if (!c.plain_dict) return py::make_tuple(prefix, ZipEntriesToPython(dir), py::none());
        return py::make_tuple(prefix, py::none(), PlainDictToPython(c));
      },
      py::arg("path"), py::arg("plain") = false,
      "A torch.save zip file's records from one read of its directory: (folder, [(name, "
      "data_offset, size, crc32, crcs_recorded)] in directory order, as zip_entries gives them), "
      "the folder holding data.pkl. ValueError, by the rules of read_torch_checkpoint and the "
      "CLI, for a bad archive, a compressed or encrypted entry, no or several data.pkl, a "
      "TorchScript archive, a format version torch does not read. With plain=True, a third "
      "member: for a file whose data.pkl is exactly what torch.save writes for a plain dict of "
      "tensors, each alone in its storage (TorchCheckpoint::plain_dict), ([name], [dtype], "
      "[shape], [data offset], [nbytes]) in the dict's order (dtype table names), and None in "
      "place of the records; else None.");

  m.def(
      "read_torch_checkpoint",
      [](const FsPath& path) {
        TorchCheckpoint c;
        {
          GilReleased release;
          c = ReadTorchCheckpoint(FileSource(OpenCheckpointForReading(path, false)));
        }
        py::list tensors;
        for (const auto& t : c.pickle.tensors) {
          tensors.append(py::make_tuple(t.path, t.dtype, py::tuple(py::cast(t.shape)),
                                        py::tuple(py::cast(t.stride)), t.storage_offset,
                                        t.storage_key, t.requires_grad));
        }
        py::dict storages;
        for (const auto& [key, s] : c.pickle.storages) {
          storages[py::str(key)] = py::make_tuple(s.dtype, s.nbytes, s.data_offset, s.location);
        }
        return py::make_tuple(c.prefix, tensors, storages, c.big_endian ? "big" : "little");
      },
      py::arg("path"),
      "Reads a torch.save zip file without running its pickle: (prefix, [(key_path, dtype, "
      "shape, stride, storage_offset, storage_key, requires_grad)], {storage_key: (dtype, nbytes, "
      "data_offset, location)}, byteorder), byteorder 'little' or 'big' (the stored bytes' "
      "order). Dtypes use safetensors names (F32, BF16, ..., C128; C32, F4_X2, BITS8... for "
      "torch's own); strides and offsets are in elements. ValueError for disallowed globals, "
      "legacy files, bad archives.");

  py::class_<TorchFileWriter>(
      m, "TorchFileWriter",
      "A torch.save zip file, planned: data.pkl, the records torch.save writes, each storage 4 "
      "KiB aligned (include/tensortier/checkpoint/torch_file_writer.hpp). Its bytes are written "
      "with write(), or with begin(), write_storages() for each group of storages, end().")
      .def(
          py::init([](const std::vector<std::string>& names, const std::vector<std::string>& dtypes,
                      const std::vector<std::vector<uint64_t>>& shapes,
                      const std::vector<std::vector<uint64_t>>& strides,
                      const std::vector<uint64_t>& nbytes, const std::vector<uintptr_t>& storages,
                      bool crc32) {
            if (dtypes.size() != names.size() || shapes.size() != names.size() ||
                strides.size() != names.size() || storages.size() != names.size()) {
              throw std::invalid_argument(
                  "TorchFileWriter: one dtype, shape, stride and storage per name");
            }
            std::vector<uintptr_t> sorted = storages;
            std::sort(sorted.begin(), sorted.end());
            if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
              throw std::invalid_argument("tensors share a storage, which torch.save keeps shared");
            }
            std::vector<TorchPickleTensor> tensors;
            tensors.reserve(names.size());
            for (size_t i = 0; i < names.size(); ++i) {
              if (strides[i] != ContiguousStrides(shapes[i])) {
                throw std::invalid_argument(
                    StrCat("tensor '", names[i], "' has strides torch.save keeps as they are"));
              }
              tensors.push_back({names[i], dtypes[i], shapes[i], std::to_string(i)});
            }
            GilReleased release;
            return std::make_unique<TorchFileWriter>(
                tensors, nbytes, TorchFileOptions{.folder = "archive", .crc32 = crc32});
          }),
          py::arg("names"), py::arg("dtypes"), py::arg("shapes"), py::arg("strides"),
          py::arg("nbytes"), py::arg("storages"), py::arg("crc32"),
          "A plain dict: tensor i is names[i] of dtypes[i] (dtype table names: 'F32'...), "
          "shapes[i] and strides[i] (contiguous ones only), nbytes[i] bytes, in storage 'i'; "
          "storages[i] identifies the tensor's storage (its data address; an empty one's, its "
          "storage object's); crc32: record CRC-32s. ValueError for what a plain dict cannot hold "
          "(before anything is written): two tensors of one storage too.")
      .def(py::init([](const py::bytes& pickle, const std::vector<uint64_t>& nbytes, bool crc32) {
             std::string data(pickle);
             GilReleased release;
             return std::make_unique<TorchFileWriter>(
                 std::move(data), nbytes, TorchFileOptions{.folder = "archive", .crc32 = crc32});
           }),
           py::arg("pickle"), py::arg("nbytes"), py::arg("crc32"),
           "Any object: pickle is the data.pkl torch's pickler wrote for it, naming storages "
           "'0' ... 'n-1' of nbytes[i] bytes; crc32: record CRC-32s.")
      .def_property_readonly("size", &TorchFileWriter::size, "The file's size in bytes.")
      .def(
          "write",
          [](TorchFileWriter& w, Engine& engine, DurableFile& out,
             const std::vector<uintptr_t>& addresses, bool commit) {
            HostTensorBytes bytes(HostAddresses(addresses));
            GilReleased release;
            out.Reserve(w.size());
            w.Write(engine, out.file(), bytes);
            if (commit) out.Commit();
          },
          py::arg("engine"), py::arg("out"), py::arg("addresses"), py::arg("commit") = false,
          "Writes the file into out (a DurableFile, reserved first) with engine, storage i's "
          "bytes at host address addresses[i] (kept alive by the caller), and with commit "
          "commits out in the same call (fdatasync, rename, directory fsync). OSError for I/O "
          "errors.")
      .def(
          "write_staged",
          [](TorchFileWriter& w, Engine& engine, DurableFile& out,
             const std::vector<std::optional<uintptr_t>>& addresses, const py::function& host,
             uint64_t staging_bytes) {
            {
              GilReleased release;
              out.Reserve(w.size());
              w.Begin(engine, out.file());
            }
            try {
              std::vector<size_t> indices(addresses.size());
              for (size_t i = 0; i < indices.size(); ++i) indices[i] = i;
              WriteStaged(indices, addresses, host, staging_bytes,
                          [&](const std::vector<size_t>&, const std::vector<uintptr_t>& group) {
                            HostTensorBytes bytes(HostAddresses(group));
                            GilReleased release;
                            w.WriteStorages(bytes, group.size());
                          });
              GilReleased release;
              w.End();
            } catch (...) {
              GilReleased release;
              w.Abandon();  // no write in flight when out is aborted
              throw;
            }
          },
          py::arg("engine"), py::arg("out"), py::arg("addresses"), py::arg("host"),
          py::arg("staging_bytes"),
          "write() without committing, for storages not all in host memory: storage i from host "
          "memory at addresses[i], or where that is None from the copy host(i) returns (a "
          "storage in host memory), the copies made in groups of about staging_bytes, each "
          "group's freed once written. OSError for I/O errors, host's errors as they are.");

  py::class_<SafetensorsFileWriter>(
      m, "SafetensorsFileWriter",
      "A safetensors file, planned: the layout (plan_safetensors_layout), the header with its "
      "metadata and checksums (include/tensortier/checkpoint/safetensors_writer.hpp).")
      .def(py::init([](std::vector<std::string> names, const std::vector<std::string>& dtypes,
                       std::vector<std::vector<uint64_t>> shapes,
                       const std::vector<uint64_t>& nbytes, SafetensorsMetadata metadata,
                       bool checksum) {
             if (dtypes.size() != names.size() || shapes.size() != names.size() ||
                 nbytes.size() != names.size()) {
               throw std::invalid_argument(
                   "SafetensorsFileWriter: one dtype, shape and size per name");
             }
             std::vector<SafetensorsTensor> tensors(names.size());
             for (size_t i = 0; i < names.size(); ++i) {
               tensors[i] = {std::move(names[i]), dtypes[i], std::move(shapes[i]), nbytes[i]};
             }
             GilReleased release;
             return std::make_unique<SafetensorsFileWriter>(std::move(tensors), std::move(metadata),
                                                            checksum);
           }),
           py::arg("names"), py::arg("dtypes"), py::arg("shapes"), py::arg("nbytes"),
           py::arg("metadata"), py::arg("checksum"),
           "Tensor i is names[i] of dtypes[i] (dtype table names), torch shape shapes[i], "
           "nbytes[i] bytes. ValueError for a dtype safetensors cannot store, metadata naming "
           "tensortier's checksum keys, a name given twice.")
      .def_property_readonly("size", &SafetensorsFileWriter::size, "The file's size in bytes.")
      .def("write", &WriteSafetensors, py::arg("engine"), py::arg("out"), py::arg("indices"),
           py::arg("addresses"),
           "Writes tensors indices[k] from host memory at addresses[k] (free again once this "
           "returns) into out (a DurableFile, reserved by the first call); the call that writes "
           "the last tensor writes the header too. OSError for I/O errors.")
      .def(
          "write_staged",
          [](SafetensorsFileWriter& w, Engine& engine, DurableFile& out,
             const std::vector<size_t>& indices, const py::function& host, uint64_t staging_bytes) {
            WriteStaged(
                indices, std::vector<std::optional<uintptr_t>>(indices.size()), host, staging_bytes,
                [&](const std::vector<size_t>& group, const std::vector<uintptr_t>& addresses) {
                  WriteSafetensors(w, engine, out, group, addresses);
                });
          },
          py::arg("engine"), py::arg("out"), py::arg("indices"), py::arg("host"),
          py::arg("staging_bytes"),
          "write() of tensors indices from the copies in host memory host(i) returns for each "
          "(contiguous tensors), made in groups of about staging_bytes, each group's freed once "
          "written.");

  m.def(
      "plan_shared_chunks",
      [](const std::vector<uint64_t>& sizes) {
        ChunkPlan plan = PlanSharedChunks(sizes);
        return py::make_tuple(plan.chunk_bytes, plan.chunk, plan.position);
      },
      py::arg("sizes"),
      "Where a load's tensors of these byte sizes go: (chunk sizes, per tensor its chunk or -1 "
      "for memory of its own, per tensor its position in its chunk).");
  m.def(
      "read_pieces",
      [](Engine& engine, const File& file, const FsPath& path,
         const std::vector<std::string>& names, const std::vector<uint64_t>& offsets,
         const std::vector<uint64_t>& lengths, const std::vector<uintptr_t>& addresses,
         const std::optional<std::vector<std::optional<uint64_t>>>& expected,
         const std::string& check, uint64_t group_bytes, uint64_t gather_below, bool stage_reads,
         const std::optional<py::function>& progress) {
        const size_t n = names.size();
        if (offsets.size() != n || lengths.size() != n || addresses.size() != n ||
            (expected && expected->size() != n)) {
          throw std::invalid_argument(
              "read_pieces: one offset, length, address and checksum per name");
        }
        const PieceCheck kind = PieceCheckOf(check);
        if (kind != PieceCheck::kNone && !expected) {
          throw std::invalid_argument("read_pieces: a check needs the expected checksums");
        }
        std::vector<PieceRead> pieces(n);
        for (size_t i = 0; i < n; ++i) {
          std::byte* dest = reinterpret_cast<std::byte*>(addresses[i]);
          std::optional<uint64_t> want;
          if (kind != PieceCheck::kNone) want = (*expected)[i];
          pieces[i] = {names[i], offsets[i], lengths[i], dest, kind, want};
        }
        std::function<void(uint64_t)> report;
        if (progress) {
          // Called on this thread between groups, the GIL taken back for it.
          report = [&progress](uint64_t bytes) {
            WaitHereIfFinalizing();
            py::gil_scoped_acquire acquire;
            (*progress)(bytes);
          };
        }
        std::vector<IoStats> stats;
        {
          GilReleased release;
          stats = ReadPieces(engine, file, path, pieces,
                             PieceReadOptions{.group_bytes = std::max<uint64_t>(group_bytes, 1),
                                              .gather_below = gather_below,
                                              .stage_reads = stage_reads},
                             report);
        }
        py::list out;
        for (const IoStats& s : stats) out.append(IoStatsToDict(s));
        return out;
      },
      py::arg("engine"), py::arg("file"), py::arg("path"), py::arg("names"), py::arg("offsets"),
      py::arg("lengths"), py::arg("addresses"), py::arg("expected") = py::none(),
      py::arg("check") = "none", py::arg("group_bytes") = kCheckpointGroupBytes,
      py::arg("gather_below") = kCheckpointGatherBelow, py::arg("stage_reads") = true,
      py::arg("progress") = py::none(),
      "Reads lengths[i] bytes at offsets[i] of file into host memory at addresses[i] (kept alive "
      "by the caller) and checks them (ReadPieces): check 'xxh64' (expected[i]: the stored "
      "checksum, None where the file stores none, an error), 'crc32' (of whole zip records) or "
      "'none'. Pieces under gather_below bytes share large requests; the others are read in "
      "groups of group_bytes, each checked while the next ones are read; progress(bytes) after "
      "each. GIL released. Returns the engine's stats of each group. ValueError naming path and "
      "the piece for a short file or a checksum mismatch; OSError for I/O errors.");
  m.def(
      "check_pieces",
      [](const FsPath& path, const std::vector<std::string>& names,
         const std::vector<uintptr_t>& addresses, const std::vector<uint64_t>& lengths,
         const std::vector<std::optional<uint64_t>>& expected, const std::string& check) {
        const size_t n = names.size();
        if (addresses.size() != n || lengths.size() != n || expected.size() != n) {
          throw std::invalid_argument("check_pieces: one address, length and checksum per name");
        }
        const PieceCheck kind = PieceCheckOf(check);
        std::vector<PieceRead> pieces(n);
        for (size_t i = 0; i < n; ++i) {
          std::byte* dest = reinterpret_cast<std::byte*>(addresses[i]);
          pieces[i] = {names[i], 0, lengths[i], dest, kind, expected[i]};
        }
        GilReleased release;
        CheckPieces(path, pieces);
      },
      py::arg("path"), py::arg("names"), py::arg("addresses"), py::arg("lengths"),
      py::arg("expected"), py::arg("check"),
      "Checks bytes already in host memory (lengths[i] at addresses[i]) as read_pieces does: "
      "ValueError naming path and the piece for a mismatch.");
  m.def(
      "check_records",
      [](Engine& engine, const File& file, const FsPath& path,
         const std::vector<std::tuple<std::string, uint64_t, uint64_t, uint32_t>>& records) {
        std::vector<RecordCheck> checks;
        checks.reserve(records.size());
        for (const auto& [name, offset, size, crc] : records) {
          checks.push_back({name, offset, size, crc});
        }
        GilReleased release;
        CheckRecords(engine, file, path, checks);
      },
      py::arg("engine"), py::arg("file"), py::arg("path"), py::arg("records"),
      "Streams each (name, offset, size, crc32) zip record of file through bounded buffers and "
      "checks its CRC-32 (CheckRecords). ValueError naming path and the record for a mismatch "
      "or a record the file ends inside; OSError for I/O errors.");

  m.def(
      "detect_checkpoint_kind",
      [](const FsPath& path) { return CheckpointKindName(DetectCheckpointKind(path)); },
      py::arg("path"), py::call_guard<GilReleased>(),
      "'safetensors', 'torch' or 'index': what the checkpoint file at path holds, by the rule the "
      "CLI follows (a .index.json name, then the first bytes). ValueError for an empty file or a "
      "legacy (non-zip) torch.save file; OSError naming the path for anything but a regular file "
      "(a FIFO is refused, never waited on).");
  py::class_<FileSystem>(
      m, "FileSystem",
      "The system calls a save or a load makes outside the engine (open, fallocate, fdatasync, "
      "rename, directory fsync, closing a replaced file).")
      .def(py::init(&TestFileSystem))
      .def(
          "open",
          [](const FileSystem& fs, const FsPath& path, bool direct) {
            GilReleased release;
            return OpenCheckpointForReading(path, direct, fs);
          },
          py::arg("path"), py::arg("direct") = true,
          "Opens a checkpoint to read it (a File); OSError naming the path for anything but a "
          "regular file (a FIFO is refused, never waited on).");
  py::class_<DurableFile>(
      m, "DurableFile",
      "A save's new file under a temporary name next to path, which the writers fill "
      "(TorchFileWriter, SafetensorsFileWriter): commit() fdatasyncs it, renames it over path "
      "and fsyncs the directory; abort() (or a failed commit) removes it.")
      .def(py::init(
               [](const FsPath& path, bool direct, const FileSystem& fs, bool free_in_background) {
                 GilReleased release;
                 return std::make_unique<DurableFile>(path, direct, fs, free_in_background);
               }),
           py::arg("path"), py::arg("direct") = true, py::arg("fs") = FileSystem(),
           py::arg("free_in_background") = true,
           "Checks path may be replaced, waits for files earlier saves replaced to be freed, "
           "removes killed saves' temporary files and creates this one. OSError naming the step "
           "and the path.")
      .def_property_readonly("committed", &DurableFile::committed)
      .def("commit", &DurableFile::Commit, py::call_guard<GilReleased>())
      .def("abort", &DurableFile::Abort, py::call_guard<GilReleased>())
      .def("__enter__", [](py::object self) { return self; })
      .def(
          "__exit__",
          [](DurableFile& f, const py::object& type, const py::object&, const py::object&) {
            GilReleased release;
            if (!type.is_none() || !f.committed()) f.Abort();
          },
          "Removes the file unless the with body committed it and raised nothing.");
  m.def("wait_for_replaced_files", &WaitForReplacedFiles, py::call_guard<GilReleased>(),
        "Waits until the files earlier saves replaced are freed (a background thread closes "
        "each).");
  m.def(
      "create_staging_directory",
      [](const FsPath& final_dir, mode_t mode) {
        std::string staged;
        {
          GilReleased release;
          staged = CreateStagingDirectory(final_dir, mode);
        }
        return PathToPython(staged);
      },
      py::arg("final_dir"), py::arg("mode") = 0777,
      "Removes the staging directories of killed saves into final_dir (their processes gone), "
      "creates a new one of `mode` (less the umask) beside it, named as a save's temporary file "
      "is, and returns its path.");
  m.def(
      "temporary_path_prefix",
      [](const FsPath& path) { return PathToPython(TemporaryPathPrefix(path)); }, py::arg("path"),
      "'DIR/.NAME.tmp-PID-START-TAG-' for this process: a save's temporary file for path is "
      "this followed by 8 random hex digits.");

  m.def(
      "format_of_suffix",
      [](const FsPath& path) -> std::optional<std::string_view> {
        const std::optional<CheckpointFormat> format = FormatOfSuffix(path.bytes);
        if (!format) return std::nullopt;
        return CheckpointFormatName(*format);
      },
      py::arg("path"),
      "'safetensors' or 'torch' as the file name's suffix says (either case: .safetensors, .st; "
      ".pt, .pth, .bin, .ckpt, .tar), or the suffix before one that names no format "
      "('x.safetensors.tmp'), else None.");
  m.def("parse_stored_checksum", &ParseStoredChecksum, py::arg("text"),
        "A stored checksum's value: exactly 16 hex digits (either case), else None (no '0x', "
        "'_', spaces or signs).");
  m.def(
      "xxh64",
      [](const py::object& obj, uint64_t seed) {
        BufferView view(obj);
        GilReleased release;
        return Xxh64(view.data(), view.size(), seed);
      },
      py::arg("obj"), py::arg("seed") = 0,
      "XXH64 of a C-contiguous buffer-protocol object (bytes, memoryview, numpy array...).");
  m.def(
      "xxh64_address",
      [](uintptr_t address, uint64_t nbytes, uint64_t seed) {
        return Xxh64(reinterpret_cast<const void*>(address), nbytes, seed);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("seed") = 0, py::call_guard<GilReleased>(),
      "XXH64 of nbytes of host memory at address (the caller keeps it alive).");
  m.def(
      "crc32",
      [](const py::object& obj, uint32_t crc) {
        BufferView view(obj);
        GilReleased release;
        return Crc32(view.data(), view.size(), crc);
      },
      py::arg("obj"), py::arg("crc") = 0, "CRC-32 (zlib.crc32) of a C-contiguous buffer.");
  m.def(
      "crc32_address",
      [](uintptr_t address, uint64_t nbytes, uint32_t crc) {
        return Crc32(reinterpret_cast<const void*>(address), nbytes, crc);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("crc") = 0, py::call_guard<GilReleased>(),
      "CRC-32 (zlib.crc32) of nbytes of host memory at address (the caller keeps it alive).");
}
