// N-gram prompt-lookup drafter: the lookup rules, incremental history across rounds, checkpoints.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <random>

#include "fixture_model.h"
#include "tandem/backend/ops.h"
#include "tandem/core/error.h"
#include "tandem/spec/gram_index.h"
#include "tandem/spec/ngram.h"

namespace tandem::spec {
namespace {

// The drafter never reads the target; any loaded model serves as the TargetView.
const Qwen35Model& any_model() {
  return test::tied_fixture_model();
}

std::unique_ptr<DraftRows> open(const NgramOptions& o, int cold_rows) {
  NgramProvider p(o);
  auto rows = p.open_rows(QwenTargetView(any_model(), "test-target"));
  std::vector<CheckpointPtr> none(cold_rows);
  rows->prepare_append(none)->commit();
  return rows;
}

// Straight from the definition: longest n first, earliest earlier start, overlaps allowed.
std::vector<int32_t> reference(const std::vector<int32_t>& h, const NgramOptions& o, int depth) {
  const int64_t len = static_cast<int64_t>(h.size());
  if (depth <= 0) return {};
  for (int n = o.max_n; n >= o.min_n; --n) {
    if (n >= len) continue;
    const int64_t tail = len - n;
    for (int64_t s = 0; s < tail; ++s) {
      if (std::equal(h.begin() + s, h.begin() + s + n, h.begin() + tail)) {
        const int64_t to = std::min<int64_t>(s + n + depth, len);
        return std::vector<int32_t>(h.begin() + s + n, h.begin() + to);
      }
    }
  }
  return {};
}

RowDraft draft_in(int32_t pending, int depth, bool want_q = false) {
  RowDraft d;
  d.pending = pending;
  d.depth = depth;
  d.want_distribution = want_q;
  return d;
}

// Prefills everything but the last token of `history`, then drafts with the last as pending.
std::vector<int32_t> draft_on(const std::vector<int32_t>& history, const NgramOptions& o,
                              int depth) {
  auto rows = open(o, 1);
  const std::vector<int32_t> prompt(history.begin(), history.end() - 1);
  RowPrefill p;
  p.row = 0;
  p.tokens = prompt;
  rows->prefill(std::span<const RowPrefill>(&p, 1));
  std::vector<DraftProposal> out;
  const RowDraft d = draft_in(history.back(), depth);
  rows->draft(std::span<const RowDraft>(&d, 1), &out);
  EXPECT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].tokens, reference(history, o, depth));
  return out[0].tokens;
}

TEST(Ngram, LongestNgramWins) {
  // Trailing 3-gram [1 2 3] never occurred; [2 3] did (followed by 7); [3] did first (then 8).
  const std::vector<int32_t> h = {5, 3, 8, 2, 3, 7, 1, 2, 3};
  EXPECT_EQ(draft_on(h, {1, 3}, 3), (std::vector<int32_t>{7, 1, 2}));
  EXPECT_EQ(draft_on(h, {1, 1}, 3), (std::vector<int32_t>{8, 2, 3}));
  EXPECT_EQ(draft_on(h, {3, 3}, 3), (std::vector<int32_t>{}));
}

TEST(Ngram, FirstOccurrenceWins) {
  const std::vector<int32_t> h = {4, 1, 2, 9, 1, 2, 6, 1, 2};
  EXPECT_EQ(draft_on(h, {2, 2}, 3), (std::vector<int32_t>{9, 1, 2}));
  EXPECT_EQ(draft_on(h, {1, 3}, 1), (std::vector<int32_t>{9}));
}

TEST(Ngram, DepthTruncatedAtHistoryEnd) {
  // [7 7] first occurs at 0, overlapping the trailing one; only one token follows it.
  EXPECT_EQ(draft_on({7, 7, 7}, {2, 2}, 4), (std::vector<int32_t>{7}));
  EXPECT_EQ(draft_on({1, 2, 3, 1}, {1, 3}, 8), (std::vector<int32_t>{2, 3, 1}));
}

