// CPU op tests: each op against a plain double-precision reference, and the batch-invariance
// property the speculative path relies on (a row's result does not depend on the other rows).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "tandem/backend/ops.h"
#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"
#include "tandem/core/sampler.h"

namespace tandem {
namespace {

struct StoredWeight {
  DType dtype;
  std::vector<uint16_t> half;
  std::vector<float> f32;
  std::vector<float> values;  // what the stored values decode to
  ops::WeightRef ref;
};

StoredWeight make_weight(DType dtype, int64_t rows, int64_t cols, std::mt19937& rng,
                         float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  StoredWeight w;
  w.dtype = dtype;
  const size_t n = static_cast<size_t>(rows * cols);
  w.values.resize(n);
  if (dtype == DType::F32) {
    w.f32.resize(n);
    for (size_t i = 0; i < n; ++i) w.values[i] = w.f32[i] = nd(rng);
    w.ref = {dtype, w.f32.data(), rows, cols, {}};
  } else {
    w.half.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const float v = nd(rng);
      w.half[i] = dtype == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
      w.values[i] = dtype == DType::BF16 ? bf16_to_f32(w.half[i]) : f16_to_f32(w.half[i]);
    }
    w.ref = {dtype, w.half.data(), rows, cols, {}};
  }
  return w;
}

std::vector<float> random_vec(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

class LinearTest : public ::testing::TestWithParam<std::tuple<DType, int64_t, int64_t>> {};

TEST_P(LinearTest, MatchesDoubleReferenceAndIsBatchInvariant) {
  const auto [dtype, n, k] = GetParam();
  std::mt19937 rng(42);
  StoredWeight w = make_weight(dtype, n, k, rng, 0.1f);
  const int64_t m = 9;
  const auto x = random_vec(static_cast<size_t>(m * k), rng);
  std::vector<float> y(static_cast<size_t>(m * n));
  ops::linear(x.data(), m, w.ref, y.data());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < k; ++c) {
        ref += static_cast<double>(x[i * k + c]) * w.values[j * k + c];
        mag += std::fabs(static_cast<double>(x[i * k + c]) * w.values[j * k + c]);
      }
      ASSERT_NEAR(y[i * n + j], ref, 1e-5 * mag + 1e-6) << "row " << i << " col " << j;
    }
  // Each row alone, and rows 3..7 as a block, must give bit-identical results.
  for (int64_t i = 0; i < m; ++i) {
    std::vector<float> yi(static_cast<size_t>(n));
    ops::linear(x.data() + i * k, 1, w.ref, yi.data());
    ASSERT_EQ(0, std::memcmp(yi.data(), y.data() + i * n, sizeof(float) * n)) << "row " << i;
  }
  std::vector<float> yb(static_cast<size_t>(5 * n));
  ops::linear(x.data() + 3 * k, 5, w.ref, yb.data());
  ASSERT_EQ(0, std::memcmp(yb.data(), y.data() + 3 * n, sizeof(float) * 5 * n));
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearTest,
                         ::testing::Values(std::make_tuple(DType::F32, 7, 33),
                                           std::make_tuple(DType::BF16, 13, 64),
                                           std::make_tuple(DType::BF16, 5, 100),
                                           std::make_tuple(DType::F16, 9, 48),
                                           std::make_tuple(DType::F16, 4, 15)));

// The A/B switches (TANDEM_CUDA_GRAPHS=0 and the like): on unless set to exactly their off value.
TEST(EnvSwitch, OnUnlessSetToItsOffValue) {
  const char* name = "TANDEM_TEST_ENV_SWITCH";
  unsetenv(name);
  EXPECT_TRUE(env_switch_on(name));
  for (const char* on : {"", "1", "00", "off", "bf16"}) {
    setenv(name, on, 1);
    EXPECT_TRUE(env_switch_on(name)) << "'" << on << "'";
  }
  setenv(name, "0", 1);
  EXPECT_FALSE(env_switch_on(name));
  EXPECT_TRUE(env_switch_on(name, "bf16"));
  setenv(name, "bf16", 1);
  EXPECT_FALSE(env_switch_on(name, "bf16"));
  unsetenv(name);
}

TEST(Ops, SampleRowsIsTheSamplerOfEachRow) {
  // Rows of different logits, parameters and keys, in parallel: each row's token is the one
  // sample_token draws for it alone; a row the sampler refuses is -1; the batch changes nothing.
  const int64_t V = 3000;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> logits(static_cast<size_t>(12 * V));
  for (auto& x : logits) x = nd(rng);
  std::vector<ops::SampleRow> rows;
  for (int r = 0; r < 12; ++r) {
    SamplingParams p;
    p.temperature = r == 0 ? 0.0f : 0.3f * static_cast<float>(r);
    p.top_k = r % 3 == 0 ? 20 : 0;
    p.top_p = r % 4 == 1 ? 0.8f : 1.0f;
    p.min_p = r % 5 == 2 ? 0.05f : 0.0f;
    p.seed = 11u * static_cast<uint64_t>(r);
    rows.push_back(ops::sample_row(p, 100u + static_cast<uint64_t>(r)));
  }
  logits[static_cast<size_t>(5 * V + 9)] = std::nanf("");  // row 5 holds a NaN
  rows[7].top_p = 1.5f;                                    // row 7's parameters are invalid
  std::vector<int32_t> out(12, 99);
  ops::sample_rows(logits.data(), 12, V, rows.data(), out.data());
  for (int64_t r = 0; r < 12; ++r) {
    const ops::SampleRow& q = rows[static_cast<size_t>(r)];
    const SamplingParams p = ops::sampling_of(q);
    if (r == 5 || r == 7) {
      EXPECT_EQ(out[static_cast<size_t>(r)], -1) << r;
      continue;
    }
    const std::span<const float> row(logits.data() + r * V, static_cast<size_t>(V));
    EXPECT_EQ(out[static_cast<size_t>(r)], sample_token(row, p, q.index)) << r;
    int32_t alone = -2;
    ops::sample_rows(row.data(), 1, V, &q, &alone);
    EXPECT_EQ(alone, out[static_cast<size_t>(r)]) << r;
  }
  EXPECT_EQ(out[0], argmax(std::span<const float>(logits.data(), static_cast<size_t>(V))));
  EXPECT_THROW(ops::sample_rows(logits.data(), 1, 0, rows.data(), out.data()), Error);
}

TEST(Ops, EmbedRowsSelectedTakesDraftedIdsFromTheirSource) {
  const int64_t V = 6, d = 3;
  std::vector<float> table(static_cast<size_t>(V * d));
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<float>(i);
  const ops::WeightRef w{DType::F32, table.data(), V, d, {}};
  const std::vector<int32_t> ids = {4, 0, 0, 2, 0};
  const std::vector<int32_t> source = {9, 5, 1, -1};
  const std::vector<int32_t> from = {-1, 1, 2, -1, 3};  // the last: a failed draw (-1)
  std::vector<float> out(5 * d), want(4 * d);
  ops::embed_rows_selected(w, ids.data(), source.data(), from.data(), 5, out.data());
  const std::vector<int32_t> chosen = {4, 5, 1, 2};
  ops::embed_rows(w, chosen.data(), 4, want.data());
  EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + 4 * d), want);
  for (int64_t c = 0; c < d; ++c) EXPECT_TRUE(std::isnan(out[static_cast<size_t>(4 * d + c)]));
}

TEST(Ops, AcceptWindowsWalksEachRowsProposals) {
  // Rows: [5 | 1 2 3] accepts 2 (3 is not 8), [9] alone, [4 | 6 7] accepts all, [2 | 3] none.
  // Row 0's second proposal and row 2's first are still in the drafter's source (from).
  const std::vector<int32_t> ids = {5, 1, 0, 3, 9, 4, 0, 7, 2, 3};
  const std::vector<int32_t> source = {6, 2};
  const std::vector<int32_t> from = {-1, -1, 1, -1, -1, -1, 0, -1, -1, -1};
  const std::vector<int32_t> verified = {1, 2, 8, 0, 11, 6, 7, 12, 4, 5};
  const std::vector<int32_t> bounds = {0, 4, 5, 8, 10};
  std::vector<int32_t> accepted(4, -9), next(4, -9);
  ops::accept_windows(verified.data(), ids.data(), source.data(), from.data(), bounds.data(),
                      nullptr, 4, accepted.data(), next.data());
  EXPECT_EQ(accepted, (std::vector<int32_t>{2, 0, 2, 0}));
  EXPECT_EQ(next, (std::vector<int32_t>{8, 11, 12, 4}));
  // Without the drafter's source, the placeholders are the window: row 0 stops at its first.
  ops::accept_windows(verified.data(), ids.data(), nullptr, nullptr, bounds.data(), nullptr, 4,
                      accepted.data(), next.data());
  EXPECT_EQ(accepted, (std::vector<int32_t>{1, 0, 0, 0}));
  EXPECT_EQ(next, (std::vector<int32_t>{2, 11, 6, 4}));
}

