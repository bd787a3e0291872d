// tandem generate: text generation from a prompt, streamed, or one JSON object with --json.
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "tandem/cli/commands.h"
#include "tandem/cli/common.h"
#include "tandem/core/error.h"
#include "tandem/engine/generator.h"

namespace tandem::cli {

namespace {

struct GenerateArgs {
  std::string model;
  std::optional<std::string> prompt, prompt_file, token_ids;
  int64_t max_tokens = 128;
  SamplingParams sampling;
  bool ignore_eos = false;
  int threads = 0;
  bool json = false;
};

void run_generate(const GenerateArgs& a) {
  apply_threads(a.threads);
  auto model = Qwen35Model::load(a.model);
  const auto tok = open_tokenizer(a.model);
  GenerateRequest req;
  req.prompt = resolve_input("prompt", a.prompt, a.prompt_file, a.token_ids, tok);
  req.sampling = a.sampling;
  req.max_tokens = a.max_tokens;
  req.ignore_eos = a.ignore_eos;

  std::unique_ptr<Tokenizer::StreamDecoder> stream;
  if (tok && !a.json) stream = std::make_unique<Tokenizer::StreamDecoder>(tok->stream_decoder());
  auto on_token = [&](size_t, int32_t id) {
    if (!stream) return;
    std::fputs(stream->push(id).c_str(), stdout);
    std::fflush(stdout);
  };
  GenerateStats stats;
  Generator gen(*model);
  const auto results = gen.run({req}, on_token, &stats);
  const GenerateResult& r = results.at(0);

  if (a.json) {
    nlohmann::json j;
    j["prompt_tokens"] = req.prompt.size();
    j["prompt_token_ids"] = req.prompt;
    j["tokens"] = r.tokens;
    j["text"] = tok ? nlohmann::json(tok->decode(r.tokens)) : nlohmann::json(nullptr);
    j["finish_reason"] = finish_reason_name(r.finish);
    j["stats"] = {{"prompt_tokens", stats.prompt_tokens},
                  {"generated_tokens", stats.generated_tokens},
                  {"prefill_seconds", stats.prefill_seconds},
                  {"decode_seconds", stats.decode_seconds},
                  {"prefill_tokens_per_second", stats.prefill_tokens_per_second()},
                  {"decode_tokens_per_second", stats.decode_tokens_per_second()},
                  {"threads", ops::thread_count()}};
    std::cout << j.dump() << "\n";
    return;
  }
  if (stream) {
    std::fputs(stream->finish().c_str(), stdout);
  } else {
    for (size_t i = 0; i < r.tokens.size(); ++i) std::printf("%s%d", i ? "," : "", r.tokens[i]);
  }
  std::printf("\n");
  std::fprintf(stderr,
               "[%zu prompt tokens, %zu generated, finish: %s | prefill %.1f tok/s, decode %.1f "
               "tok/s, %d threads]\n",
               req.prompt.size(), r.tokens.size(), finish_reason_name(r.finish),
               stats.prefill_tokens_per_second(), stats.decode_tokens_per_second(),
               ops::thread_count());
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* sub = app.add_subcommand("generate", "Generate text from a prompt");
  sub->add_option("--model", a->model, "Hugging Face model directory")->required();
  sub->add_option("--prompt", a->prompt, "Prompt text");
  sub->add_option("--prompt-file", a->prompt_file, "Read the prompt from a file");
  sub->add_option("--token-ids", a->token_ids, "Prompt as token ids: 1,2,3");
  sub->add_option("--max-tokens", a->max_tokens, "Most tokens to generate")->capture_default_str();
  sub->add_option("--temperature", a->sampling.temperature, "0 = greedy")->capture_default_str();
  sub->add_option("--top-k", a->sampling.top_k, "Keep the k most likely tokens (0 = off)");
  sub->add_option("--top-p", a->sampling.top_p, "Nucleus sampling mass (1 = off)");
  sub->add_option("--min-p", a->sampling.min_p, "Drop tokens below min-p x max prob (0 = off)");
  sub->add_option("--seed", a->sampling.seed, "Request seed for sampling")->capture_default_str();
  sub->add_flag("--ignore-eos", a->ignore_eos, "Do not stop at end-of-sequence tokens");
  sub->add_option("--threads", a->threads, "CPU threads (0 = all cores)");
  sub->add_flag("--json", a->json, "Print one JSON object instead of streaming text");
  sub->callback([a] { run_generate(*a); });
}

}  // namespace tandem::cli
