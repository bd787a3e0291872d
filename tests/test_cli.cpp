// The tandem command as users and tooling call it: JSON contracts of generate/score, and bad
// input (files, configs, arguments) ending in "error: ..." with exit code 1, never a crash.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tandem/backend/ops.h"
#include "tandem/io/safetensors.h"
#include "test_util.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using tandem::testing::ScratchDir;
using tandem::testing::write_text;

const std::string kBin = TANDEM_BINARY;
const std::string kFixtures = TANDEM_FIXTURES_DIR;

struct CliRun {
  int code = -1;
  std::string out;  // stdout (and stderr when merged)
};

// A shell command line as popen runs it.
CliRun run_command(const std::string& cmd) {
  CliRun r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

CliRun run(const std::string& args, bool merge_stderr = true) {
  return run_command(kBin + " " + args + (merge_stderr ? " 2>&1" : " 2>/dev/null"));
}

// A shell command line other than the tandem binary, stderr merged.
CliRun run_shell(const std::string& cmd) {
  return run_command(cmd + " 2>&1");
}

void expect_error(const CliRun& r, const std::string& needle) {
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("error: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << r.out;
}

std::vector<int64_t> ref_ids(const std::string& model, const std::string& name) {
  auto f = SafetensorsFile::open(kFixtures + "/" + model + "/reference.safetensors");
  const TensorView* t = f->find(name);
  const auto* p = static_cast<const int64_t*>(t->data);
  return std::vector<int64_t>(p, p + t->numel());
}

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  return s;
}

TEST(Cli, GenerateJsonMatchesReferenceGreedyContinuation) {
  const std::string model = kFixtures + "/qwen35_untied_sharded";
  const auto prompt = ref_ids("qwen35_untied_sharded", "prompt_0");
  const auto greedy = ref_ids("qwen35_untied_sharded", "greedy_0");
  const CliRun r = run("generate --model " + model + " --token-ids " + join(prompt) +
                           " --max-tokens 8 --ignore-eos --json",
                       false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["prompt_tokens"], prompt.size());
  EXPECT_EQ(j["tokens"].get<std::vector<int64_t>>(), greedy);
  EXPECT_EQ(j["finish_reason"], "length");
  EXPECT_GT(j["stats"]["decode_tokens_per_second"].get<double>(), 0.0);
}

TEST(Cli, Glm5GeneratesTransformersGreedyContinuationWithAndWithoutSpeculation) {
  // A GLM-5 checkpoint is recognised by its model_type and runs on the CPU; n-gram speculation
  // emits the same tokens; its checkpoint has no NextN layer, which --draft mtp names.
  const std::string model = kFixtures + "/glm5_bf16";
  const auto prompt = ref_ids("glm5_bf16", "prompt_0");
  const auto greedy = ref_ids("glm5_bf16", "greedy_0");
  for (const std::string draft : {"none", "ngram"}) {
    const CliRun r = run("generate --model " + model + " --token-ids " + join(prompt) +
                             " --max-tokens 8 --ignore-eos --json --draft " + draft,
                         false);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["tokens"].get<std::vector<int64_t>>(), greedy) << draft;
  }
  expect_error(run("generate --model " + model + " --token-ids 1,2,3 --draft mtp"),
               "num_nextn_predict_layers = 0");
}

TEST(Cli, SampledGenerationIsReproducibleBySeed) {
  const std::string base = "generate --model " + kFixtures +
                           "/qwen35_tied --token-ids 3,4,5 --max-tokens 12 --ignore-eos "
                           "--temperature 1.0 --top-p 0.95 --json --seed ";
  const CliRun a = run(base + "7", false), b = run(base + "7", false), c = run(base + "8", false);
  ASSERT_EQ(a.code, 0) << a.out;
  const auto ta = nlohmann::json::parse(a.out)["tokens"];
  EXPECT_EQ(ta, nlohmann::json::parse(b.out)["tokens"]);
  EXPECT_NE(ta, nlohmann::json::parse(c.out)["tokens"]);
}

