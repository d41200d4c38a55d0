#include "tensortier/checkpoint/hf_checkpoint.hpp"

#include <fcntl.h>
#include <linux/fs.h>  // RENAME_NOREPLACE
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "tensortier/checkpoint/checkpoint_file.hpp"
#include "tensortier/checkpoint/checkpoint_format.hpp"
#include "tensortier/checkpoint/directory_commit.hpp"
#include "tensortier/checkpoint/safetensors.hpp"
#include "tensortier/io/file_system.hpp"
#include "tensortier/io/page_cache.hpp"
#include "tensortier/util/error.hpp"
#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

namespace fs = std::filesystem;

// Whether the folder `at` names (a /proc link, followed) is `top` or a folder inside it. It is
// walked up through its ".." entries while on top's file system; attributes come from the cache
// (AT_STATX_DONT_SYNC), so that a process sitting on a hung network mount does not hold up the
// save.
bool FolderIsIn(std::string at, const struct stat& top) {
  const auto same_file = [](const struct statx& a, const struct statx& b) {
    return a.stx_dev_major == b.stx_dev_major && a.stx_dev_minor == b.stx_dev_minor &&
           a.stx_ino == b.stx_ino;
  };
  struct statx here{};
  for (int depth = 0; depth < 4096; ++depth, at += "/..") {
    struct statx up{};
    if (::statx(AT_FDCWD, at.c_str(), AT_STATX_DONT_SYNC, STATX_INO | STATX_TYPE, &up) != 0) {
      return false;
    }
    if (depth == 0 && !S_ISDIR(up.stx_mode)) return false;  // a file's descriptor
    if (makedev(up.stx_dev_major, up.stx_dev_minor) != top.st_dev) return false;  // another mount
    if (up.stx_ino == top.st_ino) return true;
    if (depth > 0 && same_file(up, here)) return false;  // the file system's root
    here = up;
  }
  return false;
}

// Whether a process (this one, or another this process may look at: a logger, a shell, a
// watcher, an uploader) works in `top` or a folder inside it, as its working directory or through
// a folder's descriptor it holds (openat): a swap would leave it in a removed folder, where its
// relative paths no longer reach the model's directory. Processes of other users (EACCES) and
// those gone meanwhile (ENOENT) are passed over.
bool AnyProcessWorksIn(const struct stat& top) {
  std::error_code ec;
  for (auto it = fs::directory_iterator("/proc", ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string pid = it->path().filename().string();
    if (pid.empty() ||
        !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      continue;
    }
    if (FolderIsIn(StrCat("/proc/", pid, "/cwd"), top)) return true;
    std::error_code fd_ec;
    for (auto fd = fs::directory_iterator(StrCat("/proc/", pid, "/fd"), fd_ec);
         !fd_ec && fd != fs::directory_iterator(); fd.increment(fd_ec)) {
      if (FolderIsIn(fd->path().string(), top)) return true;
    }
  }
  return false;
}

bool IsFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// Whether config.json in `dir` is unreadable, not a JSON object, or names a quantization_config.
bool QuantizedOrUnreadable(const fs::path& dir) {
  std::ifstream in(dir / "config.json", std::ios::binary);
  if (!in) return true;
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return true;
  try {
    const std::string s = text.str();
    JsonReader r(s, "config.json");
    r.Expect('{');
    if (r.Consume('}')) return false;
    do {
      if (r.ReadString() == "quantization_config") return true;
      r.Expect(':');
      r.SkipValue();
    } while (r.Consume(','));
    r.Expect('}');
    r.ExpectEnd();
    return false;
  } catch (const FormatError&) {
    return true;
  }
}

// os.path.dirname and os.path.basename.
std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash == 0 ? 1 : slash);
}
std::string BaseName(const std::string& path) {
  return path.substr(path.rfind('/') + 1);
}

