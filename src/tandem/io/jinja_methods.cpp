// Python attributes of builtin values as a sandboxed jinja2 template sees them: str methods
// (startswith, split, strip, replace, format, ...), dict.get/items/keys/values, list.count and
// list.index, range.start, int.real, ... Methods that mutate a list or dict exist (so that
// jinja2's getattr does not fall back to an item of that name) but are the sandbox's unsafe
// Undefined: calling them raises SecurityError, as ImmutableSandboxedEnvironment does.
// Also Python's printf-style `str % args` and str.format.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "tandem/io/jinja_interpreter.h"
#include "tandem/io/jinja_unicode.h"
#include "tandem/io/utf8.h"

namespace tandem::jinja {
namespace {

using MethodFn = Value (*)(Interpreter&, const Value& self, CallArgs& args);

[[noreturn]] void not_supported(const Value& self, std::string_view name) {
  raise("TemplateRuntimeError", self.type_name() + "." + std::string(name) +
                                    "() is not supported by tandem's Jinja interpreter");
}

// Methods Python has that tandem does not implement (str.encode, ...): they exist, so that
// attribute lookup behaves as in Python, and raise when called (BoundMethod names them).
Value m_unsupported(Interpreter&, const Value&, CallArgs&) {
  raise("TemplateRuntimeError", "this method is not supported by tandem's Jinja interpreter");
}

// markupsafe.Markup wraps the str methods that return text (and the text in lists and tuples
// they return: split, partition) back into Markup. (It also escapes their str arguments, which
// tandem does not do; templates call methods on |safe results rarely.)
Value to_markup(Interpreter& in, Value v) {
  if (v.is_string() && !v.is_markup()) return in.make_markup(v.as_string());
  if (v.is_seq(SeqKind::kList) || v.is_seq(SeqKind::kTuple)) {
    bool any = false;
    for (const Value& x : v.as_seq().items) any |= x.is_string() && !x.is_markup();
    if (!any) return v;
    std::vector<Value> items = v.as_seq().items;
    for (Value& x : items)
      if (x.is_string() && !x.is_markup()) x = Value::markup(x.as_string());
    return in.make_seq(std::move(items), v.as_seq().kind);
  }
  return v;
}

class BoundMethod final : public HostObject {
 public:
  BoundMethod(Value self, std::string_view name, MethodFn fn)
      : self_(std::move(self)), name_(name), fn_(fn) {}
  std::string type_name() const override { return "builtin_function_or_method"; }
  std::string repr() const override {
    return "<built-in method " + name_ + " of " + self_.type_name() + " object>";
  }
  bool callable() const override { return true; }
  Value call(Interpreter& in, CallArgs& args) override {
    // String methods decode or scan their string; list and dict methods that walk charge
    // through iterate() and make_seq().
    if (self_.is_string()) in.charge_bytes(self_.as_string().size());
    if (fn_ == m_unsupported) not_supported(self_, name_);
    Value result = fn_(in, self_, args);
    if (self_.is_markup()) result = to_markup(in, std::move(result));
    return result;
  }