// A window padded past its drafter's proposals (limits) is never accepted past them, even where
// the padding equals the target's token.
TEST(Ops, AcceptWindowsStopAtTheirLimits) {
  // [5 | 1 2 5] with 2 proposals: the padding 5 equals the target's third token.
  // [4 | 6 4 4] with 0 proposals. [2 | 3 3] with a limit past its window.
  const std::vector<int32_t> ids = {5, 1, 2, 5, 4, 6, 4, 4, 2, 3, 3};
  const std::vector<int32_t> verified = {1, 2, 5, 9, 6, 4, 4, 7, 3, 3, 8};
  const std::vector<int32_t> bounds = {0, 4, 8, 11};
  std::vector<int32_t> accepted(3, -9), next(3, -9);
  ops::accept_windows(verified.data(), ids.data(), nullptr, nullptr, bounds.data(), nullptr, 3,
                      accepted.data(), next.data());
  EXPECT_EQ(accepted, (std::vector<int32_t>{3, 3, 2}));
  const std::vector<int32_t> limits = {2, 0, 9};
  ops::accept_windows(verified.data(), ids.data(), nullptr, nullptr, bounds.data(), limits.data(),
                      3, accepted.data(), next.data());
  EXPECT_EQ(accepted, (std::vector<int32_t>{2, 0, 2}));
  EXPECT_EQ(next, (std::vector<int32_t>{5, 6, 8}));
}

TEST(Ops, SettleWindowsAddsKeptTokensPerSlot) {
  const std::vector<int32_t> accepted = {3, 0, 1};
  // Forward rows 2 and 0 are committed, in slots 4 and 1; row 1 is not.
  const std::vector<ops::SettledRow> rows = {{4, 2}, {1, 0}};
  std::vector<int64_t> shift = {0, 10, 0, 0, 5};
  std::vector<ops::RecurrentRow> replay(2 * rows.size());
  for (auto& d : replay) d.n = 77;
  ops::settle_windows(accepted.data(), rows.data(), 2, shift.data(), replay.data(), 2);
  EXPECT_EQ(shift, (std::vector<int64_t>{0, 13, 0, 0, 6}));
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(replay[static_cast<size_t>(2 * l)].n, 1);
    EXPECT_EQ(replay[static_cast<size_t>(2 * l + 1)].n, 3);
  }
  ops::settle_windows(accepted.data(), rows.data(), 2, shift.data(), nullptr, 0);
  EXPECT_EQ(shift, (std::vector<int64_t>{0, 16, 0, 0, 7}));
}

TEST(Ops, ShiftPositionsMovesRowsByWhatTheHostDidNotCount) {
  // Two rows of 3 and 2 tokens in slots 2 and 0; slot 2 holds 5 uncounted tokens, slot 0 none.
  // Blocks of 4 positions; row 0's table [7, 3, 9, 1], row 1's [5, 6, ...].
  const std::vector<int64_t> shift = {2, 0, 9};
  const std::vector<int32_t> row_slot = {2, 0};
  const std::vector<int64_t> known = {4, 2};
  const std::vector<int64_t> token_row = {0, 0, 0, 1, 1};
  const std::vector<int32_t> tables = {7, 3, 9, 1, 5, 6, 0, 0};
  std::vector<int64_t> pos = {2, 3, 4, 6, 7};
  std::vector<int64_t> slots(5, -1);
  std::vector<ops::SampleRow> draws(5);
  for (size_t t = 0; t < draws.size(); ++t) draws[t].index = 100 + t;
  ops::PositionShift s;
  s.shift = shift.data();
  s.row_slot = row_slot.data();
  s.known = known.data();
  s.token_row = token_row.data();
  s.tokens = 5;
  s.rows = 2;
  s.tables = tables.data();
  s.table_stride = 4;
  s.block_size = 4;
  s.sample = draws.data();
  ops::shift_positions(s, pos.data(), slots.data());
  EXPECT_EQ(pos, (std::vector<int64_t>{7, 8, 9, 6, 7}));
  // Row 0 moved: positions 7, 8, 9 sit in blocks 1 and 2 of its table. Row 1 stayed (unchanged).
  EXPECT_EQ(slots, (std::vector<int64_t>{3 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1, -1, -1}));
  std::vector<uint64_t> index;
  for (const auto& d : draws) index.push_back(d.index);
  EXPECT_EQ(index, (std::vector<uint64_t>{105, 106, 107, 103, 104}));
  // One draw per row: logits row k follows row k.
  s.sample_per_token = false;
  ops::shift_positions(s, pos.data(), nullptr);
  EXPECT_EQ(pos, (std::vector<int64_t>{12, 13, 14, 6, 7}));
  EXPECT_EQ(draws[0].index, 110u);
  EXPECT_EQ(draws[1].index, 106u);
  EXPECT_EQ(draws[2].index, 107u);
}

TEST(Ops, ShiftPositionsParksLeadingTokensOfRowsThatDidNotAcceptEverything) {
  // Tokens 0 and 1 lead (completion rows of rows 0 and 1), tokens 2 and 3 follow. Row 0
  // accepted all 3 proposals of its last round, row 1 only 1; both have 2 uncounted tokens.
  const std::vector<int64_t> shift = {5, 7};
  const std::vector<int32_t> row_slot = {0, 1};
  const std::vector<int64_t> known = {3, 5};
  const std::vector<int64_t> token_row = {0, 1, 0, 1};
  const std::vector<int32_t> accepted = {3, 1};
  std::vector<int64_t> pos = {9, 19, 10, 20};
  ops::PositionShift s;
  s.shift = shift.data();
  s.row_slot = row_slot.data();
  s.known = known.data();
  s.token_row = token_row.data();
  s.tokens = 4;
  s.rows = 2;
  s.park_tokens = 2;
  s.park_unless = accepted.data();
  s.park_full = 3;
  s.park_by = 4;
  ops::shift_positions(s, pos.data(), nullptr);
  EXPECT_EQ(pos, (std::vector<int64_t>{11, 25, 12, 22}));
}

TEST(Ops, GatherWindowRowsTakesEachWindowsChosenToken) {
  // Three windows of 3 tokens, rows of 2 floats: token t holds {t, -t}.
  std::vector<float> src(18);
  for (int t = 0; t < 9; ++t) {
    src[static_cast<size_t>(2 * t)] = static_cast<float>(t);
    src[static_cast<size_t>(2 * t + 1)] = static_cast<float>(-t);
  }
  const std::vector<int32_t> accepted = {2, 0, 1};
  std::vector<float> out(6);
  ops::gather_window_rows(src.data(), 2, 3, 0, accepted.data(), 3, out.data());
  EXPECT_EQ(out, (std::vector<float>{2, -2, 3, -3, 7, -7}));
  ops::gather_window_rows(src.data(), 2, 3, 1, nullptr, 3, out.data());
  EXPECT_EQ(out, (std::vector<float>{1, -1, 4, -4, 7, -7}));
}

TEST(Ops, RmsNormZeroCentredAndPlain) {
  std::mt19937 rng(1);
  const int64_t m = 3, d = 37;
  StoredWeight w = make_weight(DType::BF16, 1, d, rng, 0.3f);
  const auto x = random_vec(static_cast<size_t>(m * d), rng);
  for (bool zc : {true, false}) {
    std::vector<float> y(x.size());
    ops::rms_norm(x.data(), m, d, w.ref, zc, 1e-6f, y.data());
    for (int64_t r = 0; r < m; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(x[r * d + i]) * x[r * d + i];
      const double inv = 1.0 / std::sqrt(ss / d + 1e-6);
      for (int64_t i = 0; i < d; ++i) {
        const double s = zc ? 1.0 + w.values[i] : w.values[i];
        EXPECT_NEAR(y[r * d + i], x[r * d + i] * inv * s, 1e-5);
      }
    }
  }
}

TEST(Ops, GatedRmsNormAndActivations) {
  std::mt19937 rng(2);
  const int64_t m = 4, d = 16;
  StoredWeight w = make_weight(DType::F32, 1, d, rng);
  const auto x = random_vec(static_cast<size_t>(m * d), rng);
  const auto z = random_vec(static_cast<size_t>(m * d), rng);
  std::vector<float> y(x.size());
  ops::gated_rms_norm(x.data(), z.data(), m, d, w.ref, 1e-6f, y.data());
  for (int64_t r = 0; r < m; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(x[r * d + i]) * x[r * d + i];
    const double inv = 1.0 / std::sqrt(ss / d + 1e-6);
    for (int64_t i = 0; i < d; ++i) {
      const double zi = z[r * d + i];
      EXPECT_NEAR(y[r * d + i], w.values[i] * x[r * d + i] * inv * zi / (1 + std::exp(-zi)), 1e-5);
    }
  }
  std::vector<float> s(x.size());
  ops::swiglu(x.data(), z.data(), m * d, s.data());
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_NEAR(s[i], x[i] / (1 + std::exp(-static_cast<double>(x[i]))) * z[i], 1e-5);
}

