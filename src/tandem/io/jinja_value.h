// The Jinja interpreter's dynamic value: a Python object as jinja2 sees it. Chat templates run
// under Python, so everything observable must follow Python: str() of a float is its shortest
// round-trip repr ("1.0", "1e-05"), True prints as "True", a list prints as "['a', 1]", dicts
// keep insertion order, 1 == 1.0 == True, strings are sequences of code points.
//
// Kinds:
//   Undefined   jinja2's default Undefined: prints empty, is falsy, iterates as empty, and raises
//               (with the message it carries) on attribute access, calls and arithmetic.
//   None, Bool, Int (64-bit; overflow is an error rather than a bigint), Float, String (UTF-8,
//               immutable and shared; `markup` marks markupsafe.Markup from |safe or |escape).
//   Sequence    list, tuple, range, a one-shot iterator ("generator", what filters such as |map
//               return), and the dict views keys()/values()/items(); see SeqKind.
//   Dict        insertion-ordered; keys are hashable values (str, int, float, bool, None, tuple).
//   Namespace   jinja2's namespace(): the only mutable object a sandboxed template can change.
//   Object      anything else the interpreter provides: macros, builtin functions, bound methods,
//               the loop object (HostObject subclasses, defined by the interpreter).
//
// Lists, tuples and dicts are immutable once built (the sandbox forbids list.append and
// dict.update), so a container's nesting depth is fixed when it is made; the interpreter bounds
// it, which bounds every recursion over values (repr, tojson, equality, destruction).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tandem::jinja {

// A Python exception raised while rendering: `type` is the Python class name (TypeError,
// UndefinedError, TemplateError for raise_exception, ...) and what() its message, as str(e) in
// Python. The template layer adds the template name and position.
class RenderError : public std::runtime_error {
 public:
  RenderError(std::string type, const std::string& message)
      : std::runtime_error(message), type_(std::move(type)) {}
  const std::string& type() const { return type_; }

 private:
  std::string type_;
};

// Throws RenderError(type, message).
[[noreturn]] void raise(std::string type, const std::string& message);

enum class Kind : uint8_t {
  kUndefined,
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kSeq,
  kDict,
  kNamespace,
  kObject
};

// Python sequence flavours: they iterate alike but differ in repr, truthiness, len and indexing.
enum class SeqKind : uint8_t {
  kList,
  kTuple,
  kRange,
  kGenerator,  // a one-shot iterator: always truthy, no len(), iterating it consumes it
  kDictKeys,
  kDictValues,
  kDictItems,
};

class Value;
struct Object;
struct Sequence;
struct Dict;
struct Namespace;
struct HostObject;

// Limits shared by every routine that builds strings or containers from values.
struct ValueLimits {
  size_t max_string_bytes = 16u << 20;
  uint32_t max_depth = 128;  // nesting of lists/tuples/dicts
};

