#include "tensortier/shared/shared_spec.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include "tensortier/checkpoint/dtypes.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {


// The decimal integer `text` is, all of it; std::invalid_argument naming `field` otherwise (out of
// range included: a record in the store is anyone's writing).
template <typename T>
T ParseField(const std::string& field, const std::string& text, const std::string& record) {
  T v{};
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
    throw std::invalid_argument(
        StrCat("shared tensor record: ", field, " '", text, "' is not a number in range: ",
               record));
  }
  return v;
}

}  // namespace

// The names are string literals, so data() is NUL-terminated.
const char* SharedLayoutName(SharedLayout layout) {
  return NameOf(kSharedLayoutNames, layout, "?").data();
}

SharedLayout ParseSharedLayout(const std::string& name) {
  if (const auto layout = ValueOf(kSharedLayoutNames, name)) return *layout;
  throw std::invalid_argument(StrCat(
      "layout must be ", JoinNames(kSharedLayoutNames, ", ", " or ", "'"), ", not '", name, "'"));
}

const char* SharedMemoryName(SharedMemory memory) {
  return NameOf(kSharedMemoryNames, memory, "host").data();
}

SharedMemory ParseSharedMemory(const std::string& name) {
  if (const auto memory = ValueOf(kSharedMemoryNames, name)) return *memory;
  throw std::invalid_argument(StrCat(
      "memory must be ", JoinNames(kSharedMemoryNames, ", ", " or ", "'"), ", not '", name, "'"));
}

uint64_t SharedTensorSpec::rows() const {
  return shape.empty() ? 1 : shape[0];
}

uint64_t SharedTensorSpec::row_bytes() const {
  uint64_t n = element_size;
  for (size_t i = 1; i < shape.size(); ++i) n *= static_cast<uint64_t>(shape[i]);
  return n;
}

std::string SharedTensorSpec::Describe() const {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += StrCat(i ? "," : "", shape[i]);
  return StrCat("shape=[", dims, "] dtype=", dtype, " element_size=", element_size,
                " layout=", SharedLayoutName(layout), " memory=", SharedMemoryName(memory),
                " name='", name, "'");
}

SharedTensorSpec SharedTensorSpec::Parse(const std::string& described) {
  SharedTensorSpec s;
  auto field = [&](const std::string& key, char end) {
    size_t at = described.find(" " + key + "=");
    size_t start = at == std::string::npos ? std::string::npos : at + key.size() + 2;
    if (described.rfind(key + "=", 0) == 0) start = key.size() + 1;
    if (start == std::string::npos) {
      throw std::invalid_argument(StrCat("shared tensor record lacks ", key, ": ", described));
    }
    size_t stop = end == '\0' ? described.size() : described.find(end, start);
    if (stop == std::string::npos) stop = described.size();
    return described.substr(start, stop - start);
  };
  std::string dims = field("shape", ' ');
  if (dims.size() < 2 || dims.front() != '[' || dims.back() != ']') {
    throw std::invalid_argument(StrCat("bad shape in shared tensor record: ", described));
  }
  std::stringstream in(dims.substr(1, dims.size() - 2));
  for (std::string d; std::getline(in, d, ',');) {
    s.shape.push_back(ParseField<int64_t>("shape", d, described));
  }
  s.dtype = field("dtype", ' ');
  s.element_size = ParseField<uint64_t>("element_size", field("element_size", ' '), described);
  s.layout = ParseSharedLayout(field("layout", ' '));
  s.memory = ParseSharedMemory(field("memory", ' '));
  std::string quoted = field("name", '\0');
  if (quoted.size() < 2) throw std::invalid_argument(StrCat("bad name in: ", described));
  s.name = quoted.substr(1, quoted.size() - 2);
  return s;
}