TEST(Ngram, NoMatchNoProposals) {
  EXPECT_TRUE(draft_on({1, 2, 3, 4}, {1, 3}, 4).empty());
  EXPECT_TRUE(draft_on({1}, {1, 3}, 4).empty());
  EXPECT_TRUE(draft_on({1, 2, 1}, {1, 3}, 0).empty());  // depth 0
}

TEST(Ngram, OneHotDistributionWhenAsked) {
  auto rows = open({1, 3}, 1);
  const std::vector<int32_t> prompt = {1, 2, 3, 1};
  RowPrefill p;
  p.tokens = prompt;
  rows->prefill(std::span<const RowPrefill>(&p, 1));
  std::vector<DraftProposal> out;
  const RowDraft d = draft_in(2, 4, true);
  rows->draft(std::span<const RowDraft>(&d, 1), &out);
  ASSERT_EQ(out[0].tokens, (std::vector<int32_t>{3, 1, 2}));
  ASSERT_EQ(out[0].q.size(), 3u);
  for (size_t j = 0; j < 3; ++j) {
    ASSERT_EQ(out[0].q[j].size(), 1u);
    EXPECT_EQ(out[0].q[j][0].id, out[0].tokens[j]);
    EXPECT_EQ(out[0].q[j][0].prob, 1.0);
  }
}

TEST(Ngram, ProviderIdentity) {
  NgramProvider p({2, 5});
  EXPECT_EQ(p.id(), "ngram");
  EXPECT_EQ(p.weights_bytes(), 0u);
  EXPECT_EQ(p.checkpoint_namespace(), "ngram-history-v1:n=2-5");
  auto rows = p.open_rows(QwenTargetView(any_model(), "t"));
  EXPECT_EQ(rows->ns(), p.checkpoint_namespace());
  EXPECT_EQ(rows->prefill_mode(), PrefillMode::Full);
  EXPECT_TRUE(rows->taps().empty());
  EXPECT_EQ(rows->row_count(), 0);
}