// `to` gets `from`'s owner (where this process may give it), permission bits and access and
// modification times (shutil.copystat, plus the owner: a directory shared by a group stays so).
// A file or folder open (read-only, not followed through a link) while in scope; fd() is -1
// where it could not be opened (errno then).
class OpenedPath {
 public:
  explicit OpenedPath(const std::string& path)
      : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW)) {}
  ~OpenedPath() {
    if (fd_ >= 0) ::close(fd_);
  }
  OpenedPath(const OpenedPath&) = delete;
  OpenedPath& operator=(const OpenedPath&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

void CopyStat(const std::string& from, const std::string& to) {
  struct stat st{};
  if (::stat(from.c_str(), &st) != 0) ThrowIoError(errno, "stat", from);
  if (::chown(to.c_str(), st.st_uid, st.st_gid) != 0 && errno != EPERM) {
    ThrowIoError(errno, "chown", to);
  }
  // Opened before the mode is given (a mode without the owner's read bit would refuse it); a
  // copied file this user may not read (a write-only one) keeps no attributes.
  const OpenedPath opened(to);
  if (opened.fd() < 0 && errno != EACCES) ThrowIoError(errno, "open", to);
  if (::chmod(to.c_str(), st.st_mode & 07777) != 0) ThrowIoError(errno, "chmod", to);
  // ACLs (a shared output folder's default ACL, which files written into it then inherit),
  // user.* attributes: the folder transformers writes into keeps them. After the mode: an ACL
  // set now keeps its mask.
  if (opened.fd() >= 0) CopyExtendedAttributes(from, opened.fd(), to);
  const struct timespec times[2] = {st.st_atim, st.st_mtim};
  if (::utimensat(AT_FDCWD, to.c_str(), times, 0) != 0) ThrowIoError(errno, "utimensat", to);
}

// Whether a save may write the file `name` of the model directory (at its top: `top`) in place
// (open, truncate, write): JSON files at any depth (config.json, generation_config.json, the
// index; an adapter's adapter_config.json in its folder), model cards (README.md, which PEFT's
// save writes), the code of custom models, and at the top torch.save shards
// (safe_serialization=False). The staging directory gets copies of these, so that the old
// directory stays whole until the swap; every other file is the same file in both (a link:
// safetensors shards are replaced by rename, and a log open there goes on being written).
bool RewrittenInPlace(const std::string& name, bool top) {
  return name.ends_with(".json") || name.ends_with(".md") || name.ends_with(".py") ||
         (top && name.ends_with(".bin"));
}

// What the folder `from` holds, into the existing folder `to`, as StageHfSave keeps it: symbolic
// links as links, folders made anew, files linked (the same files: an open log file goes on
// being written, owners and attributes stay) except those a save rewrites in place at the top
// (see RewrittenInPlace), which are copied. Across file systems (a mount point inside) files are
// copied.
void LinkOrCopyTree(const std::string& from, const std::string& to, bool top);

// One entry of LinkOrCopyTree's: `entry` staged as `dst`.
void LinkOrCopyEntry(const fs::directory_entry& entry, const std::string& dst, bool top) {
  std::error_code ec;
  const std::string src = entry.path().string();
  if (entry.is_symlink(ec)) {
    const fs::path target = fs::read_symlink(src, ec);
    if (ec) ThrowIoError(ec.value(), "readlink", src);
    fs::create_symlink(target, dst, ec);
    if (ec) ThrowIoError(ec.value(), "symlink", dst);
    return;
  }
  if (entry.is_directory(ec)) {
    if (!fs::create_directory(dst, ec) && ec) ThrowIoError(ec.value(), "mkdir", dst);
    LinkOrCopyTree(src, dst, false);
    return;
  }
  // Only regular files are copied: a FIFO or socket named config.json is linked.
  if ((!RewrittenInPlace(entry.path().filename().string(), top) || !entry.is_regular_file(ec)) &&
      ::linkat(AT_FDCWD, src.c_str(), AT_FDCWD, dst.c_str(), 0) == 0) {
    return;
  }
  if (!fs::copy_file(src, dst, fs::copy_options::overwrite_existing, ec) || ec) {
    ThrowIoError(ec ? ec.value() : EIO, "copy", src);
  }
  CopyStat(src, dst);
}

void LinkOrCopyTree(const std::string& from, const std::string& to, bool top) {
  std::error_code ec;
  fs::directory_iterator it(from, ec);
  if (ec) ThrowIoError(ec.value(), "list", from);
  for (const fs::directory_entry& entry : it) {
    const std::string dst = StrCat(to, "/", entry.path().filename().string());
    try {
      LinkOrCopyEntry(entry, dst, top);
    } catch (const IoError& e) {
      // Removed by another process meanwhile (ENOENT: the staging folder is ours): left out, as
      // one it removes after the staging is (CarryNewEntries removes it from the new directory).
      // One made again under its name since is another file, which the carry moves.
      if (e.error_code() != ENOENT) throw;
      fs::remove_all(dst, ec);  // what was staged of it
    }
  }
  CopyStat(from, to);
}

}  // namespace