// The fused ops are exactly their parts: the model relies on add_rms_norm giving the bits of
// add_inplace + rms_norm (gate_up_swiglu's test follows).
TEST(Ops, AddRmsNormIsAddThenNorm) {
  std::mt19937 rng(3);
  const int64_t m = 3, d = 37;
  StoredWeight w = make_weight(DType::F32, 1, d, rng, 0.3f);
  const auto x0 = random_vec(static_cast<size_t>(m * d), rng);
  const auto r = random_vec(static_cast<size_t>(m * d), rng, 4.0f);
  std::vector<float> want_x = x0, want_y(x0.size());
  ops::add_inplace(want_x.data(), r.data(), m * d);
  ops::rms_norm(want_x.data(), m, d, w.ref, true, 1e-6f, want_y.data());
  std::vector<float> x = x0, y(x0.size());
  ops::add_rms_norm(x.data(), r.data(), m, d, w.ref, true, 1e-6f, y.data());
  EXPECT_EQ(0, std::memcmp(x.data(), want_x.data(), x.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(y.data(), want_y.data(), y.size() * sizeof(float)));
  // y may alias r (the model normalises the sublayer output in place).
  x = x0;
  std::vector<float> ry = r;
  ops::add_rms_norm(x.data(), ry.data(), m, d, w.ref, true, 1e-6f, ry.data());
  EXPECT_EQ(0, std::memcmp(ry.data(), want_y.data(), ry.size() * sizeof(float)));
  // y aliasing the residual stream itself would lose it: rejected with a clear error.
  x = x0;
  try {
    ops::add_rms_norm(x.data(), r.data(), m, d, w.ref, true, 1e-6f, x.data());
    ADD_FAILURE() << "add_rms_norm accepted y == x";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("alias"), std::string::npos) << e.what();
  }
  EXPECT_EQ(x, x0) << "a rejected call changed x";
}

// A drafter's fc input: rms_norm_pair gives each half the bits of rms_norm with that half's
// weight, and refuses an output that aliases an input.
// copy_blocks moves whole blocks by the ids it is given, in any order, and leaves every other
// block as it was.
TEST(Ops, CopyBlocksMovesTheNamedBlocksOnly) {
  const int64_t bf = 7, blocks = 6;
  std::vector<float> src(static_cast<size_t>(blocks * bf)), dst(src.size(), -1.0f);
  std::iota(src.begin(), src.end(), 0.0f);
  const std::vector<int32_t> moves = {4, 0, 5, /* to */ 1, 5, 2};
  ops::copy_blocks(dst.data(), src.data(), moves.data(), 3, bf);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t c = 0; c < bf; ++c) {
      float want = -1.0f;
      for (int i = 0; i < 3; ++i)
        if (moves[static_cast<size_t>(3 + i)] == b) want = static_cast<float>(moves[i] * bf + c);
      EXPECT_EQ(dst[static_cast<size_t>(b * bf + c)], want) << "block " << b << " float " << c;
    }
  EXPECT_THROW(ops::copy_blocks(dst.data(), src.data(), moves.data(), -1, bf), Error);
  ops::copy_blocks(dst.data(), src.data(), nullptr, 0, bf);  // nothing to move
}

TEST(Ops, RmsNormPairIsTwoNormsSideBySide) {
  std::mt19937 rng(4);
  const int64_t m = 5, d = 37;
  StoredWeight wa = make_weight(DType::BF16, 1, d, rng, 0.3f);
  StoredWeight wb = make_weight(DType::F32, 1, d, rng, 0.3f);
  const auto a = random_vec(static_cast<size_t>(m * d), rng);
  const auto b = random_vec(static_cast<size_t>(m * d), rng, 4.0f);
  for (bool zc : {true, false}) {
    std::vector<float> na(a.size()), nb(b.size()), y(static_cast<size_t>(2 * m * d), -1.0f);
    ops::rms_norm(a.data(), m, d, wa.ref, zc, 1e-6f, na.data());
    ops::rms_norm(b.data(), m, d, wb.ref, zc, 1e-6f, nb.data());
    ops::rms_norm_pair(a.data(), b.data(), m, d, wa.ref, wb.ref, zc, 1e-6f, y.data());
    for (int64_t r = 0; r < m; ++r) {
      EXPECT_EQ(0, std::memcmp(y.data() + 2 * r * d, na.data() + r * d, sizeof(float) * d))
          << "row " << r << " first half";
      EXPECT_EQ(0, std::memcmp(y.data() + 2 * r * d + d, nb.data() + r * d, sizeof(float) * d))
          << "row " << r << " second half";
    }
  }
  std::vector<float> ab = a;
  ab.resize(static_cast<size_t>(2 * m * d));
  try {
    ops::rms_norm_pair(ab.data(), b.data(), m, d, wa.ref, wb.ref, false, 1e-6f, ab.data());
    ADD_FAILURE() << "rms_norm_pair accepted y == a";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("alias"), std::string::npos) << e.what();
  }
  StoredWeight short_w = make_weight(DType::F32, 1, d - 1, rng);
  std::vector<float> y(static_cast<size_t>(2 * m * d));
  try {
    ops::rms_norm_pair(a.data(), b.data(), m, d, wa.ref, short_w.ref, false, 1e-6f, y.data());
    ADD_FAILURE() << "rms_norm_pair accepted a weight of the wrong size";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("36 elements"), std::string::npos) << e.what();
  }
}

// rms_norm_pair_embedded: rms_norm_pair of the embedding rows of ids, bit for bit, with NaN rows
// for ids out of range (as embed_rows); an output aliasing b is refused.
TEST(Ops, RmsNormPairEmbeddedIsEmbedThenPair) {
  std::mt19937 rng(5);
  const int64_t vocab = 11, m = 4, d = 24;
  StoredWeight table = make_weight(DType::BF16, vocab, d, rng, 1.0f);
  StoredWeight wa = make_weight(DType::F32, 1, d, rng, 0.3f);
  StoredWeight wb = make_weight(DType::F32, 1, d, rng, 0.3f);
  const std::vector<int32_t> ids = {3, 10, -1, 3};
  const auto b = random_vec(static_cast<size_t>(m * d), rng, 2.0f);
  std::vector<float> emb(static_cast<size_t>(m * d)), want(static_cast<size_t>(2 * m * d)),
      got(want.size(), -1.0f);
  ops::embed_rows(table.ref, ids.data(), m, emb.data());
  ops::rms_norm_pair(emb.data(), b.data(), m, d, wa.ref, wb.ref, true, 1e-6f, want.data());
  ops::rms_norm_pair_embedded(table.ref, ids.data(), b.data(), m, wa.ref, wb.ref, true, 1e-6f,
                              got.data());
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), sizeof(float) * want.size()));
  EXPECT_TRUE(std::isnan(got[static_cast<size_t>(2 * 2 * d)])) << "the row of id -1";
  std::vector<float> bb = b;
  bb.resize(want.size());
  EXPECT_THROW(ops::rms_norm_pair_embedded(table.ref, ids.data(), bb.data(), m, wa.ref, wb.ref,
                                           true, 1e-6f, bb.data()),
               Error);
}

// gate_up_swiglu on a weight in the pair layout (8 gate rows, the same 8 up rows, ...) gives the
// bits of the two projections followed by swiglu.
TEST(Ops, GateUpSwigluIsTheTwoProjectionsThenSwiglu) {
  std::mt19937 rng(4);
  const int64_t m = 5, I = 24, G = ops::kGateUpGroup;
  for (const int64_t k : {64, 100}) {
    StoredWeight gate = make_weight(DType::BF16, I, k, rng, 0.2f);
    StoredWeight up = make_weight(DType::BF16, I, k, rng, 0.2f);
    std::vector<uint16_t> pairs;
    for (int64_t blk = 0; blk < I / G; ++blk)
      for (const StoredWeight* part : {&gate, &up})
        pairs.insert(pairs.end(), part->half.begin() + blk * G * k,
                     part->half.begin() + (blk + 1) * G * k);
    const ops::WeightRef gate_up{DType::BF16, pairs.data(), 2 * I, k, {}};
    const auto x = random_vec(static_cast<size_t>(m * k), rng, 2.0f);
    std::vector<float> g(static_cast<size_t>(m * I)), u(g.size()), want(g.size()), got(g.size());
    ops::linear(x.data(), m, gate.ref, g.data());
    ops::linear(x.data(), m, up.ref, u.data());
    ops::swiglu(g.data(), u.data(), m * I, want.data());
    ops::gate_up_swiglu(x.data(), m, gate_up, got.data());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << "K " << k;
  }
  // A stacked weight that cannot hold whole pairs is refused by name.
  StoredWeight odd = make_weight(DType::BF16, 24, 64, rng);
  std::vector<float> x(64), y(12);
  try {
    ops::gate_up_swiglu(x.data(), 1, odd.ref, y.data());
    ADD_FAILURE() << "gate_up_swiglu accepted a 24-row weight";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gate_up_swiglu"), std::string::npos) << e.what();
  }
}