 private:
  Value self_;
  std::string name_;
  MethodFn fn_;
};

// A str argument, or TypeError "<what> not <type>" (what: "must be str," as Python says).
const std::string& str_arg(const Value& v, std::string_view what) {
  if (!v.is_string()) raise("TypeError", std::string(what) + " not " + v.type_name());
  return v.as_string();
}

// Code point range [start, end) of Python's str.find(sub, start, end) arguments.
void cp_range(const Value& start, const Value& end, size_t n, size_t& b, size_t& e) {
  auto idx = [&](const Value& v, int64_t dflt) -> int64_t {
    if (v.is_none() || v.is_undefined()) return dflt;
    if (!v.is_integral())
      raise("TypeError", "slice indices must be integers or None or have an __index__ method");
    int64_t x = v.as_int();
    if (x < 0) x = std::max<int64_t>(0, x + static_cast<int64_t>(n));
    return std::min<int64_t>(x, static_cast<int64_t>(n));
  };
  b = static_cast<size_t>(idx(start, 0));
  e = static_cast<size_t>(idx(end, static_cast<int64_t>(n)));
}

size_t u32_find(const std::u32string& hay, const std::u32string& needle, size_t from, size_t to) {
  return unicode::find_substring<char32_t>(hay, needle, from, to);
}

size_t u32_rfind(const std::u32string& hay, const std::u32string& needle, size_t from, size_t to) {
  return unicode::rfind_substring<char32_t>(hay, needle, from, to);
}

// ---------------------------------------------------------------------------------------------
// str methods

Value m_find_like(Interpreter&, const Value& self, CallArgs& a, const char* name, bool reverse,
                  bool raise_missing) {
  ArgBinder b(name, a, {"sub", "start", "end"}, 1);
  const std::u32string hay = unicode::decode(self.as_string());
  const std::u32string needle = unicode::decode(str_arg(b.get(0), "must be str,"));
  size_t s = 0, e = 0;
  cp_range(b.get_or(1, Value::none()), b.get_or(2, Value::none()), hay.size(), s, e);
  const size_t pos = reverse ? u32_rfind(hay, needle, s, e) : u32_find(hay, needle, s, e);
  if (pos == std::u32string::npos) {
    if (raise_missing) raise("ValueError", "substring not found");
    return Value(static_cast<int64_t>(-1));
  }
  return Value(static_cast<int64_t>(pos));
}

Value m_find(Interpreter& in, const Value& s, CallArgs& a) {
  return m_find_like(in, s, a, "find", false, false);
}
Value m_rfind(Interpreter& in, const Value& s, CallArgs& a) {
  return m_find_like(in, s, a, "rfind", true, false);
}
Value m_index(Interpreter& in, const Value& s, CallArgs& a) {
  return m_find_like(in, s, a, "index", false, true);
}
Value m_rindex(Interpreter& in, const Value& s, CallArgs& a) {
  return m_find_like(in, s, a, "rindex", true, true);
}

Value m_count(Interpreter&, const Value& self, CallArgs& a) {
  ArgBinder b("count", a, {"sub", "start", "end"}, 1);
  const std::u32string hay = unicode::decode(self.as_string());
  const std::u32string needle = unicode::decode(str_arg(b.get(0), "must be str,"));
  size_t s = 0, e = 0;
  cp_range(b.get_or(1, Value::none()), b.get_or(2, Value::none()), hay.size(), s, e);
  if (s > e) return Value(static_cast<int64_t>(0));
  if (needle.empty()) return Value(static_cast<int64_t>(e - s + 1));
  int64_t n = 0;
  size_t i = s;
  while ((i = u32_find(hay, needle, i, e)) != std::u32string::npos) {
    ++n;
    i += needle.size();
  }
  return Value(n);
}

Value starts_ends(Interpreter&, const Value& self, CallArgs& a, bool ends) {
  const char* name = ends ? "endswith" : "startswith";
  ArgBinder b(name, a, {"prefix", "start", "end"}, 1);
  const std::u32string hay = unicode::decode(self.as_string());
  size_t s = 0, e = 0;
  cp_range(b.get_or(1, Value::none()), b.get_or(2, Value::none()), hay.size(), s, e);
  std::vector<Value> options;
  const Value& p = b.get(0);
  if (p.is_string()) {
    options.push_back(p);
  } else if (p.is_seq(SeqKind::kTuple)) {
    for (const Value& o : p.as_seq().items) {
      if (!o.is_string())
        raise("TypeError",
              std::string("tuple for ") + name + " must only contain str, not " + o.type_name());
      options.push_back(o);
    }
  } else {
    raise("TypeError",
          std::string(name) + " first arg must be str or a tuple of str, not " + p.type_name());
  }
  for (const Value& o : options) {
    const std::u32string x = unicode::decode(o.as_string());
    if (s > e || e - s < x.size()) {
      // Python: an empty prefix still matches when start <= len.
      if (x.empty() && s <= hay.size() && s <= e) return Value(true);
      continue;
    }
    const size_t at = ends ? e - x.size() : s;
    if (hay.compare(at, x.size(), x) == 0) return Value(true);
  }
  return Value(false);
}

Value m_startswith(Interpreter& in, const Value& s, CallArgs& a) {
  return starts_ends(in, s, a, false);
}
Value m_endswith(Interpreter& in, const Value& s, CallArgs& a) {
  return starts_ends(in, s, a, true);
}

Value strip_like(Interpreter& in, const Value& self, CallArgs& a, const char* name, bool left,
                 bool right) {
  ArgBinder b(name, a, {"chars"});
  const Value chars = b.get_or(0, Value::none());
  std::u32string set;
  const bool whitespace = chars.is_none();
  if (!whitespace) {
    if (!chars.is_string()) raise("TypeError", std::string(name) + " arg must be None or str");
    set = unicode::decode(chars.as_string());
  }
  const std::u32string cps = unicode::decode(self.as_string());
  auto drop = [&](char32_t c) {
    return whitespace ? unicode::is_space(c) : set.find(c) != std::u32string::npos;
  };
  size_t s = 0, e = cps.size();
  if (left)
    while (s < e && drop(cps[s])) ++s;
  if (right)
    while (e > s && drop(cps[e - 1])) --e;
  std::string out = unicode::encode(std::u32string_view(cps).substr(s, e - s));
  return self.is_markup() ? in.make_markup(std::move(out)) : in.make_string(std::move(out));
}

Value m_strip(Interpreter& in, const Value& s, CallArgs& a) {
  return strip_like(in, s, a, "strip", true, true);
}
Value m_lstrip(Interpreter& in, const Value& s, CallArgs& a) {
  return strip_like(in, s, a, "lstrip", true, false);
}
Value m_rstrip(Interpreter& in, const Value& s, CallArgs& a) {
  return strip_like(in, s, a, "rstrip", false, true);
}

// str.split / str.rsplit, with Python's whitespace mode when sep is None.
Value split_like(Interpreter& in, const Value& self, CallArgs& a, bool reverse) {
  ArgBinder b(reverse ? "rsplit" : "split", a, {"sep", "maxsplit"});
  const Value sep_v = b.get_or(0, Value::none());
  const Value max_v = b.get_or(1, Value(-1));
  if (!max_v.is_integral())
    raise("TypeError", "'" + max_v.type_name() + "' object cannot be interpreted as an integer");
  int64_t maxsplit = max_v.as_int();
  if (maxsplit < 0) maxsplit = std::numeric_limits<int64_t>::max();
  const std::u32string s = unicode::decode(self.as_string());
  std::vector<std::u32string> parts;
  if (sep_v.is_none()) {
    // Runs of whitespace separate; leading/trailing whitespace yields no empty parts.
    if (!reverse) {
      size_t i = 0;
      while (true) {
        while (i < s.size() && unicode::is_space(s[i])) ++i;
        if (i >= s.size()) break;
        if (static_cast<int64_t>(parts.size()) == maxsplit) {
          size_t e = s.size();
          while (e > i && unicode::is_space(s[e - 1])) --e;
          parts.push_back(s.substr(i, e - i));
          break;
        }
        size_t j = i;
        while (j < s.size() && !unicode::is_space(s[j])) ++j;
        parts.push_back(s.substr(i, j - i));
        i = j;
      }
    } else {
      size_t i = s.size();
      while (true) {
        while (i > 0 && unicode::is_space(s[i - 1])) --i;
        if (i == 0) break;
        if (static_cast<int64_t>(parts.size()) == maxsplit) {
          size_t b0 = 0;
          while (b0 < i && unicode::is_space(s[b0])) ++b0;
          parts.push_back(s.substr(b0, i - b0));
          break;
        }
        size_t j = i;
        while (j > 0 && !unicode::is_space(s[j - 1])) --j;
        parts.push_back(s.substr(j, i - j));
        i = j;
      }
      std::reverse(parts.begin(), parts.end());
    }
  } else {
    if (!sep_v.is_string()) raise("TypeError", "must be str or None, not " + sep_v.type_name());
    const std::u32string sep = unicode::decode(sep_v.as_string());
    if (sep.empty()) raise("ValueError", "empty separator");
    in.charge_bytes(s.size());
    if (!reverse) {
      size_t i = 0;
      while (static_cast<int64_t>(parts.size()) < maxsplit) {
        const size_t j = u32_find(s, sep, i, s.size());
        if (j == std::u32string::npos) break;
        parts.push_back(s.substr(i, j - i));
        i = j + sep.size();
      }
      parts.push_back(s.substr(i));
    } else {
      // Split the reversed text by the reversed separator, then reverse back: one linear pass.
      const std::u32string rs(s.rbegin(), s.rend());
      const std::u32string rsep(sep.rbegin(), sep.rend());
      size_t i = 0;
      while (static_cast<int64_t>(parts.size()) < maxsplit) {
        const size_t j = u32_find(rs, rsep, i, rs.size());
        if (j == std::u32string::npos) break;
        parts.push_back(rs.substr(i, j - i));
        i = j + rsep.size();
      }
      parts.push_back(rs.substr(i));
      for (auto& p : parts) std::reverse(p.begin(), p.end());
      std::reverse(parts.begin(), parts.end());
    }
  }
  std::vector<Value> out;
  out.reserve(parts.size());
  for (const auto& p : parts) out.emplace_back(unicode::encode(p));
  return in.make_seq(std::move(out));
}

Value m_split(Interpreter& in, const Value& s, CallArgs& a) {
  return split_like(in, s, a, false);
}
Value m_rsplit(Interpreter& in, const Value& s, CallArgs& a) {
  return split_like(in, s, a, true);
}

Value m_splitlines(Interpreter& in, const Value& self, CallArgs& a) {
  ArgBinder b("splitlines", a, {"keepends"});
  const bool keep = b.get_or(0, Value(false)).truthy();
  const std::u32string s = unicode::decode(self.as_string());
  std::vector<Value> out;
  size_t start = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (!unicode::is_line_break(s[i])) continue;
    size_t end = i + 1;
    if (s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n') end = i + 2;
    out.emplace_back(unicode::encode(s.substr(start, (keep ? end : i) - start)));
    start = end;
    i = end - 1;
  }
  if (start < s.size()) out.emplace_back(unicode::encode(s.substr(start)));
  return in.make_seq(std::move(out));
}

Value m_replace(Interpreter& in, const Value& self, CallArgs& a) {
  ArgBinder b("replace", a, {"old", "new", "count"}, 2);
  const std::string& old_s = str_arg(b.get(0), "replace() argument 1 must be str,");
  const std::string& new_s = str_arg(b.get(1), "replace() argument 2 must be str,");
  const Value count_v = b.get_or(2, Value(-1));
  if (!count_v.is_integral())
    raise("TypeError", "'" + count_v.type_name() + "' object cannot be interpreted as an integer");
  int64_t count = count_v.as_int();
  if (count < 0) count = std::numeric_limits<int64_t>::max();
  const std::string& s = self.as_string();
  std::string out;
  auto add = [&](std::string_view part) {
    in.check_string_size(out.size() + part.size());
    out.append(part);
  };
  if (old_s.empty()) {
    // An empty pattern matches before every code point and at the end.
    const std::u32string cps = unicode::decode(s);
    int64_t done = 0;
    for (char32_t c : cps) {
      if (done < count) {
        add(new_s);
        ++done;
      }
      std::string one;
      unicode::append(c, one);
      add(one);
    }
    if (done < count) add(new_s);
  } else {
    size_t i = 0;
    int64_t done = 0;
    while (done < count) {
      const size_t j = unicode::find_substring<char>(s, old_s, i);
      if (j == std::string::npos) break;
      add(std::string_view(s).substr(i, j - i));
      add(new_s);
      i = j + old_s.size();
      ++done;
    }
    add(std::string_view(s).substr(i));
  }
  return self.is_markup() ? in.make_markup(std::move(out)) : in.make_string(std::move(out));
}

Value m_join(Interpreter& in, const Value& self, CallArgs& a) {
  ArgBinder b("join", a, {"iterable"}, 1);
  std::vector<Value> items = in.iterate(b.get(0));
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].is_string())
      raise("TypeError", "sequence item " + std::to_string(i) + ": expected str instance, " +
                             items[i].type_name() + " found");
    in.check_string_size(out.size() + self.as_string().size() + items[i].as_string().size());
    if (i) out += self.as_string();
    out += items[i].as_string();
  }
  return in.make_string(std::move(out));
}

