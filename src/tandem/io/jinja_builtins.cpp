// jinja2's builtin filters (jinja2/filters.py), tests (jinja2/tests.py) and globals, plus what
// transformers adds: the |tojson filter (json.dumps with ensure_ascii=False by default),
// raise_exception() and strftime_now(). Each follows the Python source it is named after,
// including what it returns (a list, a string, or a one-shot generator) and its error messages.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "tandem/io/jinja_interpreter.h"
#include "tandem/io/jinja_unicode.h"

namespace tandem::jinja {

// ---------------------------------------------------------------------------------------------
// Shared helpers

ArgBinder::ArgBinder(std::string_view function, CallArgs& args,
                     std::initializer_list<std::string_view> names, size_t required)
    : values_(names.size()) {
  const std::vector<std::string_view> params(names);
  if (args.args.size() > params.size())
    raise("TypeError", std::string(function) + "() takes at most " + std::to_string(params.size()) +
                           " argument(s) (" + std::to_string(args.args.size()) + " given)");
  for (size_t i = 0; i < args.args.size(); ++i) values_[i] = args.args[i];
  for (auto& [k, v] : args.kwargs) {
    const auto it = std::find(params.begin(), params.end(), k);
    if (it == params.end())
      raise("TypeError",
            std::string(function) + "() got an unexpected keyword argument " + repr_string(k));
    const size_t i = static_cast<size_t>(it - params.begin());
    if (values_[i])
      raise("TypeError",
            std::string(function) + "() got multiple values for argument " + repr_string(k));
    values_[i] = v;
  }
  for (size_t i = 0; i < required; ++i)
    if (!values_[i])
      raise("TypeError",
            std::string(function) + "() missing required argument " + repr_string(params[i]));
}

std::string html_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

Value unsafe_undefined(const Value& obj, std::string_view name) {
  return Value::undefined("access to attribute " + repr_string(name) + " of " +
                              repr_string(obj.type_name()) + " object is unsafe.",
                          "SecurityError");
}

namespace {

constexpr int64_t kMaxRangeItems = 100000;  // jinja2.sandbox.MAX_RANGE

using FilterTable = std::vector<std::pair<std::string_view, FilterFn>>;
using TestTable = std::vector<std::pair<std::string_view, TestFn>>;

// jinja2's soft_str: strings (Markup included) as they are, anything else through str(). The
// string filters that call it walk the text once, which is charged here.
Value soft_str(Interpreter& in, const Value& v) {
  if (v.is_string()) {
    in.charge_bytes(v.as_string().size());
    return v;
  }
  return in.make_string(in.str(v));
}

int64_t need_int(const Value& v, const char* what) {
  if (!v.is_integral())
    raise("TypeError", "'" + v.type_name() + "' object cannot be interpreted as an integer" +
                           (what[0] ? std::string(" (") + what + ")" : std::string()));
  return v.as_int();
}

std::optional<double> parse_py_float(std::string_view text);

// Python float(x): numbers, and strings in Python's float syntax; ValueError / TypeError with
// Python's messages otherwise, and the Undefined's own error for an Undefined.
double py_float(Interpreter& in, const Value& v) {
  if (v.is_number()) return v.as_double();
  if (v.is_undefined()) v.raise_undefined();
  if (v.is_string()) {
    if (auto f = parse_py_float(v.as_string())) return *f;
    raise("ValueError", "could not convert string to float: " + in.repr(v));
  }
  raise("TypeError",
        "float() argument must be a string or a real number, not '" + v.type_name() + "'");
}

// Python's str.strip(chars) family on code points.
std::string strip_chars(std::string_view s, const Value& chars, bool left, bool right) {
  std::u32string set;
  const bool whitespace = chars.is_none() || chars.is_undefined();
  if (!whitespace) {
    if (!chars.is_string()) raise("TypeError", "strip arg must be None or str");
    set = unicode::decode(chars.as_string());
  }
  const std::u32string cps = unicode::decode(s);
  auto drop = [&](char32_t c) {
    return whitespace ? unicode::is_space(c) : set.find(c) != std::u32string::npos;
  };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && drop(cps[b])) ++b;
  if (right)
    while (e > b && drop(cps[e - 1])) --e;
  return unicode::encode(std::u32string_view(cps).substr(b, e - b));
}

// The result of a str method called on soft_str(v): Markup stays Markup (markupsafe wraps
// lower(), strip(), center(), ...).
Value same_kind(Interpreter& in, const Value& v, std::string s) {
  return v.is_markup() ? in.make_markup(std::move(s)) : in.make_string(std::move(s));
}

Value ignore_case(Interpreter& in, const Value& v) {
  if (v.is_string()) return in.make_string(unicode::lower(v.as_string()));
  return v;
}

// jinja2's _prepare_attribute_parts: "a.0.b" -> ["a", 0, "b"].
std::vector<Value> attribute_parts(const Value& attr) {
  std::vector<Value> parts;
  if (attr.is_none() || attr.is_undefined()) return parts;
  if (!attr.is_string()) {
    parts.push_back(attr);
    return parts;
  }
  const std::string& s = attr.as_string();
  size_t start = 0;
  while (true) {
    const size_t dot = s.find('.', start);
    const std::string part =
        s.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(),
                                                     [](char c) { return c >= '0' && c <= '9'; });
    if (digits && part.size() < 18)
      parts.emplace_back(static_cast<int64_t>(std::stoll(part)));
    else
      parts.emplace_back(part);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return parts;
}

// jinja2's make_attrgetter (item lookup through getitem, then `default` for an Undefined).
struct AttrGetter {
  std::vector<Value> parts;
  std::optional<Value> default_value;
  bool lower = false;

