#include "tensortier/checkpoint/load_checks.hpp"

#include <stdexcept>

#include "tensortier/checkpoint/checkpoint_pipeline.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {

void CheckLoadOptions(std::string_view device, bool verify, bool mmap, std::string_view to_meta) {
  if (verify && device == "meta") {
    throw std::invalid_argument(
        "verify=True checks the tensors' bytes, and a load to the meta device reads none: load "
        "with verify=False");
  }
  if (verify && !to_meta.empty()) {
    throw std::invalid_argument(StrCat(
        "verify=True checks the tensors' bytes, and map_location sends the storages saved at ",
        to_meta,
        " to the meta device, which reads none of theirs: load with verify=False, or "
        "map them elsewhere"));
  }
  if (mmap && device != "cpu" && device != "meta") {  // meta reads no bytes: nothing to map
    throw std::invalid_argument(
        StrCat("mmap=True maps the file into host memory: it needs device='cpu', not ", device,
               " (load to the GPU with mmap=False: its bytes go there without host copies)"));
  }
}

ProgressBar::ProgressBar(std::string label, uint64_t total, bool enabled,
                         std::function<void(const std::string&)> write)
    : label_(std::move(label)),
      total_(total),
      enabled_(enabled && total > 0),
      write_(std::move(write)) {}

void ProgressBar::Update(uint64_t bytes) {
  done_ += bytes;
  if (!enabled_) return;
  const Clock::time_point now = Clock::now();
  if (!last_ || now - *last_ >= std::chrono::milliseconds(100) || done_ >= total_) {
    last_ = now;
    Draw(now);
  }
}

void ProgressBar::Close() {
  if (!enabled_) return;
  if (drawn_ != done_) Draw(Clock::now());
  write_("\n");
}

void ProgressBar::Draw(Clock::time_point now) {
  drawn_ = done_;
  const std::chrono::duration<double> seconds = now - start_;
  write_(ProgressLine(label_, done_, total_, seconds.count()));
}

uint64_t CheckTorchStorage(std::string_view path, std::string_view record, std::string_view key,
                           std::string_view dtype, std::optional<int64_t> nbytes,
                           std::string_view nbytes_text, std::optional<uint64_t> record_size,
                           const std::optional<std::pair<std::string, uint64_t>>& prior) {
  if (prior) {
    const bool same = dtype == prior->first && nbytes && *nbytes >= 0 &&
                      static_cast<uint64_t>(*nbytes) == prior->second;
    if ((prior->second != 0 || nbytes_text != "0") && !same) {
      throw FormatError(StrCat(path, ": storage '", key, "' is described twice, differently (",
                               prior->first, ", ", prior->second, " bytes; ", dtype, ", ",
                               nbytes_text, " bytes): the file is damaged"));
    }
    return prior->second;
  }
  if (!record_size) throw FormatError(StrCat(path, ": storage record ", record, " is missing"));
  if (nbytes_text.starts_with('-')) {
    throw FormatError(StrCat(path, ": storage ", key, " has a negative size"));
  }
  if (!nbytes || static_cast<uint64_t>(*nbytes) != *record_size) {
    throw FormatError(StrCat(path, ": storage ", key, " should hold ", nbytes_text,
                             " bytes, its record has ", *record_size));
  }
  return *record_size;
}

}  // namespace tensortier
