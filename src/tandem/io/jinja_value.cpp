#include "tandem/io/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>

#include "tandem/io/jinja_unicode.h"

namespace tandem::jinja {

void raise(std::string type, const std::string& message) {
  throw RenderError(std::move(type), message);
}

// ---------------------------------------------------------------------------------------------
// Construction and access

Value Value::undefined(std::string message, std::string error_type) {
  Value v;
  auto info = std::make_shared<UndefinedInfo>();
  info->message = std::move(message);
  info->error_type = std::move(error_type);
  v.o_ = std::move(info);
  return v;
}

Value Value::undefined_name(std::string_view name) {
  return undefined(repr_string(name) + " is undefined");
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value::Value(std::string s)
    : kind_(Kind::kString), s_(std::make_shared<const std::string>(std::move(s))) {}

Value Value::markup(std::string s) {
  Value v(std::move(s));
  v.markup_ = true;
  return v;
}

Value Value::seq(std::shared_ptr<Sequence> s) {
  uint32_t depth = 0;
  uint64_t weight = 1;
  for (const Value& item : s->items) {
    depth = std::max(depth, item.depth());
    weight += item.weight();
  }
  s->depth = depth + 1;
  s->weight = weight;
  Value v;
  v.kind_ = Kind::kSeq;
  v.o_ = std::move(s);
  return v;
}

Value Value::list(std::vector<Value> items) {
  auto s = std::make_shared<Sequence>();
  s->items = std::move(items);
  return seq(std::move(s));
}

Value Value::tuple(std::vector<Value> items) {
  auto s = std::make_shared<Sequence>();
  s->kind = SeqKind::kTuple;
  s->items = std::move(items);
  return seq(std::move(s));
}

Value Value::dict(std::shared_ptr<Dict> d) {
  Value v;
  v.kind_ = Kind::kDict;
  v.o_ = std::move(d);
  return v;
}

Value Value::ns(std::shared_ptr<Namespace> n) {
  Value v;
  v.kind_ = Kind::kNamespace;
  v.o_ = std::move(n);
  return v;
}

Value Value::object(std::shared_ptr<HostObject> o) {
  Value v;
  v.kind_ = Kind::kObject;
  v.o_ = std::move(o);
  return v;
}

bool Value::is_seq(SeqKind k) const {
  return kind_ == Kind::kSeq && as_seq().kind == k;
}
Sequence& Value::as_seq() const {
  return static_cast<Sequence&>(*o_);
}
Dict& Value::as_dict() const {
  return static_cast<Dict&>(*o_);
}
Namespace& Value::as_namespace() const {
  return static_cast<Namespace&>(*o_);
}
HostObject& Value::as_object() const {
  return static_cast<HostObject&>(*o_);
}

const std::string& Value::undefined_message() const {
  static const std::string kDefault = "'None' is undefined";  // jinja2's Undefined() unnamed
  if (o_) return static_cast<const UndefinedInfo&>(*o_).message;
  return kDefault;
}

const std::string& Value::undefined_error_type() const {
  static const std::string kDefault = "UndefinedError";
  if (o_) return static_cast<const UndefinedInfo&>(*o_).error_type;
  return kDefault;
}

void Value::raise_undefined() const {
  raise(undefined_error_type(), undefined_message());
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return markup_ ? "Markup" : "str";
    case Kind::kSeq:
      switch (as_seq().kind) {
        case SeqKind::kList:
          return "list";
        case SeqKind::kTuple:
          return as_seq().field_names.empty() ? "tuple" : "_GroupTuple";
        case SeqKind::kRange:
          return "range";
        case SeqKind::kGenerator:
          return "generator";
        case SeqKind::kDictKeys:
          return "dict_keys";
        case SeqKind::kDictValues:
          return "dict_values";
        case SeqKind::kDictItems:
          return "dict_items";
      }
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kObject:
      return as_object().type_name();
  }
  return "object";
}

std::string Value::object_type_repr() const {
  switch (kind_) {
    case Kind::kNone:
      return "None";
    case Kind::kUndefined:
      return "jinja2.runtime.Undefined object";
    case Kind::kString:
      return markup_ ? "markupsafe.Markup object" : "str object";
    case Kind::kSeq:
      return type_name() == "_GroupTuple" ? "jinja2.filters._GroupTuple object"
                                          : type_name() + " object";
    case Kind::kNamespace:
      return "jinja2.utils.Namespace object";
    case Kind::kObject: {
      const std::string module = as_object().module_name();
      const std::string name = as_object().type_name();
      return module == "builtins" ? name + " object" : module + "." + name + " object";
    }
    default:
      return type_name() + " object";
  }
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
      return i_ != 0;
    case Kind::kFloat:
      return f_ != 0.0;  // NaN is truthy, as in Python
    case Kind::kString:
      return !s_->empty();
    case Kind::kSeq:
      return as_seq().kind == SeqKind::kGenerator || !as_seq().items.empty();
    case Kind::kDict:
      return as_dict().size() != 0;
    case Kind::kNamespace:
    case Kind::kObject:
      return true;
  }
  return false;
}