TEST(Cli, StopsAtEos) {
  // Force EOS immediately: the tied fixture's eos id is 2; --token-ids with a prompt whose greedy
  // continuation never hits it runs to max tokens, so check the stop path through a config that
  // declares the first greedy token as EOS.
  ScratchDir dir("cli-eos");
  fs::copy(kFixtures + "/qwen35_untied_sharded", dir.path() / "m", fs::copy_options::recursive);
  const auto greedy = ref_ids("qwen35_untied_sharded", "greedy_0");
  write_text((dir.path() / "m/generation_config.json").string(),
             "{\"eos_token_id\": [" + std::to_string(greedy[2]) + "]}");
  const CliRun r =
      run("generate --model " + dir.str() + "/m --token-ids " +
              join(ref_ids("qwen35_untied_sharded", "prompt_0")) + " --max-tokens 8 --json",
          false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["finish_reason"], "stop");
  EXPECT_EQ(j["tokens"].size(), 3u);
}

TEST(Cli, ScoreReportsTopLogitsForEveryPosition) {
  const auto tokens = ref_ids("qwen35_gqa_f16", "tokens_0");
  const CliRun r = run("score --model " + kFixtures + "/qwen35_gqa_f16 --token-ids " +
                           join(tokens) + " --top-k 3 --json",
                       false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["positions"].size(), tokens.size());
  EXPECT_EQ(j["tokens"].get<std::vector<int64_t>>(), tokens);
  const auto greedy = ref_ids("qwen35_gqa_f16", "greedy_0");
  const size_t plen = tokens.size() - greedy.size();
  // The continuation was greedy, so each top-1 at positions plen-1.. is the next token.
  for (size_t i = plen - 1; i + 1 < tokens.size(); ++i) {
    EXPECT_EQ(j["positions"][i]["top"].size(), 3u);
    EXPECT_EQ(j["positions"][i]["top"][0][0].get<int64_t>(), tokens[i + 1]) << i;
  }
  EXPECT_GT(j["nll_mean"].get<double>(), 0.0);
}

// --backend: unknown names are refused; cuda where no GPU is usable is an error naming why, never
// a silent fall back (auto is the one that falls back to the CPU).
TEST(Cli, BackendSelection) {
  const std::string m = kFixtures + "/qwen35_tied";
  expect_error(run("generate --model " + m + " --token-ids 1 --backend tpu"),
               "unknown backend 'tpu'");
  const CliRun cpu =
      run("generate --model " + m + " --token-ids 1,2 --max-tokens 3 --json --backend cpu", false);
  ASSERT_EQ(cpu.code, 0) << cpu.out;
  const CliRun autob =
      run("generate --model " + m + " --token-ids 1,2 --max-tokens 3 --json --backend auto", false);
  ASSERT_EQ(autob.code, 0) << autob.out;
  if (!tandem::ops::cuda_available()) {
    EXPECT_EQ(nlohmann::json::parse(cpu.out)["tokens"], nlohmann::json::parse(autob.out)["tokens"]);
    const CliRun cuda = run("generate --model " + m + " --token-ids 1 --backend cuda");
    EXPECT_NE(cuda.code, 0);
    EXPECT_TRUE(cuda.out.find("no usable CUDA device") != std::string::npos ||
                cuda.out.find("built without the CUDA backend") != std::string::npos)
        << cuda.out;
  }
  expect_error(run("bench --random-weights /nonexistent/c.json --backend cpu"),
               "/nonexistent/c.json");
  expect_error(run("bench --backend cpu"), "exactly one of --model DIR or --random-weights");
  expect_error(run("bench --model " + m + " --backend cpu --windows 1"), "--windows");
}

// A small random-weight bench shape and the quickest bench that still times every figure.
const std::string kBenchConfig = std::string(TANDEM_SOURCE_DIR) + "/bench/configs/qwen35-15m.json";
const std::string kQuickBench =
    " --backend cpu --repeats 1 --prompt-tokens 4 --gen-tokens 2 --windows 2 --step-context 8 "
    "--step-repeats 1 --json";