bool IsHfSafetensorsFile(const std::string& path) {
  return path.ends_with(".safetensors");
}

void CheckHfModelDirectory(const std::string& dir) {
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return;
  if (fs::exists(dir, ec)) {
    ThrowIoError(ENOTDIR,
                 "read a model (tensortier.hf reads a model directory: pass the one holding "
                 "config.json and the weights)",
                 dir);
  }
  ThrowIoError(ENOENT,
               "find the model directory (tensortier.hf reads local model directories; for a "
               "Hugging Face Hub model id, download it with "
               "huggingface_hub.snapshot_download(repo_id) and pass the directory it returns)",
               dir);
}

std::optional<std::string> HfLoadTarget(
    const std::vector<std::string>& files,
    const std::optional<std::map<std::string, std::string>>& weight_map) {
  if (files.empty() || !std::all_of(files.begin(), files.end(), IsHfSafetensorsFile)) {
    return std::nullopt;  // .bin files: transformers' torch.load
  }
  if (!weight_map) return files.size() == 1 ? std::optional(files[0]) : std::nullopt;
  std::set<std::string> shards;
  for (const auto& [tensor, shard] : *weight_map) shards.insert(shard);
  std::set<std::string> names;
  for (const std::string& file : files) names.insert(BaseName(file));
  if (shards != names) return std::nullopt;  // extra files beside the shards: transformers'
  // transformers loads every tensor of each file, and reports those the index names but no file
  // holds as missing keys; tensortier.load reads the tensors the index names, and refuses one a
  // shard lacks. A shard holding more or less than its index says is read by transformers.
  std::map<std::string, size_t> indexed;  // shard -> how many tensors the index puts there
  for (const auto& [tensor, shard] : *weight_map) ++indexed[shard];
  for (const std::string& file : files) {
    const std::string shard = BaseName(file);
    const auto entries = ReadSafetensorsHeader(file).header.entries;
    if (entries.size() != indexed[shard]) return std::nullopt;
    for (const SafetensorsEntry& e : entries) {
      const auto it = weight_map->find(e.name);
      if (it == weight_map->end() || it->second != shard) return std::nullopt;
    }
  }
  try {
    return HfShardIndexOf(DirName(files[0]), files[0], *weight_map);
  } catch (const IoError& e) {
    // No index here has that map (one naming a tensor twice, which transformers' json.load
    // reads and ReadShardIndex refuses): transformers reads the files.
    if (e.error_code() != ENOENT) throw;
    return std::nullopt;
  }
}

bool HfDirectorySwappable(const std::string& final_dir) {
  struct stat top{};
  if (::lstat(final_dir.c_str(), &top) != 0) return true;  // a new directory (or unreadable)
  if (!S_ISDIR(top.st_mode) || IsMountPoint(final_dir)) return false;
  // A file system mounted on a folder inside: another device, or a bind mount of this one.
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(
           final_dir, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (!it->is_directory(ec) || it->is_symlink(ec)) continue;
    struct stat st{};
    const std::string path = it->path().string();
    if (::lstat(path.c_str(), &st) == 0 && (st.st_dev != top.st_dev || IsMountPoint(path))) {
      return false;
    }
  }
  return !AnyProcessWorksIn(top);
}

