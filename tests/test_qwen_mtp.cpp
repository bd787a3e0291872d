// The Qwen MTP drafter on the bundled demo model: numerics against the PyTorch oracle
// (tests/fixtures/demo_reference, tools/make_demo_reference.py), the keep-drafted-rows commit,
// checkpoints, companion directories (mtp-split output, MLX-affine quantized) and refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "mtp_rounds.h"
#include "tandem/backend/buffer.h"
#include "tandem/core/error.h"
#include "tandem/io/safetensors.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/spec/qwen_mtp.h"
#include "tandem/spec/qwen_mtp_split.h"
#include "test_util.h"

namespace tandem::spec {
namespace {

using json = nlohmann::json;
using tandem::testing::ScratchDir;
namespace fs = std::filesystem;

const std::string kDemo = std::string(TANDEM_SOURCE_DIR) + "/models/qwen35-demo";
const std::string kRefDir = std::string(TANDEM_FIXTURES_DIR) + "/demo_reference";

// ---------------------------------------------------------------------------------------------
// Shared state: the demo target and its in-checkpoint drafter, loaded once.

struct Demo {
  std::unique_ptr<Qwen35Model> model;
  std::unique_ptr<TargetView> target;
  std::unique_ptr<QwenMtpProvider> mtp;
  std::shared_ptr<const SafetensorsFile> ref;
  json ref_json;
  int64_t H = 0, V = 0;
};

Demo& demo() {
  static Demo* d = [] {
    auto* d = new Demo();
    d->model = Qwen35Model::load(kDemo);
    d->target = std::make_unique<QwenTargetView>(*d->model, "demo");
    d->mtp = QwenMtpProvider::from_target(*d->target);
    d->ref = SafetensorsFile::open(kRefDir + "/reference.safetensors");
    std::ifstream f(kRefDir + "/reference.json");
    d->ref_json = json::parse(f);
    d->H = d->model->config().hidden_size;
    d->V = d->model->config().vocab_size;
    return d;
  }();
  return *d;
}

std::vector<int32_t> ref_ids(const std::string& name) {
  const TensorView* t = demo().ref->find(name);
  EXPECT_NE(t, nullptr) << name;
  std::vector<int32_t> out;
  const auto* p = static_cast<const int64_t*>(t->data);
  for (int64_t i = 0; i < t->numel(); ++i) out.push_back(static_cast<int32_t>(p[i]));
  return out;
}

std::vector<float> ref_floats(const std::string& name) {
  const TensorView* t = demo().ref->find(name);
  EXPECT_NE(t, nullptr) << name;
  return to_f32(*t);
}

// The target's final-normed hidden at every position of `tokens` (one fresh forward). fp32 KV:
// the PyTorch reference's hiddens are fp32 throughout.
std::vector<float> target_hidden(std::span<const int32_t> tokens) {
  Qwen35State st(demo().model->config(), RecurrentRollback::PerPositionStates, DType::F32);
  const RowInput row{st.open_row(), static_cast<int64_t>(tokens.size())};
  ForwardOutput out;
  demo().model->forward(st, {tokens, {&row, 1}, false, true}, &out);
  return out.hidden;
}

std::unique_ptr<QwenMtpRows> open_rows(const QwenMtpProvider& p, int cold_rows) {
  std::unique_ptr<DraftRows> r = p.open_rows(*demo().target);
  auto* q = dynamic_cast<QwenMtpRows*>(r.get());
  EXPECT_NE(q, nullptr);
  r.release();
  std::unique_ptr<QwenMtpRows> rows(q);
  std::vector<CheckpointPtr> none(static_cast<size_t>(cold_rows));
  apply_changes({[&] { return rows->prepare_append(none); }});
  return rows;
}

std::unique_ptr<QwenMtpRows> restore(const QwenMtpProvider& p, const CheckpointPtr& c) {
  auto rows = open_rows(p, 0);
  const CheckpointPtr one[] = {c};
  apply_changes({[&] { return rows->prepare_append(one); }});
  return rows;
}

RowDraft greedy(int32_t pending, int depth, uint64_t first_index = 0) {
  RowDraft d;
  d.pending = pending;
  d.depth = depth;
  d.first_index = first_index;
  return d;
}

double max_abs(std::span<const float> v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

double max_diff(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    m = std::max(m, static_cast<double>(std::fabs(a[i] - b[i])));
  return m;
}

int32_t argmax_of(std::span<const float> l) {
  return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
}

double top2_gap(std::span<const float> l) {
  std::vector<float> v(l.begin(), l.end());
  std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
  return v[0] - v[1];
}

void expect_same_checkpoint(const Checkpoint& a, const Checkpoint& b) {
  EXPECT_EQ(a.processed_tokens, b.processed_tokens);
  EXPECT_EQ(a.schema, b.schema);
  EXPECT_EQ(a.ns, b.ns);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) {
    const CheckpointTensor& u = b.tensors.at(name);
    EXPECT_EQ(t.shape, u.shape) << name;
    ASSERT_EQ(t.data.size(), u.data.size()) << name;
    EXPECT_EQ(std::memcmp(t.data.data(), u.data.data(), t.data.size() * sizeof(float)), 0)
        << name << " differs";
  }
}

// ---------------------------------------------------------------------------------------------
// Numerics against the PyTorch oracle.

// Row p of a drafter prefilled with tokens[0..p] and drafting from pending tokens[p+1] computes
// exactly MTP row p: (tokens[p+1], h_p) at position p. All 31 rows run as one batch.
void check_teacher_forced(int seq, bool reference_hidden) {
  const std::string s = std::to_string(seq);
  const auto tokens = ref_ids("tokens_" + s);
  const auto want = ref_floats("mtp_logits_" + s);
  const std::vector<float> hidden =
      reference_hidden ? ref_floats("hidden_" + s) : target_hidden(tokens);
  const int64_t H = demo().H, V = demo().V;
  const int n_rows = static_cast<int>(tokens.size()) - 1;
  auto rows = open_rows(*demo().mtp, n_rows);
  std::vector<RowPrefill> pre;
  std::vector<RowDraft> drafts;
  for (int p = 0; p < n_rows; ++p) {
    pre.push_back({p, std::span(tokens).first(static_cast<size_t>(p + 1)), hidden.data(), 0});
    drafts.push_back(greedy(tokens[static_cast<size_t>(p + 1)], 1));
  }
  rows->prefill(pre);
  for (int p = 0; p < n_rows; ++p) EXPECT_EQ(rows->mtp_rows(p), p);
  std::vector<DraftProposal> out;
  rows->draft(drafts, &out);
  const double scale = max_abs(want);
  double worst = 0;
  int compared = 0;
  for (int p = 0; p < n_rows; ++p) {
    const std::span<const float> got = rows->last_draft_logits(p, 0);
    const std::span<const float> ref(want.data() + p * V, static_cast<size_t>(V));
    worst = std::max(worst, max_diff(got, ref) / scale);
    ASSERT_EQ(out[p].tokens.size(), 1u);
    EXPECT_EQ(out[p].tokens[0], argmax_of(got));
    if (top2_gap(ref) > 1e-3) {
      EXPECT_EQ(argmax_of(got), argmax_of(ref)) << "seq " << seq << " row " << p;
      ++compared;
    }
  }
  EXPECT_GT(compared, n_rows / 2);
  EXPECT_LT(worst, 1e-4) << "seq " << seq << " (reference hidden: " << reference_hidden
                         << "): max logit error relative to scale " << scale;
  (void)H;
}

TEST(QwenMtp, TeacherForcedLogitsMatchPyTorchFromReferenceHidden) {
  check_teacher_forced(0, true);
  check_teacher_forced(1, true);
}

TEST(QwenMtp, TeacherForcedLogitsMatchPyTorchFromTargetHidden) {
  check_teacher_forced(0, false);
  check_teacher_forced(1, false);
}

// reference.json "chain": history rows 0..29, pending tokens_0[31], h_true = hidden_0[30],
// greedy depth 4.
TEST(QwenMtp, GreedyChainMatchesPyTorch) {
  const auto tokens = ref_ids("tokens_0");
  const auto hidden = target_hidden(tokens);
  const auto want_tokens = ref_ids("chain_tokens");
  const auto want_logits = ref_floats("chain_logits");
  const json& chain = demo().ref_json["chain"];
  ASSERT_EQ(chain["pending_token"].get<int32_t>(), tokens[31]);
  const int64_t V = demo().V;
  auto rows = open_rows(*demo().mtp, 1);
  const RowPrefill pre{0, std::span(tokens).first(31), hidden.data(), 0};
  rows->prefill({&pre, 1});
  EXPECT_EQ(rows->mtp_rows(0), 30);
  std::vector<DraftProposal> out;
  const RowDraft d = greedy(tokens[31], 4);
  rows->draft({&d, 1}, &out);
  EXPECT_EQ(out[0].tokens, want_tokens);
  const double scale = max_abs(want_logits);
  for (int j = 0; j < 4; ++j) {
    const std::span<const float> ref(want_logits.data() + j * V, static_cast<size_t>(V));
    EXPECT_LT(max_diff(rows->last_draft_logits(0, j), ref) / scale, 1e-4) << "step " << j;
  }
}

// A reduced draft vocabulary scores token ids 0..N-1: the head's first N rows, bitwise the full
// head's logits there on the CPU (its linear takes a row's dot products in the same order at
// any row count), and every proposal below N.
TEST(QwenMtp, ReducedDraftVocabularyScoresTheHeadsFirstRows) {
  Demo& d = demo();
  const int64_t H = d.H, V = d.V, N = 300;
  std::vector<float> hidden(static_cast<size_t>(3 * H));
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = std::sin(0.37f * static_cast<float>(i));
  std::vector<float> full(static_cast<size_t>(3 * V)), cut(static_cast<size_t>(3 * N));
  d.target->logits(hidden.data(), 3, full.data());
  d.target->logits_prefix(hidden.data(), 3, N, cut.data());
  for (int64_t r = 0; r < 3; ++r)
    EXPECT_EQ(0, std::memcmp(cut.data() + r * N, full.data() + r * V, sizeof(float) * N))
        << "row " << r;
  EXPECT_THROW(d.target->logits_prefix(hidden.data(), 1, V + 1, cut.data()), Error);

  const auto tokens = ref_ids("tokens_0");
  const auto target = target_hidden(tokens);
  auto rows = open_rows(*d.mtp, 1);
  rows->set_draft_vocabulary(N);
  const RowPrefill pre{0, std::span(tokens).first(31), target.data(), 0};
  rows->prefill({&pre, 1});
  std::vector<DraftProposal> out;
  const RowDraft in = greedy(tokens[31], 4);
  rows->draft({&in, 1}, &out);
  ASSERT_EQ(out.at(0).tokens.size(), 4u);
  for (int32_t t : out[0].tokens) EXPECT_LT(t, N) << "a proposal outside the draft vocabulary";
  EXPECT_EQ(rows->last_draft_logits(0, 0).size(), static_cast<size_t>(N));
  EXPECT_THROW(rows->set_draft_vocabulary(V + 1), Error);
}

// A hidden state of NaN (a broken target or tap) makes every step's logits NaN: the greedy chain,
// which embeds each step's argmax where it lies, reports the row instead of embedding id -1.
TEST(QwenMtp, GreedyChainReportsNaNLogits) {
  const auto tokens = ref_ids("tokens_0");
  const std::vector<float> good = target_hidden(tokens);
  std::vector<float> hidden = good;
  std::fill(hidden.begin() + 30 * demo().H, hidden.begin() + 31 * demo().H,
            std::numeric_limits<float>::quiet_NaN());
  auto rows = open_rows(*demo().mtp, 2);
  const std::vector<RowPrefill> pre = {{0, std::span(tokens).first(31), good.data(), 0},
                                       {1, std::span(tokens).first(31), hidden.data(), 0}};
  rows->prefill(pre);
  std::vector<DraftProposal> out;
  const std::vector<RowDraft> d = {greedy(tokens[31], 3), greedy(tokens[31], 3)};
  try {
    rows->draft(d, &out);
    FAIL() << "NaN logits were drafted from";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("row 1 hold NaN"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Batching: rows of different lengths and depths in one call give each row's numbers alone.

TEST(QwenMtp, BatchedRowsEqualRowsAlone) {
  const auto t0 = ref_ids("tokens_0"), t1 = ref_ids("tokens_1");
  const auto h0 = target_hidden(t0), h1 = target_hidden(t1);
  const int64_t V = demo().V;
  struct Case {
    const std::vector<int32_t>* tokens;
    const std::vector<float>* hidden;
    size_t n;
    int depth;
  };
  const Case cases[] = {{&t0, &h0, 20, 3}, {&t1, &h1, 27, 1}, {&t0, &h0, 9, 0}, {&t1, &h1, 31, 4}};
  auto batch = open_rows(*demo().mtp, 4);
  std::vector<RowPrefill> pre;
  std::vector<RowDraft> drafts;
  for (int b = 0; b < 4; ++b) {
    const Case& c = cases[b];
    pre.push_back({b, std::span(*c.tokens).first(c.n), c.hidden->data(), 0});
    drafts.push_back(greedy((*c.tokens)[c.n], c.depth, 100 + b));
  }
  batch->prefill(pre);
  std::vector<DraftProposal> out;
  batch->draft(drafts, &out);
  for (int b = 0; b < 4; ++b) {
    const Case& c = cases[b];
    auto alone = open_rows(*demo().mtp, 1);
    RowPrefill p = pre[b];
    p.row = 0;
    alone->prefill({&p, 1});
    std::vector<DraftProposal> o;
    alone->draft({&drafts[b], 1}, &o);
    EXPECT_EQ(o[0].tokens, out[b].tokens) << "row " << b;
    ASSERT_EQ(out[b].tokens.size(), static_cast<size_t>(c.depth));
    for (int j = 0; j < c.depth; ++j) {
      const auto a = alone->last_draft_logits(0, j), g = batch->last_draft_logits(b, j);
      EXPECT_EQ(std::memcmp(a.data(), g.data(), sizeof(float) * V), 0) << "row " << b;
    }
  }
}

// The engine's drafter shares its target's context, so each greedy chain runs whole (on CUDA
// as one graph); a block in a context of its own runs step by step. Both give the same
// proposals and draft logits, bit for bit, over rounds of rows that draft different depths.
TEST(QwenMtp, WholeChainsEqualStepByStep) {
  const std::vector<std::vector<int32_t>> prompts = {
      ref_ids("tokens_0"), ref_ids("tokens_1"), {ref_ids("tokens_0").front()}};
  int64_t whole = -1;
  const auto apart = test::mtp_rounds(*demo().mtp, *demo().target, prompts, 5, &whole);
  EXPECT_EQ(whole, 0);
  const ops::ContextScope scope(demo().model->context());
  const auto shared = QwenMtpProvider::from_target(*demo().target);
  int64_t folded = 0;
  const auto together =
      test::mtp_rounds(*shared, *demo().target, prompts, 5, &whole, {}, false, &folded);
  EXPECT_EQ(whole, 5);
  EXPECT_GT(folded, 0) << "no whole chain added a commit's completion rows";
  ASSERT_GT(apart.size(), 15u);
  EXPECT_EQ(together, apart);
}

// Sampled rows draft on the device too (each step's draws by ops::sample_rows with the key of its
// output index), whole or step by step, and propose exactly what the host's sample_token draws
// from the same logits (the path of rows that want their distribution).
TEST(QwenMtp, SampledChainsOnTheDeviceEqualHostDraws) {
  const std::vector<std::vector<int32_t>> prompts = {
      ref_ids("tokens_0"), ref_ids("tokens_1"), {ref_ids("tokens_0").front()}};
  SamplingParams sp;
  sp.temperature = 1.3f;
  sp.top_p = 0.95f;
  sp.seed = 99;
  int64_t whole = -1;
  const auto host = test::mtp_rounds(*demo().mtp, *demo().target, prompts, 6, &whole, sp, true);
  EXPECT_EQ(whole, 0);
  const auto apart = test::mtp_rounds(*demo().mtp, *demo().target, prompts, 6, &whole, sp);
  EXPECT_EQ(whole, 0);
  const ops::ContextScope scope(demo().model->context());
  const auto shared = QwenMtpProvider::from_target(*demo().target);
  const auto together = test::mtp_rounds(*shared, *demo().target, prompts, 6, &whole, sp);
  EXPECT_EQ(whole, 6);
  EXPECT_EQ(apart, host);
  EXPECT_EQ(together, host);
  // The draws are samples, not argmaxes: greedy rounds propose other tokens.
  const auto greedy = test::mtp_rounds(*demo().mtp, *demo().target, prompts, 6);
  EXPECT_NE(greedy, host);
}

// A block forward's rows for the attention of all rows at once: each token's position and KV
// slot, its row, and every row's table at one stride (the largest bound, in blocks), so table
// addresses hold still while rows grow below their bounds.
// Rounds settled on the device (DraftRows::settle, the engine's overlapped rounds) leave the
// drafter where host commits do: the same proposals every round and the same checkpoints, bit
// for bit, greedy and sampled, resolved at once or a round later.
TEST(QwenMtp, SettledRoundsEqualHostRounds) {
  const std::vector<std::vector<int32_t>> prompts = {
      ref_ids("tokens_0"), ref_ids("tokens_1"), {ref_ids("tokens_0").front()}};
  const std::vector<int> depths = {3, 3, 1, 2, 3, 3, 1, 3};
  const ops::ContextScope scope(demo().model->context());
  const auto shared = QwenMtpProvider::from_target(*demo().target);
  SamplingParams sampled;
  sampled.temperature = 1.3f;
  sampled.top_p = 0.95f;
  sampled.seed = 99;
  for (const SamplingParams& sp : {SamplingParams{}, sampled}) {
    const auto host = test::settled_mtp_rounds(*shared, *demo().target, prompts, depths, 0, sp);
    for (int lag : {1, 2}) {
      const auto settled =
          test::settled_mtp_rounds(*shared, *demo().target, prompts, depths, lag, sp);
      EXPECT_EQ(settled, host) << "lag " << lag << (sp.greedy() ? ", greedy" : ", sampled");
    }
  }
  // A drafter whose chains cannot run on the caller's stream does not settle.
  std::vector<spec::RowDraft> in(1);
  in[0].depth = 3;
  auto rows = demo().mtp->open_rows(*demo().target);
  rows->append(std::vector<spec::CheckpointPtr>(1));
  EXPECT_FALSE(rows->can_settle(in));
}

TEST(DraftKvPool, BatchLaysOutPositionsSlotsAndTablesAtOneStride) {
  DraftKvPool pool(2, 8);
  std::vector<int32_t> a, b, c;
  pool.reserve(a, 40);    // 3 blocks
  pool.reserve(b, 1030);  // 65 blocks: a bound of 2048
  pool.reserve(c, 5);
  const std::vector<int32_t>* tables[] = {&a, &b, &c};
  const int64_t lengths[] = {37, 1024, 0}, counts[] = {3, 2, 0};
  const AttentionBatch batch = pool.batch(tables, lengths, counts);
  ASSERT_EQ(batch.tokens, 5);
  ASSERT_EQ(batch.segments.size(), 3u);
  EXPECT_EQ(batch.rows.table_stride, 2048 / DraftKvPool::kBlockSize);
  const int64_t want_pos[] = {37, 38, 39, 1024, 1025};
  const int64_t want_row[] = {0, 0, 0, 1, 1};
  for (int t = 0; t < 5; ++t) {
    EXPECT_EQ(batch.positions[t], want_pos[t]) << t;
    EXPECT_EQ(batch.rows.query_rows[t], want_row[t]) << t;
    const std::vector<int32_t>& table = t < 3 ? a : b;
    const int64_t p = want_pos[t];
    EXPECT_EQ(batch.kv_slots[t], int64_t{table[p / 16]} * 16 + p % 16) << t;
  }
  for (int r = 0; r < 3; ++r) {
    const AttentionSegment& s = batch.segments[static_cast<size_t>(r)];
    EXPECT_EQ(s.block_table, batch.rows.tables + r * batch.rows.table_stride);
    EXPECT_EQ(s.start, lengths[r]);
    EXPECT_EQ(s.n, counts[r]);
    const std::vector<int32_t>& table = *tables[r];
    for (size_t i = 0; i < table.size(); ++i) EXPECT_EQ(s.block_table[i], table[i]) << r;
  }
  EXPECT_EQ(batch.segments[0].position_bound, 1024);
  EXPECT_EQ(batch.segments[1].position_bound, 2048);
  // A table that cannot hold the new positions is a caller's bug, caught before any upload.
  const int64_t too_far[] = {37, 1024, 80};
  EXPECT_THROW(pool.batch(tables, too_far, counts), Error);
}

// ---------------------------------------------------------------------------------------------
// Commit semantics (DESIGN.md §5.4).

struct Round {
  std::vector<int32_t> prompt;  // processed tokens
  std::vector<float> prompt_hidden;
  CheckpointPtr start;  // drafter state after prefilling `prompt`
  int32_t pending = 0;
};

Round make_round(size_t n) {
  Round r;
  const auto tokens = ref_ids("tokens_0");
  r.prompt.assign(tokens.begin(), tokens.begin() + static_cast<long>(n));
  r.prompt_hidden = target_hidden(r.prompt);
  r.pending = tokens[n];
  auto rows = open_rows(*demo().mtp, 1);
  const RowPrefill pre{0, r.prompt, r.prompt_hidden.data(), 0};
  rows->prefill({&pre, 1});
  r.start = rows->capture(0);
  return r;
}

// The target's hiddens over a verify window [pending, proposals...] after the prompt.
std::vector<float> window_hidden(const Round& r, std::span<const int32_t> window) {
  std::vector<int32_t> all = r.prompt;
  all.insert(all.end(), window.begin(), window.end());
  const std::vector<float> h = target_hidden(all);
  return {h.end() - static_cast<long>(window.size() * demo().H), h.end()};
}

// Drafts `depth` from r.start, verifies with the true target hiddens, accepts `accepted`.
std::unique_ptr<QwenMtpRows> run_round(const Round& r, int depth, int accepted,
                                       std::vector<int32_t>* window_out = nullptr,
                                       std::vector<float>* hidden_out = nullptr) {
  auto rows = restore(*demo().mtp, r.start);
  std::vector<DraftProposal> out;
  const RowDraft d = greedy(r.pending, depth);
  rows->draft({&d, 1}, &out);
  std::vector<int32_t> window{r.pending};
  window.insert(window.end(), out[0].tokens.begin(), out[0].tokens.end());
  const std::vector<float> hidden = window_hidden(r, window);
  const VerifyRow v{window, hidden.data(), accepted, 7};
  rows->commit({&v, 1});
  // Invariant: rows = processed - 1 with processed = prompt + 1 + accepted.
  EXPECT_EQ(rows->mtp_rows(0), static_cast<int64_t>(r.prompt.size()) + accepted);
  const CheckpointPtr c = rows->capture(0);
  EXPECT_EQ(c->processed_tokens, static_cast<int64_t>(r.prompt.size()) + 1 + accepted);
  const auto& h = c->tensors.at("h_true").data;
  EXPECT_EQ(std::memcmp(h.data(), hidden.data() + accepted * demo().H, sizeof(float) * demo().H), 0)
      << "h_true must be the verify hidden at the last accepted position";
  if (window_out) *window_out = window;
  if (hidden_out) *hidden_out = hidden;
  return rows;
}

// Depth 0 appends the pending token's row: the same state as prefilling one more token.
TEST(QwenMtpCommit, DepthZeroEqualsPrefillingThePendingToken) {
  const Round r = make_round(20);
  auto rows = run_round(r, 0, 0);
  std::vector<int32_t> longer = r.prompt;
  longer.push_back(r.pending);
  const auto h = target_hidden(longer);
  auto ref = open_rows(*demo().mtp, 1);
  const RowPrefill pre{0, longer, h.data(), 0};
  ref->prefill({&pre, 1});
  expect_same_checkpoint(*rows->capture(0), *ref->capture(0));
}

// Rejecting everything keeps only the pending token's drafted row: same as a depth-0 round.
TEST(QwenMtpCommit, AcceptNoneEqualsDepthZero) {
  const Round r = make_round(20);
  expect_same_checkpoint(*run_round(r, 3, 0)->capture(0), *run_round(r, 0, 0)->capture(0));
}

// Accepting a of k keeps the first a+1 drafted rows: the same as drafting a+1 and accepting a.
TEST(QwenMtpCommit, AcceptSomeKeepsTheDraftedRows) {
  const Round r = make_round(21);
  expect_same_checkpoint(*run_round(r, 4, 2)->capture(0), *run_round(r, 3, 2)->capture(0));
  expect_same_checkpoint(*run_round(r, 4, 1)->capture(0), *run_round(r, 2, 1)->capture(0));
}

// Accepting all k adds the last proposal's row from the TRUE verify hidden at window position
// k-1. Built another way: draft k+1, accept k-1 (keeps k drafted rows, h_true = H_{k-1}), then a
// depth-0 round with pending d_{k-1} (appends (d_{k-1}, H_{k-1})).
TEST(QwenMtpCommit, AcceptAllAppendsTheMissingRowFromTheTrueHidden) {
  const Round r = make_round(22);
  const int k = 3;
  std::vector<int32_t> window;
  std::vector<float> hidden;
  auto all = run_round(r, k, k, &window, &hidden);

  auto other = restore(*demo().mtp, r.start);
  std::vector<DraftProposal> out;
  const RowDraft d = greedy(r.pending, k + 1);
  other->draft({&d, 1}, &out);
  ASSERT_TRUE(std::equal(window.begin() + 1, window.end(), out[0].tokens.begin()));
  std::vector<int32_t> w2{r.pending};
  w2.insert(w2.end(), out[0].tokens.begin(), out[0].tokens.end());
  std::vector<float> h2 = window_hidden(r, w2);
  const VerifyRow v2{w2, h2.data(), k - 1, window[k]};
  other->commit({&v2, 1});
  const RowDraft d0 = greedy(window[k], 0);
  other->draft({&d0, 1}, &out);
  EXPECT_TRUE(out[0].tokens.empty());
  // The depth-0 window [d_{k-1}] sits at window position k of the first round.
  const VerifyRow v3{std::span(window).subspan(k, 1), hidden.data() + k * demo().H, 0, 7};
  other->commit({&v3, 1});
  expect_same_checkpoint(*all->capture(0), *other->capture(0));
}

// The target's logits and hiddens for every position of s, computed from scratch (the reference
// a speculative loop's acceptance and verify hiddens come from).
ForwardOutput greedy_forward(const std::vector<int32_t>& s) {
  Qwen35State st(demo().model->config(), RecurrentRollback::PerPositionStates, DType::F32);
  const RowInput row{st.open_row(), static_cast<int64_t>(s.size())};
  ForwardOutput o;
  demo().model->forward(st, {s, {&row, 1}, true, true}, &o);
  return o;
}

// A drafter that went through rounds continues like a fresh drafter restored from its checkpoint.
TEST(QwenMtpCommit, SpeculativeLoopKeepsAlignmentAndRestoresIdentically) {
  const auto tokens = ref_ids("tokens_1");
  std::vector<int32_t> seq(tokens.begin(), tokens.begin() + 12);
  auto rows = open_rows(*demo().mtp, 1);
  std::vector<float> h = target_hidden(seq);
  const RowPrefill pre{0, seq, h.data(), 0};
  rows->prefill({&pre, 1});
  // Greedy target continuation decides acceptance; the hiddens come from full recomputes.
  const ForwardOutput first = greedy_forward(seq);
  int32_t pending =
      argmax_of(std::span(first.logits).subspan((seq.size() - 1) * demo().V, demo().V));
  int accepted_total = 0, drafted_total = 0;
  for (int round = 0; round < 8; ++round) {
    const int depth = round % 5;  // includes depth 0
    std::vector<DraftProposal> out;
    const RowDraft d = greedy(pending, depth, seq.size());
    rows->draft({&d, 1}, &out);
    std::vector<int32_t> window{pending};
    window.insert(window.end(), out[0].tokens.begin(), out[0].tokens.end());
    std::vector<int32_t> all = seq;
    all.insert(all.end(), window.begin(), window.end());
    const ForwardOutput o = greedy_forward(all);
    const int64_t base = static_cast<int64_t>(seq.size());
    int a = 0;
    int32_t next = 0;
    for (int j = 0; j <= depth; ++j) {
      next = argmax_of(std::span(o.logits).subspan((base + j) * demo().V, demo().V));
      if (j < depth && next == window[j + 1]) {
        ++a;
        continue;
      }
      break;
    }
    const VerifyRow v{window, o.hidden.data() + base * demo().H, a, next};
    rows->commit({&v, 1});
    seq.insert(seq.end(), window.begin(), window.begin() + a + 1);
    pending = next;
    accepted_total += a;
    drafted_total += depth;
    EXPECT_EQ(rows->mtp_rows(0), static_cast<int64_t>(seq.size()) - 1) << "round " << round;
  }
  EXPECT_GT(accepted_total, 0) << "of " << drafted_total;
  // Capture, restore into a fresh row, continue both: identical drafts and logits.
  auto restored = restore(*demo().mtp, rows->capture(0));
  std::vector<DraftProposal> a, b;
  const RowDraft d = greedy(pending, 4, seq.size());
  rows->draft({&d, 1}, &a);
  restored->draft({&d, 1}, &b);
  EXPECT_EQ(a[0].tokens, b[0].tokens);
  for (int j = 0; j < 4; ++j) {
    const auto x = rows->last_draft_logits(0, j), y = restored->last_draft_logits(0, j);
    EXPECT_EQ(std::memcmp(x.data(), y.data(), sizeof(float) * demo().V), 0) << "step " << j;
  }
}

// A commit's completion rows (the last proposal's when a row accepted all, the pending token's
// at depth 0) computed by the next chain's step 0 give what computing them at commit gives: the
// same proposals, draft logits, row counts and checkpoints, over two rows whose completions are
// due in some rounds and not in others (a row without one is parked past its chain) and rounds
// of depth 0, where the drafter computes them before its host path.
TEST(QwenMtpCommit, FoldedCompletionRowsEqualCommittedOnes) {
  const auto tokens = ref_ids("tokens_1");
  const int R = 2;
  std::vector<std::vector<int32_t>> seq = {{tokens.begin(), tokens.begin() + 12},
                                           {tokens.begin() + 3, tokens.begin() + 20}};
  // Chains run whole (and fold) where the drafter shares its target's context.
  const ops::ContextScope scope(demo().model->context());
  const auto shared = QwenMtpProvider::from_target(*demo().target);
  auto folded = open_rows(*shared, R), plain = open_rows(*shared, R);
  plain->set_fold_completions(false);
  std::vector<int32_t> pending(R);
  for (int b = 0; b < R; ++b) {
    const std::vector<float> h = target_hidden(seq[b]);
    const RowPrefill pre{b, seq[b], h.data(), 0};
    folded->prefill({&pre, 1});
    plain->prefill({&pre, 1});
    const ForwardOutput o = greedy_forward(seq[b]);
    pending[b] = argmax_of(std::span(o.logits).subspan((seq[b].size() - 1) * demo().V, demo().V));
  }
  int all_accepted = 0, some_rejected = 0;
  for (int round = 0; round < 10; ++round) {
    const int depth = round % 4;  // includes depth 0
    std::vector<RowDraft> d;
    for (int b = 0; b < R; ++b) d.push_back(greedy(pending[b], depth, seq[b].size()));
    std::vector<DraftProposal> out, want;
    folded->draft(d, &out);
    plain->draft(d, &want);
    std::vector<std::vector<int32_t>> windows(R);
    std::vector<ForwardOutput> outs(R);
    std::vector<VerifyRow> v;
    for (int b = 0; b < R; ++b) {
      ASSERT_EQ(out[b].tokens, want[b].tokens) << "round " << round << " row " << b;
      for (int j = 0; j < depth; ++j) {
        const auto x = folded->last_draft_logits(b, j), y = plain->last_draft_logits(b, j);
        ASSERT_EQ(std::memcmp(x.data(), y.data(), sizeof(float) * demo().V), 0)
            << "round " << round << " row " << b << " step " << j;
      }
      windows[b] = {pending[b]};
      windows[b].insert(windows[b].end(), out[b].tokens.begin(), out[b].tokens.end());
      std::vector<int32_t> all = seq[b];
      all.insert(all.end(), windows[b].begin(), windows[b].end());
      outs[b] = greedy_forward(all);
    }
    for (int b = 0; b < R; ++b) {
      const int64_t base = static_cast<int64_t>(seq[b].size());
      int a = 0;
      int32_t next = 0;
      for (int j = 0; j <= depth; ++j) {
        next = argmax_of(std::span(outs[b].logits).subspan((base + j) * demo().V, demo().V));
        if (j < depth && next == windows[b][j + 1]) {
          ++a;
          continue;
        }
        break;
      }
      // Row 1 rejects its last proposal on purpose in odd rounds: a round that folds one row's
      // completion and parks the other's.
      if (b == 1 && round % 2 == 1 && depth > 0 && a == depth) {
        --a;
        next = windows[b][a + 1] == 0 ? 1 : 0;
      }
      if (depth > 0) (a == depth ? all_accepted : some_rejected)++;
      v.push_back({windows[b], outs[b].hidden.data() + base * demo().H, a, next});
      seq[b].insert(seq[b].end(), windows[b].begin(), windows[b].begin() + a + 1);
      pending[b] = next;
    }
    folded->commit(v);
    plain->commit(v);
    for (int b = 0; b < R; ++b) {
      EXPECT_EQ(folded->mtp_rows(b), plain->mtp_rows(b)) << "round " << round << " row " << b;
      EXPECT_EQ(folded->mtp_rows(b), static_cast<int64_t>(seq[b].size()) - 1);
    }
  }
  EXPECT_GT(all_accepted, 0);
  EXPECT_GT(some_rejected, 0);
  EXPECT_GT(folded->folded_chains(), 0) << "no chain computed a completion row";
  EXPECT_EQ(plain->folded_chains(), 0);
  for (int b = 0; b < R; ++b) expect_same_checkpoint(*folded->capture(b), *plain->capture(b));
}

// A restored row continues its prefill from the checkpoint: same state as one prefill.
TEST(QwenMtpCommit, PrefillContinuesARestoredRow) {
  const auto tokens = ref_ids("tokens_1");
  const auto h = target_hidden(tokens);
  auto whole = open_rows(*demo().mtp, 1);
  const RowPrefill all{0, std::span(tokens).first(30), h.data(), 0};
  whole->prefill({&all, 1});
  auto part = open_rows(*demo().mtp, 1);
  const RowPrefill first{0, std::span(tokens).first(13), h.data(), 0};
  part->prefill({&first, 1});
  auto rest = restore(*demo().mtp, part->capture(0));
  const RowPrefill second{0, std::span(tokens).subspan(13, 17), h.data() + 13 * demo().H, 13};
  rest->prefill({&second, 1});
  expect_same_checkpoint(*whole->capture(0), *rest->capture(0));
}

// Sampled drafts use the request's keys (seed, first_index + j) and return q when asked.
TEST(QwenMtpCommit, SampledDraftsAreKeyedAndReturnDistributions) {
  const Round r = make_round(20);
  RowDraft d = greedy(r.pending, 3, 40);
  d.sampling.temperature = 0.8f;
  d.sampling.seed = 1234;
  d.want_distribution = true;
  auto a = restore(*demo().mtp, r.start), b = restore(*demo().mtp, r.start);
  std::vector<DraftProposal> x, y;
  a->draft({&d, 1}, &x);
  b->draft({&d, 1}, &y);
  EXPECT_EQ(x[0].tokens, y[0].tokens);
  ASSERT_EQ(x[0].q.size(), 3u);
  for (int j = 0; j < 3; ++j) {
    const auto l = a->last_draft_logits(0, j);
    EXPECT_EQ(x[0].tokens[j], sample_token(l, d.sampling, 40 + j));
    double sum = 0;
    for (const TokenProb& t : x[0].q[j]) sum += t.prob;
    EXPECT_NEAR(sum, 1.0, 1e-9);
  }
}

// ---------------------------------------------------------------------------------------------
// Checkpoint refusals and all-or-nothing appends.

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(QwenMtpCheckpoint, RestoreRefusesMismatches) {
  const Round r = make_round(10);
  auto rows = open_rows(*demo().mtp, 1);
  auto refused = [&](Checkpoint c) {
    auto cp = std::make_shared<const Checkpoint>(std::move(c));
    const CheckpointPtr list[] = {nullptr, cp};
    const std::string msg =
        error_of([&] { apply_changes({[&] { return rows->prepare_append(list); }}); });
    EXPECT_EQ(rows->row_count(), 1) << "a refused append must change nothing";
    return msg;
  };
  Checkpoint c = *r.start;
  c.schema = "ngram-history-v1";
  EXPECT_NE(refused(c).find("schema"), std::string::npos);
  c = *r.start;
  c.ns = "qwen-mtp-v1:other-weights";
  EXPECT_NE(refused(c).find("namespace"), std::string::npos);
  c = *r.start;
  c.processed_tokens += 1;
  EXPECT_NE(refused(c).find("alignment"), std::string::npos);
  c = *r.start;
  c.tensors.erase("h_true");
  EXPECT_NE(refused(c).find("h_true"), std::string::npos);
  c = *r.start;
  c.tensors["kv_values"].shape[1] += 1;
  EXPECT_NE(refused(c).find("kv_values"), std::string::npos);
  // The same checkpoint restores fine, and the namespace names the drafter weights.
  EXPECT_EQ(r.start->ns.rfind("qwen-mtp-v1:", 0), 0u);
  EXPECT_EQ(restore(*demo().mtp, r.start)->mtp_rows(0), 9);
}

// A row that adopts a cached prefix (no checkpoint of its namespace) holds rows from the boundary
// on, at rotary positions counted from it: it drafts exactly as a cold row given only the tokens
// after the boundary, and its checkpoint says where its history starts.
TEST(QwenMtpCommit, AdoptedPrefixStartsTheHistoryAtTheBoundary) {
  const auto tokens = ref_ids("tokens_1");
  const auto h = target_hidden(tokens);
  const int64_t H = demo().H;
  auto adopted = open_rows(*demo().mtp, 1);
  adopted->adopt_prefix(0, std::span(tokens).first(12));
  EXPECT_FALSE(adopted->adopts_exactly());
  EXPECT_THROW(adopted->adopt_prefix(0, std::span(tokens).first(12)), Error);
  const RowPrefill wrong{0, std::span(tokens).first(12), h.data(), 0};
  EXPECT_NE(error_of([&] {
              adopted->prefill({&wrong, 1});
            }).find("covers 12 tokens"),
            std::string::npos);
  // One token: no (token, hidden) pair yet, only the hidden to continue from.
  const RowPrefill one{0, std::span(tokens).subspan(12, 1), h.data() + 12 * H, 12};
  adopted->prefill({&one, 1});
  EXPECT_EQ(adopted->mtp_rows(0), 0);
  const RowPrefill more{0, std::span(tokens).subspan(13, 15), h.data() + 13 * H, 13};
  adopted->prefill({&more, 1});
  EXPECT_EQ(adopted->mtp_rows(0), 15);

  // Its checkpoint covers 28 tokens from token 12 and restores to the same row.
  const CheckpointPtr c = adopted->capture(0);
  EXPECT_EQ(c->processed_tokens, 28);
  EXPECT_EQ(c->history_from, 12);
  auto restored = restore(*demo().mtp, c);
  expect_same_checkpoint(*restored->capture(0), *c);

  auto shifted = open_rows(*demo().mtp, 1);
  const RowPrefill same{0, std::span(tokens).subspan(12, 16), h.data() + 12 * H, 0};
  shifted->prefill({&same, 1});
  const RowDraft d = greedy(tokens[28], 4);
  for (QwenMtpRows* rows : {adopted.get(), restored.get()}) {
    std::vector<DraftProposal> a, b;
    rows->draft({&d, 1}, &a);
    shifted->draft({&d, 1}, &b);
    EXPECT_EQ(a[0].tokens, b[0].tokens);
    for (int j = 0; j < 4; ++j) {
      const auto la = rows->last_draft_logits(0, j), lb = shifted->last_draft_logits(0, j);
      EXPECT_TRUE(std::equal(la.begin(), la.end(), lb.begin(), lb.end())) << "step " << j;
    }
    // A fresh reference row for the next comparison.
    shifted = open_rows(*demo().mtp, 1);
    shifted->prefill({&same, 1});
  }
}

// filter_rows keeps the listed rows in the listed order, states intact; released rows' KV
// blocks are reused by rows appended later.
TEST(QwenMtpCheckpoint, FilterRowsKeepsStatesInOrder) {
  const auto tokens = ref_ids("tokens_0");
  const auto h = target_hidden(tokens);
  auto rows = open_rows(*demo().mtp, 3);
  std::vector<RowPrefill> pre;
  for (int b = 0; b < 3; ++b)
    pre.push_back({b, std::span(tokens).first(static_cast<size_t>(10 + 5 * b)), h.data(), 0});
  rows->prefill(pre);
  const CheckpointPtr c0 = rows->capture(0), c2 = rows->capture(2);
  const int keep[] = {2, 0};
  rows->filter_rows(keep);
  ASSERT_EQ(rows->row_count(), 2);
  expect_same_checkpoint(*rows->capture(0), *c2);
  expect_same_checkpoint(*rows->capture(1), *c0);
  const CheckpointPtr again[] = {c2};
  apply_changes({[&] { return rows->prepare_append(again); }});
  expect_same_checkpoint(*rows->capture(2), *c2);
  expect_same_checkpoint(*rows->capture(1), *c0);
  const int bad[] = {0, 0};
  EXPECT_THROW(rows->filter_rows(bad), Error);
}

TEST(QwenMtpCheckpoint, NamespaceDependsOnTheTap) {
  auto pre = QwenMtpProvider::from_target(*demo().target, HiddenTap::PreNorm);
  EXPECT_NE(pre->checkpoint_namespace(), demo().mtp->checkpoint_namespace());
  EXPECT_EQ(pre->tap(), HiddenTap::PreNorm);
  EXPECT_EQ(pre->open_rows(*demo().target)->taps().hidden, HiddenTap::PreNorm);
  EXPECT_GT(demo().mtp->weights_bytes(), 3000000u);  // 1.72M parameters in bf16
}

// A prefill given the target's hiddens in backend memory (RowPrefill::hidden_device, the
// engine's prompt forwards) leaves the states a prefill from host copies does: cold rows,
// a row continuing in a second chunk, and a row too short to hold an MTP row yet.
TEST(QwenMtpCheckpoint, PrefillFromBackendHiddensEqualsHostHiddens) {
  const auto tokens = ref_ids("tokens_0");
  const auto h = target_hidden(tokens);
  const int64_t H = demo().H;
  Buffer<float> dev(static_cast<int64_t>(h.size()));
  ops::copy_from_host(dev.data(), h.data(), sizeof(float) * h.size());
  auto host = open_rows(*demo().mtp, 3), device = open_rows(*demo().mtp, 3);
  // Calls of the rows' chunks: [0, 12) | [0, 1) | [0, 20), then [12, 30) | [1, 9).
  auto chunk = [&](int row, size_t from, size_t n, bool on_device) {
    RowPrefill p{row, std::span(tokens).subspan(from, n), nullptr, static_cast<int64_t>(from)};
    if (on_device)
      p.hidden_device = dev.data() + static_cast<int64_t>(from) * H;
    else
      p.hidden = h.data() + from * static_cast<size_t>(H);
    return p;
  };
  for (bool on_device : {false, true}) {
    QwenMtpRows& rows = on_device ? *device : *host;
    const RowPrefill first[] = {chunk(0, 0, 12, on_device), chunk(1, 0, 1, on_device),
                                chunk(2, 0, 20, on_device)};
    rows.prefill(first);
    const RowPrefill second[] = {chunk(0, 12, 18, on_device), chunk(1, 1, 8, on_device)};
    rows.prefill(second);
  }
  for (int b = 0; b < 3; ++b) expect_same_checkpoint(*device->capture(b), *host->capture(b));
  EXPECT_EQ(device->mtp_rows(0), 29);
  EXPECT_EQ(device->mtp_rows(1), 8);

  // Every row's hiddens in one place: one row on the device only and one on the host only is
  // refused before anything changes.
  auto mixed = open_rows(*demo().mtp, 2);
  const RowPrefill both[] = {chunk(0, 0, 10, true), chunk(1, 0, 10, false)};
  EXPECT_NE(error_of([&] { mixed->prefill(both); }).find("backend memory only"), std::string::npos);
  EXPECT_EQ(mixed->mtp_rows(0), 0);
}

// Rows copied from one group of the drafter into another (an engine's prefill group into its
// decoding group) hold what a checkpoint carries, copied where the KV lives: the same state, the
// same drafts, independent of the source afterwards; a refused copy changes nothing.
TEST(QwenMtpCheckpoint, CopiedRowsEqualCheckpointedRows) {
  const auto tokens = ref_ids("tokens_0");
  const auto h = target_hidden(tokens);
  auto source = open_rows(*demo().mtp, 3);
  std::vector<RowPrefill> pre;
  const size_t lengths[] = {9, 17, 26};  // MTP rows 8, 16, 25: within, at and across KV blocks
  for (int b = 0; b < 3; ++b) pre.push_back({b, std::span(tokens).first(lengths[b]), h.data(), 0});
  source->prefill(pre);
  const CheckpointPtr c0 = source->capture(0), c2 = source->capture(2);
  auto target = open_rows(*demo().mtp, 1);  // a row already there keeps its place
  const RowPrefill first{0, std::span(tokens).first(5), h.data(), 0};
  target->prefill({&first, 1});
  const CheckpointPtr t0 = target->capture(0);

  const int bad[] = {2, 3};
  EXPECT_NE(error_of([&] { target->copy_rows(*source, bad); }).find("row 3 does not exist"),
            std::string::npos);
  auto prenorm = QwenMtpProvider::from_target(*demo().target, HiddenTap::PreNorm);
  auto other = prenorm->open_rows(*demo().target);
  const int none[] = {0};
  EXPECT_NE(error_of([&] { other->copy_rows(*source, none); }).find("namespace"),
            std::string::npos);
  EXPECT_EQ(target->row_count(), 1) << "a refused copy must change nothing";
  EXPECT_EQ(other->row_count(), 0);

  const int rows[] = {2, 0};
  target->copy_rows(*source, rows);
  ASSERT_EQ(target->row_count(), 3);
  EXPECT_EQ(target->rows_copied_in_place(), 2) << "rows of one drafter copy in backend memory";
  expect_same_checkpoint(*target->capture(0), *t0);
  expect_same_checkpoint(*target->capture(1), *c2);
  expect_same_checkpoint(*target->capture(2), *c0);
  expect_same_checkpoint(*source->capture(0), *c0);

  // The source's rows go and their blocks are written by a new row: the copies keep their own.
  const int keep[] = {1};
  source->filter_rows(keep);
  apply_changes({[&] { return source->prepare_append(std::vector<CheckpointPtr>(1)); }});
  const RowPrefill refill{1, std::span(tokens).subspan(3, 28), h.data() + 3 * demo().H, 0};
  source->prefill({&refill, 1});
  expect_same_checkpoint(*target->capture(1), *c2);

  auto restored = restore(*demo().mtp, c2);
  const RowDraft drafts[] = {greedy(tokens[5], 3), greedy(tokens[26], 3), greedy(tokens[9], 3)};
  std::vector<DraftProposal> copied, alone;
  target->draft(drafts, &copied);
  restored->draft({&drafts[1], 1}, &alone);
  EXPECT_EQ(copied[1].tokens, alone[0].tokens);
  for (int j = 0; j < 3; ++j) {
    const auto a = target->last_draft_logits(1, j), b = restored->last_draft_logits(0, j);
    EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end())) << "step " << j;
  }
}

TEST(QwenMtp, CheckpointWithoutMtpLayerIsRefused) {
  auto model = Qwen35Model::load(std::string(TANDEM_FIXTURES_DIR) + "/qwen35_gqa_f16");
  const QwenTargetView view(*model, "x");
  const std::string msg = error_of([&] { QwenMtpProvider::from_target(view); });
  EXPECT_NE(msg.find("has no MTP layer (mtp_num_hidden_layers = 0)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--draft-model"), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------------
// Companion directories.

// Rewrites a companion's tensors: `edit(name, view)` returns replacement (dtype, shape, bytes)
// or nothing to copy the tensor as is; `extra` tensors are appended.
struct NewTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

template <class T>
std::vector<std::byte> as_bytes(const std::vector<T>& v) {
  std::vector<std::byte> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

void write_tensors(const std::string& path, const std::vector<NewTensor>& ts) {
  std::vector<TensorToWrite> w;
  for (const NewTensor& t : ts) w.push_back({t.name, t.dtype, t.shape, t.bytes});
  write_safetensors(path, w);
}

// The companion's tensors with norms replaced by exact fp32 (1 + w) from the target's mtp.*.
std::vector<NewTensor> exact_companion_tensors(const std::string& companion) {
  auto file = SafetensorsFile::open(companion + "/model.safetensors");
  const WeightStore& target = demo().model->weights();
  const auto& norms = mtp_norm_names();
  std::vector<NewTensor> out;
  for (const TensorView& t : file->tensors()) {
    NewTensor n{t.name, t.dtype, t.shape, {}};
    if (std::find(norms.begin(), norms.end(), t.name) != norms.end()) {
      std::vector<float> w = to_f32(target.get("mtp." + t.name));
      for (float& x : w) x = 1.0f + x;
      n.dtype = DType::F32;
      n.bytes = as_bytes(w);
    } else {
      const auto* p = static_cast<const std::byte*>(t.data);
      n.bytes.assign(p, p + t.nbytes);
    }
    out.push_back(std::move(n));
  }
  return out;
}

// Drafts from the chain setup; returns logits of every step.
std::vector<std::vector<float>> chain_logits(const QwenMtpProvider& p,
                                             std::vector<int32_t>* tokens_out) {
  const auto tokens = ref_ids("tokens_0");
  const auto hidden = target_hidden(tokens);
  auto rows = open_rows(p, 1);
  const RowPrefill pre{0, std::span(tokens).first(31), hidden.data(), 0};
  rows->prefill({&pre, 1});
  std::vector<DraftProposal> out;
  const RowDraft d = greedy(tokens[31], 4);
  rows->draft({&d, 1}, &out);
  *tokens_out = out[0].tokens;
  std::vector<std::vector<float>> l;
  for (int j = 0; j < 4; ++j) {
    const auto s = rows->last_draft_logits(0, j);
    l.emplace_back(s.begin(), s.end());
  }
  return l;
}

TEST(QwenMtpCompanion, SplitThenLoadDraftsLikeTheCheckpoint) {
  ScratchDir dir("mtp-split");
  const std::string out = dir.file("companion");
  const MtpSplitResult res = write_mtp_companion(kDemo, out);
  EXPECT_EQ(res.tensors, 15);
  const json cfg = json::parse(std::ifstream(out + "/config.json"));
  EXPECT_EQ(cfg["model_type"], "qwen3_5_mtp");
  EXPECT_EQ(cfg["block_size"], 4);
  EXPECT_EQ(cfg["text_config"]["hidden_size"], 384);
  // Names lose `mtp.`; norms hold 1 + w rounded to the stored dtype; projections are copied.
  auto file = SafetensorsFile::open(out + "/model.safetensors");
  const WeightStore& target = demo().model->weights();
  for (const TensorView& t : file->tensors()) {
    const TensorView& src = target.get("mtp." + t.name);
    EXPECT_EQ(t.dtype, src.dtype) << t.name;
    const auto& norms = mtp_norm_names();
    if (std::find(norms.begin(), norms.end(), t.name) != norms.end()) {
      const auto w = to_f32(src), got = to_f32(t);
      for (size_t i = 0; i < w.size(); ++i)
        ASSERT_EQ(got[i], bf16_to_f32(f32_to_bf16(1.0f + w[i]))) << t.name;
    } else {
      EXPECT_EQ(std::memcmp(t.data, src.data, t.nbytes), 0) << t.name;
    }
  }
  auto companion = QwenMtpProvider::from_companion(out);
  EXPECT_EQ(companion->suggested_depth(), 3);
  EXPECT_NE(companion->checkpoint_namespace(), demo().mtp->checkpoint_namespace());
  std::vector<int32_t> a, b;
  const auto la = chain_logits(*demo().mtp, &a);
  const auto lb = chain_logits(*companion, &b);
  // bf16 rounding of 1 + w moves the numbers a little; the greedy chain (gaps >= 0.15) holds.
  EXPECT_EQ(a, b);
  for (int j = 0; j < 4; ++j) EXPECT_LT(max_diff(la[j], lb[j]) / max_abs(la[j]), 2e-2);

  // With the norms in fp32 the companion computes exactly what the checkpoint's layer does.
  const std::string exact = dir.file("exact");
  fs::create_directories(exact);
  fs::copy_file(out + "/config.json", exact + "/config.json");
  write_tensors(exact + "/model.safetensors", exact_companion_tensors(out));
  auto exact_p = QwenMtpProvider::from_companion(exact);
  std::vector<int32_t> c;
  const auto lc = chain_logits(*exact_p, &c);
  EXPECT_EQ(a, c);
  for (int j = 0; j < 4; ++j)
    EXPECT_EQ(std::memcmp(la[j].data(), lc[j].data(), sizeof(float) * la[j].size()), 0);

  // mtp-split refuses a non-empty output directory and a checkpoint without mtp.*.
  EXPECT_NE(error_of([&] { write_mtp_companion(kDemo, out); }).find("not an empty directory"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              write_mtp_companion(std::string(TANDEM_FIXTURES_DIR) + "/qwen35_gqa_f16",
                                  dir.file("none"));
            }).find("no mtp.* tensors"),
            std::string::npos);
}

// MLX affine quantization of a [rows, cols] fp32 matrix: per group of `gs` columns, scale =
// (max - min) / (2^bits - 1), bias = min, q = round((w - bias) / scale). Returns packed uint32
// words (little-endian bit stream per row), scales, biases, and the dequantized matrix computed
// as the kernel does (scale * q + bias in fp32).
struct Quantized {
  std::vector<uint32_t> packed;
  std::vector<float> scales, biases, dequant;
};

Quantized quantize(const std::vector<float>& w, int64_t rows, int64_t cols, int bits, int64_t gs) {
  Quantized q;
  const int64_t groups = cols / gs, words = cols * bits / 32;
  q.packed.assign(static_cast<size_t>(rows * words), 0);
  q.dequant.resize(w.size());
  const uint32_t qmax = (1u << bits) - 1u;
  for (int64_t r = 0; r < rows; ++r) {
    auto* row = reinterpret_cast<uint8_t*>(q.packed.data() + r * words);
    for (int64_t g = 0; g < groups; ++g) {
      float lo = w[r * cols + g * gs], hi = lo;
      for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
        lo = std::min(lo, w[r * cols + c]);
        hi = std::max(hi, w[r * cols + c]);
      }
      const float scale = hi > lo ? (hi - lo) / static_cast<float>(qmax) : 1.0f;
      q.scales.push_back(scale);
      q.biases.push_back(lo);
      for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
        const float x = std::round((w[r * cols + c] - lo) / scale);
        const uint32_t v = static_cast<uint32_t>(std::clamp(x, 0.0f, static_cast<float>(qmax)));
        for (int b = 0; b < bits; ++b) {
          const int64_t bit = c * bits + b;
          if (v >> b & 1u) row[bit / 8] |= static_cast<uint8_t>(1u << (bit % 8));
        }
        q.dequant[r * cols + c] = scale * static_cast<float>(v) + lo;
      }
    }
  }
  return q;
}

// Quantizes every projection of an exact companion; writes both the quantized companion and the
// dense companion of the dequantized values.
void write_quantized_pair(const std::string& src, const std::string& qdir, const std::string& ddir,
                          int bits, int64_t gs) {
  json cfg = json::parse(std::ifstream(src + "/config.json"));
  const auto& projections = mtp_projection_names();
  std::vector<NewTensor> qt, dt;
  for (NewTensor& t : exact_companion_tensors(src)) {
    const std::string base = t.name.substr(0, t.name.size() - 7);  // drop ".weight"
    if (std::find(projections.begin(), projections.end(), base) == projections.end()) {
      qt.push_back(t);
      dt.push_back(std::move(t));
      continue;
    }
    const TensorView view{t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()};
    const std::vector<float> w = to_f32(view);
    const int64_t rows = t.shape[0], cols = t.shape[1];
    Quantized q = quantize(w, rows, cols, bits, gs);
    qt.push_back({t.name, DType::U32, {rows, cols * bits / 32}, as_bytes(q.packed)});
    qt.push_back({base + ".scales", DType::F32, {rows, cols / gs}, as_bytes(q.scales)});
    qt.push_back({base + ".biases", DType::F32, {rows, cols / gs}, as_bytes(q.biases)});
    dt.push_back({t.name, DType::F32, {rows, cols}, as_bytes(q.dequant)});
  }
  fs::create_directories(qdir);
  fs::create_directories(ddir);
  write_tensors(qdir + "/model.safetensors", qt);
  write_tensors(ddir + "/model.safetensors", dt);
  std::ofstream(ddir + "/config.json") << cfg.dump();
  cfg["quantization"] = {{"group_size", gs}, {"bits", bits}};
  std::ofstream(qdir + "/config.json") << cfg.dump();
}

TEST(QwenMtpCompanion, QuantizedMatchesDequantizedDense) {
  ScratchDir dir("mtp-quant");
  const std::string split = dir.file("split");
  write_mtp_companion(kDemo, split);
  for (int bits : {4, 8}) {
    const std::string q = dir.file("q" + std::to_string(bits)),
                      d = dir.file("d" + std::to_string(bits));
    write_quantized_pair(split, q, d, bits, 64);
    auto qp = QwenMtpProvider::from_companion(q);
    auto dp = QwenMtpProvider::from_companion(d);
    EXPECT_LT(qp->weights_bytes(), dp->weights_bytes());
    std::vector<int32_t> qa, da;
    const auto lq = chain_logits(*qp, &qa);
    const auto ld = chain_logits(*dp, &da);
    for (int j = 0; j < 4; ++j)
      EXPECT_LT(max_diff(lq[j], ld[j]) / max_abs(ld[j]), 1e-4) << bits << "-bit step " << j;
    if (bits == 8) {
      std::vector<int32_t> ref;
      chain_logits(*demo().mtp, &ref);
      EXPECT_EQ(qa, ref) << "8-bit drafts keep the greedy chain";
    }
  }
  // Unsupported bit widths are refused at load, naming the problem.
  json cfg = json::parse(std::ifstream(dir.file("q4") + "/config.json"));
  cfg["quantization"]["bits"] = 7;
  std::ofstream(dir.file("q4") + "/config.json") << cfg.dump();
  EXPECT_NE(error_of([&] {
              QwenMtpProvider::from_companion(dir.file("q4"));
            }).find("7-bit quantization is not supported"),
            std::string::npos);
}

TEST(QwenMtpCompanion, MismatchedTargetIsRefused) {
  ScratchDir dir("mtp-mismatch");
  // Another model's MTP layer (hidden 64): loads on its own, refused for the demo target.
  const std::string small = dir.file("small");
  write_mtp_companion(std::string(TANDEM_FIXTURES_DIR) + "/qwen35_tied", small);
  auto p = QwenMtpProvider::from_companion(small);
  std::string msg = error_of([&] { p->open_rows(*demo().target); });
  EXPECT_NE(msg.find("hidden size 64 does not match the target's 384"), std::string::npos) << msg;
  // Same shapes, other vocabulary.
  const std::string vocab = dir.file("vocab");
  write_mtp_companion(kDemo, vocab);
  json cfg = json::parse(std::ifstream(vocab + "/config.json"));
  cfg["text_config"]["vocab_size"] = 5000;
  std::ofstream(vocab + "/config.json") << cfg.dump();
  msg = error_of([&] { QwenMtpProvider::from_companion(vocab)->open_rows(*demo().target); });
  EXPECT_NE(msg.find("vocabulary size 5000 does not match the target's 4096"), std::string::npos)
      << msg;
  // Not a companion at all.
  msg = error_of([&] { QwenMtpProvider::from_companion(kDemo); });
  EXPECT_NE(msg.find("not a Qwen MTP companion drafter"), std::string::npos) << msg;
  // Unsupported attention shape.
  cfg["text_config"]["vocab_size"] = 4096;
  cfg["text_config"]["num_key_value_heads"] = 4;
  std::ofstream(vocab + "/config.json") << cfg.dump();
  msg = error_of([&] { QwenMtpProvider::from_companion(vocab); });
  EXPECT_NE(msg.find("unsupported MTP attention shape"), std::string::npos) << msg;
}

}  // namespace
}  // namespace tandem::spec
