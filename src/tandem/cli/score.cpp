// tandem score: per-position next-token distributions of a text (teacher forcing), for parity
// checks against other engines: the K largest raw logits at every position and the mean NLL.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "tandem/cli/commands.h"
#include "tandem/cli/common.h"
#include "tandem/core/error.h"
#include "tandem/core/sampler.h"

namespace tandem::cli {

namespace {

struct ScoreArgs {
  std::string model;
  std::optional<std::string> text, text_file, token_ids;
  int top_k = 5;
  int threads = 0;
  std::string kv_dtype = "bf16";
  std::string backend = "auto";
  bool json = false;
};

void run_score(const ScoreArgs& a) {
  apply_threads(a.threads);
  const auto context = apply_backend(a.backend);
  const ops::ContextScope context_scope(*context);
  if (a.top_k < 0) fail("--top-k must be >= 0");
  const DType kv_dtype = parse_kv_dtype(a.kv_dtype);
  auto model = Qwen35Model::load(a.model);
  const auto tok = open_tokenizer(a.model);
  const auto ids = resolve_input("text", a.text, a.text_file, a.token_ids, tok);
  const int64_t V = model->config().vocab_size;

  Qwen35State state(model->config(), Qwen35State::kDefaultRollback, kv_dtype);
  const int slot = state.open_row();
  const RowInput row{slot, static_cast<int64_t>(ids.size())};
  ForwardOutput out;
  model->forward(state, {ids, {&row, 1}, true, false}, &out);

  nlohmann::json positions = nlohmann::json::array();
  double nll_sum = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::span<const float> logits(out.logits.data() + i * V, static_cast<size_t>(V));
    nlohmann::json p;
    nlohmann::json top = nlohmann::json::array();
    for (const auto& [id, logit] : top_logits(logits, a.top_k)) top.push_back({id, logit});
    p["top"] = std::move(top);
    if (i + 1 < ids.size()) {
      const double nll = -log_softmax_at(logits, ids[i + 1]);
      p["next_token"] = ids[i + 1];
      p["nll"] = nll;
      nll_sum += nll;
    }
    positions.push_back(std::move(p));
  }
  const double nll_mean = ids.size() > 1 ? nll_sum / static_cast<double>(ids.size() - 1) : 0.0;
  if (a.json) {
    nlohmann::json j;
    j["tokens"] = ids;
    j["nll_mean"] = nll_mean;
    j["positions"] = std::move(positions);
    std::cout << j.dump() << "\n";
  } else {
    std::printf("%zu tokens, mean NLL %.4f, perplexity %.3f\n", ids.size(), nll_mean,
                std::exp(nll_mean));
  }
}

}  // namespace

void add_score_command(CLI::App& app) {
  auto a = std::make_shared<ScoreArgs>();
  CLI::App* sub = app.add_subcommand("score", "Score a text: next-token logits at every position");
  sub->add_option("--model", a->model, "Hugging Face model directory")->required();
  sub->add_option("--text", a->text, "Text to score");
  sub->add_option("--text-file", a->text_file, "Read the text from a file");
  sub->add_option("--token-ids", a->token_ids, "Token ids to score: 1,2,3");
  sub->add_option("--top-k", a->top_k, "Largest logits to report per position")
      ->capture_default_str();
  sub->add_option("--threads", a->threads, "CPU threads (0 = all cores)");
  add_kv_dtype_option(sub, &a->kv_dtype);
  sub->add_option("--backend", a->backend, "cpu, cuda or auto (cuda when a GPU is present)")
      ->capture_default_str();
  sub->add_flag("--json", a->json, "Print JSON");
  sub->callback([a] { run_score(*a); });
}

}  // namespace tandem::cli
