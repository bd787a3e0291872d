// Draft rounds of an MTP drafter, as the engine runs them, for comparing two ways of running the
// same drafter bit for bit (whole chains against step by step, graphs on and off, draws on the
// device against draws on the host).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "tandem/spec/mtp_rows.h"

namespace tandem::test {

// Opens rows for `prompts` (prefilled with synthetic hiddens: only determinism is compared),
// then runs `rounds` rounds in which the rows draft different depths (some stop early, so later
// steps run fewer rows) and accept none, some or all of their proposals. Rows draft with
// `sampling` (row r's seed is sampling.seed + r; greedy by default) and ask for their
// distributions when `want_distribution` (which keeps the draws on the host). Returns every
// proposal, then the bits of every draft step's logits. *whole_chains: the chains MtpRows ran
// whole.
inline std::vector<int32_t> mtp_rounds(const spec::DraftProvider& drafter,
                                       const spec::TargetView& target,
                                       const std::vector<std::vector<int32_t>>& prompts, int rounds,
                                       int64_t* whole_chains = nullptr,
                                       const SamplingParams& sampling = {},
                                       bool want_distribution = false) {
  const int64_t H = target.hidden_size(), V = target.vocab_size();
  const int R = static_cast<int>(prompts.size());
  auto hiddens = [&](size_t n, int salt) {
    std::vector<float> h(n * static_cast<size_t>(H));
    for (size_t i = 0; i < h.size(); ++i)
      h[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(salt));
    return h;
  };
  std::unique_ptr<spec::DraftRows> rows = drafter.open_rows(target);
  const std::vector<spec::CheckpointPtr> cold(static_cast<size_t>(R));
  rows->prepare_append(cold)->commit();
  std::vector<std::vector<float>> prompt_hidden;
  std::vector<spec::RowPrefill> pre;
  for (int r = 0; r < R; ++r) prompt_hidden.push_back(hiddens(prompts[r].size(), r));
  for (int r = 0; r < R; ++r) pre.push_back({r, prompts[r], prompt_hidden[r].data(), 0});
  rows->prefill(pre);
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
  return trace;
}

}  // namespace tandem::test
