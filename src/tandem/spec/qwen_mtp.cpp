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

const CheckpointTensor& checkpoint_tensor(const Checkpoint& c, const char* name,
                                          const std::vector<int64_t>& want) {
  auto it = c.tensors.find(name);
  if (it == c.tensors.end())
    fail("qwen-mtp: checkpoint (", kQwenMtpSchema, ") has no tensor '", name, "'");
  const CheckpointTensor& t = it->second;
  int64_t numel = 1;
  for (int64_t d : want) numel *= d;
  if (t.shape != want || static_cast<int64_t>(t.data.size()) != numel)
    fail("qwen-mtp: checkpoint tensor '", name, "' has shape ", shape_str(t.shape), " (",
         t.data.size(), " values), expected ", shape_str(want),
         " (captured by a drafter of another shape?)");
  return t;
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
  return std::make_unique<QwenMtpRows>(block_, target, ns_, tap_);
}

// ---------------------------------------------------------------------------------------------
// Rows

QwenMtpRows::QwenMtpRows(std::shared_ptr<const QwenMtpBlock> block, const TargetView& target,
                         std::string ns, HiddenTap tap)
    : MtpRows(target, "qwen-mtp", kQwenMtpSchema, std::move(ns), tap, block->config().hidden_size,
              block->config().vocab_size),
      block_(std::move(block)) {
  kv_heads_ = block_->config().num_key_value_heads;
  head_dim_ = block_->config().head_dim;
}

ops::KVLayerView QwenMtpRows::kv_view() const {
  ops::KVLayerView v;
  // The drafter's one layer keeps fp32 KV, whatever the target's: its checkpoints are fp32
  // tensors, and one layer's KV is a small part of the target's. Written only through
  // forward_block and restore_history, which own the blocks they write.
  v.pool = const_cast<float*>(pool_.data());
  v.dtype = DType::F32;
  v.block_size = kBlockSize;
  v.n_kv_heads = kv_heads_;
  v.head_dim = head_dim_;
  return v;
}

std::vector<int32_t> QwenMtpRows::take_blocks(int64_t n) {
  if (static_cast<int64_t>(free_blocks_.size()) < n) {
    // Grow geometrically; block ids never move, and rows' contents are kept by the resize.
    const int64_t add = std::max<int64_t>({n, n_blocks_, 16});
    pool_.grow_to((n_blocks_ + add) * floats_per_block());
    // Capacity for every block: returning blocks (release, filter) never reallocates.
    free_blocks_.reserve(static_cast<size_t>(n_blocks_ + add));
    for (int64_t b = n_blocks_ + add - 1; b >= n_blocks_; --b)
      free_blocks_.push_back(static_cast<int32_t>(b));
    n_blocks_ += add;
  }
  std::vector<int32_t> out(free_blocks_.end() - n, free_blocks_.end());
  std::reverse(out.begin(), out.end());
  free_blocks_.resize(free_blocks_.size() - static_cast<size_t>(n));
  return out;
}

void QwenMtpRows::reserve(KvHistory& h, int64_t length) {
  const int64_t need = (length + kBlockSize - 1) / kBlockSize;
  const int64_t missing = need - static_cast<int64_t>(h.blocks.size());
  if (missing <= 0) return;
  const std::vector<int32_t> got = take_blocks(missing);
  h.blocks.insert(h.blocks.end(), got.begin(), got.end());
}

std::unique_ptr<MtpRows::History> QwenMtpRows::new_history() {
  return std::make_unique<KvHistory>();
}

void QwenMtpRows::release_history(History& h) {
  std::vector<int32_t>& blocks = static_cast<KvHistory&>(h).blocks;
  free_blocks_.insert(free_blocks_.end(), blocks.begin(), blocks.end());
  blocks.clear();
}