template <std::string (*F)(std::string_view)>
Value case_method(Interpreter& in, const Value& self, CallArgs& a) {
  no_args("method", a);
  return in.make_string(F(self.as_string()));
}

template <bool (*P)(char32_t)>
Value char_predicate(Interpreter&, const Value& self, CallArgs& a) {
  no_args("method", a);
  const std::u32string cps = unicode::decode(self.as_string());
  if (cps.empty()) return Value(false);
  return Value(std::all_of(cps.begin(), cps.end(), P));
}

Value m_isascii(Interpreter&, const Value& self, CallArgs& a) {
  no_args("isascii", a);
  return Value(unicode::is_ascii(self.as_string()));
}
Value m_isprintable(Interpreter&, const Value& self, CallArgs& a) {
  no_args("isprintable", a);
  for (char32_t c : unicode::decode(self.as_string()))
    if (!unicode::is_printable(c)) return Value(false);
  return Value(true);
}
Value m_islower(Interpreter&, const Value& self, CallArgs& a) {
  no_args("islower", a);
  return Value(unicode::str_is_lower(self.as_string()));
}
Value m_isupper(Interpreter&, const Value& self, CallArgs& a) {
  no_args("isupper", a);
  return Value(unicode::str_is_upper(self.as_string()));
}
Value m_istitle(Interpreter&, const Value& self, CallArgs& a) {
  no_args("istitle", a);
  return Value(unicode::str_is_title(self.as_string()));
}
Value m_isidentifier(Interpreter&, const Value& self, CallArgs& a) {
  no_args("isidentifier", a);
  const std::u32string cps = unicode::decode(self.as_string());
  if (cps.empty() || !(cps[0] == '_' || unicode::is_alpha(cps[0]))) return Value(false);
  return Value(std::all_of(cps.begin(), cps.end(),
                           [](char32_t c) { return c == '_' || unicode::is_alnum(c); }));
}

Value pad_method(Interpreter& in, const Value& self, CallArgs& a, const char* name, char how) {
  ArgBinder b(name, a, {"width", "fillchar"}, 1);
  if (!b.get(0).is_integral())
    raise("TypeError", "'" + b.get(0).type_name() + "' object cannot be interpreted as an integer");
  const Value fill_v = b.get_or(1, Value(" "));
  if (!fill_v.is_string() || unicode::length(fill_v.as_string()) != 1)
    raise("TypeError", "The fill character must be exactly one character long");
  const std::string& s = self.as_string();
  const auto len = static_cast<int64_t>(unicode::length(s));
  const int64_t width = b.get(0).as_int();
  if (width <= len) return self;
  const int64_t marg = width - len;
  if (static_cast<uint64_t>(marg) > in.options().limits.max_output_bytes)
    in.check_string_size(in.options().limits.max_output_bytes + 1);
  in.check_string_size(s.size() + static_cast<size_t>(marg) * fill_v.as_string().size());
  int64_t left = how == 'c' ? marg / 2 + (marg & width & 1) : how == 'r' ? marg : 0;
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill_v.as_string();
  out += s;
  for (int64_t i = left; i < marg; ++i) out += fill_v.as_string();
  return in.make_string(std::move(out));
}

Value m_center(Interpreter& in, const Value& s, CallArgs& a) {
  return pad_method(in, s, a, "center", 'c');
}
Value m_ljust(Interpreter& in, const Value& s, CallArgs& a) {
  return pad_method(in, s, a, "ljust", 'l');
}
Value m_rjust(Interpreter& in, const Value& s, CallArgs& a) {
  return pad_method(in, s, a, "rjust", 'r');
}

Value m_zfill(Interpreter& in, const Value& self, CallArgs& a) {
  ArgBinder b("zfill", a, {"width"}, 1);
  if (!b.get(0).is_integral())
    raise("TypeError", "'" + b.get(0).type_name() + "' object cannot be interpreted as an integer");
  const std::string& s = self.as_string();
  const auto len = static_cast<int64_t>(unicode::length(s));
  const int64_t width = b.get(0).as_int();
  if (width <= len) return self;
  in.check_string_size(s.size() + static_cast<size_t>(width - len));
  std::string zeros(static_cast<size_t>(width - len), '0');
  if (!s.empty() && (s[0] == '+' || s[0] == '-'))
    return in.make_string(s.substr(0, 1) + zeros + s.substr(1));
  return in.make_string(zeros + s);
}

