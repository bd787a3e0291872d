// tandem bench: prefill and decode throughput over repeated runs, reported against the memory
// roofline (weight bytes one decode step must read ÷ this machine's measured bandwidth), and the
// cost of one target forward per shape: a decode step, verify windows of k tokens per row (with
// their commit), and a long prefill. --random-weights builds the model directly in the backend's
// memory from a config.json, so real sizes can be measured without weight files; when that config
// declares an MTP layer, the MTP draft step is timed with a random layer of that shape.
// A GLM-5 checkpoint (--model) gets the same figures: its plain runs go through the engine without
// a drafter, its draft step is the NextN layer's, and a step's bytes are its weights (the routed
// experts a batch touches) plus the latent entries and index keys its rows read.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "tandem/cli/commands.h"
#include "tandem/cli/common.h"
#include "tandem/core/error.h"
#include "tandem/core/sampler.h"
#include "tandem/engine/generator.h"
#include "tandem/engine/speculative.h"
#include "tandem/io/json_file.h"
#include "tandem/model/qwen3_5_config.h"
#include "tandem/model/qwen3_5_state.h"
#include "tandem/spec/draft.h"
#include "tandem/spec/glm_mtp.h"
#include "tandem/spec/qwen_mtp.h"

namespace tandem::cli {

namespace {

struct BenchArgs {
  std::string model;
  std::string random_weights;  // config.json of a random-weight model
  std::string backend = "auto";
  std::string windows = "2,4,8";
  int64_t step_context = 512;      // tokens each row holds before the timed steps
  int64_t long_prefill = 0;        // prompt length of the long-prefill timing (0: skip)
  int64_t long_prefill_chunk = 0;  // the engine chunk its GEMM tile follows (0: the whole prompt)
  int step_repeats = 20;
  int64_t prompt_tokens = 128;
  int64_t gen_tokens = 64;
  int batch = 1;
  int repeats = 5;
  int threads = 0;
  std::string step_output = "tokens";  // what a timed forward hands to the host, see time_steps
  std::string kv_dtype = "bf16";
  std::string rollback = "replay";  // RecurrentRollback of the timed verify windows
  bool keep_all = false;            // commit the whole window instead of its first token
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

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<int64_t> parse_windows(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) continue;
    int64_t k = 0;
    try {
      k = std::stoll(item);
    } catch (...) {
      fail("--windows: '", item, "' is not a number");
    }
    if (k < 2 || k > Qwen35Model::kMaxWindowTokens)
      fail("--windows: window ", k, " must be in 2..", Qwen35Model::kMaxWindowTokens);
    out.push_back(k);
  }
  return out;
}

// Median seconds of one target forward in which each of `batch` rows appends `k` tokens
// (k == 1: a decode step; k > 1: a verify window and its commit: what a round costs the target
// besides drafting). The commit keeps one token, as a fully rejected round (rows grow by one token
// per step), or with keep_all the whole window, as a fully accepted one. Rows first hold `context`
// tokens, in a state new_state() makes.
// Every window token gets logits; what reaches the host is what the engines take from a forward:
// Tokens, the greedy token of each (argmax on the device, as greedy decoding and verification
// run); Samples, a token drawn from each at T = 1 on the device (ops::sample_rows, as sampled
// decoding and verification run); Logits, the logits themselves (as log-probabilities and
// rejection sampling need, a vocab-sized PCIe copy per token).
enum class StepOutput { Tokens, Samples, Logits };

template <class Model, class NewState>
Spread time_steps(const Model& model, const NewState& new_state, int batch, int64_t k,
                  int64_t context, int repeats, StepOutput output, bool keep_all) {
  const auto state_ptr = new_state();
  auto& state = *state_ptr;
  std::vector<int> slots;
  std::vector<int32_t> tokens;
  std::vector<RowInput> rows;
  std::mt19937 rng(99);
  std::uniform_int_distribution<int32_t> pick(0,
                                              static_cast<int32_t>(model.config().vocab_size - 1));
  for (int b = 0; b < batch; ++b) {
    slots.push_back(state.open_row());
    for (int64_t i = 0; i < context; ++i) tokens.push_back(pick(rng));
    rows.push_back({slots.back(), context});
  }
  ForwardOutput out;
  ForwardRequest prefill{tokens, rows, false, false};
  prefill.prompt = true;
  model.forward(state, prefill, &out);
  std::vector<double> times;
  std::vector<RowKeep> keep;
  std::vector<ops::SampleRow> draws;
  for (int r = 0; r < repeats + 2; ++r) {  // two warm-up steps
    tokens.clear();
    rows.clear();
    keep.clear();
    for (int b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < k; ++i) tokens.push_back(pick(rng));
      rows.push_back({slots[static_cast<size_t>(b)], k, k > 1});
      keep.push_back({slots[static_cast<size_t>(b)], keep_all ? k : 1});
    }
    ops::synchronize();
    const double t0 = now_seconds();
    ForwardRequest req{tokens, rows, k > 1, false};
    req.want_logits = output == StepOutput::Logits;
    req.want_argmax = output != StepOutput::Logits;
    if (output == StepOutput::Samples) {
      draws.clear();
      SamplingParams t1;
      t1.temperature = 1.0f;
      t1.seed = static_cast<uint64_t>(r);
      for (size_t i = 0; i < tokens.size(); ++i) draws.push_back(ops::sample_row(t1, i));
      req.sample_rows = draws;
    }
    model.forward(state, req, &out);
    if (k > 1) model.commit_windows(state, keep);
    ops::synchronize();
    const double t = now_seconds() - t0;
    if (r >= 2) times.push_back(t);
  }
  return spread(times);
}

