#include "tandem/spec/glm_mtp.h"

#include <filesystem>

#include "tandem/core/error.h"
#include "tandem/io/artifact_identity.h"
#include "tandem/io/json_file.h"

namespace tandem::spec {

namespace {

const char* history_name(GlmMtpHistory h) {
  return h == GlmMtpHistory::Prefilled ? "prefilled" : "empty";
}

const Glm5Config& glm_target(const TargetView& target, const std::string& source) {
  const Glm5Config* c = target.glm5_config();
  if (!c)
    fail("glm-mtp drafter ", source, ": the target is not a GLM-5 model (the NextN layer is ",
         "built from a glm_moe_dsa config)");
  return *c;
}

}  // namespace

std::unique_ptr<GlmMtpProvider> GlmMtpProvider::from_target(const TargetView& target,
                                                            GlmMtpHistory history) {
  const WeightStore& store = target.weights();
  const Glm5Config& cfg = glm_target(target, store.dir());
  const std::string source =
      store.dir() + " (model.layers." + std::to_string(cfg.num_hidden_layers) + ".*)";
  std::unique_ptr<GlmMtpProvider> p(new GlmMtpProvider());
  p->source_ = source;
  p->history_ = history;
  p->block_ = std::make_shared<const GlmMtpBlock>(cfg, store);
  const nlohmann::json config =
      read_json_file((std::filesystem::path(store.dir()) / "config.json").string());
  p->ns_ = std::string(kGlmMtpSchema) + ":" +
           artifact_identity(config_fingerprint(config) +
                                 "|glm-mtp:in-checkpoint|history:" + history_name(history),
                             store.files());
  return p;
}

std::unique_ptr<DraftRows> GlmMtpProvider::open_rows(const TargetView& target) const {
  const Glm5Config& tc = glm_target(target, source_);
  const Glm5Config& c = block_->config();
  if (tc.hidden_size != c.hidden_size || tc.vocab_size != c.vocab_size)
    fail("glm-mtp drafter ", source_, ": hidden size ", c.hidden_size, " and vocabulary ",
         c.vocab_size, " do not match the target's ", tc.hidden_size, " and ", tc.vocab_size,
         " (it drafts through the target's embedding and head, so they must agree)");
  if (!target.can_tap(HiddenTap::FinalNormed))
    fail("glm-mtp drafter ", source_, ": the target cannot provide its final-normed hidden");
  return std::make_unique<GlmMtpRows>(block_, target, ns_, history_);
}

GlmMtpRows::GlmMtpRows(std::shared_ptr<const GlmMtpBlock> block, const TargetView& target,
                       std::string ns, GlmMtpHistory history)
    : MtpRows(target, "glm-mtp", kGlmMtpSchema, std::move(ns), HiddenTap::FinalNormed,
              block->config().hidden_size, block->config().vocab_size),
      block_(std::move(block)),
      width_(block_->latent_width()) {
  prefill_history_ = history == GlmMtpHistory::Prefilled;
}

std::unique_ptr<MtpRows::History> GlmMtpRows::new_history() {
  return std::make_unique<LatentHistory>(width_);
}

void GlmMtpRows::release_history(History& h) {
  static_cast<LatentHistory&>(h).latent.release();
}

void GlmMtpRows::truncate_history(History& h, int64_t length) {
  static_cast<LatentHistory&>(h).latent.truncate(length);
}

int64_t GlmMtpRows::check_history(const Checkpoint& c) const {
  const auto it = c.tensors.find("latent");
  if (it == c.tensors.end())
    fail("glm-mtp: checkpoint (", kGlmMtpSchema, ") has no tensor 'latent'");
  const CheckpointTensor& t = it->second;
  const int64_t rows = t.shape.size() == 2 ? t.shape[0] : -1;
  if (rows < 0 || t.shape[1] != width_ || static_cast<int64_t>(t.data.size()) != rows * width_)
    fail("glm-mtp: checkpoint tensor 'latent' has shape ", shape_str(t.shape), " (", t.data.size(),
         " values), expected [rows, ", width_, "] (captured by a drafter of another shape?)");
  return rows;
}

std::unique_ptr<MtpRows::History> GlmMtpRows::restore_history(const Checkpoint& c, int64_t length) {
  auto h = std::make_unique<LatentHistory>(width_);
  const std::vector<float>& latent = c.tensors.at("latent").data;
  h->latent.assign_host(std::span<const float>(latent).first(static_cast<size_t>(length * width_)));
  return h;
}

void GlmMtpRows::save_history(const History& h, int64_t length, Checkpoint& c) const {
  const PositionCache& latent = static_cast<const LatentHistory&>(h).latent;
  c.metadata = nlohmann::json{{"hidden_size", H_}, {"latent_width", width_}};
  c.tensors["latent"] = CheckpointTensor{{length, width_}, latent.to_host(length)};
}

void GlmMtpRows::forward_block(const float* embeds, const float* hidden,
                               std::span<History* const> rows, std::span<const int64_t> lengths,
                               std::span<const int64_t> counts, float* out) {
  // The absorbed attention form throughout: a row's MTP rows get the same bits whether they are
  // built in one call (prefill) or one per call (the draft chain).
  Glm5Tokens tokens;
  std::vector<Glm5RowCache> caches;
  for (size_t i = 0; i < rows.size(); ++i) {
    tokens.rows.push_back({tokens.T, counts[i], lengths[i]});
    for (int64_t j = 0; j < counts[i]; ++j) tokens.pos.push_back(lengths[i] + j);
    tokens.T += counts[i];
    PositionCache& latent = static_cast<LatentHistory&>(*rows[i]).latent;
    TANDEM_CHECK(latent.length() == lengths[i], "glm-mtp: a row's history holds ", latent.length(),
                 " positions, its drafter ", lengths[i]);
    caches.push_back({&latent, nullptr});
  }
  block_->forward(embeds, hidden, tokens, caches, out);
}

}  // namespace tandem::spec