// qk_norm_rope is the split, the per-head norms and the rotary embedding, one after the other.
// The model's sublayer seams: a projection with an input norm is bitwise rms_norm into a
// temporary then the projection (x untouched), and linear_add is bitwise linear then add_inplace.
TEST(Ops, InputNormAndLinearAddAreTheirParts) {
  std::mt19937 rng(5);
  const int64_t m = 3, k = 48, I = 16;
  StoredWeight norm_w = make_weight(DType::F32, 1, k, rng, 0.2f);
  const ops::RowNorm norm{norm_w.ref, true, 1e-6f};
  // [2I, k]: read as a plain weight, and by gate_up_swiglu as I outputs in its pair layout.
  StoredWeight w = make_weight(DType::BF16, 2 * I, k, rng, 0.2f);
  const auto x0 = random_vec(static_cast<size_t>(m * k), rng, 3.0f);
  std::vector<float> h(x0.size());
  ops::rms_norm(x0.data(), m, k, norm_w.ref, true, 1e-6f, h.data());

  std::vector<float> want(static_cast<size_t>(m * 2 * I)), got(want.size()), x = x0;
  ops::linear(h.data(), m, w.ref, want.data());
  const ops::OutputSlice all{got.data(), 2 * I};
  ops::linear_split(x.data(), m, w.ref, &all, 1, &norm);
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
  EXPECT_EQ(x, x0) << "the input norm wrote into x";

  std::vector<float> act_want(static_cast<size_t>(m * I)), act_got(act_want.size());
  ops::gate_up_swiglu(h.data(), m, w.ref, act_want.data());
  ops::gate_up_swiglu(x.data(), m, w.ref, act_got.data(), &norm);
  EXPECT_EQ(0, std::memcmp(act_got.data(), act_want.data(), act_got.size() * sizeof(float)));

  const auto y0 = random_vec(want.size(), rng, 5.0f);
  std::vector<float> y_want = y0, y_got = y0;
  ops::linear(x0.data(), m, w.ref, want.data());
  ops::add_inplace(y_want.data(), want.data(), m * 2 * I);
  ops::linear_add(x0.data(), m, w.ref, y_got.data());
  EXPECT_EQ(0, std::memcmp(y_got.data(), y_want.data(), y_got.size() * sizeof(float)));

  // A norm whose size is not the rows' is refused by name, before anything is written.
  StoredWeight short_norm = make_weight(DType::F32, 1, k - 1, rng);
  const ops::RowNorm bad{short_norm.ref, true, 1e-6f};
  std::fill(got.begin(), got.end(), 7.0f);
  try {
    ops::linear_split(x.data(), m, w.ref, &all, 1, &bad);
    ADD_FAILURE() << "linear_split accepted a " << k - 1 << "-weight norm for rows of " << k;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("input norm"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return v == 7.0f; }));
  EXPECT_THROW(ops::gate_up_swiglu(x.data(), m, w.ref, act_got.data(), &bad), Error);
}

// leading_rows cuts a weight to its first rows (clamped to [0, all]), and a prefetch hint on
// linear_split changes no value.
TEST(Ops, LeadingRowsAndPrefetchHint) {
  std::mt19937 rng(6);
  StoredWeight w = make_weight(DType::BF16, 30, 16, rng, 0.2f);
  StoredWeight next = make_weight(DType::BF16, 10, 16, rng, 0.2f);
  EXPECT_EQ(ops::leading_rows(next.ref, 0.5).rows, 5);
  EXPECT_EQ(ops::leading_rows(next.ref, 0.55).rows, 5);  // rounded down
  EXPECT_EQ(ops::leading_rows(next.ref, 2.0).rows, 10);
  EXPECT_EQ(ops::leading_rows(next.ref, -1.0).rows, 0);
  EXPECT_EQ(ops::leading_rows(next.ref, 0.5).data, next.ref.data);
  EXPECT_EQ(ops::leading_rows(next.ref, 0.5).cols, 16);
  const auto x = random_vec(2 * 16, rng, 1.0f);
  std::vector<float> want(2 * 30), got(want.size());
  const ops::OutputSlice all_want{want.data(), 30}, all_got{got.data(), 30};
  ops::linear_split(x.data(), 2, w.ref, &all_want, 1);
  const ops::WeightRef half = ops::leading_rows(next.ref, 0.5);
  ops::linear_split(x.data(), 2, w.ref, &all_got, 1, nullptr, &half);
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
}