  Value operator()(Interpreter& in, const Value& item) const {
    Value v = item;
    for (const Value& p : parts) {
      v = in.getitem(v, p);
      if (default_value && v.is_undefined()) v = *default_value;
    }
    return lower ? ignore_case(in, v) : v;
  }
};

// jinja2's make_multi_attrgetter: "a,b" -> the list [item.a, item.b] (a sort key).
Value multi_attr_key(Interpreter& in, const Value& attribute, const Value& item, bool lower) {
  std::vector<Value> keys;
  std::vector<Value> specs;
  if (attribute.is_string()) {
    const std::string& s = attribute.as_string();
    size_t start = 0;
    while (true) {
      const size_t comma = s.find(',', start);
      specs.emplace_back(
          s.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  } else {
    specs.push_back(attribute);
  }
  for (const Value& spec : specs) {
    Value v = item;
    for (const Value& p : attribute_parts(spec)) v = in.getitem(v, p);
    keys.push_back(lower ? ignore_case(in, v) : v);
  }
  return Value::list(std::move(keys));
}

// sorted(items, key=..., reverse=...): stable, and stable in reverse too.
std::vector<Value> sorted_by(Interpreter& in, std::vector<Value> items,
                             const std::vector<Value>& keys, bool reverse) {
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  in.step(order.size() * 4);
  merge_sort(order, [&](size_t a, size_t b) {
    return reverse ? py_compare(Order::kLt, keys[b], keys[a])
                   : py_compare(Order::kLt, keys[a], keys[b]);
  });
  std::vector<Value> out;
  out.reserve(items.size());
  for (size_t i : order) out.push_back(std::move(items[i]));
  return out;
}

Value generator(Interpreter& in, std::vector<Value> items) {
  return in.make_seq(std::move(items), SeqKind::kGenerator);
}

// ---------------------------------------------------------------------------------------------
// Filters

Value f_abs(Interpreter&, const Value& v, CallArgs& a) {
  no_args("abs", a);
  if (v.is_float()) return Value(std::fabs(v.as_double()));
  if (v.is_integral()) {
    const int64_t i = v.as_int();
    if (i == std::numeric_limits<int64_t>::min()) raise("OverflowError", "integer overflow");
    return Value(i < 0 ? -i : i);
  }
  raise("TypeError", "bad operand type for abs(): '" + v.type_name() + "'");
}

Value f_attr(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("attr", a, {"name"}, 1);
  const Value& name = b.get(0);
  if (v.is_undefined()) v.raise_undefined();
  if (name.is_string())
    if (std::optional<Value> r = in.python_attribute(v, name.as_string())) return *r;
  return Value::undefined(repr_string(v.object_type_repr()) + " has no attribute " +
                          (name.is_string() ? repr_string(name.as_string()) : in.repr(name)));
}

Value f_batch(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("batch", a, {"linecount", "fill_with"}, 1);
  const int64_t n = need_int(b.get(0), "linecount");
  const Value fill = b.get_or(1, Value::none());
  std::vector<Value> out, tmp;
  for (Value& item : in.iterate(v)) {
    if (static_cast<int64_t>(tmp.size()) == n) {
      out.push_back(in.make_seq(std::move(tmp)));
      tmp.clear();
    }
    tmp.push_back(std::move(item));
  }
  if (!tmp.empty()) {
    if (!fill.is_none() && static_cast<int64_t>(tmp.size()) < n) {
      if (n > static_cast<int64_t>(in.options().limits.max_items))
        raise("LimitError", "a batch would have more than " +
                                std::to_string(in.options().limits.max_items) + " items");
      in.step(static_cast<uint64_t>(n));
      tmp.resize(static_cast<size_t>(n), fill);
    }
    out.push_back(in.make_seq(std::move(tmp)));
  }
  return generator(in, std::move(out));
}

Value f_capitalize(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("capitalize", a);
  return same_kind(in, v, unicode::capitalize(soft_str(in, v).as_string()));
}

// str.center / ljust / rjust.
std::string pad(Interpreter& in, const std::string& s, int64_t width, const std::string& fill,
                char how) {
  const auto len = static_cast<int64_t>(unicode::length(s));
  if (width <= len) return s;
  const int64_t marg = width - len;
  if (static_cast<uint64_t>(marg) > in.options().limits.max_output_bytes)
    in.check_string_size(in.options().limits.max_output_bytes + 1);
  in.check_string_size(s.size() + static_cast<size_t>(marg) * fill.size());
  int64_t left = 0;
  if (how == 'c')
    left = marg / 2 + (marg & width & 1);
  else if (how == 'r')
    left = marg;
  const int64_t right = marg - left;
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = 0; i < right; ++i) out += fill;
  return out;
}

Value f_center(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("center", a, {"width"});
  const int64_t width = need_int(b.get_or(0, Value(80)), "");
  return same_kind(in, v, pad(in, soft_str(in, v).as_string(), width, " ", 'c'));
}

Value f_default(Interpreter&, const Value& v, CallArgs& a) {
  ArgBinder b("default", a, {"default_value", "boolean"});
  const bool boolean = b.get_or(1, Value(false)).truthy();
  if (v.is_undefined() || (boolean && !v.truthy())) return b.get_or(0, Value(""));
  return v;
}

Value f_dictsort(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("dictsort", a, {"case_sensitive", "by", "reverse"});
  const bool case_sensitive = b.get_or(0, Value(false)).truthy();
  const Value by = b.get_or(1, Value("key"));
  const bool reverse = b.get_or(2, Value(false)).truthy();
  size_t pos = 0;
  if (by.is_string() && by.as_string() == "key")
    pos = 0;
  else if (by.is_string() && by.as_string() == "value")
    pos = 1;
  else
    raise("FilterArgumentError", "You can only sort by either \"key\" or \"value\"");
  if (!v.is_dict()) {
    if (v.is_undefined()) v.raise_undefined();
    raise("AttributeError", "'" + v.type_name() + "' object has no attribute 'items'");
  }
  std::vector<Value> items, keys;
  for (const auto& [k, val] : v.as_dict().entries) {
    items.push_back(Value::tuple({k, val}));
    const Value& key = pos == 0 ? k : val;
    keys.push_back(case_sensitive ? key : ignore_case(in, key));
  }
  return in.make_seq(sorted_by(in, std::move(items), keys, reverse));
}

Value f_escape(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("escape", a);
  if (v.is_markup()) return v;
  return in.make_markup(html_escape(in.str(v)));
}

Value f_forceescape(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("forceescape", a);
  return in.make_markup(html_escape(in.str(v)));
}

Value f_filesizeformat(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("filesizeformat", a, {"binary"});
  const bool binary = b.get_or(0, Value(false)).truthy();
  const double bytes = py_float(in, v);
  const double base = binary ? 1024 : 1000;
  static constexpr const char* kBinary[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
  static constexpr const char* kDecimal[] = {"kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"};
  if (bytes == 1) return Value("1 Byte");
  char buf[64];
  if (bytes < base) {
    std::snprintf(buf, sizeof(buf), "%lld Bytes", static_cast<long long>(bytes));
    return Value(std::string(buf));
  }
  double unit = base;
  const char* prefix = "";
  for (int i = 0; i < 8; ++i) {
    unit = std::pow(base, i + 2);
    prefix = binary ? kBinary[i] : kDecimal[i];
    if (bytes < unit) break;
  }
  std::snprintf(buf, sizeof(buf), "%.1f %s", base * bytes / unit, prefix);
  return Value(std::string(buf));
}

Value first_item(Interpreter& in, const Value& v) {
  if (v.is_seq(SeqKind::kGenerator)) {
    Sequence& s = v.as_seq();
    if (s.consumed || s.items.empty())
      return Value::undefined("No first item, sequence was empty.");
    Value first = s.items.front();
    s.items.erase(s.items.begin());
    return first;
  }
  if (v.is_string() && !v.as_string().empty()) {
    std::string one;
    unicode::append(unicode::decode(v.as_string())[0], one);
    return in.make_string(std::move(one));
  }
  std::vector<Value> items = in.iterate(v);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}

Value f_first(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("first", a);
  return first_item(in, v);
}

Value f_last(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("last", a);
  // next(iter(reversed(seq))): a generator is not reversible; an Undefined is (it is empty).
  if (v.is_undefined()) return Value::undefined("No last item, sequence was empty.");
  if (v.is_seq(SeqKind::kGenerator) || v.is_seq(SeqKind::kDictValues) ||
      !(v.is_string() || v.is_seq() || v.is_dict()))
    raise("TypeError", "'" + v.type_name() + "' object is not reversible");
  std::vector<Value> items = in.iterate(v);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}

// Python float(str): whitespace, sign, digits with single underscores, exponent, inf, nan.
std::optional<double> parse_py_float(std::string_view text) {
  std::string s = strip_chars(text, Value::none(), true, true);
  std::string lower = unicode::lower(s);
  size_t i = 0;
  std::string clean;
  if (i < lower.size() && (lower[i] == '+' || lower[i] == '-')) clean.push_back(lower[i++]);
  const std::string rest = lower.substr(i);
  if (rest == "inf" || rest == "infinity") return clean == "-" ? -INFINITY : INFINITY;
  if (rest == "nan") return std::nan("");
  auto digits = [&](bool need) {
    const size_t start = i;
    bool last_digit = false;
    while (i < lower.size()) {
      if (lower[i] >= '0' && lower[i] <= '9') {
        clean.push_back(lower[i++]);
        last_digit = true;
      } else if (lower[i] == '_' && last_digit && i + 1 < lower.size() && lower[i + 1] >= '0' &&
                 lower[i + 1] <= '9') {
        ++i;
        last_digit = false;
      } else {
        break;
      }
    }
    return !need || i > start;
  };
  const size_t before = i;
  digits(false);
  bool any = i > before;
  if (i < lower.size() && lower[i] == '.') {
    clean.push_back('.');
    ++i;
    const size_t f = i;
    digits(false);
    any = any || i > f;
  }
  if (!any) return std::nullopt;
  if (i < lower.size() && lower[i] == 'e') {
    clean.push_back('e');
    ++i;
    if (i < lower.size() && (lower[i] == '+' || lower[i] == '-')) clean.push_back(lower[i++]);
    if (!digits(true)) return std::nullopt;
  }
  if (i != lower.size()) return std::nullopt;
  return std::strtod(clean.c_str(), nullptr);
}

// Python int(str, base).
std::optional<int64_t> parse_py_int(std::string_view text, int64_t base) {
  std::string s = strip_chars(text, Value::none(), true, true);
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  if (i + 1 < s.size() && s[i] == '0') {
    const char p = static_cast<char>(s[i + 1] | 0x20);
    const int64_t prefix_base = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (prefix_base && (base == prefix_base || base == 0)) {
      base = prefix_base;
      i += 2;
      if (i < s.size() && s[i] == '_') ++i;
    }
  }
  if (base == 0) base = 10;
  if (base < 2 || base > 36) return std::nullopt;
  if (i >= s.size()) return std::nullopt;
  uint64_t v = 0;
  bool last_digit = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '_' && last_digit && i + 1 < s.size() && s[i + 1] != '_') {
      last_digit = false;
      continue;
    }
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    if (c >= 'a' && c <= 'z') d = c - 'a' + 10;
    if (c >= 'A' && c <= 'Z') d = c - 'A' + 10;
    if (d < 0 || d >= base) return std::nullopt;
    if (v >
        (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - static_cast<uint64_t>(d)) /
            static_cast<uint64_t>(base))
      raise("OverflowError", "integer too large (tandem's Jinja integers are 64-bit)");
    v = v * static_cast<uint64_t>(base) + static_cast<uint64_t>(d);
    last_digit = true;
  }
  if (!last_digit) return std::nullopt;
  return neg ? -static_cast<int64_t>(v) : static_cast<int64_t>(v);
}

std::optional<double> to_float(const Value& v) {
  if (v.is_number()) return v.as_double();
  if (v.is_string()) return parse_py_float(v.as_string());
  return std::nullopt;
}

Value f_float(Interpreter&, const Value& v, CallArgs& a) {
  ArgBinder b("float", a, {"default"});
  if (v.is_undefined()) v.raise_undefined();  // Undefined.__float__ raises
  if (auto f = to_float(v)) return Value(*f);
  return b.get_or(0, Value(0.0));
}

// int(float): truncation; infinity cannot be converted (OverflowError, which jinja2 does not
// catch), NaN neither (ValueError, which it does).
std::optional<int64_t> float_to_int(double f) {
  if (std::isnan(f)) return std::nullopt;
  if (std::isinf(f)) raise("OverflowError", "cannot convert float infinity to integer");
  if (f >= 9223372036854775808.0 || f < -9223372036854775808.0)
    raise("OverflowError", "integer too large (tandem's Jinja integers are 64-bit)");
  return static_cast<int64_t>(f);
}

Value f_int(Interpreter&, const Value& v, CallArgs& a) {
  ArgBinder b("int", a, {"default", "base"});
  const Value fallback = b.get_or(0, Value(0));
  const int64_t base = need_int(b.get_or(1, Value(10)), "");
  if (v.is_undefined()) v.raise_undefined();  // Undefined.__int__ raises
  if (v.is_integral()) return Value(v.as_int());
  if (v.is_float()) {
    if (auto i = float_to_int(v.as_double())) return Value(*i);
    return fallback;
  }
  if (v.is_string()) {
    if (auto i = parse_py_int(v.as_string(), base)) return Value(*i);
    if (auto f = parse_py_float(v.as_string()))
      if (auto i = float_to_int(*f)) return Value(*i);
  }
  return fallback;
}

Value f_format(Interpreter& in, const Value& v, CallArgs& a) {
  if (!a.args.empty() && !a.kwargs.empty())
    raise("FilterArgumentError", "can't handle positional and keyword arguments at the same time");
  Value args;
  if (!a.kwargs.empty()) {
    auto d = std::make_shared<Dict>();
    for (auto& [k, x] : a.kwargs) d->set(Value(k), x);
    args = in.make_dict(std::move(d));
  } else {
    args = in.make_seq(a.args, SeqKind::kTuple);
  }
  return percent_format(in, soft_str(in, v), args);
}

Value f_groupby(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("groupby", a, {"attribute", "default", "case_sensitive"}, 1);
  const bool case_sensitive = b.get_or(2, Value(false)).truthy();
  AttrGetter key{attribute_parts(b.get(0)), std::nullopt, !case_sensitive};
  if (b.has(1) && !b.get(1).is_none()) key.default_value = b.get(1);
  AttrGetter out_key = key;
  out_key.lower = false;
  std::vector<Value> items = in.iterate(v);
  std::vector<Value> keys;
  for (const Value& item : items) keys.push_back(key(in, item));
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  merge_sort(order, [&](size_t x, size_t y) { return py_compare(Order::kLt, keys[x], keys[y]); });
  std::vector<Value> groups;
  size_t i = 0;
  while (i < order.size()) {
    size_t j = i + 1;
    while (j < order.size() && py_equal(keys[order[j]], keys[order[i]])) ++j;
    std::vector<Value> members;
    for (size_t k = i; k < j; ++k) members.push_back(items[order[k]]);
    const Value grouper = case_sensitive ? keys[order[i]] : out_key(in, members.front());
    auto t = std::make_shared<Sequence>();
    t->kind = SeqKind::kTuple;
    t->field_names = {"grouper", "list"};
    t->items = {grouper, in.make_seq(std::move(members))};
    groups.push_back(Value::seq(std::move(t)));
    i = j;
  }
  return in.make_seq(std::move(groups));
}

Value f_indent(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("indent", a, {"width", "first", "blank"});
  const Value width = b.get_or(0, Value(4));
  const bool first = b.get_or(1, Value(false)).truthy();
  const bool blank = b.get_or(2, Value(false)).truthy();
  std::string indention;
  if (width.is_string()) {
    indention = width.as_string();
  } else {
    const int64_t n = need_int(width, "");
    in.check_string_size(static_cast<size_t>(std::max<int64_t>(0, n)));
    indention.assign(static_cast<size_t>(std::max<int64_t>(0, n)), ' ');
  }
  // jinja2 starts with s += "\n": a list takes it (then has no splitlines), a tuple refuses it.
  if (v.is_seq(SeqKind::kList))
    raise("AttributeError", "'list' object has no attribute 'splitlines'");
  if (v.is_seq(SeqKind::kTuple))
    raise("TypeError", "can only concatenate tuple (not \"str\") to tuple");
  if (v.is_undefined()) v.raise_undefined();
  if (!v.is_string())
    raise("TypeError", "unsupported operand type(s) for +=: '" + v.type_name() + "' and 'str'");
  // s += "\n" (so that splitlines keeps a trailing empty line), then indent every line.
  const std::u32string cps = unicode::decode(v.as_string() + "\n");
  std::vector<std::string> lines;
  std::u32string line;
  for (size_t i = 0; i < cps.size(); ++i) {
    const char32_t c = cps[i];
    if (unicode::is_line_break(c)) {
      if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
      lines.push_back(unicode::encode(line));
      line.clear();
    } else {
      line.push_back(c);
    }
  }
  if (!line.empty()) lines.push_back(unicode::encode(line));
  std::string rv;
  auto add = [&](const std::string& s) {
    in.check_string_size(rv.size() + s.size());
    rv += s;
  };
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) add("\n" + indention);
      add(lines[i]);
    }
  } else if (!lines.empty()) {
    add(lines[0]);
    for (size_t i = 1; i < lines.size(); ++i) {
      add("\n");
      if (!lines[i].empty()) add(indention);
      add(lines[i]);
    }
  }
  if (first) rv = indention + rv;
  return v.is_markup() ? in.make_markup(std::move(rv)) : in.make_string(std::move(rv));
}