// Median seconds of one MTP drafting round at depth 1 for `batch` rows (the draft step: the MTP
// block over each row's pending token plus the target head, and its commit) with `provider`'s
// layer (the checkpoint's own, or a random one). The rows first hold `context` tokens of target
// hiddens.
Spread time_mtp_step(const spec::TargetView& target, const spec::DraftProvider& provider, int64_t H,
                     int batch, int64_t context, int repeats) {
  auto rows = provider.open_rows(target);
  std::vector<spec::CheckpointPtr> cold(static_cast<size_t>(batch));
  rows->append(cold);
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(target.vocab_size() - 1));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(batch));
  std::vector<float> hidden(static_cast<size_t>(context * H));
  for (float& h : hidden) h = normal(rng);
  std::vector<spec::RowPrefill> pre(static_cast<size_t>(batch));
  for (int b = 0; b < batch; ++b) {
    auto& p = prompts[static_cast<size_t>(b)];
    for (int64_t i = 0; i < context; ++i) p.push_back(pick(rng));
    pre[static_cast<size_t>(b)] = {b, p, hidden.data(), 0};
  }
  rows->prefill(pre);
  std::vector<spec::RowDraft> drafts(static_cast<size_t>(batch));
  std::vector<spec::DraftProposal> proposals;
  std::vector<spec::VerifyRow> verified(static_cast<size_t>(batch));
  std::vector<std::vector<int32_t>> windows(static_cast<size_t>(batch));
  std::vector<double> times;
  for (int r = 0; r < repeats + 2; ++r) {
    for (auto& d : drafts) {
      d.pending = pick(rng);
      d.depth = 1;
    }
    ops::synchronize();
    const double t0 = now_seconds();
    rows->draft(drafts, &proposals);
    for (int b = 0; b < batch; ++b) {
      auto& w = windows[static_cast<size_t>(b)];
      w = {drafts[static_cast<size_t>(b)].pending};
      w.insert(w.end(), proposals[static_cast<size_t>(b)].tokens.begin(),
               proposals[static_cast<size_t>(b)].tokens.end());
      verified[static_cast<size_t>(b)] = {w, hidden.data(), 0, pick(rng)};
    }
    rows->commit(verified);
    ops::synchronize();
    if (r >= 2) times.push_back(now_seconds() - t0);
  }
  return spread(times);
}