TEST(Ngram, OptionsValidated) {
  auto refused = [](NgramOptions o, const std::string& flag) {
    try {
      NgramProvider p(o);
      ADD_FAILURE() << "accepted min " << o.min_n << " max " << o.max_n;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  };
  refused({0, 3}, "--ngram-min");
  refused({1, 17}, "--ngram-max");
  refused({3, 2}, "--ngram-min");
  refused({-1, 0}, "--ngram-min");
  EXPECT_NO_THROW(NgramProvider({16, 16}));
  EXPECT_NO_THROW(NgramProvider({1, 1}));
}

// One simulated request: the reference history (processed tokens + pending) next to a row.
struct Sim {
  std::vector<int32_t> history;
  int vocab = 4;
};

// Random rounds on several rows: every draft must equal the brute-force lookup on the full
// history; accepted counts, corrections, depths (including 0) and captures/restores are random.
void run_random(const NgramOptions& o, uint32_t seed) {
  std::mt19937 rng(seed);
  const int rows_n = 3;
  auto rows = open(o, rows_n);
  std::vector<Sim> sims(rows_n);
  const int vocabs[rows_n] = {3, 8, 60};
  std::vector<std::vector<int32_t>> prompts(rows_n);
  std::vector<RowPrefill> pre(rows_n);
  for (int b = 0; b < rows_n; ++b) {
    sims[b].vocab = vocabs[b];
    const int len = static_cast<int>(rng() % 40);
    for (int i = 0; i < len; ++i) prompts[b].push_back(static_cast<int32_t>(rng() % vocabs[b]));
    sims[b].history = prompts[b];
    pre[b].row = b;
    pre[b].tokens = prompts[b];
  }
  rows->prefill(pre);
  std::vector<int32_t> pending(rows_n);
  for (int b = 0; b < rows_n; ++b) {
    pending[b] = static_cast<int32_t>(rng() % sims[b].vocab);
    sims[b].history.push_back(pending[b]);
  }
  for (int round = 0; round < 300; ++round) {
    std::vector<RowDraft> in(rows_n);
    for (int b = 0; b < rows_n; ++b) in[b] = draft_in(pending[b], static_cast<int>(rng() % 6));
    std::vector<DraftProposal> out;
    rows->draft(in, &out);
    std::vector<std::vector<int32_t>> windows(rows_n);
    std::vector<VerifyRow> ver(rows_n);
    for (int b = 0; b < rows_n; ++b) {
      ASSERT_EQ(out[b].tokens, reference(sims[b].history, o, in[b].depth))
          << "seed " << seed << " round " << round << " row " << b;
      windows[b] = {pending[b]};
      windows[b].insert(windows[b].end(), out[b].tokens.begin(), out[b].tokens.end());
      ver[b].window = windows[b];
      ver[b].accepted = static_cast<int>(rng() % (out[b].tokens.size() + 1));
      ver[b].next_pending = static_cast<int32_t>(rng() % sims[b].vocab);
      sims[b].history.insert(sims[b].history.end(), out[b].tokens.begin(),
                             out[b].tokens.begin() + ver[b].accepted);
      sims[b].history.push_back(ver[b].next_pending);
      pending[b] = ver[b].next_pending;
    }
    rows->commit(ver);
    if (round % 37 == 5) {
      // Move a random row through a checkpoint: restore it as a new last row, drop the old one.
      const int victim = static_cast<int>(rng() % rows_n);
      const CheckpointPtr c = rows->capture(victim);
      ASSERT_EQ(c->processed_tokens + 1, static_cast<int64_t>(sims[victim].history.size()));
      rows->prepare_append(std::span<const CheckpointPtr>(&c, 1))->commit();
      std::vector<int> keep;
      for (int b = 0; b < rows_n; ++b)
        if (b != victim) keep.push_back(b);
      keep.push_back(rows_n);
      rows->filter_rows(keep);
      Sim moved = sims[victim];
      const int32_t moved_pending = pending[victim];
      sims.erase(sims.begin() + victim);
      pending.erase(pending.begin() + victim);
      sims.push_back(moved);
      pending.push_back(moved_pending);
    }
  }
}

// The index keeps every distinct n-gram's first start, through the table's growth, and knows no
// n-gram it was not given.
TEST(GramIndex, KeepsTheFirstOccurrenceOfEveryNgram) {
  std::mt19937 rng(7);
  for (int n : {1, 2, 3, 16}) {
    std::vector<int32_t> history;
    GramIndex index(n);
    std::map<std::vector<int32_t>, int32_t> first;  // the reference
    for (int len = 1; len <= 3000; ++len) {
      history.push_back(static_cast<int32_t>(rng() % (n == 16 ? 2 : 5)));
      if (len < n) continue;
      const int32_t start = len - n;
      index.insert(history, start);
      first.try_emplace(std::vector<int32_t>(history.begin() + start, history.end()), start);
    }
    EXPECT_EQ(index.size(), first.size()) << "n = " << n;
    for (int32_t start = 0; start + n <= static_cast<int32_t>(history.size()); ++start) {
      const std::vector<int32_t> gram(history.begin() + start, history.begin() + start + n);
      ASSERT_EQ(index.first(history, start), first.at(gram)) << "n = " << n << " at " << start;
    }
    // An n-gram never inserted: a token outside the alphabet.
    history.push_back(99);
    EXPECT_EQ(index.first(history, static_cast<int32_t>(history.size()) - n), -1);
  }
  EXPECT_EQ(GramIndex(3).first(std::vector<int32_t>{1, 2, 3}, 0), -1);
}

TEST(Ngram, IncrementalMatchesBruteForce) {
  run_random({1, 3}, 1);
  run_random({1, 1}, 2);
  run_random({2, 4}, 3);
  run_random({1, 16}, 4);
  run_random({5, 16}, 5);
}

TEST(Ngram, CaptureRestoreContinuesIdentically) {
  NgramProvider prov({1, 3});
  const QwenTargetView target(any_model(), "t");
  auto a = prov.open_rows(target);
  std::vector<CheckpointPtr> cold(1);
  a->prepare_append(cold)->commit();
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 1, 2};
  RowPrefill p;
  p.tokens = prompt;
  a->prefill(std::span<const RowPrefill>(&p, 1));

  std::mt19937 rng(7);
  int32_t pending = 3;
  auto round = [&](DraftRows& r, int32_t pend, int depth, int accepted, int32_t next) {
    std::vector<DraftProposal> out;
    const RowDraft d = draft_in(pend, depth);
    r.draft(std::span<const RowDraft>(&d, 1), &out);
    std::vector<int32_t> window = {pend};
    window.insert(window.end(), out[0].tokens.begin(), out[0].tokens.end());
    VerifyRow v;
    v.window = window;
    v.accepted = std::min<int>(accepted, static_cast<int>(out[0].tokens.size()));
    v.next_pending = next;
    r.commit(std::span<const VerifyRow>(&v, 1));
    return out[0].tokens;
  };
  for (int i = 0; i < 10; ++i) {
    const int32_t next = static_cast<int32_t>(rng() % 5);
    round(*a, pending, 3, static_cast<int>(rng() % 4), next);
    pending = next;
  }
  const CheckpointPtr c = a->capture(0);
  EXPECT_EQ(c->schema, "ngram-history-v1");
  EXPECT_EQ(c->ns, prov.checkpoint_namespace());
  EXPECT_EQ(static_cast<int64_t>(c->tokens.size()), c->processed_tokens);
  EXPECT_EQ(std::vector<int32_t>(c->tokens.begin(), c->tokens.begin() + 6), prompt);

  auto b = prov.open_rows(target);
  b->prepare_append(std::span<const CheckpointPtr>(&c, 1))->commit();
  for (int i = 0; i < 30; ++i) {
    const int32_t next = static_cast<int32_t>(rng() % 5);
    const int depth = static_cast<int>(rng() % 5);
    const int acc = static_cast<int>(rng() % 5);
    EXPECT_EQ(round(*a, pending, depth, acc, next), round(*b, pending, depth, acc, next)) << i;
    pending = next;
  }
  EXPECT_EQ(a->capture(0)->tokens, b->capture(0)->tokens);
}