// bench --random-weights times the MTP draft step with a random MTP layer when the config
// declares one (the bench configs do), and reports no MTP figures when it declares none.
TEST(Cli, BenchRandomWeightsTimesARandomMtpLayer) {
  const CliRun r = run("bench --random-weights " + kBenchConfig + kQuickBench, false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["mtp_draft_weights"], "random");
  EXPECT_GT(j["mtp_draft_step_seconds"]["median"].get<double>(), 0.0);
  EXPECT_GT(j["mtp_draft_step_relative_to_decode_step"].get<double>(), 0.0);

  ScratchDir dir("cli-bench-no-mtp");
  std::ifstream in(kBenchConfig);
  nlohmann::json c = nlohmann::json::parse(in);
  c["text_config"]["mtp_num_hidden_layers"] = 0;
  write_text(dir.file("config.json"), c.dump());
  const CliRun none = run("bench --random-weights " + dir.file("config.json") + kQuickBench, false);
  ASSERT_EQ(none.code, 0) << none.out;
  const auto k = nlohmann::json::parse(none.out);
  EXPECT_GT(k["decode_step_seconds"]["median"].get<double>(), 0.0);
  EXPECT_FALSE(k.contains("mtp_draft_step_relative_to_decode_step")) << none.out;
  EXPECT_FALSE(k.contains("mtp_draft_weights"));
}

// bench's timed steps hand the host the greedy tokens (the default, as greedy decoding runs),
// tokens drawn on the device (as sampled decoding runs) or every window token's logits; the JSON
// says which, and other values are refused.
TEST(Cli, BenchStepOutput) {
  for (const std::string mode : {"", "tokens", "samples", "logits"}) {
    const CliRun r = run("bench --random-weights " + kBenchConfig + kQuickBench +
                             (mode.empty() ? "" : " --step-output " + mode),
                         false);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["step_output"], mode.empty() ? "tokens" : mode);
    EXPECT_GT(j["verify_windows"][0]["seconds"]["median"].get<double>(), 0.0);
  }
  expect_error(run("bench --random-weights " + kBenchConfig + kQuickBench + " --step-output probs"),
               "--step-output");
}

// bench's verify windows are timed with their commit under the rollback asked for (Replay, the
// engines' default, or per-position states), keeping one token or, with --keep-all, the window;
// the JSON says which, and an unknown rollback is refused.
TEST(Cli, BenchWindowRollback) {
  for (const std::string opts : {"", " --rollback per-position", " --rollback replay --keep-all"}) {
    const CliRun r = run("bench --random-weights " + kBenchConfig + kQuickBench + opts, false);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["verify_rollback"],
              opts.find("per-position") != std::string::npos ? "per-position" : "replay");
    EXPECT_EQ(j["verify_commit_keeps"], opts.find("keep-all") != std::string::npos ? "all" : "one");
    EXPECT_GT(j["verify_windows"][0]["seconds"]["median"].get<double>(), 0.0);
  }
  expect_error(run("bench --random-weights " + kBenchConfig + kQuickBench + " --rollback snapshot"),
               "--rollback must be replay or per-position");
}

