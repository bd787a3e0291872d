#include "tandem/spec/eagle3.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

#include "tandem/core/error.h"
#include "tandem/io/artifact_identity.h"
#include "tandem/io/json_file.h"
#include "tandem/spec/hidden_rows.h"

namespace tandem::spec {

// ---------------------------------------------------------------------------------------------
// Provider

std::unique_ptr<Eagle3Provider> Eagle3Provider::open(const std::string& dir) {
  std::unique_ptr<Eagle3Provider> p(new Eagle3Provider());
  p->source_ = dir;
  Eagle3Weights w = load_eagle3_head(dir);
  const std::vector<std::string> files = w.store.files();
  p->block_ = std::make_shared<Eagle3Block>(std::move(w));
  // config.json whole: the tap list and the draft vocabulary shape what a state means, and
  // config_fingerprint keeps only the fields a target's graph depends on.
  const nlohmann::json config =
      read_json_file((std::filesystem::path(dir) / "config.json").string());
  p->ns_ = std::string(kEagle3Schema) + ":" +
           artifact_identity(config_fingerprint(config) + "|eagle3:" + config.dump(), files);
  return p;
}

std::vector<int> Eagle3Provider::tap_layers(const TargetView& target) const {
  const Eagle3Config& c = block_->config();
  return c.tap_layers.empty() ? eagle3_default_tap_layers(target.layer_count()) : c.tap_layers;
}

std::unique_ptr<DraftRows> Eagle3Provider::open_rows(const TargetView& target) const {
  const Eagle3Config& c = block_->config();
  const std::string who = "eagle3 drafter " + source_;
  if (target.vocab_size() != c.vocab_size)
    fail(who, ": vocabulary size ", c.vocab_size, " does not match the target's ",
         target.vocab_size(), " (d2t maps draft ids to target ids; was it trained for another ",
         "model?)");
  if (target.hidden_size() != c.target_hidden_size)
    fail(who, ": target_hidden_size ", c.target_hidden_size, " (the width of one tap) does not ",
         "match the target's hidden size ", target.hidden_size());
  if (!block_->weights().has_embedding() && target.hidden_size() != c.hidden_size)
    fail(who, ": hidden size ", c.hidden_size, " differs from the target's ", target.hidden_size(),
         " and the head has no embed_tokens of its own (it would embed ",
         "through the target's table)");
  const std::vector<int> layers = tap_layers(target);
  if (c.tap_layers.empty() && target.layer_count() < 4)
    fail(who, ": config.json names no eagle_aux_hidden_state_layer_ids and the default [2, L/2, ",
         "L-3] needs a target of at least 4 layers (it has ", target.layer_count(), ")");
  check_target_taps(target, {std::nullopt, layers}, who);
  return std::make_unique<Eagle3Rows>(block_, target, ns_, layers);
}

// ---------------------------------------------------------------------------------------------
// Rows

Eagle3Rows::Eagle3Rows(std::shared_ptr<const Eagle3Block> block, const TargetView& target,
                       std::string ns, std::vector<int> tap_layers)
    : block_(std::move(block)),
      target_(target),
      ns_(std::move(ns)),
      tap_layers_(std::move(tap_layers)),
      kv_(block_->config().num_key_value_heads, block_->config().head_dim) {
  const Eagle3Config& c = block_->config();
  H_ = c.hidden_size;
  V_ = c.vocab_size;
  Vd_ = c.draft_vocab_size;
  W_ = static_cast<int64_t>(tap_layers_.size()) * c.target_hidden_size;
  const std::vector<int32_t>& d2t = block_->weights().draft_to_target;
  d2t_increasing_ = std::adjacent_find(d2t.begin(), d2t.end(),
                                       [](int32_t a, int32_t b) { return a >= b; }) == d2t.end();
}

void Eagle3Rows::embed(int64_t T) {
  emb_.grow_to(T * H_);
  if (!block_->weights().has_embedding()) {
    target_.embed(ids_, emb_.data());
    return;
  }
  ids_dev_.grow_to(T);
  ops::copy_from_host(ids_dev_.data(), ids_.data(), sizeof(int32_t) * ids_.size());
  block_->embed(ids_dev_.data(), T, emb_.data());
}

void Eagle3Rows::run_block(const std::vector<int>& row_ids, const std::vector<int64_t>& counts) {
  const int64_t T = static_cast<int64_t>(ids_.size());
  std::vector<const std::vector<int32_t>*> tables;
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < row_ids.size(); ++i) {
    Row& r = rows_[static_cast<size_t>(row_ids[i])];
    kv_.reserve(r.blocks, r.length + counts[i]);
    tables.push_back(&r.blocks);
    lengths.push_back(r.length);
  }
  const std::vector<AttentionSegment> segs = kv_.segments(tables, lengths, counts);
  embed(T);
  out_.grow_to(T * H_);
  block_->forward(emb_.data(), hid_.data(), segs, kv_.view(), ws_, out_.data());
  for (size_t i = 0; i < row_ids.size(); ++i)
    rows_[static_cast<size_t>(row_ids[i])].length += counts[i];
}