// linear_split with a DeltaNet's conv on its first slice is bitwise the product, then
// causal_conv_silu_rows on that slice: outputs and conv states; a conv without an output, with a
// weight of the wrong shape or without descriptors is refused before anything is written.
TEST(Ops, LinearSplitConvIsTheProductThenTheConv) {
  std::mt19937 rng(8);
  const int64_t R = 3, C = 12, taps = 4, hist = taps - 1, k = 16, n = 20;
  StoredWeight w = make_weight(DType::BF16, n, k, rng, 0.2f);
  StoredWeight conv_w = make_weight(DType::F32, C, taps, rng, 0.5f);
  const auto x = random_vec(static_cast<size_t>(R * k), rng, 1.0f);
  const auto state0 = random_vec(static_cast<size_t>(R * C * hist), rng, 1.0f);
  std::vector<float> qkv[2], rest[2], out[2], state[2];
  for (int run = 0; run < 2; ++run) {
    qkv[run].assign(static_cast<size_t>(R * C), NAN);
    rest[run].assign(static_cast<size_t>(R * (n - C)), NAN);
    out[run].assign(static_cast<size_t>(R * C), NAN);
    state[run] = state0;
    std::vector<ops::RecurrentRow> rows(static_cast<size_t>(R));
    for (int64_t i = 0; i < R; ++i) {
      rows[static_cast<size_t>(i)].first_token = i;
      rows[static_cast<size_t>(i)].n = 1;
      rows[static_cast<size_t>(i)].conv_state = state[run].data() + i * C * hist;
    }
    const ops::OutputSlice slices[] = {{qkv[run].data(), C}, {rest[run].data(), n - C}};
    if (run == 0) {
      ops::linear_split(x.data(), R, w.ref, slices, 2);
      ops::causal_conv_silu_rows(qkv[run].data(), C, taps, conv_w.ref, rows.data(), R, 1,
                                 out[run].data());
    } else {
      const ops::SliceConv conv{conv_w.ref, taps, rows.data(), R, 1, out[run].data()};
      ops::linear_split(x.data(), R, w.ref, slices, 2, nullptr, nullptr, &conv);
      // Bad convs are refused before the product writes anything.
      ops::SliceConv no_out = conv, narrow = conv, no_rows = conv;
      no_out.out = nullptr;
      narrow.w.rows = C - 1;
      no_rows.rows = nullptr;
      const std::vector<float> untouched = qkv[run], rest_before = rest[run];
      for (const ops::SliceConv* bad : {&no_out, &narrow, &no_rows})
        EXPECT_THROW(ops::linear_split(x.data(), R, w.ref, slices, 2, nullptr, nullptr, bad),
                     Error);
      EXPECT_EQ(0, std::memcmp(untouched.data(), qkv[run].data(), untouched.size() * 4));
      EXPECT_EQ(0, std::memcmp(rest_before.data(), rest[run].data(), rest_before.size() * 4));
    }
  }
  EXPECT_EQ(0, std::memcmp(qkv[0].data(), qkv[1].data(), qkv[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(rest[0].data(), rest[1].data(), rest[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(state[0].data(), state[1].data(), state[0].size() * sizeof(float)));
  EXPECT_NE(0, std::memcmp(state[1].data(), state0.data(), state0.size() * sizeof(float)));
}

// linear_add with the DeltaNet's gated norm is bitwise gated_rms_norm into a temporary, then
// linear_add; x is unchanged, and a head size that does not tile the rows is refused.
TEST(Ops, LinearAddWithGatedNormIsNormThenLinearAdd) {
  std::mt19937 rng(7);
  const int64_t m = 3, hd = 8, k = 4 * hd, n = 12;
  StoredWeight w = make_weight(DType::BF16, n, k, rng, 0.2f);
  StoredWeight norm_w = make_weight(DType::F32, 1, hd, rng, 0.2f);
  const auto x0 = random_vec(static_cast<size_t>(m * k), rng, 2.0f);
  const auto z = random_vec(x0.size(), rng, 2.0f);
  const auto y0 = random_vec(static_cast<size_t>(m * n), rng, 3.0f);
  std::vector<float> normed(x0.size()), want = y0, got = y0, x = x0;
  ops::gated_rms_norm(x0.data(), z.data(), m * (k / hd), hd, norm_w.ref, 1e-6f, normed.data());
  ops::linear_add(normed.data(), m, w.ref, want.data());
  const ops::GatedNorm gated{z.data(), norm_w.ref, 1e-6f};
  ops::linear_add(x.data(), m, w.ref, got.data(), &gated);
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
  EXPECT_EQ(x, x0) << "the gated norm wrote into x";
  StoredWeight odd = make_weight(DType::F32, 1, 5, rng);
  const ops::GatedNorm bad{z.data(), odd.ref, 1e-6f};
  EXPECT_THROW(ops::linear_add(x.data(), m, w.ref, got.data(), &bad), Error);
}

// swiglu_mlp_add is bitwise gate_up_swiglu (with its input norm) into a temporary, then
// linear_add, also when it adds into its own input; a down projection of the wrong shape is
// refused.
TEST(Ops, SwigluMlpAddIsGateUpThenLinearAdd) {
  std::mt19937 rng(6);
  const int64_t m = 2, h = 32, I = 16;
  StoredWeight gate_up = make_weight(DType::BF16, 2 * I, h, rng, 0.2f);
  StoredWeight down = make_weight(DType::BF16, h, I, rng, 0.2f);
  StoredWeight norm_w = make_weight(DType::F32, 1, h, rng, 0.2f);
  const ops::RowNorm norm{norm_w.ref, true, 1e-6f};
  const auto x0 = random_vec(static_cast<size_t>(m * h), rng, 2.0f);
  for (const ops::RowNorm* n : {static_cast<const ops::RowNorm*>(nullptr), &norm}) {
    std::vector<float> act(static_cast<size_t>(m * I)), want = x0, got = x0;
    ops::gate_up_swiglu(x0.data(), m, gate_up.ref, act.data(), n);
    ops::linear_add(act.data(), m, down.ref, want.data());
    ops::swiglu_mlp_add(got.data(), m, gate_up.ref, down.ref, got.data(), n);  // y == x
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
        << "norm " << (n != nullptr);
  }
  StoredWeight wrong = make_weight(DType::BF16, h, I + 8, rng);
  std::vector<float> y = x0;
  try {
    ops::swiglu_mlp_add(x0.data(), m, gate_up.ref, wrong.ref, y.data());
    ADD_FAILURE() << "swiglu_mlp_add accepted a [32 x 24] down projection for I = 16";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("down projection"), std::string::npos) << e.what();
  }
  EXPECT_EQ(y, x0) << "a rejected call changed y";
}

TEST(Ops, QkNormRopeIsSplitNormsThenRope) {
  std::mt19937 rng(5);
  const int64_t T = 3, nh = 4, nkv = 2, hd = 16, rot = 8;
  StoredWeight qn = make_weight(DType::F32, 1, hd, rng, 0.2f);
  StoredWeight kn = make_weight(DType::F32, 1, hd, rng, 0.2f);
  const auto qg = random_vec(static_cast<size_t>(T * nh * 2 * hd), rng, 2.0f);
  const auto k0 = random_vec(static_cast<size_t>(T * nkv * hd), rng, 2.0f);
  const std::vector<int64_t> pos = {5, 0, 77};
  std::vector<float> freq(static_cast<size_t>(rot / 2));
  for (size_t i = 0; i < freq.size(); ++i) freq[i] = 1.0f / std::pow(1e4f, 2.0f * i / rot);
  std::vector<float> wq(static_cast<size_t>(T * nh * hd)), wg(wq.size()), wk = k0;
  ops::copy_rows(wq.data(), hd, qg.data(), 2 * hd, T * nh, hd);
  ops::copy_rows(wg.data(), hd, qg.data() + hd, 2 * hd, T * nh, hd);
  ops::rms_norm(wq.data(), T * nh, hd, qn.ref, true, 1e-6f, wq.data());
  ops::rms_norm(wk.data(), T * nkv, hd, kn.ref, true, 1e-6f, wk.data());
  ops::rope(wq.data(), T, nh, hd, rot, pos.data(), freq.data());
  ops::rope(wk.data(), T, nkv, hd, rot, pos.data(), freq.data());
  ops::QkNormRope s;
  s.n_tokens = T;
  s.n_heads = nh;
  s.n_kv_heads = nkv;
  s.head_dim = hd;
  s.rotary_dim = rot;
  std::vector<float> q(wq.size()), g(wq.size()), k = k0;
  ops::qk_norm_rope(s, qg.data(), qn.ref, kn.ref, pos.data(), freq.data(), q.data(), g.data(),
                    k.data());
  EXPECT_EQ(q, wq);
  EXPECT_EQ(g, wg);
  EXPECT_EQ(k, wk);
  // With a KV target the same pass also writes each token's keys and values at its slot: the
  // rows kv_write writes at the token's position (slot -1: none).
  const int64_t bs = 4;
  std::vector<float> pool(static_cast<size_t>(6 * 2 * bs * nkv * hd), -7.0f), pool_parts = pool;
  ops::KVLayerView kv{pool.data(), bs, nkv, hd}, kv_parts{pool_parts.data(), bs, nkv, hd};
  const std::vector<int32_t> table = {3, 0, 5, 1, 4, 2};  // positions 0..23
  const std::vector<int64_t> kv_pos = {5, 0, 22};
  std::vector<int64_t> slots;
  for (const int64_t p : kv_pos) slots.push_back(int64_t{table[p / bs]} * bs + p % bs);
  slots[1] = -1;
  const auto v = random_vec(k0.size(), rng, 2.0f);
  s.kv = &kv;
  s.kv_slots = slots.data();
  s.v = v.data();
  std::vector<float> k2 = k0;
  ops::qk_norm_rope(s, qg.data(), qn.ref, kn.ref, kv_pos.data(), freq.data(), q.data(), g.data(),
                    k2.data());
  std::vector<float> k3 = k0;
  s.kv = nullptr;
  ops::qk_norm_rope(s, qg.data(), qn.ref, kn.ref, kv_pos.data(), freq.data(), q.data(), g.data(),
                    k3.data());
  EXPECT_EQ(k2, k3);
  for (int64_t t : {0, 2})
    ops::kv_write(kv_parts, table.data(), &kv_pos[t], 1, k3.data() + t * nkv * hd,
                  v.data() + t * nkv * hd);
  EXPECT_EQ(pool, pool_parts);
  ops::KVLayerView wrong{pool.data(), bs, nkv, hd / 2};
  s.kv = &wrong;
  try {
    ops::qk_norm_rope(s, qg.data(), qn.ref, kn.ref, kv_pos.data(), freq.data(), q.data(), g.data(),
                      k2.data());
    ADD_FAILURE() << "qk_norm_rope accepted a KV target of another head size";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KV target"), std::string::npos) << e.what();
  }
  s.kv = nullptr;
  s.rotary_dim = 7;  // odd: refused by name before anything is written
  EXPECT_THROW(ops::qk_norm_rope(s, qg.data(), qn.ref, kn.ref, pos.data(), freq.data(), q.data(),
                                 g.data(), k.data()),
               Error);
}

TEST(Ops, RopeRotatesOnlyTheRotaryDims) {
  const int64_t T = 2, nh = 2, hd = 8, rd = 4;
  std::mt19937 rng(3);
  auto x = random_vec(static_cast<size_t>(T * nh * hd), rng);
  const auto x0 = x;
  const int64_t pos[T] = {0, 5};
  const float inv_freq[2] = {1.0f, 0.01f};
  ops::rope(x.data(), T, nh, hd, rd, pos, inv_freq);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nh; ++h) {
      const float* a = x0.data() + (t * nh + h) * hd;
      const float* b = x.data() + (t * nh + h) * hd;
      for (int64_t i = 0; i < rd / 2; ++i) {
        const double ang = static_cast<double>(pos[t]) * inv_freq[i];
        EXPECT_NEAR(b[i], a[i] * std::cos(ang) - a[i + rd / 2] * std::sin(ang), 1e-5);
        EXPECT_NEAR(b[i + rd / 2], a[i + rd / 2] * std::cos(ang) + a[i] * std::sin(ang), 1e-5);
      }
      for (int64_t i = rd; i < hd; ++i) EXPECT_EQ(b[i], a[i]);
    }
}

TEST(Ops, PagedAttentionMatchesDenseCausalAttention) {
  const int64_t bs = 4, nkv = 2, hd = 8, nh = 4, L = 11;
  std::mt19937 rng(4);
  std::vector<float> pool(static_cast<size_t>(8 * 2 * bs * nkv * hd));
  ops::KVLayerView kv{pool.data(), bs, nkv, hd};
  const std::vector<int32_t> table = {5, 1, 7};  // scattered blocks
  const auto k = random_vec(static_cast<size_t>(L * nkv * hd), rng);
  const auto v = random_vec(static_cast<size_t>(L * nkv * hd), rng);
  const auto q = random_vec(static_cast<size_t>(L * nh * hd), rng);
  std::vector<int64_t> pos(static_cast<size_t>(L));
  std::iota(pos.begin(), pos.end(), int64_t{0});
  ops::kv_write(kv, table.data(), pos.data(), L, k.data(), v.data());
  const float scale = 0.35f;
  std::vector<float> out(q.size());
  ops::attention(kv, table.data(), pos.data(), L, L, q.data(), nh, scale, out.data());
  for (int64_t t = 0; t < L; ++t)
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t g = h / (nh / nkv);
      std::vector<double> w(static_cast<size_t>(t + 1));
      double mx = -1e30, sum = 0;
      for (int64_t p = 0; p <= t; ++p) {
        double d = 0;
        for (int64_t i = 0; i < hd; ++i) d += q[(t * nh + h) * hd + i] * k[(p * nkv + g) * hd + i];
        w[p] = d * scale;
        mx = std::max(mx, w[p]);
      }
      for (auto& e : w) sum += (e = std::exp(e - mx));
      for (int64_t i = 0; i < hd; ++i) {
        double o = 0;
        for (int64_t p = 0; p <= t; ++p) o += w[p] / sum * v[(p * nkv + g) * hd + i];
        EXPECT_NEAR(out[(t * nh + h) * hd + i], o, 1e-5);
      }
    }
  // The last 3 queries alone (a verify window over a cached prefix), under a looser position
  // bound, give the same bits; so does one query given out of order with a repeat.
  std::vector<float> tail(static_cast<size_t>(3 * nh * hd));
  ops::attention(kv, table.data(), pos.data() + (L - 3), 3, 4 * bs, q.data() + (L - 3) * nh * hd,
                 nh, scale, tail.data());
  EXPECT_EQ(0, std::memcmp(tail.data(), out.data() + (L - 3) * nh * hd, tail.size() * 4));
  const std::vector<int64_t> picked = {7, 2, 7};
  std::vector<float> qp, got(static_cast<size_t>(3 * nh * hd));
  for (const int64_t p : picked)
    qp.insert(qp.end(), q.begin() + p * nh * hd, q.begin() + (p + 1) * nh * hd);
  ops::attention(kv, table.data(), picked.data(), 3, L, qp.data(), nh, scale, got.data());
  for (size_t j = 0; j < picked.size(); ++j)
    EXPECT_EQ(0, std::memcmp(got.data() + j * nh * hd, out.data() + picked[j] * nh * hd,
                             static_cast<size_t>(nh * hd) * 4))
        << "query at position " << picked[j];
  // The output gate gives the bits of the ungated output followed by sigmoid_gate.
  const auto gate = random_vec(out.size(), rng, 3.0f);
  std::vector<float> gated(out.size()), want_gated = out;
  ops::sigmoid_gate(want_gated.data(), gate.data(), static_cast<int64_t>(out.size()));
  ops::attention(kv, table.data(), pos.data(), L, L, q.data(), nh, scale, gated.data(),
                 gate.data());
  EXPECT_EQ(0, std::memcmp(gated.data(), want_gated.data(), gated.size() * 4));
  // A position at or past the bound is the caller's bug, reported rather than read past.
  EXPECT_THROW(
      ops::attention(kv, table.data(), pos.data(), L, L - 1, q.data(), nh, scale, out.data()),
      Error);
}

// attention_rows: rows with their own block tables in one call; each query's bits are those of
// its row's attention() call under any window hint, and a skipped query's output is untouched;
// a window below 1 is refused.
TEST(Ops, AttentionRowsEqualsEachRowsAttention) {
  const int64_t bs = 4, nkv = 2, hd = 8, nh = 4, stride = 3;
  std::mt19937 rng(9);
  std::vector<float> pool = random_vec(static_cast<size_t>(10 * 2 * bs * nkv * hd), rng);
  const ops::KVLayerView kv{pool.data(), bs, nkv, hd};
  const std::vector<int32_t> tables = {5, 1, 7, /* row 1 */ 2, 9, 0, /* row 2 */ 3, 8, 4};
  // Row 0: positions 9, 10; row 2 (skipped): 0, 1; row 1: 4, 5, 6.
  const std::vector<int64_t> pos = {9, 10, 0, 1, 4, 5, 6}, rows = {0, 0, -1, -1, 1, 1, 1};
  const int64_t T = 7, qf = nh * hd;
  const auto q = random_vec(static_cast<size_t>(T * qf), rng);
  const auto gate = random_vec(q.size(), rng, 3.0f);
  const float scale = 0.35f;
  for (const bool gated : {false, true})
    for (const int64_t window : {1, 2, 3}) {
      std::vector<float> got(q.size(), -7.0f);
      ops::attention_rows(kv, tables.data(), stride, rows.data(), pos.data(), T, 12, window,
                          q.data(), nh, scale, got.data(), gated ? gate.data() : nullptr);
      std::vector<float> want(q.size(), -7.0f);
      ops::attention(kv, tables.data(), pos.data(), 2, 12, q.data(), nh, scale, want.data(),
                     gated ? gate.data() : nullptr);
      ops::attention(kv, tables.data() + stride, pos.data() + 4, 3, 12, q.data() + 4 * qf, nh,
                     scale, want.data() + 4 * qf, gated ? gate.data() + 4 * qf : nullptr);
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
          << (gated ? "gated" : "ungated") << " window " << window;
    }
  std::vector<float> out(q.size());
  EXPECT_THROW(ops::attention_rows(kv, tables.data(), stride, rows.data(), pos.data(), T, 12, 0,
                                   q.data(), nh, scale, out.data()),
               Error);
}

// bf16 KV storage: kv_write rounds each key and value to nearest even, kv_write_stored copies
// stored rows as they are, and attention over a bf16 pool is bitwise attention over an fp32
// pool holding the same (rounded) values.
TEST(Ops, Bf16KvStoresRoundedValuesAndAttentionReadsThemExactly) {
  const int64_t bs = 4, nkv = 2, hd = 8, nh = 4, row = nkv * hd, L = 11;
  std::mt19937 rng(21);
  std::vector<uint16_t> pool16(static_cast<size_t>(4 * 2 * bs * row), 0);
  std::vector<float> pool32(static_cast<size_t>(4 * 2 * bs * row), 0.0f);
  const ops::KVLayerView kv16{pool16.data(), bs, nkv, hd, DType::BF16};
  const ops::KVLayerView kv32{pool32.data(), bs, nkv, hd, DType::F32};
  EXPECT_EQ(kv16.row_bytes(), static_cast<size_t>(row) * 2);
  const std::vector<int32_t> table = {2, 0, 3};
  std::vector<int64_t> pos(static_cast<size_t>(L));
  for (int64_t p = 0; p < L; ++p) pos[static_cast<size_t>(p)] = p;
  auto k = random_vec(static_cast<size_t>(L * row), rng);
  auto v = random_vec(k.size(), rng);
  k[0] = 1.0f + 1.0f / 256;  // halfway between two bf16 values: rounds to the even one, 1.0
  k[1] = 1.0f + 3.0f / 256;  // ... and up, to 1 + 4/256
  ops::kv_write(kv16, table.data(), pos.data(), L, k.data(), v.data());
  std::vector<float> k_rounded(k.size()), v_rounded(v.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k_rounded[i] = bf16_to_f32(f32_to_bf16(k[i]));
    v_rounded[i] = bf16_to_f32(f32_to_bf16(v[i]));
  }
  EXPECT_EQ(k_rounded[0], 1.0f);
  EXPECT_EQ(k_rounded[1], 1.0f + 4.0f / 256);
  ops::kv_write(kv32, table.data(), pos.data(), L, k_rounded.data(), v_rounded.data());
  for (int64_t p = 0; p < L; ++p) {
    const auto* key = reinterpret_cast<const uint16_t*>(kv16.key(table[p / bs], p % bs));
    const auto* value = reinterpret_cast<const uint16_t*>(kv16.value(table[p / bs], p % bs));
    for (int64_t i = 0; i < row; ++i) {
      ASSERT_EQ(key[i], f32_to_bf16(k[p * row + i])) << "key of position " << p;
      ASSERT_EQ(value[i], f32_to_bf16(v[p * row + i])) << "value of position " << p;
    }
  }
  const auto q = random_vec(static_cast<size_t>(L * nh * hd), rng);
  std::vector<float> got(q.size()), want(q.size());
  ops::attention(kv16, table.data(), pos.data(), L, L, q.data(), nh, 0.3f, got.data());
  ops::attention(kv32, table.data(), pos.data(), L, L, q.data(), nh, 0.3f, want.data());
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));

  // Stored rows restored into other blocks: the same bits, no second rounding.
  std::vector<uint16_t> keys(static_cast<size_t>(L * row)), values(keys.size());
  for (int64_t p = 0; p < L; ++p) {
    std::memcpy(keys.data() + p * row, kv16.key(table[p / bs], p % bs), kv16.row_bytes());
    std::memcpy(values.data() + p * row, kv16.value(table[p / bs], p % bs), kv16.row_bytes());
  }
  const std::vector<int32_t> other = {1, 3, 0};
  ops::kv_write_stored(kv16, other.data(), pos.data(), L, keys.data(), values.data());
  std::vector<float> restored(q.size());
  ops::attention(kv16, other.data(), pos.data(), L, L, q.data(), nh, 0.3f, restored.data());
  EXPECT_EQ(0, std::memcmp(restored.data(), got.data(), got.size() * sizeof(float)));
}