// bench/decode_ab.sh, the A/B of BENCHMARKS' batched-decode figures: every binary (or binary
// under an environment) at every batch size in each round before the next round, one line per run
// as it finishes, each run's report and figures kept, then a table row per binary and batch over
// the rounds.
// Bad arguments stop it before any run with exit code 2.
TEST(Cli, DecodeAbAlternatesBinariesAndTabulatesTheRounds) {
  ScratchDir dir("decode-ab");
  const std::string script = std::string(TANDEM_SOURCE_DIR) + "/bench/decode_ab.sh";
  const std::string env = "CONFIG=" + kBenchConfig +
                          " BATCHES='1 2' ROUNDS=2 PROMPT=4 GEN=2 STEP_REPEATS=1 WINDOWS=2 "
                          "BACKEND=cpu OUT=" +
                          dir.str() + " ";
  const std::string other = kBin + "@TANDEM_THREADS=1";
  const CliRun r = run_shell(env + script + " " + kBin + " " + other);
  ASSERT_EQ(r.code, 0) << r.out;
  std::vector<std::string> runs;  // "round R batch B spec", in the order they ran
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream f(line);
    std::string word, round, batch, spec;
    if (f >> word && word == "round" && f >> round >> word >> batch >> spec)
      runs.push_back(round + " " + batch + " " + spec);
  }
  const std::vector<std::string> want = {"1 1 " + kBin,  "1 1 " + other, "1 2 " + kBin,
                                         "1 2 " + other, "2 1 " + kBin,  "2 1 " + other,
                                         "2 2 " + kBin,  "2 2 " + other};
  EXPECT_EQ(runs, want) << r.out;
  // results.tsv: run, round, batch, binary, decode tok/s, roofline %, step ms, windows as
  // "tokens:steps:ms".
  std::ifstream results(dir.file("results.tsv"));
  int rows = 0;
  for (std::string line; std::getline(results, line); ++rows) {
    std::istringstream f(line);
    std::string run_no, round, batch, spec, decode, roofline, step, windows;
    ASSERT_TRUE(std::getline(f, run_no, '\t') && std::getline(f, round, '\t') &&
                std::getline(f, batch, '\t') && std::getline(f, spec, '\t') &&
                std::getline(f, decode, '\t') && std::getline(f, roofline, '\t') &&
                std::getline(f, step, '\t') && std::getline(f, windows, '\t'))
        << line;
    EXPECT_EQ(round + " " + batch + " " + spec, want[static_cast<size_t>(rows)]) << line;
    EXPECT_GT(std::stod(decode), 0.0) << line;
    EXPECT_GT(std::stod(step), 0.0) << line;
    // The one window (2 tokens): its cost in steps and in ms agree with the step.
    std::istringstream w(windows);
    std::string tokens, steps, ms;
    ASSERT_TRUE(std::getline(w, tokens, ':') && std::getline(w, steps, ':') &&
                std::getline(w, ms, ':'))
        << line;
    EXPECT_EQ(tokens, "2") << line;
    EXPECT_NEAR(std::stod(ms), std::stod(steps) * std::stod(step), 0.02 * std::stod(ms) + 0.01)
        << line;
    EXPECT_TRUE(std::ifstream(dir.file("run" + run_no + ".txt")).good()) << line;
  }
  EXPECT_EQ(rows, 8);
  for (const std::string& row : {"| " + kBin + " | 1 | ", "| " + other + " | 1 | ",
                                 "| " + kBin + " | 2 | ", "| " + other + " | 2 | "})
    EXPECT_NE(r.out.find(row), std::string::npos) << "no table row '" << row << "' in: " << r.out;
  EXPECT_NE(r.out.find(" ms |"), std::string::npos) << "no window milliseconds in: " << r.out;

  const CliRun bad = run_shell(env + script + " " + kBin + "@THREADS");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("is not VAR=VALUE"), std::string::npos) << bad.out;
  const CliRun missing = run_shell(env + script + " " + dir.file("no-such-tandem"));
  EXPECT_EQ(missing.code, 2) << missing.out;
  EXPECT_NE(missing.out.find("no tandem binary"), std::string::npos) << missing.out;
}

// bench on a GLM-5 checkpoint: plain runs through the engine, decode steps, verify windows, the
// NextN draft step where the checkpoint has the layer (the demo) and none where it has not (the
// bf16 fixture), a long prefill; bytes per step of its weights and latent caches.
TEST(Cli, BenchMeasuresAGlm5Checkpoint) {
  const std::string demo = std::string(TANDEM_SOURCE_DIR) + "/models/glm5-demo";
  const std::string quick = kQuickBench + " --long-prefill 16";
  const CliRun r = run("bench --model " + demo + quick, false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["decode_tokens_per_second"]["median"].get<double>(), 0.0);
  EXPECT_GT(j["decode_step_seconds"]["median"].get<double>(), 0.0);
  EXPECT_GT(j["verify_windows"][0]["relative_to_decode_step"].get<double>(), 0.0);
  EXPECT_EQ(j["mtp_draft_weights"], "checkpoint");
  EXPECT_GT(j["mtp_draft_step_seconds"]["median"].get<double>(), 0.0);
  EXPECT_GT(j["long_prefill_tokens_per_second"].get<double>(), 0.0);
  EXPECT_FALSE(j.contains("long_prefill_tflops"));  // not counted for GLM-5
  EXPECT_GT(j["decode_bytes_per_step"].get<double>(), j["decode_weight_bytes"].get<double>());
  EXPECT_GT(j["parameters"].get<double>(), 1e6);

  const CliRun f = run("bench --model " + kFixtures + "/glm5_bf16" + kQuickBench, false);
  ASSERT_EQ(f.code, 0) << f.out;
  const auto k = nlohmann::json::parse(f.out);
  EXPECT_GT(k["decode_step_seconds"]["median"].get<double>(), 0.0);
  EXPECT_FALSE(k.contains("mtp_draft_weights")) << f.out;
}

