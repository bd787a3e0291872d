#include "tandem/engine/speculative.h"

#include <algorithm>
#include <chrono>

#include "tandem/core/error.h"

namespace tandem {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

double SpecStats::mean_accepted_length() const {
  return rounds > 0 ? static_cast<double>(accepted + rounds) / static_cast<double>(rounds) : 0.0;
}

double SpecStats::tokens_per_target_forward() const {
  return target_forwards > 0 ? static_cast<double>(emitted) / static_cast<double>(target_forwards)
                             : 0.0;
}

double SpecStats::acceptance_rate() const {
  return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0.0;
}

SpeculativeGenerator::SpeculativeGenerator(const Qwen35Model& model,
                                           const spec::DraftProvider* drafter,
                                           std::string target_identity, SpecOptions options)
    : model_(model),
      drafter_(drafter),
      target_(model, std::move(target_identity)),
      options_(options) {
  if (options_.depth < 0 || options_.depth > 16) fail("--depth must be in 0..16");
}

std::vector<GenerateResult> SpeculativeGenerator::run(const std::vector<GenerateRequest>& requests,
                                                      const TokenCallback& on_token,
                                                      GenerateStats* stats,
                                                      std::vector<SpecStats>* spec_stats) {
  const Qwen35Config& cfg = model_.config();
  validate_requests(requests, cfg);
  const size_t B = requests.size();
  std::vector<GenerateResult> results(B);
  std::vector<SpecStats> sstats(B);
  for (auto& s : sstats) {
    s.accepted_by_position.assign(static_cast<size_t>(options_.depth), 0);
    s.drafted_by_position.assign(static_cast<size_t>(options_.depth), 0);
  }
  if (B == 0) return results;

  const int depth = drafter_ ? options_.depth : 0;
  std::unique_ptr<spec::DraftRows> rows;
  std::optional<spec::HiddenTap> tap;
  if (drafter_) {
    rows = drafter_->open_rows(target_);
    tap = rows->tap();
    if (rows->prefill_mode() != spec::PrefillMode::Full)
      fail("drafter '", drafter_->id(), "': only full-prompt prefill is supported");
    std::vector<spec::CheckpointPtr> cold(B);
    rows->append(cold);
  }
  const bool want_final = tap == spec::HiddenTap::FinalNormed;
  const bool want_prenorm = tap == spec::HiddenTap::PreNorm;

  Qwen35State state(cfg);
  // `live` lists the requests still generating, in drafter-row order.
  std::vector<size_t> live(B);
  std::vector<int> slot(B);
  for (size_t i = 0; i < B; ++i) {
    live[i] = i;
    slot[i] = state.open_row();
  }
  std::vector<bool> done(B, false);
  // Emits one token; returns false once the request has finished.
  auto emit = [&](size_t i, int32_t tok) {
    done[i] = append_token(requests[i], cfg, tok, &results[i]);
    ++sstats[i].emitted;
    if (on_token) on_token(i, tok);
    return !done[i];
  };
  const float* (*pick)(const ForwardOutput&, bool) = [](const ForwardOutput& o, bool prenorm) {
    return prenorm ? o.prenorm_hidden.data() : o.hidden.data();
  };

  GenerateStats st;
  const int64_t V = cfg.vocab_size, H = cfg.hidden_size;
  ForwardOutput out;
  std::vector<int32_t> tokens;
  std::vector<RowInput> inputs;

  // Prefill: every prompt as one row of one forward; token 0 of each request from its logits.
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < B; ++i) {
    tokens.insert(tokens.end(), requests[i].prompt.begin(), requests[i].prompt.end());
    inputs.push_back({slot[i], static_cast<int64_t>(requests[i].prompt.size()), false});
    st.prompt_tokens += static_cast<int64_t>(requests[i].prompt.size());
  }
  // Greedy requests under match verification need only the target's greedy tokens: the
  // forwards pick them on the device and copy ids instead of logits.
  const bool greedy = options_.verify == spec::VerifyMode::Match &&
                      std::all_of(requests.begin(), requests.end(),
                                  [](const GenerateRequest& r) { return r.sampling.greedy(); });
  ForwardRequest prefill{tokens, inputs, false, want_final, want_prenorm};
  prefill.prompt = true;
  prefill.want_logits = !greedy;
  prefill.want_argmax = greedy;
  model_.forward(state, prefill, &out);
  for (size_t i = 0; i < B; ++i) {
    ++sstats[i].target_forwards;
    if (greedy) {
      emit(i, out.argmax[i]);
    } else {
      std::span<const float> logits(out.logits.data() + i * V, static_cast<size_t>(V));
      emit(i, sample_token(logits, requests[i].sampling, 0));
    }
  }
  if (rows) {
    std::vector<spec::RowPrefill> pre(B);
    int64_t t = 0;
    const float* hidden = pick(out, want_prenorm);
    for (size_t i = 0; i < B; ++i) {
      pre[i].row = static_cast<int>(i);
      pre[i].tokens = requests[i].prompt;
      pre[i].hidden = tap ? hidden + t * H : nullptr;
      pre[i].processed_before = 0;
      t += static_cast<int64_t>(requests[i].prompt.size());
    }
    rows->prefill(pre);
  }
  st.prefill_seconds = seconds_since(t0);

