#include "tandem/io/jinja_interpreter.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "tandem/io/jinja_parser.h"
#include "tandem/io/jinja_unicode.h"

namespace tandem::jinja {

// Counts the evaluator's recursion (statements, expressions, calls all recurse through it).
class EvalGuard {
 public:
  explicit EvalGuard(Interpreter& in) : in_(in) {
    if (++in_.eval_depth_ > in_.options_.limits.max_eval_depth) {
      --in_.eval_depth_;
      raise("LimitError", "the template nests too deeply (evaluation depth over " +
                              std::to_string(in_.options_.limits.max_eval_depth) + ")");
    }
  }
  ~EvalGuard() { --in_.eval_depth_; }
  EvalGuard(const EvalGuard&) = delete;
  EvalGuard& operator=(const EvalGuard&) = delete;

 private:
  Interpreter& in_;
};

// A macro, or the caller of a {% call %} block: its definition and the frame it closes over.
class MacroObject final : public HostObject {
 public:
  MacroObject(const MacroDef& d, ScopePtr c) : def(d), closure(std::move(c)) {}
  std::string type_name() const override { return "Macro"; }
  std::string module_name() const override { return "jinja2.runtime"; }
  std::string repr() const override { return "<Macro " + repr_string(def.name) + ">"; }
  std::optional<Value> attribute(std::string_view name) const override {
    if (name == "name") return Value(def.name);
    if (name == "arguments") {
      std::vector<Value> names(def.params.begin(), def.params.end());
      return Value::tuple(std::move(names));
    }
    if (name == "catch_kwargs") return Value(def.uses_kwargs);
    if (name == "catch_varargs") return Value(def.uses_varargs);
    if (name == "caller") return Value(def.uses_caller);
    return std::nullopt;
  }
  bool callable() const override { return true; }
  Value call(Interpreter& in, CallArgs& args) override { return in.call_macro(*this, args); }

  const MacroDef& def;
  ScopePtr closure;
};

// jinja2's LoopContext.
class LoopObject final : public HostObject {
 public:
  std::string type_name() const override { return "LoopContext"; }
  std::string module_name() const override { return "jinja2.runtime"; }
  std::string repr() const override {
    return "<LoopContext " + std::to_string(index0 + 1) + "/" + std::to_string(items.size()) + ">";
  }
  std::optional<Value> attribute(std::string_view name) const override;
  bool callable() const override { return true; }
  Value call(Interpreter& in, CallArgs& args) override { return in.call_loop(*this, args); }

  std::vector<Value> items;
  size_t index0 = 0;
  uint32_t depth0 = 0;
  const ForStmt* stmt = nullptr;
  ScopePtr outer;  // the frame the loop runs in, for recursive calls
  std::optional<Value> last_changed;
  std::weak_ptr<LoopObject> self;
};

namespace {

// loop.cycle and loop.changed, bound to their loop.
class LoopMethod final : public HostObject {
 public:
  LoopMethod(std::shared_ptr<LoopObject> l, bool cycle) : loop_(std::move(l)), cycle_(cycle) {}
  std::string type_name() const override { return "method"; }
  std::string repr() const override {
    return std::string("<bound method LoopContext.") + (cycle_ ? "cycle" : "changed") + ">";
  }
  bool callable() const override { return true; }
  Value call(Interpreter&, CallArgs& args) override {
    if (!args.kwargs.empty())
      raise("TypeError", std::string(cycle_ ? "cycle" : "changed") +
                             "() got an unexpected keyword argument " +
                             repr_string(args.kwargs[0].first));
    if (cycle_) {
      if (args.args.empty()) raise("TypeError", "no items for cycling given");
      return args.args[loop_->index0 % args.args.size()];
    }
    Value current = Value::tuple(args.args);
    if (loop_->last_changed && py_equal(*loop_->last_changed, current)) return Value(false);
    loop_->last_changed = std::move(current);
    return Value(true);
  }