// make-random-model writes checkpoints the loaders take: GLM-5 in the fp8 layout (e4m3 matrices
// with the config's block scales, the embedding bf16) when asked for fp8 with a config that has a
// quantization_config, and an error naming what is missing otherwise.
TEST(Cli, MakeRandomModelWritesGlm5Fp8Checkpoints) {
  ScratchDir dir("cli-random-glm5");
  nlohmann::json c = nlohmann::json::parse(R"({
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
    "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.0, "first_k_dense_replace": 1, "index_topk": 4,
    "index_head_dim": 32, "index_n_heads": 2, "num_nextn_predict_layers": 1, "eos_token_id": 1})");
  write_text(dir.file("plain.json"), c.dump());
  c["quantization_config"] = {{"quant_method", "fp8"},
                              {"fmt", "e4m3"},
                              {"activation_scheme", "dynamic"},
                              {"weight_block_size", {16, 16}}};
  write_text(dir.file("fp8.json"), c.dump());
  expect_error(run("make-random-model --config " + dir.file("plain.json") + " --out " +
                   dir.file("m0") + " --dtype fp8"),
               "quantization_config");
  expect_error(run("make-random-model --config " + dir.file("fp8.json") + " --out " +
                   dir.file("m1") + " --dtype fp4"),
               "--dtype must be f32, bf16 or f16 or fp8");
  const CliRun w = run("make-random-model --config " + dir.file("fp8.json") + " --out " +
                           dir.file("m") + " --dtype fp8",
                       false);
  ASSERT_EQ(w.code, 0) << w.out;
  const auto f = tandem::SafetensorsFile::open(dir.file("m") + "/model.safetensors");
  ASSERT_NE(f->find("model.layers.0.self_attn.q_a_proj.weight"), nullptr);
  EXPECT_EQ(f->find("model.layers.0.self_attn.q_a_proj.weight")->dtype, tandem::DType::F8_E4M3);
  EXPECT_NE(f->find("model.layers.0.self_attn.q_a_proj.weight_scale_inv"), nullptr);
  EXPECT_EQ(f->find("model.embed_tokens.weight")->dtype, tandem::DType::BF16);
  const CliRun g = run("generate --model " + dir.file("m") +
                           " --token-ids 3,5,7,9,11,13 --max-tokens 6 --ignore-eos --json "
                           "--draft mtp --depth 2",
                       false);
  ASSERT_EQ(g.code, 0) << g.out;
  EXPECT_EQ(nlohmann::json::parse(g.out)["tokens"].size(), 6u);
}

TEST(Cli, BadArgumentsAndInputs) {
  const std::string m = kFixtures + "/qwen35_tied";
  expect_error(run("generate --model /nonexistent/dir --token-ids 1"), "/nonexistent/dir");
  expect_error(run("generate --model " + m + " --token-ids 1,999"), "token id 999");
  expect_error(run("generate --model " + m + " --token-ids 1,x"), "'x'");
  expect_error(run("generate --model " + m + " --token-ids ''"), "empty");
  expect_error(run("generate --model " + m), "exactly one of");
  expect_error(run("generate --model " + m + " --token-ids 1 --prompt hi"), "exactly one of");
  expect_error(run("generate --model " + m + " --token-ids 1 --temperature -1"), "temperature");
  expect_error(run("generate --model " + m + " --token-ids 1 --top-p 0"), "top_p");
  expect_error(run("generate --model " + m + " --token-ids 1 --max-tokens 0"), "max_tokens");
  expect_error(run("generate --model " + m + " --prompt-file /nonexistent/p.txt"),
               "/nonexistent/p.txt");
  // Parse errors from the argument parser also exit non-zero.
  EXPECT_NE(run("generate --model " + m + " --max-tokens lots --token-ids 1").code, 0);
  expect_error(run("generate --model " + m + " --token-ids 1 --kv-dtype f16"),
               "--kv-dtype must be bf16 or f32, got 'f16'");
  expect_error(run("bench --model " + m + " --backend cpu --kv-dtype fp8"), "--kv-dtype");
  EXPECT_NE(run("frobnicate").code, 0);
}