Value f_items(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("items", a);
  if (v.is_undefined()) return generator(in, {});
  if (!v.is_dict()) raise("TypeError", "Can only get item pairs from a mapping.");
  std::vector<Value> items;
  for (const auto& [k, val] : v.as_dict().entries) items.push_back(Value::tuple({k, val}));
  return generator(in, std::move(items));
}

Value f_join(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("join", a, {"d", "attribute"});
  const std::string sep = in.str(b.get_or(0, Value("")));
  std::vector<Value> items = in.iterate(v);
  std::optional<AttrGetter> getter;
  if (b.has(1) && !b.get(1).is_none()) getter = AttrGetter{attribute_parts(b.get(1)), std::nullopt};
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    const Value item = getter ? (*getter)(in, items[i]) : items[i];
    const std::string part = item.is_string() ? item.as_string() : in.str(item);
    in.check_string_size(out.size() + part.size() + sep.size());
    if (i) out += sep;
    out += part;
  }
  return in.make_string(std::move(out));
}

Value f_length(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("length", a);
  return Value(in.length(v));
}

Value f_list(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("list", a);
  return in.make_seq(in.iterate(v));
}

Value f_lower(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("lower", a);
  return same_kind(in, v, unicode::lower(soft_str(in, v).as_string()));
}