class Value {
 public:
  // Undefined, with the error an operation on it raises (UndefinedError, or SecurityError for
  // the sandbox's unsafe attributes).
  Value() = default;
  static Value undefined(std::string message, std::string error_type = "UndefinedError");
  // jinja2's Undefined(name=...): "'name' is undefined".
  static Value undefined_name(std::string_view name);
  static Value none();
  Value(bool b) : kind_(Kind::kBool), b_(b) {}  // NOLINT: implicit like Python literals
  Value(int v) : Value(static_cast<int64_t>(v)) {}
  Value(int64_t i) : kind_(Kind::kInt), i_(i) {}
  Value(double f) : kind_(Kind::kFloat), f_(f) {}
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  Value(std::string_view s) : Value(std::string(s)) {}
  static Value markup(std::string s);
  static Value seq(std::shared_ptr<Sequence> s);
  static Value list(std::vector<Value> items);
  static Value tuple(std::vector<Value> items);
  static Value dict(std::shared_ptr<Dict> d);
  static Value ns(std::shared_ptr<Namespace> n);
  static Value object(std::shared_ptr<HostObject> o);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  // int or bool (bool is a subclass of int in Python)
  bool is_integral() const { return kind_ == Kind::kInt || kind_ == Kind::kBool; }
  bool is_number() const { return is_integral() || kind_ == Kind::kFloat; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_markup() const { return kind_ == Kind::kString && markup_; }
  bool is_seq() const { return kind_ == Kind::kSeq; }
  bool is_seq(SeqKind k) const;
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_object() const { return kind_ == Kind::kObject; }

  bool as_bool() const { return b_; }
  // int or bool as an integer
  int64_t as_int() const { return kind_ == Kind::kBool ? (b_ ? 1 : 0) : i_; }
  // any number as a double
  double as_double() const { return kind_ == Kind::kFloat ? f_ : static_cast<double>(as_int()); }
  const std::string& as_string() const { return *s_; }
  Sequence& as_seq() const;
  Dict& as_dict() const;
  Namespace& as_namespace() const;
  HostObject& as_object() const;
  const std::shared_ptr<Object>& object_ptr() const { return o_; }
  // The error an operation on this Undefined raises.
  const std::string& undefined_message() const;
  const std::string& undefined_error_type() const;
  // Raises that error.
  [[noreturn]] void raise_undefined() const;

  // Python type(x).__name__.
  std::string type_name() const;
  // jinja2's object_type_repr(x), used in "'dict object' has no attribute 'x'".
  std::string object_type_repr() const;

  // Python bool(x).
  bool truthy() const;
  // Nesting depth: 0 for scalars, 1 + the deepest element for lists/tuples/dicts.
  uint32_t depth() const;
  // An upper bound of the work a comparison or a walk over the value costs: 1 for scalars, one
  // more per 64 bytes of a string, the sum over the elements for containers. The interpreter
  // charges it to its step budget.
  uint64_t weight() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool markup_ = false;
  union {
    bool b_;
    int64_t i_ = 0;
    double f_;
  };
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<Object> o_;
};

struct Object {
  virtual ~Object() = default;
};

struct UndefinedInfo final : Object {
  std::string message;
  std::string error_type;
};

struct Sequence final : Object {
  SeqKind kind = SeqKind::kList;
  std::vector<Value> items;
  uint32_t depth = 1;
  uint64_t weight = 1;
  // kRange: its arguments, for repr ("range(0, 3)").
  int64_t range_start = 0, range_stop = 0, range_step = 1;
  // kGenerator: set once it has been iterated (a Python iterator then yields nothing more).
  bool consumed = false;
  // Attribute names of a named tuple (|groupby yields (grouper, list) pairs); empty otherwise.
  std::vector<std::string> field_names;
};

// An insertion-ordered dict. String keys and integral keys (int, bool, integral float: 1, 1.0 and
// True are one key, as in Python) are indexed; the other keys (None, fractional floats, tuples:
// rare) are found by a scan with Python equality.
struct Dict final : Object {
  std::vector<std::pair<Value, Value>> entries;
  std::unordered_map<std::string, size_t> string_index;
  std::unordered_map<int64_t, size_t> int_index;
  std::vector<size_t> other_keys;
  uint32_t depth = 1;
  uint64_t weight = 1;

  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  // Inserts or replaces (keeping the first position, as Python does). Throws TypeError for an
  // unhashable key.
  void set(Value key, Value value);
  size_t size() const { return entries.size(); }
};

struct Namespace final : Object {
  Dict attrs;  // string keys only
};

class Interpreter;
struct CallArgs {
  std::vector<Value> args;
  std::vector<std::pair<std::string, Value>> kwargs;
};

// Objects the interpreter provides (macros, functions, bound methods, the loop object).
struct HostObject : Object {
  // Python type(x).__name__ and __module__ (for object_type_repr).
  virtual std::string type_name() const = 0;
  virtual std::string module_name() const { return "builtins"; }
  virtual std::string repr() const = 0;
  // getattr(x, name); std::nullopt when there is no such attribute (AttributeError).
  virtual std::optional<Value> attribute(std::string_view name) const;
  virtual bool callable() const { return false; }
  virtual Value call(Interpreter& interp, CallArgs& args);
};

// Python str(x) and repr(x). Throw RenderError when the result would exceed limits.
std::string py_str(const Value& v, const ValueLimits& limits);
std::string py_repr(const Value& v, const ValueLimits& limits);
// repr of a str; of a float (shortest round trip: 1.0, 0.1, 1e-05, 1e+16, inf, nan).
std::string repr_string(std::string_view s);
std::string repr_float(double f);

// A stable merge sort (what Python's sorted() gives for a consistent comparison). Unlike
// std::sort/std::stable_sort it stays memory-safe when `less` is not a strict weak order (NaN
// keys, comparisons that change their mind), which untrusted templates can arrange. `less` may
// throw; the vector is then left in some permutation of its elements.
template <class T, class Less>
void merge_sort(std::vector<T>& v, Less less) {
  if (v.size() < 2) return;
  std::vector<T> tmp(v.size());
  for (size_t width = 1; width < v.size(); width *= 2) {
    for (size_t lo = 0; lo < v.size(); lo += 2 * width) {
      const size_t mid = std::min(lo + width, v.size());
      const size_t hi = std::min(lo + 2 * width, v.size());
      size_t i = lo, j = mid, k = lo;
      while (i < mid && j < hi) tmp[k++] = less(v[j], v[i]) ? v[j++] : v[i++];
      while (i < mid) tmp[k++] = v[i++];
      while (j < hi) tmp[k++] = v[j++];
    }
    v.swap(tmp);
  }
}

// Python ==; never throws.
bool py_equal(const Value& a, const Value& b);
// Python a < b, a <= b, a > b, a >= b: numbers, strings (code point order), lists and tuples
// (lexicographic); TypeError "'<' not supported between instances of ..." otherwise, and the
// Undefined's own error when either side is Undefined.
enum class Order : uint8_t { kLt, kLe, kGt, kGe };
bool py_compare(Order op, const Value& a, const Value& b);
// Whether v can be a dict key / set member (TypeError "unhashable type" otherwise).
bool py_hashable(const Value& v);
// Throws Python's TypeError "unhashable type: 'dict'" (naming the innermost culprit, as hashing
// a tuple does) unless v is hashable.
void require_hashable(const Value& v);

// Python's json.dumps(v, ensure_ascii, indent, separators, sort_keys), which transformers
// installs as the |tojson filter. `indent`: nullopt for None, else the string one level of
// indentation adds (json.dumps(indent=2) is "  "); separators default to (", ", ": ") without
// indent and (",", ": ") with it.
struct JsonOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;
  std::optional<std::pair<std::string, std::string>> separators;
  bool sort_keys = false;
};
std::string py_json_dumps(const Value& v, const JsonOptions& options, const ValueLimits& limits);

// A JSON document (as the server parses it, key order kept) as Python's json.loads gives it:
// objects become dicts, arrays lists, integers int (unsigned ones beyond int64 become float),
// reals float. Throws RenderError when nested deeper than limits.max_depth.
Value from_json(const nlohmann::ordered_json& j, const ValueLimits& limits);

}  // namespace tandem::jinja
