#include "tandem/spec/qwen_mtp.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "tandem/core/error.h"
#include "tandem/io/artifact_identity.h"
#include "tandem/io/json_file.h"

namespace tandem::spec {

namespace {

using json = nlohmann::json;

const char* tap_name(HiddenTap t) {
  return t == HiddenTap::FinalNormed ? "final-normed" : "pre-norm";
}

// Everything that changes what a drafter state means beyond the weights: where the layer came
// from (norm layout) and which target hidden it consumes.
std::string mtp_fingerprint(const json& config, const char* source, HiddenTap tap) {
  return config_fingerprint(config) + "|qwen-mtp:" + source + "|tap:" + tap_name(tap);
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
    fail("qwen-mtp drafter ", source_, ": the target cannot provide the ", tap_name(tap_),
         " hidden state this drafter consumes");
  return std::make_unique<QwenMtpRows>(block_, target, ns_, tap_);
}

// ---------------------------------------------------------------------------------------------
// Rows

QwenMtpRows::QwenMtpRows(std::shared_ptr<const QwenMtpBlock> block, const TargetView& target,
                         std::string ns, HiddenTap tap)
    : block_(std::move(block)), target_(target), ns_(std::move(ns)), tap_(tap) {
  const QwenMtpConfig& c = block_->config();
  H_ = c.hidden_size;
  V_ = c.vocab_size;
  kv_heads_ = c.num_key_value_heads;
  head_dim_ = c.head_dim;
}

ops::KVLayerView QwenMtpRows::kv_view() {
  ops::KVLayerView v;
  // The drafter's one layer keeps fp32 KV, whatever the target's: its checkpoints are fp32
  // tensors, and one layer's KV is a small part of the target's.
  v.pool = pool_.data();
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
    // Capacity for every block: returning blocks (dispose, filter) never reallocates.
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

void QwenMtpRows::reserve(Row& r, int64_t length) {
  const int64_t need = (length + kBlockSize - 1) / kBlockSize;
  const int64_t missing = need - static_cast<int64_t>(r.blocks.size());
  if (missing <= 0) return;
  const std::vector<int32_t> got = take_blocks(missing);
  r.blocks.insert(r.blocks.end(), got.begin(), got.end());
}

void QwenMtpRows::gather(int32_t id, const float* hidden) {
  ids_.push_back(id);
  hid_.insert(hid_.end(), hidden, hidden + H_);
}

void QwenMtpRows::run_block(const std::vector<int>& row_ids, const std::vector<int64_t>& counts) {
  const int64_t T = static_cast<int64_t>(ids_.size());
  TANDEM_CHECK(static_cast<int64_t>(hid_.size()) == T * H_);
  for (size_t i = 0; i < row_ids.size(); ++i) {
    Row& r = rows_[row_ids[i]];
    reserve(r, r.length + counts[i]);
  }
  // Segments point into an upload of the rows' block tables, made after every reservation.
  tables_host_.clear();
  std::vector<int64_t> offset;
  for (size_t i = 0; i < row_ids.size(); ++i) {
    const Row& r = rows_[row_ids[i]];
    offset.push_back(static_cast<int64_t>(tables_host_.size()));
    tables_host_.insert(tables_host_.end(), r.blocks.begin(), r.blocks.end());
  }
  tables_dev_.grow_to(std::max<int64_t>(1, static_cast<int64_t>(tables_host_.size())));
  ops::copy_from_host(tables_dev_.data(), tables_host_.data(),
                      sizeof(int32_t) * tables_host_.size());
  std::vector<MtpSegment> segs;
  segs.reserve(row_ids.size());
  for (size_t i = 0; i < row_ids.size(); ++i) {
    const Row& r = rows_[row_ids[i]];
    const int64_t capacity = static_cast<int64_t>(r.blocks.size()) * kBlockSize;
    segs.push_back(
        {tables_dev_.data() + offset[i], r.length, counts[i], attention_position_bound(capacity)});
  }
  emb_.grow_to(T * H_);
  out_.grow_to(T * H_);
  hid_dev_.grow_to(T * H_);
  ops::copy_from_host(hid_dev_.data(), hid_.data(), sizeof(float) * static_cast<size_t>(T * H_));
  target_.embed(ids_, emb_.data());
  block_->forward(emb_.data(), hid_dev_.data(), segs, kv_view(), ws_, out_.data());
  for (size_t i = 0; i < row_ids.size(); ++i) rows_[row_ids[i]].length += counts[i];
}

namespace {

// A prepared append: rows fully built (KV written into blocks no row owns yet); commit only moves
// them in (capacity reserved while preparing, so it cannot throw).
class AppendChange : public PreparedChange {
 public:
  AppendChange(std::function<void()> commit, std::function<void()> dispose)
      : commit_(std::move(commit)), dispose_(std::move(dispose)) {}
  ~AppendChange() override {
    if (!done_) dispose_();
  }
  void commit() noexcept override {
    if (done_) return;
    done_ = true;
    commit_();
  }
  void dispose() noexcept override {
    if (done_) return;
    done_ = true;
    dispose_();
  }

 private:
  std::function<void()> commit_, dispose_;
  bool done_ = false;
};

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

// The MTP rows a checkpoint holds: the leading dimension of its kv_keys.
int64_t checkpoint_rows(const Checkpoint& c) {
  auto it = c.tensors.find("kv_keys");
  return it == c.tensors.end() || it->second.shape.empty() ? 0 : it->second.shape.front();
}

}  // namespace

std::unique_ptr<PreparedChange> QwenMtpRows::prepare_append(std::span<const CheckpointPtr> from) {
  const int64_t n = static_cast<int64_t>(from.size());
  const int64_t kvf = kv_heads_ * head_dim_;
  // Validate everything first: nothing is allocated for a refused batch.
  for (const CheckpointPtr& c : from) {
    if (!c) continue;
    check_checkpoint(*c, "qwen-mtp", kQwenMtpSchema, ns_, c->processed_tokens);
    if (c->history_from < 0 || c->processed_tokens < c->history_from + 1)
      fail("qwen-mtp: checkpoint covers ", c->processed_tokens, " tokens from token ",
           c->history_from, "; a qwen-mtp state needs at least one processed token");
    const int64_t r = checkpoint_rows(*c);
    checkpoint_tensor(*c, "kv_keys", {r, kv_heads_, head_dim_});
    checkpoint_tensor(*c, "kv_values", {r, kv_heads_, head_dim_});
    checkpoint_tensor(*c, "h_true", {H_});
    check_checkpoint(*c, "qwen-mtp", kQwenMtpSchema, ns_, c->history_from + r + 1);
  }
  auto built = std::make_shared<std::vector<Row>>();
  built->reserve(static_cast<size_t>(n));
  try {
    for (const CheckpointPtr& c : from) {
      Row row;
      if (c) {
        const CheckpointTensor& keys = c->tensors.at("kv_keys");
        const CheckpointTensor& values = c->tensors.at("kv_values");
        const int64_t len = keys.shape.front();
        row.blocks = take_blocks((len + kBlockSize - 1) / kBlockSize);
        row.length = len;
        row.base = c->history_from;
        const ops::KVLayerView kv = kv_view();
        // A block's keys (and its values) are contiguous: one copy each per block.
        for (int64_t p = 0; p < len; p += kBlockSize) {
          const int32_t b = row.blocks[static_cast<size_t>(p / kBlockSize)];
          const size_t bytes = sizeof(float) * kvf * std::min(kBlockSize, len - p);
          ops::copy_from_host(kv.key(b, 0), keys.data.data() + p * kvf, bytes);
          ops::copy_from_host(kv.value(b, 0), values.data.data() + p * kvf, bytes);
        }
        row.h_true = c->tensors.at("h_true").data;
        row.has_hidden = true;
      }
      built->push_back(std::move(row));
    }
    rows_.reserve(rows_.size() + static_cast<size_t>(outstanding_appends_ + n));
  } catch (...) {
    for (Row& r : *built) free_blocks_.insert(free_blocks_.end(), r.blocks.begin(), r.blocks.end());
    throw;
  }
  outstanding_appends_ += n;
  return std::make_unique<AppendChange>(
      [this, built, n] {
        for (Row& r : *built) rows_.push_back(std::move(r));
        outstanding_appends_ -= n;
      },
      [this, built, n] {
        for (Row& r : *built)
          free_blocks_.insert(free_blocks_.end(), r.blocks.begin(), r.blocks.end());
        outstanding_appends_ -= n;
      });
}

void QwenMtpRows::filter_rows(std::span<const int> keep) {
  std::vector<bool> kept(rows_.size(), false);
  for (int k : keep) {
    if (k < 0 || k >= row_count()) fail("qwen-mtp filter_rows: row ", k, " does not exist");
    if (kept[static_cast<size_t>(k)]) fail("qwen-mtp filter_rows: row ", k, " listed twice");
    kept[static_cast<size_t>(k)] = true;
  }
  std::vector<Row> next;
  // Keep room for prepared appends: their commit must not allocate.
  next.reserve(keep.size() + static_cast<size_t>(outstanding_appends_));
  for (int k : keep) next.push_back(std::move(rows_[static_cast<size_t>(k)]));
  for (size_t i = 0; i < rows_.size(); ++i)
    if (!kept[i])
      free_blocks_.insert(free_blocks_.end(), rows_[i].blocks.begin(), rows_[i].blocks.end());
  rows_ = std::move(next);
}

void QwenMtpRows::adopt_prefix(int row, std::span<const int32_t> tokens) {
  if (row < 0 || row >= row_count()) fail("qwen-mtp adopt_prefix: row ", row, " does not exist");
  Row& r = rows_[static_cast<size_t>(row)];
  if (r.has_hidden || r.length != 0 || r.base != 0)
    fail("qwen-mtp adopt_prefix: row ", row, " is not a cold row");
  r.base = static_cast<int64_t>(tokens.size());
}

void QwenMtpRows::prefill(std::span<const RowPrefill> rows) {
  std::vector<bool> seen(rows_.size(), false);
  for (const RowPrefill& p : rows) {
    if (p.row < 0 || p.row >= row_count()) fail("qwen-mtp prefill: row ", p.row, " does not exist");
    if (seen[static_cast<size_t>(p.row)]) fail("qwen-mtp prefill: row ", p.row, " listed twice");
    seen[static_cast<size_t>(p.row)] = true;
    const Row& r = rows_[static_cast<size_t>(p.row)];
    if (r.drafted) fail("qwen-mtp prefill: row ", p.row, " has an uncommitted draft");
    if (p.tokens.empty()) fail("qwen-mtp prefill: row ", p.row, " has no tokens");
    if (p.hidden == nullptr)
      fail("qwen-mtp prefill: row ", p.row, " needs the target's ", tap_name(tap_), " hiddens");
    for (int32_t id : p.tokens)
      if (id < 0 || id >= V_)
        fail("qwen-mtp prefill: token id ", id, " is out of range [0, ", V_, ")");
    const int64_t covered = r.base + (r.has_hidden ? r.length + 1 : 0);
    if (covered != p.processed_before)
      fail("qwen-mtp prefill: row ", p.row, " covers ", covered, " tokens but the prefill ",
           p.processed_before == 0 ? "starts at token 0"
                                   : "continues after " + std::to_string(p.processed_before));
  }
  ids_.clear();
  hid_.clear();
  std::vector<int> row_ids;
  std::vector<int64_t> counts;
  for (const RowPrefill& p : rows) {
    const Row& r = rows_[static_cast<size_t>(p.row)];
    const int64_t n = static_cast<int64_t>(p.tokens.size());
    int64_t count = 0;
    // A continuing row first pairs its first new token with the hidden before it.
    if (r.has_hidden) {
      gather(p.tokens[0], r.h_true.data());
      ++count;
    }
    for (int64_t j = 0; j + 1 < n; ++j) {
      gather(p.tokens[static_cast<size_t>(j + 1)], p.hidden + j * H_);
      ++count;
    }
    // An adopted row given a single token has no (token, hidden) pair yet.
    if (count == 0) continue;
    row_ids.push_back(p.row);
    counts.push_back(count);
  }
  if (!row_ids.empty()) run_block(row_ids, counts);
  for (const RowPrefill& p : rows) {
    Row& r = rows_[static_cast<size_t>(p.row)];
    const float* last = p.hidden + (static_cast<int64_t>(p.tokens.size()) - 1) * H_;
    r.h_true.assign(last, last + H_);
    r.has_hidden = true;
  }
}

void QwenMtpRows::draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) {
  if (static_cast<int>(rows.size()) != row_count())
    fail("qwen-mtp draft: ", rows.size(), " row inputs for ", row_count(), " rows");
  int max_depth = 0;
  for (size_t b = 0; b < rows.size(); ++b) {
    const Row& r = rows_[b];
    if (!r.has_hidden) fail("qwen-mtp draft: row ", b, " was never prefilled");
    if (r.drafted) fail("qwen-mtp draft: row ", b, " has a draft that was never committed");
    if (rows[b].depth < 0) fail("qwen-mtp draft: row ", b, " depth ", rows[b].depth, " < 0");
    if (rows[b].pending < 0 || rows[b].pending >= V_)
      fail("qwen-mtp draft: pending token ", rows[b].pending, " is out of range [0, ", V_, ")");
    rows[b].sampling.validate();
    max_depth = std::max(max_depth, rows[b].depth);
  }
  out->assign(rows.size(), DraftProposal{});
  for (size_t b = 0; b < rows.size(); ++b) {
    Row& r = rows_[b];
    r.drafted = true;
    r.pending = rows[b].pending;
    r.proposals.clear();
    r.round_start = r.length;
  }
  if (static_cast<int64_t>(chain_.size()) < row_count() * H_)
    chain_.resize(static_cast<size_t>(row_count() * H_));
  if (static_cast<int>(step_logits_.size()) < max_depth) {
    step_logits_.resize(static_cast<size_t>(max_depth));
    step_logits_dev_.resize(static_cast<size_t>(max_depth));
    step_rows_.resize(static_cast<size_t>(max_depth));
  }
  step_logits_on_host_.assign(step_logits_.size(), false);
  for (auto& s : step_rows_) s.clear();
  // Step j: every row still drafting adds MTP row round_start + j from (pending, h_true) at
  // j = 0, else (d_{j-1}, out_{j-1}); one block call and one head call for all of them.
  for (int j = 0; j < max_depth; ++j) {
    std::vector<int>& active = step_rows_[static_cast<size_t>(j)];
    ids_.clear();
    hid_.clear();
    for (size_t b = 0; b < rows.size(); ++b) {
      if (rows[b].depth <= j) continue;
      const Row& r = rows_[b];
      if (j == 0)
        gather(r.pending, r.h_true.data());
      else
        gather(r.proposals.back(), chain_.data() + b * H_);
      active.push_back(static_cast<int>(b));
    }
    const int64_t A = static_cast<int64_t>(active.size());
    run_block(active, std::vector<int64_t>(active.size(), 1));
    Buffer<float>& logits_dev = step_logits_dev_[static_cast<size_t>(j)];
    logits_dev.grow_to(A * V_);
    target_.logits(out_.data(), A, logits_dev.data());
    // Greedy rows that need no distribution take the argmax where the logits are: A ids cross to
    // the host instead of A x V logits.
    bool greedy = true;
    for (int b : active) {
      const RowDraft& in = rows[static_cast<size_t>(b)];
      greedy = greedy && in.sampling.greedy() && !in.want_distribution;
    }
    std::vector<int32_t> picked;
    if (greedy) {
      argmax_dev_.grow_to(A);
      ops::argmax_rows(logits_dev.data(), A, V_, argmax_dev_.data());
      picked.resize(static_cast<size_t>(A));
      ops::copy_to_host(picked.data(), argmax_dev_.data(), sizeof(int32_t) * picked.size());
      for (int64_t a = 0; a < A; ++a)
        if (picked[static_cast<size_t>(a)] < 0)
          fail("qwen-mtp draft: logits of row ", active[static_cast<size_t>(a)],
               " hold NaN or +inf, or only -inf");
    } else {
      copy_step_logits(j);
    }
    const std::vector<float>& logits = step_logits_[static_cast<size_t>(j)];
    out_host_.resize(static_cast<size_t>(A * H_));
    ops::copy_to_host(out_host_.data(), out_.data(), sizeof(float) * out_host_.size());
    for (int64_t a = 0; a < A; ++a) {
      const int b = active[static_cast<size_t>(a)];
      const RowDraft& in = rows[static_cast<size_t>(b)];
      const std::span<const float> l =
          greedy ? std::span<const float>()
                 : std::span<const float>(logits.data() + a * V_, static_cast<size_t>(V_));
      const int32_t d =
          greedy ? picked[static_cast<size_t>(a)]
                 : sample_token(l, in.sampling, in.first_index + static_cast<uint64_t>(j), &dist_);
      rows_[static_cast<size_t>(b)].proposals.push_back(d);
      (*out)[static_cast<size_t>(b)].tokens.push_back(d);
      if (in.want_distribution) {
        (*out)[static_cast<size_t>(b)].q.emplace_back();
        filtered_distribution(l, in.sampling, &(*out)[static_cast<size_t>(b)].q.back());
      }
      std::memcpy(chain_.data() + b * H_, out_host_.data() + a * H_, sizeof(float) * H_);
    }
  }
}

void QwenMtpRows::commit(std::span<const VerifyRow> rows) {
  if (static_cast<int>(rows.size()) != row_count())
    fail("qwen-mtp commit: ", rows.size(), " verify rows for ", row_count(), " rows");
  for (size_t b = 0; b < rows.size(); ++b) {
    const Row& r = rows_[b];
    const VerifyRow& v = rows[b];
    if (!r.drafted) fail("qwen-mtp commit: row ", b, " has no draft to commit");
    const size_t k = r.proposals.size();
    if (v.window.size() != k + 1)
      fail("qwen-mtp commit: row ", b, " window has ", v.window.size(),
           " tokens but the draft proposed ", k, " (expected pending + proposals)");
    if (v.window[0] != r.pending ||
        !std::equal(r.proposals.begin(), r.proposals.end(), v.window.begin() + 1))
      fail("qwen-mtp commit: row ", b, " window is not [pending, proposals] of its last draft");
    if (v.accepted < 0 || static_cast<size_t>(v.accepted) > k)
      fail("qwen-mtp commit: row ", b, " accepted ", v.accepted, " of ", k, " proposals");
    if (v.hidden == nullptr) fail("qwen-mtp commit: row ", b, " has no verify hiddens");
  }
  // Keep the drafted rows of pending + accepted proposals; then append what is still missing:
  // the last proposal's row from the TRUE verify hidden when all were accepted, or the pending
  // token's row when nothing was drafted. Afterwards rows = target processed - 1.
  ids_.clear();
  hid_.clear();
  std::vector<int> row_ids;
  for (size_t b = 0; b < rows.size(); ++b) {
    Row& r = rows_[b];
    const VerifyRow& v = rows[b];
    const int64_t k = static_cast<int64_t>(r.proposals.size());
    const int64_t a = v.accepted;
    if (k == 0) {
      r.length = r.round_start;
      gather(r.pending, r.h_true.data());
      row_ids.push_back(static_cast<int>(b));
    } else {
      r.length = r.round_start + std::min(a + 1, k);
      if (a == k) {
        gather(r.proposals.back(), v.hidden + (k - 1) * H_);
        row_ids.push_back(static_cast<int>(b));
      }
    }
  }
  if (!row_ids.empty()) run_block(row_ids, std::vector<int64_t>(row_ids.size(), 1));
  for (size_t b = 0; b < rows.size(); ++b) {
    Row& r = rows_[b];
    const float* h = rows[b].hidden + static_cast<int64_t>(rows[b].accepted) * H_;
    r.h_true.assign(h, h + H_);
    r.drafted = false;
    r.proposals.clear();
  }
}

CheckpointPtr QwenMtpRows::capture(int row) const {
  if (row < 0 || row >= row_count()) fail("qwen-mtp capture: row ", row, " does not exist");
  const Row& r = rows_[static_cast<size_t>(row)];
  if (!r.has_hidden) fail("qwen-mtp capture: row ", row, " was never prefilled");
  if (r.drafted) fail("qwen-mtp capture: row ", row, " has an uncommitted draft");
  auto c = std::make_shared<Checkpoint>();
  c->processed_tokens = r.base + r.length + 1;
  c->history_from = r.base;
  c->schema = kQwenMtpSchema;
  c->ns = ns_;
  c->metadata = json{{"hidden_size", H_}, {"kv_heads", kv_heads_}, {"head_dim", head_dim_}};
  const int64_t kvf = kv_heads_ * head_dim_;
  CheckpointTensor keys, values;
  keys.shape = values.shape = {r.length, kv_heads_, head_dim_};
  keys.data.resize(static_cast<size_t>(r.length * kvf));
  values.data.resize(static_cast<size_t>(r.length * kvf));
  ops::KVLayerView kv;
  kv.pool = const_cast<float*>(pool_.data());  // read only; fp32 as in kv_view()
  kv.dtype = DType::F32;
  kv.block_size = kBlockSize;
  kv.n_kv_heads = kv_heads_;
  kv.head_dim = head_dim_;
  for (int64_t p = 0; p < r.length; p += kBlockSize) {  // one copy of keys, one of values per block
    const int32_t b = r.blocks[static_cast<size_t>(p / kBlockSize)];
    const size_t bytes = sizeof(float) * kvf * std::min(kBlockSize, r.length - p);
    ops::copy_to_host(keys.data.data() + p * kvf, kv.key(b, 0), bytes);
    ops::copy_to_host(values.data.data() + p * kvf, kv.value(b, 0), bytes);
  }
  c->tensors["kv_keys"] = std::move(keys);
  c->tensors["kv_values"] = std::move(values);
  c->tensors["h_true"] = CheckpointTensor{{H_}, r.h_true};
  return c;
}

void QwenMtpRows::copy_step_logits(int step) const {
  const size_t j = static_cast<size_t>(step);
  if (step_logits_on_host_[j]) return;
  const int64_t n = static_cast<int64_t>(step_rows_[j].size()) * V_;
  if (static_cast<int64_t>(step_logits_[j].size()) < n)
    step_logits_[j].resize(static_cast<size_t>(n));
  ops::copy_to_host(step_logits_[j].data(), step_logits_dev_[j].data(),
                    sizeof(float) * static_cast<size_t>(n));
  step_logits_on_host_[j] = true;
}

std::span<const float> QwenMtpRows::last_draft_logits(int row, int step) const {
  if (step < 0 || step >= static_cast<int>(step_rows_.size()))
    fail("qwen-mtp: the last draft has no step ", step);
  const std::vector<int>& active = step_rows_[static_cast<size_t>(step)];
  const auto it = std::find(active.begin(), active.end(), row);
  if (it == active.end()) fail("qwen-mtp: row ", row, " drafted no proposal at step ", step);
  const int64_t a = it - active.begin();
  copy_step_logits(step);
  return {step_logits_[static_cast<size_t>(step)].data() + a * V_, static_cast<size_t>(V_)};
}

}  // namespace tandem::spec
