// tandem bench: prefill and decode throughput over repeated runs, reported against the memory
// roofline (weight bytes one decode step must read ÷ this machine's measured read bandwidth).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>

#include "tandem/backend/cpu/memory_bandwidth.h"
#include "tandem/cli/commands.h"
#include "tandem/cli/common.h"
#include "tandem/core/error.h"
#include "tandem/engine/generator.h"

namespace tandem::cli {

namespace {

struct BenchArgs {
  std::string model;
  int64_t prompt_tokens = 128;
  int64_t gen_tokens = 64;
  int batch = 1;
  int repeats = 5;
  int threads = 0;
  bool json = false;
};

struct Spread {
  double median = 0, min = 0, max = 0;
};

Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Spread s;
  if (v.empty()) return s;
  s.min = v.front();
  s.max = v.back();
  const size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  return s;
}

nlohmann::json to_json(const Spread& s) {
  return {{"median", s.median}, {"min", s.min}, {"max", s.max}};
}

void run_bench(const BenchArgs& a) {
  apply_threads(a.threads);
  if (a.prompt_tokens < 1 || a.gen_tokens < 2 || a.batch < 1 || a.repeats < 1)
    fail("bench: need --prompt-tokens >= 1, --gen-tokens >= 2, --batch >= 1, --repeats >= 1");
  std::fprintf(stderr, "bench: loading %s\n", a.model.c_str());
  auto model = Qwen35Model::load(a.model);
  const Qwen35Config& cfg = model->config();

  std::fprintf(stderr, "bench: measuring memory read bandwidth (%d threads)\n",
               ops::thread_count());
  const double bw = cpu::measure_read_bandwidth();

  Generator gen(*model);
  std::vector<double> prefill, decode;
  for (int r = 0; r <= a.repeats; ++r) {  // run 0 is a warm-up
    std::mt19937 rng(1234 + r);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(cfg.vocab_size - 1));
    std::vector<GenerateRequest> reqs(static_cast<size_t>(a.batch));
    for (auto& q : reqs) {
      q.prompt.resize(static_cast<size_t>(a.prompt_tokens));
      for (auto& id : q.prompt) id = pick(rng);
      q.max_tokens = a.gen_tokens;
      q.ignore_eos = true;
    }
    GenerateStats st;
    gen.run(reqs, {}, &st);
    if (r == 0) continue;
    prefill.push_back(st.prefill_tokens_per_second());
    decode.push_back(st.decode_tokens_per_second());
    std::fprintf(stderr, "bench: run %d/%d: prefill %.1f tok/s, decode %.1f tok/s\n", r, a.repeats,
                 prefill.back(), decode.back());
  }
  const Spread pf = spread(prefill), dc = spread(decode);
  // One decode step reads every weight once for the whole batch, plus each row's KV prefix.
  int64_t n_attn = 0;
  for (LayerKind k : cfg.layer_types) n_attn += k == LayerKind::FullAttention;
  const double mean_ctx = static_cast<double>(a.prompt_tokens) + a.gen_tokens / 2.0;
  const double kv_bytes_per_row =
      mean_ctx * static_cast<double>(n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * 4);
  const double step_bytes =
      static_cast<double>(model->decode_weight_bytes()) + a.batch * kv_bytes_per_row;
  const double roofline_tps = bw / step_bytes * a.batch;
  const double fraction = dc.median / roofline_tps;

  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model;
    j["parameters"] = model->parameter_count();
    j["threads"] = ops::thread_count();
    j["batch"] = a.batch;
    j["prompt_tokens"] = a.prompt_tokens;
    j["gen_tokens"] = a.gen_tokens;
    j["repeats"] = a.repeats;
    j["prefill_tokens_per_second"] = to_json(pf);
    j["decode_tokens_per_second"] = to_json(dc);
    j["memory_read_bandwidth_gb_per_s"] = bw / 1e9;
    j["decode_bytes_per_step"] = step_bytes;
    j["decode_weight_bytes"] = model->decode_weight_bytes();
    j["roofline_decode_tokens_per_second"] = roofline_tps;
    j["roofline_fraction"] = fraction;
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::printf("model            %s (%.1fM parameters)\n", a.model.c_str(),
              static_cast<double>(model->parameter_count()) / 1e6);
  std::printf(
      "setup            batch %d, prompt %lld tokens, %lld generated, %d threads, %d runs\n",
      a.batch, static_cast<long long>(a.prompt_tokens), static_cast<long long>(a.gen_tokens),
      ops::thread_count(), a.repeats);
  std::printf("prefill          %.1f tok/s (min %.1f, max %.1f)\n", pf.median, pf.min, pf.max);
  std::printf("decode           %.1f tok/s (min %.1f, max %.1f)\n", dc.median, dc.min, dc.max);
  std::printf("memory read      %.2f GB/s measured\n", bw / 1e9);
  std::printf("bytes per step   %.2f MB (weights %.2f MB + KV)\n", step_bytes / 1e6,
              static_cast<double>(model->decode_weight_bytes()) / 1e6);
  std::printf("roofline         %.1f tok/s -> %.0f%% reached\n", roofline_tps, 100 * fraction);
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* sub = app.add_subcommand("bench", "Measure prefill/decode speed against the roofline");
  sub->add_option("--model", a->model, "Hugging Face model directory")->required();
  sub->add_option("--prompt-tokens", a->prompt_tokens, "Prompt length")->capture_default_str();
  sub->add_option("--gen-tokens", a->gen_tokens, "Tokens generated per run")->capture_default_str();
  sub->add_option("--batch", a->batch, "Rows decoded together")->capture_default_str();
  sub->add_option("--repeats", a->repeats, "Timed runs (after one warm-up)")->capture_default_str();
  sub->add_option("--threads", a->threads, "CPU threads (0 = all cores)");
  sub->add_flag("--json", a->json, "Print JSON");
  sub->callback([a] { run_bench(*a); });
}

}  // namespace tandem::cli