void Eagle3Rows::project(std::span<const std::pair<const float*, int64_t>> taps, int64_t total) {
  taps_dev_.grow_to(total * W_);
  proj_.grow_to(total * H_);
  int64_t t = 0;
  for (const auto& [rows, n] : taps) {
    ops::copy_from_host(taps_dev_.data() + t * W_, rows,
                        sizeof(float) * static_cast<size_t>(n * W_));
    t += n;
  }
  block_->project(taps_dev_.data(), total, proj_.data());
}

std::unique_ptr<PreparedChange> Eagle3Rows::prepare_append(std::span<const CheckpointPtr> from) {
  const int64_t n = static_cast<int64_t>(from.size());
  // Validate everything first: nothing is allocated for a refused batch.
  std::vector<int64_t> lengths;
  for (const CheckpointPtr& c : from) {
    if (!c) {
      lengths.push_back(0);
      continue;
    }
    check_checkpoint(*c, "eagle3", kEagle3Schema, ns_, c->processed_tokens);
    if (c->history_from < 0 || c->processed_tokens < c->history_from + 1)
      fail("eagle3: checkpoint covers ", c->processed_tokens, " tokens from token ",
           c->history_from, "; an eagle3 state needs at least one processed token");
    checkpoint_tensor(*c, "eagle3", "g_true", {H_});
    const int64_t rows = kv_.checkpoint_rows(*c, "eagle3");
    check_checkpoint(*c, "eagle3", kEagle3Schema, ns_, c->history_from + rows + 1);
    lengths.push_back(rows);
  }
  auto built = std::make_shared<std::vector<Row>>();
  built->reserve(static_cast<size_t>(n));
  try {
    for (int64_t i = 0; i < n; ++i) {
      const CheckpointPtr& c = from[static_cast<size_t>(i)];
      Row row;
      if (c) {
        const int64_t length = lengths[static_cast<size_t>(i)];
        row.blocks = kv_.restore(*c, length);
        row.length = length;
        row.base = c->history_from;
        row.g_true = c->tensors.at("g_true").data;
        row.has_hidden = true;
      }
      built->push_back(std::move(row));
    }
    rows_.reserve(rows_.size() + static_cast<size_t>(outstanding_appends_ + n));
  } catch (...) {
    for (Row& r : *built) release(r);
    throw;
  }
  outstanding_appends_ += n;
  // The rows are fully built; commit only moves them in (capacity reserved above, so it cannot
  // throw).
  return std::make_unique<CallbackChange>(
      [this, built, n] {
        for (Row& r : *built) rows_.push_back(std::move(r));
        outstanding_appends_ -= n;
      },
      [this, built, n] {
        for (Row& r : *built) release(r);
        outstanding_appends_ -= n;
      });
}

void Eagle3Rows::filter_rows(std::span<const int> keep) {
  keep_hidden_rows(rows_, keep, outstanding_appends_, "eagle3", [&](Row& r) { release(r); });
}

void Eagle3Rows::adopt_prefix(int row, std::span<const int32_t> tokens) {
  adopt_hidden_row_prefix(rows_, row, tokens, "eagle3");
}

