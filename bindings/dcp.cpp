// tensortier._core DCP functions: the rank files and the commit of torch.distributed.checkpoint
// checkpoints (dcp_file.hpp). Each call does all of its I/O with the GIL released; items cross as
// lists of plain values and addresses the Python layer keeps alive.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dcp_items.hpp"
#include "dlpack_export.hpp"
#include "gil.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/dcp_file.hpp"
#include "tensortier/checkpoint/dcp_metadata.hpp"
#include "tensortier/checkpoint/dcp_reads.hpp"
#include "tensortier/checkpoint/staging_arenas.hpp"
#include "tensortier/util/parallel_copy.hpp"
#include "tensortier/util/strings.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

void SameLength(size_t n, std::initializer_list<size_t> others, const char* fn) {
  for (size_t k : others) {
    if (k != n) throw std::invalid_argument(std::string(fn) + ": one value per item in each list");
  }
}

py::tuple Layout(const DcpTensorItem& t) {
  return py::make_tuple(t.dtype, t.shape, t.stride, t.storage_offset, t.data_offset, t.nbytes,
                        t.crc32, t.bytes_read, t.conj, t.neg, t.safetensors);
}

// A staging arena lent as a DLPack tensor of its bytes: the arena stays in use while a tensor made
// from it lives.
py::object ArenaAsDlpack(std::shared_ptr<StagingArena> arena) {
  void* data = arena->data();
  const uint64_t size = arena->size();
  return BytesAsDlpack(std::move(arena), data, size);
}

}  // namespace