TEST(Ops, KvStorageOtherThanF32OrBf16IsRefused) {
  std::vector<float> pool(64), k(8), v(8);
  const ops::KVLayerView kv{pool.data(), 2, 2, 4, DType::F16};
  const int64_t pos[] = {0};
  EXPECT_THROW(ops::check_kv_dtype(kv.dtype, "test"), Error);
  std::vector<float> q(8), qg(16), gate(8), kk(8);
  const std::vector<float> ones(4, 1.0f);
  const ops::WeightRef norm{DType::F32, ones.data(), 1, 4, {}};
  ops::QkNormRope s;
  s.n_tokens = 1, s.n_heads = 1, s.n_kv_heads = 1, s.head_dim = 4, s.rotary_dim = 4;
  const ops::KVLayerView one_head{pool.data(), 2, 1, 4, DType::F16};
  const int64_t slots[] = {0};
  s.kv = &one_head, s.kv_slots = slots, s.v = v.data();
  const float inv_freq[] = {1.0f, 0.5f};
  EXPECT_THROW(
      ops::qk_norm_rope(s, qg.data(), norm, norm, pos, inv_freq, q.data(), gate.data(), kk.data()),
      Error);
}

TEST(Ops, CausalConvCarriesStateAcrossCalls) {
  const int64_t C = 5, K = 4, n = 7;
  std::mt19937 rng(5);
  StoredWeight w = make_weight(DType::F32, C, K, rng);
  const auto x = random_vec(static_cast<size_t>(n * C), rng);
  std::vector<float> st1(static_cast<size_t>(C * (K - 1)), 0.0f), st2 = st1;
  std::vector<float> all(x.size()), split(x.size());
  ops::causal_conv_silu(x.data(), n, C, K, w.ref, st1.data(), all.data());
  ops::causal_conv_silu(x.data(), 3, C, K, w.ref, st2.data(), split.data());
  ops::causal_conv_silu(x.data() + 3 * C, n - 3, C, K, w.ref, st2.data(), split.data() + 3 * C);
  EXPECT_EQ(all, split);
  EXPECT_EQ(st1, st2);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t src = t - (K - 1) + j;
        if (src >= 0) acc += w.values[c * K + j] * x[src * C + c];
      }
      EXPECT_NEAR(all[t * C + c], acc / (1 + std::exp(-acc)), 1e-5);
    }
}

