#include "tandem/spec/qwen_mtp.h"

#include <algorithm>
#include <filesystem>

#include "tandem/core/error.h"
#include "tandem/io/artifact_identity.h"
#include "tandem/io/json_file.h"

namespace tandem::spec {

namespace {

using json = nlohmann::json;

// Everything that changes what a drafter state means beyond the weights: where the layer came
// from (norm layout) and which target hidden it consumes.
std::string mtp_fingerprint(const json& config, const char* source, HiddenTap tap) {
  return config_fingerprint(config) + "|qwen-mtp:" + source + "|tap:" + hidden_tap_name(tap);
}

// The graph-shaping numbers of an MTP block as a config object under config.json's field names
// (rotary_dim enters as the partial_rotary_factor that gives it), for config_fingerprint.
json mtp_config_object(const QwenMtpConfig& c) {
  return json{{"model_type", "qwen3_5_mtp"},
              {"hidden_size", c.hidden_size},
              {"vocab_size", c.vocab_size},
              {"intermediate_size", c.intermediate_size},
              {"num_attention_heads", c.num_attention_heads},
              {"num_key_value_heads", c.num_key_value_heads},
              {"head_dim", c.head_dim},
              {"rms_norm_eps", c.rms_norm_eps},
              {"rope_theta", c.rope_theta},
              {"partial_rotary_factor",
               static_cast<double>(c.rotary_dim) / static_cast<double>(c.head_dim)}};
}

// Random weights are determined by their shape, the seed and the draw (WeightArena's random
// fill and random_mtp_weights' streams): bump the version when the draw changes.
constexpr const char* kRandomDraw = "random-v1";

// The Qwen3.5 config of the target the MTP layer is built for; other families are refused.
const Qwen35Config& qwen_target(const TargetView& target, const std::string& source) {
  const Qwen35Config* c = target.qwen35_config();
  if (!c)
    fail("qwen-mtp drafter ", source, ": the target is not a Qwen3.5 model (the drafter's ",
         "layer is built from a Qwen3.5 config)");
  return *c;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Provider

std::unique_ptr<QwenMtpProvider> QwenMtpProvider::from_target(const TargetView& target,
                                                              HiddenTap tap) {
  const WeightStore& store = target.weights();
  const std::string config_path = store.dir() + "/config.json";
  const QwenMtpConfig cfg =
      mtp_config_from_target(qwen_target(target, store.dir() + " (mtp.*)"), config_path);
  std::unique_ptr<QwenMtpProvider> p(new QwenMtpProvider());
  p->tap_ = tap;
  p->source_ = store.dir() + " (mtp.*)";
  auto block = std::make_shared<QwenMtpBlock>(bind_mtp_weights(cfg, store, "mtp."));
  p->bytes_ = block->weights().bytes();
  p->block_ = std::move(block);
  const json config = read_json_file((std::filesystem::path(store.dir()) / "config.json").string());
  p->ns_ = std::string(kQwenMtpSchema) + ":" +
           artifact_identity(mtp_fingerprint(config, "in-checkpoint", tap), store.files());
  return p;
}

std::unique_ptr<QwenMtpProvider> QwenMtpProvider::from_companion(const std::string& dir,
                                                                 HiddenTap tap) {
  const std::string config_path = (std::filesystem::path(dir) / "config.json").string();
  const json config = read_json_file(config_path);
  const QwenMtpConfig cfg = parse_mtp_companion_config(config, config_path);
  std::unique_ptr<QwenMtpProvider> p(new QwenMtpProvider());
  p->tap_ = tap;
  p->source_ = dir;
  WeightStore store = WeightStore::open(dir);
  const std::vector<std::string> files = store.files();
  auto block = std::make_shared<QwenMtpBlock>(bind_mtp_weights(cfg, std::move(store), ""));
  p->bytes_ = block->weights().bytes();
  p->block_ = std::move(block);
  p->ns_ = std::string(kQwenMtpSchema) + ":" +
           artifact_identity(mtp_fingerprint(config, "companion", tap), files);
  return p;
}

std::unique_ptr<QwenMtpProvider> QwenMtpProvider::random(const TargetView& target, uint64_t seed,
                                                         HiddenTap tap) {
  const std::string source = "random weights (seed " + std::to_string(seed) + ")";
  const Qwen35Config& tc = qwen_target(target, source);
  if (tc.mtp_num_hidden_layers < 1)
    fail("qwen-mtp drafter ", source,
         ": the target's config declares no MTP layer (mtp_num_hidden_layers = ",
         tc.mtp_num_hidden_layers, "), so there is no shape to build");
  const QwenMtpConfig cfg = mtp_config_from_target(tc, "qwen-mtp drafter " + source);
  std::unique_ptr<QwenMtpProvider> p(new QwenMtpProvider());
  p->tap_ = tap;
  p->source_ = source;
  auto block = std::make_shared<QwenMtpBlock>(random_mtp_weights(cfg, seed));
  p->bytes_ = block->weights().bytes();
  p->block_ = std::move(block);
  const std::string draw = std::string(kRandomDraw) + ":" + std::to_string(seed);
  p->ns_ = std::string(kQwenMtpSchema) + ":" +
           artifact_identity(mtp_fingerprint(mtp_config_object(cfg), draw.c_str(), tap), {});
  return p;
}

int QwenMtpProvider::suggested_depth() const {
  const int64_t b = config().block_size;
  return b > 1 ? static_cast<int>(b - 1) : 0;
}

std::unique_ptr<DraftRows> QwenMtpProvider::open_rows(const TargetView& target) const {
  const QwenMtpConfig& c = config();
  qwen_target(target, source_);
  if (target.hidden_size() != c.hidden_size)
    fail("qwen-mtp drafter ", source_, ": hidden size ", c.hidden_size,
         " does not match the target's ", target.hidden_size(),
         " (was it split from a different checkpoint?)");
  if (target.vocab_size() != c.vocab_size)
    fail("qwen-mtp drafter ", source_, ": vocabulary size ", c.vocab_size,
         " does not match the target's ", target.vocab_size(),
         " (it drafts through the target's embedding and head, so they must agree)");
  if (!target.can_tap(tap_))
    fail("qwen-mtp drafter ", source_, ": the target cannot provide the ", hidden_tap_name(tap_),
         " hidden state this drafter consumes");
  auto rows = std::make_unique<QwenMtpRows>(block_, target, ns_, tap_);
  rows->set_draft_vocabulary(draft_vocab_);
  return rows;
}

void QwenMtpProvider::set_draft_vocabulary(int64_t tokens) {
  if (tokens < 0 || tokens > config().vocab_size)
    fail("qwen-mtp drafter ", source_, ": a draft vocabulary of ", tokens,
         " tokens; the vocabulary has ", config().vocab_size, " (0 for all of them)");
  draft_vocab_ = tokens;
}

// ---------------------------------------------------------------------------------------------
// Rows

QwenMtpRows::QwenMtpRows(std::shared_ptr<const QwenMtpBlock> block, const TargetView& target,
                         std::string ns, HiddenTap tap)
    : MtpRows(target, "qwen-mtp", kQwenMtpSchema, std::move(ns), tap, block->config().hidden_size,
              block->config().vocab_size),
      block_(std::move(block)),
      kv_(block_->config().num_key_value_heads, block_->config().head_dim) {}

std::unique_ptr<MtpRows::History> QwenMtpRows::new_history() {
  return std::make_unique<KvHistory>();
}

void QwenMtpRows::release_history(History& h) {
  kv_.release(static_cast<KvHistory&>(h).blocks);
}

std::vector<const std::vector<int32_t>*> QwenMtpRows::reserve_tables(
    std::span<History* const> rows, std::span<const int64_t> lengths,
    std::span<const int64_t> added) {
  std::vector<const std::vector<int32_t>*> tables;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::vector<int32_t>& blocks = static_cast<KvHistory&>(*rows[i]).blocks;
    kv_.reserve(blocks, lengths[i] + added[i] + reserve_extra_);
    tables.push_back(&blocks);
  }
  return tables;
}

void QwenMtpRows::add_batch_key(const AttentionBatch& b, GraphKey& key) {
  // The rows' tables and lengths are device memory; only the batched bound sizes the attention's
  // grid, so rows of other lengths replay the graph.
  key.add(b.tokens).add(b.positions).add(b.rows.tables).add(b.rows.table_stride);
  for (const AttentionSegment& s : b.segments) key.add(s.n);
  key.add(batched_position_bound(b.segments, false));
}

void QwenMtpRows::forward_block(const float* embeds, const float* hidden,
                                std::span<History* const> rows, std::span<const int64_t> lengths,
                                std::span<const int64_t> counts, float* out) {
  const auto tables = reserve_tables(rows, lengths, counts);
  const int64_t most = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  // On the block's stream: its uploads and launches stay in order with the forward's own.
  const ops::ContextScope scope(block_->context());
  const AttentionBatch batch = kv_.batch(tables, lengths, counts);
  if (batch.tokens == 0) return;
  block_->reserve(ws_, batch.tokens);
  const ops::KVLayerView kv = kv_.view();
  auto body = [&] { block_->forward(embeds, hidden, batch, kv, ws_, out); };
  // Draft steps and commits (a token or a few per row) replay a graph: a step of this one-layer
  // block is some twenty small launches. Prompts come in every length and run directly.
  if (most > kGraphRowTokens) return body();
  GraphKey key;
  add_batch_key(batch, key);
  key.add(kv.pool).add(embeds).add(hidden).add(out);
  ws_.add_to(key);
  graphs_.run(key, body);
}

void QwenMtpRows::shift_batch(const ops::PositionShift& shift, const AttentionBatch& b) {
  ops::PositionShift s = shift;
  s.token_row = b.rows.query_rows;
  s.tokens = b.tokens;
  s.rows = static_cast<int64_t>(b.segments.size());
  s.tables = b.rows.tables;
  s.table_stride = b.rows.table_stride;
  s.block_size = kBlockSize;
  // The batch's arrays are this pool's upload scratch (DraftKvPool::batch, chain), the
  // forward's own to move.
  ops::shift_positions(s, const_cast<int64_t*>(b.positions), const_cast<int64_t*>(b.kv_slots));
}

void QwenMtpRows::shift_chain(const ops::PositionShift& s) {
  for (size_t j = 0; j < chain_.size(); ++j) {
    ops::PositionShift step = s;
    if (j > 0) step.park_tokens = 0;  // completion rows lead step 0 only
    shift_batch(step, chain_[j]);
  }
}

bool QwenMtpRows::chains_share_context() const {
  return &block_->context() == &ops::current_context();
}

bool QwenMtpRows::prepare_chain(std::span<History* const> rows, std::span<const int64_t> lengths,
                                std::span<const int> depths, StagedUpload::Part* tables_upload) {
  if (!chains_share_context()) return false;
  const std::vector<int64_t> steps(depths.begin(), depths.end());
  std::vector<int64_t> completion;
  if (chain_completion_)
    for (size_t i = 0; i < lengths.size(); ++i)
      completion.push_back(completion_position(i, lengths[i], depths[i]));
  chain_ =
      kv_.chain(reserve_tables(rows, lengths, steps), lengths, depths, completion, tables_upload);
  int64_t most = 0;
  for (const AttentionBatch& b : chain_) most = std::max(most, b.tokens);
  block_->reserve(ws_, most);
  return true;
}

void QwenMtpRows::chain_step(int j, const float* embeds, const float* hidden, float* out) {
  block_->forward(embeds, hidden, chain_.at(static_cast<size_t>(j)), kv_.view(), ws_, out);
}

bool QwenMtpRows::chain_step_embedded(int j, const int32_t* ids, const float* hidden, float* out) {
  const ops::WeightRef* table = target_.embedding_table();
  if (table == nullptr) return false;
  block_->forward_embedded(*table, ids, hidden, chain_.at(static_cast<size_t>(j)), kv_.view(), ws_,
                           out);
  return true;
}

void QwenMtpRows::add_chain_key(GraphKey& key) const {
  key.add(kv_.view().pool);
  for (const AttentionBatch& b : chain_) add_batch_key(b, key);
  ws_.add_to(key);
}

int64_t QwenMtpRows::check_history(const Checkpoint& c) const {
  return kv_.checkpoint_rows(c, "qwen-mtp");
}

std::unique_ptr<MtpRows::History> QwenMtpRows::restore_history(const Checkpoint& c,
                                                               int64_t length) {
  auto h = std::make_unique<KvHistory>();
  h->blocks = kv_.restore(c, length);
  return h;
}

std::vector<std::unique_ptr<MtpRows::History>> QwenMtpRows::copy_histories(
    const MtpRows& source, std::span<const History* const> from, std::span<const int64_t> lengths) {
  const auto* src = dynamic_cast<const QwenMtpRows*>(&source);
  if (!src || src->block_ != block_) return {};
  std::vector<const std::vector<int32_t>*> tables;
  for (const History* h : from) tables.push_back(&static_cast<const KvHistory&>(*h).blocks);
  std::vector<std::vector<int32_t>> blocks = kv_.copy_from(src->kv_, tables, lengths);
  std::vector<std::unique_ptr<History>> out;
  try {
    for (std::vector<int32_t>& b : blocks) {
      auto h = std::make_unique<KvHistory>();
      h->blocks = std::move(b);
      out.push_back(std::move(h));
    }
  } catch (...) {
    for (auto& h : out) release_history(*h);
    for (std::vector<int32_t>& b : blocks) kv_.release(b);
    throw;
  }
  return out;
}

void QwenMtpRows::save_history(const History& h, int64_t length, Checkpoint& c) const {
  c.metadata =
      json{{"hidden_size", H_}, {"kv_heads", kv_.kv_heads()}, {"head_dim", kv_.head_dim()}};
  kv_.save(static_cast<const KvHistory&>(h).blocks, length, c);
}

}  // namespace tandem::spec
