// tensortier._core DCP functions: the rank files and the commit of torch.distributed.checkpoint
// checkpoints (dcp_file.hpp). Each call does all of its I/O with the GIL released; items cross as
// lists of plain values and addresses the Python layer keeps alive.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "paths.hpp"
#include "register.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/dcp_file.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/checkpoint/dcp_reads.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

void SameLength(size_t n, std::initializer_list<size_t> others, const char* fn) {
  for (size_t k : others) {
    if (k != n) throw std::invalid_argument(std::string(fn) + ": one value per item in each list");
  }
}

py::list TensorLayouts(const std::vector<DcpTensorItem>& items) {
  py::list out;
  for (const auto& t : items) {
    out.append(py::make_tuple(t.dtype, t.shape, t.stride, t.storage_offset, t.data_offset, t.nbytes,
                              t.crc32, t.bytes_read, t.conj, t.neg, t.safetensors));
  }
  return out;
}

}  // namespace

void RegisterDcp(py::module_& m) {
  m.def(
      "write_dcp_file",
      [](Engine& engine, const FsPath& path, const std::vector<std::string>& dtypes,
         const std::vector<std::vector<uint64_t>>& shapes, const std::vector<uint64_t>& nbytes,
         const std::vector<uintptr_t>& addresses, bool direct, const std::string& who,
         const std::vector<std::string>& names) {
        SameLength(dtypes.size(), {shapes.size(), nbytes.size(), addresses.size()},
                   "write_dcp_file");
        if (!names.empty()) SameLength(dtypes.size(), {names.size()}, "write_dcp_file");
        std::vector<DcpWriteItem> items(dtypes.size());
        for (size_t i = 0; i < items.size(); ++i) {
          items[i] = {dtypes[i], shapes[i], nbytes[i],
                      reinterpret_cast<const std::byte*>(addresses[i]),
                      names.empty() ? std::string() : names[i]};
        }
        std::vector<DcpItemPlace> places;
        {
          py::gil_scoped_release release;
          places = WriteDcpFile(engine, path, std::move(items), direct, who);
        }
        py::list out;
        for (const auto& p : places) {
          out.append(py::make_tuple(p.offset, p.length, p.xxh64, py::bytes(p.block_xxh64)));
        }
        return out;
      },
      py::arg("engine"), py::arg("path"), py::arg("dtypes"), py::arg("shapes"), py::arg("nbytes"),
      py::arg("addresses"), py::arg("direct") = true, py::arg("who") = "",
      py::arg("names") = std::vector<std::string>{},
      "Writes a DCP rank file durably at path: item i is a tensor of dtypes[i] (tensortier's "
      "name) and shapes[i], or bytes where dtypes[i] is '', nbytes[i] bytes of host memory at "
      "addresses[i]. Returns [(offset, length, xxh64, block xxh64s)] per item (the block sums: "
      "packed little-endian, one per dcp_block_bytes of a tensor's data; b'' for bytes items). "
      "ValueError naming the item (names[i] where given) for a dtype torch cannot pickle, "
      "OSError naming who ('rank 1'), the step and path (no temporary file left).");
  m.def(
      "read_dcp_tensor_items",
      [](const FsPath& path, const std::vector<std::string>& names,
         const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& lengths,
         const std::vector<std::optional<std::vector<int64_t>>>& shapes,
         const std::vector<std::string>& fqns) {
        SameLength(names.size(), {offsets.size(), lengths.size()}, "read_dcp_tensor_items");
        if (!shapes.empty()) SameLength(names.size(), {shapes.size()}, "read_dcp_tensor_items");
        if (!fqns.empty()) SameLength(names.size(), {fqns.size()}, "read_dcp_tensor_items");
        std::vector<DcpTensorItem> items;
        if (!names.empty()) {
          py::gil_scoped_release release;
          const File file = OpenDcpDataFile(path, names, /*direct=*/false);
          for (size_t i = 0; i < offsets.size(); ++i) {
            items.push_back(ReadDcpTensorItem(file, names[i], offsets[i], lengths[i],
                                              shapes.empty() ? std::nullopt : shapes[i],
                                              fqns.empty() ? std::string() : fqns[i]));
          }
        }
        return TensorLayouts(items);
      },
      py::arg("path"), py::arg("names"), py::arg("offsets"), py::arg("lengths"),
      py::arg("shapes") = std::vector<std::optional<std::vector<int64_t>>>{},
      py::arg("fqns") = std::vector<std::string>{},
      "The tensor of each torch.save zip (item names[i]) at [offsets[i], offsets[i] + lengths[i]) "
      "of path, whose shape must be shapes[i] where given (the metadata's chunk sizes), or, where "
      "fqns[i] is given and the item is no zip, the tensor fqns[i] of the safetensors section at "
      "offsets[i] (torch's SAFETENSORS serialization): [(dtype, shape, stride, storage_offset, "
      "data_offset, nbytes, crc32 or None, bytes read to find it, conj, neg, safetensors)]. "
      "ValueError naming the path, item and byte range for anything but a zip of one plain "
      "tensor; OSError naming the path and the first item where the file is missing.");
  py::class_<DcpFileReads>(
      m, "DcpFileReads",
      "A rank file a load reads from: the bytes of the small items it reads whole read once, in "
      "few large requests (items 4 KiB or less apart share one), serving both the tensor items' "
      "zip records and their data.")
      .def(py::init([](Engine& engine, const FsPath& path, const std::vector<std::string>& names,
                       const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& lengths,
                       const std::vector<bool>& tensor, const std::vector<bool>& whole,
                       const std::vector<std::optional<std::vector<int64_t>>>& shapes,
                       const std::vector<std::string>& fqns) {
             SameLength(names.size(),
                        {offsets.size(), lengths.size(), tensor.size(), whole.size(), shapes.size(),
                         fqns.size()},
                        "DcpFileReads");
             std::vector<DcpFileReads::Item> items(names.size());
             for (size_t i = 0; i < items.size(); ++i) {
               items[i] = {names[i], offsets[i], lengths[i], tensor[i],
                           whole[i], shapes[i],  fqns[i]};
             }
             py::gil_scoped_release release;
             return std::make_unique<DcpFileReads>(engine, path, items);
           }),
           py::arg("engine"), py::arg("path"), py::arg("names"), py::arg("offsets"),
           py::arg("lengths"), py::arg("tensor"), py::arg("whole"), py::arg("shapes"),
           py::arg("fqns"),
           "Opens path and reads what the load needs of item i (names[i], at [offsets[i], "
           "+lengths[i]); a tensor item where tensor[i], whose shape must be shapes[i] where "
           "given, and which is the tensor fqns[i] of a safetensors section where it is no zip; "
           "the small items the load reads whole (whole[i]) are held for read()). "
           "ValueError naming the path, item and byte range for anything but a zip of one plain "
           "tensor; OSError naming the path and the first item where the file is missing.")
      .def(
          "tensors", [](const DcpFileReads& r) { return TensorLayouts(r.tensors()); },
          "[(dtype, shape, stride, storage_offset, data_offset, nbytes, crc32 or None, bytes "
          "read to find it, conj, neg, safetensors)] of the tensor items, in order.")
      .def_property_readonly("bytes_read", &DcpFileReads::bytes_read,
                             "The bytes read from the file to make this object.")
      .def(
          "read",
          [](const DcpFileReads& self, Engine& engine, const std::vector<std::string>& names,
             const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& lengths,
             const std::vector<uint64_t>& data_offsets, const std::vector<uint64_t>& data_lengths,
             const std::vector<uintptr_t>& addresses,
             const std::vector<std::optional<uint64_t>>& xxh64,
             const std::vector<std::optional<uint32_t>>& crc32,
             const std::vector<std::optional<py::tuple>>& slices,
             const std::vector<std::optional<std::string>>& blocks) {
            SameLength(names.size(),
                       {offsets.size(), lengths.size(), data_offsets.size(), data_lengths.size(),
                        addresses.size(), xxh64.size(), crc32.size(), slices.size(), blocks.size()},
                       "DcpFileReads.read");
            std::vector<DcpRead> reads(names.size());
            for (size_t i = 0; i < reads.size(); ++i) {
              reads[i] = {names[i],        offsets[i],
                          lengths[i],      data_offsets[i],
                          data_lengths[i], reinterpret_cast<std::byte*>(addresses[i]),
                          xxh64[i],        crc32[i],
                          std::nullopt,    {}};
              if (slices[i]) {
                const py::tuple& t = *slices[i];
                reads[i].slice =
                    DcpSlice{t[0].cast<std::vector<int64_t>>(), t[1].cast<uint64_t>(),
                             t[2].cast<std::vector<int64_t>>(), t[3].cast<std::vector<int64_t>>()};
                if (xxh64[i] || crc32[i]) {
                  throw std::invalid_argument(
                      "DcpFileReads.read: a part of an item is checked by its block sums alone");
                }
                if (blocks[i]) reads[i].blocks = *blocks[i];
              }
            }
            py::gil_scoped_release release;
            return self.Read(engine, reads);
          },
          py::arg("engine"), py::arg("names"), py::arg("offsets"), py::arg("lengths"),
          py::arg("data_offsets"), py::arg("data_lengths"), py::arg("addresses"), py::arg("xxh64"),
          py::arg("crc32"), py::arg("slices"), py::arg("blocks"),
          "Reads item i's data [data_offsets[i], +data_lengths[i]) into addresses[i] and checks "
          "the item: the xxh64 of [offsets[i], +lengths[i]) where xxh64[i] is set, else the "
          "CRC-32 of its data where crc32[i] is. Where slices[i] is (shape, itemsize, offsets, "
          "lengths), reads only that block of the contiguous tensor of `shape` stored at "
          "data_offsets[i], as a contiguous tensor of `lengths`, checked where blocks[i] (the "
          "data's block sums) is given: every block the part touches is read whole. Ranges are "
          "read sorted, near ones merged; the held bytes are copied, not read again. Returns the "
          "bytes read from the file. ValueError naming the file, the item and its byte range for "
          "a mismatch, a truncated file or a block outside the tensor; OSError for I/O errors.");
  m.def(
      "commit_dcp_checkpoint",
      [](Engine& engine, const FsPath& dir, const py::bytes& metadata,
         const std::vector<std::string>& referenced, const std::string& who) {
        std::string data = metadata;
        py::gil_scoped_release release;
        return CommitDcpCheckpoint(engine, dir, data, referenced, who);
      },
      py::arg("engine"), py::arg("dir"), py::arg("metadata"), py::arg("referenced"),
      py::arg("who") = "",
      "Writes dir/.metadata durably, then removes the data files it does not name (referenced: "
      "relative paths) and dead saves' temporary files. Returns how many files went. OSError "
      "naming who ('rank 0'), the step and path (the old checkpoint stays whole).");
  m.def(
      "read_dcp_metadata_bytes",
      [](const FsPath& dir) {
        std::string data;
        {
          py::gil_scoped_release release;
          data = ReadDcpMetadataBytes(dir);
        }
        return py::bytes(data);
      },
      py::arg("dir"),
      "The bytes of dir/.metadata. FileNotFoundError naming the path and what is missing (the "
      "directory; its .metadata, saying whether an unfinished save's files are there), "
      "NotADirectoryError for a file.");
  m.def(
      "check_dcp_format",
      [](const py::object& format, const std::string& what) {
        if (format.is_none()) return;
        if (!py::isinstance<py::int_>(format) || py::isinstance<py::bool_>(format)) {
          throw std::invalid_argument(
              StrCat(what, ": tensortier_format is a ",
                     py::str(py::type::of(format).attr("__name__")).cast<std::string>(),
                     ", not a format version"));
        }
        CheckDcpFormat(format.cast<int64_t>(), what);
      },
      py::arg("format"), py::arg("what"),
      "Refuses (ValueError naming `what`, the version found and the one read) a "
      "tensortier_format newer than this build's DCP format (dcp_format), or not an integer; "
      "None (torch's files) passes.");
  m.def(
      "check_dcp_data_files",
      [](const py::list& relative_paths, const std::string& what) {
        for (const py::handle& p : relative_paths) {
          if (!py::isinstance<py::str>(p)) {
            throw std::invalid_argument(StrCat(
                what, ": a data file named by a ",
                py::str(py::type::of(p).attr("__name__")).cast<std::string>(), ", not a str"));
          }
          CheckDcpDataFileName(p.cast<std::string>(), what);
        }
      },
      py::arg("relative_paths"), py::arg("what"),
      "Refuses (ValueError naming `what` and the path) a data file path of the metadata that is "
      "not a plain file name inside the checkpoint directory ('../x', 'a/b', '.x', '').");
  m.def(
      "check_dcp_data_files_present",
      [](const FsPath& dir, const std::vector<std::string>& relative_paths) {
        py::gil_scoped_release release;
        CheckDcpDataFilesPresent(dir, relative_paths);
      },
      py::arg("dir"), py::arg("relative_paths"),
      "Refuses (FileNotFoundError naming dir/.metadata and the files) a metadata naming data files "
      "that are not in dir, saying when it is stale (the directory holds data files of another "
      "save).");
  m.def("check_dcp_chunks_cover", &CheckDcpChunksCover, py::arg("name"), py::arg("size"),
        py::arg("offsets"), py::arg("sizes"), py::arg("what"),
        "Refuses (ValueError naming `what` and the tensor) chunks that lie outside the tensor's "
        "size or do not hold all of its elements (data no file has).");
  m.attr("dcp_format") = kDcpFormat;
  m.attr("dcp_block_bytes") = kDcpBlockBytes;
}