TEST(Ops, GatedDeltaRuleMatchesReferenceRecurrence) {
  const ops::DeltaHeads h{2, 4, 8, 6};
  const int64_t n = 5;
  std::mt19937 rng(6);
  const auto q = random_vec(static_cast<size_t>(n * h.n_k_heads * h.dk), rng);
  const auto k = random_vec(static_cast<size_t>(n * h.n_k_heads * h.dk), rng);
  const auto v = random_vec(static_cast<size_t>(n * h.n_v_heads * h.dv), rng);
  const auto a = random_vec(static_cast<size_t>(n * h.n_v_heads), rng);
  const auto b = random_vec(static_cast<size_t>(n * h.n_v_heads), rng);
  StoredWeight A_log = make_weight(DType::F32, 1, h.n_v_heads, rng, 0.5f);
  StoredWeight dt = make_weight(DType::F32, 1, h.n_v_heads, rng, 0.5f);
  const size_t S = static_cast<size_t>(h.n_v_heads * h.dk * h.dv);
  std::vector<float> state(S, 0.0f), out(static_cast<size_t>(n * h.n_v_heads * h.dv));
  std::vector<float> after(S * n);
  ops::gated_delta_rule(q.data(), k.data(), v.data(), a.data(), b.data(), A_log.ref, dt.ref, n, h,
                        state.data(), out.data(), after.data());
  std::vector<double> ref(S, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t vh = 0; vh < h.n_v_heads; ++vh) {
      const int64_t kh = vh / (h.n_v_heads / h.n_k_heads);
      std::vector<double> qn(h.dk), kn(h.dk);
      double qs = 0, ks = 0;
      for (int64_t i = 0; i < h.dk; ++i) {
        qs += std::pow(q[(t * h.n_k_heads + kh) * h.dk + i], 2);
        ks += std::pow(k[(t * h.n_k_heads + kh) * h.dk + i], 2);
      }
      for (int64_t i = 0; i < h.dk; ++i) {
        qn[i] = q[(t * h.n_k_heads + kh) * h.dk + i] / std::sqrt(qs + 1e-6) / std::sqrt(h.dk);
        kn[i] = k[(t * h.n_k_heads + kh) * h.dk + i] / std::sqrt(ks + 1e-6);
      }
      const double x = a[t * h.n_v_heads + vh] + dt.values[vh];
      const double g = -std::exp(A_log.values[vh]) * std::log1p(std::exp(x));
      const double beta = 1 / (1 + std::exp(-b[t * h.n_v_heads + vh]));
      double* Sm = ref.data() + vh * h.dk * h.dv;
      for (int64_t i = 0; i < h.dk * h.dv; ++i) Sm[i] *= std::exp(g);
      for (int64_t j = 0; j < h.dv; ++j) {
        double mem = 0;
        for (int64_t i = 0; i < h.dk; ++i) mem += Sm[i * h.dv + j] * kn[i];
        const double u = (v[(t * h.n_v_heads + vh) * h.dv + j] - mem) * beta;
        for (int64_t i = 0; i < h.dk; ++i) Sm[i * h.dv + j] += kn[i] * u;
      }
      for (int64_t j = 0; j < h.dv; ++j) {
        double o = 0;
        for (int64_t i = 0; i < h.dk; ++i) o += Sm[i * h.dv + j] * qn[i];
        EXPECT_NEAR(out[(t * h.n_v_heads + vh) * h.dv + j], o, 1e-5);
      }
      for (int64_t i = 0; i < h.dk * h.dv; ++i)
        EXPECT_NEAR(after[t * S + vh * h.dk * h.dv + i], Sm[i], 1e-5);
    }
  // Token-by-token calls leave the same state bits as one call over the window.
  std::vector<float> state2(S, 0.0f), out2(out.size());
  for (int64_t t = 0; t < n; ++t)
    ops::gated_delta_rule(q.data() + t * h.n_k_heads * h.dk, k.data() + t * h.n_k_heads * h.dk,
                          v.data() + t * h.n_v_heads * h.dv, a.data() + t * h.n_v_heads,
                          b.data() + t * h.n_v_heads, A_log.ref, dt.ref, 1, h, state2.data(),
                          out2.data() + t * h.n_v_heads * h.dv);
  EXPECT_EQ(state, state2);
  EXPECT_EQ(out, out2);
}

// The batched recurrent ops: rows of 1, 4, 1, 9 and 2 tokens laid out in the call's arrays in
// another order than their descriptors, some keeping per-token states, some settling fewer
// tokens than they run (a verify window under Replay settles one), plus an idle row (n = 0), with
// one descriptor array for both ops as a layer uses it. Each row gets the outputs and per-token
// states of the single-row ops run on a copy of that row's inputs and states, and the states
// those ops leave after its settled tokens; the idle row's states stay.
TEST(Ops, RecurrentRowsEqualSingleRowCalls) {
  const auto z = [](int64_t v) { return static_cast<size_t>(v); };
  const int64_t C = 37, K = 4, hist = K - 1;
  const ops::DeltaHeads h{2, 4, 8, 6};
  const int64_t qk = h.n_k_heads * h.dk, vr = h.n_v_heads * h.dv, nv = h.n_v_heads;
  const int64_t S = h.n_v_heads * h.dk * h.dv;
  const std::vector<int64_t> ns = {1, 4, 1, 9, 2, 0};
  const std::vector<bool> keeps = {true, false, false, true, true, true};
  const std::vector<int64_t> settled = {-1, 1, 0, 4, 2, -1};
  const std::vector<size_t> order = {3, 0, 5, 4, 2, 1};
  const int64_t R = static_cast<int64_t>(ns.size());
  std::vector<int64_t> first(ns.size());
  int64_t T = 0, max_n = 0;
  for (const size_t r : order) {
    first[r] = T;
    T += ns[r];
    max_n = std::max(max_n, ns[r]);
  }

  std::mt19937 rng(7);
  StoredWeight w = make_weight(DType::F32, C, K, rng, 0.5f);
  StoredWeight A_log = make_weight(DType::F32, 1, nv, rng, 0.5f);
  StoredWeight dt = make_weight(DType::F32, 1, nv, rng, 0.5f);
  const auto x = random_vec(z(T * C), rng);
  const auto q = random_vec(z(T * qk), rng), k = random_vec(z(T * qk), rng);
  const auto v = random_vec(z(T * vr), rng);
  const auto a = random_vec(z(T * nv), rng, 2.0f), b = random_vec(z(T * nv), rng, 2.0f);
  std::vector<std::vector<float>> conv0(z(R)), state0(z(R)), conv(z(R)), state(z(R)),
      conv_after(z(R)), state_after(z(R));
  std::vector<ops::RecurrentRow> rows(z(R));
  for (size_t r = 0; r < z(R); ++r) {
    conv0[r] = conv[r] = random_vec(z(C * hist), rng);
    state0[r] = state[r] = random_vec(z(S), rng, 0.1f);
    conv_after[r].assign(keeps[r] ? z(ns[r] * C * hist) : 0, NAN);
    state_after[r].assign(keeps[r] ? z(ns[r] * S) : 0, NAN);
    rows[r] = {.first_token = first[r],
               .n = ns[r],
               .conv_state = conv[r].data(),
               .conv_after = keeps[r] ? conv_after[r].data() : nullptr,
               .state = state[r].data(),
               .state_after = keeps[r] ? state_after[r].data() : nullptr,
               .settled = settled[r]};
  }
  std::vector<float> conv_out(z(T * C), NAN), delta_out(z(T * vr), NAN);
  ops::causal_conv_silu_rows(x.data(), C, K, w.ref, rows.data(), R, max_n, conv_out.data());
  ops::gated_delta_rule_rows(q.data(), k.data(), v.data(), a.data(), b.data(), A_log.ref, dt.ref,
                             rows.data(), R, max_n, h, delta_out.data());

  const auto same = [](const float* got, const std::vector<float>& want) {
    return want.empty() || std::memcmp(got, want.data(), want.size() * sizeof(float)) == 0;
  };
  for (size_t r = 0; r < z(R); ++r) {
    const int64_t n = ns[r], t0 = first[r];
    std::vector<float> st = conv0[r], out(z(n * C)), after(conv_after[r].size());
    ops::causal_conv_silu(x.data() + t0 * C, n, C, K, w.ref, st.data(), out.data(),
                          keeps[r] ? after.data() : nullptr);
    EXPECT_TRUE(same(conv_out.data() + t0 * C, out)) << "row " << r << ": conv out";
    // The state after the settled tokens alone (all of them unless the row says otherwise).
    const int64_t kept = ops::settled_tokens(rows[r]);
    EXPECT_EQ(kept, settled[r] < 0 ? n : settled[r]);
    if (kept < n) {
      st = conv0[r];
      ops::causal_conv_silu(x.data() + t0 * C, kept, C, K, w.ref, st.data(), out.data(), nullptr);
    }
    EXPECT_TRUE(same(conv[r].data(), st)) << "row " << r << ": conv state";
    EXPECT_TRUE(same(conv_after[r].data(), after)) << "row " << r << ": conv_after";

    std::vector<float> S1 = state0[r], o(z(n * vr)), S_after(state_after[r].size());
    ops::gated_delta_rule(q.data() + t0 * qk, k.data() + t0 * qk, v.data() + t0 * vr,
                          a.data() + t0 * nv, b.data() + t0 * nv, A_log.ref, dt.ref, n, h,
                          S1.data(), o.data(), keeps[r] ? S_after.data() : nullptr);
    EXPECT_TRUE(same(delta_out.data() + t0 * vr, o)) << "row " << r << ": delta out";
    if (kept < n) {
      S1 = state0[r];
      ops::gated_delta_rule(q.data() + t0 * qk, k.data() + t0 * qk, v.data() + t0 * vr,
                            a.data() + t0 * nv, b.data() + t0 * nv, A_log.ref, dt.ref, kept, h,
                            S1.data(), o.data(), nullptr);
    }
    EXPECT_TRUE(same(state[r].data(), S1)) << "row " << r << ": state";
    EXPECT_TRUE(same(state_after[r].data(), S_after)) << "row " << r << ": state_after";
  }
  EXPECT_EQ(conv[5], conv0[5]) << "the idle row's conv state changed";
  EXPECT_EQ(state[5], state0[5]) << "the idle row's state changed";

  // A row longer than max_n breaks the call's contract and is refused before any row runs.
  const auto before = state[0];
  EXPECT_THROW(
      ops::gated_delta_rule_rows(q.data(), k.data(), v.data(), a.data(), b.data(), A_log.ref,
                                 dt.ref, rows.data(), R, max_n - 1, h, delta_out.data()),
      Error);
  EXPECT_EQ(state[0], before);
}