Value f_upper(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("upper", a);
  return same_kind(in, v, unicode::upper(soft_str(in, v).as_string()));
}

Value f_map(Interpreter& in, const Value& v, CallArgs& a) {
  // jinja2's do_map starts with `if value:`: a falsy operand maps to nothing, unchecked.
  if (!v.truthy()) return generator(in, {});
  std::vector<Value> items = in.iterate(v);
  std::vector<Value> out;
  if (a.args.empty()) {
    // map(attribute='x', default=...)
    std::optional<Value> attribute, dflt;
    for (auto& [k, x] : a.kwargs) {
      if (k == "attribute")
        attribute = x;
      else if (k == "default")
        dflt = x;
      else
        raise("FilterArgumentError", "Unexpected keyword argument " + repr_string(k));
    }
    if (!attribute) raise("FilterArgumentError", "map requires a filter argument");
    AttrGetter getter{attribute_parts(*attribute), std::nullopt};
    if (dflt && !dflt->is_none()) getter.default_value = *dflt;
    for (const Value& item : items) out.push_back(getter(in, item));
  } else {
    const Value name = a.args[0];
    if (!name.is_string()) raise("TemplateRuntimeError", "No filter named " + in.repr(name) + ".");
    for (const Value& item : items) {
      CallArgs rest;
      rest.args.assign(a.args.begin() + 1, a.args.end());
      rest.kwargs = a.kwargs;
      out.push_back(in.apply_filter(name.as_string(), item, rest));
    }
  }
  return generator(in, std::move(out));
}

Value min_max(Interpreter& in, const Value& v, CallArgs& a, bool is_max, const char* name) {
  ArgBinder b(name, a, {"case_sensitive", "attribute"});
  const bool case_sensitive = b.get_or(0, Value(false)).truthy();
  std::vector<Value> items = in.iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  AttrGetter getter{attribute_parts(b.get_or(1, Value::none())), std::nullopt, !case_sensitive};
  size_t best = 0;
  Value best_key = getter(in, items[0]);
  for (size_t i = 1; i < items.size(); ++i) {
    Value key = getter(in, items[i]);
    // min keeps the first of equal minima, max the first of equal maxima.
    if (is_max ? py_compare(Order::kGt, key, best_key) : py_compare(Order::kLt, key, best_key)) {
      best = i;
      best_key = std::move(key);
    }
  }
  return items[best];
}

Value f_max(Interpreter& in, const Value& v, CallArgs& a) {
  return min_max(in, v, a, true, "max");
}
Value f_min(Interpreter& in, const Value& v, CallArgs& a) {
  return min_max(in, v, a, false, "min");
}

// select/reject/selectattr/rejectattr.
Value select_reject(Interpreter& in, const Value& v, CallArgs& a, bool select, bool by_attr) {
  // jinja2's select_or_reject starts with `if value:`: a falsy operand selects nothing.
  if (!v.truthy()) return generator(in, {});
  std::vector<Value> items = in.iterate(v);
  size_t off = 0;
  std::optional<AttrGetter> getter;
  if (by_attr) {
    if (a.args.empty()) raise("FilterArgumentError", "Missing parameter for attribute name");
    getter = AttrGetter{attribute_parts(a.args[0]), std::nullopt};
    off = 1;
  }
  std::optional<std::string> test;
  if (a.args.size() > off) {
    if (!a.args[off].is_string())
      raise("TemplateRuntimeError", "No test named " + in.repr(a.args[off]) + ".");
    test = a.args[off].as_string();
  }
  std::vector<Value> out;
  for (Value& item : items) {
    const Value subject = getter ? (*getter)(in, item) : item;
    bool ok;
    if (test) {
      CallArgs rest;
      rest.args.assign(a.args.begin() + static_cast<std::ptrdiff_t>(off) + 1, a.args.end());
      rest.kwargs = a.kwargs;
      ok = in.apply_test(*test, subject, rest);
    } else {
      ok = subject.truthy();
    }
    if (ok == select) out.push_back(std::move(item));
  }
  return generator(in, std::move(out));
}

Value f_select(Interpreter& in, const Value& v, CallArgs& a) {
  return select_reject(in, v, a, true, false);
}
Value f_reject(Interpreter& in, const Value& v, CallArgs& a) {
  return select_reject(in, v, a, false, false);
}
Value f_selectattr(Interpreter& in, const Value& v, CallArgs& a) {
  return select_reject(in, v, a, true, true);
}
Value f_rejectattr(Interpreter& in, const Value& v, CallArgs& a) {
  return select_reject(in, v, a, false, true);
}

Value f_replace(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("replace", a, {"old", "new", "count"}, 2);
  CallArgs margs;
  margs.args = {in.make_string(in.str(b.get(0))), in.make_string(in.str(b.get(1)))};
  if (b.has(2) && !b.get(2).is_none()) margs.args.push_back(b.get(2));
  const Value s = in.make_string(in.str(v));
  return in.call(in.getattr(s, "replace"), margs);
}

// jinja2's do_reverse: a reversed string, else reversed(value) (an iterator), else for what
// reversed() refuses (generators) a reversed list; FilterArgumentError for what does not iterate.
Value f_reverse(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("reverse", a);
  if (v.is_string()) {
    std::u32string cps = unicode::decode(v.as_string());
    std::reverse(cps.begin(), cps.end());
    return v.is_markup() ? in.make_markup(unicode::encode(cps))
                         : in.make_string(unicode::encode(cps));
  }
  if (!(v.is_seq() || v.is_dict() || v.is_undefined()))
    raise("FilterArgumentError", "argument must be iterable");
  std::vector<Value> items = in.iterate(v);
  std::reverse(items.begin(), items.end());
  if (v.is_seq(SeqKind::kGenerator)) return in.make_seq(std::move(items));
  return generator(in, std::move(items));
}

// Python round(x, n) for a float: correctly rounded (ties to even on the exact binary value),
// which is what printf's %.*f does.
double round_float(double x, int64_t n) {
  if (!std::isfinite(x)) return x;
  if (n >= 0) {
    if (n > 330) return x;
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(n), x);
    return std::strtod(buf, nullptr);
  }
  if (n < -330) return std::copysign(0.0, x);
  const double p = std::pow(10.0, static_cast<double>(-n));
  return std::nearbyint(x / p) * p;
}

