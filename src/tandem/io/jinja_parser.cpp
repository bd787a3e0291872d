#include "tandem/io/jinja_parser.h"

#include <algorithm>
#include <initializer_list>
#include <map>
#include <set>

#include "tandem/io/jinja_interpreter.h"
#include "tandem/io/jinja_lexer.h"

namespace tandem::jinja {
namespace {

using Names = std::initializer_list<std::string_view>;

class Parser {
 public:
  Parser(const std::string& source, const std::string& name)
      : src_(source), name_(name), tokens_(tokenize(source, name)) {}

  Body parse() {
    Body body = subparse(nullptr);
    return body;
  }

 private:
  // ---- token stream -------------------------------------------------------------------------

  const Token& cur() const { return tokens_[idx_]; }
  const Token& look() const { return tokens_[std::min(idx_ + 1, tokens_.size() - 1)]; }
  const Token& next() {
    const Token& t = tokens_[idx_];
    if (idx_ + 1 < tokens_.size()) ++idx_;
    return t;
  }
  bool is(Tok t) const { return cur().type == t; }
  bool is_name(std::string_view n) const { return cur().type == Tok::kName && cur().text == n; }
  bool skip(Tok t) {
    if (!is(t)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }

  [[noreturn]] void fail(const std::string& message, uint32_t offset) const {
    syntax_error(name_, src_, offset, message);
  }
  [[noreturn]] void fail(const std::string& message) const { fail(message, cur().offset); }

  static std::string quoted(const std::string& s) { return repr_string(s); }

  const Token& expect(Tok t) {
    if (!is(t)) {
      if (is(Tok::kEof)) fail("unexpected end of template, expected " + quoted(describe(t)) + ".");
      fail("expected token " + quoted(describe(t)) + ", got " + quoted(describe_token(cur())));
    }
    return next();
  }
  const Token& expect_name(std::string_view n) {
    if (!is_name(n)) {
      if (is(Tok::kEof)) fail("unexpected end of template, expected '" + std::string(n) + "'.");
      fail("expected token '" + std::string(n) + "', got " + quoted(describe_token(cur())));
    }
    return next();
  }
  static std::string describe(Tok t) {
    Token tok;
    tok.type = t;
    if (t == Tok::kName) return "name";
    return describe_token(tok);
  }

  // ---- nesting guards -----------------------------------------------------------------------

  // Bounds the parser's own recursion (parentheses, unary chains, nested literals), so that
  // hostile input cannot overflow the stack.
  struct Nest {
    Parser& p;
    Nest(Parser& parser, uint32_t limit, const char* what) : p(parser) {
      if (++p.nesting_ > limit)
        p.fail(std::string(what) + " nested too deeply (more than " + std::to_string(limit) +
               " levels)");
    }
    ~Nest() { --p.nesting_; }
  };

  template <class T>
  std::unique_ptr<T> depth_checked(std::unique_ptr<T> e, std::initializer_list<const Expr*> kids) {
    uint32_t d = 0;
    for (const Expr* k : kids)
      if (k) d = std::max(d, k->depth);
    e->depth = d + 1;
    if (e->depth > kMaxExprDepth)
      fail("expression nested too deeply (more than " + std::to_string(kMaxExprDepth) + " levels)",
           e->offset);
    return e;
  }
  uint32_t args_depth(const ArgList& a) const {
    uint32_t d = 0;
    for (const auto& e : a.args) d = std::max(d, e->depth);
    for (const auto& kv : a.kwargs) d = std::max(d, kv.second->depth);
    if (a.dyn_args) d = std::max(d, a.dyn_args->depth);
    if (a.dyn_kwargs) d = std::max(d, a.dyn_kwargs->depth);
    return d;
  }
  template <class T>
  std::unique_ptr<T> with_depth(std::unique_ptr<T> e, uint32_t child_depth) {
    e->depth = child_depth + 1;
    if (e->depth > kMaxExprDepth)
      fail("expression nested too deeply (more than " + std::to_string(kMaxExprDepth) + " levels)",
           e->offset);
    return e;
  }

  // ---- statements ---------------------------------------------------------------------------

  // Statements until one of `end` (a block tag whose name is in it), or the end of the template.
  Body subparse(const std::vector<std::string>* end) {
    Body body;
    while (!is(Tok::kEof)) {
      const Token& t = cur();
      if (t.type == Tok::kData) {
        body.push_back(std::make_unique<DataStmt>(t.offset, t.text));
        next();
      } else if (t.type == Tok::kVariableBegin) {
        const uint32_t offset = next().offset;
        ExprPtr e = parse_tuple(false, true, {}, false);
        body.push_back(std::make_unique<OutputStmt>(offset, std::move(e)));
        expect(Tok::kVariableEnd);
      } else if (t.type == Tok::kBlockBegin) {
        next();
        if (end && is(Tok::kName) && std::find(end->begin(), end->end(), cur().text) != end->end())
          return body;
        body.push_back(parse_statement());
        expect(Tok::kBlockEnd);
      } else {
        fail("internal parser error: unexpected " + quoted(describe_token(t)));
      }
    }
    return body;
  }

  // The body of a block statement, up to one of `end`; the current token is left on the end
  // tag's name (or consumed, with drop_needle).
  Body parse_statements(std::vector<std::string> end, bool drop_needle) {
    skip(Tok::kColon);  // "{% for x in y: %}" is allowed for Python compatibility
    expect(Tok::kBlockEnd);
    end_stack_.push_back(end);  // for error messages; `end` itself stays valid while nested
    Body body = subparse(&end);
    end_stack_.pop_back();
    if (is(Tok::kEof)) fail_eof(end);
    if (drop_needle) next();
    return body;
  }

  std::string describe_end(const std::vector<std::string>& names) const {
    std::string s;
    for (size_t i = 0; i < names.size(); ++i) {
      if (i) s += " or ";
      s += quoted(names[i]);
    }
    return s;
  }

  // jinja2's message for an unknown tag or a missing end tag.
  [[noreturn]] void fail_unknown(const std::string* tag, uint32_t offset) const {
    std::string message = tag ? "Encountered unknown tag " + quoted(*tag) + "."
                              : std::string("Unexpected end of template.");
    if (!end_stack_.empty()) {
      bool expected = false;
      if (tag)
        for (const auto& names : end_stack_)
          expected |= std::find(names.begin(), names.end(), *tag) != names.end();
      if (expected)
        message +=
            " You probably made a nesting mistake. Jinja is expecting this tag, but "
            "currently looking for " +
            describe_end(end_stack_.back()) + ".";
      else
        message +=
            " Jinja was looking for the following tags: " + describe_end(end_stack_.back()) + ".";
    }
    if (!tag_stack_.empty())
      message +=
          " The innermost block that needs to be closed is " + quoted(tag_stack_.back()) + ".";
    fail(message, offset);
  }
  [[noreturn]] void fail_eof(const std::vector<std::string>& end) {
    end_stack_.push_back(end);
    fail_unknown(nullptr, cur().offset);
  }

  StmtPtr parse_statement() {
    const Token& t = cur();
    if (t.type != Tok::kName) fail("tag name expected");
    Nest nest(*this, kMaxStmtDepth, "statements");
    const std::string tag = t.text;
    tag_stack_.push_back(tag);
    StmtPtr s;
    if (tag == "for") {
      s = parse_for();
    } else if (tag == "if") {
      s = parse_if();
    } else if (tag == "set") {
      s = parse_set();
    } else if (tag == "macro") {
      s = parse_macro();
    } else if (tag == "call") {
      s = parse_call_block();
    } else if (tag == "filter") {
      s = parse_filter_block();
    } else if (tag == "with") {
      s = parse_with();
    } else if (tag == "print") {
      const uint32_t offset = next().offset;
      s = std::make_unique<OutputStmt>(offset, parse_tuple(false, true, {}, false));
    } else if (tag == "break" || tag == "continue") {
      const uint32_t offset = next().offset;
      // jinja2 leaves this to Python's compiler: "SyntaxError: 'break' outside loop".
      if (loop_depth_ == 0) fail("'" + tag + "' outside loop", offset);
      s = std::make_unique<LoopControlStmt>(tag == "break" ? StmtKind::kBreak : StmtKind::kContinue,
                                            offset);
    } else if (tag == "generation") {
      const uint32_t offset = next().offset;
      auto scope = std::make_unique<ScopeStmt>(offset);
      scope->body = parse_statements({"endgeneration"}, true);
      s = std::move(scope);
    } else if (tag == "block") {
      const uint32_t offset = next().offset;
      const std::string block_name = expect(Tok::kName).text;
      skip_name("scoped");
      skip_name("required");
      auto scope = std::make_unique<ScopeStmt>(offset);
      scope->body = parse_statements({"endblock"}, true);
      if (is(Tok::kName)) {
        if (cur().text != block_name)
          fail("'" + block_name + "' block ended with 'endblock " + cur().text + "'");
        next();
      }
      s = std::move(scope);
    } else if (tag == "extends" || tag == "include" || tag == "import" || tag == "from") {
      fail("'" + tag +
               "' needs a template loader, which the chat-template environment does not have",
           t.offset);
    } else if (tag == "autoescape") {
      fail("'autoescape' blocks are not supported (chat templates render without escaping)",
           t.offset);
    } else {
      tag_stack_.pop_back();  // jinja2 names the enclosing block, not the unknown tag
      fail_unknown(&tag, t.offset);
    }
    tag_stack_.pop_back();
    return s;
  }

  StmtPtr parse_for() {
    auto s = std::make_unique<ForStmt>(next().offset);
    s->target = parse_assign_target(true, false, {"in"}, false);
    expect_name("in");
    s->iter = parse_tuple(false, false, {"recursive"}, false);
    if (skip_name("if")) s->filter = parse_expression(true);
    s->recursive = skip_name("recursive");
    ++loop_depth_;
    s->body = parse_statements({"endfor", "else"}, false);
    --loop_depth_;
    if (next().text != "endfor") s->else_body = parse_statements({"endfor"}, true);
    return s;
  }

  StmtPtr parse_if() {
    auto s = std::make_unique<IfStmt>(next().offset);
    while (true) {
      ExprPtr test = parse_tuple(false, false, {}, false);
      Body body = parse_statements({"elif", "else", "endif"}, false);
      s->branches.emplace_back(std::move(test), std::move(body));
      const Token& t = next();
      if (t.text == "elif") continue;
      if (t.text == "else") s->else_body = parse_statements({"endif"}, true);
      break;
    }
    return s;
  }

  StmtPtr parse_set() {
    const uint32_t offset = next().offset;
    Target target = parse_assign_target(true, false, {}, true);
    if (skip(Tok::kAssign)) {
      auto s = std::make_unique<SetStmt>(offset);
      s->target = std::move(target);
      s->value = parse_tuple(false, true, {}, false);
      return s;
    }
    auto s = std::make_unique<SetBlockStmt>(offset);
    s->target = std::move(target);
    if (is(Tok::kPipe)) s->filter = parse_filter(nullptr, false);
    s->body = parse_statements({"endset"}, true);
    return s;
  }

  void parse_signature(MacroDef& def) {
    expect(Tok::kLParen);
    while (!is(Tok::kRParen)) {
      if (!def.params.empty()) expect(Tok::kComma);
      const std::string param = expect(Tok::kName).text;
      if (skip(Tok::kAssign))
        def.defaults.push_back(parse_expression(true));
      else if (!def.defaults.empty())
        fail("non-default argument follows default argument");
      def.params.push_back(param);
    }
    expect(Tok::kRParen);
  }

  // A macro body is not inside the loops around its definition.
  Body parse_macro_body(const char* end) {
    const int saved = loop_depth_;
    loop_depth_ = 0;
    Body body = parse_statements({end}, true);
    loop_depth_ = saved;
    return body;
  }

  StmtPtr parse_macro() {
    auto s = std::make_unique<MacroStmt>(next().offset);
    s->def.offset = s->offset;
    s->def.name = expect(Tok::kName).text;
    parse_signature(s->def);
    s->def.body = parse_macro_body("endmacro");
    finish_macro(s->def);
    return s;
  }

  StmtPtr parse_call_block() {
    auto s = std::make_unique<CallBlockStmt>(next().offset);
    s->caller.name = "caller";
    s->caller.offset = s->offset;
    if (is(Tok::kLParen)) parse_signature(s->caller);
    s->call = parse_expression(true);
    if (s->call->kind != ExprKind::kCall) fail("expected call", s->offset);
    s->caller.body = parse_macro_body("endcall");
    finish_macro(s->caller);
    return s;
  }

  StmtPtr parse_filter_block() {
    auto s = std::make_unique<FilterBlockStmt>(next().offset);
    s->filter = parse_filter(nullptr, true);
    s->body = parse_statements({"endfilter"}, true);
    return s;
  }

  StmtPtr parse_with() {
    auto s = std::make_unique<WithStmt>(next().offset);
    while (!is(Tok::kBlockEnd)) {
      if (!s->targets.empty()) expect(Tok::kComma);
      s->targets.push_back(parse_assign_target(true, false, {}, false));
      expect(Tok::kAssign);
      s->values.push_back(parse_expression(true));
    }
    s->body = parse_statements({"endwith"}, true);
    return s;
  }

  // Which of caller/kwargs/varargs the body reads (jinja2's find_undeclared), minus explicit
  // parameters of those names.
  void finish_macro(MacroDef& def) {
    std::set<std::string> found;
    find_names_in(def.body, found);
    auto param = [&](const char* n) {
      return std::find(def.params.begin(), def.params.end(), n) != def.params.end();
    };
    if (found.count("caller")) {
      const auto it = std::find(def.params.begin(), def.params.end(), "caller");
      if (it != def.params.end()) {
        const size_t idx = static_cast<size_t>(it - def.params.begin());
        if (idx < def.params.size() - def.defaults.size())
          fail(
              "When defining macros or call blocks the special \"caller\" argument must be "
              "omitted or be given a default.",
              def.offset);
      } else {
        def.uses_caller = true;
      }
    }
    def.uses_kwargs = found.count("kwargs") && !param("kwargs");
    def.uses_varargs = found.count("varargs") && !param("varargs");
  }

  // ---- assignment targets -------------------------------------------------------------------

  Target parse_assign_target(bool with_tuple, bool name_only, Names extra_end,
                             bool with_namespace) {
    Target t;
    t.offset = cur().offset;
    if (with_namespace && look().type == Tok::kDot) {
      t.kind = Target::Kind::kNamespaceAttr;
      t.name = expect(Tok::kName).text;
      next();  // the dot
      t.attr = expect(Tok::kName).text;
      return t;
    }
    if (name_only) {
      t.name = expect(Tok::kName).text;
      return t;
    }
    ExprPtr e = with_tuple ? parse_tuple(true, true, extra_end, false) : parse_primary();
    return to_target(*e);
  }

  Target to_target(const Expr& e) {
    Target t;
    t.offset = e.offset;
    if (e.kind == ExprKind::kName) {
      t.name = static_cast<const NameExpr&>(e).name;
      return t;
    }
    if (e.kind == ExprKind::kTuple) {
      t.kind = Target::Kind::kTuple;
      for (const auto& item : static_cast<const ListExpr&>(e).items)
        t.items.push_back(to_target(*item));
      return t;
    }
    static constexpr const char* kNames[] = {"const",   "name",    "list",  "tuple", "dict",
                                             "getattr", "getitem", "slice", "call",  "filter",
                                             "test",    "neg",     "pos",   "not",   "binary",
                                             "concat",  "compare", "and",   "or",    "condexpr"};
    fail(std::string("can't assign to '") + kNames[static_cast<int>(e.kind)] + "'", e.offset);
  }

  // ---- expressions --------------------------------------------------------------------------

  bool is_tuple_end(Names extra_end) const {
    if (is(Tok::kVariableEnd) || is(Tok::kBlockEnd) || is(Tok::kRParen)) return true;
    for (std::string_view n : extra_end)
      if (is_name(n)) return true;
    return false;
  }

  // jinja2's parse_tuple: one expression, or a tuple when there are commas. `simplified` parses
  // only primaries (assignment targets).
  ExprPtr parse_tuple(bool simplified, bool with_condexpr, Names extra_end,
                      bool explicit_parentheses) {
    const uint32_t offset = cur().offset;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect(Tok::kComma);
      if (is_tuple_end(extra_end)) break;
      items.push_back(simplified ? parse_primary() : parse_expression(with_condexpr));
      if (is(Tok::kComma))
        is_tuple = true;
      else
        break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses)
        fail("Expected an expression, got " + quoted(describe_token(cur())));
    }
    auto t = std::make_unique<ListExpr>(ExprKind::kTuple, offset);
    uint32_t d = 0;
    for (const auto& i : items) d = std::max(d, i->depth);
    t->items = std::move(items);
    return with_depth(std::move(t), d);
  }

