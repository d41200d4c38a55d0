// What tensortier.load decides without tensor objects: arguments that exclude each other, the
// progress bar of a long load (when it draws), and the storages a torch.save pickle's persistent
// ids describe, checked against the zip records before any memory is allocated for them.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tensortier {

// tensortier.load's arguments as resolved: the target `device` ("cpu", "cuda:N" or "meta"),
// `verify`, `mmap`, and `to_meta`: the saved locations a map_location dict sends to the meta
// device, as Python prints their list ("" for none). std::invalid_argument for verify=True where
// no byte is read, or mmap=True for another device than the CPU (the meta device reads no
// bytes: mmap means nothing there, as in torch.load).
void CheckLoadOptions(std::string_view device, bool verify, bool mmap, std::string_view to_meta);

// Loads of at least this many bytes show their progress bar by default (stderr a terminal).
inline constexpr uint64_t kProgressMinBytes = uint64_t{512} << 20;

// A one-line progress bar (ProgressLine) redrawn at most ten times a second, its final state
// drawn once. `write` gets each piece of text; it is called on the thread that calls Update and
// Close (the Python package writes through sys.stderr).
class ProgressBar {
 public:
  ProgressBar(std::string label, uint64_t total, bool enabled,
              std::function<void(const std::string&)> write);
  bool enabled() const { return enabled_; }
  uint64_t done() const { return done_; }
  void Update(uint64_t bytes);
  // Draws the final state (once) and ends the line.
  void Close();

 private:
  using Clock = std::chrono::steady_clock;
  void Draw(Clock::time_point now);

  std::string label_;
  uint64_t total_;
  bool enabled_;
  std::function<void(const std::string&)> write_;
  uint64_t done_ = 0;
  std::optional<uint64_t> drawn_;  // `done_` at the last drawing
  Clock::time_point start_ = Clock::now();
  std::optional<Clock::time_point> last_;
};

// Storage `key` as a persistent id describes it: `dtype` (torch's name, "torch.float32"), its
// size in bytes as the pickle gives it (`nbytes_text`, any integer; `nbytes` when it fits).
// `record_size`: that of its zip record `record` (nullopt: none); `prior`: (dtype, bytes) of an
// earlier description of the same key. Returns its size in bytes; FormatError naming `path` for a
// missing record, a negative size, a size its record does not have, or a second description that
// differs from the first (torch.save never describes a storage with bytes two ways: read as
// either, the other's tensors would get wrong values; the CLI's pickle reader's rule).
uint64_t CheckTorchStorage(std::string_view path, std::string_view record, std::string_view key,
                           std::string_view dtype, std::optional<int64_t> nbytes,
                           std::string_view nbytes_text, std::optional<uint64_t> record_size,
                           const std::optional<std::pair<std::string, uint64_t>>& prior);

}  // namespace tensortier