uint32_t Value::depth() const {
  if (kind_ == Kind::kSeq) return as_seq().depth;
  if (kind_ == Kind::kDict) return as_dict().depth;
  return 0;
}

uint64_t Value::weight() const {
  switch (kind_) {
    case Kind::kString:
      return 1 + s_->size() / 64;
    case Kind::kSeq:
      return as_seq().weight;
    case Kind::kDict:
      return as_dict().weight;
    default:
      return 1;
  }
}

std::optional<Value> HostObject::attribute(std::string_view) const {
  return std::nullopt;
}

Value HostObject::call(Interpreter&, CallArgs&) {
  raise("TypeError", "'" + type_name() + "' object is not callable");
}

// ---------------------------------------------------------------------------------------------
// Dict

const Value* Dict::find(std::string_view key) const {
  auto it = string_index.find(std::string(key));
  return it == string_index.end() ? nullptr : &entries[it->second].second;
}

namespace {

// The int64 a key equal to an integer stands for (1, 1.0 and True are one key); nullopt for
// other keys.
std::optional<int64_t> integral_key(const Value& k) {
  if (k.is_integral()) return k.as_int();
  if (k.is_float()) {
    const double f = k.as_double();
    if (f == std::floor(f) && f >= -9223372036854775808.0 && f < 9223372036854775808.0)
      return static_cast<int64_t>(f);
  }
  return std::nullopt;
}

}  // namespace

const Value* Dict::find(const Value& key) const {
  if (key.is_string()) return find(std::string_view(key.as_string()));
  if (const auto i = integral_key(key)) {
    auto it = int_index.find(*i);
    return it == int_index.end() ? nullptr : &entries[it->second].second;
  }
  for (size_t idx : other_keys)
    if (py_equal(entries[idx].first, key)) return &entries[idx].second;
  return nullptr;
}

void Dict::set(Value key, Value value) {
  require_hashable(key);
  depth = std::max({depth, key.depth() + 1, value.depth() + 1});
  weight += key.weight() + value.weight();
  size_t* slot = nullptr;
  if (key.is_string()) {
    auto [it, inserted] = string_index.emplace(key.as_string(), entries.size());
    if (!inserted) slot = &it->second;
  } else if (const auto i = integral_key(key)) {
    auto [it, inserted] = int_index.emplace(*i, entries.size());
    if (!inserted) slot = &it->second;
  } else {
    for (size_t& idx : other_keys)
      if (py_equal(entries[idx].first, key)) slot = &idx;
    if (!slot) other_keys.push_back(entries.size());
  }
  if (slot) {
    // An existing key keeps its first position and its first key object, as in Python.
    entries[*slot].second = std::move(value);
    return;
  }
  entries.emplace_back(std::move(key), std::move(value));
}

// ---------------------------------------------------------------------------------------------
// str() and repr()

namespace {

// Appends with a bound: exceeding it is an error, never an unbounded allocation.
class Writer {
 public:
  explicit Writer(size_t limit) : limit_(limit) {}
  void put(std::string_view s) {
    if (out_.size() + s.size() > limit_)
      raise("LimitError", "a string would exceed " + std::to_string(limit_) + " bytes");
    out_.append(s);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
  size_t limit_;
};

constexpr char kHex[] = "0123456789abcdef";

void repr_into(const Value& v, Writer& w, std::vector<const Namespace*>& active);

void repr_items(const std::vector<Value>& items, Writer& w, std::vector<const Namespace*>& active) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) w.put(", ");
    repr_into(items[i], w, active);
  }
}