void QwenMtpRows::forward_block(const float* embeds, const float* hidden,
                                std::span<History* const> rows, std::span<const int64_t> lengths,
                                std::span<const int64_t> counts, float* out) {
  for (size_t i = 0; i < rows.size(); ++i)
    reserve(static_cast<KvHistory&>(*rows[i]), lengths[i] + counts[i]);
  // Segments point into an upload of the rows' block tables, made after every reservation.
  tables_host_.clear();
  std::vector<int64_t> offset;
  for (History* h : rows) {
    const std::vector<int32_t>& blocks = static_cast<const KvHistory&>(*h).blocks;
    offset.push_back(static_cast<int64_t>(tables_host_.size()));
    tables_host_.insert(tables_host_.end(), blocks.begin(), blocks.end());
  }
  tables_dev_.grow_to(std::max<int64_t>(1, static_cast<int64_t>(tables_host_.size())));
  ops::copy_from_host(tables_dev_.data(), tables_host_.data(),
                      sizeof(int32_t) * tables_host_.size());
  std::vector<MtpSegment> segs;
  segs.reserve(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t capacity =
        static_cast<int64_t>(static_cast<const KvHistory&>(*rows[i]).blocks.size()) * kBlockSize;
    segs.push_back({tables_dev_.data() + offset[i], lengths[i], counts[i],
                    attention_position_bound(capacity)});
  }
  block_->forward(embeds, hidden, segs, kv_view(), ws_, out);
}

int64_t QwenMtpRows::check_history(const Checkpoint& c) const {
  const auto keys = c.tensors.find("kv_keys");
  const int64_t rows =
      keys == c.tensors.end() || keys->second.shape.empty() ? 0 : keys->second.shape.front();
  checkpoint_tensor(c, "kv_keys", {rows, kv_heads_, head_dim_});
  checkpoint_tensor(c, "kv_values", {rows, kv_heads_, head_dim_});
  return rows;
}

std::unique_ptr<MtpRows::History> QwenMtpRows::restore_history(const Checkpoint& c,
                                                               int64_t length) {
  const CheckpointTensor& keys = c.tensors.at("kv_keys");
  const CheckpointTensor& values = c.tensors.at("kv_values");
  const int64_t kvf = kv_heads_ * head_dim_;
  auto h = std::make_unique<KvHistory>();
  h->blocks = take_blocks((length + kBlockSize - 1) / kBlockSize);
  const ops::KVLayerView kv = kv_view();
  // A block's keys (and its values) are contiguous: one copy each per block.
  for (int64_t p = 0; p < length; p += kBlockSize) {
    const int32_t b = h->blocks[static_cast<size_t>(p / kBlockSize)];
    const size_t bytes = sizeof(float) * kvf * std::min(kBlockSize, length - p);
    ops::copy_from_host(kv.key(b, 0), keys.data.data() + p * kvf, bytes);
    ops::copy_from_host(kv.value(b, 0), values.data.data() + p * kvf, bytes);
  }
  return h;
}

void QwenMtpRows::save_history(const History& h, int64_t length, Checkpoint& c) const {
  const std::vector<int32_t>& blocks = static_cast<const KvHistory&>(h).blocks;
  c.metadata = json{{"hidden_size", H_}, {"kv_heads", kv_heads_}, {"head_dim", head_dim_}};
  const int64_t kvf = kv_heads_ * head_dim_;
  CheckpointTensor keys, values;
  keys.shape = values.shape = {length, kv_heads_, head_dim_};
  keys.data.resize(static_cast<size_t>(length * kvf));
  values.data.resize(static_cast<size_t>(length * kvf));
  const ops::KVLayerView kv = kv_view();
  for (int64_t p = 0; p < length; p += kBlockSize) {  // one copy of keys, one of values per block
    const int32_t b = blocks[static_cast<size_t>(p / kBlockSize)];
    const size_t bytes = sizeof(float) * kvf * std::min(kBlockSize, length - p);
    ops::copy_to_host(keys.data.data() + p * kvf, kv.key(b, 0), bytes);
    ops::copy_to_host(values.data.data() + p * kvf, kv.value(b, 0), bytes);
  }
  c.tensors["kv_keys"] = std::move(keys);
  c.tensors["kv_values"] = std::move(values);
}

}  // namespace tandem::spec