Value partition_like(Interpreter& in, const Value& self, CallArgs& a, bool reverse) {
  ArgBinder b(reverse ? "rpartition" : "partition", a, {"sep"}, 1);
  const std::string& sep = str_arg(b.get(0), "must be str,");
  if (sep.empty()) raise("ValueError", "empty separator");
  const std::string& s = self.as_string();
  const size_t j =
      reverse ? unicode::rfind_substring<char>(s, sep) : unicode::find_substring<char>(s, sep);
  if (j == std::string::npos) {
    if (reverse) return in.make_seq({Value(""), Value(""), self}, SeqKind::kTuple);
    return in.make_seq({self, Value(""), Value("")}, SeqKind::kTuple);
  }
  return in.make_seq({Value(s.substr(0, j)), Value(sep), Value(s.substr(j + sep.size()))},
                     SeqKind::kTuple);
}

Value m_partition(Interpreter& in, const Value& s, CallArgs& a) {
  return partition_like(in, s, a, false);
}
Value m_rpartition(Interpreter& in, const Value& s, CallArgs& a) {
  return partition_like(in, s, a, true);
}

Value m_removeprefix(Interpreter& in, const Value& self, CallArgs& a) {
  ArgBinder b("removeprefix", a, {"prefix"}, 1);
  const std::string& p = str_arg(b.get(0), "removeprefix() argument must be str,");
  const std::string& s = self.as_string();
  if (s.compare(0, p.size(), p) == 0) return in.make_string(s.substr(p.size()));
  return self;
}

Value m_removesuffix(Interpreter& in, const Value& self, CallArgs& a) {
  ArgBinder b("removesuffix", a, {"suffix"}, 1);
  const std::string& p = str_arg(b.get(0), "removesuffix() argument must be str,");
  const std::string& s = self.as_string();
  if (!p.empty() && s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0)
    return in.make_string(s.substr(0, s.size() - p.size()));
  return self;
}

Value m_expandtabs(Interpreter& in, const Value& self, CallArgs& a) {
  ArgBinder b("expandtabs", a, {"tabsize"});
  const Value t = b.get_or(0, Value(8));
  if (!t.is_integral())
    raise("TypeError", "'" + t.type_name() + "' object cannot be interpreted as an integer");
  const int64_t tab = t.as_int();
  std::string out;
  int64_t col = 0;
  for (char32_t c : unicode::decode(self.as_string())) {
    if (c == '\t') {
      if (tab > 0) {
        const int64_t n = tab - col % tab;
        in.check_string_size(out.size() + static_cast<size_t>(n));
        out.append(static_cast<size_t>(n), ' ');
        col += n;
      }
    } else {
      unicode::append(c, out);
      col = (c == '\n' || c == '\r') ? 0 : col + 1;
    }
  }
  return in.make_string(std::move(out));
}

Value m_format(Interpreter& in, const Value& self, CallArgs& a);

struct MethodEntry {
  std::string_view name;
  MethodFn fn;
};

// Every attribute of Python 3.11's str (those tandem does not implement raise when called).
const MethodEntry kStrMethods[] = {
    {"capitalize", case_method<unicode::capitalize>},
    {"casefold", case_method<unicode::casefold>},
    {"center", m_center},
    {"count", m_count},
    {"encode", m_unsupported},
    {"endswith", m_endswith},
    {"expandtabs", m_expandtabs},
    {"find", m_find},
    {"format", m_format},
    {"format_map", m_unsupported},
    {"index", m_index},
    {"isalnum", char_predicate<unicode::is_alnum>},
    {"isalpha", char_predicate<unicode::is_alpha>},
    {"isascii", m_isascii},
    {"isdecimal", char_predicate<unicode::is_decimal>},
    {"isdigit", char_predicate<unicode::is_digit>},
    {"isidentifier", m_isidentifier},
    {"islower", m_islower},
    {"isnumeric", char_predicate<unicode::is_numeric>},
    {"isprintable", m_isprintable},
    {"isspace", char_predicate<unicode::is_space>},
    {"istitle", m_istitle},
    {"isupper", m_isupper},
    {"join", m_join},
    {"ljust", m_ljust},
    {"lower", case_method<unicode::lower>},
    {"lstrip", m_lstrip},
    {"maketrans", m_unsupported},
    {"partition", m_partition},
    {"removeprefix", m_removeprefix},
    {"removesuffix", m_removesuffix},
    {"replace", m_replace},
    {"rfind", m_rfind},
    {"rindex", m_rindex},
    {"rjust", m_rjust},
    {"rpartition", m_rpartition},
    {"rsplit", m_rsplit},
    {"rstrip", m_rstrip},
    {"split", m_split},
    {"splitlines", m_splitlines},
    {"startswith", m_startswith},
    {"strip", m_strip},
    {"swapcase", case_method<unicode::swapcase>},
    {"title", case_method<unicode::title>},
    {"translate", m_unsupported},
    {"upper", case_method<unicode::upper>},
    {"zfill", m_zfill},
};

// ---------------------------------------------------------------------------------------------
// dict, list, tuple, range, number attributes

Value m_dict_get(Interpreter&, const Value& self, CallArgs& a) {
  ArgBinder b("get", a, {"key", "default"}, 1);
  require_hashable(b.get(0));
  if (const Value* v = self.as_dict().find(b.get(0))) return *v;
  return b.get_or(1, Value::none());
}

Value dict_view(Interpreter& in, const Value& self, CallArgs& a, SeqKind kind) {
  no_args("view", a);
  std::vector<Value> items;
  items.reserve(self.as_dict().size());
  for (const auto& [k, v] : self.as_dict().entries) {
    if (kind == SeqKind::kDictKeys)
      items.push_back(k);
    else if (kind == SeqKind::kDictValues)
      items.push_back(v);
    else
      items.push_back(Value::tuple({k, v}));
  }
  return in.make_seq(std::move(items), kind);
}

Value m_dict_items(Interpreter& in, const Value& s, CallArgs& a) {
  return dict_view(in, s, a, SeqKind::kDictItems);
}
Value m_dict_keys(Interpreter& in, const Value& s, CallArgs& a) {
  return dict_view(in, s, a, SeqKind::kDictKeys);
}
Value m_dict_values(Interpreter& in, const Value& s, CallArgs& a) {
  return dict_view(in, s, a, SeqKind::kDictValues);
}

Value m_dict_copy(Interpreter& in, const Value& self, CallArgs& a) {
  no_args("copy", a);
  return in.make_dict(std::make_shared<Dict>(self.as_dict()));
}

Value m_dict_fromkeys(Interpreter& in, const Value&, CallArgs& a) {
  ArgBinder b("fromkeys", a, {"iterable", "value"}, 1);
  auto d = std::make_shared<Dict>();
  const Value v = b.get_or(1, Value::none());
  for (const Value& k : in.iterate(b.get(0))) d->set(k, v);
  return in.make_dict(std::move(d));
}

Value m_seq_count(Interpreter& in, const Value& self, CallArgs& a) {
  ArgBinder b("count", a, {"value"}, 1);
  int64_t n = 0;
  in.step(self.as_seq().items.size() / 8);
  for (const Value& x : self.as_seq().items) n += py_equal(x, b.get(0));
  return Value(n);
}