TEST(Ngram, RestoreThenPrefillRest) {
  // A checkpoint of a prompt prefix, restored and prefilled with the rest, equals a row that
  // prefilled the whole prompt (the prefix-cache case).
  NgramProvider prov({1, 3});
  const QwenTargetView target(any_model(), "t");
  const std::vector<int32_t> head = {1, 2, 3, 4};
  const std::vector<int32_t> rest = {1, 2, 5, 1};
  auto a = prov.open_rows(target);
  std::vector<CheckpointPtr> cold(1);
  a->prepare_append(cold)->commit();
  RowPrefill p;
  p.tokens = head;
  a->prefill(std::span<const RowPrefill>(&p, 1));
  const CheckpointPtr c = a->capture(0);
  EXPECT_EQ(c->processed_tokens, 4);

  auto b = prov.open_rows(target);
  b->prepare_append(std::span<const CheckpointPtr>(&c, 1))->commit();
  p.tokens = rest;
  p.processed_before = 3;  // misaligned
  EXPECT_THROW(b->prefill(std::span<const RowPrefill>(&p, 1)), Error);
  p.processed_before = 4;
  b->prefill(std::span<const RowPrefill>(&p, 1));
  std::vector<DraftProposal> out;
  const RowDraft d = draft_in(2, 3);
  b->draft(std::span<const RowDraft>(&d, 1), &out);
  // History 1 2 3 4 1 2 5 1 | 2: [5 1 2] is new; [1 2] first occurred at the start.
  EXPECT_EQ(out[0].tokens, (std::vector<int32_t>{3, 4, 1}));
  EXPECT_EQ(b->capture(0)->processed_tokens, 8);
}