HfSaveStaging StageHfSave(const std::string& final_dir) {
  std::error_code ec;
  const fs::file_status status = fs::status(final_dir, ec);
  const bool exists = fs::exists(status);
  if (exists && !fs::is_directory(status)) {
    ThrowIoError(ENOTDIR, "save a model directory over a file", final_dir);
  }
  fs::create_directories(DirName(final_dir), ec);
  if (ec) ThrowIoError(ec.value(), "mkdir", DirName(final_dir));
  HfSaveStaging out{CreateStagingDirectory(final_dir), {}};
  try {
    if (exists) LinkOrCopyTree(final_dir, out.dir, true);
    for (auto it = fs::recursive_directory_iterator(out.dir), end = decltype(it)(); it != end;
         ++it) {
      const std::string rel = it->path().lexically_relative(out.dir).string();
      KeptEntry& entry = out.kept[rel];
      if (it->is_regular_file() && !it->is_symlink()) {
        entry.staged_file = VersionOf(it->path().string());
        const std::optional<FileVersion> old = VersionOf(StrCat(final_dir, "/", rel));
        entry.linked = entry.staged_file && old && old->dev == entry.staged_file->dev &&
                       old->ino == entry.staged_file->ino;
      }
    }
  } catch (...) {
    RemoveDirectoryTree(out.dir);
    throw;
  }
  return out;
}

namespace {

// After the exchange (staging.dir names the old directory): what the old directory gained during
// the save is moved into the new one, and the old one removed; where something could not move,
// the old directory keeps only that (not the old model: a checkpoint loop would keep one at each
// such save), renamed "NAME.previous-<UTC time>" beside final_dir: a name no removal of killed
// saves' temporary files takes.
void FinishExchange(const HfSaveStaging& staging, const std::string& final_dir, HfSaveCommit& out) {
  out.left = CarryNewEntries(staging.dir, final_dir, staging.kept).left;
  if (out.left.empty()) {
    RemoveDirectoryTree(staging.dir);
    return;
  }
  RemoveKeptEntries(staging.dir, staging.kept, out.left);
  out.kept_dir = staging.dir;
  std::string stem = final_dir;
  while (stem.size() > 1 && stem.back() == '/') stem.pop_back();
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  char when[32] = "";
  if (gmtime_r(&now, &utc) != nullptr) std::strftime(when, sizeof when, "%Y%m%dT%H%M%SZ", &utc);
  stem = StrCat(stem, ".previous-", when);
  for (int n = 0; n < 100; ++n) {
    const std::string name = n == 0 ? stem : StrCat(stem, "-", n);
    if (syscall(SYS_renameat2, AT_FDCWD, staging.dir.c_str(), AT_FDCWD, name.c_str(),
                RENAME_NOREPLACE) == 0) {
      out.kept_dir = name;
      return;
    }
    if (errno != EEXIST) return;  // kept where it is
  }
}

}  // namespace

HfSaveCommit CommitHfSave(const HfSaveStaging& staging, const std::string& final_dir,
                          const FileSystem& fs) {
  HfSaveCommit out;
  struct stat staged{};
  const bool known = ::stat(staging.dir.c_str(), &staged) == 0;
  try {
    CommitDirectory(staging.dir, final_dir, fs);
    out.swapped = true;
  } catch (const IoError& e) {
    struct stat now{};
    if (known && ::stat(final_dir.c_str(), &now) == 0 && now.st_dev == staged.st_dev &&
        now.st_ino == staged.st_ino) {
      // The exchange happened and a later step failed (the parent directory's fsync): the new
      // directory is in place, and the old one still holds what others wrote meanwhile.
      FinishExchange(staging, final_dir, out);
      throw;
    }
    const int code = e.error_code();
    RemoveDirectoryTree(staging.dir);
    if (code != EBUSY && code != EXDEV && code != EINVAL && code != ENOSYS && code != EOPNOTSUPP) {
      throw;
    }
    return out;
  }
  FinishExchange(staging, final_dir, out);
  return out;
}

