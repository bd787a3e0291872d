// Syntax tree of a parsed Jinja template (the shapes of jinja2's nodes.py that chat templates
// use). Every node records the byte offset of its first token in the normalized source, for
// error positions. Expression trees are at most kMaxExprDepth deep (the parser refuses deeper
// ones), which bounds the interpreter's recursion over them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/io/jinja_value.h"

namespace tandem::jinja {

constexpr uint32_t kMaxExprDepth = 200;  // nesting of one expression
constexpr uint32_t kMaxStmtDepth = 100;  // nesting of block statements

enum class ExprKind : uint8_t {
  kConst,
  kName,
  kList,
  kTuple,
  kDict,
  kGetattr,
  kGetitem,
  kSlice,
  kCall,
  kFilter,
  kTest,
  kNeg,
  kPos,
  kNot,
  kBinary,
  kConcat,
  kCompare,
  kAnd,
  kOr,
  kCond,
};

enum class BinOp : uint8_t { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
enum class CmpOp : uint8_t { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

struct Expr {
  Expr(ExprKind k, uint32_t o) : kind(k), offset(o) {}
  virtual ~Expr() = default;
  ExprKind kind;
  uint32_t offset;
  uint32_t depth = 1;
};
using ExprPtr = std::unique_ptr<Expr>;

struct ConstExpr final : Expr {
  ConstExpr(uint32_t o, Value v) : Expr(ExprKind::kConst, o), value(std::move(v)) {}
  Value value;
};

struct NameExpr final : Expr {
  NameExpr(uint32_t o, std::string n) : Expr(ExprKind::kName, o), name(std::move(n)) {}
  std::string name;
};

// [a, b] (kList) and (a, b) (kTuple).
struct ListExpr final : Expr {
  ListExpr(ExprKind k, uint32_t o) : Expr(k, o) {}
  std::vector<ExprPtr> items;
};

struct DictExpr final : Expr {
  explicit DictExpr(uint32_t o) : Expr(ExprKind::kDict, o) {}
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
};

// obj.attr: jinja2's getattr, which prefers the Python attribute and falls back to obj['attr'].
struct GetattrExpr final : Expr {
  GetattrExpr(uint32_t o, ExprPtr obj_, std::string a)
      : Expr(ExprKind::kGetattr, o), obj(std::move(obj_)), attr(std::move(a)) {}
  ExprPtr obj;
  std::string attr;
};

// obj[index]: jinja2's getitem, which prefers the item and falls back to the attribute.
// `index` may be a SliceExpr.
struct GetitemExpr final : Expr {
  GetitemExpr(uint32_t o, ExprPtr obj_, ExprPtr i)
      : Expr(ExprKind::kGetitem, o), obj(std::move(obj_)), index(std::move(i)) {}
  ExprPtr obj;
  ExprPtr index;
};

// start:stop:step; any part may be null (None).
struct SliceExpr final : Expr {
  explicit SliceExpr(uint32_t o) : Expr(ExprKind::kSlice, o) {}
  ExprPtr start, stop, step;
};

// Arguments of a call, filter or test: positional, keyword, *args, **kwargs.
struct ArgList {
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  ExprPtr dyn_args, dyn_kwargs;
};

struct CallExpr final : Expr {
  CallExpr(uint32_t o, ExprPtr c) : Expr(ExprKind::kCall, o), callee(std::move(c)) {}
  ExprPtr callee;
  ArgList args;
};

// operand|name(args). `operand` is null for the outermost filter of a {% filter %} block or a
// {% set x | filter %} block, whose operand is the block's rendered body.
struct FilterExpr final : Expr {
  FilterExpr(uint32_t o, ExprPtr op, std::string n)
      : Expr(ExprKind::kFilter, o), operand(std::move(op)), name(std::move(n)) {}
  ExprPtr operand;
  std::string name;
  ArgList args;
};

// operand is [not] name(args); `not` is a separate kNot node around it.
struct TestExpr final : Expr {
  TestExpr(uint32_t o, ExprPtr op, std::string n)
      : Expr(ExprKind::kTest, o), operand(std::move(op)), name(std::move(n)) {}
  ExprPtr operand;
  std::string name;
  ArgList args;
};

// -x, +x, not x.
struct UnaryExpr final : Expr {
  UnaryExpr(ExprKind k, uint32_t o, ExprPtr op) : Expr(k, o), operand(std::move(op)) {}
  ExprPtr operand;
};

struct BinaryExpr final : Expr {
  BinaryExpr(uint32_t o, BinOp op_, ExprPtr l, ExprPtr r)
      : Expr(ExprKind::kBinary, o), op(op_), left(std::move(l)), right(std::move(r)) {}
  BinOp op;
  ExprPtr left, right;
};

// a ~ b ~ c: "".join(str(x) for x in items).
struct ConcatExpr final : Expr {
  explicit ConcatExpr(uint32_t o) : Expr(ExprKind::kConcat, o) {}
  std::vector<ExprPtr> items;
};

// first op1 e1 op2 e2 ...: Python's chained comparison.
struct CompareExpr final : Expr {
  CompareExpr(uint32_t o, ExprPtr f) : Expr(ExprKind::kCompare, o), first(std::move(f)) {}
  ExprPtr first;
  std::vector<std::pair<CmpOp, ExprPtr>> rest;
};

// a and b (kAnd), a or b (kOr): Python semantics, the result is one of the operands.
struct LogicalExpr final : Expr {
  LogicalExpr(ExprKind k, uint32_t o, ExprPtr l, ExprPtr r)
      : Expr(k, o), left(std::move(l)), right(std::move(r)) {}
  ExprPtr left, right;
};

// then if test else otherwise; without else an Undefined with jinja2's message.
struct CondExpr final : Expr {
  CondExpr(uint32_t o, ExprPtr t, ExprPtr th, ExprPtr ot)
      : Expr(ExprKind::kCond, o),
        test(std::move(t)),
        then(std::move(th)),
        otherwise(std::move(ot)) {}
  ExprPtr test, then, otherwise;
  uint32_t line = 0;  // for the no-else message
};

// Assignment targets: a name, a tuple of targets (unpacking), or ns.attr (namespace attribute).
struct Target {
  enum class Kind : uint8_t { kName, kTuple, kNamespaceAttr } kind = Kind::kName;
  std::string name;
  std::string attr;
  std::vector<Target> items;
  uint32_t offset = 0;
};

// Names a frame starts with as Undefined (see the frame analysis in jinja_parser.cpp): jinja2
// compiles each frame to Python locals, and a name whose first use in a frame is an assignment,
// and which no enclosing frame uses, starts as "missing" even if the render variables define it.
// Read from a nested frame before the assignment runs, it is Undefined, not the variable.
using FrameNames = std::vector<std::string>;

enum class StmtKind : uint8_t {
  kData,
  kOutput,
  kFor,
  kIf,
  kSet,
  kSetBlock,
  kMacro,
  kCallBlock,
  kFilterBlock,
  kWith,
  kBreak,
  kContinue,
  kScope,
};

struct Stmt {
  Stmt(StmtKind k, uint32_t o) : kind(k), offset(o) {}
  virtual ~Stmt() = default;
  StmtKind kind;
  uint32_t offset;
};
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct DataStmt final : Stmt {
  DataStmt(uint32_t o, std::string t) : Stmt(StmtKind::kData, o), text(std::move(t)) {}
  std::string text;
};

// {{ expr }} and {% print expr %}.
struct OutputStmt final : Stmt {
  OutputStmt(uint32_t o, ExprPtr e) : Stmt(StmtKind::kOutput, o), expr(std::move(e)) {}
  ExprPtr expr;
};

struct ForStmt final : Stmt {
  explicit ForStmt(uint32_t o) : Stmt(StmtKind::kFor, o) {}
  Target target;
  ExprPtr iter;
  ExprPtr filter;  // for x in y if filter
  bool recursive = false;
  Body body, else_body;
  FrameNames body_frame, else_frame;
};

struct IfStmt final : Stmt {
  explicit IfStmt(uint32_t o) : Stmt(StmtKind::kIf, o) {}
  std::vector<std::pair<ExprPtr, Body>> branches;  // if, elif, ...
  Body else_body;
};

struct SetStmt final : Stmt {
  explicit SetStmt(uint32_t o) : Stmt(StmtKind::kSet, o) {}
  Target target;
  ExprPtr value;
};

// {% set x | filters %}body{% endset %}
struct SetBlockStmt final : Stmt {
  explicit SetBlockStmt(uint32_t o) : Stmt(StmtKind::kSetBlock, o) {}
  Target target;
  ExprPtr filter;  // a FilterExpr chain whose innermost operand is null, or null
  Body body;
  FrameNames frame;
};

// A macro, or the body of a {% call %} block (the `caller` macro).
struct MacroDef {
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // for the last defaults.size() params
  Body body;
  // Whether the body mentions these names (jinja2 decides from the source, as here): only then
  // does the macro accept extra positional args, extra keyword args, or a caller.
  bool uses_varargs = false, uses_kwargs = false, uses_caller = false;
  uint32_t offset = 0;
  FrameNames frame;
};

struct MacroStmt final : Stmt {
  explicit MacroStmt(uint32_t o) : Stmt(StmtKind::kMacro, o) {}
  MacroDef def;
};

struct CallBlockStmt final : Stmt {
  explicit CallBlockStmt(uint32_t o) : Stmt(StmtKind::kCallBlock, o) {}
  MacroDef caller;  // the block body, callable as caller(...)
  ExprPtr call;     // a CallExpr
};

struct FilterBlockStmt final : Stmt {
  explicit FilterBlockStmt(uint32_t o) : Stmt(StmtKind::kFilterBlock, o) {}
  ExprPtr filter;  // FilterExpr chain, innermost operand null
  Body body;
  FrameNames frame;
};

struct WithStmt final : Stmt {
  explicit WithStmt(uint32_t o) : Stmt(StmtKind::kWith, o) {}
  std::vector<Target> targets;
  std::vector<ExprPtr> values;
  Body body;
  FrameNames frame;
};

struct LoopControlStmt final : Stmt {
  LoopControlStmt(StmtKind k, uint32_t o) : Stmt(k, o) {}
};

// A body rendered in its own scope: {% block %} in a template without inheritance, and
// transformers' {% generation %} (whose only effect on the text is none).
struct ScopeStmt final : Stmt {
  explicit ScopeStmt(uint32_t o) : Stmt(StmtKind::kScope, o) {}
  Body body;
  FrameNames frame;
};

}  // namespace tandem::jinja
