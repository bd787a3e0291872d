// tandem bench-spec: speculative decoding against plain decoding on the same prompts in the same
// process: acceptance by window position, mean accepted length, tokens per target forward and
// tokens/s for each drafter and depth, at a given batch size.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "tandem/cli/commands.h"
#include "tandem/cli/common.h"
#include "tandem/core/error.h"
#include "tandem/engine/speculative.h"
#include "tandem/io/artifact_identity.h"
#include "tandem/spec/eagle3.h"
#include "tandem/spec/glm_mtp.h"
#include "tandem/spec/ngram.h"
#include "tandem/spec/qwen_mtp.h"

namespace tandem::cli {

namespace {

struct BenchSpecArgs {
  std::string model, prompts_file;
  std::string drafts = "mtp,ngram";
  std::optional<std::string> draft_model;  // the EAGLE-3 head of --drafts eagle3
  std::string depths = "1,2,3,4";
  int batch = 1;
  int64_t max_tokens = 64;
  int repeats = 3;
  int threads = 0;
  std::string backend = "auto";
  float temperature = 0.0f;
  std::string kv_dtype = "bf16";
  bool json = false;
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
  int depth = 0;  // fixed, or the most an adaptive round proposes
  bool automatic = false;
  double tokens_per_second = 0;  // generated tokens / wall time of all groups (median run)
  SpecStats total;               // summed over requests
};

Measured measure(const LoadedTarget& target, DType kv_dtype, const spec::DraftProvider* drafter,
                 DepthArg depth, const std::vector<GenerateRequest>& reqs, int batch, int repeats) {
  // The probe stays off: this measures each drafter at the depth asked, whatever it accepts.
  SpecOptions opts{depth.depth, spec::VerifyMode::Match};
  opts.health_probe = false;
  opts.auto_depth = depth.automatic;
  SpeculativeGenerator gen(target.engine_target(kv_dtype), target.view->vocab_size(), drafter,
                           opts);
  Measured m;
  m.draft = drafter ? drafter->id() : "none";
  m.depth = drafter ? depth.depth : 0;
  m.automatic = drafter && depth.automatic;
  std::vector<double> rates;
  for (int rep = 0; rep <= repeats; ++rep) {  // rep 0 warms up
    SpecStats sum;
    sum.accepted_by_position.assign(static_cast<size_t>(m.depth), 0);
    sum.drafted_by_position.assign(static_cast<size_t>(m.depth), 0);
    int64_t tokens = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t g = 0; g < reqs.size(); g += static_cast<size_t>(batch)) {
      const std::vector<GenerateRequest> group(
          reqs.begin() + static_cast<std::ptrdiff_t>(g),
          reqs.begin() + static_cast<std::ptrdiff_t>(std::min(reqs.size(), g + batch)));
      std::vector<SpecStats> st;
      const auto res = gen.run(group, {}, nullptr, &st);
      for (size_t i = 0; i < res.size(); ++i) {
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
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep == 0) continue;
    rates.push_back(static_cast<double>(tokens) / s);
    m.total = sum;
  }
  std::sort(rates.begin(), rates.end());
  m.tokens_per_second = rates[rates.size() / 2];
  return m;
}

void run_bench_spec(const BenchSpecArgs& a) {
  const DType kv_dtype = parse_kv_dtype(a.kv_dtype);
  apply_threads(a.threads);
  apply_backend(backend_for(a.model, a.backend));
  if (a.batch < 1 || a.repeats < 1 || a.max_tokens < 1)
    fail("bench-spec: need --batch >= 1, --repeats >= 1, --max-tokens >= 1");
  const LoadedTarget target = load_target(a.model, true);
  const auto tok = open_tokenizer(a.model);
  if (!tok) fail("bench-spec: ", a.model, " has no tokenizer.json");
  GenerateRequest shape;
  shape.max_tokens = a.max_tokens;
  shape.ignore_eos = true;
  shape.sampling.temperature = a.temperature;
  auto reqs = read_prompts_file(a.prompts_file, shape, tok);
  for (size_t i = 0; i < reqs.size(); ++i) reqs[i].sampling.seed = i;

  std::vector<Measured> rows;
  std::fprintf(stderr, "bench-spec: %zu prompts, batch %d, %lld tokens each, %d threads\n",
               reqs.size(), a.batch, static_cast<long long>(a.max_tokens), ops::thread_count());
  rows.push_back(measure(target, kv_dtype, nullptr, DepthArg{}, reqs, a.batch, a.repeats));
  const double base = rows[0].tokens_per_second;
  const std::vector<std::string> drafts = split_list(a.drafts);
  if (a.draft_model && std::find(drafts.begin(), drafts.end(), "eagle3") == drafts.end())
    fail("--draft-model names the EAGLE-3 head of --drafts eagle3, which is not listed");
  for (const std::string& d : drafts) {
    std::unique_ptr<spec::DraftProvider> drafter;
    if (d == "mtp" && target.glm)
      drafter = spec::GlmMtpProvider::from_target(*target.view);
    else if (d == "mtp-empty" && target.glm)
      drafter = spec::GlmMtpProvider::from_target(*target.view, spec::GlmMtpHistory::Empty);
    else if (d == "mtp")
      drafter = spec::QwenMtpProvider::from_target(*target.view);
    else if (d == "ngram")
      drafter = std::make_unique<spec::NgramProvider>(spec::NgramOptions{});
    else if (d == "eagle3" && a.draft_model)
      drafter = spec::Eagle3Provider::open(*a.draft_model);
    else if (d == "eagle3")
      fail("--drafts eagle3 needs --draft-model DIR: the EAGLE-3 head's directory");
    else
      fail("--drafts: unknown drafter '", d, "' (mtp, ngram, eagle3; GLM-5 also mtp-empty)");
    for (const std::string& ds : split_list(a.depths)) {
      const DepthArg depth = parse_depth(ds);
      rows.push_back(measure(target, kv_dtype, drafter.get(), depth, reqs, a.batch, a.repeats));
      rows.back().draft = d;  // as listed: mtp and mtp-empty share a drafter id
      std::fprintf(stderr, "bench-spec: %s depth %s: %.1f tok/s\n", d.c_str(), ds.c_str(),
                   rows.back().tokens_per_second);
    }
  }
  nlohmann::json out = nlohmann::json::array();
  if (!a.json)
    std::printf("%-6s %5s %10s %8s %6s %8s  %s\n", "draft", "depth", "tok/s", "speedup", "AL",
                "tok/fwd", "acceptance by position");
  for (const Measured& m : rows) {
    std::vector<double> by_pos;
    for (int j = 0; j < m.depth; ++j)
      by_pos.push_back(m.total.drafted_by_position[j]
                           ? static_cast<double>(m.total.accepted_by_position[j]) /
                                 static_cast<double>(m.total.drafted_by_position[j])
                           : 0.0);
    if (a.json) {
      out.push_back({{"draft", m.draft},
                     {"depth", m.automatic ? nlohmann::json("auto") : nlohmann::json(m.depth)},
                     {"tokens_per_second", m.tokens_per_second},
                     {"speedup", m.tokens_per_second / base},
                     {"mean_accepted_length", m.total.mean_accepted_length()},
                     {"tokens_per_target_forward", m.total.tokens_per_target_forward()},
                     {"acceptance_rate", m.total.acceptance_rate()},
                     {"acceptance_by_position", by_pos},
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
    std::printf("%-6s %5s %10.1f %7.2fx %6.2f %8.2f  %s\n", m.draft.c_str(), depth.c_str(),
                m.tokens_per_second, m.tokens_per_second / base, m.total.mean_accepted_length(),
                m.total.tokens_per_target_forward(), pos.c_str());
  }
  if (a.json) std::cout << out.dump(2) << "\n";
}

}  // namespace

void add_bench_spec_command(CLI::App& app) {
  auto a = std::make_shared<BenchSpecArgs>();
  CLI::App* sub = app.add_subcommand(
      "bench-spec", "Speculative vs plain decoding on the same prompts: acceptance and speed");
  sub->add_option("--model", a->model, "Hugging Face model directory")->required();
  sub->add_option("--prompts-file", a->prompts_file, "JSONL with a \"prompt\" per line")
      ->required();
  sub->add_option("--drafts", a->drafts, "Drafters to compare: mtp, ngram, eagle3")
      ->capture_default_str();
  sub->add_option("--draft-model", a->draft_model,
                  "The EAGLE-3 head directory --drafts eagle3 drafts with");
  sub->add_option("--depths", a->depths, "Depths to compare (numbers, or auto for adaptive rounds)")
      ->capture_default_str();
  sub->add_option("--batch", a->batch, "Requests per batch")->capture_default_str();
  sub->add_option("--max-tokens", a->max_tokens, "Tokens per request")->capture_default_str();
  sub->add_option("--temperature", a->temperature, "Sampling temperature")->capture_default_str();
  sub->add_option("--repeats", a->repeats, "Timed runs (after a warm-up)")->capture_default_str();
  sub->add_option("--threads", a->threads, "CPU threads (0 = all cores)");
  add_kv_dtype_option(sub, &a->kv_dtype);
  sub->add_option("--backend", a->backend, "cpu, cuda or auto (cuda when a GPU is present)")
      ->capture_default_str();
  sub->add_flag("--json", a->json, "Print JSON");
  sub->callback([a] { run_bench_spec(*a); });
}

}  // namespace tandem::cli