void repr_dict(const Dict& d, Writer& w, std::vector<const Namespace*>& active) {
  w.put("{");
  for (size_t i = 0; i < d.entries.size(); ++i) {
    if (i) w.put(", ");
    repr_into(d.entries[i].first, w, active);
    w.put(": ");
    repr_into(d.entries[i].second, w, active);
  }
  w.put("}");
}

void repr_into(const Value& v, Writer& w, std::vector<const Namespace*>& active) {
  switch (v.kind()) {
    case Kind::kUndefined:
      w.put("Undefined");
      return;
    case Kind::kString:
      if (v.is_markup()) {
        w.put("Markup(");
        w.put(repr_string(v.as_string()));
        w.put(")");
      } else {
        w.put(repr_string(v.as_string()));
      }
      return;
    case Kind::kSeq: {
      const Sequence& s = v.as_seq();
      switch (s.kind) {
        case SeqKind::kList:
          w.put("[");
          repr_items(s.items, w, active);
          w.put("]");
          return;
        case SeqKind::kTuple:
          // (|groupby's _GroupTuple prints as a plain tuple: jinja2 overrides its repr.)
          w.put("(");
          repr_items(s.items, w, active);
          w.put(s.items.size() == 1 ? ",)" : ")");
          return;
        case SeqKind::kRange:
          w.put("range(" + std::to_string(s.range_start) + ", " + std::to_string(s.range_stop));
          if (s.range_step != 1) w.put(", " + std::to_string(s.range_step));
          w.put(")");
          return;
        case SeqKind::kGenerator:
          // Python adds the object's address, which no fixture can depend on.
          w.put("<generator object>");
          return;
        case SeqKind::kDictKeys:
        case SeqKind::kDictValues:
        case SeqKind::kDictItems:
          w.put(v.type_name());
          w.put("([");
          repr_items(s.items, w, active);
          w.put("])");
          return;
      }
      return;
    }
    case Kind::kDict:
      repr_dict(v.as_dict(), w, active);
      return;
    case Kind::kNamespace: {
      const Namespace* n = &v.as_namespace();
      // A namespace can hold itself; Python's dict repr prints the inner occurrence as {...}.
      if (std::find(active.begin(), active.end(), n) != active.end()) {
        w.put("<Namespace {...}>");
        return;
      }
      active.push_back(n);
      w.put("<Namespace ");
      repr_dict(n->attrs, w, active);
      w.put(">");
      active.pop_back();
      return;
    }
    case Kind::kObject:
      w.put(v.as_object().repr());
      return;
    default:
      w.put(py_str(v, ValueLimits{}));
      return;
  }
}

}  // namespace

std::string repr_float(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f < 0 ? "-inf" : "inf";
  // Shortest round-trip digits, then laid out as Python's float_repr_style 'short' does:
  // positional when -4 <= exponent < 16, scientific (at least two exponent digits) otherwise.
  char buf[64];  // the longest shortest form of a double is 24 characters: never too small
  const char* end = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific).ptr;
  std::string_view sci(buf, static_cast<size_t>(end - buf));
  std::string out;
  size_t pos = 0;
  if (sci[0] == '-') {
    out.push_back('-');
    pos = 1;
  }
  const size_t epos = sci.find('e');
  std::string digits;
  for (size_t i = pos; i < epos; ++i)
    if (sci[i] != '.') digits.push_back(sci[i]);
  int exponent = 0;
  std::from_chars(sci.data() + epos + 1 + (sci[epos + 1] == '+'), sci.data() + sci.size(),
                  exponent);
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      out += "0.";
      out.append(static_cast<size_t>(-exponent - 1), '0');
      out += digits;
    } else {
      const size_t int_digits = static_cast<size_t>(exponent) + 1;
      if (digits.size() <= int_digits) {
        out += digits;
        out.append(int_digits - digits.size(), '0');
        out += ".0";
      } else {
        out += digits.substr(0, int_digits);
        out += '.';
        out += digits.substr(int_digits);
      }
    }
  } else {
    out += digits[0];
    if (digits.size() > 1) {
      out += '.';
      out += digits.substr(1);
    }
    out += 'e';
    out += exponent < 0 ? '-' : '+';
    const int a = std::abs(exponent);
    if (a < 10) out += '0';
    out += std::to_string(a);
  }
  return out;
}