Value f_round(Interpreter&, const Value& v, CallArgs& a) {
  ArgBinder b("round", a, {"precision", "method"});
  const int64_t precision = need_int(b.get_or(0, Value(0)), "");
  const Value method = b.get_or(1, Value("common"));
  const std::string m = method.is_string() ? method.as_string() : "";
  if (m != "common" && m != "ceil" && m != "floor")
    raise("FilterArgumentError", "method must be common, ceil or floor");
  if (!v.is_number())
    raise("TypeError", "type " + v.type_name() + " doesn't define __round__ method");
  if (m == "common") {
    if (v.is_integral()) {
      if (precision >= 0) return Value(v.as_int());
      // round(int, -n): to a multiple of 10**n, ties to even.
      if (precision < -18) return Value(static_cast<int64_t>(0));
      int64_t p = 1;
      for (int64_t i = 0; i < -precision; ++i) p *= 10;
      const int64_t x = v.as_int();
      int64_t q = x / p, r = x % p;
      if (r < 0) {
        r += p;
        --q;
      }
      if (2 * r > p || (2 * r == p && (q & 1))) ++q;
      int64_t out = 0;
      if (__builtin_mul_overflow(q, p, &out)) raise("OverflowError", "integer overflow");
      return Value(out);
    }
    return Value(round_float(v.as_double(), precision));
  }
  const double p = std::pow(10.0, static_cast<double>(precision));
  const double scaled = v.as_double() * p;
  const double r = m == "ceil" ? std::ceil(scaled) : std::floor(scaled);
  return Value(r / p);
}

Value f_safe(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("safe", a);
  if (v.is_markup()) return v;
  return in.make_markup(v.is_string() ? v.as_string() : in.str(v));
}

Value f_slice(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("slice", a, {"slices", "fill_with"}, 1);
  const int64_t slices = need_int(b.get(0), "slices");
  const Value fill = b.get_or(1, Value::none());
  std::vector<Value> seq = in.iterate(v);
  const auto length = static_cast<int64_t>(seq.size());
  if (slices <= 0) raise("ZeroDivisionError", "integer division or modulo by zero");
  if (slices > static_cast<int64_t>(in.options().limits.max_items))
    raise("LimitError", "too many slices");
  const int64_t per = length / slices;
  const int64_t extra = length % slices;
  int64_t offset = 0;
  std::vector<Value> out;
  for (int64_t n = 0; n < slices; ++n) {
    in.step();
    const int64_t start = offset + n * per;
    if (n < extra) ++offset;
    const int64_t end = offset + (n + 1) * per;
    std::vector<Value> tmp(seq.begin() + start, seq.begin() + end);
    if (!fill.is_none() && n >= extra) tmp.push_back(fill);
    out.push_back(in.make_seq(std::move(tmp)));
  }
  return generator(in, std::move(out));
}

Value f_sort(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("sort", a, {"reverse", "case_sensitive", "attribute"});
  const bool reverse = b.get_or(0, Value(false)).truthy();
  const bool case_sensitive = b.get_or(1, Value(false)).truthy();
  const Value attribute = b.get_or(2, Value::none());
  std::vector<Value> items = in.iterate(v);
  std::vector<Value> keys;
  for (const Value& item : items)
    keys.push_back(multi_attr_key(in, attribute, item, !case_sensitive));
  return in.make_seq(sorted_by(in, std::move(items), keys, reverse));
}

Value f_string(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("string", a);
  return soft_str(in, v);
}

// HTML entities markupsafe's unescape knows best; the common ones.
std::string html_unescape(std::string_view s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == '&') {
      const size_t semi = s.find(';', i);
      if (semi != std::string_view::npos && semi - i <= 10) {
        const std::string_view ent = s.substr(i + 1, semi - i - 1);
        std::string rep;
        if (ent == "amp")
          rep = "&";
        else if (ent == "lt")
          rep = "<";
        else if (ent == "gt")
          rep = ">";
        else if (ent == "quot")
          rep = "\"";
        else if (ent == "apos")
          rep = "'";
        else if (ent == "nbsp")
          rep = "\xC2\xA0";
        else if (ent.size() > 1 && ent[0] == '#') {
          const bool hex = ent[1] == 'x' || ent[1] == 'X';
          const std::string digits(ent.substr(hex ? 2 : 1));
          char* end = nullptr;
          const unsigned long cp = std::strtoul(digits.c_str(), &end, hex ? 16 : 10);
          if (!digits.empty() && end && *end == 0 && cp > 0 && cp <= 0x10FFFF)
            unicode::append(static_cast<char32_t>(cp), rep);
        }
        if (!rep.empty()) {
          out += rep;
          i = semi + 1;
          continue;
        }
      }
    }
    out.push_back(s[i++]);
  }
  return out;
}

Value f_striptags(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("striptags", a);
  std::string s = in.str(v);
  size_t start;
  while ((start = s.find("<!--")) != std::string::npos) {
    const size_t end = s.find("-->", start);
    if (end == std::string::npos) break;
    s.erase(start, end + 3 - start);
  }
  while ((start = s.find('<')) != std::string::npos) {
    const size_t end = s.find('>', start);
    if (end == std::string::npos) break;
    s.erase(start, end + 1 - start);
  }
  // " ".join(s.split())
  std::string collapsed;
  std::u32string word;
  for (char32_t c : unicode::decode(s)) {
    if (unicode::is_space(c)) {
      if (!word.empty()) {
        if (!collapsed.empty()) collapsed += ' ';
        collapsed += unicode::encode(word);
        word.clear();
      }
    } else {
      word.push_back(c);
    }
  }
  if (!word.empty()) {
    if (!collapsed.empty()) collapsed += ' ';
    collapsed += unicode::encode(word);
  }
  return in.make_string(html_unescape(collapsed));
}

Value f_sum(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("sum", a, {"attribute", "start"});
  std::optional<AttrGetter> getter;
  if (b.has(0) && !b.get(0).is_none()) getter = AttrGetter{attribute_parts(b.get(0)), std::nullopt};
  Value total = b.get_or(1, Value(0));
  if (total.is_string()) raise("TypeError", "sum() can't sum strings [use ''.join(seq) instead]");
  for (const Value& item : in.iterate(v))
    total = in.binary(BinOp::kAdd, total, getter ? (*getter)(in, item) : item);
  return total;
}

