// tandem bench-spec: speculative decoding against plain decoding on the same prompts in the same
// process: acceptance by window position, mean accepted length, tokens per target forward and
// tokens/s for each drafter and depth, at a given batch size, overall (prompts included) and of
// the decode rounds alone. Every speculative run's tokens are checked against the plain run's
// (match verification is lossless at any temperature).
//
// --drafts continuation measures speed-up against acceptance: the plain run's own output is
// proposed back with each proposal corrupted with probability 1 - p (spec/continuation.h), for
// each p of --accept-p. With --random-weights CONFIG and --random-prompts it runs on a model of
// any shape without a checkpoint.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "tandem/cli/commands.h"
#include "tandem/cli/common.h"
#include "tandem/core/error.h"
#include "tandem/engine/speculative.h"
#include "tandem/io/artifact_identity.h"
#include "tandem/io/json_file.h"
#include "tandem/spec/continuation.h"
#include "tandem/spec/depth_policy.h"
#include "tandem/spec/eagle3.h"
#include "tandem/spec/glm_mtp.h"
#include "tandem/spec/ngram.h"
#include "tandem/spec/qwen_mtp.h"

namespace tandem::cli {

namespace {

// Seed of --random-prompts.
constexpr uint64_t kRandomPromptSeed = 1234;
// Seed of the continuation drafter's corruption draws.
constexpr uint64_t kContinuationSeed = 77;

struct BenchSpecArgs {
  std::string model, prompts_file;
  std::string random_weights;  // config.json of a random-weight model
  int random_prompts = 0;      // prompts of random token ids, instead of --prompts-file
  int64_t prompt_tokens = 512;
  std::string drafts = "mtp,ngram";
  std::string accept_p = "0.8";
  std::optional<std::string> draft_model;  // the EAGLE-3 head of --drafts eagle3
  std::string draft_vocab = "0";           // --drafts mtp on Qwen3.5: draft vocabularies to measure
  std::string depths = "1,2,3,4";
  int batch = 1;
  int64_t max_tokens = 64;
  int repeats = 3;
  // Untimed runs of each setting before the timed ones. One sizes buffers and captures the
  // fixed-depth CUDA graphs; --depth auto visits (rows, depth) shapes over many runs, so its
  // steady state, a server's, needs more.
  int warmup = 1;
  int threads = 0;
  std::string backend = "auto";
  float temperature = 0.0f;
  std::string kv_dtype = "bf16";
  bool json = false;
  bool round_split = false;
  bool settled_rounds = false;
  bool fresh_engines = false;  // a new engine for every group (a cold start each)
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

struct Measured {
  std::string draft;
  double accept_p = -1;   // the continuation drafter's p; -1 for the others
  bool identical = true;  // every request's tokens equal the plain run's
  int depth = 0;          // fixed, or the most an adaptive round proposes
  bool automatic = false;
  double tokens_per_second = 0;  // generated tokens / wall time of all groups (median run)
  // Tokens after each request's first / time in decode rounds: the prompts' prefill left out.
  double decode_tokens_per_second = 0;
  SpecStats total;  // summed over requests
  // --round-split: ms per round in each phase, from one more run that waits for the device at
  // each phase's end; empty without it.
  std::vector<double> phase_ms;  // draft, verify, accept, commit
  // The same phases' host time per round in the measured runs, where nothing waits at a phase's
  // end: what the host spends queueing each phase, and where it waits for the device (a host
  // round waits in verify, a settled round in accept, when it reads the round before).
  std::vector<double> host_ms;
  // Where a group's wall time goes, ms per group of the last measured run: the prompts' prefill
  // forwards, the decode rounds, the drafter's prompt pass (and the rows' move into the decoding
  // group), the engine's other step work (row changes: admissions, reads of queued work, rows
  // leaving), and the rest (submitting, engine set-up with --fresh-engines).
  double group_wall_ms = 0, group_prefill_ms = 0, group_decode_ms = 0;
  double group_drafter_prefill_ms = 0, group_row_change_ms = 0, group_drafter_move_ms = 0;
  // Of the decode rounds, the time the host was blocked on the device; the rest of decode is the
  // host's own work, and where the device waited for it, the round was host-bound.
  double group_decode_wait_ms = 0;
  // Rounds per group by the depth they ran at ([0..depth]), in the last measured run; and, with
  // an adaptive depth, the policy's round-cost estimate in ms at the end (per row count 1, 2, 4,
  // ... up to the batch: [0..depth], null where nothing is known yet).
  std::vector<double> group_rounds_by_depth;
  double group_cold_graph_runs = 0;       // CUDA graphs run cold per group (GenerateStats)
  double group_device_commit_rounds = 0;  // rounds committed on the device per group
  // {"rows": [ms at depth 0, 1, ...]}, null for a depth with no estimate; null without a policy.
  nlohmann::json depth_cost_ms;
};

// The requests in batches of `batch`, in order (the last may be smaller).
std::vector<std::vector<GenerateRequest>> groups_of(const std::vector<GenerateRequest>& reqs,
                                                    int batch) {
  std::vector<std::vector<GenerateRequest>> groups;
  for (size_t g = 0; g < reqs.size(); g += static_cast<size_t>(batch))
    groups.emplace_back(
        reqs.begin() + static_cast<std::ptrdiff_t>(g),
        reqs.begin() + static_cast<std::ptrdiff_t>(std::min(reqs.size(), g + batch)));
  return groups;
}

// One more run of every group with the device awaited at each round phase's end: the mean time
// per round of each phase.
std::vector<double> round_split(const LoadedTarget& target, DType kv_dtype,
                                const spec::DraftProvider* drafter, SpecOptions opts,
                                const std::vector<GenerateRequest>& reqs, int batch) {
  opts.sync_phases = true;
  SpeculativeGenerator gen(target.engine_target(kv_dtype), target.view->vocab_size(), drafter,
                           opts);
  double phases[4] = {0, 0, 0, 0};
  int64_t rounds = 0;
  for (const std::vector<GenerateRequest>& group : groups_of(reqs, batch)) {
    GenerateStats st;
    gen.run(group, {}, &st);
    phases[0] += st.draft_seconds;
    phases[1] += st.verify_seconds;
    phases[2] += st.accept_seconds;
    phases[3] += st.commit_seconds;
    rounds += st.decode_steps;
  }
  std::vector<double> ms;
  for (double p : phases) ms.push_back(rounds > 0 ? 1e3 * p / static_cast<double>(rounds) : 0.0);
  return ms;
}

// outputs: the last run's tokens per request.
Measured measure(const LoadedTarget& target, DType kv_dtype, const spec::DraftProvider* drafter,
                 DepthArg depth, const std::vector<GenerateRequest>& reqs, int batch, int warmup,
                 int repeats, bool split, bool settled, bool fresh_engines,
                 std::vector<std::vector<int32_t>>* outputs) {
  // The probe stays off: this measures each drafter at the depth asked, whatever it accepts.
  if (drafter && depth.automatic) depth.depth = auto_max_depth(depth, drafter->id());
  SpecOptions opts{depth.depth, spec::VerifyMode::Match};
  opts.health_probe = false;
  opts.auto_depth = depth.automatic;
  opts.settled_rounds = settled;
  SpeculativeGenerator gen(target.engine_target(kv_dtype), target.view->vocab_size(), drafter,
                           opts);
  gen.set_keep_engine(!fresh_engines);
  Measured m;
  m.draft = drafter ? drafter->id() : "none";
  m.depth = drafter ? depth.depth : 0;
  m.automatic = drafter && depth.automatic;
  std::vector<double> rates, decode_rates;
  outputs->assign(reqs.size(), {});
  for (int rep = 0; rep < warmup + repeats; ++rep) {
    SpecStats sum;
    sum.accepted_by_position.assign(static_cast<size_t>(m.depth), 0);
    sum.drafted_by_position.assign(static_cast<size_t>(m.depth), 0);
    int64_t tokens = 0, decode_tokens = 0, rounds = 0;
    std::vector<int64_t> rounds_by_depth(static_cast<size_t>(m.depth) + 1, 0);
    int64_t cold_graph_runs = 0, device_commit_rounds = 0;
    double decode_seconds = 0, prefill_seconds = 0, phases[4] = {0, 0, 0, 0};
    double drafter_prefill_seconds = 0, row_change_seconds = 0, drafter_move_seconds = 0;
    double decode_wait_seconds = 0;
    int64_t groups = 0;
    const auto t0 = std::chrono::steady_clock::now();
    size_t first = 0;  // of the group's requests
    for (const std::vector<GenerateRequest>& group : groups_of(reqs, batch)) {
      std::vector<SpecStats> st;
      GenerateStats gs;
      const auto res = gen.run(group, {}, &gs, &st);
      decode_tokens += gs.decode_tokens;
      decode_seconds += gs.decode_seconds;
      prefill_seconds += gs.prefill_seconds;
      drafter_prefill_seconds += gs.drafter_prefill_seconds;
      row_change_seconds += gs.row_change_seconds;
      drafter_move_seconds += gs.drafter_move_seconds;
      decode_wait_seconds += gs.decode_wait_seconds;
      ++groups;
      phases[0] += gs.draft_seconds;
      phases[1] += gs.verify_seconds;
      phases[2] += gs.accept_seconds;
      phases[3] += gs.commit_seconds;
      rounds += gs.decode_steps;
      cold_graph_runs += gs.cold_graph_runs;
      device_commit_rounds += gs.device_commit_rounds;
      for (size_t d = 0; d < gs.rounds_by_depth.size() && d < rounds_by_depth.size(); ++d)
        rounds_by_depth[d] += gs.rounds_by_depth[d];
      for (size_t i = 0; i < res.size(); ++i) {
        (*outputs)[first + i] = res[i].tokens;
        tokens += static_cast<int64_t>(res[i].tokens.size());
        sum.rounds += st[i].rounds;
        sum.drafted += st[i].drafted;
        sum.accepted += st[i].accepted;
        sum.target_forwards += st[i].target_forwards;
        sum.emitted += st[i].emitted;
        for (int j = 0; j < m.depth; ++j) {
          sum.accepted_by_position[j] += st[i].accepted_by_position[j];
          sum.drafted_by_position[j] += st[i].drafted_by_position[j];
        }
      }
      first += group.size();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep < warmup) continue;
    rates.push_back(static_cast<double>(tokens) / s);
    decode_rates.push_back(decode_seconds > 0 ? static_cast<double>(decode_tokens) / decode_seconds
                                              : 0.0);
    m.total = sum;
    m.group_wall_ms = 1e3 * s / static_cast<double>(groups);
    m.group_prefill_ms = 1e3 * prefill_seconds / static_cast<double>(groups);
    m.group_decode_ms = 1e3 * decode_seconds / static_cast<double>(groups);
    m.group_drafter_prefill_ms = 1e3 * drafter_prefill_seconds / static_cast<double>(groups);
    m.group_row_change_ms = 1e3 * row_change_seconds / static_cast<double>(groups);
    m.group_drafter_move_ms = 1e3 * drafter_move_seconds / static_cast<double>(groups);
    m.group_decode_wait_ms = 1e3 * decode_wait_seconds / static_cast<double>(groups);
    m.group_cold_graph_runs = static_cast<double>(cold_graph_runs) / static_cast<double>(groups);
    m.group_device_commit_rounds =
        static_cast<double>(device_commit_rounds) / static_cast<double>(groups);
    m.group_rounds_by_depth.clear();
    for (int64_t n : rounds_by_depth)
      m.group_rounds_by_depth.push_back(static_cast<double>(n) / static_cast<double>(groups));
    m.host_ms.clear();
    for (double ph : phases)
      m.host_ms.push_back(rounds > 0 ? 1e3 * ph / static_cast<double>(rounds) : 0.0);
  }
  std::sort(rates.begin(), rates.end());
  std::sort(decode_rates.begin(), decode_rates.end());
  m.tokens_per_second = rates[rates.size() / 2];
  m.decode_tokens_per_second = decode_rates[decode_rates.size() / 2];
  if (const spec::DepthPolicy* policy = gen.depth_policy())
    for (int64_t rows = 1;; rows *= 2) {
      nlohmann::json costs = nlohmann::json::array();
      for (int d = 0; d <= m.depth; ++d) {
        const std::optional<double> c = policy->cost(rows, d);
        costs.push_back(c ? nlohmann::json(1e3 * *c) : nlohmann::json());
      }
      m.depth_cost_ms[std::to_string(rows)] = std::move(costs);
      if (rows >= batch) break;
    }
  if (split && drafter) m.phase_ms = round_split(target, kv_dtype, drafter, opts, reqs, batch);
  return m;
}

// --accept-p: each p in [0, 1].
std::vector<double> parse_accept_p(const std::string& list) {
  std::vector<double> ps;
  for (const std::string& item : split_list(list)) {
    size_t used = 0;
    double p = -1;
    try {
      p = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || !(p >= 0.0 && p <= 1.0))
      fail("--accept-p: '", item, "' is not a probability in [0, 1]");
    ps.push_back(p);
  }
  if (ps.empty()) fail("--accept-p: no probability given");
  return ps;
}

// The target of --model or --random-weights.
LoadedTarget open_target(const BenchSpecArgs& a) {
  if (a.model.empty()) {
    std::fprintf(stderr, "bench-spec: building a random-weight model from %s on %s\n",
                 a.random_weights.c_str(), ops::device_description().c_str());
    LoadedTarget t;
    t.qwen = random_weight_model(a.random_weights);
    t.view = std::make_unique<spec::QwenTargetView>(*t.qwen, "random-weights:" + a.random_weights);
    return t;
  }
  return load_target(a.model, true);
}

// The requests of --prompts-file, or --random-prompts prompts of --prompt-tokens random ids.
std::vector<GenerateRequest> open_requests(const BenchSpecArgs& a, const LoadedTarget& target) {
  GenerateRequest shape;
  shape.max_tokens = a.max_tokens;
  shape.ignore_eos = true;
  shape.sampling.temperature = a.temperature;
  std::vector<GenerateRequest> reqs;
  if (a.random_prompts > 0) {
    std::mt19937 rng(kRandomPromptSeed);
    std::uniform_int_distribution<int32_t> pick(
        0, static_cast<int32_t>(target.view->vocab_size() - 1));
    reqs.assign(static_cast<size_t>(a.random_prompts), shape);
    for (auto& q : reqs) {
      q.prompt.resize(static_cast<size_t>(a.prompt_tokens));
      for (auto& id : q.prompt) id = pick(rng);
    }
  } else {
    const auto tok = a.model.empty() ? std::nullopt : open_tokenizer(a.model);
    reqs = read_prompts_file(a.prompts_file, shape, tok);
  }
  for (size_t i = 0; i < reqs.size(); ++i) reqs[i].sampling.seed = i;
  return reqs;
}

void run_bench_spec(const BenchSpecArgs& a) {
  const DType kv_dtype = parse_kv_dtype(a.kv_dtype);
  if (a.model.empty() == a.random_weights.empty())
    fail("bench-spec: give exactly one of --model DIR or --random-weights CONFIG.json");
  if (a.prompts_file.empty() == (a.random_prompts == 0))
    fail("bench-spec: give exactly one of --prompts-file FILE or --random-prompts N");
  if (a.batch < 1 || a.repeats < 1 || a.warmup < 0 || a.max_tokens < 1 || a.random_prompts < 0 ||
      a.prompt_tokens < 1)
    fail(
        "bench-spec: need --batch >= 1, --repeats >= 1, --warmup >= 0, --max-tokens >= 1, "
        "--random-prompts >= 0, --prompt-tokens >= 1");
  const std::vector<std::string> drafts = split_list(a.drafts);
  const bool continuation = std::find(drafts.begin(), drafts.end(), "continuation") != drafts.end();
  const std::vector<double> accept_ps =
      continuation ? parse_accept_p(a.accept_p) : std::vector<double>{};
  if (a.draft_model && std::find(drafts.begin(), drafts.end(), "eagle3") == drafts.end())
    fail("--draft-model names the EAGLE-3 head of --drafts eagle3, which is not listed");
  std::vector<int64_t> draft_vocabs;
  for (const std::string& v : split_list(a.draft_vocab)) {
    size_t used = 0;
    long long n = -1;
    try {
      n = std::stoll(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != v.size() || n < 0)
      fail("--draft-vocab: expected token counts >= 0 (0: the whole vocabulary), got '", v, "'");
    draft_vocabs.push_back(n);
  }
  if (draft_vocabs.empty()) fail("--draft-vocab: no token count given");
  apply_threads(a.threads);
  const auto context = apply_backend(a.backend);
  const ops::ContextScope context_scope(*context);
  const LoadedTarget target = open_target(a);
  const auto reqs = open_requests(a, target);
  if (reqs.empty()) fail("bench-spec: no prompts");

  std::vector<Measured> rows;
  std::fprintf(stderr, "bench-spec: %zu prompts, batch %d, %lld tokens each, %d threads\n",
               reqs.size(), a.batch, static_cast<long long>(a.max_tokens), ops::thread_count());
  std::vector<std::vector<int32_t>> plain, got;
  rows.push_back(measure(target, kv_dtype, nullptr, DepthArg{}, reqs, a.batch, a.warmup, a.repeats,
                         false, false, a.fresh_engines, &plain));
  const double base = rows[0].tokens_per_second;
  const double decode_base = rows[0].decode_tokens_per_second;
  auto run_depths = [&](const spec::DraftProvider& drafter, const std::string& name, double p) {
    for (const std::string& ds : split_list(a.depths)) {
      const DepthArg depth = parse_depth(ds);
      rows.push_back(measure(target, kv_dtype, &drafter, depth, reqs, a.batch, a.warmup, a.repeats,
                             a.round_split, a.settled_rounds, a.fresh_engines, &got));
      Measured& m = rows.back();
      m.draft = name;  // as listed: mtp and mtp-empty share a drafter id
      m.accept_p = p;
      m.identical = got == plain;
      char at[24] = "";
      if (p >= 0) std::snprintf(at, sizeof at, " p=%.2f", p);
      std::fprintf(stderr, "bench-spec: %s%s depth %s: %.1f tok/s%s\n", name.c_str(), at,
                   ds.c_str(), m.tokens_per_second,
                   m.identical ? "" : " (OUTPUT DIFFERS FROM PLAIN)");
      if (m.automatic && m.group_cold_graph_runs > 0)
        std::fprintf(stderr,
                     "bench-spec: depth %s ran %.0f CUDA graphs cold a batch in its last timed "
                     "run (shapes the policy had not run yet): a start-up figure; --warmup 40 "
                     "measures its steady state\n",
                     ds.c_str(), m.group_cold_graph_runs);
    }
  };
  for (const std::string& d : drafts) {
    if (d == "continuation") {
      // The target's own continuations, as the plain run produced them.
      std::vector<std::vector<int32_t>> refs;
      for (size_t i = 0; i < reqs.size(); ++i) {
        refs.push_back(reqs[i].prompt);
        refs.back().insert(refs.back().end(), plain[i].begin(), plain[i].end());
      }
      for (double p : accept_ps) {
        const spec::ContinuationProvider drafter(refs, p, kContinuationSeed);
        run_depths(drafter, d, p);
      }
      continue;
    }
    std::unique_ptr<spec::DraftProvider> drafter;
    if (d == "mtp" && target.glm)
      drafter = spec::GlmMtpProvider::from_target(*target.view);
    else if (d == "mtp-empty" && target.glm)
      drafter = spec::GlmMtpProvider::from_target(*target.view, spec::GlmMtpHistory::Empty);
    else if (d == "mtp") {
      // One run per draft vocabulary (0: the whole vocabulary), named mtp/v<tokens> when cut.
      for (const int64_t tokens : draft_vocabs) {
        auto mtp = a.model.empty() ? spec::QwenMtpProvider::random(*target.view, kRandomWeightsSeed)
                                   : spec::QwenMtpProvider::from_target(*target.view);
        mtp->set_draft_vocabulary(tokens);
        run_depths(*mtp, tokens == 0 ? d : d + "/v" + std::to_string(tokens), -1);
      }
      continue;
    } else if (d == "ngram")
      drafter = std::make_unique<spec::NgramProvider>(spec::NgramOptions{});
    else if (d == "eagle3" && a.draft_model)
      drafter = spec::Eagle3Provider::open(*a.draft_model);
    else if (d == "eagle3")
      fail("--drafts eagle3 needs --draft-model DIR: the EAGLE-3 head's directory");
    else
      fail("--drafts: unknown drafter '", d,
           "' (mtp, ngram, eagle3, continuation; GLM-5 also mtp-empty)");
    run_depths(*drafter, d, -1);
  }
  nlohmann::json out = nlohmann::json::array();
  if (!a.json)
    std::printf("%-12s %4s %5s %10s %8s %10s %8s %6s %8s  %s\n", "draft", "p", "depth", "tok/s",
                "speedup", "decode t/s", "decode x", "AL", "tok/fwd", "acceptance by position");
  for (const Measured& m : rows) {
    std::vector<double> by_pos;
    for (int j = 0; j < m.depth; ++j)
      by_pos.push_back(m.total.drafted_by_position[j]
                           ? static_cast<double>(m.total.accepted_by_position[j]) /
                                 static_cast<double>(m.total.drafted_by_position[j])
                           : 0.0);
    if (a.json) {
      out.push_back(
          {{"draft", m.draft},
           {"depth", m.automatic ? nlohmann::json("auto") : nlohmann::json(m.depth)},
           {"tokens_per_second", m.tokens_per_second},
           {"speedup", m.tokens_per_second / base},
           {"decode_tokens_per_second", m.decode_tokens_per_second},
           {"decode_speedup", m.decode_tokens_per_second / decode_base},
           {"mean_accepted_length", m.total.mean_accepted_length()},
           {"tokens_per_target_forward", m.total.tokens_per_target_forward()},
           {"acceptance_rate", m.total.acceptance_rate()},
           {"acceptance_by_position", by_pos},
           {"accept_p", m.accept_p >= 0 ? nlohmann::json(m.accept_p) : nlohmann::json()},
           {"identical_to_plain", m.identical},
           {"round_phase_ms", m.phase_ms.empty() ? nlohmann::json()
                                                 : nlohmann::json{{"draft", m.phase_ms[0]},
                                                                  {"verify", m.phase_ms[1]},
                                                                  {"accept", m.phase_ms[2]},
                                                                  {"commit", m.phase_ms[3]}}},
           {"round_host_ms", m.draft == "none" || m.host_ms.size() != 4
                                 ? nlohmann::json()
                                 : nlohmann::json{{"draft", m.host_ms[0]},
                                                  {"verify", m.host_ms[1]},
                                                  {"accept", m.host_ms[2]},
                                                  {"commit", m.host_ms[3]}}},
           {"group_ms",
            {{"wall", m.group_wall_ms},
             {"prefill", m.group_prefill_ms},
             {"decode", m.group_decode_ms},
             {"decode_wait", m.group_decode_wait_ms},  // of decode: blocked on the device
             {"drafter_prefill", m.group_drafter_prefill_ms},
             {"drafter_move", m.group_drafter_move_ms},  // of drafter_prefill
             {"row_changes", m.group_row_change_ms},
             {"other", m.group_wall_ms - m.group_prefill_ms - m.group_decode_ms -
                           m.group_drafter_prefill_ms - m.group_row_change_ms}}},
           {"rounds_by_depth", m.group_rounds_by_depth},
           {"cold_graph_runs", m.group_cold_graph_runs},
           {"device_commit_rounds", m.group_device_commit_rounds},
           {"depth_cost_ms", m.depth_cost_ms},
           {"batch", a.batch}});
      continue;
    }
    std::string pos;
    for (double p : by_pos) {
      char buf[16];
      std::snprintf(buf, sizeof buf, "%s%.2f", pos.empty() ? "" : " ", p);
      pos += buf;
    }
    const std::string depth = m.automatic ? "auto" : std::to_string(m.depth);
    char p[16] = "-";
    if (m.accept_p >= 0) std::snprintf(p, sizeof p, "%.2f", m.accept_p);
    std::printf("%-12s %4s %5s %10.1f %7.2fx %10.1f %7.2fx %6.2f %8.2f  %s%s\n", m.draft.c_str(), p,
                depth.c_str(), m.tokens_per_second, m.tokens_per_second / base,
                m.decode_tokens_per_second, m.decode_tokens_per_second / decode_base,
                m.total.mean_accepted_length(), m.total.tokens_per_target_forward(), pos.c_str(),
                m.identical ? "" : "  OUTPUT DIFFERS FROM PLAIN");
    if (!m.phase_ms.empty())
      std::printf("%-12s ms per round: draft %.3f, verify %.3f, accept %.3f, commit %.3f\n", "",
                  m.phase_ms[0], m.phase_ms[1], m.phase_ms[2], m.phase_ms[3]);
  }
  if (a.json) std::cout << out.dump(2) << "\n";
  for (const Measured& m : rows)
    if (!m.identical)
      fail("bench-spec: ", m.draft, " at depth ", m.automatic ? "auto" : std::to_string(m.depth),
           " produced other tokens than plain decoding (speculation must be lossless)");
}

}  // namespace

void add_bench_spec_command(CLI::App& app) {
  auto a = std::make_shared<BenchSpecArgs>();
  CLI::App* sub = app.add_subcommand(
      "bench-spec", "Speculative vs plain decoding on the same prompts: acceptance and speed");
  sub->add_option("--model", a->model, "Hugging Face model directory");
  sub->add_option("--random-weights", a->random_weights,
                  "config.json: a random-weight model of that shape instead of --model (its "
                  "--drafts mtp is a random MTP layer)");
  sub->add_option("--prompts-file", a->prompts_file, "JSONL with a \"prompt\" per line");
  sub->add_option("--random-prompts", a->random_prompts,
                  "Instead of --prompts-file: this many prompts of random token ids");
  sub->add_option("--prompt-tokens", a->prompt_tokens, "Tokens per --random-prompts prompt")
      ->capture_default_str();
  sub->add_option("--drafts", a->drafts,
                  "Drafters to compare: mtp, ngram, eagle3, continuation (the plain run's own "
                  "output proposed back, each proposal corrupted with probability 1 - p)")
      ->capture_default_str();
  sub->add_option("--accept-p", a->accept_p,
                  "--drafts continuation: the acceptance probabilities p to measure (a list)")
      ->capture_default_str();
  sub->add_option("--draft-model", a->draft_model,
                  "The EAGLE-3 head directory --drafts eagle3 drafts with");
  sub->add_option("--draft-vocab", a->draft_vocab,
                  "--drafts mtp on Qwen3.5: draft vocabularies to compare, a list of token counts "
                  "(each draft step scores token ids below it; 0 = the whole vocabulary)")
      ->capture_default_str();
  sub->add_option("--depths", a->depths,
                  "Depths to compare (numbers, auto or auto:K for adaptive rounds)")
      ->capture_default_str();
  sub->add_option("--batch", a->batch, "Requests per batch")->capture_default_str();
  sub->add_option("--max-tokens", a->max_tokens, "Tokens per request")->capture_default_str();
  sub->add_option("--temperature", a->temperature, "Sampling temperature")->capture_default_str();
  sub->add_option("--repeats", a->repeats, "Timed runs of each setting")->capture_default_str();
  sub->add_option("--warmup", a->warmup,
                  "Untimed runs of each setting first (--depths auto reaches a server's steady "
                  "state, every shape's CUDA graphs captured, after tens of them)")
      ->capture_default_str();
  sub->add_option("--threads", a->threads, "CPU threads (0 = all cores)");
  add_kv_dtype_option(sub, &a->kv_dtype);
  sub->add_option("--backend", a->backend, "cpu, cuda or auto (cuda when a GPU is present)")
      ->capture_default_str();
  sub->add_flag("--json", a->json, "Print JSON");
  sub->add_flag("--settled-rounds", a->settled_rounds,
                "MTP rounds accepted and committed on the device, each queued before the host "
                "reads the one before (SpecOptions::settled_rounds)");
  sub->add_flag("--fresh-engines", a->fresh_engines,
                "Open a new engine (target state, drafter rows, their CUDA graphs) for every "
                "group, as a cold start does; by default the groups share one, as a server's "
                "requests do");
  sub->add_flag("--round-split", a->round_split,
                "Also report where a round's time goes (draft, verify, accept, commit), from one "
                "more run per setting that waits for the device at each phase's end");
  sub->callback([a] { run_bench_spec(*a); });
}

}  // namespace tandem::cli