std::string repr_string(std::string_view s) {
  // CPython's unicode_repr: single quotes unless the text has ' and no ".
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back(quote);
  auto hex = [&](uint32_t c, int digits) {
    for (int i = digits - 1; i >= 0; --i) out.push_back(kHex[(c >> (4 * i)) & 0xF]);
  };
  for (char32_t c : unicode::decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      out += "\\x";
      hex(c, 2);
    } else if (c < 0x7F) {
      out.push_back(static_cast<char>(c));
    } else if (unicode::is_printable(c)) {
      unicode::append(c, out);
    } else if (c <= 0xFF) {
      out += "\\x";
      hex(c, 2);
    } else if (c <= 0xFFFF) {
      out += "\\u";
      hex(c, 4);
    } else {
      out += "\\U";
      hex(c, 8);
    }
  }
  out.push_back(quote);
  return out;
}

std::string py_str(const Value& v, const ValueLimits& limits) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return v.as_bool() ? "True" : "False";
    case Kind::kInt:
      return std::to_string(v.as_int());
    case Kind::kFloat:
      return repr_float(v.as_double());
    case Kind::kString:
      return v.as_string();
    default:
      return py_repr(v, limits);
  }
}

std::string py_repr(const Value& v, const ValueLimits& limits) {
  switch (v.kind()) {
    case Kind::kNone:
    case Kind::kBool:
    case Kind::kInt:
    case Kind::kFloat:
      return py_str(v, limits);
    default: {
      Writer w(limits.max_string_bytes);
      std::vector<const Namespace*> active;
      repr_into(v, w, active);
      return w.take();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Comparisons

namespace {

// Exact comparison of an integer with a double (Python compares int and float exactly):
// -1, 0, 1, or 2 when f is NaN (unordered).
int compare_int_float(int64_t i, double f) {
  if (std::isnan(f)) return 2;
  if (f >= 9223372036854775808.0) return -1;
  if (f < -9223372036854775808.0) return 1;
  const double fl = std::floor(f);
  const auto fi = static_cast<int64_t>(fl);
  if (i < fi) return -1;
  if (i > fi) return 1;
  return f > fl ? -1 : 0;
}

// -1, 0, 1, or 2 for unordered (NaN).
int compare_numbers(const Value& a, const Value& b) {
  if (a.is_integral() && b.is_integral()) {
    const int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_integral()) return compare_int_float(a.as_int(), b.as_double());
  if (b.is_integral()) {
    const int r = compare_int_float(b.as_int(), a.as_double());
    return r == 2 ? 2 : -r;
  }
  const double x = a.as_double(), y = b.as_double();
  if (std::isnan(x) || std::isnan(y)) return 2;
  return x < y ? -1 : (x > y ? 1 : 0);
}

bool same_object(const Value& a, const Value& b) {
  return a.object_ptr() == b.object_ptr();
}

// Set equality of two dict views (keys or items), which compare like sets in Python.
bool view_set_equal(const Sequence& a, const Sequence& b) {
  if (a.items.size() != b.items.size()) return false;
  for (const Value& x : a.items) {
    bool found = false;
    for (const Value& y : b.items) {
      if (py_equal(x, y)) {
        found = true;
        break;
      }
    }
    if (!found) return false;
  }
  return true;
}

}  // namespace

bool py_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return compare_numbers(a, b) == 0;
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return a.as_string() == b.as_string();
    case Kind::kSeq: {
      const Sequence& x = a.as_seq();
      const Sequence& y = b.as_seq();
      if (same_object(a, b)) return true;
      if (x.kind != y.kind) return false;
      switch (x.kind) {
        case SeqKind::kGenerator:
        case SeqKind::kDictValues:
          return false;  // compared by identity in Python
        case SeqKind::kDictKeys:
        case SeqKind::kDictItems:
          return view_set_equal(x, y);
        default:
          break;
      }
      if (x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i)
        if (!py_equal(x.items[i], y.items[i])) return false;
      return true;
    }
    case Kind::kDict: {
      const Dict& x = a.as_dict();
      const Dict& y = b.as_dict();
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* other = y.find(k);
        if (!other || !py_equal(v, *other)) return false;
      }
      return true;
    }
    default:
      return same_object(a, b);
  }
}