  ExprPtr parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    Nest nest(*this, kMaxExprDepth, "expression");
    const uint32_t offset = cur().offset;
    ExprPtr expr1 = parse_or();
    while (is_name("if")) {
      uint32_t line = 0, col = 0;
      line_col(src_, next().offset, line, col);
      ExprPtr test = parse_or();
      ExprPtr otherwise;
      if (skip_name("else")) otherwise = parse_condexpr();
      const uint32_t d = std::max({test->depth, expr1->depth, otherwise ? otherwise->depth : 0u});
      auto c = std::make_unique<CondExpr>(offset, std::move(test), std::move(expr1),
                                          std::move(otherwise));
      c->line = line;
      expr1 = with_depth(std::move(c), d);
    }
    return expr1;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const uint32_t offset = next().offset;
      ExprPtr right = parse_and();
      const Expr* l = left.get();
      const Expr* r = right.get();
      left = depth_checked(
          std::make_unique<LogicalExpr>(ExprKind::kOr, offset, std::move(left), std::move(right)),
          {l, r});
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const uint32_t offset = next().offset;
      ExprPtr right = parse_not();
      const Expr* l = left.get();
      const Expr* r = right.get();
      left = depth_checked(
          std::make_unique<LogicalExpr>(ExprKind::kAnd, offset, std::move(left), std::move(right)),
          {l, r});
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      Nest nest(*this, kMaxExprDepth, "expression");
      const uint32_t offset = next().offset;
      ExprPtr operand = parse_not();
      const Expr* o = operand.get();
      return depth_checked(std::make_unique<UnaryExpr>(ExprKind::kNot, offset, std::move(operand)),
                           {o});
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const uint32_t offset = cur().offset;
    ExprPtr first = parse_math1();
    std::vector<std::pair<CmpOp, ExprPtr>> rest;
    while (true) {
      CmpOp op;
      switch (cur().type) {
        case Tok::kEq:
          op = CmpOp::kEq;
          break;
        case Tok::kNe:
          op = CmpOp::kNe;
          break;
        case Tok::kLt:
          op = CmpOp::kLt;
          break;
        case Tok::kLe:
          op = CmpOp::kLe;
          break;
        case Tok::kGt:
          op = CmpOp::kGt;
          break;
        case Tok::kGe:
          op = CmpOp::kGe;
          break;
        default:
          if (is_name("in")) {
            op = CmpOp::kIn;
          } else if (is_name("not") && look().type == Tok::kName && look().text == "in") {
            next();
            op = CmpOp::kNotIn;
          } else {
            op = CmpOp::kEq;
            goto done;
          }
      }
      next();
      rest.emplace_back(op, parse_math1());
    }
  done:
    if (rest.empty()) return first;
    auto c = std::make_unique<CompareExpr>(offset, std::move(first));
    uint32_t d = c->first->depth;
    for (const auto& r : rest) d = std::max(d, r.second->depth);
    c->rest = std::move(rest);
    return with_depth(std::move(c), d);
  }