void SharedTensorSpec::Validate() const {
  if (name.size() > kMaxSharedNameBytes) {
    throw std::invalid_argument(StrCat("name is ", name.size(), " bytes long; a shared tensor's ",
                                       "name has at most ", kMaxSharedNameBytes));
  }
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument(StrCat("shape has a negative dimension: ", Describe()));
  }
  if (element_size == 0) {
    throw std::invalid_argument(StrCat("element_size must be positive: ", Describe()));
  }
  // Every product is checked before it is formed: rows x row_bytes must not wrap.
  uint64_t bytes = element_size;
  for (size_t i = 0; i < shape.size(); ++i) {
    const auto d = static_cast<uint64_t>(shape[i]);
    if (i == 0 && d == 0) continue;  // no rows: the row's size must still be sane
    if (bytes > kMaxSharedTensorBytes || (d != 0 && bytes > kMaxSharedTensorBytes / d)) {
      throw std::invalid_argument(StrCat("shape and element_size make more than 2^56 bytes, ",
                                         "more than an address space holds: ", Describe()));
    }
    bytes *= d;
  }
  if (bytes > kMaxSharedTensorBytes) {
    throw std::invalid_argument(StrCat("shape and element_size make more than 2^56 bytes, ",
                                       "more than an address space holds: ", Describe()));
  }
  if (dtype.empty() || std::any_of(dtype.begin(), dtype.end(), [](char c) {
        return std::isspace(static_cast<unsigned char>(c));
      })) {
    throw std::invalid_argument(StrCat("dtype must be a word: ", Describe()));
  }
  constexpr std::string_view kTorch = "torch.";
  if (dtype.rfind(kTorch, 0) == 0) {
    const Dtype* known = DtypeOfTorch(std::string_view(dtype).substr(kTorch.size()));
    if (known != nullptr && known->bits % 8 == 0 && known->bits / 8 != element_size) {
      throw std::invalid_argument(StrCat("element_size ", element_size, " is not the size of ",
                                         dtype, " (", known->bits / 8, "): ", Describe()));
    }
  }
}

std::vector<SharedPartition> PartitionRows(uint64_t rows, uint64_t row_bytes, int world_size,
                                           uint64_t granule_bytes) {
  if (world_size <= 0) throw std::invalid_argument("world_size must be positive");
  uint64_t unit = 1;  // rows per indivisible unit: a whole number of granules
  if (row_bytes > 0 && granule_bytes > 1) unit = granule_bytes / std::gcd(granule_bytes, row_bytes);
  uint64_t units = (rows + unit - 1) / unit;
  uint64_t base = units / world_size;
  uint64_t extra = units % world_size;
  std::vector<SharedPartition> parts(world_size);
  uint64_t begin = 0;
  for (int r = 0; r < world_size; ++r) {
    uint64_t n = (base + (static_cast<uint64_t>(r) < extra ? 1 : 0)) * unit;
    n = std::min(n, rows - begin);
    parts[r] = SharedPartition{r, begin, n, n * row_bytes, nullptr};
    begin += n;
  }
  return parts;
}

bool IsHugeSharedTensor(const SharedTensorSpec& spec, int world_size) {
  return spec.rows() * spec.row_bytes() >=
         kHugePartitionThreshold * static_cast<uint64_t>(world_size);
}

std::string SharedTensorRecordKey(const std::string& name) {
  return StrCat("tensortier/shared/named/", name);
}

std::string SharedTensorRecord::Format() const {
  return StrCat(token, " ", world_size, " ", spec.Describe());
}

SharedTensorRecord SharedTensorRecord::Parse(const std::string& name, const std::string& value) {
  size_t a = value.find(' ');
  size_t b = a == std::string::npos ? a : value.find(' ', a + 1);
  if (b == std::string::npos) {
    throw std::invalid_argument(StrCat("bad shared tensor record for '", name, "': ", value));
  }
  SharedTensorRecord r;
  r.token = value.substr(0, a);
  auto is_hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
  const bool hex =
      r.token.size() == 32 && std::all_of(r.token.begin(), r.token.end(), is_hex);
  if (!hex) {
    throw std::invalid_argument(
        StrCat("shared tensor record for '", name, "': token is not 32 hex digits: ", value));
  }
  r.world_size = ParseField<int>("world_size", value.substr(a + 1, b - a - 1), value);
  if (r.world_size <= 0 || r.world_size > kMaxSharedWorldSize) {
    throw std::invalid_argument(StrCat("shared tensor record for '", name, "': world_size ",
                                       r.world_size, " is not in [1, ", kMaxSharedWorldSize,
                                       "]: ", value));
  }
  r.spec = SharedTensorSpec::Parse(value.substr(b + 1));
  if (r.spec.name != name) {
    throw std::invalid_argument(StrCat("shared tensor record for '", name, "': name is '",
                                       r.spec.name, "': ", value));
  }
  if (r.spec.layout == SharedLayout::kDistributed) {
    throw std::invalid_argument(StrCat("shared tensor record for '", name,
                                       "': layout distributed is never published: ", value));
  }
  try {
    r.spec.Validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(StrCat("shared tensor record for '", name, "': ", e.what()));
  }
  return r;
}

}  // namespace tensortier
