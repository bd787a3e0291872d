// Pieces shared by the tandem subcommands: input parsing and model/tokenizer opening.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/backend/context.h"
#include "tandem/engine/generator.h"
#include "tandem/engine/speculative.h"
#include "tandem/io/tokenizer.h"
#include "tandem/model/glm5.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/spec/draft.h"
#include "tandem/spec/ngram.h"

namespace CLI {
class App;
}

namespace tandem::cli {

// Parses "1,2,3" (spaces allowed). Throws Error naming the bad element.
std::vector<int32_t> parse_token_ids(const std::string& s);

// The tokenizer of a model directory, if it has tokenizer.json.
std::optional<Tokenizer> open_tokenizer(const std::string& model_dir);

// Exactly one of text / text file / token ids must be given; text needs a tokenizer.
// Unset optionals are options not given on the command line.
std::vector<int32_t> resolve_input(const std::string& what, const std::optional<std::string>& text,
                                   const std::optional<std::string>& text_file,
                                   const std::optional<std::string>& token_ids,
                                   const std::optional<Tokenizer>& tok);

void apply_threads(int threads);
// --backend cpu|cuda|auto: selects the backend for everything that follows (before any model is
// loaded), names the device on stderr and returns the command's backend context. The command
// enters it (ops::ContextScope) for its whole run, so the models it loads share it and its own
// copies and timings need no switch of streams.
std::shared_ptr<ops::Context> apply_backend(const std::string& name);

// The model's artifact identity: config fingerprint + content hash of its weight files.
std::string target_identity(const WeightStore& weights, const std::string& dir);

// A target model of either family, chosen by config.json's model_type: glm_moe_dsa is GLM-5
// (CPU backend), anything else goes to the Qwen3.5 loader, which names what it refuses.
struct LoadedTarget {
  std::unique_ptr<Qwen35Model> qwen;
  std::unique_ptr<Glm5Model> glm;
  std::unique_ptr<spec::TargetView> view;  // named by the identity load_target computed
  // Opens a fresh engine state of the model per call (kv_dtype: Qwen's KV storage).
  EngineTargetFactory engine_target(DType kv_dtype) const;
  int64_t max_position_embeddings() const;
};
bool is_glm5_dir(const std::string& dir);
// with_identity: compute the artifact identity (drafter checkpoints, prefix-cache files need
// it); otherwise the view's identity is empty.
LoadedTarget load_target(const std::string& dir, bool with_identity);
// --random-weights CONFIG.json (bench, bench-spec): a model of that shape with random weights in
// the backend's memory, drawn with kRandomWeightsSeed (as is a random MTP layer beside it).
inline constexpr uint64_t kRandomWeightsSeed = 1234;
std::unique_ptr<Qwen35Model> random_weight_model(const std::string& config_path);

// JSONL requests, one object per line: {"prompt": ...} or {"token_ids": [...]}, optional "seed",
// "temperature", "max_tokens" overriding `base`; blank lines skipped; errors name file:line.
std::vector<GenerateRequest> read_prompts_file(const std::string& path, const GenerateRequest& base,
                                               const std::optional<Tokenizer>& tok);

// --kv-dtype bf16|f32: how the KV cache stores keys and values (every command that runs the
// model has it; bf16 by default). parse_kv_dtype throws Error naming the bad value.
void add_kv_dtype_option(CLI::App* sub, std::string* value);
DType parse_kv_dtype(const std::string& s);

// The drafter options `generate` and `serve` share.
struct DraftArgs {
  std::string draft = "none";
  std::optional<std::string> draft_model;
  std::string depth = "auto";  // parse_depth
  std::string verify = "match";
  spec::NgramOptions ngram;
  std::string mtp_hidden = "final";
  int64_t draft_vocab = 0;  // --draft mtp (Qwen3.5): token ids a draft step scores; 0 = all
  int64_t prefill_chunk = kPrefillChunkTokens;
  bool no_drafter_probe = false;
  bool settled_rounds = false;
};
void add_draft_options(CLI::App* sub, DraftArgs* a);
// --depth: "auto" (adaptive, at most auto_max_depth proposals a round), "auto:K" (adaptive, at
// most K in 1..16) or a fixed 0..16.
inline constexpr int kAutoMaxDepth = 4;  // model drafters: every proposal costs a draft step
// Drafters of tokens alone (n-gram): a proposal costs only its place in the verify window, which
// on a GPU is nearly free, so adaptive rounds may go deeper.
inline constexpr int kAutoMaxDepthTokens = 8;
struct DepthArg {
  int depth = 0;  // fixed depth, or the most an adaptive round proposes
  bool automatic = false;
  bool max_given = false;  // auto:K
};
// The most an adaptive round of drafter `draft` ("ngram", "mtp", ...) proposes.
int auto_max_depth(const DepthArg& d, std::string_view draft);
DepthArg parse_depth(const std::string& s);
// The spec options --depth, --verify, --prefill-chunk, --no-drafter-probe and --settled-rounds
// give.
SpecOptions spec_options(const DraftArgs& a);
// The drafter the options name (null for --draft none); Error for bad combinations.
std::unique_ptr<spec::DraftProvider> open_drafter(const DraftArgs& a,
                                                  const spec::TargetView& target);

}  // namespace tandem::cli
