// Verify rounds whose accept walk and commit stay where the tokens are
// (Qwen35Model::accept_windows / settle_windows), against the same rounds committed on the host:
// the next rounds' forwards are queued before the host learns what was kept, and must compute
// exactly what they would after a host commit. Shared by the CPU and CUDA suites.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/core/sampler.h"
#include "tandem/model/qwen3_5.h"

namespace tandem::test {

// What plain decoding draws after `prompt` (greedy at temperature 0): out[k] follows prompt and
// out[0..k-1], drawn with the key of output index k.
inline std::vector<int32_t> continuation(const Qwen35Model& m, const std::vector<int32_t>& prompt,
                                         const SamplingParams& sp, int n) {
  Qwen35State s(m.config());
  const int slot = s.open_row();
  std::vector<int32_t> out;
  std::vector<int32_t> in = prompt;
  for (int k = 0; k < n; ++k) {
    const RowInput r{slot, static_cast<int64_t>(in.size()), false};
    const ops::SampleRow draw = ops::sample_row(sp, static_cast<uint64_t>(k));
    ForwardRequest req{in, {&r, 1}, false, false};
    req.want_logits = false;
    req.want_argmax = true;
    if (!sp.greedy()) req.sample_rows = {&draw, 1};
    ForwardOutput o;
    m.forward(s, req, &o);
    out.push_back(o.argmax.at(0));
    in = {out.back()};
  }
  return out;
}

struct SettleCase {
  bool sampled;
  int lag;  // rounds queued before the host resolves a settled commit
};

// Compares row sa of a with row sb of b (ADD_FAILURE naming `what` on a difference).
using SameState =
    std::function<void(Qwen35State& a, int sa, Qwen35State& b, int sb, const std::string& what)>;

// The rows (one per prompt) follow their plain continuations through 8 verify rounds. The last
// row verifies its pending token alone; the others verify windows of 2..5 tokens whose proposals
// go wrong at a chosen place (so they keep 1..n). State A commits on the host; state B accepts
// and settles on the device and resolves each commit `lag` rounds later. Every verify of B,
// queued before its rows' lengths are known on the host, gives A's logits and drawn tokens bit
// for bit; resolved, B holds A's state (same_state) and a plain step after it gives A's logits.
inline void settled_rounds(const Qwen35Model& m, RecurrentRollback rollback, const SettleCase& c,
                           const std::vector<std::vector<int32_t>>& prompts,
                           const SameState& same_state) {
  SamplingParams sp;
  if (c.sampled) {
    sp.temperature = 0.8f;
    sp.top_k = 40;
    sp.seed = 77;
  }
  constexpr int kRounds = 8, kMaxWindow = 5;
  const int R = static_cast<int>(prompts.size());
  const int64_t V = m.config().vocab_size;
  std::vector<std::vector<int32_t>> truth;
  for (const auto& p : prompts) truth.push_back(continuation(m, p, sp, kRounds * kMaxWindow + 6));
  Qwen35State a(m.config(), rollback), b(m.config(), rollback);
  std::vector<int> sa, sb;
  for (int r = 0; r < R; ++r) {
    sa.push_back(a.open_row());
    sb.push_back(b.open_row());
  }
  for (int r = 0; r < R; ++r)
    for (Qwen35State* s : {&a, &b}) {
      const RowInput in{s == &a ? sa[r] : sb[r], static_cast<int64_t>(prompts[r].size()), false};
      ForwardOutput o;
      m.forward(*s, {prompts[r], {&in, 1}, false, false}, &o);
    }
  std::mt19937 rng(99 + (c.sampled ? 1 : 0) + 2 * c.lag);
  std::vector<int64_t> k(R, 0);  // index in truth of each row's pending token
  // B's settled commits not resolved yet: per round, each settled row's (slot, kept).
  std::vector<std::vector<RowKeep>> unresolved;
  std::vector<int64_t> unknown(R, 0);  // per row: tokens kept that B's host was not told of
  Buffer<int32_t> accepted(R), next(R);
  for (int round = 0; round < kRounds; ++round) {
    const std::string what = std::string(c.sampled ? "sampled" : "greedy") + ", lag " +
                             std::to_string(c.lag) + ", round " + std::to_string(round);
    std::vector<int32_t> flat;
    std::vector<int> n(R), kept(R);
    for (int r = 0; r < R; ++r) {
      n[r] = r == R - 1 ? 1 : std::uniform_int_distribution<int>(2, kMaxWindow)(rng);
      kept[r] = std::uniform_int_distribution<int>(1, n[r])(rng);
      for (int j = 0; j < n[r]; ++j) {
        int32_t t = truth[r][static_cast<size_t>(k[r] + j)];
        if (j == kept[r]) t = static_cast<int32_t>((t + 1 + j) % V);  // the first rejection
        flat.push_back(t);
      }
    }
    // Window position j of row r draws output index k + 1 + j; B's host knows k less the row's
    // unresolved tokens.
    std::vector<RowInput> ra, rb;
    std::vector<ops::SampleRow> da, db;
    for (int r = 0; r < R; ++r) {
      ra.push_back({sa[r], n[r], n[r] > 1});
      rb.push_back({sb[r], n[r], n[r] > 1});
      for (int j = 0; j < n[r]; ++j) {
        da.push_back(ops::sample_row(sp, static_cast<uint64_t>(k[r] + 1 + j)));
        db.push_back(ops::sample_row(sp, static_cast<uint64_t>(k[r] - unknown[r] + 1 + j)));
      }
    }
    ForwardOutput oa, ob;
    ForwardRequest qa{flat, ra, true, false}, qb{flat, rb, true, false};
    qa.want_argmax = qb.want_argmax = true;
    if (c.sampled) {
      qa.sample_rows = da;
      qb.sample_rows = db;
    }
    m.forward(a, qa, &oa);
    m.forward(b, qb, &ob);
    ASSERT_EQ(oa.argmax, ob.argmax) << what;
    ASSERT_EQ(0, std::memcmp(oa.logits.data(), ob.logits.data(), sizeof(float) * oa.logits.size()))
        << what;
    // A: the host's walk and commit.
    std::vector<RowKeep> keeps;
    int64_t t = 0;
    for (int r = 0; r < R; ++r) {
      int acc = 0;
      while (acc + 1 < n[r] && flat[t + acc + 1] == oa.argmax[t + acc]) ++acc;
      ASSERT_EQ(acc, kept[r] - 1) << what << ", row " << r;
      if (n[r] > 1) keeps.push_back({sa[r], kept[r]});
      t += n[r];
    }
    m.commit_windows(a, keeps);
    // B: the walk and commit where the tokens are.
    m.accept_windows(accepted.data(), next.data());
    std::vector<int32_t> acc_host(R), next_host(R);
    ops::copy_to_host(acc_host.data(), accepted.data(), sizeof(int32_t) * R);
    ops::copy_to_host(next_host.data(), next.data(), sizeof(int32_t) * R);
    std::vector<ops::SettledRow> settle;
    std::vector<RowKeep> later;
    for (int r = 0; r < R; ++r) {
      EXPECT_EQ(acc_host[r], kept[r] - 1) << what << ", row " << r;
      EXPECT_EQ(next_host[r], truth[r][static_cast<size_t>(k[r] + kept[r])]) << what;
      if (n[r] > 1) {
        settle.push_back({sb[r], r});
        later.push_back({sb[r], kept[r]});
        unknown[r] += kept[r] - 1;
      }
      k[r] += kept[r];
    }
    m.settle_windows(b, settle, accepted.data());
    for (const ops::SettledRow& sr : settle) EXPECT_FALSE(b.window_open(sr.slot)) << what;
    unresolved.push_back(later);
    // The host reads a round's counts once `lag` rounds are queued after it.
    while (static_cast<int>(unresolved.size()) >= c.lag) {
      for (const RowKeep& kr : unresolved.front()) {
        b.resolve_settled(kr.slot, kr.kept);
        for (int r = 0; r < R; ++r)
          if (sb[r] == kr.slot) unknown[r] -= kr.kept - 1;
      }
      unresolved.erase(unresolved.begin());
    }
    for (int r = 0; r < R; ++r) {
      EXPECT_EQ(b.length(sb[r]) + unknown[r], a.length(sa[r])) << what;
      EXPECT_GE(b.unresolved_tokens(sb[r]), unknown[r]) << what;
    }
  }
  for (const auto& round : unresolved)
    for (const RowKeep& kr : round) b.resolve_settled(kr.slot, kr.kept);
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(b.unresolved_commits(sb[r]), 0);
    same_state(a, sa[r], b, sb[r], "row " + std::to_string(r) + " resolved");
  }
  // A plain step after everything resolved: no trace of the settled path.
  std::vector<int32_t> step;
  std::vector<RowInput> ra, rb;
  for (int r = 0; r < R; ++r) {
    step.push_back(truth[r][static_cast<size_t>(k[r])]);
    ra.push_back({sa[r], 1, false});
    rb.push_back({sb[r], 1, false});
  }
  ForwardOutput oa, ob;
  m.forward(a, {step, ra, false, false}, &oa);
  m.forward(b, {step, rb, false, false}, &ob);
  EXPECT_EQ(0, std::memcmp(oa.logits.data(), ob.logits.data(), sizeof(float) * R * V));
}

}  // namespace tandem::test
