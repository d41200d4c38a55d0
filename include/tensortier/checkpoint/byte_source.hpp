// Random-access reads of a whole file or of a memory buffer, for the parsers of file headers and
// directories (safetensors, zip). Memory sources let tests and fuzz targets feed the same code
// paths as files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "tensortier/io/file.hpp"

namespace tensortier {

// Thread-compatible; implementations below are safe for concurrent ReadAt calls.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  // The path, or a description, used in error messages.
  virtual const std::string& name() const = 0;
  // Fills `buf` with exactly `len` bytes at `offset`. Throws FormatError if the range goes past
  // size() (a truncated or changed file), IoError when the read fails.
  virtual void ReadAt(uint64_t offset, void* buf, size_t len) const = 0;
};

// pread() on the file's buffered descriptor; the size is taken once, at construction.
class FileSource : public ByteSource {
 public:
  explicit FileSource(File file);
  uint64_t size() const override { return size_; }
  const std::string& name() const override { return file_.path(); }
  void ReadAt(uint64_t offset, void* buf, size_t len) const override;

 private:
  File file_;
  uint64_t size_;
};

// Borrows `data` (the caller keeps it alive).
class MemorySource : public ByteSource {
 public:
  MemorySource(const void* data, size_t size, std::string name = "<memory>")
      : data_(static_cast<const unsigned char*>(data)), size_(size), name_(std::move(name)) {}
  uint64_t size() const override { return size_; }
  const std::string& name() const override { return name_; }
  void ReadAt(uint64_t offset, void* buf, size_t len) const override;

 private:
  const unsigned char* data_;
  size_t size_;
  std::string name_;
};

}  // namespace tensortier