  ExprPtr binary(BinOp op, uint32_t offset, ExprPtr left, ExprPtr right) {
    const Expr* l = left.get();
    const Expr* r = right.get();
    return depth_checked(
        std::make_unique<BinaryExpr>(offset, op, std::move(left), std::move(right)), {l, r});
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is(Tok::kAdd) || is(Tok::kSub)) {
      const BinOp op = is(Tok::kAdd) ? BinOp::kAdd : BinOp::kSub;
      const uint32_t offset = next().offset;
      left = binary(op, offset, std::move(left), parse_concat());
    }
    return left;
  }

  ExprPtr parse_concat() {
    const uint32_t offset = cur().offset;
    ExprPtr first = parse_math2();
    if (!is(Tok::kTilde)) return first;
    auto c = std::make_unique<ConcatExpr>(offset);
    c->items.push_back(std::move(first));
    while (skip(Tok::kTilde)) c->items.push_back(parse_math2());
    uint32_t d = 0;
    for (const auto& i : c->items) d = std::max(d, i->depth);
    return with_depth(std::move(c), d);
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is(Tok::kMul) || is(Tok::kDiv) || is(Tok::kFloorDiv) || is(Tok::kMod)) {
      const BinOp op = is(Tok::kMul)        ? BinOp::kMul
                       : is(Tok::kDiv)      ? BinOp::kDiv
                       : is(Tok::kFloorDiv) ? BinOp::kFloorDiv
                                            : BinOp::kMod;
      const uint32_t offset = next().offset;
      left = binary(op, offset, std::move(left), parse_pow());
    }
    return left;
  }

  // ** is left-associative in Jinja (2 ** 3 ** 2 == 64), unlike Python.
  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is(Tok::kPow)) {
      const uint32_t offset = next().offset;
      left = binary(BinOp::kPow, offset, std::move(left), parse_unary(true));
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    Nest nest(*this, kMaxExprDepth, "expression");
    ExprPtr node;
    if (is(Tok::kSub) || is(Tok::kAdd)) {
      const ExprKind k = is(Tok::kSub) ? ExprKind::kNeg : ExprKind::kPos;
      const uint32_t offset = next().offset;
      ExprPtr operand = parse_unary(false);
      const Expr* o = operand.get();
      node = depth_checked(std::make_unique<UnaryExpr>(k, offset, std::move(operand)), {o});
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    Nest nest(*this, kMaxExprDepth, "expression");
    const Token& t = cur();
    const uint32_t offset = t.offset;
    switch (t.type) {
      case Tok::kName: {
        const std::string& n = t.text;
        ExprPtr e;
        if (n == "true" || n == "True")
          e = std::make_unique<ConstExpr>(offset, Value(true));
        else if (n == "false" || n == "False")
          e = std::make_unique<ConstExpr>(offset, Value(false));
        else if (n == "none" || n == "None")
          e = std::make_unique<ConstExpr>(offset, Value::none());
        else
          e = std::make_unique<NameExpr>(offset, n);
        next();
        return e;
      }
      case Tok::kString: {
        std::string s = next().text;
        while (is(Tok::kString)) s += next().text;  // adjacent literals concatenate
        return std::make_unique<ConstExpr>(offset, Value(std::move(s)));
      }
      case Tok::kInteger:
        return std::make_unique<ConstExpr>(offset, Value(next().int_value));
      case Tok::kFloat:
        return std::make_unique<ConstExpr>(offset, Value(next().float_value));
      case Tok::kLParen: {
        next();
        ExprPtr e = parse_tuple(false, true, {}, true);
        expect(Tok::kRParen);
        return e;
      }
      case Tok::kLBracket: {
        next();
        auto l = std::make_unique<ListExpr>(ExprKind::kList, offset);
        while (!is(Tok::kRBracket)) {
          if (!l->items.empty()) expect(Tok::kComma);
          if (is(Tok::kRBracket)) break;
          l->items.push_back(parse_expression(true));
        }
        expect(Tok::kRBracket);
        uint32_t d = 0;
        for (const auto& i : l->items) d = std::max(d, i->depth);
        return with_depth(std::move(l), d);
      }
      case Tok::kLBrace: {
        next();
        auto m = std::make_unique<DictExpr>(offset);
        while (!is(Tok::kRBrace)) {
          if (!m->items.empty()) expect(Tok::kComma);
          if (is(Tok::kRBrace)) break;
          ExprPtr key = parse_expression(true);
          expect(Tok::kColon);
          m->items.emplace_back(std::move(key), parse_expression(true));
        }
        expect(Tok::kRBrace);
        uint32_t d = 0;
        for (const auto& kv : m->items) d = std::max({d, kv.first->depth, kv.second->depth});
        return with_depth(std::move(m), d);
      }
      default:
        if (t.type == Tok::kEof) fail("unexpected end of template");
        fail("unexpected " + quoted(describe_token(t)));
    }
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is(Tok::kDot) || is(Tok::kLBracket))
        node = parse_subscript(std::move(node));
      else if (is(Tok::kLParen))
        node = parse_call(std::move(node));
      else
        return node;
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is(Tok::kPipe))
        node = parse_filter(std::move(node), false);
      else if (is_name("is"))
        node = parse_test(std::move(node));
      else if (is(Tok::kLParen))
        node = parse_call(std::move(node));
      else
        return node;
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const Token& t = next();
    const uint32_t offset = t.offset;
    if (t.type == Tok::kDot) {
      const Token& attr = cur();
      if (attr.type == Tok::kName) {
        std::string name = next().text;
        const Expr* o = node.get();
        return depth_checked(
            std::make_unique<GetattrExpr>(offset, std::move(node), std::move(name)), {o});
      }
      if (attr.type != Tok::kInteger) fail("expected name or number");
      auto index = std::make_unique<ConstExpr>(attr.offset, Value(next().int_value));
      const Expr* o = node.get();
      return depth_checked(std::make_unique<GetitemExpr>(offset, std::move(node), std::move(index)),
                           {o});
    }
    std::vector<ExprPtr> args;
    while (!is(Tok::kRBracket)) {
      if (!args.empty()) expect(Tok::kComma);
      args.push_back(parse_subscribed());
    }
    expect(Tok::kRBracket);
    ExprPtr index;
    if (args.size() == 1) {
      index = std::move(args[0]);
    } else {
      auto t2 = std::make_unique<ListExpr>(ExprKind::kTuple, offset);
      uint32_t d = 0;
      for (const auto& a : args) d = std::max(d, a->depth);
      t2->items = std::move(args);
      index = with_depth(std::move(t2), d);
    }
    const Expr* o = node.get();
    const Expr* i = index.get();
    return depth_checked(std::make_unique<GetitemExpr>(offset, std::move(node), std::move(index)),
                         {o, i});
  }

  ExprPtr parse_subscribed() {
    const uint32_t offset = cur().offset;
    auto s = std::make_unique<SliceExpr>(offset);
    if (skip(Tok::kColon)) {
      // start is None
    } else {
      ExprPtr e = parse_expression(true);
      if (!is(Tok::kColon)) return e;
      next();
      s->start = std::move(e);
    }
    if (!is(Tok::kColon) && !is(Tok::kRBracket) && !is(Tok::kComma))
      s->stop = parse_expression(true);
    if (skip(Tok::kColon)) {
      if (!is(Tok::kRBracket) && !is(Tok::kComma)) s->step = parse_expression(true);
    }
    const uint32_t d = std::max({s->start ? s->start->depth : 0u, s->stop ? s->stop->depth : 0u,
                                 s->step ? s->step->depth : 0u});
    return with_depth(std::move(s), d);
  }

  void parse_call_args(ArgList& a) {
    const uint32_t offset = expect(Tok::kLParen).offset;
    auto ensure = [&](bool ok) {
      if (!ok) fail("invalid syntax for function call expression", offset);
    };
    bool require_comma = false;
    while (!is(Tok::kRParen)) {
      if (require_comma) {
        expect(Tok::kComma);
        if (is(Tok::kRParen)) break;  // trailing comma
      }
      if (is(Tok::kMul)) {
        ensure(!a.dyn_args && !a.dyn_kwargs);
        next();
        a.dyn_args = parse_expression(true);
      } else if (is(Tok::kPow)) {
        ensure(!a.dyn_kwargs);
        next();
        a.dyn_kwargs = parse_expression(true);
      } else if (is(Tok::kName) && look().type == Tok::kAssign) {
        ensure(!a.dyn_kwargs);
        std::string key = next().text;
        next();
        a.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        ensure(!a.dyn_args && !a.dyn_kwargs && a.kwargs.empty());
        a.args.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect(Tok::kRParen);
  }

  ExprPtr parse_call(ExprPtr node) {
    auto c = std::make_unique<CallExpr>(cur().offset, std::move(node));
    parse_call_args(c->args);
    const uint32_t d = std::max(c->callee->depth, args_depth(c->args));
    return with_depth(std::move(c), d);
  }

  // Filters are looked up after parsing (see check_names), as jinja2 does when compiling.
  ExprPtr parse_filter(ExprPtr node, bool start_inline) {
    while (is(Tok::kPipe) || start_inline) {
      if (!start_inline) next();
      start_inline = false;
      const Token& t = expect(Tok::kName);
      std::string name = t.text;
      const uint32_t offset = t.offset;
      while (skip(Tok::kDot)) name += "." + expect(Tok::kName).text;
      auto f = std::make_unique<FilterExpr>(offset, std::move(node), std::move(name));
      if (is(Tok::kLParen)) parse_call_args(f->args);
      const uint32_t d = std::max(f->operand ? f->operand->depth : 0u, args_depth(f->args));
      node = with_depth(std::move(f), d);
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    const uint32_t offset = next().offset;  // "is"
    const bool negated = skip_name("not");
    std::string name = expect(Tok::kName).text;
    while (skip(Tok::kDot)) name += "." + expect(Tok::kName).text;
    auto t = std::make_unique<TestExpr>(offset, std::move(node), std::move(name));
    if (is(Tok::kLParen)) {
      parse_call_args(t->args);
    } else if ((is(Tok::kName) || is(Tok::kString) || is(Tok::kInteger) || is(Tok::kFloat) ||
                is(Tok::kLParen) || is(Tok::kLBracket) || is(Tok::kLBrace)) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail("You cannot chain multiple tests with is");
      t->args.args.push_back(parse_postfix(parse_primary()));
    }
    const uint32_t d = std::max(t->operand->depth, args_depth(t->args));
    ExprPtr e = with_depth(std::move(t), d);
    if (negated) {
      const Expr* o = e.get();
      e = depth_checked(std::make_unique<UnaryExpr>(ExprKind::kNot, offset, std::move(e)), {o});
    }
    return e;
  }

  // ---- post-parse checks --------------------------------------------------------------------

 public:
  // The names an expression reads.
  static void collect_names(const Expr* e, std::set<std::string>& out) { find_names_expr(e, out); }

 private:
  static void find_names_expr(const Expr* e, std::set<std::string>& out);
  static void find_names_args(const ArgList& a, std::set<std::string>& out) {
    for (const auto& x : a.args) find_names_expr(x.get(), out);
    for (const auto& kv : a.kwargs) find_names_expr(kv.second.get(), out);
    find_names_expr(a.dyn_args.get(), out);
    find_names_expr(a.dyn_kwargs.get(), out);
  }
  static void find_names_in(const Body& body, std::set<std::string>& out);

  const std::string& src_;
  const std::string& name_;
  std::vector<Token> tokens_;
  size_t idx_ = 0;
  uint32_t nesting_ = 0;
  int loop_depth_ = 0;
  std::vector<std::string> tag_stack_;
  std::vector<std::vector<std::string>> end_stack_;
};

void Parser::find_names_expr(const Expr* e, std::set<std::string>& out) {
  if (!e) return;
  switch (e->kind) {
    case ExprKind::kConst:
      return;
    case ExprKind::kName:
      out.insert(static_cast<const NameExpr*>(e)->name);
      return;
    case ExprKind::kList:
    case ExprKind::kTuple:
      for (const auto& i : static_cast<const ListExpr*>(e)->items) find_names_expr(i.get(), out);
      return;
    case ExprKind::kDict:
      for (const auto& kv : static_cast<const DictExpr*>(e)->items) {
        find_names_expr(kv.first.get(), out);
        find_names_expr(kv.second.get(), out);
      }
      return;
    case ExprKind::kGetattr:
      find_names_expr(static_cast<const GetattrExpr*>(e)->obj.get(), out);
      return;
    case ExprKind::kGetitem:
      find_names_expr(static_cast<const GetitemExpr*>(e)->obj.get(), out);
      find_names_expr(static_cast<const GetitemExpr*>(e)->index.get(), out);
      return;
    case ExprKind::kSlice: {
      const auto* s = static_cast<const SliceExpr*>(e);
      find_names_expr(s->start.get(), out);
      find_names_expr(s->stop.get(), out);
      find_names_expr(s->step.get(), out);
      return;
    }
    case ExprKind::kCall:
      find_names_expr(static_cast<const CallExpr*>(e)->callee.get(), out);
      find_names_args(static_cast<const CallExpr*>(e)->args, out);
      return;
    case ExprKind::kFilter:
      find_names_expr(static_cast<const FilterExpr*>(e)->operand.get(), out);
      find_names_args(static_cast<const FilterExpr*>(e)->args, out);
      return;
    case ExprKind::kTest:
      find_names_expr(static_cast<const TestExpr*>(e)->operand.get(), out);
      find_names_args(static_cast<const TestExpr*>(e)->args, out);
      return;
    case ExprKind::kNeg:
    case ExprKind::kPos:
    case ExprKind::kNot:
      find_names_expr(static_cast<const UnaryExpr*>(e)->operand.get(), out);
      return;
    case ExprKind::kBinary:
      find_names_expr(static_cast<const BinaryExpr*>(e)->left.get(), out);
      find_names_expr(static_cast<const BinaryExpr*>(e)->right.get(), out);
      return;
    case ExprKind::kConcat:
      for (const auto& i : static_cast<const ConcatExpr*>(e)->items) find_names_expr(i.get(), out);
      return;
    case ExprKind::kCompare:
      find_names_expr(static_cast<const CompareExpr*>(e)->first.get(), out);
      for (const auto& r : static_cast<const CompareExpr*>(e)->rest)
        find_names_expr(r.second.get(), out);
      return;
    case ExprKind::kAnd:
    case ExprKind::kOr:
      find_names_expr(static_cast<const LogicalExpr*>(e)->left.get(), out);
      find_names_expr(static_cast<const LogicalExpr*>(e)->right.get(), out);
      return;
    case ExprKind::kCond: {
      const auto* c = static_cast<const CondExpr*>(e);
      find_names_expr(c->test.get(), out);
      find_names_expr(c->then.get(), out);
      find_names_expr(c->otherwise.get(), out);
      return;
    }
  }
}

void Parser::find_names_in(const Body& body, std::set<std::string>& out) {
  for (const auto& s : body) {
    switch (s->kind) {
      case StmtKind::kData:
      case StmtKind::kBreak:
      case StmtKind::kContinue:
        break;
      case StmtKind::kOutput:
        find_names_expr(static_cast<const OutputStmt&>(*s).expr.get(), out);
        break;
      case StmtKind::kFor: {
        const auto& f = static_cast<const ForStmt&>(*s);
        find_names_expr(f.iter.get(), out);
        find_names_expr(f.filter.get(), out);
        find_names_in(f.body, out);
        find_names_in(f.else_body, out);
        break;
      }
      case StmtKind::kIf:
        for (const auto& [test, b] : static_cast<const IfStmt&>(*s).branches) {
          find_names_expr(test.get(), out);
          find_names_in(b, out);
        }
        find_names_in(static_cast<const IfStmt&>(*s).else_body, out);
        break;
      case StmtKind::kSet:
        find_names_expr(static_cast<const SetStmt&>(*s).value.get(), out);
        break;
      case StmtKind::kSetBlock:
        find_names_expr(static_cast<const SetBlockStmt&>(*s).filter.get(), out);
        find_names_in(static_cast<const SetBlockStmt&>(*s).body, out);
        break;
      case StmtKind::kMacro: {
        const auto& m = static_cast<const MacroStmt&>(*s).def;
        for (const auto& d : m.defaults) find_names_expr(d.get(), out);
        find_names_in(m.body, out);
        break;
      }
      case StmtKind::kCallBlock: {
        const auto& c = static_cast<const CallBlockStmt&>(*s);
        for (const auto& d : c.caller.defaults) find_names_expr(d.get(), out);
        find_names_in(c.caller.body, out);
        find_names_expr(c.call.get(), out);
        break;
      }
      case StmtKind::kFilterBlock:
        find_names_expr(static_cast<const FilterBlockStmt&>(*s).filter.get(), out);
        find_names_in(static_cast<const FilterBlockStmt&>(*s).body, out);
        break;
      case StmtKind::kWith:
        for (const auto& v : static_cast<const WithStmt&>(*s).values) find_names_expr(v.get(), out);
        find_names_in(static_cast<const WithStmt&>(*s).body, out);
        break;
      case StmtKind::kScope:
        find_names_in(static_cast<const ScopeStmt&>(*s).body, out);
        break;
    }
  }
}

// jinja2 looks filters and tests up when it compiles a template and fails then, except inside an
// {% if %} or an inline if (a "soft" frame), where it waits until rendering reaches the call.
// Block statements that open a frame of their own (for, macro, call, filter, with, set blocks)
// end the soft region.
class NameChecker {
 public:
  NameChecker(const ParsedTemplate& t) : t_(t) {}

  void body(const Body& b, bool soft) {
    for (const auto& s : b) stmt(*s, soft);
  }

 private:
  void args(const ArgList& a, bool soft) {
    for (const auto& x : a.args) expr(x.get(), soft);
    for (const auto& kv : a.kwargs) expr(kv.second.get(), soft);
    expr(a.dyn_args.get(), soft);
    expr(a.dyn_kwargs.get(), soft);
  }

  void expr(const Expr* e, bool soft) {
    if (!e) return;
    switch (e->kind) {
      case ExprKind::kFilter: {
        const auto* f = static_cast<const FilterExpr*>(e);
        if (!soft && !is_known_filter(f->name))
          syntax_error(t_.name, t_.source, f->offset,
                       "No filter named " + repr_string(f->name) + ".", "TemplateAssertionError");
        expr(f->operand.get(), soft);
        args(f->args, soft);
        return;
      }
      case ExprKind::kTest: {
        const auto* t = static_cast<const TestExpr*>(e);
        if (!soft && !is_known_test(t->name))
          syntax_error(t_.name, t_.source, t->offset, "No test named " + repr_string(t->name) + ".",
                       "TemplateAssertionError");
        expr(t->operand.get(), soft);
        args(t->args, soft);
        return;
      }
      case ExprKind::kCond: {
        const auto* c = static_cast<const CondExpr*>(e);
        expr(c->test.get(), true);
        expr(c->then.get(), true);
        expr(c->otherwise.get(), true);
        return;
      }
      case ExprKind::kList:
      case ExprKind::kTuple:
        for (const auto& i : static_cast<const ListExpr*>(e)->items) expr(i.get(), soft);
        return;
      case ExprKind::kDict:
        for (const auto& kv : static_cast<const DictExpr*>(e)->items) {
          expr(kv.first.get(), soft);
          expr(kv.second.get(), soft);
        }
        return;
      case ExprKind::kGetattr:
        expr(static_cast<const GetattrExpr*>(e)->obj.get(), soft);
        return;
      case ExprKind::kGetitem:
        expr(static_cast<const GetitemExpr*>(e)->obj.get(), soft);
        expr(static_cast<const GetitemExpr*>(e)->index.get(), soft);
        return;
      case ExprKind::kSlice: {
        const auto* s = static_cast<const SliceExpr*>(e);
        expr(s->start.get(), soft);
        expr(s->stop.get(), soft);
        expr(s->step.get(), soft);
        return;
      }
      case ExprKind::kCall:
        expr(static_cast<const CallExpr*>(e)->callee.get(), soft);
        args(static_cast<const CallExpr*>(e)->args, soft);
        return;
      case ExprKind::kNeg:
      case ExprKind::kPos:
      case ExprKind::kNot:
        expr(static_cast<const UnaryExpr*>(e)->operand.get(), soft);
        return;
      case ExprKind::kBinary:
        expr(static_cast<const BinaryExpr*>(e)->left.get(), soft);
        expr(static_cast<const BinaryExpr*>(e)->right.get(), soft);
        return;
      case ExprKind::kConcat:
        for (const auto& i : static_cast<const ConcatExpr*>(e)->items) expr(i.get(), soft);
        return;
      case ExprKind::kCompare:
        expr(static_cast<const CompareExpr*>(e)->first.get(), soft);
        for (const auto& r : static_cast<const CompareExpr*>(e)->rest) expr(r.second.get(), soft);
        return;
      case ExprKind::kAnd:
      case ExprKind::kOr:
        expr(static_cast<const LogicalExpr*>(e)->left.get(), soft);
        expr(static_cast<const LogicalExpr*>(e)->right.get(), soft);
        return;
      case ExprKind::kConst:
      case ExprKind::kName:
        return;
    }
  }

  void stmt(const Stmt& s, bool soft) {
    switch (s.kind) {
      case StmtKind::kData:
      case StmtKind::kBreak:
      case StmtKind::kContinue:
        return;
      case StmtKind::kOutput:
        expr(static_cast<const OutputStmt&>(s).expr.get(), soft);
        return;
      case StmtKind::kFor: {
        const auto& f = static_cast<const ForStmt&>(s);
        expr(f.iter.get(), soft);
        expr(f.filter.get(), false);
        body(f.body, false);
        body(f.else_body, false);
        return;
      }
      case StmtKind::kIf:
        for (const auto& [test, b] : static_cast<const IfStmt&>(s).branches) {
          expr(test.get(), true);
          body(b, true);
        }
        body(static_cast<const IfStmt&>(s).else_body, true);
        return;
      case StmtKind::kSet:
        expr(static_cast<const SetStmt&>(s).value.get(), soft);
        return;
      case StmtKind::kSetBlock:
        expr(static_cast<const SetBlockStmt&>(s).filter.get(), soft);
        body(static_cast<const SetBlockStmt&>(s).body, false);
        return;
      case StmtKind::kMacro: {
        const auto& m = static_cast<const MacroStmt&>(s).def;
        for (const auto& d : m.defaults) expr(d.get(), false);
        body(m.body, false);
        return;
      }
      case StmtKind::kCallBlock: {
        const auto& c = static_cast<const CallBlockStmt&>(s);
        for (const auto& d : c.caller.defaults) expr(d.get(), false);
        body(c.caller.body, false);
        expr(c.call.get(), soft);
        return;
      }
      case StmtKind::kFilterBlock:
        expr(static_cast<const FilterBlockStmt&>(s).filter.get(), soft);
        body(static_cast<const FilterBlockStmt&>(s).body, false);
        return;
      case StmtKind::kWith:
        for (const auto& v : static_cast<const WithStmt&>(s).values) expr(v.get(), soft);
        body(static_cast<const WithStmt&>(s).body, false);
        return;
      case StmtKind::kScope:
        body(static_cast<const ScopeStmt&>(s).body, false);
        return;
    }
  }

  const ParsedTemplate& t_;
};

// jinja2's idtracking (the symbol tables of its code generator), reduced to what decides how a
// frame's variables start. Each frame (the template, a loop body, a macro body, ...) becomes a
// Python function or block whose locals start as: a parameter; the render variable of that name
// ("resolve"); the enclosing frame's variable ("alias"); or "missing" when the frame's first use
// of the name is an assignment and no enclosing frame uses it. Only the last differs from a
// plain lookup through the enclosing frames, so FrameNames lists just those names.
class FrameAnalyzer {
 public:
  void template_frame(ParsedTemplate& t) { t.frame = frame(t.body, {}, nullptr); }

 private:
  enum class Load : uint8_t { kParam, kResolve, kAlias, kUndefined };

  struct Symbols {
    const Symbols* parent = nullptr;
    std::map<std::string, Load> refs;
    std::set<std::string> stores;

    bool known(const std::string& n) const {
      for (const Symbols* s = this; s; s = s->parent)
        if (s->refs.count(n)) return true;
      return false;
    }
    void load(const std::string& n) {
      if (!known(n)) refs[n] = Load::kResolve;
    }
    void store(const std::string& n) {
      stores.insert(n);
      if (!refs.count(n)) refs[n] = parent && parent->known(n) ? Load::kAlias : Load::kUndefined;
    }
    void param(const std::string& n) {
      stores.insert(n);
      refs[n] = Load::kParam;
    }
  };

  // Analyzes one frame and, with it complete, the frames nested in it; returns its names that
  // start "missing".
  FrameNames frame(Body& body, const std::vector<std::string>& params, const Symbols* parent,
                   const std::vector<const Expr*>& own_exprs = {}) {
    Symbols sym;
    sym.parent = parent;
    for (const auto& p : params) sym.param(p);
    for (const Expr* e : own_exprs) expr(e, sym);
    statements(body, sym);
    nested(body, sym);
    FrameNames names;
    for (const auto& [n, load] : sym.refs)
      if (load == Load::kUndefined) names.push_back(n);
    return names;
  }

  void expr(const Expr* e, Symbols& sym) {
    std::set<std::string> names;
    Parser::collect_names(e, names);
    for (const auto& n : names) sym.load(n);
  }

  void target(const Target& t, Symbols& sym) {
    switch (t.kind) {
      case Target::Kind::kName:
        sym.store(t.name);
        return;
      case Target::Kind::kTuple:
        for (const auto& item : t.items) target(item, sym);
        return;
      case Target::Kind::kNamespaceAttr:
        sym.load(t.name);
        return;
    }
  }

  static void collect_targets(const Target& t, std::vector<std::string>& out) {
    if (t.kind == Target::Kind::kName) out.push_back(t.name);
    for (const auto& item : t.items) collect_targets(item, out);
  }

  // The frame's own statements, in order; nested frames' bodies are not part of it.
  void statements(Body& body, Symbols& sym) {
    for (auto& sp : body) {
      Stmt& s = *sp;
      switch (s.kind) {
        case StmtKind::kData:
        case StmtKind::kBreak:
        case StmtKind::kContinue:
        case StmtKind::kScope:
          break;
        case StmtKind::kOutput:
          expr(static_cast<OutputStmt&>(s).expr.get(), sym);
          break;
        case StmtKind::kFor:
          expr(static_cast<ForStmt&>(s).iter.get(), sym);
          break;
        case StmtKind::kIf: {
          // Each branch on a copy; then names assigned in some branches but not all start as
          // the render variable (or alias the enclosing frame's), not as missing.
          auto& i = static_cast<IfStmt&>(s);
          expr(i.branches[0].first.get(), sym);
          std::vector<Symbols> branches;
          branches.push_back(sym);
          statements(i.branches[0].second, branches.back());
          branches.push_back(sym);
          for (size_t k = 1; k < i.branches.size(); ++k) {
            expr(i.branches[k].first.get(), branches.back());
            statements(i.branches[k].second, branches.back());
          }
          branches.push_back(sym);
          statements(i.else_body, branches.back());
          std::map<std::string, int> stored;
          for (const auto& b : branches)
            for (const auto& n : b.stores)
              if (!sym.stores.count(n)) ++stored[n];
          for (const auto& b : branches) {
            for (const auto& [n, load] : b.refs) sym.refs[n] = load;
            sym.stores.insert(b.stores.begin(), b.stores.end());
          }
          for (const auto& [n, count] : stored)
            if (count != static_cast<int>(branches.size()))
              sym.refs[n] = parent_knows(sym, n) ? Load::kAlias : Load::kResolve;
          break;
        }
        case StmtKind::kSet: {
          auto& set = static_cast<SetStmt&>(s);
          expr(set.value.get(), sym);
          target(set.target, sym);
          break;
        }
        case StmtKind::kSetBlock:
          target(static_cast<SetBlockStmt&>(s).target, sym);
          break;
        case StmtKind::kMacro:
          sym.store(static_cast<MacroStmt&>(s).def.name);
          break;
        case StmtKind::kCallBlock:
          expr(static_cast<CallBlockStmt&>(s).call.get(), sym);
          break;
        case StmtKind::kFilterBlock:
          expr(static_cast<FilterBlockStmt&>(s).filter.get(), sym);
          break;
        case StmtKind::kWith:
          for (const auto& v : static_cast<WithStmt&>(s).values) expr(v.get(), sym);
          break;
      }
    }
  }

  static bool parent_knows(const Symbols& sym, const std::string& n) {
    return sym.parent && sym.parent->known(n);
  }

  std::vector<std::string> macro_params(const MacroDef& def) {
    std::vector<std::string> params = def.params;
    if (def.uses_caller) params.push_back("caller");
    if (def.uses_kwargs) params.push_back("kwargs");
    if (def.uses_varargs) params.push_back("varargs");
    return params;
  }

  void macro(MacroDef& def, const Symbols& sym) {
    std::vector<const Expr*> defaults;
    for (const auto& d : def.defaults) defaults.push_back(d.get());
    def.frame = frame(def.body, macro_params(def), &sym, defaults);
  }

  // The frames nested in a frame's statements (looking through if branches, which belong to it).
  void nested(Body& body, const Symbols& sym) {
    for (auto& sp : body) {
      Stmt& s = *sp;
      switch (s.kind) {
        case StmtKind::kFor: {
          auto& f = static_cast<ForStmt&>(s);
          std::vector<std::string> params{"loop"};
          collect_targets(f.target, params);
          f.body_frame = frame(f.body, params, &sym);
          f.else_frame = frame(f.else_body, {}, &sym);
          break;
        }
        case StmtKind::kIf: {
          auto& i = static_cast<IfStmt&>(s);
          for (auto& [test, b] : i.branches) nested(b, sym);
          nested(i.else_body, sym);
          break;
        }
        case StmtKind::kSetBlock: {
          auto& sb = static_cast<SetBlockStmt&>(s);
          sb.frame = frame(sb.body, {}, &sym, {sb.filter.get()});
          break;
        }
        case StmtKind::kMacro:
          macro(static_cast<MacroStmt&>(s).def, sym);
          break;
        case StmtKind::kCallBlock:
          macro(static_cast<CallBlockStmt&>(s).caller, sym);
          break;
        case StmtKind::kFilterBlock: {
          auto& fb = static_cast<FilterBlockStmt&>(s);
          fb.frame = frame(fb.body, {}, &sym, {fb.filter.get()});
          break;
        }
        case StmtKind::kWith: {
          auto& w = static_cast<WithStmt&>(s);
          std::vector<std::string> params;
          for (const auto& t : w.targets) collect_targets(t, params);
          w.frame = frame(w.body, params, &sym);
          break;
        }
        case StmtKind::kScope: {
          auto& sc = static_cast<ScopeStmt&>(s);
          sc.frame = frame(sc.body, {}, &sym);
          break;
        }
        default:
          break;
      }
    }
  }
};

}  // namespace

std::unique_ptr<ParsedTemplate> parse_template(std::string_view source, std::string name) {
  auto t = std::make_unique<ParsedTemplate>();
  t->name = std::move(name);
  t->source = normalize_source(source);
  t->body = Parser(t->source, t->name).parse();
  NameChecker(*t).body(t->body, false);
  FrameAnalyzer().template_frame(*t);
  return t;
}

}  // namespace tandem::jinja