 private:
  std::shared_ptr<LoopObject> loop_;
  bool cycle_;
};

bool is_dunder(std::string_view name) {
  return name.size() > 4 && name.substr(0, 2) == "__" && name.substr(name.size() - 2) == "__";
}

int64_t checked_int(bool ok, int64_t v) {
  if (!ok) raise("OverflowError", "integer overflow (tandem's Jinja integers are 64-bit)");
  return v;
}

// Python's float floor division and modulo (the result of % takes the divisor's sign).
double py_fmod(double x, double y) {
  double mod = std::fmod(x, y);
  if (mod != 0.0) {
    if ((y < 0) != (mod < 0)) mod += y;
  } else {
    mod = std::copysign(0.0, y);
  }
  return mod;
}

double py_floordiv(double x, double y) {
  double mod = std::fmod(x, y);
  double div = (x - mod) / y;
  if (mod != 0.0 && (y < 0) != (mod < 0)) div -= 1.0;
  if (div == 0.0) return std::copysign(0.0, x / y);
  double floordiv = std::floor(div);
  if (div - floordiv > 0.5) floordiv += 1.0;
  return floordiv;
}

std::string operand_types(const Value& a, const Value& b) {
  return "'" + a.type_name() + "' and '" + b.type_name() + "'";
}

}  // namespace

std::optional<Value> LoopObject::attribute(std::string_view name) const {
  const auto n = static_cast<int64_t>(items.size());
  const auto i = static_cast<int64_t>(index0);
  if (name == "index0") return Value(i);
  if (name == "index") return Value(i + 1);
  if (name == "revindex") return Value(n - i);
  if (name == "revindex0") return Value(n - i - 1);
  if (name == "first") return Value(i == 0);
  if (name == "last") return Value(i == n - 1);
  if (name == "length") return Value(n);
  if (name == "depth") return Value(static_cast<int64_t>(depth0) + 1);
  if (name == "depth0") return Value(static_cast<int64_t>(depth0));
  if (name == "previtem") {
    if (i == 0) return Value::undefined("there is no previous item");
    return items[index0 - 1];
  }
  if (name == "nextitem") {
    if (i == n - 1) return Value::undefined("there is no next item");
    return items[index0 + 1];
  }
  if (name == "cycle" || name == "changed")
    return Value::object(std::make_shared<LoopMethod>(self.lock(), name == "cycle"));
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------

Interpreter::Interpreter(const ParsedTemplate& t, const Dict& variables,
                         const RenderOptions& options)
    : template_(t), variables_(variables), options_(options) {
  value_limits_.max_string_bytes = options_.limits.max_output_bytes;
  value_limits_.max_depth = options_.limits.max_value_depth;
}

Interpreter::~Interpreter() {
  // Break every reference cycle a template can build; nothing rendered escapes the render.
  for (auto& n : namespaces_) n->attrs = Dict{};
  for (auto& s : captured_scopes_) s->vars.clear();
}

std::string Interpreter::run() {
  std::string out;
  out_ = &out;
  auto root = new_frame(nullptr, template_.frame);
  captured_scopes_.push_back(root);
  exec(template_.body, root);
  out_ = nullptr;
  return out;
}

void Interpreter::fail_steps() const {
  raise("LimitError", "the template took more than " + std::to_string(options_.limits.max_steps) +
                          " evaluation steps");
}

void Interpreter::check_string_size(size_t n) const {
  if (n > options_.limits.max_output_bytes)
    raise("LimitError",
          "a string would exceed " + std::to_string(options_.limits.max_output_bytes) + " bytes");
}

LocalTime Interpreter::now() const {
  if (options_.clock) return options_.clock();
  const auto t = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(t);
  LocalTime lt;
  localtime_r(&secs, &lt.tm);
  const auto since_second = t - std::chrono::system_clock::from_time_t(secs);
  lt.microsecond = static_cast<int>(
      std::chrono::duration_cast<std::chrono::microseconds>(since_second).count() % 1000000);
  if (lt.microsecond < 0) lt.microsecond += 1000000;
  return lt;
}

void Interpreter::write(std::string_view s) {
  if (out_->size() + s.size() > options_.limits.max_output_bytes)
    raise("LimitError",
          "the output would exceed " + std::to_string(options_.limits.max_output_bytes) + " bytes");
  charge_bytes(s.size());
  out_->append(s);
}

std::string Interpreter::str(const Value& v) {
  std::string s = py_str(v, value_limits_);
  charge_bytes(s.size());
  return s;
}

std::string Interpreter::repr(const Value& v) {
  std::string s = py_repr(v, value_limits_);
  charge_bytes(s.size());
  return s;
}

Value Interpreter::make_string(std::string s) {
  check_string_size(s.size());
  charge_bytes(s.size());
  return Value(std::move(s));
}

Value Interpreter::make_markup(std::string s) {
  check_string_size(s.size());
  charge_bytes(s.size());
  return Value::markup(std::move(s));
}

Value Interpreter::make_seq(std::vector<Value> items, SeqKind kind) {
  if (items.size() > options_.limits.max_items)
    raise("LimitError",
          "a list would have more than " + std::to_string(options_.limits.max_items) + " items");
  step(items.size() / 8);
  auto s = std::make_shared<Sequence>();
  s->kind = kind;
  s->items = std::move(items);
  Value v = Value::seq(std::move(s));
  if (v.depth() > options_.limits.max_value_depth)
    raise("LimitError", "lists or dicts nested deeper than " +
                            std::to_string(options_.limits.max_value_depth) + " levels");
  return v;
}

Value Interpreter::make_dict(std::shared_ptr<Dict> d) {
  if (d->size() > options_.limits.max_items)
    raise("LimitError",
          "a dict would have more than " + std::to_string(options_.limits.max_items) + " items");
  if (d->depth > options_.limits.max_value_depth)
    raise("LimitError", "lists or dicts nested deeper than " +
                            std::to_string(options_.limits.max_value_depth) + " levels");
  step(d->size() / 8);
  return Value::dict(std::move(d));
}

Value Interpreter::make_namespace(std::shared_ptr<Dict> attrs) {
  auto n = std::make_shared<Namespace>();
  if (attrs) n->attrs = std::move(*attrs);
  namespaces_.push_back(n);
  return Value::ns(std::move(n));
}

ScopePtr Interpreter::new_frame(const ScopePtr& parent, const FrameNames& missing) {
  auto scope = std::make_shared<Scope>(parent);
  for (const std::string& n : missing) scope->vars.emplace_back(n, Value::undefined_name(n));
  return scope;
}

Value Interpreter::make_macro(const MacroDef& def, const ScopePtr& scope) {
  captured_scopes_.push_back(scope);
  return Value::object(std::make_shared<MacroObject>(def, scope));
}

// ---------------------------------------------------------------------------------------------
// Statements

Interpreter::Flow Interpreter::exec(const Body& body, const ScopePtr& scope) {
  for (const auto& s : body) {
    const Flow f = exec_stmt(*s, scope);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

std::string Interpreter::capture(const Body& body, const ScopePtr& scope) {
  std::string buffer;
  std::string* saved = out_;
  out_ = &buffer;
  struct Restore {
    std::string*& out;
    std::string* saved;
    ~Restore() { out = saved; }
  } restore{out_, saved};
  exec(body, scope);
  return buffer;
}

Interpreter::Flow Interpreter::exec_stmt(const Stmt& s, const ScopePtr& scope) {
  EvalGuard guard(*this);
  step();
  const uint32_t saved_pos = pos_;
  pos_ = s.offset;
  Flow flow = Flow::kNormal;
  switch (s.kind) {
    case StmtKind::kData:
      write(static_cast<const DataStmt&>(s).text);
      break;
    case StmtKind::kOutput: {
      const Value v = eval(*static_cast<const OutputStmt&>(s).expr, scope);
      if (v.is_string())
        write(v.as_string());
      else
        write(str(v));
      break;
    }
    case StmtKind::kFor: {
      const auto& f = static_cast<const ForStmt&>(s);
      const Value iterable = eval(*f.iter, scope);
      std::vector<Value> items = iterate(iterable);
      if (f.filter) {
        std::vector<Value> kept;
        for (Value& item : items) {
          auto test_scope = std::make_shared<Scope>(scope);
          assign(f.target, item, test_scope);
          if (eval(*f.filter, test_scope).truthy()) kept.push_back(std::move(item));
        }
        items = std::move(kept);
      }
      flow = exec_for(f, scope, std::move(items), 0);
      break;
    }
    case StmtKind::kIf: {
      const auto& i = static_cast<const IfStmt&>(s);
      bool taken = false;
      for (const auto& [test, body] : i.branches) {
        if (eval(*test, scope).truthy()) {
          flow = exec(body, scope);
          taken = true;
          break;
        }
      }
      if (!taken) flow = exec(i.else_body, scope);
      break;
    }
    case StmtKind::kSet: {
      const auto& set = static_cast<const SetStmt&>(s);
      assign(set.target, eval(*set.value, scope), scope);
      break;
    }
    case StmtKind::kSetBlock: {
      const auto& set = static_cast<const SetBlockStmt&>(s);
      Value content = make_string(capture(set.body, new_frame(scope, set.frame)));
      if (set.filter)
        content = eval_filter(static_cast<const FilterExpr&>(*set.filter), scope, &content);
      assign(set.target, std::move(content), scope);
      break;
    }
    case StmtKind::kMacro: {
      const auto& m = static_cast<const MacroStmt&>(s);
      scope->set(m.def.name, make_macro(m.def, scope));
      break;
    }
    case StmtKind::kCallBlock: {
      const auto& c = static_cast<const CallBlockStmt&>(s);
      const auto& call_expr = static_cast<const CallExpr&>(*c.call);
      Value caller = make_macro(c.caller, scope);
      const Value callee = eval(*call_expr.callee, scope);
      CallArgs args = eval_args(call_expr.args, scope);
      args.kwargs.emplace_back("caller", std::move(caller));
      const Value result = call(callee, args);
      if (result.is_string())
        write(result.as_string());
      else
        write(str(result));
      break;
    }
    case StmtKind::kFilterBlock: {
      const auto& fb = static_cast<const FilterBlockStmt&>(s);
      const Value content = make_string(capture(fb.body, new_frame(scope, fb.frame)));
      const Value result = eval_filter(static_cast<const FilterExpr&>(*fb.filter), scope, &content);
      write(str(result));
      break;
    }
    case StmtKind::kWith: {
      const auto& w = static_cast<const WithStmt&>(s);
      auto inner = new_frame(scope, w.frame);
      for (size_t i = 0; i < w.targets.size(); ++i)
        assign(w.targets[i], eval(*w.values[i], scope), inner);
      flow = exec(w.body, inner);
      break;
    }
    case StmtKind::kBreak:
      flow = Flow::kBreak;
      break;
    case StmtKind::kContinue:
      flow = Flow::kContinue;
      break;
    case StmtKind::kScope:
      flow = exec(static_cast<const ScopeStmt&>(s).body,
                  new_frame(scope, static_cast<const ScopeStmt&>(s).frame));
      break;
  }
  pos_ = saved_pos;
  return flow;
}

Interpreter::Flow Interpreter::exec_for(const ForStmt& f, const ScopePtr& scope,
                                        std::vector<Value> items, uint32_t depth) {
  // jinja2 compiles {% else %} as a flag set before the loop and cleared at the end of the body,
  // so the else block runs unless some iteration reached the end of the body: also when every
  // iteration ended in {% continue %}, or the first one in {% break %}.
  bool run_else = true;
  if (!items.empty()) {
    auto loop = std::make_shared<LoopObject>();
    loop->self = loop;
    loop->items = std::move(items);
    loop->depth0 = depth;
    loop->stmt = &f;
    loop->outer = scope;
    if (f.recursive) captured_scopes_.push_back(scope);
    const Value loop_value = Value::object(loop);
    for (size_t i = 0; i < loop->items.size(); ++i) {
      step();
      loop->index0 = i;
      auto iteration = new_frame(scope, f.body_frame);
      assign(f.target, loop->items[i], iteration);
      iteration->set("loop", loop_value);
      const Flow flow = exec(f.body, iteration);
      if (flow == Flow::kNormal) run_else = false;
      if (flow == Flow::kBreak) break;
    }
  }
  // The else block is outside the loop: break/continue there belong to an enclosing loop.
  if (run_else && !f.else_body.empty()) return exec(f.else_body, new_frame(scope, f.else_frame));
  return Flow::kNormal;
}

Value Interpreter::call_loop(LoopObject& loop, CallArgs& args) {
  if (!loop.stmt || !loop.stmt->recursive)
    raise("TypeError", "The loop must be marked as 'recursive' to call it.");
  if (args.args.size() != 1 || !args.kwargs.empty())
    raise("TypeError", "loop() takes exactly one argument, the iterable to recurse into");
  if (++call_depth_ > options_.limits.max_call_depth) {
    --call_depth_;
    raise("LimitError",
          "calls nested deeper than " + std::to_string(options_.limits.max_call_depth) + " levels");
  }
  struct Depth {
    uint32_t& d;
    ~Depth() { --d; }
  } depth{call_depth_};
  const ForStmt& f = *loop.stmt;
  std::vector<Value> items = iterate(args.args[0]);
  if (f.filter) {
    std::vector<Value> kept;
    for (Value& item : items) {
      auto test_scope = std::make_shared<Scope>(loop.outer);
      assign(f.target, item, test_scope);
      if (eval(*f.filter, test_scope).truthy()) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  std::string buffer;
  std::string* saved = out_;
  out_ = &buffer;
  struct Restore {
    std::string*& out;
    std::string* saved;
    ~Restore() { out = saved; }
  } restore{out_, saved};
  exec_for(f, loop.outer, std::move(items), loop.depth0 + 1);
  return make_string(std::move(buffer));
}

void Interpreter::assign(const Target& t, Value v, const ScopePtr& scope) {
  switch (t.kind) {
    case Target::Kind::kName:
      scope->set(t.name, std::move(v));
      return;
    case Target::Kind::kTuple: {
      if (!(v.is_undefined() || v.is_string() || v.is_seq() || v.is_dict()))
        raise("TypeError", "cannot unpack non-iterable " + v.type_name() + " object");
      std::vector<Value> items = iterate(v);
      const size_t want = t.items.size();
      if (items.size() < want)
        raise("ValueError", "not enough values to unpack (expected " + std::to_string(want) +
                                ", got " + std::to_string(items.size()) + ")");
      if (items.size() > want)
        raise("ValueError", "too many values to unpack (expected " + std::to_string(want) + ")");
      for (size_t i = 0; i < want; ++i) assign(t.items[i], std::move(items[i]), scope);
      return;
    }
    case Target::Kind::kNamespaceAttr: {
      const Value target = lookup(t.name, scope);
      if (!target.is_namespace())
        raise("TemplateRuntimeError", "cannot assign attribute on non-namespace object");
      target.as_namespace().attrs.set(Value(t.attr), std::move(v));
      return;
    }
  }
}

Value Interpreter::lookup(const std::string& name, const ScopePtr& scope) {
  for (Scope* s = scope.get(); s; s = s->parent.get())
    if (Value* v = s->find(name)) return *v;
  if (const Value* v = variables_.find(std::string_view(name))) return *v;
  if (auto g = find_global(name)) return *g;
  return Value::undefined_name(name);
}

// ---------------------------------------------------------------------------------------------
// Calls

Value Interpreter::call(const Value& callee, CallArgs& args) {
  if (callee.is_undefined()) callee.raise_undefined();
  if (callee.is_object() && callee.as_object().callable()) {
    step();
    return callee.as_object().call(*this, args);
  }
  raise("TypeError", "'" + callee.type_name() + "' object is not callable");
}

Value Interpreter::call_macro(const MacroObject& m, CallArgs& a) {
  const MacroDef& def = m.def;
  if (++call_depth_ > options_.limits.max_call_depth) {
    --call_depth_;
    raise("LimitError", "calls nested deeper than " +
                            std::to_string(options_.limits.max_call_depth) + " levels (macro " +
                            repr_string(def.name) + ")");
  }
  struct Depth {
    uint32_t& d;
    ~Depth() { --d; }
  } depth{call_depth_};

  // jinja2's Macro.__call__: positionals fill the parameters in order, keywords the rest;
  // leftovers go to varargs/kwargs when the body uses them, else they are errors.
  auto scope = new_frame(m.closure, def.frame);
  const size_t n_params = def.params.size();
  const size_t first_default = n_params - def.defaults.size();
  std::vector<std::pair<std::string, Value>> kwargs = std::move(a.kwargs);
  auto pop_kwarg = [&](std::string_view name) -> std::optional<Value> {
    for (auto it = kwargs.begin(); it != kwargs.end(); ++it) {
      if (it->first == name) {
        Value v = std::move(it->second);
        kwargs.erase(it);
        return v;
      }
    }
    return std::nullopt;
  };
  std::vector<std::optional<Value>> values(n_params);
  for (size_t i = 0; i < n_params; ++i)
    values[i] = i < a.args.size() ? std::optional<Value>(a.args[i]) : pop_kwarg(def.params[i]);
  // uses_caller means the body reads `caller` and it is not a declared parameter.
  if (def.uses_caller) {
    std::optional<Value> caller = pop_kwarg("caller");
    scope->set("caller", caller ? std::move(*caller) : Value::undefined("No caller defined"));
  }
  if (def.uses_kwargs) {
    auto d = std::make_shared<Dict>();
    for (auto& [k, v] : kwargs) d->set(Value(k), std::move(v));
    scope->set("kwargs", make_dict(std::move(d)));
  } else if (!kwargs.empty()) {
    for (const auto& kv : kwargs)
      if (kv.first == "caller")
        raise("TypeError", "macro " + repr_string(def.name) +
                               " was invoked with two values for the special caller argument. "
                               "This is most likely a bug.");
    raise("TypeError", "macro " + repr_string(def.name) + " takes no keyword argument " +
                           repr_string(kwargs.front().first));
  }
  if (def.uses_varargs) {
    std::vector<Value> extra;
    for (size_t i = n_params; i < a.args.size(); ++i) extra.push_back(a.args[i]);
    scope->set("varargs", make_seq(std::move(extra), SeqKind::kTuple));
  } else if (a.args.size() > n_params) {
    raise("TypeError", "macro " + repr_string(def.name) + " takes not more than " +
                           std::to_string(n_params) + " argument(s)");
  }
  // Defaults are evaluated in parameter order in the macro's frame: a default sees the
  // parameters before it, and a parameter still waiting for its value reads as Undefined (never
  // as a variable of the same name outside the macro).
  std::vector<bool> pending(n_params, false);
  for (size_t i = 0; i < n_params; ++i) {
    if (values[i]) {
      scope->set(def.params[i], std::move(*values[i]));
    } else {
      scope->set(def.params[i], Value::undefined_name(def.params[i]));
      pending[i] = true;
    }
  }
  for (size_t i = 0; i < n_params; ++i) {
    if (!pending[i]) continue;
    if (i >= first_default)
      scope->set(def.params[i], eval(*def.defaults[i - first_default], scope));
    else
      scope->set(def.params[i],
                 Value::undefined("parameter " + repr_string(def.params[i]) + " was not provided"));
  }
  return make_string(capture(def.body, scope));
}

CallArgs Interpreter::eval_args(const ArgList& a, const ScopePtr& scope) {
  CallArgs out;
  for (const auto& e : a.args) out.args.push_back(eval(*e, scope));
  if (a.dyn_args)
    for (Value& v : iterate(eval(*a.dyn_args, scope))) out.args.push_back(std::move(v));
  auto add_kwarg = [&](std::string key, Value v) {
    for (const auto& kv : out.kwargs)
      if (kv.first == key)
        raise("TypeError", "got multiple values for keyword argument " + repr_string(key));
    out.kwargs.emplace_back(std::move(key), std::move(v));
  };
  for (const auto& [k, e] : a.kwargs) add_kwarg(k, eval(*e, scope));
  if (a.dyn_kwargs) {
    const Value d = eval(*a.dyn_kwargs, scope);
    if (!d.is_dict())
      raise("TypeError", "argument after ** must be a mapping, not " + d.type_name());
    for (const auto& [k, v] : d.as_dict().entries) {
      if (!k.is_string()) raise("TypeError", "keywords must be strings");
      add_kwarg(k.as_string(), v);
    }
  }
  return out;
}

Value Interpreter::apply_filter(const std::string& name, const Value& operand, CallArgs& args) {
  const FilterFn fn = find_filter(name);
  if (!fn) raise("TemplateRuntimeError", "No filter named " + repr_string(name) + " found.");
  // Filters that walk their operand charge for it themselves (iterate() and soft_str do).
  step();
  return fn(*this, operand, args);
}

bool Interpreter::apply_test(const std::string& name, const Value& operand, CallArgs& args) {
  const TestFn fn = find_test(name);
  if (!fn) raise("TemplateRuntimeError", "No test named " + repr_string(name) + " found.");
  step();
  return fn(*this, operand, args);
}

Value Interpreter::eval_filter(const FilterExpr& f, const ScopePtr& scope,
                               const Value* block_content) {
  Value operand;
  if (f.operand) {
    if (f.operand->kind == ExprKind::kFilter)
      operand = eval_filter(static_cast<const FilterExpr&>(*f.operand), scope, block_content);
    else
      operand = eval(*f.operand, scope);
  } else if (block_content) {
    operand = *block_content;
  }
  CallArgs args = eval_args(f.args, scope);
  pos_ = f.offset;
  return apply_filter(f.name, operand, args);
}

// ---------------------------------------------------------------------------------------------
// Expressions

Value Interpreter::eval(const Expr& e, const ScopePtr& scope) {
  EvalGuard guard(*this);
  step();
  const uint32_t saved_pos = pos_;
  pos_ = e.offset;
  Value v = eval_uncounted(e, scope);
  pos_ = saved_pos;
  return v;
}

Value Interpreter::eval_uncounted(const Expr& e, const ScopePtr& scope) {
  switch (e.kind) {
    case ExprKind::kConst:
      return static_cast<const ConstExpr&>(e).value;
    case ExprKind::kName:
      return lookup(static_cast<const NameExpr&>(e).name, scope);
    case ExprKind::kList:
    case ExprKind::kTuple: {
      const auto& l = static_cast<const ListExpr&>(e);
      std::vector<Value> items;
      items.reserve(l.items.size());
      for (const auto& i : l.items) items.push_back(eval(*i, scope));
      return make_seq(std::move(items),
                      e.kind == ExprKind::kList ? SeqKind::kList : SeqKind::kTuple);
    }
    case ExprKind::kDict: {
      auto d = std::make_shared<Dict>();
      for (const auto& [k, v] : static_cast<const DictExpr&>(e).items) {
        Value key = eval(*k, scope);
        d->set(std::move(key), eval(*v, scope));
      }
      return make_dict(std::move(d));
    }
    case ExprKind::kGetattr: {
      const auto& g = static_cast<const GetattrExpr&>(e);
      const Value obj = eval(*g.obj, scope);
      pos_ = e.offset;
      return getattr(obj, g.attr);
    }
    case ExprKind::kGetitem: {
      const auto& g = static_cast<const GetitemExpr&>(e);
      const Value obj = eval(*g.obj, scope);
      if (g.index->kind == ExprKind::kSlice) {
        const auto& s = static_cast<const SliceExpr&>(*g.index);
        const Value start = s.start ? eval(*s.start, scope) : Value::none();
        const Value stop = s.stop ? eval(*s.stop, scope) : Value::none();
        const Value step_v = s.step ? eval(*s.step, scope) : Value::none();
        pos_ = e.offset;
        return slice(obj, start, stop, step_v);
      }
      const Value key = eval(*g.index, scope);
      pos_ = e.offset;
      return getitem(obj, key);
    }
    case ExprKind::kSlice:
      raise("TypeError", "a slice can only be used as a subscript");
    case ExprKind::kCall: {
      const auto& c = static_cast<const CallExpr&>(e);
      const Value callee = eval(*c.callee, scope);
      CallArgs args = eval_args(c.args, scope);
      pos_ = e.offset;
      return call(callee, args);
    }
    case ExprKind::kFilter:
      return eval_filter(static_cast<const FilterExpr&>(e), scope, nullptr);
    case ExprKind::kTest: {
      const auto& t = static_cast<const TestExpr&>(e);
      const Value operand = eval(*t.operand, scope);
      CallArgs args = eval_args(t.args, scope);
      pos_ = e.offset;
      return Value(apply_test(t.name, operand, args));
    }
    case ExprKind::kNeg:
    case ExprKind::kPos: {
      const Value v = eval(*static_cast<const UnaryExpr&>(e).operand, scope);
      const bool neg = e.kind == ExprKind::kNeg;
      if (v.is_undefined()) v.raise_undefined();
      if (v.is_float()) return Value(neg ? -v.as_double() : v.as_double());
      if (v.is_integral()) {
        if (!neg) return Value(v.as_int());
        return Value(checked_int(v.as_int() != std::numeric_limits<int64_t>::min(), -v.as_int()));
      }
      raise("TypeError", std::string("bad operand type for unary ") + (neg ? "-" : "+") + ": '" +
                             v.type_name() + "'");
    }
    case ExprKind::kNot:
      return Value(!eval(*static_cast<const UnaryExpr&>(e).operand, scope).truthy());
    case ExprKind::kBinary: {
      const auto& b = static_cast<const BinaryExpr&>(e);
      const Value l = eval(*b.left, scope);
      const Value r = eval(*b.right, scope);
      pos_ = e.offset;
      return binary(b.op, l, r);
    }
    case ExprKind::kConcat: {
      std::string s;
      for (const auto& i : static_cast<const ConcatExpr&>(e).items) {
        const Value v = eval(*i, scope);
        if (v.is_string()) {
          check_string_size(s.size() + v.as_string().size());
          s += v.as_string();
        } else {
          const std::string part = str(v);
          check_string_size(s.size() + part.size());
          s += part;
        }
      }
      return make_string(std::move(s));
    }
    case ExprKind::kCompare: {
      const auto& c = static_cast<const CompareExpr&>(e);
      Value left = eval(*c.first, scope);
      for (const auto& [op, expr] : c.rest) {
        Value right = eval(*expr, scope);
        pos_ = e.offset;
        if (!compare(op, left, right).truthy()) return Value(false);
        left = std::move(right);
      }
      return Value(true);
    }
    case ExprKind::kAnd: {
      const auto& l = static_cast<const LogicalExpr&>(e);
      Value left = eval(*l.left, scope);
      if (!left.truthy()) return left;
      return eval(*l.right, scope);
    }
    case ExprKind::kOr: {
      const auto& l = static_cast<const LogicalExpr&>(e);
      Value left = eval(*l.left, scope);
      if (left.truthy()) return left;
      return eval(*l.right, scope);
    }
    case ExprKind::kCond: {
      const auto& c = static_cast<const CondExpr&>(e);
      if (eval(*c.test, scope).truthy()) return eval(*c.then, scope);
      if (c.otherwise) return eval(*c.otherwise, scope);
      return Value::undefined("the inline if-expression on line " + std::to_string(c.line) +
                              " evaluated to false and no else section was defined.");
    }
  }
  raise("RuntimeError", "unknown expression");
}

Value Interpreter::compare(CmpOp op, const Value& a, const Value& b) {
  // Comparing containers or long strings walks them: charge what that can cost.
  if (op != CmpOp::kIn && op != CmpOp::kNotIn) step(std::min(a.weight(), b.weight()) / 8);
  switch (op) {
    case CmpOp::kEq:
      return Value(py_equal(a, b));
    case CmpOp::kNe:
      return Value(!py_equal(a, b));
    case CmpOp::kLt:
      return Value(py_compare(Order::kLt, a, b));
    case CmpOp::kLe:
      return Value(py_compare(Order::kLe, a, b));
    case CmpOp::kGt:
      return Value(py_compare(Order::kGt, a, b));
    case CmpOp::kGe:
      return Value(py_compare(Order::kGe, a, b));
    case CmpOp::kIn:
      return Value(contains(b, a));
    case CmpOp::kNotIn:
      return Value(!contains(b, a));
  }
  return Value(false);
}

// ---------------------------------------------------------------------------------------------
// Python object protocol

std::optional<Value> Interpreter::python_attribute(const Value& obj, std::string_view name) {
  if (is_dunder(name)) return unsafe_undefined(obj, name);
  switch (obj.kind()) {
    case Kind::kNamespace:
      if (const Value* v = obj.as_namespace().attrs.find(name)) return *v;
      return std::nullopt;
    case Kind::kObject:
      return obj.as_object().attribute(name);
    case Kind::kUndefined:
      obj.raise_undefined();
    default:
      return builtin_attribute(obj, name);
  }
}

Value Interpreter::getattr(const Value& obj, std::string_view name) {
  if (obj.is_undefined()) obj.raise_undefined();
  if (std::optional<Value> a = python_attribute(obj, name)) return std::move(*a);
  if (obj.is_dict())
    if (const Value* v = obj.as_dict().find(name)) return *v;
  return Value::undefined(repr_string(obj.object_type_repr()) + " has no attribute " +
                          repr_string(name));
}

Value Interpreter::getitem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) obj.raise_undefined();
  // obj[key]; a TypeError or LookupError falls through to the attribute, then to Undefined.
  if (obj.is_dict()) {
    if (py_hashable(key))
      if (const Value* v = obj.as_dict().find(key)) return *v;
  } else if (key.is_integral() &&
             (obj.is_string() || (obj.is_seq() && (obj.as_seq().kind == SeqKind::kList ||
                                                   obj.as_seq().kind == SeqKind::kTuple ||
                                                   obj.as_seq().kind == SeqKind::kRange)))) {
    const int64_t n = length(obj);
    int64_t i = key.as_int();
    if (i < 0) i += n;
    if (i >= 0 && i < n) {
      if (obj.is_seq()) return obj.as_seq().items[static_cast<size_t>(i)];
      const std::string& s = obj.as_string();
      charge_bytes(s.size());
      if (unicode::is_ascii(s)) return Value(s.substr(static_cast<size_t>(i), 1));
      const std::u32string cps = unicode::decode(s);
      return Value(unicode::encode(cps.substr(static_cast<size_t>(i), 1)));
    }
  }
  if (key.is_string())
    if (std::optional<Value> a = python_attribute(obj, key.as_string())) return std::move(*a);
  if (key.is_string())
    return Value::undefined(repr_string(obj.object_type_repr()) + " has no attribute " +
                            repr_string(key.as_string()));
  return Value::undefined(obj.object_type_repr() + " has no element " + repr(key));
}

Value Interpreter::slice(const Value& obj, const Value& start, const Value& stop,
                         const Value& step_v) {
  if (obj.is_undefined()) obj.raise_undefined();
  const bool sliceable =
      obj.is_string() || (obj.is_seq() && (obj.as_seq().kind == SeqKind::kList ||
                                           obj.as_seq().kind == SeqKind::kTuple ||
                                           obj.as_seq().kind == SeqKind::kRange));
  // jinja2 compiles x[a:b] to plain Python slicing (not through its getitem), so errors are
  // Python's TypeErrors rather than an Undefined.
  if (!sliceable) {
    if (obj.is_dict()) raise("TypeError", "unhashable type: 'slice'");
    raise("TypeError", "'" + obj.type_name() + "' object is not subscriptable");
  }
  auto bound_ok = [](const Value& v) { return v.is_none() || v.is_integral(); };
  if (!bound_ok(start) || !bound_ok(stop) || !bound_ok(step_v))
    raise("TypeError", "slice indices must be integers or None or have an __index__ method");
  // slice.indices(len)
  const int64_t n = length(obj);
  const int64_t stride = step_v.is_none() ? 1 : step_v.as_int();
  if (stride == 0) raise("ValueError", "slice step cannot be zero");
  const int64_t lower = stride > 0 ? 0 : -1;
  const int64_t upper = stride > 0 ? n : n - 1;
  auto clamp = [&](const Value& v, int64_t dflt) {
    if (v.is_none()) return dflt;
    int64_t x = v.as_int();
    if (x < 0) {
      x += n;
      if (x < lower) x = lower;
    } else if (x > upper) {
      x = upper;
    }
    return x;
  };
  const int64_t b = clamp(start, stride > 0 ? lower : upper);
  const int64_t e = clamp(stop, stride > 0 ? upper : lower);
  // 128-bit steps: b and e lie in [-1, n], but a huge stride would overflow 64 bits.
  std::vector<size_t> picks;
  for (__int128 i = b; stride > 0 ? i < e : i > e; i += stride)
    picks.push_back(static_cast<size_t>(i));
  step(picks.size() / 8);
  if (obj.is_string()) {
    const std::string& s = obj.as_string();
    charge_bytes(s.size());
    std::string out;
    if (unicode::is_ascii(s)) {
      for (size_t i : picks) out.push_back(s[i]);
    } else {
      const std::u32string cps = unicode::decode(s);
      for (size_t i : picks) unicode::append(cps[i], out);
    }
    return obj.is_markup() ? make_markup(std::move(out)) : make_string(std::move(out));
  }
  std::vector<Value> items;
  items.reserve(picks.size());
  for (size_t i : picks) items.push_back(obj.as_seq().items[i]);
  const SeqKind kind = obj.as_seq().kind;
  if (kind == SeqKind::kRange) {
    // A slice of a range is a range.
    Value r = make_seq(std::move(items), SeqKind::kRange);
    Sequence& rs = r.as_seq();
    const Sequence& src = obj.as_seq();
    rs.range_step = src.range_step * stride;
    rs.range_start = src.range_start + b * src.range_step;
    rs.range_stop = src.range_start + e * src.range_step;
    return r;
  }
  return make_seq(std::move(items), kind);
}

std::vector<Value> Interpreter::iterate(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return {};
    case Kind::kString: {
      const std::string& s = v.as_string();
      // One value per character: refuse what would not fit in a list anyway.
      if (unicode::length(s) > options_.limits.max_items)
        raise("LimitError", "iterating a string of more than " +
                                std::to_string(options_.limits.max_items) + " characters");
      std::vector<Value> out;
      out.reserve(s.size());
      if (unicode::is_ascii(s)) {
        for (char c : s) out.emplace_back(std::string(1, c));
      } else {
        for (char32_t c : unicode::decode(s)) {
          std::string one;
          unicode::append(c, one);
          out.emplace_back(std::move(one));
        }
      }
      step(out.size() / 8);
      return out;
    }
    case Kind::kSeq: {
      Sequence& s = v.as_seq();
      if (s.kind == SeqKind::kGenerator) {
        if (s.consumed) return {};
        s.consumed = true;
      }
      step(s.items.size() / 8);
      return s.items;
    }
    case Kind::kDict: {
      std::vector<Value> keys;
      keys.reserve(v.as_dict().size());
      for (const auto& kv : v.as_dict().entries) keys.push_back(kv.first);
      step(keys.size() / 8);
      return keys;
    }
    default:
      raise("TypeError", "'" + v.type_name() + "' object is not iterable");
  }
}

int64_t Interpreter::length(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return 0;
    case Kind::kString:
      charge_bytes(v.as_string().size());
      return static_cast<int64_t>(unicode::length(v.as_string()));
    case Kind::kSeq:
      if (v.as_seq().kind == SeqKind::kGenerator)
        raise("TypeError", "object of type 'generator' has no len()");
      return static_cast<int64_t>(v.as_seq().items.size());
    case Kind::kDict:
      return static_cast<int64_t>(v.as_dict().size());
    default:
      raise("TypeError", "object of type '" + v.type_name() + "' has no len()");
  }
}

bool Interpreter::contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::kUndefined:
      return false;  // iterating an Undefined yields nothing
    case Kind::kString:
      if (!item.is_string())
        raise("TypeError",
              "'in <string>' requires string as left operand, not " + item.type_name());
      charge_bytes(container.as_string().size() + item.as_string().size());
      return unicode::find_substring<char>(container.as_string(), item.as_string()) !=
             std::string::npos;
    case Kind::kDict:
      require_hashable(item);
      step(item.weight() / 8);
      return container.as_dict().find(item) != nullptr;
    case Kind::kSeq: {
      Sequence& s = container.as_seq();
      step(s.weight / 8);
      if (s.kind == SeqKind::kGenerator) {
        // `in` consumes the iterator up to the match; what follows it stays for the next use.
        if (s.consumed) return false;
        for (size_t i = 0; i < s.items.size(); ++i) {
          if (py_equal(s.items[i], item)) {
            s.items.erase(s.items.begin(), s.items.begin() + static_cast<std::ptrdiff_t>(i) + 1);
            return true;
          }
        }
        s.consumed = true;
        return false;
      }
      for (const Value& x : s.items)
        if (py_equal(x, item)) return true;
      return false;
    }
    default:
      raise("TypeError", "argument of type '" + container.type_name() + "' is not iterable");
  }
}