void Eagle3Rows::prefill(std::span<const RowPrefill> rows) {
  check_hidden_row_prefills(rows_, rows, V_, "eagle3", "the target's taps at " + taps().describe());
  int64_t total = 0;
  for (const RowPrefill& p : rows) total += static_cast<int64_t>(p.tokens.size());
  // Every position's g = fc(taps) in one product.
  std::vector<std::pair<const float*, int64_t>> taps;
  for (const RowPrefill& p : rows)
    taps.emplace_back(p.hidden, static_cast<int64_t>(p.tokens.size()));
  project(taps, total);
  // Pairs: a continuing row's (tokens[0], g_true), then (tokens[p + 1], g_p) for p < n - 1.
  ids_.clear();
  hid_.grow_to(total * H_);
  std::vector<int> row_ids;
  std::vector<int64_t> counts;
  int64_t t = 0, off = 0;
  for (const RowPrefill& p : rows) {
    const Row& r = rows_[static_cast<size_t>(p.row)];
    const int64_t n = static_cast<int64_t>(p.tokens.size());
    int64_t count = 0;
    if (r.has_hidden) {
      ids_.push_back(p.tokens[0]);
      ops::copy_from_host(hid_.data() + t * H_, r.g_true.data(), sizeof(float) * H_);
      ++count;
    }
    ids_.insert(ids_.end(), p.tokens.begin() + 1, p.tokens.end());
    ops::copy(hid_.data() + (t + count) * H_, proj_.data() + off * H_,
              sizeof(float) * static_cast<size_t>((n - 1) * H_));
    count += n - 1;
    off += n;
    t += count;
    // An adopted row given a single token has no pair yet.
    if (count == 0) continue;
    row_ids.push_back(p.row);
    counts.push_back(count);
  }
  if (!row_ids.empty()) run_block(row_ids, counts);
  off = 0;
  for (const RowPrefill& p : rows) {
    Row& r = rows_[static_cast<size_t>(p.row)];
    off += static_cast<int64_t>(p.tokens.size());
    r.g_true.resize(static_cast<size_t>(H_));
    ops::copy_to_host(r.g_true.data(), proj_.data() + (off - 1) * H_, sizeof(float) * H_);
    r.has_hidden = true;
  }
}

