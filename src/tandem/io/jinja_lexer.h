// Tokenizer for Jinja templates, following jinja2's lexer (jinja2/lexer.py) configured as
// transformers configures it: default delimiters, trim_blocks=True, lstrip_blocks=True,
// keep_trailing_newline=False, no line statements.
//
// Whitespace rules reproduced here (they decide the output bytes of every chat template):
//   - newlines are normalized to "\n" (\r\n and \r too, also inside string literals) and one
//     trailing newline of the source is dropped;
//   - "{%-", "{{-", "{#-" strip all whitespace before the tag; "-%}", "-}}", "-#}" strip all
//     whitespace after it (Python's notion of whitespace, so U+3000 counts);
//   - trim_blocks: one newline right after "%}" or "#}" is dropped (not after "}}", and not after
//     "{% raw %}");
//   - lstrip_blocks: whitespace between the start of a line and "{%" or "{#" is dropped (not
//     before "{{"); "{%+" turns both lstrip and trim off for that side.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::jinja {

enum class Tok : uint8_t {
  kData,
  kVariableBegin,
  kVariableEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInteger,
  kFloat,
  // operators
  kAdd,
  kSub,
  kDiv,
  kFloorDiv,
  kMul,
  kMod,
  kPow,
  kTilde,
  kLBracket,
  kRBracket,
  kLParen,
  kRParen,
  kLBrace,
  kRBrace,
  kEq,
  kNe,
  kGt,
  kGe,
  kLt,
  kLe,
  kAssign,
  kDot,
  kColon,
  kPipe,
  kComma,
  kSemicolon,
  kEof,
};

struct Token {
  Tok type = Tok::kEof;
  uint32_t offset = 0;  // byte offset in the normalized source
  std::string text;     // data, name, or the decoded string literal
  int64_t int_value = 0;
  double float_value = 0;
};

// How jinja2 describes a token in error messages ("end of statement block", "'('", ...).
std::string describe_token(const Token& t);

// The source as the lexer sees it: newlines normalized, one trailing newline dropped. Token
// offsets refer to this text; `line_col` turns one into a 1-based line and column.
std::string normalize_source(std::string_view source);
void line_col(std::string_view normalized, uint32_t offset, uint32_t& line, uint32_t& col);

// Throws tandem::Error "template 'name' line L col C: <type>: message" (type: jinja2's exception
// class, TemplateSyntaxError unless said otherwise).
[[noreturn]] void syntax_error(const std::string& template_name, std::string_view normalized,
                               uint32_t offset, const std::string& message,
                               const char* type = "TemplateSyntaxError");

// Tokenizes the normalized source. Throws tandem::Error ("template 'name' line L col C:
// TemplateSyntaxError: ...") on a lexical error.
std::vector<Token> tokenize(const std::string& normalized, const std::string& template_name);

}  // namespace tandem::jinja
