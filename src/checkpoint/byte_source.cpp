#include "tensortier/checkpoint/byte_source.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

void CheckRange(const std::string& name, uint64_t size, uint64_t offset, size_t len) {
  if (offset > size || len > size - offset) {
    throw FormatError(StrCat(name, ": truncated: needs bytes [", offset, ", ", offset + len,
                             ") but the file has ", size, " bytes"));
  }
}

}  // namespace

FileSource::FileSource(File file) : file_(std::move(file)), size_(file_.Size()) {}

void FileSource::ReadAt(uint64_t offset, void* buf, size_t len) const {
  CheckRange(file_.path(), size_, offset, len);
  auto* p = static_cast<unsigned char*>(buf);
  size_t done = 0;
  while (done < len) {
    ssize_t rc =
        pread(file_.buffered_fd(), p + done, len - done, static_cast<off_t>(offset + done));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) ThrowIoError(errno, "pread", file_.path(), offset + done, len - done);
    if (rc == 0) {
      // The file shrank after we took its size.
      throw FormatError(StrCat(file_.path(), ": truncated: end of file at offset ", offset + done,
                               " while reading ", len, " bytes at offset ", offset));
    }
    done += static_cast<size_t>(rc);
  }
}

void MemorySource::ReadAt(uint64_t offset, void* buf, size_t len) const {
  CheckRange(name_, size_, offset, len);
  if (len > 0) std::memcpy(buf, data_ + offset, len);
}

}  // namespace tensortier
