// Draft rounds of an MTP drafter, as the engine runs them, for comparing two ways of running the
// same drafter bit for bit (whole chains against step by step, graphs on and off, draws on the
// device against draws on the host).
#pragma once

#include <cmath>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/spec/mtp_rows.h"

namespace tandem::test {

// n rows of H made-up hidden values (a sine of the index), different for each salt.
inline std::vector<float> synthetic_hiddens(int64_t H, size_t n, int salt) {
  std::vector<float> h(n * static_cast<size_t>(H));
  for (size_t i = 0; i < h.size(); ++i)
    h[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(salt));
  return h;
}

// The drafter's rows for `prompts`, opened cold and prefilled with synthetic hiddens (only
// determinism is compared).
inline std::unique_ptr<spec::DraftRows> open_prefilled(
    const spec::DraftProvider& drafter, const spec::TargetView& target,
    const std::vector<std::vector<int32_t>>& prompts) {
  const int R = static_cast<int>(prompts.size());
  std::unique_ptr<spec::DraftRows> rows = drafter.open_rows(target);
  const std::vector<spec::CheckpointPtr> cold(static_cast<size_t>(R));
  rows->prepare_append(cold)->commit();
  std::vector<std::vector<float>> prompt_hidden;
  std::vector<spec::RowPrefill> pre;
  for (int r = 0; r < R; ++r)
    prompt_hidden.push_back(synthetic_hiddens(target.hidden_size(), prompts[r].size(), r));
  for (int r = 0; r < R; ++r) pre.push_back({r, prompts[r], prompt_hidden[r].data(), 0});
  rows->prefill(pre);
  return rows;
}

// Opens rows for `prompts` (prefilled with synthetic hiddens: only determinism is compared),
// then runs `rounds` rounds in which the rows draft different depths (some stop early, so later
// steps run fewer rows) and accept none, some or all of their proposals. Rows draft with
// `sampling` (row r's seed is sampling.seed + r; greedy by default) and ask for their
// distributions when `want_distribution` (which keeps the draws on the host). Returns every
// proposal, then the bits of every draft step's logits. *whole_chains: the chains MtpRows ran
// whole; *folded_chains: those whose first step also added the last commit's completion rows.
inline std::vector<int32_t> mtp_rounds(const spec::DraftProvider& drafter,
                                       const spec::TargetView& target,
                                       const std::vector<std::vector<int32_t>>& prompts, int rounds,
                                       int64_t* whole_chains = nullptr,
                                       const SamplingParams& sampling = {},
                                       bool want_distribution = false,
                                       int64_t* folded_chains = nullptr) {
  const int64_t H = target.hidden_size(), V = target.vocab_size();
  const int R = static_cast<int>(prompts.size());
  auto hiddens = [&](size_t n, int salt) { return synthetic_hiddens(H, n, salt); };
  std::unique_ptr<spec::DraftRows> rows = open_prefilled(drafter, target, prompts);
  const auto& mtp = dynamic_cast<const spec::MtpRows&>(*rows);
  std::vector<int32_t> trace;
  std::vector<float> logits;
  std::vector<int32_t> pending(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) pending[r] = static_cast<int32_t>((5 + 4 * r) % V);
  for (int round = 0; round < rounds; ++round) {
    std::vector<spec::RowDraft> in(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
      in[r].pending = pending[r];
      in[r].depth = (round + r) % 4 == 3 ? 1 : 3;
      in[r].sampling = sampling;
      in[r].sampling.seed = sampling.seed + static_cast<uint64_t>(r);
      in[r].first_index = static_cast<uint64_t>(4 * round + r);
      in[r].want_distribution = want_distribution;
    }
    std::vector<spec::DraftProposal> out;
    rows->draft(in, &out);
    std::vector<std::vector<int32_t>> windows(static_cast<size_t>(R));
    std::vector<std::vector<float>> verify_hidden(static_cast<size_t>(R));
    std::vector<spec::VerifyRow> verified(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
      trace.insert(trace.end(), out[r].tokens.begin(), out[r].tokens.end());
      for (int j = 0; j < static_cast<int>(out[r].tokens.size()); ++j) {
        const auto l = mtp.last_draft_logits(r, j);
        logits.insert(logits.end(), l.begin(), l.end());
      }
      windows[r] = {pending[r]};
      windows[r].insert(windows[r].end(), out[r].tokens.begin(), out[r].tokens.end());
      verify_hidden[r] = hiddens(windows[r].size(), 10 * round + r);
      const int k = static_cast<int>(out[r].tokens.size());
      const int accepted = (round + 2 * r) % (k + 1);
      pending[r] = static_cast<int32_t>((pending[r] * 7 + round + 1) % V);
      verified[r] = {windows[r], verify_hidden[r].data(), accepted, pending[r]};
    }
    rows->commit(verified);
  }
  const auto* bits = reinterpret_cast<const int32_t*>(logits.data());
  trace.insert(trace.end(), bits, bits + logits.size());
  if (whole_chains) *whole_chains = mtp.whole_chains();
  if (folded_chains) *folded_chains = mtp.folded_chains();
  return trace;
}

// Rounds in which every row drafts depths[round] proposals and the verify's outcome is made up
// (each row's accepted count, next pending token and window hiddens), committed on the host
// (lag 0: draft + commit) or settled on the device (DraftRows::settle) and resolved once `lag`
// rounds are settled after it (lag 1: at once; 2: as the engine does, after the next round is
// queued). Returns every round's proposals, then each row's checkpoint after the last round
// (processed tokens, h_true and KV bits): the same for every lag, bit for bit.
inline std::vector<int32_t> settled_mtp_rounds(const spec::DraftProvider& drafter,
                                               const spec::TargetView& target,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               const std::vector<int>& depths, int lag,
                                               const SamplingParams& sampling = {}) {
  const int64_t H = target.hidden_size(), V = target.vocab_size();
  const int R = static_cast<int>(prompts.size());
  auto hiddens = [&](size_t n, int salt) { return synthetic_hiddens(H, n, salt); };
  std::unique_ptr<spec::DraftRows> rows = open_prefilled(drafter, target, prompts);
  // Per round: its depth, made-up outcome and (settled) the backend copies the device reads.
  struct Round {
    int depth = 0;
    std::vector<int> accepted;
    std::vector<int32_t> next;
    std::vector<float> hidden;  // [R · (depth + 1), H]
    Buffer<int32_t> accepted_dev, next_dev;
    Buffer<float> hidden_dev;
  };
  std::deque<Round> unread;
  std::vector<int32_t> trace, pending(static_cast<size_t>(R));
  std::vector<uint64_t> first(static_cast<size_t>(R));  // each row's next output index
  for (int r = 0; r < R; ++r) {
    pending[r] = static_cast<int32_t>((5 + 4 * r) % V);
    first[r] = static_cast<uint64_t>(3 * r);
  }
  std::vector<int32_t> known_pending = pending;
  auto read = [&] {
    std::vector<spec::DraftProposal> out;
    rows->settled_proposals(&out);
    for (int r = 0; r < R; ++r)
      trace.insert(trace.end(), out[r].tokens.begin(), out[r].tokens.end());
    rows->resolve(unread.front().accepted);
    known_pending = unread.front().next;
    unread.pop_front();
  };
  for (size_t n = 0; n < depths.size(); ++n) {
    const int round = static_cast<int>(n), D = depths[n];
    Round o;
    o.depth = D;
    o.hidden = hiddens(static_cast<size_t>(R * (D + 1)), 10 * round);
    std::vector<spec::RowDraft> in(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
      o.accepted.push_back((round + 2 * r) % (D + 1));
      o.next.push_back(static_cast<int32_t>((pending[r] * 7 + round + 1) % V));
      // What the host knows: the tokens of the rounds it read, one more per unread round.
      uint64_t unknown = 0;
      for (const Round& u : unread) unknown += static_cast<uint64_t>(u.accepted[r]);
      in[r].pending = lag == 0 ? pending[r] : known_pending[r];
      in[r].depth = D;
      in[r].sampling = sampling;
      in[r].sampling.seed = sampling.seed + static_cast<uint64_t>(r);
      in[r].first_index = first[r] - unknown;
    }
    if (lag == 0) {
      std::vector<spec::DraftProposal> out;
      rows->draft(in, &out);
      std::vector<std::vector<int32_t>> windows(static_cast<size_t>(R));
      std::vector<spec::VerifyRow> verified(static_cast<size_t>(R));
      for (int r = 0; r < R; ++r) {
        trace.insert(trace.end(), out[r].tokens.begin(), out[r].tokens.end());
        windows[r] = {pending[r]};
        windows[r].insert(windows[r].end(), out[r].tokens.begin(), out[r].tokens.end());
        verified[r] = {windows[r], o.hidden.data() + r * (D + 1) * H, o.accepted[r], o.next[r]};
      }
      rows->commit(verified);
    } else {
      spec::QueuedDraft q;
      if (!rows->draft_queued(in, &q)) {
        ADD_FAILURE() << "round " << round << ": the draft could not be queued";
        return trace;
      }
      o.accepted_dev.grow_to(R);
      o.next_dev.grow_to(R);
      o.hidden_dev.grow_to(static_cast<int64_t>(o.hidden.size()));
      std::vector<int32_t> acc(o.accepted.begin(), o.accepted.end());
      ops::copy_from_host(o.accepted_dev.data(), acc.data(), sizeof(int32_t) * acc.size());
      ops::copy_from_host(o.next_dev.data(), o.next.data(), sizeof(int32_t) * o.next.size());
      ops::copy_from_host(o.hidden_dev.data(), o.hidden.data(), sizeof(float) * o.hidden.size());
      spec::SettledVerify v;
      v.accepted = o.accepted_dev.data();
      v.next = o.next_dev.data();
      v.hidden = o.hidden_dev.data();
      v.depth = D;
      rows->settle(v);
    }
    for (int r = 0; r < R; ++r) {
      pending[r] = o.next[r];
      first[r] += static_cast<uint64_t>(o.accepted[r] + 1);
    }
    if (lag > 0) {
      unread.push_back(std::move(o));
      while (static_cast<int>(unread.size()) >= lag) read();
    }
  }
  while (!unread.empty()) read();
  for (int r = 0; r < R; ++r) {
    const spec::CheckpointPtr c = rows->capture(r);
    trace.push_back(static_cast<int32_t>(c->processed_tokens));
    for (const auto& [name, t] : c->tensors) {
      const auto* bits = reinterpret_cast<const int32_t*>(t.data.data());
      trace.insert(trace.end(), bits, bits + t.data.size());
    }
  }
  return trace;
}

}  // namespace tandem::test