TEST(Cli, CorruptCheckpointsAreReportedWithTheFileName) {
  ScratchDir dir("cli-corrupt");
  const fs::path m = dir.path() / "m";
  fs::copy(kFixtures + "/qwen35_gqa_f16", m, fs::copy_options::recursive);
  const fs::path st = m / "model.safetensors";
  // Truncated weights.
  fs::resize_file(st, fs::file_size(st) / 2);
  expect_error(run("generate --model " + m.string() + " --token-ids 1"), "model.safetensors");
  // Not a safetensors file at all.
  write_text(st.string(), "garbage");
  expect_error(run("generate --model " + m.string() + " --token-ids 1"), "model.safetensors");
  // Malformed config.
  fs::copy_file(kFixtures + "/qwen35_gqa_f16/model.safetensors", st,
                fs::copy_options::overwrite_existing);
  write_text((m / "config.json").string(), "{\"model_type\": \"qwen3_5\", ");
  expect_error(run("generate --model " + m.string() + " --token-ids 1"), "config.json");
  // Unsupported architecture.
  write_text((m / "config.json").string(), "{\"model_type\": \"llama\"}");
  expect_error(run("generate --model " + m.string() + " --token-ids 1"), "llama");
}

}  // namespace
}  // namespace tandem

namespace tandem {
namespace {

const std::string kDemoModel = std::string(TANDEM_SOURCE_DIR) + "/models/qwen35-demo";

TEST(CliSpeculative, DraftersGiveThePlainOutputAndReportStats) {
  const std::string base = "generate --model " + kDemoModel +
                           " --prompt 'def add(a, b):\n' --max-tokens 24 --ignore-eos --json"
                           " --temperature 0.8 --seed 5";
  const CliRun plain = run(base, false);
  ASSERT_EQ(plain.code, 0) << plain.out;
  const auto want = nlohmann::json::parse(plain.out)["tokens"];
  for (const std::string extra :
       {" --draft mtp --depth 3", " --draft mtp --depth auto", " --draft ngram --depth 2",
        " --draft ngram --ngram-max 4 --ngram-min 2 --depth 4",
        " --draft mtp --depth 2 --mtp-hidden final", " --draft mtp --depth 2 --mtp-hidden prenorm",
        " --draft mtp --depth 3 --draft-vocab 512", " --draft mtp --depth 3 --settled-rounds",
        " --draft mtp --depth auto --settled-rounds", " --draft ngram --depth 3 --settled-rounds",
        " --draft ngram --depth auto --settled-rounds", " --draft ngram --depth auto:6",
        " --draft mtp --depth auto:2"}) {
    const CliRun r = run(base + extra, false);
    ASSERT_EQ(r.code, 0) << extra << ": " << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["tokens"], want) << extra;
    const auto& s = j["stats"];
    EXPECT_GT(s["rounds"].get<int64_t>(), 0) << extra;
    EXPECT_GE(s["drafted"].get<int64_t>(), s["accepted"].get<int64_t>());
    EXPECT_GE(s["mean_accepted_length"].get<double>(), 1.0);
    EXPECT_GE(s["tokens_per_target_forward"].get<double>(), 1.0);
    EXPECT_TRUE(s["accepted_by_position"].is_array());
  }
  // Rejection mode samples from the same distribution; it runs and reports its stats.
  const CliRun rej = run(base + " --draft mtp --depth 3 --verify rejection", false);
  ASSERT_EQ(rej.code, 0) << rej.out;
  EXPECT_EQ(nlohmann::json::parse(rej.out)["tokens"].size(), 24u);
}

// --depth auto goes up to 4 proposals a round with a model drafter and up to 8 with the n-gram
// drafter (whose proposals cost only their place in the window); auto:K sets the most.
TEST(CliSpeculative, AdaptiveDepthsReachTheDraftersDefaultOrTheGivenMost) {
  const std::string base = "generate --model " + kDemoModel +
                           " --prompt 'def add(a, b):\n' --max-tokens 16 --ignore-eos --json";
  for (const auto& [extra, most] :
       std::vector<std::pair<std::string, size_t>>{{" --draft mtp --depth auto", 4},
                                                   {" --draft ngram --depth auto", 8},
                                                   {" --draft ngram --depth auto:3", 3},
                                                   {" --draft mtp --depth auto:6", 6}}) {
    const CliRun r = run(base + extra, false);
    ASSERT_EQ(r.code, 0) << extra << ": " << r.out;
    EXPECT_EQ(nlohmann::json::parse(r.out)["stats"]["accepted_by_position"].size(), most) << extra;
  }
}

TEST(CliSpeculative, PromptsFileRunsEveryRequestAsOneBatch) {
  tandem::testing::ScratchDir dir("cli-prompts");
  const std::string f = dir.file("p.jsonl");
  tandem::testing::write_text(f,
                              "{\"prompt\": \"import os\\n\", \"max_tokens\": 5}\n"
                              "\n"
                              "{\"token_ids\": [5, 6, 7], \"seed\": 3, \"temperature\": 1.0, "
                              "\"max_tokens\": 9}\n");
  const CliRun r = run("generate --model " + kDemoModel + " --prompts-file " + f +
                           " --draft mtp --depth 2 --ignore-eos",
                       false);
  ASSERT_EQ(r.code, 0) << r.out;
  std::vector<nlohmann::json> lines;
  size_t start = 0;
  while (start < r.out.size()) {
    const size_t end = r.out.find('\n', start);
    lines.push_back(nlohmann::json::parse(r.out.substr(start, end - start)));
    start = end + 1;
  }
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["tokens"].size(), 5u);
  EXPECT_EQ(lines[1]["tokens"].size(), 9u);
  EXPECT_EQ(lines[1]["prompt_token_ids"], nlohmann::json({5, 6, 7}));
  // Each request equals its own plain run.
  const CliRun alone = run("generate --model " + kDemoModel +
                               " --token-ids 5,6,7 --seed 3 --temperature 1.0 --max-tokens 9 "
                               "--ignore-eos --json",
                           false);
  EXPECT_EQ(nlohmann::json::parse(alone.out)["tokens"], lines[1]["tokens"]);
}

