#include "tandem/spec/mtp_rows.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "tandem/backend/ops.h"
#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"
#include "tandem/spec/hidden_rows.h"

namespace tandem::spec {

bool MtpRows::fold_completions_default() {
  static const bool on = env_switch_on("TANDEM_MTP_FOLD");
  return on;
}

MtpRows::MtpRows(const TargetView& target, std::string who, std::string schema, std::string ns,
                 HiddenTap tap, int64_t hidden_size, int64_t vocab_size)
    : target_(target),
      H_(hidden_size),
      V_(vocab_size),
      draft_vocab_(vocab_size),
      who_(std::move(who)),
      schema_(std::move(schema)),
      ns_(std::move(ns)),
      tap_(tap) {}

void MtpRows::gather(int32_t id, const float* hidden) {
  ids_.push_back(id);
  hid_.insert(hid_.end(), hidden, hidden + H_);
}

void MtpRows::block_rows(const std::vector<int>& row_ids, const std::vector<int64_t>& counts,
                         const float* embeds, const float* hidden, float* out) {
  std::vector<History*> histories;
  std::vector<int64_t> lengths;
  for (int b : row_ids) {
    Row& r = rows_[static_cast<size_t>(b)];
    histories.push_back(r.history.get());
    lengths.push_back(r.length);
  }
  forward_block(embeds, hidden, histories, lengths, counts, out);
  for (size_t i = 0; i < row_ids.size(); ++i)
    rows_[static_cast<size_t>(row_ids[i])].length += counts[i];
}

void MtpRows::set_draft_vocabulary(int64_t tokens) {
  if (tokens < 0 || tokens > V_)
    fail(who_, ": a draft vocabulary of ", tokens, " tokens; the target has ", V_,
         " (0 for all of them)");
  draft_vocab_ = tokens == 0 ? V_ : tokens;
}

void MtpRows::draft_logits(const float* hidden, int64_t n, float* out) const {
  if (draft_vocab_ == V_)
    target_.logits(hidden, n, out);
  else
    target_.logits_prefix(hidden, n, draft_vocab_, out);
}

void MtpRows::run_block(const std::vector<int>& row_ids, const std::vector<int64_t>& counts) {
  const int64_t T = static_cast<int64_t>(ids_.size());
  TANDEM_CHECK(static_cast<int64_t>(hid_.size()) == T * H_);
  hid_dev_.grow_to(T * H_);
  ops::copy_from_host(hid_dev_.data(), hid_.data(), sizeof(float) * static_cast<size_t>(T * H_));
  run_block_on_device(row_ids, counts);
}

void MtpRows::run_block_on_device(const std::vector<int>& row_ids,
                                  const std::vector<int64_t>& counts) {
  const int64_t T = static_cast<int64_t>(ids_.size());
  emb_.grow_to(T * H_);
  out_.grow_to(T * H_);
  target_.embed(ids_, emb_.data());
  block_rows(row_ids, counts, emb_.data(), hid_dev_.data(), out_.data());
}

std::unique_ptr<PreparedChange> MtpRows::prepare_append(std::span<const CheckpointPtr> from) {
  leave_device_rows();
  const int64_t n = static_cast<int64_t>(from.size());
  // Validate everything first: nothing is allocated for a refused batch.
  std::vector<int64_t> lengths;
  for (const CheckpointPtr& c : from) {
    if (!c) {
      lengths.push_back(0);
      continue;
    }
    check_checkpoint(*c, who_, schema_, ns_, c->processed_tokens);
    if (c->history_from < 0 || c->processed_tokens < c->history_from + 1)
      fail(who_, ": checkpoint covers ", c->processed_tokens, " tokens from token ",
           c->history_from, "; a ", who_, " state needs at least one processed token");
    const auto h = c->tensors.find("h_true");
    if (h == c->tensors.end() || h->second.shape != std::vector<int64_t>{H_} ||
        static_cast<int64_t>(h->second.data.size()) != H_)
      fail(who_, ": checkpoint (", schema_, ") needs an 'h_true' tensor of shape [", H_, "]");
    const int64_t rows = check_history(*c);
    check_checkpoint(*c, who_, schema_, ns_, c->history_from + rows + 1);
    lengths.push_back(rows);
  }
  auto built = std::make_shared<std::vector<Row>>();
  built->reserve(static_cast<size_t>(n));
  try {
    for (int64_t i = 0; i < n; ++i) {
      const CheckpointPtr& c = from[static_cast<size_t>(i)];
      Row row;
      if (c) {
        row.history = restore_history(*c, lengths[static_cast<size_t>(i)]);
        row.length = lengths[static_cast<size_t>(i)];
        row.base = c->history_from;
        row.h_true = c->tensors.at("h_true").data;
        row.has_hidden = true;
      } else {
        row.history = new_history();
      }
      built->push_back(std::move(row));
    }
  } catch (...) {
    for (Row& r : *built) release_history(*r.history);
    throw;
  }
  return stage_appended(std::move(built));
}

std::unique_ptr<PreparedChange> MtpRows::prepare_copy_rows(const DraftRows& from,
                                                           std::span<const int> rows) {
  const auto* source = dynamic_cast<const MtpRows*>(&from);
  // Device-side state of the source (an unflushed completion row, h_true still on the device)
  // is what capture() resolves: such rows take the checkpoint path.
  bool in_place = source != nullptr && source != this && source->ns_ == ns_ &&
                  source->settled_.empty() && !source->h_true_stale_;
  for (int b : rows) {
    if (b < 0 || b >= from.row_count())
      fail(who_, " copy_rows: row ", b, " does not exist (", from.row_count(), " rows)");
    if (in_place) {
      const Row& r = source->rows_[static_cast<size_t>(b)];
      if (!r.has_hidden) fail(who_, " copy_rows: row ", b, " was never prefilled");
      if (r.drafted) fail(who_, " copy_rows: row ", b, " has an uncommitted draft");
      in_place = r.completion_id < 0;
    }
  }
  if (!in_place) return DraftRows::prepare_copy_rows(from, rows);
  std::vector<const History*> histories;
  std::vector<int64_t> lengths;
  for (int b : rows) {
    const Row& r = source->rows_[static_cast<size_t>(b)];
    histories.push_back(r.history.get());
    lengths.push_back(r.length);
  }
  leave_device_rows();
  std::vector<std::unique_ptr<History>> copied = copy_histories(*source, histories, lengths);
  if (copied.empty() && !rows.empty()) return DraftRows::prepare_copy_rows(from, rows);
  TANDEM_CHECK(copied.size() == rows.size(), who_, " copied ", copied.size(), " histories of ",
               rows.size());
  auto built = std::make_shared<std::vector<Row>>();
  built->reserve(rows.size());
  try {
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = source->rows_[static_cast<size_t>(rows[i])];
      Row row;
      row.history = std::move(copied[i]);
      row.length = r.length;
      row.base = r.base;
      row.h_true = r.h_true;
      row.has_hidden = true;
      built->push_back(std::move(row));
    }
  } catch (...) {
    for (Row& r : *built) release_history(*r.history);
    for (auto& h : copied)
      if (h) release_history(*h);
    throw;
  }
  auto change = stage_appended(std::move(built));
  rows_copied_in_place_ += static_cast<int64_t>(rows.size());
  return change;
}