TEST(Ngram, MismatchedCheckpointsRefused) {
  NgramProvider prov({1, 3});
  const QwenTargetView target(any_model(), "t");
  auto rows = prov.open_rows(target);
  auto good = std::make_shared<Checkpoint>();
  good->schema = "ngram-history-v1";
  good->ns = prov.checkpoint_namespace();
  good->tokens = {1, 2, 3};
  good->processed_tokens = 3;
  auto refused = [&](const Checkpoint& bad, const std::string& why) {
    std::vector<CheckpointPtr> batch = {good, std::make_shared<Checkpoint>(bad)};
    try {
      rows->prepare_append(batch)->commit();
      ADD_FAILURE() << "accepted a checkpoint with a wrong " << why;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
    EXPECT_EQ(rows->row_count(), 0);  // the good one was not appended either
  };
  Checkpoint bad = *good;
  bad.schema = "qwen-mtp-v1";
  refused(bad, "schema");
  bad = *good;
  bad.ns = NgramProvider({1, 4}).checkpoint_namespace();
  refused(bad, "namespace");
  bad = *good;
  bad.processed_tokens = 4;
  refused(bad, "alignment");
  bad = *good;
  bad.tokens.push_back(9);  // a history that includes a pending token
  refused(bad, "alignment");

  std::vector<CheckpointPtr> ok = {good};
  rows->prepare_append(ok)->commit();
  EXPECT_EQ(rows->row_count(), 1);
  // Disposing a prepared append leaves the rows as they were.
  rows->prepare_append(ok)->dispose();
  EXPECT_EQ(rows->row_count(), 1);
}

TEST(Ngram, FilterRowsKeepsListedOrder) {
  auto rows = open({1, 2}, 3);
  std::vector<std::vector<int32_t>> prompts = {{1, 1}, {2, 2}, {3, 3}};
  std::vector<RowPrefill> pre(3);
  for (int b = 0; b < 3; ++b) {
    pre[b].row = b;
    pre[b].tokens = prompts[b];
  }
  rows->prefill(pre);
  const std::vector<int> keep = {2, 0};
  rows->filter_rows(keep);
  ASSERT_EQ(rows->row_count(), 2);
  EXPECT_EQ(rows->capture(0)->tokens, prompts[2]);
  EXPECT_EQ(rows->capture(1)->tokens, prompts[0]);
}

// Rows copied from a prefill group into a decoding group (the engine's move) are the rows
// themselves: they capture and draft as rows restored from checkpoints do, the source stays as
// it was, and a refused copy changes nothing.
TEST(Ngram, CopiedRowsEqualRestoredRows) {
  const NgramOptions o{1, 3};
  std::mt19937 rng(5);
  auto source = open(o, 3);
  std::vector<std::vector<int32_t>> prompts(3);
  std::vector<RowPrefill> pre(3);
  for (int b = 0; b < 3; ++b) {
    for (int i = 0; i < 40 + 30 * b; ++i) prompts[b].push_back(static_cast<int32_t>(rng() % 6));
    pre[b] = {b, prompts[b], nullptr, 0};
  }
  source->prefill(pre);
  auto copied = open(o, 0), restored = open(o, 0);
  const int bad[] = {0, 3};
  EXPECT_THROW(copied->copy_rows(*source, bad), Error);
  EXPECT_EQ(copied->row_count(), 0) << "a refused copy must change nothing";
  const int rows[] = {2, 0};
  copied->copy_rows(*source, rows);
  const CheckpointPtr c[] = {source->capture(2), source->capture(0)};
  restored->append(c);
  ASSERT_EQ(copied->row_count(), 2);
  for (int b = 0; b < 2; ++b) EXPECT_EQ(copied->capture(b)->tokens, c[b]->tokens);
  EXPECT_EQ(source->capture(0)->tokens, prompts[0]);
  EXPECT_EQ(source->row_count(), 3);
  // Rounds on both: the same proposals, from histories that keep growing.
  int32_t pending[] = {1, 2};
  for (int round = 0; round < 20; ++round) {
    std::vector<RowDraft> in;
    for (int b = 0; b < 2; ++b) in.push_back(draft_in(pending[b], 1 + static_cast<int>(rng() % 5)));
    std::vector<DraftProposal> a, r;
    copied->draft(in, &a);
    restored->draft(in, &r);
    std::vector<std::vector<int32_t>> windows(2);
    std::vector<VerifyRow> ver(2);
    for (int b = 0; b < 2; ++b) {
      ASSERT_EQ(a[b].tokens, r[b].tokens) << "round " << round << " row " << b;
      windows[b] = {in[b].pending};
      windows[b].insert(windows[b].end(), a[b].tokens.begin(), a[b].tokens.end());
      pending[b] = static_cast<int32_t>(rng() % 6);
      ver[b] = {windows[b], nullptr, static_cast<int>(rng() % (a[b].tokens.size() + 1)),
                pending[b]};
    }
    copied->commit(ver);
    restored->commit(ver);
  }
}

// The device lookup (ops::ngram_lookup, as settled rounds use it) proposes what the host lookup
// does, for every history and option, padding its window with the pending token.
TEST(Ngram, DeviceLookupEqualsHostLookup) {
  std::mt19937 rng(41);
  for (const NgramOptions o : {NgramOptions{1, 3}, NgramOptions{2, 2}, NgramOptions{1, 16}}) {
    const int64_t R = 24, stride = 200;
    const int depth = 5;
    std::vector<int32_t> tokens(static_cast<size_t>(R * stride));
    std::vector<int64_t> lengths(static_cast<size_t>(R));
    std::vector<std::vector<int32_t>> h(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t len = 1 + static_cast<int64_t>(rng() % 150);
      for (int64_t i = 0; i < len; ++i) h[r].push_back(static_cast<int32_t>(rng() % (2 + r % 6)));
      std::copy(h[r].begin(), h[r].end(), tokens.begin() + r * stride);
      lengths[static_cast<size_t>(r)] = len;
    }
    std::vector<int32_t> ids(static_cast<size_t>(R + R * depth), -7), counts(R, -7);
    ops::ngram_lookup({tokens.data(), lengths.data(), stride, R}, o.min_n, o.max_n, depth,
                      ids.data(), counts.data());
    for (int64_t r = 0; r < R; ++r) {
      const std::vector<int32_t> want = reference(h[r], o, depth);
      ASSERT_EQ(counts[r], static_cast<int32_t>(want.size())) << "row " << r;
      EXPECT_EQ(ids[r], h[r].back());
      for (int j = 0; j < depth; ++j)
        EXPECT_EQ(ids[R + r * depth + j], j < counts[r] ? want[j] : h[r].back()) << r << "." << j;
    }
  }
  EXPECT_THROW(ops::ngram_lookup({nullptr, nullptr, 0, 0}, 3, 2, 1, nullptr, nullptr), Error);
}

// Rounds settled on the device propose what host rounds propose, round after round, while the
// host reads each at once or a round late; host rounds in between (the engine falls back to them)
// drop the device copy and the next settled round copies the rows again. Checkpoints agree.
TEST(Ngram, SettledRoundsEqualHostRounds) {
  const NgramOptions o{1, 3};
  const int rows_n = 4;
  auto host = open(o, rows_n), dev = open(o, rows_n);
  std::mt19937 rng(43);
  std::vector<std::vector<int32_t>> prompts(rows_n);
  std::vector<RowPrefill> pre(rows_n);
  for (int b = 0; b < rows_n; ++b) {
    for (int i = 0; i < 20 + 9 * b; ++i) prompts[b].push_back(static_cast<int32_t>(rng() % 6));
    pre[b].row = b;
    pre[b].tokens = prompts[b];
  }
  host->prefill(pre);
  dev->prefill(pre);
  std::vector<int32_t> pending(rows_n);
  for (auto& p : pending) p = static_cast<int32_t>(rng() % 6);

  struct Round {
    std::vector<std::vector<int32_t>> proposals;
    std::vector<int> accepted;
  };
  std::deque<Round> unread;
  auto read_one = [&] {
    std::vector<DraftProposal> got;
    dev->settled_proposals(&got);
    const Round& r = unread.front();
    ASSERT_EQ(got.size(), static_cast<size_t>(rows_n));
    for (int b = 0; b < rows_n; ++b) EXPECT_EQ(got[b].tokens, r.proposals[b]) << "row " << b;
    dev->resolve(r.accepted);
    unread.pop_front();
  };
  int settled = 0;
  for (int round = 0; round < 90; ++round) {
    const int depth = 1 + (round / 10) % 4;
    const int lag = (round / 7) % 2;  // rounds left unread when the next is drafted (engine: 1)
    const bool host_round = round % 23 == 22;
    std::vector<RowDraft> in(rows_n);
    for (int b = 0; b < rows_n; ++b) in[b] = draft_in(pending[b], depth);
    std::vector<DraftProposal> want;
    host->draft(in, &want);
    Round r;
    std::vector<VerifyRow> ver(rows_n);
    std::vector<std::vector<int32_t>> windows(rows_n);
    std::vector<int32_t> next(rows_n);
    for (int b = 0; b < rows_n; ++b) {
      r.proposals.push_back(want[b].tokens);
      r.accepted.push_back(static_cast<int>(rng() % (want[b].tokens.size() + 1)));
      next[b] = static_cast<int32_t>(rng() % 6);
      windows[b] = {pending[b]};
      windows[b].insert(windows[b].end(), want[b].tokens.begin(), want[b].tokens.end());
      ver[b] = {windows[b], nullptr, r.accepted[b], next[b]};
    }
    host->commit(ver);
    if (host_round) {
      if (!unread.empty()) {  // rounds are unread: refused, nothing changed
        EXPECT_THROW(dev->draft(in, &want), Error);
      }
      while (!unread.empty()) read_one();
      std::vector<DraftProposal> got;
      dev->draft(in, &got);
      for (int b = 0; b < rows_n; ++b) EXPECT_EQ(got[b].tokens, want[b].tokens);
      dev->commit(ver);
    } else {
      ASSERT_TRUE(dev->can_settle(in)) << "round " << round;
      QueuedDraft q;
      ASSERT_TRUE(dev->draft_settled(in, &q));
      ASSERT_NE(q.counts, nullptr);
      std::vector<int32_t> accepted(r.accepted.begin(), r.accepted.end());
      for (int b = 0; b < rows_n; ++b) {
        ASSERT_EQ(q.slots[b].size(), static_cast<size_t>(depth));
        // On the CPU the queued ids are readable at once: the device proposes what the host does.
        ASSERT_EQ(q.counts[b], static_cast<int32_t>(want[b].tokens.size())) << round;
        for (size_t j = 0; j < want[b].tokens.size(); ++j)
          EXPECT_EQ(q.ids[q.slots[b][j]], want[b].tokens[j]);
        EXPECT_EQ(q.ids[q.pending_slots[b]], pending[b]);
      }
      SettledVerify v;
      v.accepted = accepted.data();
      v.next = next.data();
      v.depth = depth;
      dev->settle(v);  // reads accepted and next now (on the CPU)
      unread.push_back(std::move(r));
      ++settled;
      while (static_cast<int>(unread.size()) > lag) read_one();
    }
    pending = next;
    if (round % 30 == 29 || round % 30 == 8) {
      if (!unread.empty()) {
        EXPECT_THROW(dev->capture(0), Error);
      }
      while (!unread.empty()) read_one();
      for (int b = 0; b < rows_n; ++b) EXPECT_EQ(dev->capture(b)->tokens, host->capture(b)->tokens);
    }
  }
  EXPECT_GT(settled, 80);
  // Depths that differ by row, or distributions, are not settled.
  std::vector<RowDraft> mixed(rows_n);
  for (int b = 0; b < rows_n; ++b) mixed[b] = draft_in(pending[b], 1 + b % 2);
  EXPECT_FALSE(dev->can_settle(mixed));
  for (int b = 0; b < rows_n; ++b) mixed[b] = draft_in(pending[b], 2, b == 1);
  EXPECT_FALSE(dev->can_settle(mixed));
}

}  // namespace
}  // namespace tandem::spec