// recurrent_layers_rows runs each layer's rows as the two per-layer calls do, q, k, v read from
// the layer's conv output; a conv whose channels are not the recurrence's q | k | v rows, and a
// row longer than max_n, are refused before any state changes.
TEST(Ops, LayeredRecurrentRowsEqualPerLayerCalls) {
  const auto z = [](int64_t v) { return static_cast<size_t>(v); };
  ops::DeltaHeads h{1, 2, 4, 3};
  const int64_t C = 2 * 4 + 2 * 3, K = 3, nl = 2, R = 3, S = 2 * 4 * 3;
  h.qkv_token_stride = C;
  const std::vector<int64_t> n = {2, 0, 3}, first = {3, 0, 0};
  const int64_t T = 5, max_n = 3;
  std::mt19937 rng(11);
  std::vector<StoredWeight> conv_w, A_log, dt;
  std::vector<std::vector<float>> x, a, b;
  for (int64_t l = 0; l < nl; ++l) {
    conv_w.push_back(make_weight(DType::F32, C, K, rng, 0.5f));
    A_log.push_back(make_weight(DType::F32, 1, 2, rng, 0.5f));
    dt.push_back(make_weight(DType::F32, 1, 2, rng, 0.5f));
    x.push_back(random_vec(z(T * C), rng));
    a.push_back(random_vec(z(T * 2), rng, 2.0f));
    b.push_back(random_vec(z(T * 2), rng, 2.0f));
  }
  std::vector<std::vector<float>> conv0, state0;
  for (int64_t i = 0; i < nl * R; ++i) {
    conv0.push_back(random_vec(z(C * (K - 1)), rng));
    state0.push_back(random_vec(z(S), rng, 0.1f));
  }
  auto run = [&](bool layered, std::vector<std::vector<float>>& conv,
                 std::vector<std::vector<float>>& state, std::vector<std::vector<float>>& outs,
                 int64_t call_max_n) {
    conv = conv0;
    state = state0;
    std::vector<std::vector<float>> conv_out(z(nl), std::vector<float>(z(T * C), NAN));
    outs.assign(z(nl), std::vector<float>(z(T * 6), NAN));
    std::vector<ops::RecurrentRow> desc(z(nl * R));
    std::vector<ops::RecurrentLayer> table(z(nl));
    for (int64_t l = 0; l < nl; ++l) {
      for (int64_t r = 0; r < R; ++r)
        desc[z(l * R + r)] = {.first_token = first[z(r)],
                              .n = n[z(r)],
                              .conv_state = conv[z(l * R + r)].data(),
                              .state = state[z(l * R + r)].data()};
      table[z(l)] = {x[z(l)].data(),  conv_w[z(l)].ref, a[z(l)].data(),        b[z(l)].data(),
                     A_log[z(l)].ref, dt[z(l)].ref,     conv_out[z(l)].data(), outs[z(l)].data()};
    }
    if (layered) {
      ops::recurrent_layers_rows({table.data(), table.data(), nl}, C, K, desc.data(), R, call_max_n,
                                 h);
      return;
    }
    for (int64_t l = 0; l < nl; ++l) {
      const ops::RecurrentRow* d = desc.data() + l * R;
      float* co = conv_out[z(l)].data();
      ops::causal_conv_silu_rows(x[z(l)].data(), C, K, conv_w[z(l)].ref, d, R, max_n, co);
      ops::gated_delta_rule_rows(co, co + 4, co + 8, a[z(l)].data(), b[z(l)].data(),
                                 A_log[z(l)].ref, dt[z(l)].ref, d, R, max_n, h, outs[z(l)].data());
    }
  };
  std::vector<std::vector<float>> conv, state, out, want_conv, want_state, want_out;
  run(false, want_conv, want_state, want_out, max_n);
  run(true, conv, state, out, max_n);
  EXPECT_EQ(conv, want_conv);
  EXPECT_EQ(state, want_state);
  for (int64_t l = 0; l < nl; ++l)
    EXPECT_EQ(0, std::memcmp(out[z(l)].data(), want_out[z(l)].data(), sizeof(float) * T * 6))
        << "layer " << l;
  EXPECT_NE(state[1 * R + 2], state0[1 * R + 2]) << "the last layer's row never ran";

  EXPECT_THROW(run(true, conv, state, out, max_n - 1), Error);
  EXPECT_EQ(state, state0) << "a refused call changed a state";
  h.qkv_token_stride = 0;
  try {
    run(true, conv, state, out, max_n);
    ADD_FAILURE() << "a conv whose channels are not q | k | v rows was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q | k | v"), std::string::npos) << e.what();
  }
}

// The prefill GEMM tile an engine derives from its chunk: the chunk rounded up to whole 16-row
// m-tiles, never past the largest tile; a tile outside that set is refused, not used.
TEST(Ops, PrefillGemmRowsFollowTheChunk) {
  EXPECT_EQ(ops::prefill_gemm_rows(1), 16);
  EXPECT_EQ(ops::prefill_gemm_rows(16), 16);
  EXPECT_EQ(ops::prefill_gemm_rows(17), 32);
  EXPECT_EQ(ops::prefill_gemm_rows(64), 64);
  EXPECT_EQ(ops::prefill_gemm_rows(100), 112);
  EXPECT_EQ(ops::prefill_gemm_rows(256), 256);
  EXPECT_EQ(ops::prefill_gemm_rows(4000), 4000);
  EXPECT_EQ(ops::prefill_gemm_rows(4096), 4096);
  EXPECT_EQ(ops::prefill_gemm_rows(8192), ops::kMaxPrefillGemmRows);
  EXPECT_EQ(ops::kMaxPrefillGemmRows, 4096);
  EXPECT_THROW(ops::prefill_gemm_rows(0), Error);
  for (const int64_t bad : {0, 8, 24, 4104, 4112})
    EXPECT_THROW(ops::set_prefill(true, bad), Error) << bad;
  ops::set_prefill(false, 0);  // off: the tile is not looked at
}

TEST(Dtype, HalfConversionsRoundTrip) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f, 1e-6f,
                  3.14159f, 1e5f}) {
    const float h = f16_to_f32(f32_to_f16(f));
    if (std::fabs(f) <= 65504.0f) {
      EXPECT_NEAR(h, f, std::fabs(f) * 1e-3 + 6e-8) << f;
    }
    EXPECT_NEAR(bf16_to_f32(f32_to_bf16(f)), f, std::fabs(f) * 8e-3) << f;
  }
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
  for (uint32_t u = 0; u < 65536; ++u) {  // every finite f16 value survives f16→f32→f16
    const uint16_t h = static_cast<uint16_t>(u);
    if ((h & 0x7c00u) == 0x7c00u) continue;
    ASSERT_EQ(f32_to_f16(f16_to_f32(h)), h) << std::hex << u;
  }
}

}  // namespace
}  // namespace tandem
