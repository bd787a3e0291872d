#include "tandem/cli/common.h"

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tandem/backend/ops.h"
#include "tandem/core/error.h"
#include "tandem/engine/glm5_engine_target.h"
#include "tandem/engine/qwen_engine_target.h"
#include "tandem/io/artifact_identity.h"
#include "tandem/io/json_file.h"
#include "tandem/spec/eagle3.h"
#include "tandem/spec/glm_mtp.h"
#include "tandem/spec/qwen_mtp.h"
#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem::cli {

std::vector<int32_t> parse_token_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string part = s.substr(i, j - i);
    const size_t a = part.find_first_not_of(" \t");
    const size_t b = part.find_last_not_of(" \t");
    part = a == std::string::npos ? "" : part.substr(a, b - a + 1);
    int64_t v = 0;
    auto [p, ec] = std::from_chars(part.data(), part.data() + part.size(), v);
    if (part.empty() || ec != std::errc() || p != part.data() + part.size() || v < 0 ||
        v > INT32_MAX)
      fail("--token-ids: '", part,
           "' is not a token id (expected non-negative integers separated "
           "by commas)");
    ids.push_back(static_cast<int32_t>(v));
    i = j + 1;
  }
  return ids;
}

std::optional<Tokenizer> open_tokenizer(const std::string& model_dir) {
  const auto path = std::filesystem::path(model_dir) / "tokenizer.json";
  if (!std::filesystem::exists(path)) return std::nullopt;
  return Tokenizer::load(path.string());
}

std::vector<int32_t> resolve_input(const std::string& what, const std::optional<std::string>& text,
                                   const std::optional<std::string>& text_file,
                                   const std::optional<std::string>& token_ids,
                                   const std::optional<Tokenizer>& tok) {
  const int given = text.has_value() + text_file.has_value() + token_ids.has_value();
  if (given != 1) fail("give exactly one of --", what, ", --", what, "-file or --token-ids");
  std::vector<int32_t> ids;
  if (token_ids) {
    if (token_ids->find_first_not_of(" \t") == std::string::npos)
      fail("the ", what, " is empty (--token-ids lists no ids)");
    ids = parse_token_ids(*token_ids);
  } else {
    const std::string body = text ? *text : read_text_file(*text_file);
    if (!tok) fail("the model directory has no tokenizer.json; pass --token-ids instead");
    ids = tok->encode(body);
  }
  if (ids.empty()) fail("the ", what, " is empty (it encodes to no tokens)");
  return ids;
}

void apply_threads(int threads) {
  if (threads < 0) fail("--threads must be >= 0 (0 = all cores)");
  ops::set_thread_count(threads);
}

std::shared_ptr<ops::Context> apply_backend(const std::string& name) {
  const ops::Backend b = ops::parse_backend(name);
  ops::set_backend(b);
#ifdef TANDEM_HAVE_CUDA
  if (b == ops::Backend::Cuda)
    std::fprintf(stderr, "backend: cuda (%s)\n", cuda::device_name().c_str());
#endif
  return ops::Context::create();
}

// The target's artifact identity: config fingerprint + content hash of its weight files.
std::string target_identity(const WeightStore& weights, const std::string& dir) {
  const auto cfg = nlohmann::json::parse(read_text_file(dir + "/config.json"));
  return artifact_identity(config_fingerprint(cfg), weights.files());
}

bool is_glm5_dir(const std::string& dir) {
  const auto path = std::filesystem::path(dir) / "config.json";
  if (!std::filesystem::exists(path)) return false;  // the loader names the missing file
  const nlohmann::json cfg = read_json_file(path.string());
  return cfg.is_object() && cfg.value("model_type", std::string()) == "glm_moe_dsa";
}

LoadedTarget load_target(const std::string& dir, bool with_identity) {
  LoadedTarget t;
  if (is_glm5_dir(dir)) {
    t.glm = Glm5Model::load(dir);
    const std::string identity = with_identity ? target_identity(t.glm->weights(), dir) : "";
    t.view = std::make_unique<spec::Glm5TargetView>(*t.glm, identity);
  } else {
    t.qwen = Qwen35Model::load(dir);
    const std::string identity = with_identity ? target_identity(t.qwen->weights(), dir) : "";
    t.view = std::make_unique<spec::QwenTargetView>(*t.qwen, identity);
  }
  return t;
}

std::unique_ptr<Qwen35Model> random_weight_model(const std::string& config_path) {
  return Qwen35Model::random(parse_qwen35_config(read_text_file(config_path), config_path),
                             kRandomWeightsSeed);
}