TEST(CliSpeculative, BadSpeculationSettingsAreRefused) {
  const std::string m = "generate --model " + kDemoModel + " --token-ids 5,6 ";
  expect_error(run(m + "--draft eagle"), "--draft");
  expect_error(run(m + "--draft mtp --depth 99"), "--depth");
  expect_error(run(m + "--draft mtp --depth deep"), "or a whole number in 0..16");
  for (const char* bad : {"auto:0", "auto:17", "auto:", "auto:x", "auto:3x"})
    expect_error(run(m + "--draft mtp --depth " + bad), "auto:K (K in 1..16)");
  expect_error(run(m + "--draft mtp --verify maybe"), "--verify");
  expect_error(run(m + "--draft ngram --ngram-min 3 --ngram-max 2"), "--ngram");
  expect_error(run(m + "--draft mtp --draft-model /nonexistent/drafter"), "/nonexistent/drafter");
  expect_error(run(m + "--draft-model /tmp"), "--draft mtp");
  expect_error(run(m + "--draft mtp --mtp-hidden middle"), "--mtp-hidden");
  expect_error(run(m + "--draft ngram --draft-vocab 512"), "--draft-vocab applies to --draft mtp");
  expect_error(run(m + "--draft mtp --draft-vocab 99999"), "--draft-vocab must be in 0..4096");
  expect_error(run(m + "--draft mtp --draft-vocab -3"), "--draft-vocab must be in 0..4096");
  expect_error(run(m + "--draft eagle3 --settled-rounds"),
               "--settled-rounds applies to --draft mtp and --draft ngram only");
  expect_error(run(m + "--draft mtp --verify rejection --settled-rounds"), "--verify match");
  // A checkpoint without an MTP layer.
  expect_error(run("generate --model " + kFixtures + "/qwen35_gqa_f16 --token-ids 1,2 --draft mtp"),
               "no MTP layer");
  // Malformed prompts files name the line.
  tandem::testing::ScratchDir dir("cli-badprompts");
  tandem::testing::write_text(dir.file("a.jsonl"), "{\"prompt\": \"x\"}\n{oops\n");
  expect_error(run("generate --model " + kDemoModel + " --prompts-file " + dir.file("a.jsonl")),
               "a.jsonl:2");
  tandem::testing::write_text(dir.file("b.jsonl"), "{\"seed\": 1}\n");
  expect_error(run("generate --model " + kDemoModel + " --prompts-file " + dir.file("b.jsonl")),
               "exactly one of");
  tandem::testing::write_text(dir.file("c.jsonl"), "{\"token_ids\": [1, 99999]}\n");
  expect_error(run("generate --model " + kDemoModel + " --prompts-file " + dir.file("c.jsonl")),
               "99999");
}