  // Drops finished requests from the target state and the drafter rows.
  auto retire = [&] {
    std::vector<int> keep;
    std::vector<size_t> still;
    for (size_t r = 0; r < live.size(); ++r) {
      if (done[live[r]]) {
        state.close_row(slot[live[r]]);
      } else {
        keep.push_back(static_cast<int>(r));
        still.push_back(live[r]);
      }
    }
    if (still.size() != live.size() && rows) rows->filter_rows(keep);
    live.swap(still);
  };
  retire();

  t0 = std::chrono::steady_clock::now();
  std::vector<spec::RowDraft> drafts;
  std::vector<spec::DraftProposal> proposals;
  std::vector<std::vector<int32_t>> windows;
  std::vector<spec::AcceptOutcome> outcomes;
  std::vector<RowKeep> keeps;
  std::vector<spec::VerifyRow> verified;
  while (!live.empty()) {
    const size_t R = live.size();
    // 1. Draft. A row never drafts past its max_tokens: a round emits at most depth + 1.
    proposals.assign(R, {});
    if (rows) {
      drafts.resize(R);
      for (size_t r = 0; r < R; ++r) {
        const size_t i = live[r];
        const int64_t room =
            requests[i].max_tokens - static_cast<int64_t>(results[i].tokens.size());
        drafts[r].pending = results[i].tokens.back();
        drafts[r].depth = static_cast<int>(std::min<int64_t>(depth, room - 1));
        drafts[r].sampling = requests[i].sampling;
        drafts[r].first_index = results[i].tokens.size();
        drafts[r].want_distribution = options_.verify == spec::VerifyMode::Rejection;
      }
      rows->draft(drafts, &proposals);
      TANDEM_CHECK(proposals.size() == R, "drafter returned ", proposals.size(), " rows");
    }
    // 2. Verify every row's window in one forward.
    tokens.clear();
    inputs.clear();
    windows.assign(R, {});
    for (size_t r = 0; r < R; ++r) {
      const size_t i = live[r];
      if (rows && static_cast<int>(proposals[r].tokens.size()) > drafts[r].depth)
        fail("drafter '", drafter_->id(), "' proposed ", proposals[r].tokens.size(),
             " tokens for depth ", drafts[r].depth);
      windows[r].push_back(results[i].tokens.back());
      windows[r].insert(windows[r].end(), proposals[r].tokens.begin(), proposals[r].tokens.end());
      tokens.insert(tokens.end(), windows[r].begin(), windows[r].end());
      inputs.push_back({slot[i], static_cast<int64_t>(windows[r].size()), true});
    }
    ForwardRequest verify{tokens, inputs, true, want_final, want_prenorm};
    verify.want_logits = !greedy;
    verify.want_argmax = greedy;
    model_.forward(state, verify, &out);
    // 3. Accept walk per row, emitting as it goes (EOS and max tokens end a request mid-window).
    outcomes.assign(R, {});
    keeps.clear();
    int64_t t = 0;
    for (size_t r = 0; r < R; ++r) {
      const size_t i = live[r];
      const size_t n = windows[r].size();
      const uint64_t first_index = results[i].tokens.size();
      if (greedy) {
        outcomes[r] = spec::accept_walk_greedy(std::span(out.argmax).subspan(t, n),
                                               std::span(windows[r]).subspan(1));
      } else {
        std::span<const float> logits(out.logits.data() + t * V, n * static_cast<size_t>(V));
        outcomes[r] = spec::accept_walk(logits, V, std::span(windows[r]).subspan(1), proposals[r].q,
                                        requests[i].sampling, first_index, options_.verify);
      }
      SpecStats& s = sstats[i];
      ++s.rounds;
      ++s.target_forwards;
      s.drafted += static_cast<int64_t>(n - 1);
      s.accepted += outcomes[r].accepted;
      for (int j = 0; j < outcomes[r].accepted; ++j) ++s.accepted_by_position[j];
      for (size_t j = 0; j + 1 < n; ++j) ++s.drafted_by_position[j];
      for (int32_t tok : outcomes[r].emitted)
        if (!emit(i, tok)) break;
      keeps.push_back({slot[i], 1 + outcomes[r].accepted});
      t += static_cast<int64_t>(n);
    }
    ++st.decode_steps;
    // 4. Commit: the target keeps pending + accepted proposals; the drafter follows.
    model_.commit_windows(state, keeps);
    if (rows) {
      verified.assign(R, {});
      const float* hidden = pick(out, want_prenorm);
      int64_t off = 0;
      for (size_t r = 0; r < R; ++r) {
        verified[r].window = windows[r];
        verified[r].hidden = tap ? hidden + off * H : nullptr;
        verified[r].accepted = outcomes[r].accepted;
        verified[r].next_pending = outcomes[r].emitted.back();
        off += static_cast<int64_t>(windows[r].size());
      }
      rows->commit(verified);
    }
    retire();
  }
  st.decode_seconds = seconds_since(t0);
  for (size_t i = 0; i < B; ++i) {
    st.generated_tokens += static_cast<int64_t>(results[i].tokens.size());
    st.decode_tokens += static_cast<int64_t>(results[i].tokens.size()) - 1;
  }
  if (stats) *stats = st;
  if (spec_stats) *spec_stats = std::move(sstats);
  return results;
}

}  // namespace tandem