void Eagle3Rows::draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) {
  if (static_cast<int>(rows.size()) != row_count())
    fail("eagle3 draft: ", rows.size(), " row inputs for ", row_count(), " rows");
  int max_depth = 0;
  for (size_t b = 0; b < rows.size(); ++b) {
    const Row& r = rows_[b];
    if (!r.has_hidden) fail("eagle3 draft: row ", b, " was never prefilled");
    if (r.drafted) fail("eagle3 draft: row ", b, " has a draft that was never committed");
    if (rows[b].depth < 0) fail("eagle3 draft: row ", b, " depth ", rows[b].depth, " < 0");
    if (rows[b].pending < 0 || rows[b].pending >= V_)
      fail("eagle3 draft: pending token ", rows[b].pending, " is out of range [0, ", V_, ")");
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
  if (static_cast<int>(step_rows_.size()) < max_depth) {
    step_rows_.resize(static_cast<size_t>(max_depth));
    step_logits_.resize(static_cast<size_t>(max_depth));
    step_out_.resize(static_cast<size_t>(max_depth));
  }
  for (auto& s : step_rows_) s.clear();
  const std::vector<int32_t>& d2t = block_->weights().draft_to_target;
  std::vector<float> logits_host;
  // Step j: every row still drafting adds row round_start + j from (pending, g_true) at j = 0,
  // else (d_{j-1}, out_{j-1}); one block call and one head call for all of them. The chain's
  // hiddens stay in backend memory.
  for (int j = 0; j < max_depth; ++j) {
    std::vector<int>& active = step_rows_[static_cast<size_t>(j)];
    for (size_t b = 0; b < rows.size(); ++b)
      if (rows[b].depth > j) active.push_back(static_cast<int>(b));
    const int64_t A = static_cast<int64_t>(active.size());
    ids_.clear();
    hid_.grow_to(A * H_);
    for (int64_t a = 0; a < A; ++a) {
      const int b = active[static_cast<size_t>(a)];
      const Row& r = rows_[static_cast<size_t>(b)];
      if (j == 0) {
        ids_.push_back(r.pending);
        ops::copy_from_host(hid_.data() + a * H_, r.g_true.data(), sizeof(float) * H_);
        continue;
      }
      // Active rows of step j are active at j - 1 too, in the same order.
      const std::vector<int>& prev = step_rows_[static_cast<size_t>(j - 1)];
      const int64_t pa = std::find(prev.begin(), prev.end(), b) - prev.begin();
      ids_.push_back(r.proposals.back());
      ops::copy(hid_.data() + a * H_, step_out_[static_cast<size_t>(j - 1)].data() + pa * H_,
                sizeof(float) * H_);
    }
    run_block(active, std::vector<int64_t>(active.size(), 1));
    Buffer<float>& step_out = step_out_[static_cast<size_t>(j)];
    step_out.grow_to(A * H_);
    ops::copy(step_out.data(), out_.data(), sizeof(float) * static_cast<size_t>(A * H_));
    Buffer<float>& logits = step_logits_[static_cast<size_t>(j)];
    logits.grow_to(A * Vd_);
    block_->logits(out_.data(), A, ws_, logits.data());
    // Rows that need no distribution draw where the logits are (the argmax, or ops::sample_rows
    // where the map keeps id order): A ids cross to the host instead of A x Vd logits.
    bool greedy = true, on_device = true;
    for (int b : active) {
      const RowDraft& in = rows[static_cast<size_t>(b)];
      greedy = greedy && in.sampling.greedy() && !in.want_distribution;
      on_device = on_device && !in.want_distribution && (in.sampling.greedy() || d2t_increasing_);
    }
    std::vector<int32_t> picked(static_cast<size_t>(A));
    if (on_device) {
      argmax_dev_.grow_to(A);
      if (greedy) {
        ops::argmax_rows(logits.data(), A, Vd_, argmax_dev_.data());
      } else {
        draws_.clear();
        for (int b : active) {
          const RowDraft& in = rows[static_cast<size_t>(b)];
          draws_.push_back(ops::sample_row(in.sampling, in.first_index + static_cast<uint64_t>(j)));
        }
        draws_dev_.grow_to(A);
        ops::copy_from_host(draws_dev_.data(), draws_.data(),
                            sizeof(ops::SampleRow) * draws_.size());
        ops::sample_rows(logits.data(), A, Vd_, draws_dev_.data(), argmax_dev_.data());
      }
      ops::copy_to_host(picked.data(), argmax_dev_.data(), sizeof(int32_t) * picked.size());
    } else {
      logits_host.resize(static_cast<size_t>(A * Vd_));
      ops::copy_to_host(logits_host.data(), logits.data(), sizeof(float) * logits_host.size());
    }
    for (int64_t a = 0; a < A; ++a) {
      const int b = active[static_cast<size_t>(a)];
      const RowDraft& in = rows[static_cast<size_t>(b)];
      int32_t d = 0;
      if (on_device) {
        if (picked[static_cast<size_t>(a)] < 0)
          fail("eagle3 draft: logits of row ", b, " hold NaN or +inf, or only -inf");
        d = d2t[static_cast<size_t>(picked[static_cast<size_t>(a)])];
      } else {
        // The draft distribution over target ids: ids outside the draft vocabulary get -inf,
        // so the sampler's filters and keyed draw see the head's distribution mapped by d2t.
        full_.assign(static_cast<size_t>(V_), -std::numeric_limits<float>::infinity());
        for (int64_t v = 0; v < Vd_; ++v)
          full_[static_cast<size_t>(d2t[static_cast<size_t>(v)])] =
              logits_host[static_cast<size_t>(a * Vd_ + v)];
        d = sample_token(full_, in.sampling, in.first_index + static_cast<uint64_t>(j), &dist_);
        if (in.want_distribution) {
          (*out)[static_cast<size_t>(b)].q.emplace_back();
          filtered_distribution(full_, in.sampling, &(*out)[static_cast<size_t>(b)].q.back());
        }
      }
      rows_[static_cast<size_t>(b)].proposals.push_back(d);
      (*out)[static_cast<size_t>(b)].tokens.push_back(d);
    }
  }
}

void Eagle3Rows::commit(std::span<const VerifyRow> rows) {
  if (static_cast<int>(rows.size()) != row_count())
    fail("eagle3 commit: ", rows.size(), " verify rows for ", row_count(), " rows");
  for (size_t b = 0; b < rows.size(); ++b) {
    const Row& r = rows_[b];
    const VerifyRow& v = rows[b];
    if (!r.drafted) fail("eagle3 commit: row ", b, " has no draft to commit");
    const size_t k = r.proposals.size();
    if (v.window.size() != k + 1)
      fail("eagle3 commit: row ", b, " window has ", v.window.size(),
           " tokens but the draft proposed ", k, " (expected pending + proposals)");
    if (v.window[0] != r.pending ||
        !std::equal(r.proposals.begin(), r.proposals.end(), v.window.begin() + 1))
      fail("eagle3 commit: row ", b, " window is not [pending, proposals] of its last draft");
    if (v.accepted < 0 || static_cast<size_t>(v.accepted) > k)
      fail("eagle3 commit: row ", b, " accepted ", v.accepted, " of ", k, " proposals");
    if (v.hidden == nullptr) fail("eagle3 commit: row ", b, " has no verify taps");
  }
  // g of window positions 0..a of every row, in one product.
  int64_t total = 0;
  for (const VerifyRow& v : rows) total += v.accepted + 1;
  std::vector<std::pair<const float*, int64_t>> taps;
  for (const VerifyRow& v : rows) taps.emplace_back(v.hidden, v.accepted + 1);
  project(taps, total);
  // Keep row P when the chain built it (from the true taps); drop the chain's later rows. Then
  // depth 0: row P from (pending, g_true); and rows P + 1 + j from (window[j + 1], g_j), j < a.
  ids_.clear();
  hid_.grow_to(total * H_);
  std::vector<int> row_ids;
  std::vector<int64_t> counts;
  int64_t t = 0, off = 0;
  for (size_t b = 0; b < rows.size(); ++b) {
    Row& r = rows_[b];
    const VerifyRow& v = rows[b];
    const int64_t a = v.accepted;
    int64_t count = 0;
    if (r.proposals.empty()) {
      r.length = r.round_start;
      ids_.push_back(r.pending);
      ops::copy_from_host(hid_.data() + t * H_, r.g_true.data(), sizeof(float) * H_);
      ++count;
    } else {
      r.length = r.round_start + 1;
    }
    ids_.insert(ids_.end(), v.window.begin() + 1, v.window.begin() + 1 + a);
    ops::copy(hid_.data() + (t + count) * H_, proj_.data() + off * H_,
              sizeof(float) * static_cast<size_t>(a * H_));
    count += a;
    t += count;
    off += a + 1;
    if (count == 0) continue;
    row_ids.push_back(static_cast<int>(b));
    counts.push_back(count);
  }
  if (!row_ids.empty()) run_block(row_ids, counts);
  off = 0;
  for (size_t b = 0; b < rows.size(); ++b) {
    Row& r = rows_[b];
    off += rows[b].accepted + 1;
    ops::copy_to_host(r.g_true.data(), proj_.data() + (off - 1) * H_, sizeof(float) * H_);
    r.drafted = false;
    r.proposals.clear();
  }
}

CheckpointPtr Eagle3Rows::capture(int row) const {
  if (row < 0 || row >= row_count()) fail("eagle3 capture: row ", row, " does not exist");
  const Row& r = rows_[static_cast<size_t>(row)];
  if (!r.has_hidden) fail("eagle3 capture: row ", row, " was never prefilled");
  if (r.drafted) fail("eagle3 capture: row ", row, " has an uncommitted draft");
  auto c = std::make_shared<Checkpoint>();
  c->processed_tokens = r.base + r.length + 1;
  c->history_from = r.base;
  c->schema = kEagle3Schema;
  c->ns = ns_;
  c->metadata = nlohmann::json{
      {"hidden_size", H_}, {"kv_heads", kv_.kv_heads()}, {"head_dim", kv_.head_dim()}};
  kv_.save(r.blocks, r.length, *c);
  c->tensors["g_true"] = CheckpointTensor{{H_}, r.g_true};
  return c;
}

int64_t Eagle3Rows::step_row(int row, int step) const {
  if (step < 0 || step >= static_cast<int>(step_rows_.size()))
    fail("eagle3: the last draft has no step ", step);
  const std::vector<int>& active = step_rows_[static_cast<size_t>(step)];
  const auto it = std::find(active.begin(), active.end(), row);
  if (it == active.end()) fail("eagle3: row ", row, " drafted no proposal at step ", step);
  return it - active.begin();
}

std::vector<float> Eagle3Rows::last_draft_logits(int row, int step) const {
  const int64_t a = step_row(row, step);
  std::vector<float> l(static_cast<size_t>(Vd_));
  ops::copy_to_host(l.data(), step_logits_[static_cast<size_t>(step)].data() + a * Vd_,
                    sizeof(float) * l.size());
  return l;
}

std::vector<float> Eagle3Rows::last_draft_hidden(int row, int step) const {
  const int64_t a = step_row(row, step);
  std::vector<float> h(static_cast<size_t>(H_));
  ops::copy_to_host(h.data(), step_out_[static_cast<size_t>(step)].data() + a * H_,
                    sizeof(float) * h.size());
  return h;
}

}  // namespace tandem::spec
