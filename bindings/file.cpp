// Files for IOHandle transfers (File) and what is asked of a file system: its type, and how much
// of a file's range the page cache holds.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/statfs.h>

#include <cerrno>
#include <string>
#include <utility>
#include <vector>

#include "gil.hpp"
#include "paths.hpp"
#include "register.hpp"
#include "tensortier/io/file.hpp"
#include "tensortier/io/page_cache.hpp"
#include "tensortier/util/error.hpp"

namespace py = pybind11;
using namespace tensortier;

namespace {

// `f`, or ValueError where it was closed, as Python's own files raise it.
const File& Opened(const File& f) {
  if (!f.is_open()) throw py::value_error("I/O operation on closed file");
  return f;
}

}  // namespace

void RegisterFile(py::module_& m) {
  py::class_<File>(m, "File",
                   "An open file for IOHandle transfers: a buffered descriptor, plus an O_DIRECT "
                   "one where the filesystem takes it. Open with IOHandle.open() or File.open().")
      .def_static(
          "open",
          [](const FsPath& path, const std::string& mode, bool direct) {
            OpenMode parsed = ParseOpenMode(mode);
            GilReleased release;
            return File::Open(path, parsed, direct);
          },
          py::arg("path"), py::arg("mode") = "r", py::arg("direct") = true,
          "Opens `path`: mode 'r' (read), 'r+' (read and write), 'w' (create or truncate), 'a' "
          "(create if missing, keep contents); 'w' and 'a' files can be read too. `direct`: also "
          "open O_DIRECT where the filesystem allows (else `direct_fallback_reason` says why). "
          "Raises OSError.")
      .def_static(
          "open_descriptor",
          [](int fd, const std::string& mode, bool direct) {
            OpenMode parsed = ParseOpenMode(mode);
            GilReleased release;
            return File::OpenDescriptor(fd, parsed, direct);
          },
          py::arg("fd"), py::arg("mode") = "r", py::arg("direct") = true,
          "Opens again the file the descriptor `fd` refers to (it stays the caller's), as open() "
          "does; named, in `path` and errors, by the descriptor's file. Raises OSError (EBADF "
          "for a descriptor not open).")
      .def_property_readonly(
          "path", [](const File& f) { return PathToPython(Opened(f).path()); },
          "The path it was opened with. ValueError once closed, as every property but `closed`.")
      .def_property_readonly(
          "closed", [](const File& f) { return !f.is_open(); }, "Whether close() was called.")
      .def_property_readonly(
          "writable", [](const File& f) { return Opened(f).writable(); },
          "Whether the mode allows writes.")
      .def_property_readonly(
          "direct", [](const File& f) { return Opened(f).direct(); },
          "Whether an O_DIRECT descriptor is open.")
      .def_property_readonly(
          "direct_fallback_reason",
          [](const File& f) { return MessageToPython(Opened(f).direct_fallback_reason()); },
          "Why O_DIRECT was refused ('' when it was not, or not asked for).")
      .def_property_readonly(
          "offset_alignment", [](const File& f) { return Opened(f).offset_alignment(); },
          "File offset alignment O_DIRECT needs here (bytes).")
      .def_property_readonly(
          "memory_alignment", [](const File& f) { return Opened(f).memory_alignment(); },
          "Memory address alignment O_DIRECT needs here (bytes).")
      .def(
          "fileno", [](const File& f) { return Opened(f).buffered_fd(); },
          "The buffered descriptor (valid until close()). ValueError once closed.")
      .def(
          "size", [](const File& f) { return Opened(f).Size(); },
          "The file's size in bytes. ValueError once closed.")
      .def(
          "truncate",
          [](const File& f, uint64_t size) {
            Opened(f);
            GilReleased release;
            f.Truncate(size);
          },
          py::arg("size"), "Sets the file's size to `size` bytes.")
      .def(
          "allocate",
          [](const File& f, uint64_t offset, uint64_t length) {
            Opened(f);
            GilReleased release;
            f.Allocate(offset, length);
          },
          py::arg("offset"), py::arg("length"),
          "Reserves [offset, offset+length) on disk (posix fallocate): ENOSPC now rather than "
          "mid-write. Raises OSError.")
      .def(
          "datasync",
          [](const File& f) {
            Opened(f);
            GilReleased release;
            f.DataSync();
          },
          "fdatasync: the data written so far is durable when it returns.")
      .def(
          "drop_cache",
          [](const File& f) {
            Opened(f);
            GilReleased release;
            f.DropCache();
          },
          "Drops the file's clean page-cache pages (the next read is cold).")
      .def(
          "__enter__",
          [](File& f) -> File& {
            Opened(f);
            return f;
          },
          py::return_value_policy::reference_internal)
      .def(
          "__exit__", [](File& f, const py::args&) { f.Close(); },
          "Closes the file, as close() does.")
      .def("close", &File::Close,
           "Closes this handle; operations in flight keep the descriptors until they end.");

  m.def(
      "filesystem_magic",
      [](const FsPath& path) {
        struct statfs st{};
        int rc;
        {
          GilReleased release;  // a network filesystem can take its time
          rc = statfs(path.bytes.c_str(), &st);
        }
        if (rc != 0) ThrowIoError(errno, "statfs", path);
        return static_cast<uint64_t>(st.f_type);
      },
      py::arg("path"), "statfs(2)'s f_type of the filesystem holding `path` (EXT4 0xEF53...).");
  m.def(
      "query_residency",
      [](int fd, uint64_t offset, uint64_t length) {
        Residency r = QueryResidency(fd, offset, length);
        return py::make_tuple(r.resident_bytes, r.checked_bytes,
                              std::string(ResidencyMethodName(r.method)));
      },
      py::arg("fd"), py::arg("offset"), py::arg("length"));
  m.def(
      "files_residency",
      [](const std::vector<FsPath>& paths) {
        const std::vector<std::string> names = PathBytes(paths);
        GilReleased release;
        const Residency r = QueryFilesResidency(names);
        return std::make_pair(r.resident_bytes, r.checked_bytes);
      },
      py::arg("paths"),
      "(bytes in the page cache, bytes) of the files at paths, summed; a file that cannot be "
      "opened counts as none cached.");
  m.def(
      "populate_for_reading",
      [](const std::vector<std::pair<uintptr_t, uint64_t>>& ranges, unsigned threads) {
        std::vector<MemoryRange> memory;
        memory.reserve(ranges.size());
        for (const auto& [address, length] : ranges) {
          memory.push_back({reinterpret_cast<const void*>(address), length});
        }
        GilReleased release;
        PopulateForReading(memory, threads);
      },
      py::arg("ranges"), py::arg("threads"),
      "Maps the pages of file mappings, (address, length) ranges, into the page tables now "
      "(MADV_POPULATE_READ over up to `threads` threads), so that first reads take no faults. A "
      "hint: never raises.");
}
