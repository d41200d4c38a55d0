// The one pickle opcode reader of tensortier's restricted unpicklers: torch.save's data.pkl
// (torch_pickle.cpp) and a DCP checkpoint's .metadata (dcp_metadata.cpp). It runs no Python and
// calls nothing: it builds a graph of values, and what a global may be, what a call (REDUCE,
// NEWOBJ), a persistent id and BUILD make, and how errors read, is the deriving reader's.
//
// Bounded: values and memo by the caps each reader gives (relative to the input's size), the
// stack and marks by fixed caps.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tensortier {

enum class PickleKind : uint8_t {
  kNone,
  kBool,
  kInt,
  kBigInt,
  kFloat,
  kStr,
  kBytes,
  kList,
  kTuple,
  kDict,
  kSet,
  kGlobal,
  kStorage,
  kTensor,
  kObject,
};

struct PickleValue {
  PickleKind kind = PickleKind::kNone;
  bool parameter = false;        // kTensor: rebuilt as an nn.Parameter (shares the tensor)
  bool requires_grad = false;    // kTensor with `parameter`: the parameter's requires_grad
  uint32_t state = UINT32_MAX;   // kObject: what BUILD set
  int64_t i = 0;                 // int, bool; a float's bits; a reader's index (kTensor...)
  std::string s;                 // str, bytes, "module.name" of a global or an object's class
  std::vector<uint32_t> items;   // list/tuple/set elements; dict keys and values interleaved;
                                 // an object's arguments
};

// What SETITEM(S) (keys and values interleaved, `keyed`) or APPEND(S) (elements) added to a
// kObject, where the reader lets objects take items. Apart from PickleValue, which every value
// of a pickle has (its size bounds a crafted pickle's memory).
struct PickleContents {
  std::vector<uint32_t> items;
  bool keyed = false;
};

class PickleMachine {
 public:
  // `extended`: also the opcodes torch.save does not emit but pickle.dumps does (protocols 3 to
  // 5: sets and frozensets, NEWOBJ, LONG4, the short and 8-byte binary strings).
  PickleMachine(std::string_view data, size_t max_values, size_t max_memo, bool extended);
  virtual ~PickleMachine() = default;

  const PickleValue& at(uint32_t i) const { return values_[i]; }
  // Throws FormatError: the reader's message (Describe) for `problem` at the current opcode.
  [[noreturn]] void Fail(std::string_view problem) const;

 protected:
  // The message of an error: `problem`, what the input is, where (op_pos_).
  virtual std::string Describe(std::string_view problem) const = 0;
  // Runs the pickle; returns the value STOP leaves.
  uint32_t Execute();

  // Refuses (Fail) a global the reader does not allow.
  virtual void CheckGlobal(const std::string& module, const std::string& name) = 0;
  // REDUCE (and NEWOBJ, where `newobj`): the value of callable(*args).
  virtual uint32_t Call(uint32_t callable, uint32_t args, bool newobj) = 0;
  // BINPERSID: the value persistent id `pid` stands for. Refused unless a reader overrides it.
  virtual uint32_t PersistentLoad(uint32_t pid);
  // BUILD of `target` (the top of the stack) with `state`.
  virtual void Build(uint32_t target, uint32_t state) = 0;
  // An integer of more than 8 bytes (little-endian two's complement): a kBigInt here.
  virtual uint32_t WideInt(std::string_view bytes);
  // What the error of an opcode this reader does not take adds to "unsupported pickle opcode 0x..".
  virtual std::string_view OpcodeNote() const { return ""; }
  // Whether SETITEM(S) and APPEND(S) may fill a kObject (a dict or list subclass such as
  // defaultdict) rather than being refused: into its `contents`.
  virtual bool ObjectsTakeItems() const { return false; }

  uint32_t New(PickleValue v);
  uint32_t Scalar(PickleKind kind, int64_t i = 0, std::string s = {});
  uint32_t Tuple(std::vector<uint32_t> items);

  std::string_view data_;
  size_t op_pos_ = 0;  // where the current opcode starts
  std::vector<PickleValue> values_;
  std::unordered_map<uint32_t, PickleContents> contents_;  // by kObject value, where filled
  static constexpr uint32_t kNoneValue = 0;  // the shared singletons the constructor makes
  static constexpr uint32_t kTrueValue = 1;
  static constexpr uint32_t kFalseValue = 2;
  static constexpr uint32_t kEmptyTuple = 3;

 private:
  const unsigned char* Take(size_t n);
  uint64_t TakeLe(size_t n);
  std::string TakeLine();
  void Push(uint32_t v);
  uint32_t Pop();
  size_t MarkFloor() const { return marks_.empty() ? 0 : marks_.back(); }
  std::vector<uint32_t> PopToMark();  // everything above the topmost mark, and the mark
  PickleValue& Top();
  // The items of the container on top of the stack, which must be a `kind` (or an object, where
  // ObjectsTakeItems): refused with `refusal` otherwise.
  std::vector<uint32_t>& Items(PickleKind kind, std::string_view refusal);
  void Memoize(uint64_t index);
  void Get(uint64_t index);

  static constexpr uint32_t kUnset = UINT32_MAX;  // a memo slot never set
  const size_t max_values_;
  const size_t max_memo_;
  const bool extended_;
  size_t pos_ = 0;
  std::vector<uint32_t> stack_;
  std::vector<size_t> marks_;
  std::vector<uint32_t> memo_;  // value by memo index; kUnset where none
  uint64_t memo_count_ = 0;     // memo keys set
};

}  // namespace tensortier