Value m_seq_index(Interpreter& in, const Value& self, CallArgs& a) {
  ArgBinder b("index", a, {"value", "start", "stop"}, 1);
  const auto& items = self.as_seq().items;
  size_t s = 0, e = 0;
  cp_range(b.get_or(1, Value::none()), b.get_or(2, Value::none()), items.size(), s, e);
  in.step(items.size() / 8);
  for (size_t i = s; i < e && i < items.size(); ++i)
    if (py_equal(items[i], b.get(0))) return Value(static_cast<int64_t>(i));
  if (self.is_seq(SeqKind::kList)) raise("ValueError", in.repr(b.get(0)) + " is not in list");
  if (self.is_seq(SeqKind::kRange)) raise("ValueError", in.repr(b.get(0)) + " is not in range");
  raise("ValueError", "tuple.index(x): x not in tuple");
}

Value m_list_copy(Interpreter& in, const Value& self, CallArgs& a) {
  no_args("copy", a);
  return in.make_seq(self.as_seq().items);
}

Value m_int_bit_length(Interpreter&, const Value& self, CallArgs& a) {
  no_args("bit_length", a);
  const int64_t v = self.as_int();
  uint64_t u = v < 0 ? static_cast<uint64_t>(-(v + 1)) + 1 : static_cast<uint64_t>(v);
  int64_t n = 0;
  while (u) {
    ++n;
    u >>= 1;
  }
  return Value(n);
}

Value m_int_bit_count(Interpreter&, const Value& self, CallArgs& a) {
  no_args("bit_count", a);
  const int64_t v = self.as_int();
  const uint64_t u = v < 0 ? static_cast<uint64_t>(-(v + 1)) + 1 : static_cast<uint64_t>(v);
  return Value(static_cast<int64_t>(__builtin_popcountll(u)));
}

Value m_num_conjugate(Interpreter&, const Value& self, CallArgs& a) {
  no_args("conjugate", a);
  if (self.is_float()) return Value(self.as_double());
  return Value(self.as_int());
}

Value m_int_ratio(Interpreter& in, const Value& self, CallArgs& a) {
  no_args("as_integer_ratio", a);
  return in.make_seq({Value(self.as_int()), Value(1)}, SeqKind::kTuple);
}

Value m_float_is_integer(Interpreter&, const Value& self, CallArgs& a) {
  no_args("is_integer", a);
  const double f = self.as_double();
  return Value(std::isfinite(f) && f == std::floor(f));
}

std::optional<Value> bound(const Value& self, std::string_view name, const MethodEntry* begin,
                           const MethodEntry* end) {
  for (const MethodEntry* m = begin; m != end; ++m)
    if (m->name == name) return Value::object(std::make_shared<BoundMethod>(self, name, m->fn));
  return std::nullopt;
}

template <size_t N>
std::optional<Value> bound(const Value& self, std::string_view name,
                           const MethodEntry (&table)[N]) {
  return bound(self, name, table, table + N);
}

bool one_of(std::string_view name, std::initializer_list<std::string_view> names) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

const MethodEntry kDictMethods[] = {
    {"copy", m_dict_copy},   {"fromkeys", m_dict_fromkeys}, {"get", m_dict_get},
    {"items", m_dict_items}, {"keys", m_dict_keys},         {"values", m_dict_values},
};
const MethodEntry kListMethods[] = {
    {"copy", m_list_copy}, {"count", m_seq_count}, {"index", m_seq_index}};
const MethodEntry kTupleMethods[] = {{"count", m_seq_count}, {"index", m_seq_index}};
const MethodEntry kIntMethods[] = {
    {"as_integer_ratio", m_int_ratio}, {"bit_count", m_int_bit_count},
    {"bit_length", m_int_bit_length},  {"conjugate", m_num_conjugate},
    {"from_bytes", m_unsupported},     {"to_bytes", m_unsupported},
};
const MethodEntry kFloatMethods[] = {
    {"as_integer_ratio", m_unsupported}, {"conjugate", m_num_conjugate},
    {"fromhex", m_unsupported},          {"hex", m_unsupported},
    {"is_integer", m_float_is_integer},
};
const MethodEntry kGeneratorMethods[] = {
    {"close", m_unsupported}, {"send", m_unsupported}, {"throw", m_unsupported}};
const MethodEntry kViewMethods[] = {{"isdisjoint", m_unsupported}};

}  // namespace

std::optional<Value> builtin_attribute(const Value& obj, std::string_view name) {
  switch (obj.kind()) {
    case Kind::kString:
      return bound(obj, name, kStrMethods);
    case Kind::kDict:
      if (one_of(name, {"clear", "pop", "popitem", "setdefault", "update"}))
        return unsafe_undefined(obj, name);
      return bound(obj, name, kDictMethods);
    case Kind::kSeq:
      switch (obj.as_seq().kind) {
        case SeqKind::kList:
          if (one_of(name,
                     {"append", "clear", "extend", "insert", "pop", "remove", "reverse", "sort"}))
            return unsafe_undefined(obj, name);
          return bound(obj, name, kListMethods);
        case SeqKind::kTuple:
          if (!obj.as_seq().field_names.empty()) {
            const auto& f = obj.as_seq().field_names;
            for (size_t i = 0; i < f.size() && i < obj.as_seq().items.size(); ++i)
              if (f[i] == name) return obj.as_seq().items[i];
          }
          return bound(obj, name, kTupleMethods);
        case SeqKind::kRange:
          if (name == "start") return Value(obj.as_seq().range_start);
          if (name == "stop") return Value(obj.as_seq().range_stop);
          if (name == "step") return Value(obj.as_seq().range_step);
          return bound(obj, name, kTupleMethods);
        case SeqKind::kGenerator:
          return bound(obj, name, kGeneratorMethods);
        case SeqKind::kDictKeys:
        case SeqKind::kDictItems:
          return bound(obj, name, kViewMethods);
        case SeqKind::kDictValues:
          return std::nullopt;
      }
      return std::nullopt;
    case Kind::kBool:
    case Kind::kInt:
      if (name == "real" || name == "numerator") return Value(obj.as_int());
      if (name == "imag") return Value(static_cast<int64_t>(0));
      if (name == "denominator") return Value(static_cast<int64_t>(1));
      return bound(obj, name, kIntMethods);
    case Kind::kFloat:
      if (name == "real") return Value(obj.as_double());
      if (name == "imag") return Value(0.0);
      return bound(obj, name, kFloatMethods);
    default:
      return std::nullopt;
  }
}

// ---------------------------------------------------------------------------------------------
// printf-style formatting: format % args

namespace {

// ascii(x): repr with every non-ASCII character escaped.
std::string ascii_repr(Interpreter& in, const Value& v) {
  const std::string r = in.repr(v);
  std::string out;
  for (char32_t c : unicode::decode(r)) {
    char buf[16];
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      continue;
    }
    if (c <= 0xFF)
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
    else if (c <= 0xFFFF)
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
    else
      std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
    out += buf;
  }
  return out;
}

struct Spec {
  bool left = false, plus = false, space = false, alt = false, zero = false;
  int64_t width = -1, precision = -1;
};