std::unique_ptr<PreparedChange> MtpRows::stage_appended(std::shared_ptr<std::vector<Row>> built) {
  const int64_t n = static_cast<int64_t>(built->size());
  try {
    rows_.reserve(rows_.size() + static_cast<size_t>(outstanding_appends_ + n));
  } catch (...) {
    for (Row& r : *built) release_history(*r.history);
    throw;
  }
  outstanding_appends_ += n;
  // The rows are fully built; commit only moves them in (capacity reserved above, so it cannot
  // throw).
  return std::make_unique<CallbackChange>(
      [this, built, n] {
        for (Row& r : *built) rows_.push_back(std::move(r));
        outstanding_appends_ -= n;
        known_.resize(rows_.size(), 0);
      },
      [this, built, n] {
        for (Row& r : *built) release_history(*r.history);
        outstanding_appends_ -= n;
      });
}

void MtpRows::filter_rows(std::span<const int> keep) {
  leave_device_rows();
  keep_hidden_rows(rows_, keep, outstanding_appends_, who_,
                   [&](Row& r) { release_history(*r.history); });
  known_.assign(rows_.size(), 0);
}

void MtpRows::adopt_prefix(int row, std::span<const int32_t> tokens) {
  leave_device_rows();
  adopt_hidden_row_prefix(rows_, row, tokens, who_);
}

void MtpRows::prefill(std::span<const RowPrefill> rows) {
  leave_device_rows();
  check_hidden_row_prefills(rows_, rows, V_, who_,
                            "the target's " + std::string(hidden_tap_name(tap_)) + " hiddens",
                            true);
  // From backend memory when every row's hiddens are there, else from the host copies.
  bool device = true;
  for (const RowPrefill& p : rows) device = device && p.hidden_device != nullptr;
  for (const RowPrefill& p : rows)
    if (!device && p.hidden == nullptr)
      fail(who_, " prefill: row ", p.row,
           " gives its hiddens in backend memory only, another row on the host only");
  ids_.clear();
  hid_.clear();
  // Device rows: the block's hidden input in order, each piece `rows` hiddens from `from` (host
  // memory for a continuing row's h_true, else the target's backend memory).
  struct Piece {
    const float* from;
    bool host;
    int64_t rows;
  };
  std::vector<Piece> pieces;
  std::vector<int> row_ids;
  std::vector<int64_t> counts;
  for (const RowPrefill& p : rows) {
    Row& r = rows_[static_cast<size_t>(p.row)];
    const int64_t n = static_cast<int64_t>(p.tokens.size());
    if (!prefill_history_ && r.length == 0) {
      r.base = p.processed_before + n - 1;
      continue;
    }
    // A continuing row first pairs its first new token with the hidden before it; then row
    // p.processed_before + j pairs token j + 1 with hidden j.
    const int64_t count = (r.has_hidden ? 1 : 0) + n - 1;
    if (device) {
      if (r.has_hidden) {
        ids_.push_back(p.tokens[0]);
        pieces.push_back({r.h_true.data(), true, 1});
      }
      ids_.insert(ids_.end(), p.tokens.begin() + 1, p.tokens.end());
      if (n > 1) pieces.push_back({p.hidden_device, false, n - 1});
    } else {
      if (r.has_hidden) gather(p.tokens[0], r.h_true.data());
      for (int64_t j = 0; j + 1 < n; ++j)
        gather(p.tokens[static_cast<size_t>(j + 1)], p.hidden + j * H_);
    }
    // An adopted row given a single token has no (token, hidden) pair yet.
    if (count == 0) continue;
    row_ids.push_back(p.row);
    counts.push_back(count);
  }
  // Each row's new h_true, the hidden of its last token.
  const int64_t R = static_cast<int64_t>(rows.size());
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(H_);
  std::vector<const float*> last(rows.size());
  if (device && R > 0) {
    // Gathered and read back before the block is queued: the host then waits for the copies
    // alone, not for the block.
    last_dev_.grow_to(R * H_);
    for (int64_t i = 0; i < R; ++i) {
      const RowPrefill& p = rows[static_cast<size_t>(i)];
      ops::copy(last_dev_.data() + i * H_,
                p.hidden_device + (static_cast<int64_t>(p.tokens.size()) - 1) * H_, row_bytes);
    }
    last_host_.resize(static_cast<size_t>(R * H_));
    ops::copy_to_host(last_host_.data(), last_dev_.data(), row_bytes * static_cast<size_t>(R));
    for (int64_t i = 0; i < R; ++i) last[static_cast<size_t>(i)] = last_host_.data() + i * H_;
  } else {
    for (size_t i = 0; i < rows.size(); ++i)
      last[i] = rows[i].hidden + (static_cast<int64_t>(rows[i].tokens.size()) - 1) * H_;
  }
  if (!row_ids.empty()) {
    if (device) {
      const int64_t T = static_cast<int64_t>(ids_.size());
      hid_dev_.grow_to(T * H_);
      int64_t at = 0;
      for (const Piece& piece : pieces) {
        const size_t bytes = row_bytes * static_cast<size_t>(piece.rows);
        if (piece.host)
          ops::copy_from_host(hid_dev_.data() + at * H_, piece.from, bytes);
        else
          ops::copy(hid_dev_.data() + at * H_, piece.from, bytes);
        at += piece.rows;
      }
      TANDEM_CHECK(at == T, "prefill pieces hold ", at, " hiddens for ", T, " rows");
      run_block_on_device(row_ids, counts);
    } else {
      run_block(row_ids, counts);
    }
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    Row& r = rows_[static_cast<size_t>(rows[i].row)];
    r.h_true.assign(last[i], last[i] + H_);
    r.has_hidden = true;
  }
}

