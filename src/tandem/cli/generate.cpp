// tandem generate: text generation, optionally speculative (--draft mtp|ngram), streamed as text
// or printed as one JSON object (--json); --prompts-file runs many requests as rows of one batch
// and prints JSON Lines, one object per request.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "tandem/cli/commands.h"
#include "tandem/cli/common.h"
#include "tandem/core/error.h"
#include "tandem/engine/speculative.h"
#include "tandem/io/artifact_identity.h"
#include "tandem/spec/ngram.h"
#include "tandem/spec/qwen_mtp.h"

namespace tandem::cli {

namespace {

struct GenerateArgs {
  std::string model;
  std::optional<std::string> prompt, prompt_file, token_ids, prompts_file;
  int64_t max_tokens = 128;
  SamplingParams sampling;
  bool ignore_eos = false;
  int threads = 0;
  std::string backend = "auto";
  bool json = false;
  std::string kv_dtype = "bf16";
  DraftArgs d;
};

nlohmann::json stats_json(const GenerateStats& st, const SpecStats& s, const GenerateResult& r) {
  return {{"prompt_tokens", st.prompt_tokens},
          {"generated_tokens", r.tokens.size()},
          {"prefill_seconds", st.prefill_seconds},
          {"decode_seconds", st.decode_seconds},
          {"prefill_tokens_per_second", st.prefill_tokens_per_second()},
          {"decode_tokens_per_second", st.decode_tokens_per_second()},
          {"device", ops::device_description()},
          {"threads", ops::thread_count()},
          {"rounds", s.rounds},
          {"drafted", s.drafted},
          {"accepted", s.accepted},
          {"accepted_by_position", s.accepted_by_position},
          {"acceptance_rate", s.acceptance_rate()},
          {"mean_accepted_length", s.mean_accepted_length()},
          {"tokens_per_target_forward", s.tokens_per_target_forward()}};
}

void run_generate(const GenerateArgs& a) {
  apply_threads(a.threads);
  const DType kv_dtype = parse_kv_dtype(a.kv_dtype);
  const auto context = apply_backend(a.backend);
  const ops::ContextScope context_scope(*context);
  const LoadedTarget target = load_target(a.model, a.d.draft != "none");
  const auto tok = open_tokenizer(a.model);
  GenerateRequest base;
  base.sampling = a.sampling;
  base.max_tokens = a.max_tokens;
  base.ignore_eos = a.ignore_eos;
  std::vector<GenerateRequest> reqs;
  if (a.prompts_file) {
    if (a.prompt || a.prompt_file || a.token_ids)
      fail("--prompts-file cannot be combined with --prompt, --prompt-file or --token-ids");
    reqs = read_prompts_file(*a.prompts_file, base, tok);
  } else {
    base.prompt = resolve_input("prompt", a.prompt, a.prompt_file, a.token_ids, tok);
    reqs.push_back(base);
  }
  const SpecOptions opts = spec_options(a.d);

  const auto drafter = open_drafter(a.d, *target.view);
  SpeculativeGenerator gen(target.engine_target(kv_dtype), target.view->vocab_size(), drafter.get(),
                           opts);

  // Text streams only for a single request without --json.
  const bool stream_text = tok && !a.json && reqs.size() == 1;
  std::unique_ptr<Tokenizer::StreamDecoder> stream;
  if (stream_text) stream = std::make_unique<Tokenizer::StreamDecoder>(tok->stream_decoder());
  auto on_token = [&](size_t, int32_t id) {
    if (!stream) return;
    std::fputs(stream->push(id).c_str(), stdout);
    std::fflush(stdout);
  };
  GenerateStats stats;
  std::vector<SpecStats> sstats;
  const auto results = gen.run(reqs, on_token, &stats, &sstats);

  if (a.json || reqs.size() > 1) {
    for (size_t i = 0; i < results.size(); ++i) {
      nlohmann::json j;
      j["prompt_tokens"] = reqs[i].prompt.size();
      j["prompt_token_ids"] = reqs[i].prompt;
      j["tokens"] = results[i].tokens;
      j["text"] = tok ? nlohmann::json(tok->decode(results[i].tokens)) : nlohmann::json(nullptr);
      j["finish_reason"] = finish_reason_name(results[i].finish);
      j["stats"] = stats_json(stats, sstats[i], results[i]);
      j["stats"]["draft"] = a.d.draft;
      // A number for a fixed depth, "auto" for adaptive rounds.
      j["stats"]["depth"] = !drafter          ? nlohmann::json(0)
                            : opts.auto_depth ? nlohmann::json("auto")
                                              : nlohmann::json(opts.depth);
      std::cout << j.dump() << "\n";
    }
    return;
  }
  const GenerateResult& r = results.at(0);
  if (stream) {
    std::fputs(stream->finish().c_str(), stdout);
  } else {
    for (size_t i = 0; i < r.tokens.size(); ++i) std::printf("%s%d", i ? "," : "", r.tokens[i]);
  }
  std::printf("\n");
  std::fprintf(stderr,
               "[%zu prompt tokens, %zu generated, finish: %s | prefill %.1f tok/s, decode "
               "%.1f tok/s on %s",
               reqs[0].prompt.size(), r.tokens.size(), finish_reason_name(r.finish),
               stats.prefill_tokens_per_second(), stats.decode_tokens_per_second(),
               ops::device_description().c_str());
  if (drafter)
    std::fprintf(stderr, " | %s depth %s: %.0f%% of drafts accepted, %.2f tokens per round",
                 a.d.draft.c_str(), a.d.depth.c_str(), 100 * sstats[0].acceptance_rate(),
                 sstats[0].mean_accepted_length());
  std::fprintf(stderr, "]\n");
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* sub = app.add_subcommand("generate", "Generate text from a prompt");
  sub->add_option("--model", a->model, "Hugging Face model directory")->required();
  sub->add_option("--prompt", a->prompt, "Prompt text");
  sub->add_option("--prompt-file", a->prompt_file, "Read the prompt from a file");
  sub->add_option("--token-ids", a->token_ids, "Prompt as token ids: 1,2,3");
  sub->add_option("--prompts-file", a->prompts_file,
                  "JSONL requests ({\"prompt\"|\"token_ids\", \"seed\", \"temperature\", "
                  "\"max_tokens\"}) run together as one batch; prints JSONL");
  sub->add_option("--max-tokens", a->max_tokens, "Most tokens to generate")->capture_default_str();
  sub->add_option("--temperature", a->sampling.temperature, "0 = greedy")->capture_default_str();
  sub->add_option("--top-k", a->sampling.top_k, "Keep the k most likely tokens (0 = off)");
  sub->add_option("--top-p", a->sampling.top_p, "Nucleus sampling mass (1 = off)");
  sub->add_option("--min-p", a->sampling.min_p, "Drop tokens below min-p x max prob (0 = off)");
  sub->add_option("--seed", a->sampling.seed, "Request seed for sampling")->capture_default_str();
  sub->add_flag("--ignore-eos", a->ignore_eos, "Do not stop at end-of-sequence tokens");
  sub->add_option("--threads", a->threads, "CPU threads (0 = all cores)");
  sub->add_option("--backend", a->backend, "cpu, cuda or auto (cuda when a GPU is present)")
      ->capture_default_str();
  sub->add_flag("--json", a->json, "Print one JSON object instead of streaming text");
  add_draft_options(sub, &a->d);
  add_kv_dtype_option(sub, &a->kv_dtype);
  sub->callback([a] { run_generate(*a); });
}

}  // namespace tandem::cli