// bench-spec on a random-weight model and random prompts: the continuation drafter accepts every
// proposal at p = 1 and none at p = 0, every run's tokens are plain decoding's, and the JSON says
// so, with each round's time split by phase (no untimed run first); bad settings are refused by
// name.
TEST(CliSpeculative, BenchSpecMeasuresSpeedUpAgainstAcceptance) {
  const std::string base = "bench-spec --backend cpu --random-weights " + kBenchConfig +
                           " --random-prompts 3 --prompt-tokens 6 --max-tokens 10 --batch 2"
                           " --repeats 1 --warmup 0 ";
  const CliRun r =
      run(base + "--drafts continuation,ngram --accept-p 1,0 --depths 3,auto --round-split --json",
          false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.size(), 7u) << r.out;  // plain, 2 p x 2 depths, ngram x 2 depths
  EXPECT_EQ(j[0]["draft"], "none");
  for (const auto& m : j) {
    EXPECT_TRUE(m["identical_to_plain"].get<bool>()) << m;
    EXPECT_GT(m["tokens_per_second"].get<double>(), 0.0) << m;
    EXPECT_GT(m["decode_tokens_per_second"].get<double>(), 0.0) << m;
    // Plain decoding has no speculative rounds to split.
    if (m["draft"] == "none") {
      EXPECT_TRUE(m["round_phase_ms"].is_null()) << m;
    } else {
      EXPECT_GT(m["round_phase_ms"]["verify"].get<double>(), 0.0) << m;
      EXPECT_GE(m["round_phase_ms"]["draft"].get<double>(), 0.0) << m;
    }
    if (m["draft"] != "continuation") {
      EXPECT_TRUE(m["accept_p"].is_null()) << m;
      continue;
    }
    const double p = m["accept_p"].get<double>();
    if (m["depth"] != 3) continue;  // auto may choose any depth
    EXPECT_EQ(m["acceptance_rate"].get<double>(), p) << m;
    if (p == 0.0) {
      EXPECT_EQ(m["mean_accepted_length"].get<double>(), 1.0) << m;
    } else {  // every full round emits 4 tokens; only a row's last round may emit fewer
      EXPECT_GE(m["mean_accepted_length"].get<double>(), 3.0) << m;
    }
  }
  expect_error(run(base + "--drafts continuation --accept-p 1.5"), "--accept-p");
  expect_error(run(base + "--drafts continuation --accept-p high"), "--accept-p");
  expect_error(run(base + "--drafts oracle"), "unknown drafter 'oracle'");
  expect_error(run("bench-spec --backend cpu --random-weights " + kBenchConfig +
                   " --random-prompts 1 --warmup -1"),
               "--warmup >= 0");
  expect_error(run("bench-spec --backend cpu --random-prompts 2"),
               "exactly one of --model DIR or --random-weights");
  expect_error(run("bench-spec --backend cpu --random-weights " + kBenchConfig),
               "exactly one of --prompts-file FILE or --random-prompts N");
}

TEST(CliSpeculative, MtpSplitWritesACompanionThatDrafts) {
  tandem::testing::ScratchDir dir("cli-split");
  const std::string out = dir.file("drafter");
  const CliRun s = run("mtp-split --model " + kDemoModel + " --out " + out);
  ASSERT_EQ(s.code, 0) << s.out;
  EXPECT_TRUE(std::filesystem::exists(out + "/config.json"));
  EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors"));
  const std::string base = "generate --model " + kDemoModel +
                           " --prompt 'class A:\n' --max-tokens 16 --ignore-eos --json";
  const CliRun a = run(base, false);
  const CliRun b = run(base + " --draft mtp --draft-model " + out, false);
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_EQ(nlohmann::json::parse(a.out)["tokens"], nlohmann::json::parse(b.out)["tokens"]);
  EXPECT_GT(nlohmann::json::parse(b.out)["stats"]["accepted"].get<int64_t>(), 0);
  // Splitting again into a non-empty directory is refused.
  expect_error(run("mtp-split --model " + kDemoModel + " --out " + out), out);
}

}  // namespace
}  // namespace tandem