std::string pad_to_width(std::string body, const Spec& sp, bool numeric) {
  const auto len = static_cast<int64_t>(unicode::length(body));
  if (sp.width <= len) return body;
  const size_t n = static_cast<size_t>(sp.width - len);
  if (sp.left) return body + std::string(n, ' ');
  if (numeric && sp.zero) {
    size_t sign = 0;
    if (!body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ')) sign = 1;
    if (body.size() >= sign + 2 && body[sign] == '0' &&
        (body[sign + 1] == 'x' || body[sign + 1] == 'X' || body[sign + 1] == 'o'))
      sign += 2;
    return body.substr(0, sign) + std::string(n, '0') + body.substr(sign);
  }
  return std::string(n, ' ') + body;
}

std::string format_integer(int64_t v, char type, const Spec& sp) {
  const bool neg = v < 0;
  uint64_t u = neg ? static_cast<uint64_t>(-(v + 1)) + 1 : static_cast<uint64_t>(v);
  std::string digits;
  const int base = type == 'x' || type == 'X' ? 16 : type == 'o' ? 8 : 10;
  const char* set = type == 'X' ? "0123456789ABCDEF" : "0123456789abcdef";
  do {
    digits.push_back(set[u % static_cast<uint64_t>(base)]);
    u /= static_cast<uint64_t>(base);
  } while (u);
  std::reverse(digits.begin(), digits.end());
  if (sp.precision > static_cast<int64_t>(digits.size()))
    digits = std::string(static_cast<size_t>(sp.precision) - digits.size(), '0') + digits;
  std::string prefix;
  if (sp.alt && base == 16) prefix = type == 'X' ? "0X" : "0x";
  if (sp.alt && base == 8) prefix = "0o";
  const std::string sign = neg ? "-" : sp.plus ? "+" : sp.space ? " " : "";
  return pad_to_width(sign + prefix + digits, sp, true);
}

std::string format_double(double v, char type, const Spec& sp) {
  std::string fmt = "%";
  if (sp.plus) fmt += '+';
  if (sp.space) fmt += ' ';
  if (sp.alt) fmt += '#';
  fmt += '.';
  fmt += std::to_string(sp.precision < 0 ? 6 : std::min<int64_t>(sp.precision, 400));
  fmt += type;
  char buf[512];
  std::snprintf(buf, sizeof(buf), fmt.c_str(), v);
  return pad_to_width(buf, sp, std::isfinite(v));
}

}  // namespace

Value percent_format(Interpreter& in, const Value& format, const Value& args) {
  const std::string& f = format.as_string();
  const bool markup = format.is_markup();
  std::vector<Value> positional;
  const Dict* mapping = nullptr;
  // Python treats any non-tuple argument with __getitem__ (dict, list, ...) as a possible
  // mapping: no "not all arguments converted" error for it.
  bool mapping_like = false;
  if (args.is_seq(SeqKind::kTuple)) {
    positional = args.as_seq().items;
  } else {
    if (args.is_dict()) mapping = &args.as_dict();
    mapping_like = args.is_dict() || args.is_seq(SeqKind::kList) || args.is_seq(SeqKind::kRange) ||
                   args.is_undefined();
    positional.push_back(args);
  }
  size_t next_arg = 0;
  auto take = [&]() -> Value {
    if (next_arg >= positional.size()) raise("TypeError", "not enough arguments for format string");
    return positional[next_arg++];
  };
  std::string out;
  auto add = [&](const std::string& s) {
    in.check_string_size(out.size() + s.size());
    out += s;
  };
  size_t i = 0;
  while (i < f.size()) {
    const size_t pct = f.find('%', i);
    if (pct == std::string::npos) {
      add(f.substr(i));
      break;
    }
    add(f.substr(i, pct - i));
    i = pct + 1;
    if (i >= f.size()) raise("ValueError", "incomplete format");
    std::optional<Value> value;
    if (f[i] == '(') {
      if (args.is_undefined()) args.raise_undefined();  // Undefined[key] raises
      if (!mapping) raise("TypeError", "format requires a mapping");
      int depth = 1;
      const size_t start = ++i;
      while (i < f.size() && depth) {
        if (f[i] == '(') ++depth;
        if (f[i] == ')') --depth;
        ++i;
      }
      if (depth) raise("ValueError", "incomplete format key");
      const std::string key = f.substr(start, i - 1 - start);
      const Value* v = mapping->find(std::string_view(key));
      if (!v) raise("KeyError", repr_string(key));
      value = *v;
    }
    Spec sp;
    for (; i < f.size(); ++i) {
      const char c = f[i];
      if (c == '-')
        sp.left = true;
      else if (c == '+')
        sp.plus = true;
      else if (c == ' ')
        sp.space = true;
      else if (c == '#')
        sp.alt = true;
      else if (c == '0')
        sp.zero = true;
      else
        break;
    }
    auto number = [&](int64_t& target) {
      if (i < f.size() && f[i] == '*') {
        const Value w = take();
        if (!w.is_integral()) raise("TypeError", "* wants int");
        target = w.as_int();
        ++i;
        return;
      }
      int64_t n = -1;
      while (i < f.size() && f[i] >= '0' && f[i] <= '9') {
        n = (n < 0 ? 0 : n) * 10 + (f[i] - '0');
        if (n > (1 << 24)) raise("ValueError", "width too big");
        ++i;
      }
      target = n;
    };
    number(sp.width);
    if (sp.width < -1) {
      sp.left = true;
      sp.width = sp.width == std::numeric_limits<int64_t>::min()
                     ? std::numeric_limits<int64_t>::max()
                     : -sp.width;
    }
    if (sp.width > 0) in.check_string_size(static_cast<size_t>(sp.width));
    if (i < f.size() && f[i] == '.') {
      ++i;
      number(sp.precision);
      if (sp.precision < 0) sp.precision = 0;
      in.check_string_size(static_cast<size_t>(sp.precision));
    }
    while (i < f.size() && (f[i] == 'h' || f[i] == 'l' || f[i] == 'L')) ++i;
    if (i >= f.size()) raise("ValueError", "incomplete format");
    const char type = f[i++];
    if (type == '%' && i == pct + 2) {  // "%%"; a '%' after flags or a width is an error
      add("%");
      continue;
    }
    const Value v = value ? *value : take();
    if (v.is_undefined() && type != 's' && type != 'r' && type != 'a') v.raise_undefined();
    switch (type) {
      case 's':
      case 'r':
      case 'a': {
        std::string s = type == 's' ? in.str(v) : type == 'r' ? in.repr(v) : ascii_repr(in, v);
        if (markup && !(type == 's' && v.is_markup())) s = html_escape(s);
        if (sp.precision >= 0) {
          const std::u32string cps = unicode::decode(s);
          if (static_cast<int64_t>(cps.size()) > sp.precision)
            s = unicode::encode(
                std::u32string_view(cps).substr(0, static_cast<size_t>(sp.precision)));
        }
        add(pad_to_width(std::move(s), sp, false));
        break;
      }
      case 'd':
      case 'i':
      case 'u': {
        if (!v.is_number())
          raise("TypeError", std::string("%") + type + " format: a real number is required, not " +
                                 v.type_name());
        int64_t iv = 0;
        if (v.is_float()) {
          const double d = v.as_double();
          if (!std::isfinite(d)) raise("OverflowError", "cannot convert float infinity to integer");
          if (d >= 9223372036854775808.0 || d < -9223372036854775808.0)
            raise("OverflowError", "integer too large (tandem's Jinja integers are 64-bit)");
          iv = static_cast<int64_t>(d);
        } else {
          iv = v.as_int();
        }
        add(format_integer(iv, 'd', sp));
        break;
      }
      case 'x':
      case 'X':
      case 'o':
        if (!v.is_integral())
          raise("TypeError",
                std::string("%") + type + " format: an integer is required, not " + v.type_name());
        add(format_integer(v.as_int(), type, sp));
        break;
      case 'e':
      case 'E':
      case 'f':
      case 'F':
      case 'g':
      case 'G':
        if (!v.is_number()) raise("TypeError", "must be real number, not " + v.type_name());
        add(format_double(v.as_double(), type, sp));
        break;
      case 'c': {
        std::string ch;
        if (v.is_integral()) {
          if (v.as_int() < 0 || v.as_int() > 0x10FFFF)
            raise("OverflowError", "%c arg not in range(0x110000)");
          unicode::append(static_cast<char32_t>(v.as_int()), ch);
        } else if (v.is_string() && unicode::length(v.as_string()) == 1) {
          ch = v.as_string();
        } else {
          raise("TypeError", "%c requires int or char");
        }
        add(pad_to_width(std::move(ch), sp, false));
        break;
      }
      default: {
        // Python reports the character and its index in code points.
        uint32_t cp = static_cast<unsigned char>(type);
        const size_t at = i - 1;
        if (cp >= 0x80) utf8::decode(f, at, cp);
        std::string ch;
        unicode::append(cp, ch);
        char buf[64];
        std::snprintf(buf, sizeof(buf), "' (0x%x) at index %zu", static_cast<unsigned>(cp),
                      unicode::length(std::string_view(f).substr(0, at)));
        raise("ValueError", "unsupported format character '" + ch + buf);
      }
    }
  }
  if (!mapping_like && next_arg < positional.size())
    raise("TypeError", "not all arguments converted during string formatting");
  return markup ? in.make_markup(std::move(out)) : in.make_string(std::move(out));
}

