// A writer of pickle opcodes (protocols 2 and 3), for the pickles tensortier writes without Python:
// torch.save's data.pkl (torch_pickle_writer.cpp) and DCP's .metadata (dcp_metadata_writer.cpp).
// Every new object is memoized under the next index, as Python's pickler does; objects that are
// one Python object however often they appear (a class, a shared string) are memoized once and
// fetched after.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tensortier {

inline constexpr size_t kBatch = 1000;  // pickle's _BATCHSIZE for SETITEMS and APPENDS

class Emitter {
 public:
  // `protocol` 2: opcodes as torch.save's pickler writes them (BINPUT, BINUNICODE, GLOBAL);
  // 4: as pickle.dumps' default (MEMOIZE, SHORT_BINUNICODE, STACK_GLOBAL; no frames), smaller.
  explicit Emitter(int protocol = 2) : short_(protocol >= 4) {}

  std::string Take() { return std::move(out_); }

  void Op(char op) { out_ += op; }
  void Le(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xFF);
  }

  // A new object: memoized under the next index (BINPUT, LONG_BINPUT past 255).
  uint32_t Put() {
    uint32_t index = next_++;
    if (short_) {
      Op('\x94');  // MEMOIZE: the next index
    } else if (index < 256) {
      Op('q');
      Le(index, 1);
    } else {
      Op('r');
      Le(index, 4);
    }
    return index;
  }
  void Get(uint32_t index) {
    if (index < 256) {
      Op('h');
      Le(index, 1);
    } else {
      Op('j');
      Le(index, 4);
    }
  }

  // save_str: BINUNICODE, memoized.
  uint32_t Str(std::string_view s) {
    if (short_ && s.size() < 256) {
      Op('\x8c');  // SHORT_BINUNICODE
      Le(s.size(), 1);
    } else {
      Op('X');
      Le(s.size(), 4);
    }
    out_ += s;
    return Put();
  }
  // A string that is one Python object however often it is pickled ('storage', 'cpu', a key).
  void SharedStr(std::string_view s) {
    // Keys built by concatenation, not StrCat: this runs several times per tensor.
    Shared(std::string("str:").append(s), [&] { Str(s); });
  }
  // save_bytes (protocol 3): BINBYTES, memoized.
  void Bytes(std::string_view b) {
    if (short_ && b.size() < 256) {
      Op('C');  // SHORT_BINBYTES
      Le(b.size(), 1);
    } else {
      Op('B');
      Le(b.size(), 4);
    }
    out_ += b;
    Put();
  }

  // save_global: GLOBAL 'module\nname\n', memoized; later occurrences fetch it.
  void Global(std::string_view module, std::string_view name) {
    Shared(std::string("global:").append(module).append(".").append(name), [&] {
      if (short_) {  // STACK_GLOBAL of the two strings (the module's shared, as Python's)
        SharedStr(module);
        Str(name);
        Op('\x93');
        Put();
        return;
      }
      Op('c');
      out_ += module;
      out_ += '\n';
      out_ += name;
      out_ += '\n';
      Put();
    });
  }

  // save_long for non-negative values: BININT1, BININT2, BININT, else LONG1.
  void Int(uint64_t v) {
    if (v <= 0xFF) {
      Op('K');
      Le(v, 1);
    } else if (v <= 0xFFFF) {
      Op('M');
      Le(v, 2);
    } else if (v <= 0x7FFFFFFF) {
      Op('J');
      Le(v, 4);
    } else {
      // encode_long: little-endian two's complement of (bit_length // 8 + 1) bytes; a value
      // with bit 63 set takes a ninth byte, 0 (it is positive).
      int bits = 64 - __builtin_clzll(v);
      int n = bits / 8 + 1;
      Op('\x8a');
      Le(static_cast<uint64_t>(n), 1);
      Le(v, n > 8 ? 8 : n);
      if (n > 8) Le(0, 1);
    }
  }
  // An int that may be negative: BININT for 32-bit values, else LONG1.
  void SignedInt(int64_t v) {
    if (v >= 0) return Int(static_cast<uint64_t>(v));
    if (v >= INT32_MIN) {
      Op('J');
      Le(static_cast<uint64_t>(v), 4);
      return;
    }
    Op('\x8a');
    Le(8, 1);
    Le(static_cast<uint64_t>(v), 8);
  }
  void Bool(bool v) { Op(v ? '\x88' : '\x89'); }  // NEWTRUE, NEWFALSE
  void None() { Op('N'); }

  // save_tuple of ints: EMPTY_TUPLE (not memoized), TUPLE1-3, else MARK ... TUPLE; memoized.
  template <typename T>
  void IntTuple(const std::vector<T>& v) {
    if (v.empty()) {
      Op(')');
      return;
    }
    if (v.size() > 3) Op('(');
    for (T x : v) SignedInt(static_cast<int64_t>(x));
    TupleEnd(v.size());
  }
  // Closes a tuple of `n` > 0 items pushed after a MARK when n > 3: TUPLE1-3 or TUPLE; memoized.
  void TupleEnd(size_t n) {
    Op(n == 1 ? '\x85' : n == 2 ? '\x86' : n == 3 ? '\x87' : 't');
    Put();
  }

  // An instance of the class just pushed, made by cls.__new__ (EMPTY_TUPLE NEWOBJ), memoized;
  // its state follows, then Op('b') (BUILD).
  void NewObj() {
    Op(')');
    Op('\x81');
    Put();
  }

  // The items of a dict or list just pushed (EMPTY_DICT or EMPTY_LIST, memoized), as the C
  // pickler batches them: one item alone is a SETITEM/APPEND; more go in batches of kBatch, each
  // MARK ... SETITEMS/APPENDS, and a full batch is always followed by another (empty after the
  // last). `item(i)` pushes item i (a key and its value for a dict).
  template <typename F>
  void Items(size_t n, bool dict, F&& item) {
    if (n == 1) {
      item(0);
      Op(dict ? 's' : 'a');
      return;
    }
    if (n == 0) return;
    size_t next = 0;
    size_t count = 0;
    do {
      Op('(');
      for (count = 0; count < kBatch && next < n; ++count) item(next++);
      Op(dict ? 'u' : 'e');
    } while (count == kBatch);
  }
  template <typename F>
  void Dict(size_t n, F&& item) {
    Op('}');
    Put();
    Items(n, true, std::forward<F>(item));
  }
  template <typename F>
  void List(size_t n, F&& item) {
    Op(']');
    Put();
    Items(n, false, std::forward<F>(item));
  }

 private:
  template <typename F>
  void Shared(const std::string& identity, F&& first) {
    auto it = shared_.find(identity);
    if (it != shared_.end()) {
      Get(it->second);
      return;
    }
    first();
    shared_.emplace(identity, next_ - 1);  // the object first() memoized last
  }

  bool short_;
  std::string out_;
  uint32_t next_ = 0;
  std::map<std::string, uint32_t> shared_;
};

}  // namespace tensortier