void ReplaceLinkedShard(const std::string& written, const std::string& link, const FileSystem& fs) {
  try {
    fs.Rename(written, link);
    fs.SyncDirectory(DirName(link).empty() ? "." : DirName(link), link);
  } catch (...) {
    ::unlink(written.c_str());
    throw;
  }
}

std::optional<std::string> HfWeightsFile(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return std::nullopt;
  for (const char* name : kHfWeightsFiles) {
    if (IsFile(fs::path(dir) / name)) return (fs::path(dir) / name).string();
  }
  std::vector<std::string> others;
  const auto is_index = [](const std::string& name) {
    return name.find(".index") != std::string::npos && name.ends_with(".json");
  };
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (IsFile(entry.path()) &&
        (name.ends_with(".safetensors") || name.ends_with(".bin") || name.ends_with(".pt") ||
         name.ends_with(".pth") || is_index(name))) {
      others.push_back(name);
    }
  }
  if (others.empty()) return std::nullopt;
  // Indexes first: a sharded variant's (model.safetensors.index.fp16.json) is the one file to
  // pass, not its first shard.
  std::sort(others.begin(), others.end(), [&](const std::string& a, const std::string& b) {
    return std::pair(!is_index(a), a) < std::pair(!is_index(b), b);
  });
  std::string listed;
  for (size_t i = 0; i < others.size() && i < 4; ++i) listed += StrCat(i ? ", " : "", others[i]);
  if (others.size() > 4) listed += StrCat(" and ", others.size() - 4, " more");
  throw FormatError(StrCat(dir,
                           ": no model.safetensors, model.safetensors.index.json, "
                           "pytorch_model.bin or pytorch_model.bin.index.json (the files "
                           "from_pretrained reads without a variant); pass one of the weights "
                           "files it holds: ",
                           listed));
}

std::optional<HfCheckpoint> FindHfCheckpoint(const std::string& dir) {
  const fs::path d(dir);
  // transformers' order, of the safetensors ones (the first two of kHfWeightsFiles).
  const fs::path single = d / kHfWeightsFiles[0];
  const fs::path target = IsFile(single) ? single : d / kHfWeightsFiles[1];
  if (!IsFile(target) || QuantizedOrUnreadable(d)) return std::nullopt;
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(d, ec)) {
    if (IsHfSafetensorsFile(entry.path().string())) files.push_back(entry.path().string());
  }
  return HfCheckpoint{target.string(), HfFilesCached(files)};
}

std::string HfShardIndexOf(const std::string& dir, const std::string& shard,
                           const std::map<std::string, std::string>& weight_map) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("model.safetensors.index") && name.ends_with(".json")) {
      names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  const std::string prefix = StrCat(dir, "/");
  for (const std::string& name : names) {
    const std::string path = StrCat(prefix, name);
    std::map<std::string, std::string> map;
    try {
      for (const Shard& s : ReadShardIndex(path)) {
        const std::string file = s.path.starts_with(prefix) ? s.path.substr(prefix.size()) : s.path;
        for (const std::string& tensor : s.names) map.emplace(tensor, file);
      }
    } catch (const FormatError&) {
      continue;  // another kind of file, or an index naming no tensors: not the one
    }
    if (map == weight_map) return path;
  }
  throw IoError(ENOENT, StrCat("find a shard index naming the shards of ", shard), dir, 0, 0);
}

bool HfFilesCached(const std::vector<std::string>& files) {
  const Residency r = QueryFilesResidency(files);
  return r.resident_bytes * 10 >= r.checked_bytes * 9;
}

}  // namespace tensortier