bool MtpRows::draws_on_device(std::span<const RowDraft> rows) {
  for (const RowDraft& in : rows)
    if (in.depth > 0 && in.want_distribution) return false;
  return true;
}

void MtpRows::draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) {
  const int max_depth = begin_draft(rows, out);
  if (draws_on_device(rows)) {
    if (max_depth == 0) return;
    queue_device_chain(rows, max_depth);
    picks_.resize(static_cast<size_t>(max_depth * row_count()));
    ops::copy_to_host(picks_.data(), picks_dev_.data() + row_count(),
                      sizeof(int32_t) * picks_.size());
    return take_picks(picks_.data(), max_depth, out);
  }
  draft_on_host(rows, max_depth, out);
}

bool MtpRows::draft_queued(std::span<const RowDraft> rows, QueuedDraft* queued) {
  if (!chains_share_context() || !draws_on_device(rows)) return false;
  queued_.clear();
  const int max_depth = begin_draft(rows, &queued_);
  queued_depth_ = max_depth;
  const int64_t R = row_count();
  queued->slots.assign(rows.size(), {});
  queued->pending_slots.clear();
  if (max_depth == 0) {
    queued->ids = nullptr;
    return true;
  }
  queue_device_chain(rows, max_depth);
  // picks_dev_: the pending tokens [R], then step j's proposals at (j + 1) · R.
  for (int j = 0; j < max_depth; ++j) {
    const std::vector<int>& active = step_rows_[static_cast<size_t>(j)];
    for (size_t a = 0; a < active.size(); ++a)
      queued->slots[static_cast<size_t>(active[a])].push_back(
          static_cast<int32_t>((j + 1) * R + static_cast<int64_t>(a)));
  }
  if (chain_device_inputs_)
    for (int64_t b = 0; b < R; ++b) queued->pending_slots.push_back(static_cast<int32_t>(b));
  queued->ids = picks_dev_.data();
  picks_reads_[picks_read_].start(picks_dev_.data() + R,
                                  sizeof(int32_t) * static_cast<size_t>(max_depth * R));
  return true;
}

void MtpRows::finish_queued(std::vector<DraftProposal>* out) {
  if (queued_depth_ < 0) fail(who_, " finish_queued: no queued draft is pending");
  const int max_depth = queued_depth_;
  queued_depth_ = -1;
  *out = std::move(queued_);
  queued_.clear();
  if (max_depth == 0) return;
  take_picks(static_cast<const int32_t*>(picks_reads_[picks_read_].wait()), max_depth, out);
}

int MtpRows::begin_draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) {
  if (queued_depth_ >= 0) fail(who_, " draft: the last queued draft was never finished");
  if (static_cast<int>(rows.size()) != row_count())
    fail(who_, " draft: ", rows.size(), " row inputs for ", row_count(), " rows");
  int max_depth = 0;
  for (size_t b = 0; b < rows.size(); ++b) {
    const Row& r = rows_[b];
    if (!r.has_hidden) fail(who_, " draft: row ", b, " was never prefilled");
    if (r.drafted) fail(who_, " draft: row ", b, " has a draft that was never committed");
    if (rows[b].depth < 0) fail(who_, " draft: row ", b, " depth ", rows[b].depth, " < 0");
    if (rows[b].pending < 0 || rows[b].pending >= V_)
      fail(who_, " draft: pending token ", rows[b].pending, " is out of range [0, ", V_, ")");
    rows[b].sampling.validate();
    max_depth = std::max(max_depth, rows[b].depth);
  }
  folding_ = take_completions(rows);
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
  return max_depth;
}