EngineTargetFactory LoadedTarget::engine_target(DType kv_dtype) const {
  const std::string identity = view->identity();
  if (glm)
    return [m = glm.get(), identity] { return std::make_unique<Glm5EngineTarget>(*m, identity); };
  return [m = qwen.get(), identity, kv_dtype] {
    return std::make_unique<QwenEngineTarget>(*m, identity, kv_dtype);
  };
}

int64_t LoadedTarget::max_position_embeddings() const {
  return glm ? glm->config().max_position_embeddings : qwen->config().max_position_embeddings;
}

// One JSON object per line: {"prompt": ...} or {"token_ids": [...]}, optional "seed",
// "temperature", "max_tokens"; other sampling settings come from the command line.
std::vector<GenerateRequest> read_prompts_file(const std::string& path, const GenerateRequest& base,
                                               const std::optional<Tokenizer>& tok) {
  const std::string text = read_text_file(path);
  std::vector<GenerateRequest> reqs;
  size_t line_no = 0, start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail(where, ": not a JSON object: ", e.what());
    }
    if (!j.is_object()) fail(where, ": each line must be a JSON object");
    GenerateRequest r = base;
    try {
      if (j.contains("prompt") == j.contains("token_ids"))
        fail(where, ": give exactly one of \"prompt\" or \"token_ids\"");
      if (j.contains("prompt")) {
        if (!tok) fail(where, ": the model has no tokenizer.json; use \"token_ids\"");
        r.prompt = tok->encode(j.at("prompt").get<std::string>());
      } else {
        r.prompt = j.at("token_ids").get<std::vector<int32_t>>();
      }
      if (j.contains("seed")) r.sampling.seed = j.at("seed").get<uint64_t>();
      if (j.contains("temperature")) r.sampling.temperature = j.at("temperature").get<float>();
      if (j.contains("max_tokens")) r.max_tokens = j.at("max_tokens").get<int64_t>();
    } catch (const nlohmann::json::exception& e) {
      fail(where, ": ", e.what());
    }
    if (r.prompt.empty()) fail(where, ": the prompt is empty");
    reqs.push_back(std::move(r));
  }
  if (reqs.empty()) fail(path, ": no requests");
  return reqs;
}

void add_kv_dtype_option(CLI::App* sub, std::string* value) {
  sub->add_option("--kv-dtype", *value,
                  "KV cache storage: bf16 (half the memory and bandwidth) or f32; attention "
                  "computes in fp32 either way")
      ->capture_default_str();
}

DType parse_kv_dtype(const std::string& s) {
  if (s == "bf16") return DType::BF16;
  if (s == "f32") return DType::F32;
  fail("--kv-dtype must be bf16 or f32, got '", s, "'");
}

void add_draft_options(CLI::App* sub, DraftArgs* a) {
  sub->add_option("--draft", a->draft, "Drafter: none, mtp, ngram or eagle3")
      ->capture_default_str();
  sub->add_option("--draft-model", a->draft_model,
                  "--draft mtp: a companion MTP drafter directory (default: the model's own mtp.* "
                  "layer); --draft eagle3: the EAGLE-3 head directory (required)");
  sub->add_option("--depth", a->depth,
                  "Proposals per round: a fixed 0..16, or auto (each round picks 0..4, 0..8 for "
                  "ngram, from the running acceptance and measured round times), or auto:K "
                  "(0..K)")
      ->capture_default_str();
  sub->add_option("--verify", a->verify, "match (lossless bytes) or rejection")
      ->capture_default_str();
  sub->add_option("--ngram-max", a->ngram.max_n, "Longest n-gram looked up")->capture_default_str();
  sub->add_option("--ngram-min", a->ngram.min_n, "Shortest n-gram looked up")
      ->capture_default_str();
  sub->add_option("--prefill-chunk", a->prefill_chunk,
                  "Prompt tokens per prefill forward, counted from the prompt's start (on CUDA, "
                  "generate and serve agree byte for byte at the same value)")
      ->capture_default_str();
  sub->add_flag("--no-drafter-probe", a->no_drafter_probe,
                "Keep drafting when the drafter's first proposals stop being accepted (by default "
                "a collapsed drafter is reported once and rounds propose nothing from then on)");
  sub->add_flag("--settled-rounds", a->settled_rounds,
                "--draft mtp or ngram: draft, accept and commit each round on the device and queue "
                "the next round before reading it (one host read per round, overlapped with the "
                "device's work)");
  sub->add_option("--mtp-hidden", a->mtp_hidden,
                  "Target hidden fed to the MTP drafter: final (after the final norm) or prenorm")
      ->capture_default_str();
  sub->add_option("--draft-vocab", a->draft_vocab,
                  "--draft mtp on Qwen3.5: each draft step scores token ids 0..N-1 only (a reduced "
                  "draft vocabulary; the output is unchanged); 0 = the whole vocabulary")
      ->capture_default_str();
}

