// The evaluator of parsed Jinja templates, with jinja2's semantics in the environment
// transformers renders chat templates in: ImmutableSandboxedEnvironment (attribute lookup through
// the sandbox, no mutation of lists and dicts, range() capped at 100000 items), the default
// Undefined, no autoescaping, the loopcontrols extension, and transformers' globals
// raise_exception(msg) and strftime_now(fmt) and its |tojson filter.
//
// Scoping follows jinja2's compiled code: {% set %} writes to the innermost frame; every loop
// iteration, macro call, call block, with block, filter block and set block is a frame of its own
// (so assignments in a loop body do not survive the iteration); {% if %} is not. A macro sees
// the variables of the frame it was defined in as they are when it runs (Python closures).
//
// Everything an untrusted template or conversation can make expensive is bounded (RenderLimits)
// and reported as an error: evaluation steps, output and string sizes, list sizes and nesting,
// call depth and the evaluator's own recursion.
#pragma once

#include <cstdint>
#include <ctime>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/io/jinja_ast.h"
#include "tandem/io/jinja_value.h"

namespace tandem::jinja {

struct ParsedTemplate;

struct RenderLimits {
  size_t max_output_bytes = 32u << 20;  // the rendered text, and any one string value
  uint64_t max_steps = 20'000'000;      // node evaluations + loop iterations + 64-byte text units
  uint32_t max_call_depth = 100;        // nested macro / caller / recursive-loop calls
  uint32_t max_eval_depth = 600;        // recursion of the evaluator itself
  uint32_t max_value_depth = 128;       // nesting of lists, tuples and dicts
  size_t max_items = 1u << 20;          // items of one list or dict
};

// A local date and time, what Python's datetime.now() holds.
struct LocalTime {
  std::tm tm{};  // all fields set, tm_wday and tm_yday included
  int microsecond = 0;
};

struct RenderOptions {
  RenderLimits limits;
  // What strftime_now() formats (transformers: datetime.now(), the local time); unset means the
  // system clock in the local time zone. Tests and fixtures set it so that their output does not
  // depend on the date.
  std::function<LocalTime()> clock;
};

// The builtin filters and tests (jinja2's plus transformers' tojson).
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);

// One frame of variables.
struct Scope {
  explicit Scope(std::shared_ptr<Scope> p) : parent(std::move(p)) {}
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;

  Value* find(std::string_view name) {
    for (auto& [k, v] : vars)
      if (k == name) return &v;
    return nullptr;
  }
  void set(std::string_view name, Value v) {
    if (Value* slot = find(name)) {
      *slot = std::move(v);
      return;
    }
    vars.emplace_back(std::string(name), std::move(v));
  }
};
using ScopePtr = std::shared_ptr<Scope>;

class MacroObject;
class LoopObject;

class Interpreter {
 public:
  Interpreter(const ParsedTemplate& t, const Dict& variables, const RenderOptions& options);
  ~Interpreter();
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;

  // Renders the template. Throws RenderError; `error_offset()` is then where it happened.
  std::string run();
  uint32_t error_offset() const { return pos_; }

  // ---- Python-level operations, shared with the builtins --------------------------------------

  // jinja2's sandboxed getattr (x.name) and getitem (x[key]).
  Value getattr(const Value& obj, std::string_view name);
  Value getitem(const Value& obj, const Value& key);
  // The Python attribute only (no item fallback); nullopt for AttributeError. Unsafe attributes
  // come back as an Undefined that raises SecurityError when used.
  std::optional<Value> python_attribute(const Value& obj, std::string_view name);
  Value call(const Value& callee, CallArgs& args);
  // iter(v) as a list of items (a one-shot iterator is consumed).
  std::vector<Value> iterate(const Value& v);
  // len(v)
  int64_t length(const Value& v);
  // item in container
  bool contains(const Value& container, const Value& item);
  Value binary(BinOp op, const Value& a, const Value& b);
  Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

  std::string str(const Value& v);
  std::string repr(const Value& v);
  Value make_string(std::string s);
  Value make_markup(std::string s);
  Value make_seq(std::vector<Value> items, SeqKind kind = SeqKind::kList);
  Value make_dict(std::shared_ptr<Dict> d);
  Value make_namespace(std::shared_ptr<Dict> attrs);

  Value apply_filter(const std::string& name, const Value& operand, CallArgs& args);
  bool apply_test(const std::string& name, const Value& operand, CallArgs& args);