// Seconds of one prefill forward of `n` tokens in one row (median of `repeats`) in a fresh state
// new_state() makes, its GEMM tile the one an engine prefilling `chunk` tokens at a time uses.
template <class Model, class NewState>
Spread time_prefill(const Model& model, const NewState& new_state, int64_t n, int64_t chunk,
                    int repeats) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> pick(0,
                                              static_cast<int32_t>(model.config().vocab_size - 1));
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  std::vector<double> times;
  for (int r = 0; r < repeats + 1; ++r) {
    for (auto& t : tokens) t = pick(rng);
    const auto state = new_state();
    const int slot = state->open_row();
    const RowInput row{slot, n};
    ForwardOutput out;
    ops::synchronize();
    const double t0 = now_seconds();
    ForwardRequest req{tokens, std::span<const RowInput>(&row, 1), false, false};
    req.prompt = true;
    req.prompt_gemm_rows = ops::prefill_gemm_rows(chunk);
    model.forward(*state, req, &out);
    ops::synchronize();
    if (r > 0) times.push_back(now_seconds() - t0);
  }
  return spread(times);
}

// Prefill and decode throughput over the runs (the first a warm-up) of `gen` (a Generator or a
// SpeculativeGenerator) on random prompts.
template <class Gen>
void time_runs(const BenchArgs& a, int64_t vocab, Gen& gen, Spread* prefill_tps,
               Spread* decode_tps) {
  std::vector<double> prefill, decode;
  for (int r = 0; r <= a.repeats; ++r) {  // run 0 is a warm-up
    std::mt19937 rng(1234 + r);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
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
  *prefill_tps = spread(prefill);
  *decode_tps = spread(decode);
}

// Everything a bench run reports.
struct Measured {
  std::string name;
  uint64_t parameters = 0;
  Spread prefill, decode, step, mtp_step, long_prefill;
  std::vector<Spread> windows;
  double bandwidth = 0;      // bytes/s
  double weight_bytes = 0;   // weights a decode step of the batch reads
  double step_bytes = 0;     // with each row's caches and states
  double prefill_flops = 0;  // of the long prefill; 0: not counted for this model
  int64_t long_chunk = 0;
  const char* mtp_weights = "";  // "" when no draft step was timed
  std::string state_bytes;       // what the per-row bytes of a step are, in words
};

// Of a mixture of experts a step of `batch` rows reads the union of its rows' experts: for routing
// spread evenly, an expert is touched by none of the rows with probability (1 - k/E)^B.
double batch_weight_bytes(double decode_weight_bytes, double expert_bytes, int64_t top_k,
                          int64_t experts, int batch) {
  if (expert_bytes <= 0) return decode_weight_bytes;
  const double share = static_cast<double>(top_k) / static_cast<double>(experts);
  const double touched = 1.0 - std::pow(1.0 - share, batch);
  return decode_weight_bytes + (touched - share) * expert_bytes;
}

double measure_bandwidth() {
  std::fprintf(stderr, "bench: measuring memory bandwidth on %s\n",
               ops::device_description().c_str());
  return ops::memory_bandwidth();
}

// The forward costs per shape into m: the decode step of the batch, and each verify window.
template <class Model, class NewState>
void time_forwards(const BenchArgs& a, const Model& model, const NewState& new_state,
                   const std::vector<int64_t>& windows, StepOutput step_output, Measured* m) {
  std::fprintf(stderr,
               "bench: timing decode steps and verify windows (context %lld, %s to the host)\n",
               static_cast<long long>(a.step_context), a.step_output.c_str());
  m->step = time_steps(model, new_state, a.batch, 1, a.step_context, a.step_repeats, step_output,
                       a.keep_all);
  for (int64_t k : windows)
    m->windows.push_back(time_steps(model, new_state, a.batch, k, a.step_context, a.step_repeats,
                                    step_output, a.keep_all));
}

Measured measure_qwen(const BenchArgs& a, DType kv_dtype, const std::vector<int64_t>& windows,
                      StepOutput step_output, RecurrentRollback rollback) {
  Measured m;
  std::unique_ptr<Qwen35Model> model;
  if (!a.random_weights.empty()) {
    m.name = a.random_weights + " (random weights)";
    std::fprintf(stderr, "bench: building a random-weight model from %s on %s\n",
                 a.random_weights.c_str(), ops::device_description().c_str());
    model = random_weight_model(a.random_weights);
  } else {
    m.name = a.model;
    std::fprintf(stderr, "bench: loading %s\n", a.model.c_str());
    model = Qwen35Model::load(a.model);
  }
  const Qwen35Config& cfg = model->config();
  m.parameters = model->parameter_count();

  m.bandwidth = measure_bandwidth();

  Generator gen(*model, kPrefillChunkTokens, kv_dtype);
  time_runs(a, cfg.vocab_size, gen, &m.prefill, &m.decode);

  time_forwards(
      a, *model, [&] { return std::make_unique<Qwen35State>(cfg, rollback, kv_dtype); }, windows,
      step_output, &m);
  // The MTP drafter's round cost, where the config declares the layer: the checkpoint's own
  // (skipped when its tensors are absent), or a random one beside a random-weight model.
  const spec::QwenTargetView target(*model, "bench");
  std::unique_ptr<spec::QwenMtpProvider> mtp;
  if (cfg.mtp_num_hidden_layers > 0) {
    if (!a.random_weights.empty()) {
      mtp = spec::QwenMtpProvider::random(target, kRandomWeightsSeed);
      m.mtp_weights = "random";
    } else if (model->weights().find("mtp.fc.weight")) {
      mtp = spec::QwenMtpProvider::from_target(target);
      m.mtp_weights = "checkpoint";
    }
  }
  if (mtp) {
    std::fprintf(stderr, "bench: timing the MTP draft step (%s MTP layer)\n", m.mtp_weights);
    m.mtp_step =
        time_mtp_step(target, *mtp, cfg.hidden_size, a.batch, a.step_context, a.step_repeats);
  }
  m.long_chunk = a.long_prefill_chunk > 0 ? a.long_prefill_chunk : a.long_prefill;
  if (a.long_prefill > 0) {
    std::fprintf(stderr, "bench: timing a %lld-token prefill\n",
                 static_cast<long long>(a.long_prefill));
    m.long_prefill = time_prefill(
        *model,
        [&] { return std::make_unique<Qwen35State>(cfg, Qwen35State::kDefaultRollback, kv_dtype); },
        a.long_prefill, m.long_chunk, std::max(1, a.repeats / 2));
  }
  // Matrix FLOPs of a prefill token: 2 per weight of every projection (the head runs once per
  // row, not per token); attention's QK/PV add 4·ctx·heads·head_dim per layer on average ctx/2.
  int64_t n_attn = 0;
  for (LayerKind k : cfg.layer_types) n_attn += k == LayerKind::FullAttention;
  const double proj_params = static_cast<double>(model->decode_weight_bytes()) /
                                 (ops::backend() == ops::Backend::Cuda ? 2.0 : 4.0) -
                             static_cast<double>(cfg.vocab_size * cfg.hidden_size);
  m.prefill_flops = 2.0 * proj_params * static_cast<double>(a.long_prefill) +
                    static_cast<double>(n_attn) * 2.0 * static_cast<double>(a.long_prefill) *
                        static_cast<double>(a.long_prefill) *
                        static_cast<double>(cfg.num_attention_heads * cfg.head_dim);
  // One decode step reads every weight once for the whole batch, plus each row's KV prefix, and
  // reads and writes each row's Gated DeltaNet state (fp32: 100 MB per row at the 9B shape).
  const double mean_ctx = static_cast<double>(a.prompt_tokens) + a.gen_tokens / 2.0;
  const double kv_bytes_per_row =
      mean_ctx * static_cast<double>(n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim) *
      static_cast<double>(dtype_size(kv_dtype));
  const Qwen35State probe(cfg);
  const double state_bytes_per_row =
      2.0 * static_cast<double>(probe.linear_state_floats()) * sizeof(float);
  m.weight_bytes =
      batch_weight_bytes(static_cast<double>(model->decode_weight_bytes()),
                         static_cast<double>(model->expert_weight_bytes()), cfg.num_experts_per_tok,
                         std::max<int64_t>(cfg.num_experts, 1), a.batch);
  m.step_bytes = m.weight_bytes + a.batch * (kv_bytes_per_row + state_bytes_per_row);
  m.state_bytes = "KV (" + a.kv_dtype + ") + recurrent state in and out";
  return m;
}

// GLM-5 (--model of a glm_moe_dsa checkpoint): plain runs through the engine (no drafter), its
// forwards per shape, and its NextN layer's draft step where the checkpoint has one.
Measured measure_glm5(const BenchArgs& a, const std::vector<int64_t>& windows,
                      StepOutput step_output) {
  Measured m;
  m.name = a.model;
  std::fprintf(stderr, "bench: loading %s\n", a.model.c_str());
  const LoadedTarget target = load_target(a.model, /*with_identity=*/false);
  const Glm5Model& model = *target.glm;
  const Glm5Config& cfg = model.config();
  m.parameters = model.parameter_count();
  m.bandwidth = measure_bandwidth();

  SpecOptions plain;
  plain.depth = 0;
  SpeculativeGenerator gen(target.engine_target(DType::F32), cfg.vocab_size, nullptr, plain);
  time_runs(a, cfg.vocab_size, gen, &m.prefill, &m.decode);

  const auto new_state = [&] { return std::make_unique<Glm5State>(cfg, 0); };
  time_forwards(a, model, new_state, windows, step_output, &m);
  const std::string nextn =
      "model.layers." + std::to_string(cfg.num_hidden_layers) + ".eh_proj.weight";
  if (cfg.num_nextn_predict_layers > 0 && model.weights().find(nextn)) {
    m.mtp_weights = "checkpoint";
    std::fprintf(stderr, "bench: timing the NextN draft step\n");
    const auto provider = spec::GlmMtpProvider::from_target(*target.view);
    m.mtp_step = time_mtp_step(*target.view, *provider, cfg.hidden_size, a.batch, a.step_context,
                               a.step_repeats);
  }
  m.long_chunk = a.long_prefill_chunk > 0 ? a.long_prefill_chunk : a.long_prefill;
  if (a.long_prefill > 0) {
    std::fprintf(stderr, "bench: timing a %lld-token prefill\n",
                 static_cast<long long>(a.long_prefill));
    m.long_prefill =
        time_prefill(model, new_state, a.long_prefill, m.long_chunk, std::max(1, a.repeats / 2));
  }
  // A step reads, per row and layer, the latent entries its attention reads (the DSA choice's
  // index_topk positions once the prefix is longer) and, where the layer runs its indexer, every
  // position's index key; fp32 caches.
  const double mean_ctx = static_cast<double>(a.prompt_tokens) + a.gen_tokens / 2.0;
  const double attended = std::min(mean_ctx, static_cast<double>(cfg.index_topk));
  double row_bytes = 0;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    row_bytes += attended * static_cast<double>(cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4.0;
    if (!cfg.shared_index_layers[static_cast<size_t>(l)])
      row_bytes += mean_ctx * static_cast<double>(cfg.index_head_dim) * 4.0;
  }
  m.weight_bytes =
      batch_weight_bytes(static_cast<double>(model.decode_weight_bytes()),
                         static_cast<double>(model.expert_weight_bytes()), cfg.num_experts_per_tok,
                         std::max<int64_t>(cfg.n_routed_experts, 1), a.batch);
  m.step_bytes = m.weight_bytes + a.batch * row_bytes;
  m.state_bytes = "latent caches and index keys read";
  return m;
}

void report(const BenchArgs& a, const std::vector<int64_t>& windows, const Measured& m) {
  const double roofline_tps = m.bandwidth / m.step_bytes * a.batch;
  const double fraction = m.decode.median / roofline_tps;
  const bool has_mtp = *m.mtp_weights != '\0';
  if (a.json) {
    nlohmann::json j;
    j["model"] = m.name;
    j["backend"] = std::string(ops::backend_name(ops::backend()));
    j["device"] = ops::device_description();
    j["parameters"] = m.parameters;
    j["threads"] = ops::thread_count();
    j["batch"] = a.batch;
    j["prompt_tokens"] = a.prompt_tokens;
    j["gen_tokens"] = a.gen_tokens;
    j["repeats"] = a.repeats;
    j["prefill_tokens_per_second"] = to_json(m.prefill);
    j["decode_tokens_per_second"] = to_json(m.decode);
    j["memory_read_bandwidth_gb_per_s"] = m.bandwidth / 1e9;
    j["kv_dtype"] = a.kv_dtype;
    j["decode_bytes_per_step"] = m.step_bytes;
    j["decode_weight_bytes"] = m.weight_bytes;
    j["roofline_decode_tokens_per_second"] = roofline_tps;
    j["roofline_fraction"] = fraction;
    j["step_context"] = a.step_context;
    j["step_output"] = a.step_output;
    j["decode_step_seconds"] = to_json(m.step);
    nlohmann::json w = nlohmann::json::array();
    for (size_t i = 0; i < windows.size(); ++i)
      w.push_back({{"tokens", windows[i]},
                   {"seconds", to_json(m.windows[i])},
                   {"relative_to_decode_step", m.windows[i].median / m.step.median}});
    j["verify_windows"] = w;
    j["verify_rollback"] = a.rollback;
    j["verify_commit_keeps"] = a.keep_all ? "all" : "one";
    if (has_mtp) {
      j["mtp_draft_weights"] = m.mtp_weights;
      j["mtp_draft_step_seconds"] = to_json(m.mtp_step);
      j["mtp_draft_step_relative_to_decode_step"] = m.mtp_step.median / m.step.median;
    }
    if (a.long_prefill > 0) {
      j["long_prefill_tokens"] = a.long_prefill;
      j["long_prefill_chunk"] = m.long_chunk;
      j["long_prefill_seconds"] = to_json(m.long_prefill);
      j["long_prefill_tokens_per_second"] =
          static_cast<double>(a.long_prefill) / m.long_prefill.median;
      if (m.prefill_flops > 0)
        j["long_prefill_tflops"] = m.prefill_flops / m.long_prefill.median / 1e12;
    }
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::printf("device           %s\n", ops::device_description().c_str());
  std::printf("model            %s (%.1fM parameters)\n", m.name.c_str(),
              static_cast<double>(m.parameters) / 1e6);
  std::printf(
      "setup            batch %d, prompt %lld tokens, %lld generated, %d threads, %d runs\n",
      a.batch, static_cast<long long>(a.prompt_tokens), static_cast<long long>(a.gen_tokens),
      ops::thread_count(), a.repeats);
  std::printf("prefill          %.1f tok/s (min %.1f, max %.1f)\n", m.prefill.median, m.prefill.min,
              m.prefill.max);
  std::printf("decode           %.1f tok/s (min %.1f, max %.1f)\n", m.decode.median, m.decode.min,
              m.decode.max);
  std::printf("memory           %.2f GB/s measured\n", m.bandwidth / 1e9);
  std::printf("bytes per step   %.2f MB (weights %.2f MB + %s)\n", m.step_bytes / 1e6,
              m.weight_bytes / 1e6, m.state_bytes.c_str());
  std::printf("roofline         %.1f tok/s -> %.0f%% reached\n", roofline_tps, 100 * fraction);
  std::printf("decode step      %.3f ms (min %.3f, max %.3f), batch %d, context %lld, %s out\n",
              m.step.median * 1e3, m.step.min * 1e3, m.step.max * 1e3, a.batch,
              static_cast<long long>(a.step_context), a.step_output.c_str());
  for (size_t i = 0; i < windows.size(); ++i)
    std::printf(
        "verify %2lld tokens %.3f ms (min %.3f, max %.3f) = %.2fx a decode step (with a commit "
        "keeping %s, %s rollback)\n",
        static_cast<long long>(windows[i]), m.windows[i].median * 1e3, m.windows[i].min * 1e3,
        m.windows[i].max * 1e3, m.windows[i].median / m.step.median, a.keep_all ? "all" : "one",
        a.rollback.c_str());
  if (has_mtp)
    std::printf("MTP draft step   %.3f ms (min %.3f, max %.3f) = %.2fx a decode step (%s layer)\n",
                m.mtp_step.median * 1e3, m.mtp_step.min * 1e3, m.mtp_step.max * 1e3,
                m.mtp_step.median / m.step.median, m.mtp_weights);
  if (a.long_prefill > 0) {
    std::printf("prefill %lld      %.1f tok/s (%.3f s, min %.3f, max %.3f)",
                static_cast<long long>(a.long_prefill),
                static_cast<double>(a.long_prefill) / m.long_prefill.median, m.long_prefill.median,
                m.long_prefill.min, m.long_prefill.max);
    if (m.prefill_flops > 0)
      std::printf(", %.1f TFLOP/s", m.prefill_flops / m.long_prefill.median / 1e12);
    std::printf(", chunk %lld\n", static_cast<long long>(m.long_chunk));
  }
}

void run_bench(const BenchArgs& a) {
  const DType kv_dtype = parse_kv_dtype(a.kv_dtype);
  apply_threads(a.threads);
  const auto context = apply_backend(a.backend);
  const ops::ContextScope context_scope(*context);
  if (a.prompt_tokens < 1 || a.gen_tokens < 2 || a.batch < 1 || a.repeats < 1)
    fail("bench: need --prompt-tokens >= 1, --gen-tokens >= 2, --batch >= 1, --repeats >= 1");
  if (a.model.empty() == a.random_weights.empty())
    fail("bench: give exactly one of --model DIR or --random-weights CONFIG.json");
  if (a.step_context < 1 || a.step_repeats < 1 || a.long_prefill < 0 || a.long_prefill_chunk < 0)
    fail(
        "bench: need --step-context >= 1, --step-repeats >= 1, --long-prefill >= 0, "
        "--long-prefill-chunk >= 0");
  const std::vector<int64_t> windows = parse_windows(a.windows);
  if (a.step_output != "tokens" && a.step_output != "samples" && a.step_output != "logits")
    fail("bench: --step-output must be tokens, samples or logits, got '", a.step_output, "'");
  const StepOutput step_output = a.step_output == "logits"    ? StepOutput::Logits
                                 : a.step_output == "samples" ? StepOutput::Samples
                                                              : StepOutput::Tokens;
  if (a.rollback != "replay" && a.rollback != "per-position")
    fail("bench: --rollback must be replay or per-position, got '", a.rollback, "'");
  const RecurrentRollback rollback =
      a.rollback == "replay" ? RecurrentRollback::Replay : RecurrentRollback::PerPositionStates;
  const bool glm5 = !a.model.empty() && is_glm5_dir(a.model);
  const Measured m = glm5 ? measure_glm5(a, windows, step_output)
                          : measure_qwen(a, kv_dtype, windows, step_output, rollback);
  report(a, windows, m);
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* sub = app.add_subcommand("bench", "Measure prefill/decode speed against the roofline");
  sub->add_option("--model", a->model, "Hugging Face model directory");
  sub->add_option("--random-weights", a->random_weights,
                  "config.json: build a random-weight model of that shape in device memory");
  sub->add_option("--backend", a->backend, "cpu, cuda or auto (cuda when a GPU is present)")
      ->capture_default_str();
  sub->add_option("--windows", a->windows, "Verify window sizes to time (tokens per row)")
      ->capture_default_str();
  sub->add_option("--step-context", a->step_context, "Tokens per row before the timed steps")
      ->capture_default_str();
  sub->add_option("--step-repeats", a->step_repeats, "Timed forwards per shape")
      ->capture_default_str();
  sub->add_option("--step-output", a->step_output,
                  "What a timed step or window hands to the host: tokens (greedy ids picked on "
                  "the device), samples (ids drawn at T = 1 on the device) or logits (every "
                  "window token's, as log-probabilities and rejection sampling need)")
      ->capture_default_str();
  sub->add_option("--long-prefill", a->long_prefill,
                  "Prompt length of the prefill timing (0: skip)")
      ->capture_default_str();
  sub->add_option("--long-prefill-chunk", a->long_prefill_chunk,
                  "Prefill chunk whose GEMM tile the prefill timing uses, as generate and serve "
                  "with --prefill-chunk (0: the whole prompt)")
      ->capture_default_str();
  sub->add_option("--prompt-tokens", a->prompt_tokens, "Prompt length")->capture_default_str();
  sub->add_option("--gen-tokens", a->gen_tokens, "Tokens generated per run")->capture_default_str();
  sub->add_option("--batch", a->batch, "Rows decoded together")->capture_default_str();
  sub->add_option("--repeats", a->repeats, "Timed runs (after one warm-up)")->capture_default_str();
  sub->add_option("--threads", a->threads, "CPU threads (0 = all cores)");
  add_kv_dtype_option(sub, &a->kv_dtype);
  sub->add_option("--rollback", a->rollback,
                  "How timed verify windows keep their rollback: replay (the engines' default: "
                  "the commit replays the kept tokens) or per-position (states after every token)")
      ->capture_default_str();
  sub->add_flag("--keep-all", a->keep_all,
                "Timed verify windows commit every token (a fully accepted round) instead of one");
  sub->add_flag("--json", a->json, "Print JSON");
  sub->callback([a] { run_bench(*a); });
}

}  // namespace tandem::cli