DepthArg parse_depth(const std::string& s) {
  if (s == "auto") return {kAutoMaxDepth, true, false};
  const bool automatic = s.rfind("auto:", 0) == 0;
  const std::string number = automatic ? s.substr(5) : s;
  size_t used = 0;
  int depth = -1;
  try {
    depth = std::stoi(number, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != number.size() || depth < (automatic ? 1 : 0) || depth > 16)
    fail("--depth must be auto, auto:K (K in 1..16) or a whole number in 0..16, got '", s, "'");
  return {depth, automatic, automatic};
}

int auto_max_depth(const DepthArg& d, std::string_view draft) {
  if (d.max_given) return d.depth;
  return draft == "ngram" ? kAutoMaxDepthTokens : kAutoMaxDepth;
}

SpecOptions spec_options(const DraftArgs& a) {
  const DepthArg d = parse_depth(a.depth);
  SpecOptions o;
  o.depth = d.automatic ? auto_max_depth(d, a.draft) : d.depth;
  o.auto_depth = d.automatic;
  o.verify = spec::parse_verify_mode(a.verify);
  o.prefill_chunk = a.prefill_chunk;
  o.health_probe = !a.no_drafter_probe;
  o.settled_rounds = a.settled_rounds;
  return o;
}

std::unique_ptr<spec::DraftProvider> open_drafter(const DraftArgs& a,
                                                  const spec::TargetView& target) {
  if (a.draft_vocab != 0 && a.draft != "mtp") fail("--draft-vocab applies to --draft mtp only");
  if (a.settled_rounds && a.draft != "mtp" && a.draft != "ngram")
    fail("--settled-rounds applies to --draft mtp and --draft ngram only (got --draft ", a.draft,
         ")");
  if (a.settled_rounds && a.verify != "match")
    fail(
        "--settled-rounds needs --verify match (rejection sampling reads the draft "
        "distributions on the host)");
  if (a.settled_rounds && target.qwen35_config() == nullptr)
    fail(
        "--settled-rounds: this target commits its rounds on the host only (Qwen3.5 targets "
        "settle rounds on the device)");
  if (a.draft == "none") {
    if (a.draft_model) fail("--draft-model needs --draft mtp or --draft eagle3");
    return nullptr;
  }
  if (a.draft == "ngram") {
    if (a.draft_model)
      fail("--draft-model needs --draft mtp or --draft eagle3 (n-gram lookup has no weights)");
    spec::validate_ngram_options(a.ngram);
    return std::make_unique<spec::NgramProvider>(a.ngram);
  }
  if (a.draft == "mtp") {
    spec::HiddenTap tap;
    if (a.mtp_hidden == "final")
      tap = spec::HiddenTap::FinalNormed;
    else if (a.mtp_hidden == "prenorm")
      tap = spec::HiddenTap::PreNorm;
    else
      fail("--mtp-hidden must be 'final' or 'prenorm', got '", a.mtp_hidden, "'");
    if (target.glm5_config()) {
      if (a.draft_model)
        fail(
            "--draft-model: GLM-5 drafts with the NextN layer inside its checkpoint; companion "
            "directories are Qwen3.5 MTP layers");
      if (tap != spec::HiddenTap::FinalNormed)
        fail("--mtp-hidden prenorm: GLM-5's NextN layer reads the final-normed hidden");
      if (a.draft_vocab != 0) fail("--draft-vocab: GLM-5's NextN drafter scores every token");
      return spec::GlmMtpProvider::from_target(target);
    }
    auto mtp = a.draft_model ? spec::QwenMtpProvider::from_companion(*a.draft_model, tap)
                             : spec::QwenMtpProvider::from_target(target, tap);
    if (a.draft_vocab < 0 || a.draft_vocab > target.vocab_size())
      fail("--draft-vocab must be in 0..", target.vocab_size(), " (the vocabulary), got ",
           a.draft_vocab);
    mtp->set_draft_vocabulary(a.draft_vocab);
    return mtp;
  }
  if (a.draft == "eagle3") {
    if (!a.draft_model)
      fail("--draft eagle3 needs --draft-model DIR: the EAGLE-3 head's directory (config.json + ",
           "model.safetensors)");
    if (a.mtp_hidden != "final") fail("--mtp-hidden applies to --draft mtp only");
    return spec::Eagle3Provider::open(*a.draft_model);
  }
  fail("--draft must be none, mtp, ngram or eagle3, got '", a.draft, "'");
}

}  // namespace tandem::cli