  // Counts work; throws LimitError past RenderLimits::max_steps.
  void step(uint64_t n = 1) {
    steps_ += n;
    if (steps_ > options_.limits.max_steps) fail_steps();
  }
  void charge_bytes(size_t n) { step(n / 64); }
  void check_string_size(size_t n) const;
  const RenderOptions& options() const { return options_; }
  const ValueLimits& value_limits() const { return value_limits_; }
  LocalTime now() const;

  // Macros, callers and recursive loops run through these.
  Value call_macro(const MacroObject& m, CallArgs& args);
  Value call_loop(LoopObject& loop, CallArgs& args);

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  Flow exec(const Body& body, const ScopePtr& scope);
  Flow exec_stmt(const Stmt& s, const ScopePtr& scope);
  Flow exec_for(const ForStmt& s, const ScopePtr& scope, std::vector<Value> items, uint32_t depth);
  Value eval(const Expr& e, const ScopePtr& scope);
  Value eval_uncounted(const Expr& e, const ScopePtr& scope);
  CallArgs eval_args(const ArgList& a, const ScopePtr& scope);
  Value eval_filter(const FilterExpr& f, const ScopePtr& scope, const Value* block_content);
  Value lookup(const std::string& name, const ScopePtr& scope);
  void assign(const Target& t, Value v, const ScopePtr& scope);
  Value make_macro(const MacroDef& def, const ScopePtr& scope);
  // A frame's scope, with the names it starts without (FrameNames) bound to Undefined.
  ScopePtr new_frame(const ScopePtr& parent, const FrameNames& missing);
  std::string capture(const Body& body, const ScopePtr& scope);
  void write(std::string_view s);
  Value compare(CmpOp op, const Value& a, const Value& b);
  [[noreturn]] void fail_steps() const;

  const ParsedTemplate& template_;
  const Dict& variables_;
  RenderOptions options_;
  ValueLimits value_limits_;
  std::string* out_ = nullptr;
  uint64_t steps_ = 0;
  uint32_t eval_depth_ = 0;
  uint32_t call_depth_ = 0;
  uint32_t pos_ = 0;
  // Objects that can take part in reference cycles (a namespace holding itself, a macro stored
  // in the frame it closes over); their contents are cleared when the render ends.
  std::vector<std::shared_ptr<Namespace>> namespaces_;
  std::vector<ScopePtr> captured_scopes_;

  friend class EvalGuard;
  friend class LoopObject;
};

// Binds Python-style arguments of a builtin to its parameter names: positional first, then
// keywords; an unknown keyword, a duplicate, or too many positionals raise TypeError naming the
// function, as Python would.
class ArgBinder {
 public:
  ArgBinder(std::string_view function, CallArgs& args,
            std::initializer_list<std::string_view> names, size_t required = 0);
  bool has(size_t i) const { return values_[i].has_value(); }
  const Value& get(size_t i) const { return *values_[i]; }
  Value get_or(size_t i, Value fallback) const {
    return has(i) ? *values_[i] : std::move(fallback);
  }

 private:
  std::vector<std::optional<Value>> values_;
};

// For builtins without parameters: TypeError if any argument was given.
inline void no_args(std::string_view function, CallArgs& args) {
  const ArgBinder none(function, args, {});
}

// Function tables of jinja_builtins.cpp / jinja_methods.cpp.
using FilterFn = Value (*)(Interpreter&, const Value& operand, CallArgs& args);
using TestFn = bool (*)(Interpreter&, const Value& operand, CallArgs& args);
FilterFn find_filter(std::string_view name);
TestFn find_test(std::string_view name);
// A global of the environment (range, dict, namespace, raise_exception, strftime_now, cycler,
// joiner, lipsum); nullopt if there is none of that name.
std::optional<Value> find_global(std::string_view name);
// The attribute `name` of a str, list, tuple, dict, dict view, range, int, float, bool or None
// (bound methods, or data attributes such as range.start); nullopt when Python has none. Methods
// that would mutate a list or dict come back as the sandbox's unsafe Undefined.
std::optional<Value> builtin_attribute(const Value& obj, std::string_view name);

// The Undefined jinja2's sandbox returns for an unsafe attribute: using it raises SecurityError.
Value unsafe_undefined(const Value& obj, std::string_view name);

// HTML escaping of markupsafe.escape (& < > " ').
std::string html_escape(std::string_view s);

// Python's printf-style `format % args` (str % tuple, str % dict, str % value).
Value percent_format(Interpreter& in, const Value& format, const Value& args);

}  // namespace tandem::jinja