bool py_compare(Order op, const Value& a, const Value& b) {
  static constexpr const char* kOps[] = {"<", "<=", ">", ">="};
  if (a.is_undefined()) a.raise_undefined();
  if (b.is_undefined()) b.raise_undefined();
  int c = 0;
  if (a.is_number() && b.is_number()) {
    c = compare_numbers(a, b);
    if (c == 2) return false;
  } else if (a.is_string() && b.is_string()) {
    // UTF-8 byte order is code point order.
    const int r = a.as_string().compare(b.as_string());
    c = r < 0 ? -1 : (r > 0 ? 1 : 0);
  } else if (a.is_seq() && b.is_seq() && a.as_seq().kind == b.as_seq().kind &&
             (a.as_seq().kind == SeqKind::kList || a.as_seq().kind == SeqKind::kTuple)) {
    // Lexicographic: the first unequal pair decides, else the lengths.
    const auto& x = a.as_seq().items;
    const auto& y = b.as_seq().items;
    const size_t n = std::min(x.size(), y.size());
    for (size_t i = 0; i < n; ++i)
      if (!py_equal(x[i], y[i])) return py_compare(op, x[i], y[i]);
    c = x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  } else {
    raise("TypeError", std::string("'") + kOps[static_cast<int>(op)] +
                           "' not supported between instances of '" + a.type_name() + "' and '" +
                           b.type_name() + "'");
  }
  switch (op) {
    case Order::kLt:
      return c < 0;
    case Order::kLe:
      return c <= 0;
    case Order::kGt:
      return c > 0;
    case Order::kGe:
      return c >= 0;
  }
  return false;
}

bool py_hashable(const Value& v) {
  switch (v.kind()) {
    case Kind::kDict:
      return false;
    case Kind::kSeq:
      switch (v.as_seq().kind) {
        case SeqKind::kList:
        case SeqKind::kDictKeys:
        case SeqKind::kDictItems:
          return false;
        case SeqKind::kTuple:
          return std::all_of(v.as_seq().items.begin(), v.as_seq().items.end(), py_hashable);
        default:
          return true;
      }
    default:
      return true;
  }
}

void require_hashable(const Value& v) {
  if (py_hashable(v)) return;
  if (v.is_seq(SeqKind::kTuple))
    for (const Value& item : v.as_seq().items) require_hashable(item);
  raise("TypeError", "unhashable type: '" + v.type_name() + "'");
}

// ---------------------------------------------------------------------------------------------
// json.dumps

namespace {

void json_string(std::string_view s, bool ensure_ascii, Writer& w) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  auto u4 = [&](uint32_t c) {
    out += "\\u";
    for (int i = 3; i >= 0; --i) out.push_back(kHex[(c >> (4 * i)) & 0xF]);
  };
  for (char32_t c : unicode::decode(s)) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          u4(c);
        } else if (c < 0x80 || !ensure_ascii) {
          unicode::append(c, out);
        } else if (c <= 0xFFFF) {
          u4(c);
        } else {
          const uint32_t v = c - 0x10000;
          u4(0xD800 + (v >> 10));
          u4(0xDC00 + (v & 0x3FF));
        }
    }
  }
  out.push_back('"');
  w.put(out);
}

std::string json_float(double f) {
  if (std::isnan(f)) return "NaN";
  if (std::isinf(f)) return f < 0 ? "-Infinity" : "Infinity";
  return repr_float(f);
}

struct JsonEncoder {
  const JsonOptions& options;
  Writer& w;
  std::string item_sep, key_sep;

  void newline(size_t level) {
    w.put("\n");
    for (size_t i = 0; i < level; ++i) w.put(*options.indent);
  }

  std::string key_string(const Value& k) {
    switch (k.kind()) {
      case Kind::kString:
        return k.as_string();
      case Kind::kBool:
        return k.as_bool() ? "true" : "false";
      case Kind::kInt:
        return std::to_string(k.as_int());
      case Kind::kFloat:
        return json_float(k.as_double());
      case Kind::kNone:
        return "null";
      default:
        raise("TypeError", "keys must be str, int, float, bool or None, not " + k.type_name());
    }
  }