// ---------------------------------------------------------------------------------------------
// str.format

namespace {

// Python's format(value, spec) for str, int, float and bool; other types accept only "".
std::string format_value(Interpreter& in, const Value& v, const std::string& spec_text) {
  if (spec_text.empty()) return in.str(v);
  const std::u32string spec = unicode::decode(spec_text);
  size_t i = 0;
  char32_t fill = ' ';
  char align = 0;
  auto is_align = [](char32_t c) { return c == '<' || c == '>' || c == '^' || c == '='; };
  if (spec.size() >= 2 && is_align(spec[1])) {
    fill = spec[0];
    align = static_cast<char>(spec[1]);
    i = 2;
  } else if (!spec.empty() && is_align(spec[0])) {
    align = static_cast<char>(spec[0]);
    i = 1;
  }
  char sign = 0;
  if (i < spec.size() && (spec[i] == '+' || spec[i] == '-' || spec[i] == ' '))
    sign = static_cast<char>(spec[i++]);
  bool alt = false;
  if (i < spec.size() && spec[i] == '#') {
    alt = true;
    ++i;
  }
  if (i < spec.size() && spec[i] == '0') {
    if (!align) {
      fill = '0';
      align = '=';
    }
    ++i;
  }
  int64_t width = -1;
  while (i < spec.size() && spec[i] >= '0' && spec[i] <= '9') {
    width = (width < 0 ? 0 : width) * 10 + (spec[i++] - '0');
    if (width > (1 << 24)) raise("ValueError", "Too many decimal digits in format string");
  }
  char grouping = 0;
  if (i < spec.size() && (spec[i] == ',' || spec[i] == '_'))
    grouping = static_cast<char>(spec[i++]);
  int64_t precision = -1;
  if (i < spec.size() && spec[i] == '.') {
    ++i;
    precision = 0;
    while (i < spec.size() && spec[i] >= '0' && spec[i] <= '9') {
      precision = precision * 10 + (spec[i++] - '0');
      if (precision > 1000) raise("ValueError", "precision too big");
    }
  }
  char type = 0;
  if (i < spec.size()) type = static_cast<char>(spec[i++]);
  if (i != spec.size()) raise("ValueError", "Invalid format specifier");

  std::string body;
  std::string sign_text;
  if (v.is_string()) {
    if (type && type != 's')
      raise("ValueError",
            std::string("Unknown format code '") + type + "' for object of type 'str'");
    if (sign) raise("ValueError", "Sign not allowed in string format specifier");
    if (align == '=') raise("ValueError", "'=' alignment not allowed in string format specifier");
    std::u32string cps = unicode::decode(v.as_string());
    if (precision >= 0 && static_cast<int64_t>(cps.size()) > precision)
      cps.resize(static_cast<size_t>(precision));
    body = unicode::encode(cps);
    if (!align) align = '<';
  } else if (v.is_number()) {
    if (!align) align = '>';
    const bool as_int =
        v.is_integral() && (type == 0 || type == 'd' || type == 'b' || type == 'o' || type == 'x' ||
                            type == 'X' || type == 'n' || type == 'c');
    if (v.is_integral() && !as_int &&
        std::string_view("eEfFgG%").find(type) == std::string_view::npos)
      raise("ValueError", std::string("Unknown format code '") + type + "' for object of type '" +
                              v.type_name() + "'");
    if (as_int) {
      if (precision >= 0) raise("ValueError", "Precision not allowed in integer format specifier");
      const int64_t x = v.as_int();
      if (type == 'c') {
        unicode::append(static_cast<char32_t>(x), body);
      } else {
        const bool neg = x < 0;
        uint64_t u = neg ? static_cast<uint64_t>(-(x + 1)) + 1 : static_cast<uint64_t>(x);
        const int base = type == 'b' ? 2 : type == 'o' ? 8 : (type == 'x' || type == 'X') ? 16 : 10;
        const char* set = type == 'X' ? "0123456789ABCDEF" : "0123456789abcdef";
        std::string digits;
        do {
          digits.push_back(set[u % static_cast<uint64_t>(base)]);
          u /= static_cast<uint64_t>(base);
        } while (u);
        if (grouping) {
          const size_t every = base == 10 ? 3 : 4;
          std::string g;
          for (size_t k = 0; k < digits.size(); ++k) {
            if (k && k % every == 0) g.push_back(grouping);
            g.push_back(digits[k]);
          }
          digits = g;
        }
        std::reverse(digits.begin(), digits.end());
        if (alt && base != 10)
          body = std::string("0") + (type == 'X'   ? 'X'
                                     : type == 'x' ? 'x'
                                     : type == 'o' ? 'o'
                                                   : 'b');
        body += digits;
        sign_text = neg ? "-" : sign == '+' ? "+" : sign == ' ' ? " " : "";
      }
    } else {
      double d = v.as_double();
      const bool neg = std::signbit(d) && !std::isnan(d);
      d = std::fabs(d);
      std::string t;
      if (type == 0 && precision < 0) {
        t = repr_float(d);
      } else {
        char ct = type == 0 ? 'g' : type == '%' ? 'f' : type == 'n' ? 'g' : type;
        if (type == '%') d *= 100;
        char fmt[16];
        std::snprintf(fmt, sizeof(fmt), "%%%s.%d%c", alt ? "#" : "",
                      static_cast<int>(precision < 0 ? 6 : precision), ct);
        char buf[1400];
        std::snprintf(buf, sizeof(buf), fmt, d);
        t = buf;
        if (type == 0 && std::isfinite(d) && t.find_first_of(".e") == std::string::npos) t += ".0";
        if (type == '%') t += '%';
      }
      if (grouping) {
        const size_t dot = t.find_first_of(".e%");
        std::string ip = t.substr(0, dot), rest = dot == std::string::npos ? "" : t.substr(dot);
        std::string g;
        for (size_t k = 0; k < ip.size(); ++k) {
          if (k && (ip.size() - k) % 3 == 0) g.push_back(grouping);
          g.push_back(ip[k]);
        }
        t = g + rest;
      }
      body = t;
      sign_text = neg ? "-" : sign == '+' ? "+" : sign == ' ' ? " " : "";
    }
  } else {
    raise("TypeError", "unsupported format string passed to " + v.type_name() + ".__format__");
  }
  const auto len = static_cast<int64_t>(unicode::length(sign_text) + unicode::length(body));
  if (width <= len) return sign_text + body;
  in.check_string_size(static_cast<size_t>(width) * 4);
  const size_t n = static_cast<size_t>(width - len);
  std::string fill_s;
  unicode::append(fill, fill_s);
  auto repeat = [&](size_t k) {
    std::string r;
    for (size_t j = 0; j < k; ++j) r += fill_s;
    return r;
  };
  switch (align) {
    case '<':
      return sign_text + body + repeat(n);
    case '^':
      return repeat(n / 2) + sign_text + body + repeat(n - n / 2);
    case '=':
      return sign_text + repeat(n) + body;
    default:
      return repeat(n) + sign_text + body;
  }
}

struct FormatState {
  Interpreter& in;
  const std::vector<Value>& args;
  const std::vector<std::pair<std::string, Value>>& kwargs;
  int mode = 0;  // 0 unknown, 1 automatic numbering, 2 manual
  size_t next = 0;
};

Value resolve_field(FormatState& st, const std::string& field) {
  size_t i = 0;
  while (i < field.size() && field[i] != '.' && field[i] != '[') ++i;
  const std::string first = field.substr(0, i);
  Value v;
  const bool numeric = !first.empty() && std::all_of(first.begin(), first.end(),
                                                     [](char c) { return c >= '0' && c <= '9'; });
  if (first.empty() || numeric) {
    size_t index = 0;
    if (first.empty()) {
      if (st.mode == 2)
        raise("ValueError",
              "cannot switch from manual field specification to automatic field numbering");
      st.mode = 1;
      index = st.next++;
    } else {
      if (st.mode == 1)
        raise("ValueError",
              "cannot switch from automatic field numbering to manual field specification");
      st.mode = 2;
      if (first.size() > 9) raise("ValueError", "Too many decimal digits in format string");
      index = static_cast<size_t>(std::stoul(first));
    }
    if (index >= st.args.size())
      raise("IndexError", "Replacement index " + std::to_string(index) +
                              " out of range for positional args tuple");
    v = st.args[index];
  } else {
    bool found = false;
    for (const auto& [k, x] : st.kwargs) {
      if (k == first) {
        v = x;
        found = true;
        break;
      }
    }
    if (!found) raise("KeyError", repr_string(first));
  }
  while (i < field.size()) {
    if (field[i] == '.') {
      size_t j = ++i;
      while (j < field.size() && field[j] != '.' && field[j] != '[') ++j;
      if (j == i) raise("ValueError", "Empty attribute in format string");
      v = st.in.getattr(v, field.substr(i, j - i));
      i = j;
    } else if (field[i] == '[') {
      const size_t close = field.find(']', i);
      if (close == std::string::npos) raise("ValueError", "Missing ']' in format string");
      const std::string key = field.substr(i + 1, close - i - 1);
      const bool digits =
          !key.empty() && key.size() < 18 &&
          std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
      v = st.in.getitem(v, digits ? Value(static_cast<int64_t>(std::stoll(key))) : Value(key));
      i = close + 1;
    } else {
      raise("ValueError", "Only '.' or '[' may follow ']' in format field specifier");
    }
  }
  return v;
}

std::string expand_format(FormatState& st, const std::string& f, int depth) {
  if (depth > 2) raise("ValueError", "Max string recursion exceeded");
  std::string out;
  size_t i = 0;
  while (i < f.size()) {
    const char c = f[i];
    if (c == '}') {
      if (i + 1 < f.size() && f[i + 1] == '}') {
        out += '}';
        i += 2;
        continue;
      }
      raise("ValueError", "Single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      ++i;
      continue;
    }
    if (i + 1 < f.size() && f[i + 1] == '{') {
      out += '{';
      i += 2;
      continue;
    }
    // A replacement field up to the matching brace (the spec may hold nested fields).
    int level = 1;
    size_t j = i + 1;
    while (j < f.size() && level) {
      if (f[j] == '{') ++level;
      if (f[j] == '}') --level;
      ++j;
    }
    if (level) raise("ValueError", "expected '}' before end of string");
    const std::string body = f.substr(i + 1, j - i - 2);
    i = j;
    size_t end_name = 0;
    while (end_name < body.size() && body[end_name] != '!' && body[end_name] != ':') {
      if (body[end_name] == '[') {
        const size_t close = body.find(']', end_name);
        end_name = close == std::string::npos ? body.size() : close + 1;
      } else {
        ++end_name;
      }
    }
    const std::string field = body.substr(0, end_name);
    char conversion = 0;
    std::string spec;
    size_t k = end_name;
    if (k < body.size() && body[k] == '!') {
      if (k + 1 >= body.size())
        raise("ValueError", "end of string while looking for conversion specifier");
      conversion = body[k + 1];
      k += 2;
      if (k < body.size() && body[k] != ':')
        raise("ValueError", "expected ':' after conversion specifier");
    }
    if (k < body.size() && body[k] == ':') spec = expand_format(st, body.substr(k + 1), depth + 1);
    Value v = resolve_field(st, field);
    if (conversion == 'r')
      v = Value(st.in.repr(v));
    else if (conversion == 's')
      v = Value(st.in.str(v));
    else if (conversion == 'a')
      v = Value(ascii_repr(st.in, v));
    else if (conversion)
      raise("ValueError", std::string("Unknown conversion specifier ") + conversion);
    const std::string piece = format_value(st.in, v, spec);
    st.in.check_string_size(out.size() + piece.size());
    out += piece;
  }
  return out;
}

Value m_format(Interpreter& in, const Value& self, CallArgs& a) {
  FormatState st{in, a.args, a.kwargs};
  return in.make_string(expand_format(st, self.as_string(), 0));
}

}  // namespace

}  // namespace tandem::jinja