Value Interpreter::binary(BinOp op, const Value& a, const Value& b) {
  static constexpr const char* kSymbols[] = {"+", "-", "*", "/", "//", "%", "** or pow()"};
  if (a.is_undefined()) a.raise_undefined();
  // str % x formats x without touching it first (an Undefined argument prints as "").
  if (op == BinOp::kMod && a.is_string()) return percent_format(*this, a, b);
  if (b.is_undefined()) b.raise_undefined();
  auto unsupported = [&]() -> Value {
    raise("TypeError", std::string("unsupported operand type(s) for ") +
                           kSymbols[static_cast<int>(op)] + ": " + operand_types(a, b));
  };
  const bool ints = a.is_integral() && b.is_integral();
  const bool nums = a.is_number() && b.is_number();
  switch (op) {
    case BinOp::kAdd: {
      if (ints) {
        int64_t r = 0;
        const bool overflow = __builtin_add_overflow(a.as_int(), b.as_int(), &r);
        return Value(checked_int(!overflow, r));
      }
      if (nums) return Value(a.as_double() + b.as_double());
      if (a.is_string()) {
        if (!b.is_string())
          raise("TypeError", "can only concatenate str (not \"" + b.type_name() + "\") to str");
        check_string_size(a.as_string().size() + b.as_string().size());
        // markupsafe: Markup + str escapes the str (and str + Markup, via Markup.__radd__).
        if (a.is_markup() || b.is_markup()) {
          return make_markup((a.is_markup() ? a.as_string() : html_escape(a.as_string())) +
                             (b.is_markup() ? b.as_string() : html_escape(b.as_string())));
        }
        return make_string(a.as_string() + b.as_string());
      }
      if (a.is_seq(SeqKind::kList) || a.is_seq(SeqKind::kTuple)) {
        const SeqKind k = a.as_seq().kind;
        if (!b.is_seq(k)) {
          const char* name = k == SeqKind::kList ? "list" : "tuple";
          raise("TypeError", std::string("can only concatenate ") + name + " (not \"" +
                                 b.type_name() + "\") to " + name);
        }
        std::vector<Value> items = a.as_seq().items;
        items.insert(items.end(), b.as_seq().items.begin(), b.as_seq().items.end());
        return make_seq(std::move(items), k);
      }
      return unsupported();
    }
    case BinOp::kSub:
      if (ints) {
        int64_t r = 0;
        const bool overflow = __builtin_sub_overflow(a.as_int(), b.as_int(), &r);
        return Value(checked_int(!overflow, r));
      }
      if (nums) return Value(a.as_double() - b.as_double());
      return unsupported();
    case BinOp::kMul: {
      if (ints) {
        int64_t r = 0;
        const bool overflow = __builtin_mul_overflow(a.as_int(), b.as_int(), &r);
        return Value(checked_int(!overflow, r));
      }
      if (nums) return Value(a.as_double() * b.as_double());
      // sequence * int repeats it
      const Value* seq = nullptr;
      const Value* count = nullptr;
      if (b.is_integral()) {
        seq = &a;
        count = &b;
      } else if (a.is_integral()) {
        seq = &b;
        count = &a;
      }
      if (seq && count) {
        const int64_t n = std::max<int64_t>(0, count->as_int());
        if (seq->is_string()) {
          const std::string& s = seq->as_string();
          if (!s.empty() && static_cast<uint64_t>(n) > options_.limits.max_output_bytes / s.size())
            check_string_size(options_.limits.max_output_bytes + 1);
          std::string out;
          out.reserve(s.size() * static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) out += s;
          return seq->is_markup() ? make_markup(std::move(out)) : make_string(std::move(out));
        }
        if (seq->is_seq(SeqKind::kList) || seq->is_seq(SeqKind::kTuple)) {
          const auto& src = seq->as_seq().items;
          if (!src.empty() && static_cast<uint64_t>(n) > options_.limits.max_items / src.size())
            raise("LimitError", "a list would have more than " +
                                    std::to_string(options_.limits.max_items) + " items");
          std::vector<Value> items;
          for (int64_t i = 0; i < n; ++i) items.insert(items.end(), src.begin(), src.end());
          return make_seq(std::move(items), seq->as_seq().kind);
        }
      }
      // str, list and tuple repeat only by an int (bool included).
      auto repeatable = [](const Value& v) {
        return v.is_string() || v.is_seq(SeqKind::kList) || v.is_seq(SeqKind::kTuple);
      };
      if (repeatable(a) && !b.is_integral())
        raise("TypeError", "can't multiply sequence by non-int of type '" + b.type_name() + "'");
      if (repeatable(b) && !a.is_integral())
        raise("TypeError", "can't multiply sequence by non-int of type '" + a.type_name() + "'");
      return unsupported();
    }
    case BinOp::kDiv:
      if (nums) {
        if (b.as_double() == 0.0 && (b.is_integral() || b.is_float()))
          raise("ZeroDivisionError", ints ? "division by zero" : "float division by zero");
        return Value(a.as_double() / b.as_double());
      }
      return unsupported();
    case BinOp::kFloorDiv:
      if (ints) {
        const int64_t x = a.as_int(), y = b.as_int();
        if (y == 0) raise("ZeroDivisionError", "integer division or modulo by zero");
        if (x == std::numeric_limits<int64_t>::min() && y == -1) checked_int(false, 0);
        int64_t q = x / y;
        if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
        return Value(q);
      }
      if (nums) {
        if (b.as_double() == 0.0) raise("ZeroDivisionError", "float floor division by zero");
        return Value(py_floordiv(a.as_double(), b.as_double()));
      }
      return unsupported();
    case BinOp::kMod:
      if (ints) {
        const int64_t x = a.as_int(), y = b.as_int();
        if (y == 0) raise("ZeroDivisionError", "integer modulo by zero");
        if (y == -1) return Value(static_cast<int64_t>(0));
        int64_t r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) r += y;
        return Value(r);
      }
      if (nums) {
        if (b.as_double() == 0.0) raise("ZeroDivisionError", "float modulo");
        return Value(py_fmod(a.as_double(), b.as_double()));
      }
      return unsupported();
    case BinOp::kPow: {
      if (ints && b.as_int() >= 0) {
        int64_t base = a.as_int(), e = b.as_int(), r = 1;
        while (e > 0) {
          if (e & 1) {
            const bool overflow = __builtin_mul_overflow(r, base, &r);
            checked_int(!overflow, r);
          }
          e >>= 1;
          if (e > 0) {
            const bool overflow = __builtin_mul_overflow(base, base, &base);
            checked_int(!overflow, base);
          }
        }
        return Value(r);
      }
      if (nums) {
        const double x = a.as_double(), y = b.as_double();
        if (x == 0.0 && y < 0)
          raise("ZeroDivisionError", "0.0 cannot be raised to a negative power");
        if (x < 0 && y != std::floor(y))
          raise("ValueError",
                "a negative number to a fractional power has a complex result, "
                "which tandem's Jinja does not support");
        const double r = std::pow(x, y);
        if (std::isinf(r) && std::isfinite(x) && std::isfinite(y))
          raise("OverflowError", "(34, 'Numerical result out of range')");
        return Value(r);
      }
      return unsupported();
    }
  }
  return unsupported();
}

}  // namespace tandem::jinja