// jinja2's do_title: the first character of each word (after -, whitespace, (, {, [ or <)
// upper-cased, the rest lower-cased.
Value f_title(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("title", a);
  const std::u32string cps = unicode::decode(soft_str(in, v).as_string());
  auto is_sep = [](char32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || unicode::is_space(c);
  };
  std::string out;
  size_t i = 0;
  while (i < cps.size()) {
    size_t j = i;
    const bool sep = is_sep(cps[i]);
    while (j < cps.size() && is_sep(cps[j]) == sep) ++j;
    const std::u32string_view part(cps.data() + i, j - i);
    if (sep) {
      out += unicode::encode(part);
    } else {
      out += unicode::upper(unicode::encode(part.substr(0, 1)));
      out += unicode::lower(unicode::encode(part.substr(1)));
    }
    i = j;
  }
  return in.make_string(std::move(out));
}

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False); unlike jinja2's own tojson it does not HTML-escape.
Value f_tojson(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("tojson", a, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions o;
  o.ensure_ascii = b.get_or(0, Value(false)).truthy();
  const Value indent = b.get_or(1, Value::none());
  if (indent.is_string()) {
    o.indent = indent.as_string();
  } else if (indent.is_integral()) {
    o.indent =
        std::string(static_cast<size_t>(std::clamp<int64_t>(indent.as_int(), 0, 1 << 16)), ' ');
  } else if (!indent.is_none()) {
    raise("TypeError", "can't multiply sequence by non-int of type '" + indent.type_name() + "'");
  }
  const Value seps = b.get_or(2, Value::none());
  if (!seps.is_none()) {
    std::vector<Value> parts = in.iterate(seps);
    if (parts.size() != 2)
      raise("ValueError", "separators must be a pair (item separator, key separator)");
    if (!parts[0].is_string() || !parts[1].is_string())
      raise("TypeError", "separators must be strings");
    o.separators = std::make_pair(parts[0].as_string(), parts[1].as_string());
  }
  o.sort_keys = b.get_or(3, Value(false)).truthy();
  std::string s = py_json_dumps(v, o, in.value_limits());
  return in.make_string(std::move(s));
}

Value f_trim(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("trim", a, {"chars"});
  return same_kind(
      in, v, strip_chars(soft_str(in, v).as_string(), b.get_or(0, Value::none()), true, true));
}

// jinja2's do_truncate works on the value itself (len(), slicing), not on its str().
Value f_truncate(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("truncate", a, {"length", "killwords", "end", "leeway"});
  const int64_t length = need_int(b.get_or(0, Value(255)), "");
  const bool killwords = b.get_or(1, Value(false)).truthy();
  const Value end = b.get_or(2, Value("..."));
  const Value leeway_v = b.get_or(3, Value::none());
  const int64_t leeway = leeway_v.is_none() ? 5 : need_int(leeway_v, "");
  const int64_t end_len = in.length(end);
  if (length < end_len)
    raise("AssertionError",
          "expected length >= " + std::to_string(end_len) + ", got " + std::to_string(length));
  if (leeway < 0) raise("AssertionError", "expected leeway >= 0, got " + std::to_string(leeway));
  if (in.length(v) <= length + leeway) return v;
  const Value head = in.slice(v, Value::none(), Value(length - end_len), Value::none());
  if (killwords) return in.binary(BinOp::kAdd, head, end);
  if (!v.is_string())
    raise("AttributeError", "'" + v.type_name() + "' object has no attribute 'rsplit'");
  const std::u32string cps = unicode::decode(head.as_string());
  const size_t space = cps.rfind(U' ');
  const std::string kept =
      space == std::u32string::npos ? head.as_string() : unicode::encode(cps.substr(0, space));
  return in.binary(BinOp::kAdd, in.make_string(kept), end);
}

Value f_unique(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("unique", a, {"case_sensitive", "attribute"});
  const bool case_sensitive = b.get_or(0, Value(false)).truthy();
  AttrGetter getter{attribute_parts(b.get_or(1, Value::none())), std::nullopt, !case_sensitive};
  std::vector<Value> out, seen;
  for (Value& item : in.iterate(v)) {
    const Value key = getter(in, item);
    require_hashable(key);
    bool found = false;
    in.step(seen.size() / 16);
    for (const Value& s : seen)
      if (py_equal(s, key)) {
        found = true;
        break;
      }
    if (!found) {
      seen.push_back(key);
      out.push_back(std::move(item));
    }
  }
  return generator(in, std::move(out));
}

std::string url_quote(const std::string& s, bool for_qs) {
  std::string out;
  for (unsigned char c : s) {
    const bool unreserved = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                            (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-' ||
                            c == '~' || (!for_qs && c == '/');
    if (unreserved) {
      out.push_back(static_cast<char>(c));
    } else if (for_qs && c == ' ') {
      out.push_back('+');
    } else {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

Value f_urlencode(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("urlencode", a);
  if (v.is_string() || !(v.is_seq() || v.is_dict() || v.is_undefined()))
    return in.make_string(url_quote(in.str(v), false));
  std::vector<Value> pairs;
  if (v.is_dict()) {
    for (const auto& [k, x] : v.as_dict().entries) pairs.push_back(Value::tuple({k, x}));
  } else {
    pairs = in.iterate(v);
  }
  std::string out;
  for (const Value& p : pairs) {
    // for k, v in pairs
    if (!(p.is_string() || p.is_seq() || p.is_dict() || p.is_undefined()))
      raise("TypeError", "cannot unpack non-iterable " + p.type_name() + " object");
    std::vector<Value> kv = in.iterate(p);
    if (kv.size() < 2)
      raise("ValueError",
            "not enough values to unpack (expected 2, got " + std::to_string(kv.size()) + ")");
    if (kv.size() > 2) raise("ValueError", "too many values to unpack (expected 2)");
    if (!out.empty()) out += '&';
    out += url_quote(in.str(kv[0]), true) + "=" + url_quote(in.str(kv[1]), true);
  }
  return in.make_string(std::move(out));
}

Value f_wordcount(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("wordcount", a);
  int64_t n = 0;
  bool in_word = false;
  for (char32_t c : unicode::decode(soft_str(in, v).as_string())) {
    const bool w = unicode::is_word(c);
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value(n);
}

Value f_unsupported(Interpreter&, const Value&, CallArgs&) {
  raise("TemplateRuntimeError", "this filter is not supported by tandem's Jinja interpreter");
}

const FilterTable& filters() {
  static const FilterTable table = {
      {"abs", f_abs},
      {"attr", f_attr},
      {"batch", f_batch},
      {"capitalize", f_capitalize},
      {"center", f_center},
      {"count", f_length},
      {"d", f_default},
      {"default", f_default},
      {"dictsort", f_dictsort},
      {"e", f_escape},
      {"escape", f_escape},
      {"filesizeformat", f_filesizeformat},
      {"first", f_first},
      {"float", f_float},
      {"forceescape", f_forceescape},
      {"format", f_format},
      {"groupby", f_groupby},
      {"indent", f_indent},
      {"int", f_int},
      {"items", f_items},
      {"join", f_join},
      {"last", f_last},
      {"length", f_length},
      {"list", f_list},
      {"lower", f_lower},
      {"map", f_map},
      {"max", f_max},
      {"min", f_min},
      {"pprint", f_unsupported},
      {"random", f_unsupported},
      {"reject", f_reject},
      {"rejectattr", f_rejectattr},
      {"replace", f_replace},
      {"reverse", f_reverse},
      {"round", f_round},
      {"safe", f_safe},
      {"select", f_select},
      {"selectattr", f_selectattr},
      {"slice", f_slice},
      {"sort", f_sort},
      {"string", f_string},
      {"striptags", f_striptags},
      {"sum", f_sum},
      {"title", f_title},
      {"tojson", f_tojson},
      {"trim", f_trim},
      {"truncate", f_truncate},
      {"unique", f_unique},
      {"upper", f_upper},
      {"urlencode", f_urlencode},
      {"urlize", f_unsupported},
      {"wordcount", f_wordcount},
      {"wordwrap", f_unsupported},
      {"xmlattr", f_unsupported},
  };
  return table;
}

// ---------------------------------------------------------------------------------------------
// Tests

bool number_mod_is(Interpreter& in, const Value& v, const Value& divisor, int64_t want) {
  return py_equal(in.binary(BinOp::kMod, v, divisor), Value(want));
}

bool t_odd(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("odd", a);
  return number_mod_is(in, v, Value(2), 1);
}
bool t_even(Interpreter& in, const Value& v, CallArgs& a) {
  no_args("even", a);
  return number_mod_is(in, v, Value(2), 0);
}
bool t_divisibleby(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("divisibleby", a, {"num"}, 1);
  return number_mod_is(in, v, b.get(0), 0);
}
bool t_defined(Interpreter&, const Value& v, CallArgs&) {
  return !v.is_undefined();
}
bool t_undefined(Interpreter&, const Value& v, CallArgs&) {
  return v.is_undefined();
}
bool t_none(Interpreter&, const Value& v, CallArgs&) {
  return v.is_none();
}
bool t_boolean(Interpreter&, const Value& v, CallArgs&) {
  return v.is_bool();
}
bool t_false(Interpreter&, const Value& v, CallArgs&) {
  return v.is_bool() && !v.as_bool();
}
bool t_true(Interpreter&, const Value& v, CallArgs&) {
  return v.is_bool() && v.as_bool();
}
bool t_integer(Interpreter&, const Value& v, CallArgs&) {
  return v.is_int();
}
bool t_float(Interpreter&, const Value& v, CallArgs&) {
  return v.is_float();
}
bool t_lower(Interpreter& in, const Value& v, CallArgs&) {
  return unicode::str_is_lower(in.str(v));
}
bool t_upper(Interpreter& in, const Value& v, CallArgs&) {
  return unicode::str_is_upper(in.str(v));
}
bool t_string(Interpreter&, const Value& v, CallArgs&) {
  return v.is_string();
}
bool t_mapping(Interpreter&, const Value& v, CallArgs&) {
  return v.is_dict();
}
bool t_number(Interpreter&, const Value& v, CallArgs&) {
  return v.is_number();
}
// len(v) and v.__getitem__ both exist.
bool t_sequence(Interpreter&, const Value& v, CallArgs&) {
  // Undefined has __len__ and __getitem__ (which raises, but only when called).
  if (v.is_string() || v.is_dict() || v.is_undefined()) return true;
  if (!v.is_seq()) return false;
  const SeqKind k = v.as_seq().kind;
  return k == SeqKind::kList || k == SeqKind::kTuple || k == SeqKind::kRange;
}
bool t_iterable(Interpreter&, const Value& v, CallArgs&) {
  if (v.is_undefined() || v.is_string() || v.is_seq() || v.is_dict()) return true;
  return v.is_object() && v.as_object().type_name() == "LoopContext";
}
bool t_callable(Interpreter&, const Value& v, CallArgs&) {
  // Undefined has __call__ (which raises when called).
  return v.is_undefined() || (v.is_object() && v.as_object().callable());
}
// `is`: identity. None and the booleans are singletons; CPython caches small ints; containers
// and objects are the same object when they share storage.
bool t_sameas(Interpreter&, const Value& v, CallArgs& a) {
  ArgBinder b("sameas", a, {"other"}, 1);
  const Value& o = b.get(0);
  if (v.kind() != o.kind()) return false;
  switch (v.kind()) {
    case Kind::kNone:
      return true;
    case Kind::kBool:
      return v.as_bool() == o.as_bool();
    case Kind::kInt:
      return v.as_int() == o.as_int() && v.as_int() >= -5 && v.as_int() <= 256;
    case Kind::kString:
      return &v.as_string() == &o.as_string();
    case Kind::kFloat:
    case Kind::kUndefined:
      return false;
    default:
      return v.object_ptr() == o.object_ptr();
  }
}
bool t_escaped(Interpreter&, const Value& v, CallArgs&) {
  return v.is_markup();
}
bool t_in(Interpreter& in, const Value& v, CallArgs& a) {
  ArgBinder b("in", a, {"seq"}, 1);
  return in.contains(b.get(0), v);
}
bool t_filter(Interpreter&, const Value& v, CallArgs&) {
  return v.is_string() && is_known_filter(v.as_string());
}
bool t_test(Interpreter&, const Value& v, CallArgs&) {
  return v.is_string() && is_known_test(v.as_string());
}
template <CmpOp op>
bool t_compare(Interpreter&, const Value& v, CallArgs& a) {
  ArgBinder b("compare", a, {"other"}, 1);
  const Value& o = b.get(0);
  switch (op) {
    case CmpOp::kEq:
      return py_equal(v, o);
    case CmpOp::kNe:
      return !py_equal(v, o);
    case CmpOp::kLt:
      return py_compare(Order::kLt, v, o);
    case CmpOp::kLe:
      return py_compare(Order::kLe, v, o);
    case CmpOp::kGt:
      return py_compare(Order::kGt, v, o);
    case CmpOp::kGe:
      return py_compare(Order::kGe, v, o);
    default:
      return false;
  }
}

const TestTable& tests() {
  static const TestTable table = {
      {"!=", t_compare<CmpOp::kNe>},
      {"<", t_compare<CmpOp::kLt>},
      {"<=", t_compare<CmpOp::kLe>},
      {"==", t_compare<CmpOp::kEq>},
      {">", t_compare<CmpOp::kGt>},
      {">=", t_compare<CmpOp::kGe>},
      {"boolean", t_boolean},
      {"callable", t_callable},
      {"defined", t_defined},
      {"divisibleby", t_divisibleby},
      {"eq", t_compare<CmpOp::kEq>},
      {"equalto", t_compare<CmpOp::kEq>},
      {"escaped", t_escaped},
      {"even", t_even},
      {"false", t_false},
      {"filter", t_filter},
      {"float", t_float},
      {"ge", t_compare<CmpOp::kGe>},
      {"greaterthan", t_compare<CmpOp::kGt>},
      {"gt", t_compare<CmpOp::kGt>},
      {"in", t_in},
      {"integer", t_integer},
      {"iterable", t_iterable},
      {"le", t_compare<CmpOp::kLe>},
      {"lessthan", t_compare<CmpOp::kLt>},
      {"lower", t_lower},
      {"lt", t_compare<CmpOp::kLt>},
      {"mapping", t_mapping},
      {"ne", t_compare<CmpOp::kNe>},
      {"none", t_none},
      {"number", t_number},
      {"odd", t_odd},
      {"sameas", t_sameas},
      {"sequence", t_sequence},
      {"string", t_string},
      {"test", t_test},
      {"true", t_true},
      {"undefined", t_undefined},
      {"upper", t_upper},
  };
  return table;
}

// ---------------------------------------------------------------------------------------------
// Globals

using GlobalFn = Value (*)(Interpreter&, CallArgs&);

class BuiltinFunction final : public HostObject {
 public:
  BuiltinFunction(std::string name, GlobalFn fn) : name_(std::move(name)), fn_(fn) {}
  std::string type_name() const override { return "function"; }
  std::string repr() const override { return "<function " + name_ + ">"; }
  bool callable() const override { return true; }
  Value call(Interpreter& in, CallArgs& args) override { return fn_(in, args); }

 private:
  std::string name_;
  GlobalFn fn_;
};

Value g_range(Interpreter& in, CallArgs& a) {
  if (!a.kwargs.empty()) raise("TypeError", "range() takes no keyword arguments");
  if (a.args.empty() || a.args.size() > 3)
    raise("TypeError", "range expected at most 3 arguments, got " + std::to_string(a.args.size()));
  for (const Value& v : a.args)
    if (!v.is_integral())
      raise("TypeError", "'" + v.type_name() + "' object cannot be interpreted as an integer");
  int64_t start = 0, stop = 0, step = 1;
  if (a.args.size() == 1) {
    stop = a.args[0].as_int();
  } else {
    start = a.args[0].as_int();
    stop = a.args[1].as_int();
    if (a.args.size() == 3) step = a.args[2].as_int();
  }
  if (step == 0) raise("ValueError", "range() arg 3 must not be zero");
  // len(range) without overflow, in 128 bits.
  const __int128 span =
      step > 0 ? static_cast<__int128>(stop) - start : static_cast<__int128>(start) - stop;
  const __int128 abs_step = step > 0 ? step : -static_cast<__int128>(step);
  const __int128 count = span <= 0 ? 0 : (span + abs_step - 1) / abs_step;
  if (count > kMaxRangeItems)
    raise("OverflowError",
          "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  std::vector<Value> items;
  items.reserve(static_cast<size_t>(count));
  for (__int128 i = 0; i < count; ++i)
    items.emplace_back(static_cast<int64_t>(start + i * static_cast<__int128>(step)));
  Value r = in.make_seq(std::move(items), SeqKind::kRange);
  r.as_seq().range_start = start;
  r.as_seq().range_stop = stop;
  r.as_seq().range_step = step;
  return r;
}

// dict(mapping or pairs, **kwargs) and namespace(...) share this.
std::shared_ptr<Dict> dict_from_args(Interpreter& in, CallArgs& a, const char* name) {
  if (a.args.size() > 1)
    raise("TypeError",
          std::string(name) + " expected at most 1 argument, got " + std::to_string(a.args.size()));
  auto d = std::make_shared<Dict>();
  if (!a.args.empty()) {
    const Value& src = a.args[0];
    if (src.is_dict()) {
      *d = src.as_dict();
    } else {
      for (const Value& item : in.iterate(src)) {
        std::vector<Value> kv = in.iterate(item);
        if (kv.size() != 2)
          raise("ValueError", "dictionary update sequence element has length " +
                                  std::to_string(kv.size()) + "; 2 is required");
        d->set(kv[0], kv[1]);
      }
    }
  }
  for (auto& [k, v] : a.kwargs) d->set(Value(k), v);
  return d;
}

Value g_dict(Interpreter& in, CallArgs& a) {
  return in.make_dict(dict_from_args(in, a, "dict"));
}

Value g_namespace(Interpreter& in, CallArgs& a) {
  return in.make_namespace(dict_from_args(in, a, "namespace"));
}

Value g_raise_exception(Interpreter& in, CallArgs& a) {
  ArgBinder b("raise_exception", a, {"message"}, 1);
  raise("TemplateError", in.str(b.get(0)));
}

// transformers' strftime_now(format): datetime.now().strftime(format). Python handles %f, %z
// and %Z itself (a naive datetime has no zone: both are empty) and gives the rest to the C
// library's strftime, as done here.
Value g_strftime_now(Interpreter& in, CallArgs& a) {
  ArgBinder b("strftime_now", a, {"format"}, 1);
  const Value& fmt_v = b.get(0);
  if (!fmt_v.is_string())
    raise("TypeError", "strftime() argument 1 must be str, not " + fmt_v.type_name());
  const LocalTime t = in.now();
  const std::string& fmt = fmt_v.as_string();
  std::string expanded;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] == '%' && i + 1 < fmt.size()) {
      const char c = fmt[i + 1];
      if (c == 'f') {
        char buf[16];
        std::snprintf(buf, sizeof(buf), "%06d", t.microsecond);
        expanded += buf;
        ++i;
        continue;
      }
      if (c == 'z' || c == 'Z') {
        ++i;
        continue;
      }
      expanded += fmt[i];
      expanded += c;
      ++i;
      continue;
    }
    expanded += fmt[i];
  }
  if (expanded.empty()) return Value("");
  in.check_string_size(expanded.size() * 8);
  // strftime gives 0 both for "did not fit" and for an empty result; grow a bounded number of
  // times, then treat the result as empty.
  std::string out(expanded.size() * 4 + 64, '\0');
  for (int attempt = 0; attempt < 6; ++attempt) {
    const size_t n = std::strftime(out.data(), out.size(), expanded.c_str(), &t.tm);
    if (n > 0) {
      out.resize(n);
      return in.make_string(std::move(out));
    }
    in.check_string_size(out.size() * 2);
    out.resize(out.size() * 2);
  }
  return Value("");
}

// jinja2's joiner: "" the first time it is called, the separator after that.
class Joiner final : public HostObject {
 public:
  explicit Joiner(std::string sep) : sep_(std::move(sep)) {}
  std::string type_name() const override { return "Joiner"; }
  std::string module_name() const override { return "jinja2.utils"; }
  std::string repr() const override { return "<jinja2.utils.Joiner object>"; }
  bool callable() const override { return true; }
  Value call(Interpreter&, CallArgs&) override {
    if (!used_) {
      used_ = true;
      return Value("");
    }
    return Value(sep_);
  }

 private:
  std::string sep_;
  bool used_ = false;
};

Value g_joiner(Interpreter& in, CallArgs& a) {
  ArgBinder b("joiner", a, {"sep"});
  return Value::object(std::make_shared<Joiner>(in.str(b.get_or(0, Value(", ")))));
}

// jinja2's Cycler: .next(), .reset(), .current.
class Cycler final : public HostObject, public std::enable_shared_from_this<Cycler> {
 public:
  explicit Cycler(std::vector<Value> items) : items_(std::move(items)) {}
  std::string type_name() const override { return "Cycler"; }
  std::string module_name() const override { return "jinja2.utils"; }
  std::string repr() const override { return "<jinja2.utils.Cycler object>"; }
  std::optional<Value> attribute(std::string_view name) const override;

  std::vector<Value> items_;
  size_t pos_ = 0;
};

class CyclerMethod final : public HostObject {
 public:
  CyclerMethod(std::shared_ptr<Cycler> c, bool next) : c_(std::move(c)), next_(next) {}
  std::string type_name() const override { return "method"; }
  std::string repr() const override {
    return next_ ? "<bound method Cycler.next>" : "<bound method Cycler.reset>";
  }
  bool callable() const override { return true; }
  Value call(Interpreter&, CallArgs&) override {
    if (!next_) {
      c_->pos_ = 0;
      return Value::none();
    }
    const Value v = c_->items_[c_->pos_];
    c_->pos_ = (c_->pos_ + 1) % c_->items_.size();
    return v;
  }

 private:
  std::shared_ptr<Cycler> c_;
  bool next_;
};

std::optional<Value> Cycler::attribute(std::string_view name) const {
  auto self = std::const_pointer_cast<Cycler>(shared_from_this());
  if (name == "current") return items_[pos_];
  if (name == "next" || name == "__next__")
    return Value::object(std::make_shared<CyclerMethod>(self, true));
  if (name == "reset") return Value::object(std::make_shared<CyclerMethod>(self, false));
  return std::nullopt;
}

Value g_cycler(Interpreter&, CallArgs& a) {
  if (!a.kwargs.empty()) raise("TypeError", "cycler() takes no keyword arguments");
  if (a.args.empty()) raise("RuntimeError", "at least one item has to be provided");
  return Value::object(std::make_shared<Cycler>(a.args));
}

}  // namespace

bool is_known_filter(std::string_view name) {
  return find_filter(name) != nullptr;
}
bool is_known_test(std::string_view name) {
  return find_test(name) != nullptr;
}

FilterFn find_filter(std::string_view name) {
  for (const auto& [n, fn] : filters())
    if (n == name) return fn;
  return nullptr;
}

TestFn find_test(std::string_view name) {
  for (const auto& [n, fn] : tests())
    if (n == name) return fn;
  return nullptr;
}

std::optional<Value> find_global(std::string_view name) {
  // Immutable function objects, shared by every render (and every thread).
  static const std::vector<std::pair<std::string_view, Value>> globals = [] {
    std::vector<std::pair<std::string_view, Value>> g;
    auto add = [&](std::string_view n, GlobalFn fn) {
      g.emplace_back(n, Value::object(std::make_shared<BuiltinFunction>(std::string(n), fn)));
    };
    add("range", g_range);
    add("dict", g_dict);
    add("namespace", g_namespace);
    add("raise_exception", g_raise_exception);
    add("strftime_now", g_strftime_now);
    add("joiner", g_joiner);
    add("cycler", g_cycler);
    return g;
  }();
  for (const auto& [n, v] : globals)
    if (n == name) return v;
  return std::nullopt;
}

}  // namespace tandem::jinja