void MtpRows::draft_on_host(std::span<const RowDraft> rows, int max_depth,
                            std::vector<DraftProposal>* out) {
  check_resolved("draft");
  sync_h_true();
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
    logits_dev.grow_to(A * draft_vocab_);
    draft_logits(out_.data(), A, logits_dev.data());
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
      ops::argmax_rows(logits_dev.data(), A, draft_vocab_, argmax_dev_.data());
      picked.resize(static_cast<size_t>(A));
      ops::copy_to_host(picked.data(), argmax_dev_.data(), sizeof(int32_t) * picked.size());
      for (int64_t a = 0; a < A; ++a)
        if (picked[static_cast<size_t>(a)] < 0)
          fail(who_, " draft: logits of row ", active[static_cast<size_t>(a)],
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
                 : std::span<const float>(logits.data() + a * draft_vocab_,
                                          static_cast<size_t>(draft_vocab_));
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

void MtpRows::queue_device_chain(std::span<const RowDraft> rows, int max_depth) {
  const int64_t R = row_count();
  picks_dev_.grow_to((max_depth + 1) * R);
  // Twice the rows: a settled round's completion rows may head step 0.
  for (Buffer<float>& b : chain_dev_) b.grow_to(2 * R * H_);
  emb_.grow_to(2 * R * H_);
  hid_dev_.grow_to(R * H_);
  ids_dev_.grow_to(R);
  for (int j = 0; j < max_depth; ++j) {
    std::vector<int>& active = step_rows_[static_cast<size_t>(j)];
    for (size_t b = 0; b < rows.size(); ++b)
      if (rows[b].depth > j) active.push_back(static_cast<int>(b));
    step_logits_dev_[static_cast<size_t>(j)].grow_to(static_cast<int64_t>(active.size()) *
                                                     draft_vocab_);
  }
  // Step 0's inputs, the drafting rows' pending ids and h_true (where the last commit left them
  // on the host), the draws of sampled rows, and a settling chain's per-row arrays, in one upload.
  const std::vector<int>& first = step_rows_[0];
  const int64_t A0 = static_cast<int64_t>(first.size());
  bool sampled = false;
  for (int b : first) sampled = sampled || !rows[static_cast<size_t>(b)].sampling.greedy();
  const bool settling = can_settle(rows);
  // After a settled round the pending tokens and h_true are where it left them; a chain whose
  // rows do not all draft (no settling) takes the host's, which the engine knows once the rounds
  // are read.
  chain_device_inputs_ = pending_on_device_ && settling;
  const bool host_inputs = !chain_device_inputs_;
  TANDEM_CHECK(!folding_ || (host_inputs && A0 == R), who_, ": folded completion rows need every ",
               "row's step 0 from the host");
  // Folding the last commit's completion rows: they lead step 0 (R of them, then the A0 = R
  // pending rows); a row without one repeats its pending input, parked past its chain.
  const int64_t lead = folding_ ? R : 0;
  const size_t ids_bytes = host_inputs ? sizeof(int32_t) * static_cast<size_t>(lead + A0) : 0;
  const size_t hidden_bytes =
      host_inputs ? sizeof(float) * static_cast<size_t>((lead + A0) * H_) : 0;
  const size_t draws_bytes =
      sampled ? sizeof(ops::SampleRow) * static_cast<size_t>(max_depth * R) : 0;
  const size_t hidden_at = upload_part_bytes(ids_bytes);
  const size_t draws_at = hidden_at + upload_part_bytes(hidden_bytes);
  const size_t slots_at = draws_at + upload_part_bytes(draws_bytes);
  const size_t known_at = slots_at + upload_part_bytes(sizeof(int32_t) * R);
  const size_t settled_at = known_at + upload_part_bytes(sizeof(int64_t) * R);
  const size_t bytes = settling ? settled_at + sizeof(ops::SettledRow) * R : draws_at + draws_bytes;
  uint8_t* staged = chain_in_upload_.host(bytes);
  if (host_inputs) {
    if (h_true_stale_) sync_h_true();
    auto stage = [&](int64_t at, int32_t id, const float* hidden) {
      reinterpret_cast<int32_t*>(staged)[at] = id;
      std::memcpy(staged + hidden_at + sizeof(float) * static_cast<size_t>(at * H_), hidden,
                  sizeof(float) * H_);
    };
    for (int64_t b = 0; b < lead; ++b) {
      Row& r = rows_[static_cast<size_t>(b)];
      if (r.completion_id >= 0)
        stage(b, r.completion_id, r.completion_h.data());
      else
        stage(b, rows[static_cast<size_t>(b)].pending, r.h_true.data());
    }
    for (int64_t a = 0; a < A0; ++a) {
      const int b = first[static_cast<size_t>(a)];
      stage(lead + a, rows[static_cast<size_t>(b)].pending,
            rows_[static_cast<size_t>(b)].h_true.data());
    }
  }
  if (sampled) {
    // Step j's a-th active row draws the token of output index first_index + j (the key the
    // target's sample at that window position uses: coupled draws).
    auto* draws = reinterpret_cast<ops::SampleRow*>(staged + draws_at);
    for (int j = 0; j < max_depth; ++j) {
      const std::vector<int>& active = step_rows_[static_cast<size_t>(j)];
      for (size_t a = 0; a < active.size(); ++a) {
        const RowDraft& in = rows[static_cast<size_t>(active[a])];
        draws[static_cast<size_t>(j * R) + a] =
            ops::sample_row(in.sampling, in.first_index + static_cast<uint64_t>(j));
      }
    }
  }
  if (settling) {
    // Row b is slot b of shift_dev_ (settled rounds never change the rows).
    auto* slots = reinterpret_cast<int32_t*>(staged + slots_at);
    auto* known = reinterpret_cast<int64_t*>(staged + known_at);
    auto* settled = reinterpret_cast<ops::SettledRow*>(staged + settled_at);
    for (int64_t b = 0; b < R; ++b) {
      slots[b] = static_cast<int32_t>(b);
      known[b] = known_[static_cast<size_t>(b)];
      settled[b] = {static_cast<int32_t>(b), static_cast<int32_t>(b)};
    }
  }
  chain_in_dev_.grow_to(static_cast<int64_t>(bytes));
  const StagedUpload::Part inputs{&chain_in_upload_, chain_in_dev_.data(), bytes};
  uint8_t* in = chain_in_dev_.data();
  // Device inputs: the completion rows of the last settled round head step 0 (R of them, then
  // the R pending rows), unless that round was flushed already.
  chain_completion_ = (chain_device_inputs_ && completion_pending_) || folding_;
  const int64_t skip = chain_device_inputs_ && !completion_pending_ ? R : 0;
  const auto* ids0 =
      host_inputs ? reinterpret_cast<const int32_t*>(in) : step0_ids_dev_.data() + skip;
  const auto* hidden0 = host_inputs ? reinterpret_cast<const float*>(in + hidden_at)
                                    : step0_hidden_dev_.data() + skip * H_;
  chain_draws_ = sampled ? reinterpret_cast<ops::SampleRow*>(in + draws_at) : nullptr;
  shift_rows_dev_ = settling ? reinterpret_cast<const int32_t*>(in + slots_at) : nullptr;
  known_dev_ = settling ? reinterpret_cast<const int64_t*>(in + known_at) : nullptr;
  settled_rows_dev_ = settling ? reinterpret_cast<ops::SettledRow*>(in + settled_at) : nullptr;
  // Unresolved rounds: the chain's positions and draws move on by what the host has not counted.
  chain_shifted_ = !settled_.empty();
  reserve_extra_ = folding_ ? 1 : 0;  // a parked completion row, one past the chain
  if (settling) {
    for (const SettledRound& u : settled_) reserve_extra_ += u.depth;
    reserve_extra_ += static_cast<int64_t>(max_depth) + 1;  // settle's completion rows
  }
  if (chain_shifted_ && !settling)
    fail(who_, " draft: ", settled_.size(), " settled round(s) are unresolved");
  if (!draft_chain_graph(rows, max_depth, ids0, hidden0, inputs)) {
    if (chain_shifted_) fail(who_, " draft: a chain after unresolved rounds must run whole");
    chain_in_upload_.start(inputs.dst, inputs.bytes);
    queue_chain(ids0, hidden0, false);
  }
  if (chain_completion_) completion_pending_ = false;  // the chain computed them
  if (folding_) {
    ++folded_chains_;
    for (Row& r : rows_) r.completion_id = -1;
    folding_ = false;
  }
}

void MtpRows::take_picks(const int32_t* picks, int max_depth, std::vector<DraftProposal>* out) {
  const int64_t R = row_count();
  for (int j = 0; j < max_depth; ++j) {
    const std::vector<int>& active = step_rows_[static_cast<size_t>(j)];
    for (size_t a = 0; a < active.size(); ++a) {
      const int32_t d = picks[static_cast<size_t>(j * R) + a];
      // A draw of -1 (NaN logits) embeds as NaN, so every later step of the row fails too.
      if (d < 0) fail(who_, " draft: logits of row ", active[a], " hold NaN or +inf, or only -inf");
      rows_[static_cast<size_t>(active[a])].proposals.push_back(d);
      (*out)[static_cast<size_t>(active[a])].tokens.push_back(d);
    }
  }
}

bool MtpRows::draft_chain_graph(std::span<const RowDraft> rows, int max_depth, const int32_t* ids0,
                                const float* hidden0, const StagedUpload::Part& inputs) {
  std::vector<History*> histories;
  std::vector<int64_t> lengths;
  std::vector<int> depths;
  for (size_t b = 0; b < rows.size(); ++b) {
    histories.push_back(rows_[b].history.get());
    lengths.push_back(rows_[b].length);
    depths.push_back(rows[b].depth);
  }
  StagedUpload::Part tables;
  if (!prepare_chain(histories, lengths, depths, &tables)) return false;
  // One copy kernel for the graph's inputs: the rows' step-0 inputs and the chain's tables.
  if (tables.upload) {
    const StagedUpload::Part both[] = {inputs, tables};
    StagedUpload::start_together(both);
  } else {
    inputs.upload->start(inputs.dst, inputs.bytes);
  }
  // Everything the chain's launches bake in: which rows draft how far, and every address.
  GraphKey key;
  key.add(static_cast<uint64_t>(rows.size())).add(static_cast<uint64_t>(max_depth));
  for (int d : depths) key.add(static_cast<uint64_t>(d));
  key.add(&target_).add(static_cast<uint64_t>(draft_vocab_)).add(ids0).add(hidden0);
  key.add(emb_.data()).add(hid_dev_.data()).add(ids_dev_.data()).add(picks_dev_.data());
  key.add(chain_dev_[0].data()).add(chain_dev_[1].data()).add(chain_draws_);
  key.add(chain_shifted_).add(shift_rows_dev_).add(known_dev_).add(shift_dev_.data());
  key.add(chain_completion_).add(chain_completion_ ? completion_accepted_ : nullptr);
  key.add(static_cast<uint64_t>(chain_completion_ ? completion_depth_ : 0));
  for (int j = 0; j < max_depth; ++j) key.add(step_logits_dev_[static_cast<size_t>(j)].data());
  add_chain_key(key);
  chain_graphs_.run(key, [&] { queue_chain(ids0, hidden0, true); });
  ++whole_chains_;
  for (int j = 0; j < max_depth; ++j)
    for (int b : step_rows_[static_cast<size_t>(j)]) ++rows_[static_cast<size_t>(b)].length;
  return true;
}

void MtpRows::queue_chain(const int32_t* ids, const float* hidden, bool prepared) {
  const int64_t R = row_count();
  int64_t depth = 0;
  for (const std::vector<int>& s : step_rows_) depth += s.empty() ? 0 : 1;
  if (chain_shifted_) {
    // Every row drafts each step (settled rounds): row b is step j's row b. Completion rows are
    // laid out where they belong when their round accepted every proposal, parked past this
    // chain's positions where not.
    ops::PositionShift s;
    s.shift = shift_dev_.data();
    s.row_slot = shift_rows_dev_;
    s.known = known_dev_;
    if (chain_completion_) {
      s.park_tokens = R;
      s.park_unless = completion_accepted_;
      s.park_full = completion_depth_;
      s.park_by = depth + 1;
    }
    shift_chain(s);
    if (chain_draws_)
      for (size_t j = 0; j < step_rows_.size() && !step_rows_[j].empty(); ++j) {
        ops::PositionShift d = s;
        d.rows = R;
        d.sample = chain_draws_ + static_cast<int64_t>(j) * R;
        d.sample_per_token = false;
        ops::shift_positions(d, nullptr, nullptr);
      }
  }
  for (size_t j = 0; j < step_rows_.size(); ++j) {
    const std::vector<int>& active = step_rows_[j];
    const int64_t A = static_cast<int64_t>(active.size());
    if (A == 0) break;
    if (j > 0) {
      // Rows that stop drafting drop out: the others' ids and outputs move up, run by run
      // (the active rows are a subsequence of the last step's).
      const std::vector<int>& prev = step_rows_[j - 1];
      if (static_cast<int64_t>(prev.size()) != A) {
        size_t p = 0;
        for (int64_t a = 0; a < A;) {
          while (prev[p] != active[static_cast<size_t>(a)]) ++p;
          int64_t run = 1;
          while (a + run < A && p + run < prev.size() &&
                 prev[p + run] == active[static_cast<size_t>(a + run)])
            ++run;
          ops::copy(ids_dev_.data() + a, ids + p, sizeof(int32_t) * run);
          ops::copy(hid_dev_.data() + a * H_, hidden + p * H_, sizeof(float) * run * H_);
          a += run;
          p += run;
        }
        ids = ids_dev_.data();
        hidden = hid_dev_.data();
      }
    }
    // Step 0 of a chain after a settled round: that round's completion rows first (no draft).
    const int64_t lead = j == 0 && chain_completion_ ? A : 0;
    float* block_out = chain_dev_[j % 2].data();
    if (!prepared || !chain_step_embedded(static_cast<int>(j), ids, hidden, block_out)) {
      target_.embed_device(ids, lead + A, emb_.data());
      if (prepared)
        chain_step(static_cast<int>(j), emb_.data(), hidden, block_out);
      else
        block_rows(active, std::vector<int64_t>(active.size(), 1), emb_.data(), hidden, block_out);
    }
    const float* drafted = block_out + lead * H_;
    float* logits = step_logits_dev_[j].data();
    draft_logits(drafted, A, logits);
    int32_t* picked = picks_dev_.data() + static_cast<int64_t>(j + 1) * R;
    if (chain_draws_)
      ops::sample_rows(logits, A, draft_vocab_, chain_draws_ + static_cast<int64_t>(j) * R, picked);
    else
      ops::argmax_rows(logits, A, draft_vocab_, picked);
    ids = picked;
    hidden = drafted;
  }
}

void MtpRows::commit(std::span<const VerifyRow> rows) {
  check_resolved("commit");
  if (static_cast<int>(rows.size()) != row_count())
    fail(who_, " commit: ", rows.size(), " verify rows for ", row_count(), " rows");
  sync_h_true();
  for (size_t b = 0; b < rows.size(); ++b) {
    const Row& r = rows_[b];
    const VerifyRow& v = rows[b];
    if (!r.drafted) fail(who_, " commit: row ", b, " has no draft to commit");
    const size_t k = r.proposals.size();
    if (v.window.size() != k + 1)
      fail(who_, " commit: row ", b, " window has ", v.window.size(),
           " tokens but the draft proposed ", k, " (expected pending + proposals)");
    if (v.window[0] != r.pending ||
        !std::equal(r.proposals.begin(), r.proposals.end(), v.window.begin() + 1))
      fail(who_, " commit: row ", b, " window is not [pending, proposals] of its last draft");
    if (v.accepted < 0 || static_cast<size_t>(v.accepted) > k)
      fail(who_, " commit: row ", b, " accepted ", v.accepted, " of ", k, " proposals");
    if (v.hidden == nullptr) fail(who_, " commit: row ", b, " has no verify hiddens");
  }
  // Afterwards rows = target processed - 1, counting each row's completion row (the pending
  // token's, or the last proposal's when all were accepted), which is computed now or, folded,
  // by the next chain (Row::completion_id).
  ids_.clear();
  hid_.clear();
  std::vector<int> row_ids;
  auto complete = [&](size_t b, int32_t id, const float* hidden) {
    Row& r = rows_[b];
    if (fold_completions_) {
      r.completion_id = id;
      r.completion_h.assign(hidden, hidden + H_);
      return;
    }
    gather(id, hidden);
    row_ids.push_back(static_cast<int>(b));
  };
  for (size_t b = 0; b < rows.size(); ++b) {
    Row& r = rows_[b];
    const VerifyRow& v = rows[b];
    const int64_t k = static_cast<int64_t>(r.proposals.size());
    const int64_t a = v.accepted;
    if (k == 0) {
      r.length = r.round_start;
      complete(b, r.pending, r.h_true.data());
    } else {
      r.length = r.round_start + std::min(a + 1, k);
      if (a == k) complete(b, r.proposals.back(), v.hidden + (k - 1) * H_);
    }
    truncate_history(*r.history, r.length);
  }
  if (!row_ids.empty()) run_block(row_ids, std::vector<int64_t>(row_ids.size(), 1));
  for (size_t b = 0; b < rows.size(); ++b) {
    Row& r = rows_[b];
    const float* h = rows[b].hidden + static_cast<int64_t>(rows[b].accepted) * H_;
    r.h_true.assign(h, h + H_);
    r.drafted = false;
    r.proposals.clear();
  }
  pending_on_device_ = false;  // the host holds every row's pending token and h_true again
}

bool MtpRows::can_settle(std::span<const RowDraft> rows) const {
  if (!chains_share_context() || rows.empty() || static_cast<int>(rows.size()) != row_count())
    return false;
  for (const RowDraft& in : rows)
    if (in.depth <= 0 || in.depth != rows[0].depth || in.want_distribution) return false;
  return static_cast<int>(settled_.size()) < kPickReads - 1;
}

void MtpRows::settle(const SettledVerify& v) {
  const int64_t R = row_count();
  if (queued_depth_ < 0) fail(who_, " settle: no queued draft to settle");
  if (settled_rows_dev_ == nullptr || v.depth != queued_depth_ || v.depth <= 0)
    fail(who_, " settle: the queued draft (depth ", queued_depth_,
         ") was not laid out for settling a verify of depth ", v.depth);
  if (v.accepted == nullptr || v.next == nullptr || v.hidden == nullptr)
    fail(who_, " settle: the verify's counts, pending tokens and hiddens are all needed");
  if (completion_pending_)
    fail(who_, " settle: the last settled round's completion rows were never computed");
  const int D = v.depth;
  step0_ids_dev_.grow_to(2 * R);
  step0_hidden_dev_.grow_to(2 * R * H_);
  shift_dev_.grow_to(R);
  known_.resize(static_cast<size_t>(R), 0);
  // The next round's inputs, where it reads them, in one graph on CUDA:
  // - the pending tokens: picks_dev_'s first row for the verify (which already read this round's)
  //   and the second half of the chain's step-0 ids;
  // - h_true: the verify's hidden at the last accepted position of each window of D + 1;
  // - each row's completion row (the last proposal, from the hidden before it: what commit() adds
  //   when all were accepted), which heads the next chain's step 0, or is computed alone once the
  //   round is resolved and no chain took it (flush_completion).
  auto inputs = [&] {
    const size_t id_bytes = sizeof(int32_t) * static_cast<size_t>(R);
    ops::copy(picks_dev_.data(), v.next, id_bytes);
    ops::copy(step0_ids_dev_.data() + R, v.next, id_bytes);
    ops::gather_window_rows(v.hidden, H_, D + 1, 0, v.accepted, R,
                            step0_hidden_dev_.data() + R * H_);
    ops::copy(step0_ids_dev_.data(), picks_dev_.data() + static_cast<int64_t>(D) * R, id_bytes);
    ops::gather_window_rows(v.hidden, H_, D + 1, D - 1, nullptr, R, step0_hidden_dev_.data());
  };
  GraphKey key;
  key.add(uint64_t{0x736574746c65}).add(R).add(static_cast<uint64_t>(D)).add(H_);
  key.add(picks_dev_.data()).add(step0_ids_dev_.data()).add(step0_hidden_dev_.data());
  key.add(v.next).add(v.accepted).add(v.hidden);
  chain_graphs_.run(key, inputs);
  completion_pending_ = true;
  completion_depth_ = D;
  completion_accepted_ = v.accepted;
  ops::settle_windows(v.accepted, settled_rows_dev_, R, shift_dev_.data(), nullptr, 0);
  // The host counts each row's pending row only until resolve adds the accepted ones.
  for (Row& r : rows_) {
    r.length = r.round_start + 1;
    r.drafted = false;
    r.proposals.clear();
  }
  settled_.push_back({D, picks_read_});
  picks_read_ = (picks_read_ + 1) % kPickReads;
  queued_depth_ = -1;
  queued_.clear();
  pending_on_device_ = true;
  h_true_stale_ = true;
}

void MtpRows::settled_proposals(std::vector<DraftProposal>* out) {
  if (settled_.empty()) fail(who_, " settled_proposals: no settled round is unresolved");
  const SettledRound& f = settled_.front();
  const int64_t R = row_count();
  const auto* picks = static_cast<const int32_t*>(picks_reads_[f.read].wait());
  out->assign(static_cast<size_t>(R), DraftProposal{});
  for (int j = 0; j < f.depth; ++j)
    for (int64_t b = 0; b < R; ++b) {
      const int32_t d = picks[static_cast<size_t>(j * R + b)];
      if (d < 0) fail(who_, " draft: logits of row ", b, " hold NaN or +inf, or only -inf");
      (*out)[static_cast<size_t>(b)].tokens.push_back(d);
    }
}

void MtpRows::flush_completion(std::span<const int> accepted) {
  // Rows that accepted every proposal get their completion row at length - 1 (resolved: the
  // host's lengths are exact); the others get it at their next position, which their next draft
  // or commit writes before anything reads it.
  const int64_t R = row_count();
  std::vector<History*> histories;
  std::vector<int64_t> starts;
  for (int64_t b = 0; b < R; ++b) {
    Row& r = rows_[static_cast<size_t>(b)];
    histories.push_back(r.history.get());
    starts.push_back(accepted[static_cast<size_t>(b)] == completion_depth_ ? r.length - 1
                                                                           : r.length);
  }
  emb_.grow_to(R * H_);
  out_.grow_to(R * H_);
  target_.embed_device(step0_ids_dev_.data(), R, emb_.data());
  forward_block(emb_.data(), step0_hidden_dev_.data(), histories, starts,
                std::vector<int64_t>(static_cast<size_t>(R), 1), out_.data());
  completion_pending_ = false;
}

bool MtpRows::owes_completions() const {
  for (const Row& r : rows_)
    if (r.completion_id >= 0) return true;
  return false;
}

void MtpRows::flush_host_completions() {
  if (!owes_completions()) return;
  ids_.clear();
  hid_.clear();
  std::vector<int> row_ids;
  for (size_t b = 0; b < rows_.size(); ++b) {
    Row& r = rows_[b];
    if (r.completion_id < 0) continue;
    gather(r.completion_id, r.completion_h.data());
    row_ids.push_back(static_cast<int>(b));
    r.completion_id = -1;
  }
  if (!row_ids.empty()) run_block(row_ids, std::vector<int64_t>(row_ids.size(), 1));
}

bool MtpRows::take_completions(std::span<const RowDraft> rows) {
  if (!owes_completions()) return false;
  // Step 0 must hold every row and run whole on the device from the host's inputs.
  bool fold = chains_share_context() && draws_on_device(rows) && settled_.empty() &&
              !pending_on_device_ && static_cast<int>(rows.size()) == row_count();
  for (const RowDraft& in : rows) fold = fold && in.depth > 0;
  if (!fold) {
    flush_host_completions();
    return false;
  }
  for (Row& r : rows_)
    if (r.completion_id >= 0) ++r.length;  // the chain's step 0 writes it at length - 1
  return true;
}

void MtpRows::resolve(std::span<const int> accepted) {
  if (settled_.empty()) fail(who_, " resolve: no settled round is unresolved");
  const int D = settled_.front().depth;
  if (static_cast<int>(accepted.size()) != row_count())
    fail(who_, " resolve: ", accepted.size(), " counts for ", row_count(), " rows");
  for (size_t b = 0; b < accepted.size(); ++b)
    if (accepted[b] < 0 || accepted[b] > D)
      fail(who_, " resolve: row ", b, " accepted ", accepted[b], " of ", D, " proposals");
  if (picks_reads_[settled_.front().read].pending()) picks_reads_[settled_.front().read].wait();
  for (size_t b = 0; b < accepted.size(); ++b) {
    rows_[b].length += accepted[b];
    known_[b] += accepted[b];
  }
  settled_.pop_front();
  // Every round is read: the host path may come next, which computes no completion rows.
  if (settled_.empty() && completion_pending_) flush_completion(accepted);
}

void MtpRows::drop_settled() {
  for (Readback& r : picks_reads_)
    if (r.pending()) r.wait();
  settled_.clear();
  queued_depth_ = -1;
  completion_pending_ = false;
}

void MtpRows::check_resolved(const char* what) const {
  if (!settled_.empty())
    fail(who_, " ", what, ": ", settled_.size(), " round(s) settled on the device are unresolved");
}

void MtpRows::sync_h_true() {
  if (!h_true_stale_) return;
  check_resolved("h_true");
  const int64_t R = row_count();
  std::vector<float> h(static_cast<size_t>(R * H_));
  ops::copy_to_host(h.data(), step0_hidden_dev_.data() + R * H_, sizeof(float) * h.size());
  for (int64_t b = 0; b < R; ++b)
    rows_[static_cast<size_t>(b)].h_true.assign(h.begin() + b * H_, h.begin() + (b + 1) * H_);
  h_true_stale_ = false;
}

void MtpRows::leave_device_rows() {
  check_resolved("changing rows");
  flush_host_completions();
  sync_h_true();
  pending_on_device_ = false;
  // Every round resolved: the device's shifts equal the host's counts; both start again at 0.
  if (!shift_dev_.empty()) shift_dev_.zero();
  known_.assign(known_.size(), 0);
}

CheckpointPtr MtpRows::capture(int row) const {
  if (row < 0 || row >= row_count()) fail(who_, " capture: row ", row, " does not exist");
  const Row& r = rows_[static_cast<size_t>(row)];
  if (!r.has_hidden) fail(who_, " capture: row ", row, " was never prefilled");
  if (r.drafted) fail(who_, " capture: row ", row, " has an uncommitted draft");
  check_resolved("capture");
  // A completion row the last commit left to the next chain belongs to this state: computing it
  // now changes no value the rows would hold (logically const).
  const_cast<MtpRows*>(this)->flush_host_completions();
  std::vector<float> h_true = r.h_true;
  if (h_true_stale_)
    ops::copy_to_host(h_true.data(),
                      step0_hidden_dev_.data() + (row_count() + static_cast<int64_t>(row)) * H_,
                      sizeof(float) * static_cast<size_t>(H_));
  auto c = std::make_shared<Checkpoint>();
  c->processed_tokens = r.base + r.length + 1;
  c->history_from = r.base;
  c->schema = schema_;
  c->ns = ns_;
  save_history(*r.history, r.length, *c);
  c->tensors["h_true"] = CheckpointTensor{{H_}, std::move(h_true)};
  return c;
}

void MtpRows::copy_step_logits(int step) const {
  const size_t j = static_cast<size_t>(step);
  if (step_logits_on_host_[j]) return;
  const int64_t n = static_cast<int64_t>(step_rows_[j].size()) * draft_vocab_;
  if (static_cast<int64_t>(step_logits_[j].size()) < n)
    step_logits_[j].resize(static_cast<size_t>(n));
  ops::copy_to_host(step_logits_[j].data(), step_logits_dev_[j].data(),
                    sizeof(float) * static_cast<size_t>(n));
  step_logits_on_host_[j] = true;
}

std::span<const float> MtpRows::last_draft_logits(int row, int step) const {
  if (step < 0 || step >= static_cast<int>(step_rows_.size()))
    fail(who_, ": the last draft has no step ", step);
  const std::vector<int>& active = step_rows_[static_cast<size_t>(step)];
  const auto it = std::find(active.begin(), active.end(), row);
  if (it == active.end()) fail(who_, ": row ", row, " drafted no proposal at step ", step);
  const int64_t a = it - active.begin();
  copy_step_logits(step);
  return {step_logits_[static_cast<size_t>(step)].data() + a * draft_vocab_,
          static_cast<size_t>(draft_vocab_)};
}

}  // namespace tandem::spec