void RegisterDcp(py::module_& m) {
  m.def(
      "write_dcp_file",
      [](Engine& engine, const FsPath& dir, const std::string& name,
         const std::vector<std::string>& dtypes, const std::vector<std::vector<uint64_t>>& shapes,
         const std::vector<uint64_t>& nbytes,
         const std::vector<std::optional<uintptr_t>>& addresses, const py::list& write_items,
         bool direct, const std::string& who, const std::optional<py::function>& host,
         uint64_t staging_bytes, const py::list& plain_fqns) {
        SameLength(dtypes.size(),
                   {shapes.size(), nbytes.size(), addresses.size(),
                    write_items.size() + plain_fqns.size()},
                   "write_dcp_file");
        std::vector<DcpWriteItem> items(dtypes.size());
        std::vector<uintptr_t> resident;  // staging arenas' memory among them is freed after
        py::list fqns, offsets, indices;
        const py::int_ first_chunk(0);
        for (size_t i = 0; i < items.size(); ++i) {
          if (i < write_items.size()) {
            const py::object index = write_items[i].attr("index");
            const py::object offset = index.attr("offset");
            fqns.append(index.attr("fqn"));
            offsets.append(offset.is_none() ? offset : py::tuple(offset));
            indices.append(index.attr("index"));
          } else {  // a plain tensor: its one chunk, at the origin
            fqns.append(plain_fqns[i - write_items.size()]);
            offsets.append(py::tuple(py::cast(std::vector<int64_t>(shapes[i].size(), 0))));
            indices.append(first_chunk);
          }
          if (addresses[i]) resident.push_back(*addresses[i]);
          items[i] = {dtypes[i], shapes[i], nbytes[i],
                      reinterpret_cast<const std::byte*>(addresses[i].value_or(0)),
                      py::str(fqns[i]).cast<std::string>()};
          if (!addresses[i] && nbytes[i] > 0 && !host) {
            throw std::invalid_argument(
                StrCat("write_dcp_file: item ", i, " has no address and no host() to stage it"));
          }
        }
        py::object copies;  // the staged group's host copies, alive while written
        const DcpStageFn stage = [&](std::span<const size_t> group) {
          WaitHereIfFinalizing();
          py::gil_scoped_acquire gil;
          copies = py::none();  // the group before: written, its memory free for this one
          // A list held here: the copies must outlive their writes (an iterator's would not).
          copies = py::list((*host)(py::cast(std::vector<size_t>(group.begin(), group.end()))));
          const py::list list(copies);
          if (list.size() != group.size()) {
            throw std::invalid_argument(StrCat("write_dcp_file: host() gave ", list.size(),
                                               " copies for ", group.size(), " items"));
          }
          std::vector<const std::byte*> srcs;
          for (size_t k = 0; k < group.size(); ++k) {
            if (!list[k].attr("is_cpu").cast<bool>() ||
                !list[k].attr("is_contiguous")().cast<bool>()) {
              throw std::invalid_argument(StrCat("write_dcp_file: host() gave item ", group[k],
                                                 " not as contiguous host memory"));
            }
            const uint64_t n = list[k].attr("nbytes").cast<uint64_t>();
            if (n != nbytes[group[k]]) {
              throw std::invalid_argument(StrCat("write_dcp_file: host() gave ", n,
                                                 " bytes for item ", group[k], " of ",
                                                 nbytes[group[k]]));
            }
            srcs.push_back(
                reinterpret_cast<const std::byte*>(list[k].attr("data_ptr")().cast<uintptr_t>()));
          }
          return srcs;
        };
        std::vector<DcpItemPlace> places;
        {
          GilReleased release;
          // Written or failed, the save is done with them: the next stage may reuse them. A
          // failed save's staged copy would otherwise stay taken until the garbage collector
          // frees the traceback that holds it, and each retry would stage into new memory.
          struct MarkWhenDone {
            const std::vector<uintptr_t>& addresses;
            ~MarkWhenDone() { StagingArenas::Process().MarkWritten(addresses); }
          } mark{resident};
          places =
              WriteDcpFile(engine, StrCat(dir.bytes, dir.bytes.ends_with('/') ? "" : "/", name),
                           std::move(items), direct, who, host ? stage : nullptr, staging_bytes);
        }
        copies = py::none();
        std::vector<uint64_t> flat;
        uint64_t total = 0;
        py::list blocks;
        for (const auto& p : places) {
          flat.insert(flat.end(), {p.offset, p.length, p.xxh64});
          total += p.length;
          blocks.append(py::bytes(p.block_xxh64));
        }
        const py::bytes packed(reinterpret_cast<const char*>(flat.data()),
                               flat.size() * sizeof(uint64_t));
        return py::make_tuple(total, py::make_tuple(name, fqns, offsets, indices, packed, blocks));
      },
      py::arg("engine"), py::arg("dir"), py::arg("name"), py::arg("dtypes"), py::arg("shapes"),
      py::arg("nbytes"), py::arg("addresses"), py::arg("items"), py::arg("direct") = true,
      py::arg("who") = "", py::arg("host") = py::none(),
      py::arg("staging_bytes") = kCheckpointStagingBytes, py::arg("plain_fqns") = py::list(),
      "Writes a DCP rank file durably at dir/name: item i (items[i], a WriteItem; past them, "
      "the plain tensor plain_fqns[i - len(items)], one chunk at the origin) is a tensor of "
      "dtypes[i] (tensortier's name) and shapes[i], or bytes where dtypes[i] is '', nbytes[i] "
      "bytes of host memory at addresses[i]; where that is None, from the contiguous host copies "
      "host(indices) returns (tensors) for groups of such items of about staging_bytes, asked "
      "for once the items in host memory are written, each group's dropped once written. Then "
      "marks free the "
      "staging arenas holding them "
      "(staging_arenas_written). Returns (the bytes of all items, the rank's write result that "
      "dcp_storage_data expands: (name, fqns, offsets, indices, places: offset, length and xxh64 "
      "of each item as native uint64s, [block xxh64s] per item: packed little-endian, one per "
      "dcp_block_bytes of a tensor's data; b'' for bytes items)). ValueError naming the item (its "
      "fqn) for a dtype torch cannot pickle, OSError naming who ('rank 1'), the step and path (no "
      "temporary file left); host's errors as they are.");
  py::class_<DcpFileReads>(
      m, "DcpFileReads",
      "A rank file a load reads from, and how it reads each item: the bytes of the small items it "
      "reads whole read once, in few large requests (items 4 KiB or less apart share one), "
      "serving both the tensor items' zip records and their data.")
      .def(py::init(
               [](Engine& engine, const FsPath& path, const std::vector<std::string>& names,
                  const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& lengths,
                  const std::vector<bool>& tensor,
                  const std::vector<std::optional<std::vector<int64_t>>>& shapes,
                  const std::vector<std::string>& fqns,
                  const std::vector<
                      std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>>& requests,
                  const std::vector<std::optional<uint64_t>>& xxh64,
                  const std::vector<std::optional<std::string>>& blocks, const py::object& verify) {
                 SameLength(names.size(),
                            {offsets.size(), lengths.size(), tensor.size(), shapes.size(),
                             fqns.size(), requests.size(), xxh64.size(), blocks.size()},
                            "DcpFileReads");
                 std::vector<DcpFileReads::Item> items(names.size());
                 for (size_t i = 0; i < items.size(); ++i) {
                   DcpFileReads::Item& it = items[i];
                   it.name = names[i];
                   it.offset = offsets[i];
                   it.length = lengths[i];
                   it.tensor = tensor[i];
                   it.expected_shape = shapes[i];
                   it.fqn = fqns[i];
                   for (const auto& [at, length] : requests[i]) it.requests.push_back({at, length});
                   it.xxh64 = xxh64[i];
                   it.blocks = blocks[i].value_or("");
                 }
                 const DcpVerify how = DcpVerifyOf(verify);
                 GilReleased release;
                 return std::make_unique<DcpFileReads>(engine, path, items, how);
               }),
           py::arg("engine"), py::arg("path"), py::arg("names"), py::arg("offsets"),
           py::arg("lengths"), py::arg("tensor"), py::arg("shapes"), py::arg("fqns"),
           py::arg("requests"), py::arg("xxh64"), py::arg("blocks"), py::arg("verify"),
           "Opens path and reads what the load needs of item i (names[i], at [offsets[i], "
           "+lengths[i]); a tensor item where tensor[i], whose shape must be shapes[i] where "
           "given, and which is the tensor fqns[i] of a safetensors section where it is no zip; "
           "requests[i]: the (offsets, lengths) blocks the load asks of it; xxh64[i] and "
           "blocks[i]: its sums, where recorded; verify: Reader's). The small items read whole "
           "are held for read(). ValueError naming the path, item and byte range for anything "
           "but a zip of one plain tensor; OSError naming the path and the first item where the "
           "file is missing.")
      .def(
          "plan",
          [](const DcpFileReads& self) {
            py::list out;
            for (size_t i = 0; i < self.size(); ++i) {
              const DcpTensorItem* t = self.tensor(i);
              const DcpItemRead how = self.how(i);
              out.append(py::make_tuple(how == DcpItemRead::kParts    ? "parts"
                                        : how == DcpItemRead::kDirect ? "direct"
                                                                      : "whole",
                                        t == nullptr ? py::object(py::none()) : Layout(*t)));
            }
            return out;
          },
          "Per item: (how, layout): how it is read ('whole'; 'direct': whole, its one request "
          "asking for all of it as stored, so it may go straight into a target of its dtype, "
          "shape and strides; 'parts': request by request, only the elements each selects), and "
          "its layout, None for a bytes item: (dtype, shape, stride, storage_offset, "
          "data_offset, nbytes, crc32 or None, bytes read to find it, conj, neg, safetensors).")
      .def_property_readonly("bytes_read", &DcpFileReads::bytes_read,
                             "The bytes read from the file to make this object.")
      .def(
          "read",
          [](const DcpFileReads& self, Engine& engine,
             const std::vector<std::tuple<size_t, int64_t, uintptr_t>>& dests) {
            std::vector<DcpRead> reads;
            reads.reserve(dests.size());
            for (const auto& [item, part, address] : dests) {
              reads.push_back(self.ReadOf(
                  item, part < 0 ? std::nullopt : std::optional<size_t>(static_cast<size_t>(part)),
                  reinterpret_cast<std::byte*>(address)));
            }
            GilReleased release;
            return self.Read(engine, reads);
          },
          py::arg("engine"), py::arg("dests"),
          "Reads each (item, part, address) of dests: all of item's data (a tensor's storage "
          "bytes) to address where part is -1, checked by its xxh64, else its zip CRC-32; else "
          "only the block its request `part` selects ('parts' items), as a contiguous tensor, "
          "checked by the block sums of every block the part touches (read whole). Ranges are "
          "read sorted, near ones merged; the held bytes are copied, not read again. Returns the "
          "bytes read from the file. ValueError naming the file, the item and its byte range for "
          "a mismatch, a truncated file or a block outside the tensor; OSError for I/O errors.");
  m.def(
      "commit_dcp_checkpoint",
      [](Engine& engine, const FsPath& dir, const py::bytes& metadata,
         const py::object& storage_data, const std::string& who) {
        std::set<std::string> files;
        if (PyDict_Check(storage_data.ptr())) {
          for (const auto& [_, info] : py::dict(storage_data)) {
            files.insert(info.attr("relative_path").cast<std::string>());
          }
        } else {  // the names themselves
          for (const py::handle& name : storage_data) files.insert(name.cast<std::string>());
        }
        const std::vector<std::string> referenced(files.begin(), files.end());
        std::string data = metadata;
        GilReleased release;
        return CommitDcpCheckpoint(engine, dir, data, referenced, who);
      },
      py::arg("engine"), py::arg("dir"), py::arg("metadata"), py::arg("storage_data"),
      py::arg("who") = "",
      "Writes dir/.metadata durably, then removes the data files it does not name (the "
      "relative_paths of storage_data's _StorageInfos, or storage_data's names where it is a "
      "list) and dead saves' temporary files. Returns "
      "how many files went. OSError naming who ('rank 0'), the step and path (the old "
      "checkpoint stays whole).");
  m.def(
      "dcp_metadata_path",
      [](const FsPath& dir, std::optional<int64_t> rank) {
        return PathToPython(DcpMetadataPath(dir, rank));
      },
      py::arg("dir"), py::arg("rank") = py::none(),
      "dir/.metadata, or with `rank` the rank-local dir/__{rank}.metadata: the one spelling of "
      "the names every DCP reader, writer and command of tensortier uses.");
  m.def(
      "read_dcp_metadata_bytes",
      [](const FsPath& dir, std::optional<int64_t> rank) {
        std::string data;
        {
          GilReleased release;
          data = ReadDcpMetadataBytes(dir, rank);
        }
        return py::bytes(data);
      },
      py::arg("dir"), py::arg("rank") = py::none(),
      "The bytes of dir/.metadata (with `rank`: of dir/__{rank}.metadata, a save's rank-local "
      "metadata). FileNotFoundError naming the path and what is missing (the directory; its "
      ".metadata, saying whether an unfinished save's files are there), NotADirectoryError for "
      "a file.");
  m.def(
      "check_dcp_metadata",
      [](const FsPath& dir, const py::object& metadata, const py::handle& metadata_type,
         const FsPath& metadata_path) {
        // Bytes, as the file system names it: a directory name need not be UTF-8.
        const std::string& what = metadata_path;
        auto type_name = [](const py::handle& v) {
          return py::str(py::type::of(v).attr("__name__")).cast<std::string>();
        };
        const py::object storage = py::getattr(metadata, "storage_data", py::none());
        if (!py::isinstance(metadata, metadata_type) || !py::isinstance<py::dict>(storage)) {
          throw std::invalid_argument(StrCat(what, ": holds ", type_name(metadata),
                                             ", not DCP metadata with storage data"));
        }
        const py::object format = py::getattr(py::getattr(metadata, "storage_meta", py::none()),
                                              "tensortier_format", py::none());
        if (!format.is_none()) {
          if (!py::isinstance<py::int_>(format) || py::isinstance<py::bool_>(format)) {
            throw std::invalid_argument(StrCat(what, ": tensortier_format is a ", type_name(format),
                                               ", not a format version"));
          }
          CheckDcpFormat(format.cast<int64_t>(), what);
        }
        std::set<std::string> files;
        for (const auto& [_, info] : py::reinterpret_borrow<py::dict>(storage)) {
          const py::object p = py::getattr(info, "relative_path", py::none());
          if (!py::isinstance<py::str>(p)) {
            throw std::invalid_argument(
                StrCat(what, ": a data file named by a ", type_name(p), ", not a str"));
          }
          std::string name = p.cast<std::string>();
          CheckDcpDataFileName(name, what);
          files.insert(std::move(name));
        }
        const std::vector<std::string> sorted(files.begin(), files.end());
        GilReleased release;
        CheckDcpDataFilesPresent(dir, sorted);
      },
      py::arg("dir"), py::arg("metadata"), py::arg("metadata_type"), py::arg("what"),
      "Refuses the unpickled DCP .metadata (`what`) of dir that is no metadata_type with a dict "
      "of storage data (ValueError), whose storage_meta's tensortier_format (None: torch's "
      "files) is "
      "newer than this build's DCP format (dcp_format) or not an integer (ValueError naming the "
      "version found and the one read), that names a data file (its _StorageInfos' "
      "relative_path) by anything but a plain file name inside dir ('../x', 'a/b', '.x', ''; "
      "ValueError naming the path), or names files that are not in dir (FileNotFoundError "
      "naming the files, saying when it is stale: dir holds data files of another save).");
  m.def("dcp_metadata_global_allowed", &IsDcpMetadataGlobal, py::arg("module"), py::arg("name"),
        "Whether a DCP .metadata may name global module.name (dcp_metadata.hpp): what the CLI's "
        "reader allows; of torch's lowercase names, the caller takes only dtypes, layouts and "
        "memory formats.");
  m.def(
      "take_staging_arena",
      [](const std::vector<std::optional<uint64_t>>& nbytes, std::optional<int> pinned_device) {
        StagingLayout layout = LayOutStaging(nbytes);
        std::shared_ptr<StagingArena> arena;
        {
          GilReleased release;  // faulting in or registering gigabytes
          arena = StagingArenas::Process().Take(layout.size, pinned_device);
        }
        const auto address = reinterpret_cast<uintptr_t>(arena->data());
        return py::make_tuple(address, ArenaAsDlpack(std::move(arena)), layout.offsets);
      },
      py::arg("nbytes"), py::arg("pinned_device"),
      "(address, DLPack capsule of its bytes, offsets) of a free staging arena for tensors of "
      "nbytes[i] bytes (None: not staged in it; offsets[i]: where tensor i goes, None for those), "
      "pinned for CUDA device pinned_device where it is not None (staging_arenas.hpp): in use "
      "until staging_arenas_written names it or no tensor made from the capsule lives.");
  m.def(
      "staging_arenas_written",
      [](const std::vector<uintptr_t>& addresses) {
        StagingArenas::Process().MarkWritten(addresses);
      },
      py::arg("addresses"),
      "Marks free the staging arenas holding any of addresses (the items a save has just "
      "written to its file): the next take_staging_arena may lend them, whoever holds a view.");
  m.def(
      "copy_into_staging_arena",
      [](uintptr_t address, const std::vector<std::tuple<uint64_t, uintptr_t, uint64_t>>& copies) {
        std::vector<CopyRange> ranges;
        ranges.reserve(copies.size());
        for (const auto& [offset, src, nbytes] : copies) {
          ranges.push_back({reinterpret_cast<std::byte*>(address + offset),
                            reinterpret_cast<const std::byte*>(src), static_cast<size_t>(nbytes)});
        }
        cpu_set_t cpus;
        const int usable = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
        GilReleased release;
        ParallelCopy(ranges, static_cast<unsigned>(std::clamp(usable, 1, 8)));
      },
      py::arg("address"), py::arg("copies"),
      "Copies each (offset, src, nbytes) of copies: nbytes bytes of host memory at address src to "
      "the staging arena at `address` (take_staging_arena's), at offset, on up to 8 threads (as "
      "many as the process may run on), the GIL released.");
  m.def(
      "staging_arena_count", [] { return StagingArenas::Process().count(); },
      "How many staging arenas this process keeps (in use or free).");
  m.attr("dcp_format") = kDcpFormat;
  m.attr("dcp_block_bytes") = kDcpBlockBytes;
}
