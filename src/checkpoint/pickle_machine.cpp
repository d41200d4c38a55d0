#include "tensortier/checkpoint/pickle_machine.hpp"

#include <algorithm>
#include <utility>

#include "tensortier/util/format_error.hpp"
#include "tensortier/util/json.hpp"
#include "tensortier/util/strings.hpp"

namespace tensortier {
namespace {

constexpr size_t kMaxStack = 1u << 20;
constexpr size_t kMaxMarks = 1u << 16;

}  // namespace

PickleMachine::PickleMachine(std::string_view data, size_t max_values, size_t max_memo,
                             bool extended)
    : data_(data), max_values_(max_values), max_memo_(max_memo), extended_(extended) {
  values_.reserve(std::min<size_t>(max_values_, 1u << 12));
  // Shared immutable singletons: a list of a million Nones costs no value each.
  for (auto [kind, i] : {std::pair{PickleKind::kNone, 0},
                         {PickleKind::kBool, 1},
                         {PickleKind::kBool, 0},
                         {PickleKind::kTuple, 0}}) {
    PickleValue v;
    v.kind = kind;
    v.i = i;
    values_.push_back(std::move(v));
  }
}

void PickleMachine::Fail(std::string_view problem) const {
  throw FormatError(Describe(problem));
}

uint32_t PickleMachine::PersistentLoad(uint32_t) {
  Fail("unsupported pickle opcode 0x51 (a persistent id)");
}

uint32_t PickleMachine::WideInt(std::string_view) {
  return Scalar(PickleKind::kBigInt);
}

const unsigned char* PickleMachine::Take(size_t n) {
  if (data_.size() - pos_ < n) Fail("truncated pickle");
  auto* p = reinterpret_cast<const unsigned char*>(data_.data()) + pos_;
  pos_ += n;
  return p;
}

uint64_t PickleMachine::TakeLe(size_t n) {
  const unsigned char* p = Take(n);
  uint64_t v = 0;
  for (size_t i = n; i > 0; --i) v = (v << 8) | p[i - 1];
  return v;
}

std::string PickleMachine::TakeLine() {
  size_t end = data_.find('\n', pos_);
  if (end == std::string_view::npos || end - pos_ > 256) Fail("bad GLOBAL operand");
  std::string s(data_.substr(pos_, end - pos_));
  pos_ = end + 1;
  return s;
}

uint32_t PickleMachine::New(PickleValue v) {
  if (values_.size() >= max_values_) {
    Fail(StrCat("more than ", max_values_, " values in a ", data_.size(), "-byte pickle"));
  }
  if (values_.size() == values_.capacity()) {
    // Doubling, but never past the cap, nor by a last small step (old + new both live then).
    size_t grown = std::min(max_values_, values_.capacity() * 2);
    if (max_values_ - grown < grown / 2) grown = max_values_;
    values_.reserve(grown);
  }
  values_.push_back(std::move(v));
  return static_cast<uint32_t>(values_.size() - 1);
}

uint32_t PickleMachine::Scalar(PickleKind kind, int64_t i, std::string s) {
  PickleValue v;
  v.kind = kind;
  v.i = i;
  v.s = std::move(s);
  return New(std::move(v));
}

uint32_t PickleMachine::Tuple(std::vector<uint32_t> items) {
  if (items.empty()) return kEmptyTuple;
  PickleValue v;
  v.kind = PickleKind::kTuple;
  v.items = std::move(items);
  return New(std::move(v));
}

void PickleMachine::Push(uint32_t v) {
  if (stack_.size() >= kMaxStack) Fail("pickle stack too deep");
  stack_.push_back(v);
}

uint32_t PickleMachine::Pop() {
  if (stack_.size() <= MarkFloor()) Fail("stack underflow");
  uint32_t v = stack_.back();
  stack_.pop_back();
  return v;
}

std::vector<uint32_t> PickleMachine::PopToMark() {
  if (marks_.empty()) Fail("no MARK on the stack");
  size_t m = marks_.back();
  marks_.pop_back();
  std::vector<uint32_t> items(stack_.begin() + static_cast<ptrdiff_t>(m), stack_.end());
  stack_.resize(m);
  return items;
}

PickleValue& PickleMachine::Top() {
  if (stack_.size() <= MarkFloor()) Fail("stack underflow");
  return values_[stack_.back()];
}

std::vector<uint32_t>& PickleMachine::Items(PickleKind kind, std::string_view refusal) {
  PickleValue& c = Top();
  if (c.kind == kind) return c.items;
  if (c.kind != PickleKind::kObject || kind == PickleKind::kSet || !ObjectsTakeItems()) {
    Fail(refusal);
  }
  const bool keyed = kind == PickleKind::kDict;
  PickleContents& contents = contents_[stack_.back()];
  if (!contents.items.empty() && contents.keyed != keyed) {
    Fail("an object given both items and elements");
  }
  contents.keyed = keyed;
  return contents.items;
}

void PickleMachine::Memoize(uint64_t index) {
  if (stack_.empty()) Fail("memo put with an empty stack");
  if (index >= max_memo_) {
    Fail(StrCat("memo key ", index, " is too large for a ", data_.size(), "-byte pickle"));
  }
  if (index >= memo_.size()) memo_.resize(index + 1, kUnset);
  if (memo_[index] == kUnset) ++memo_count_;
  memo_[index] = stack_.back();
}

void PickleMachine::Get(uint64_t index) {
  if (index >= memo_.size() || memo_[index] == kUnset) {
    Fail(StrCat("memo key ", index, " was never set"));
  }
  Push(memo_[index]);
}

uint32_t PickleMachine::Execute() {
  for (;;) {
    op_pos_ = pos_;
    uint8_t op = *Take(1);
    // The opcodes of pickle.dumps that torch.save does not emit: only for extended readers.
    static constexpr std::string_view kExtended(
        "\x8f\x90\x91\x81\x8b\x8e"
        "TU",
        8);
    if (!extended_ && kExtended.find(static_cast<char>(op)) != std::string_view::npos) op = 0xff;
    switch (op) {
      case 0x80:  // PROTO
        if (*Take(1) > 5) Fail("unsupported pickle protocol");
        break;
      case 0x95: {  // FRAME: framing only, but its bytes must follow (as pickle requires)
        const uint64_t frame = TakeLe(8);
        if (frame > data_.size() - pos_) {
          Fail(StrCat("FRAME of ", frame, " bytes is longer than the ", data_.size() - pos_,
                      " bytes left in the pickle"));
        }
        break;
      }
      case '.':  // STOP
        if (!marks_.empty() || stack_.size() != 1) Fail("STOP with a malformed stack");
        return stack_.back();
      case '(':
        if (marks_.size() >= kMaxMarks) Fail("too many nested MARKs");
        marks_.push_back(stack_.size());
        break;
      case '0':  // POP
        Pop();
        break;
      case '1':  // POP_MARK
        PopToMark();
        break;
      case '2': {  // DUP
        uint32_t v = Pop();
        Push(v);
        Push(v);
        break;
      }
      case '}':
        Push(Scalar(PickleKind::kDict));
        break;
      case ']':
        Push(Scalar(PickleKind::kList));
        break;
      case 0x8f:  // EMPTY_SET
        Push(Scalar(PickleKind::kSet));
        break;
      case ')':
        Push(kEmptyTuple);
        break;
      case 'N':
        Push(kNoneValue);
        break;
      case 0x88:
        Push(kTrueValue);
        break;
      case 0x89:
        Push(kFalseValue);
        break;
      case 'K':
        Push(Scalar(PickleKind::kInt, static_cast<int64_t>(TakeLe(1))));
        break;
      case 'M':
        Push(Scalar(PickleKind::kInt, static_cast<int64_t>(TakeLe(2))));
        break;
      case 'J':
        Push(Scalar(PickleKind::kInt, static_cast<int32_t>(static_cast<uint32_t>(TakeLe(4)))));
        break;
      case 0x8a:
      case 0x8b: {  // LONG1, LONG4
        const uint64_t n = TakeLe(op == 0x8a ? 1 : 4);
        if (n > 8) {
          if (n > data_.size() - pos_) Fail("truncated pickle");
          Push(WideInt(std::string_view(reinterpret_cast<const char*>(Take(n)), n)));
          break;
        }
        uint64_t v = n == 0 ? 0 : TakeLe(n);
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~0ull << (8 * n);  // sign-extend
        Push(Scalar(PickleKind::kInt, static_cast<int64_t>(v)));
        break;
      }
      case 'G': {  // BINFLOAT: big-endian double
        const unsigned char* p = Take(8);
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];
        Push(Scalar(PickleKind::kFloat, static_cast<int64_t>(bits)));
        break;
      }
      case 'X':
      case 0x8c:
      case 0x8d:
      case 'B':
      case 'C':
      case 'T':
      case 'U':
      case 0x8e: {
        const uint64_t n = op == 'X' || op == 'B' || op == 'T' ? TakeLe(4)
                           : op == 0x8d || op == 0x8e          ? TakeLe(8)
                                                               : TakeLe(1);
        if (n > data_.size() - pos_) Fail("truncated pickle");
        const char* p = reinterpret_cast<const char*>(Take(n));
        bool text = op == 'X' || op == 0x8c || op == 0x8d;
        // Python's unpickler decodes these as UTF-8 ("surrogatepass"); torch.load refuses
        // anything else.
        if (text && !IsUtf8(std::string_view(p, n), /*surrogates=*/true)) {
          Fail("string is not valid UTF-8");
        }
        Push(Scalar(text ? PickleKind::kStr : PickleKind::kBytes, 0, std::string(p, n)));
        break;
      }
      case 'q':
        Memoize(TakeLe(1));
        break;
      case 'r':
        Memoize(TakeLe(4));
        break;
      case 0x94:  // MEMOIZE: the next index is the count of keys set (as in pickle.py)
        Memoize(memo_count_);
        break;
      case 'h':
        Get(TakeLe(1));
        break;
      case 'j':
        Get(TakeLe(4));
        break;
      case 't':
        Push(Tuple(PopToMark()));
        break;
      case 0x91: {  // FROZENSET
        PickleValue v;
        v.kind = PickleKind::kSet;
        v.items = PopToMark();
        Push(New(std::move(v)));
        break;
      }
      case 0x85:
      case 0x86:
      case 0x87: {
        size_t n = op - 0x84u;
        std::vector<uint32_t> items(n);
        for (size_t i = n; i > 0; --i) items[i - 1] = Pop();
        Push(Tuple(std::move(items)));
        break;
      }
      case 'a': {  // APPEND
        uint32_t v = Pop();
        Items(PickleKind::kList, "APPEND to something that is not a list").push_back(v);
        break;
      }
      case 'e':
      case 0x90: {  // APPENDS, ADDITEMS
        std::vector<uint32_t> items = PopToMark();
        std::vector<uint32_t>& c =
            op == 'e' ? Items(PickleKind::kList, "APPENDS to something that is not a list")
                      : Items(PickleKind::kSet, "ADDITEMS to something that is not a set");
        c.insert(c.end(), items.begin(), items.end());
        break;
      }
      case 's': {  // SETITEM
        uint32_t v = Pop();
        uint32_t k = Pop();
        auto& d = Items(PickleKind::kDict, "SETITEM on something that is not a dict");
        d.push_back(k);
        d.push_back(v);
        break;
      }
      case 'u': {  // SETITEMS
        std::vector<uint32_t> items = PopToMark();
        if (items.size() % 2 != 0) Fail("SETITEMS with an odd number of items");
        auto& d = Items(PickleKind::kDict, "SETITEMS on something that is not a dict");
        d.insert(d.end(), items.begin(), items.end());
        break;
      }
      case 'c': {  // GLOBAL
        std::string module = TakeLine();
        std::string name = TakeLine();
        CheckGlobal(module, name);
        Push(Scalar(PickleKind::kGlobal, 0, module + "." + name));
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        uint32_t name = Pop();
        uint32_t module = Pop();
        if (values_[name].kind != PickleKind::kStr || values_[module].kind != PickleKind::kStr) {
          Fail("STACK_GLOBAL operands are not strings");
        }
        CheckGlobal(values_[module].s, values_[name].s);
        Push(Scalar(PickleKind::kGlobal, 0, values_[module].s + "." + values_[name].s));
        break;
      }
      case 'Q':  // BINPERSID
        Push(PersistentLoad(Pop()));
        break;
      case 'R':
      case 0x81: {  // REDUCE, NEWOBJ
        uint32_t args = Pop();
        uint32_t callable = Pop();
        Push(Call(callable, args, op == 0x81));
        break;
      }
      case 'b': {  // BUILD
        uint32_t state = Pop();
        Top();  // the target must be there
        Build(stack_.back(), state);
        break;
      }
      default:
        Fail(StrCat("unsupported pickle opcode 0x", std::hex,
                    int{static_cast<unsigned char>(data_[op_pos_])}, OpcodeNote()));
    }
  }
}

}  // namespace tensortier