  void encode(const Value& v, size_t level) {
    switch (v.kind()) {
      case Kind::kNone:
        w.put("null");
        return;
      case Kind::kBool:
        w.put(v.as_bool() ? "true" : "false");
        return;
      case Kind::kInt:
        w.put(std::to_string(v.as_int()));
        return;
      case Kind::kFloat:
        w.put(json_float(v.as_double()));
        return;
      case Kind::kString:
        json_string(v.as_string(), options.ensure_ascii, w);
        return;
      case Kind::kSeq:
        if (v.as_seq().kind == SeqKind::kList || v.as_seq().kind == SeqKind::kTuple) {
          const auto& items = v.as_seq().items;
          if (items.empty()) {
            w.put("[]");
            return;
          }
          w.put("[");
          if (options.indent) newline(level + 1);
          for (size_t i = 0; i < items.size(); ++i) {
            if (i) {
              w.put(item_sep);
              if (options.indent) newline(level + 1);
            }
            encode(items[i], level + 1);
          }
          if (options.indent) newline(level);
          w.put("]");
          return;
        }
        break;
      case Kind::kDict: {
        const Dict& d = v.as_dict();
        if (d.entries.empty()) {
          w.put("{}");
          return;
        }
        std::vector<const std::pair<Value, Value>*> entries;
        for (const auto& e : d.entries) entries.push_back(&e);
        if (options.sort_keys) {
          // sorted(d.items()): keys are distinct, so the keys alone decide (mixed key types
          // raise TypeError, as in Python).
          merge_sort(entries, [](const auto* x, const auto* y) {
            return py_compare(Order::kLt, x->first, y->first);
          });
        }
        w.put("{");
        if (options.indent) newline(level + 1);
        for (size_t i = 0; i < entries.size(); ++i) {
          if (i) {
            w.put(item_sep);
            if (options.indent) newline(level + 1);
          }
          json_string(key_string(entries[i]->first), options.ensure_ascii, w);
          w.put(key_sep);
          encode(entries[i]->second, level + 1);
        }
        if (options.indent) newline(level);
        w.put("}");
        return;
      }
      default:
        break;
    }
    raise("TypeError", "Object of type " + v.type_name() + " is not JSON serializable");
  }
};

}  // namespace

std::string py_json_dumps(const Value& v, const JsonOptions& options, const ValueLimits& limits) {
  Writer w(limits.max_string_bytes);
  JsonEncoder enc{options, w, ", ", ": "};
  if (options.indent) enc.item_sep = ",";
  if (options.separators) {
    enc.item_sep = options.separators->first;
    enc.key_sep = options.separators->second;
  }
  enc.encode(v, 0);
  return w.take();
}

// ---------------------------------------------------------------------------------------------
// From JSON

namespace {

Value from_json_at(const nlohmann::ordered_json& j, const ValueLimits& limits, uint32_t depth) {
  using json = nlohmann::ordered_json;
  switch (j.type()) {
    case json::value_t::null:
      return Value::none();
    case json::value_t::boolean:
      return Value(j.get<bool>());
    case json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return Value(static_cast<int64_t>(u));
      return Value(static_cast<double>(u));
    }
    case json::value_t::number_float:
      return Value(j.get<double>());
    case json::value_t::string:
      return Value(j.get_ref<const std::string&>());
    case json::value_t::array:
    case json::value_t::object:
      break;
    default:
      raise("TypeError", "binary JSON values are not supported");
  }
  if (depth >= limits.max_depth)
    raise("LimitError", "input nested deeper than " + std::to_string(limits.max_depth) + " levels");
  if (j.is_array()) {
    std::vector<Value> items;
    items.reserve(j.size());
    for (const auto& e : j) items.push_back(from_json_at(e, limits, depth + 1));
    return Value::list(std::move(items));
  }
  auto d = std::make_shared<Dict>();
  for (const auto& [k, e] : j.items()) d->set(Value(k), from_json_at(e, limits, depth + 1));
  return Value::dict(std::move(d));
}

}  // namespace

Value from_json(const nlohmann::ordered_json& j, const ValueLimits& limits) {
  return from_json_at(j, limits, 0);
}

}  // namespace tandem::jinja
