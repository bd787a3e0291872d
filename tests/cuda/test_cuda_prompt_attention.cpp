// cuda::attention_prompt (backend/cuda/attention_prompt.h: prompt prefill attention from one
// row's contiguous q/k/v) against cpu::attention on a paged KV cache filled from the same k/v
// (block size 16, shuffled blocks, tokens at positions 0..n-1).
//
// Tolerance: 2e-3 of the max |value| of each (token, head) output vector. The CUDA op computes
// the scores near fp32 but multiplies P·V with P and V rounded to TF32 (10-bit mantissa); emulated
// on these inputs that costs up to ~1e-3 of the vector's max. A wrong mask, a missed head or a
// mixed-up GQA group is off by far more. Everything else is checked bitwise: unwritten outputs
// (NaN poison), run-to-run determinism, causality, and independence from earlier calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cuda/attention_prompt.h"
#include "tandem/backend/cuda/cuda_ops.h"

namespace tandem {
namespace {

using tandem::testing::bitwise_equal;
using tandem::testing::CudaParamTest;
using tandem::testing::CudaTest;
using tandem::testing::DeviceBuffer;
using tandem::testing::nan_buffer;
using tandem::testing::near_blocks;
using tandem::testing::randn;
using tandem::testing::slice;
using tandem::testing::uniform;

constexpr double kPromptAttnRel = 2e-3;
constexpr int64_t kBlockSize = 16;

inline size_t sz(int64_t v) {
  return static_cast<size_t>(v);
}

struct PromptCase {
  int64_t n, n_heads, n_kv_heads, head_dim;
  float sharpness;  // multiplies the softmax scale 1/sqrt(head_dim): > 1 makes attention peaky
};
void PrintTo(const PromptCase& c, std::ostream* os) {
  *os << "n " << c.n << " heads " << c.n_heads << "/" << c.n_kv_heads << " head_dim " << c.head_dim
      << " sharpness " << c.sharpness;
}
std::string prompt_name(const ::testing::TestParamInfo<PromptCase>& p) {
  const PromptCase& c = p.param;
  return "n" + std::to_string(c.n) + "_H" + std::to_string(c.n_heads) + "_KV" +
         std::to_string(c.n_kv_heads) + "_D" + std::to_string(c.head_dim) +
         (c.sharpness != 1.0f ? "_sharp" : "");
}

// One row's projections on host and device.
struct PromptInputs {
  PromptCase c;
  float scale = 0.0f;
  std::vector<float> q, k, v;
  DeviceBuffer<float> dq, dk, dv;
  size_t out_size() const { return sz(c.n * c.n_heads * c.head_dim); }
};

PromptInputs make_inputs(const PromptCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  PromptInputs in;
  in.c = c;
  in.scale = c.sharpness / std::sqrt(static_cast<float>(c.head_dim));
  in.q = randn(sz(c.n * c.n_heads * c.head_dim), rng);
  in.k = randn(sz(c.n * c.n_kv_heads * c.head_dim), rng);
  in.v = randn(sz(c.n * c.n_kv_heads * c.head_dim), rng);
  in.dq = DeviceBuffer<float>(in.q);
  in.dk = DeviceBuffer<float>(in.k);
  in.dv = DeviceBuffer<float>(in.v);
  return in;
}

// cpu::attention of tokens at positions 0..n-1 over a paged pool that kv_write filled with the
// row's k/v: shuffled block ids, unwritten slots holding large garbage.
std::vector<float> cpu_reference(const PromptInputs& in, uint32_t seed) {
  const PromptCase& c = in.c;
  std::mt19937 rng(seed);
  const int64_t used = std::max<int64_t>(1, (c.n + kBlockSize - 1) / kBlockSize);
  const int64_t n_blocks = used + 3;
  std::vector<int32_t> ids(sz(n_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  const std::vector<int32_t> table(ids.begin(), ids.begin() + used);
  std::vector<float> pool =
      uniform(sz(n_blocks * 2 * kBlockSize * c.n_kv_heads * c.head_dim), rng, -1000.0f, 1000.0f);
  const ops::KVLayerView kv{pool.data(), kBlockSize, c.n_kv_heads, c.head_dim};
  std::vector<int64_t> positions(sz(c.n));
  std::iota(positions.begin(), positions.end(), int64_t{0});
  cpu::kv_write(kv, table.data(), positions.data(), c.n, in.k.data(), in.v.data());
  std::vector<float> out(in.out_size());
  cpu::attention(kv, table.data(), positions.data(), c.n, c.n, in.q.data(), c.n_heads, in.scale,
                 out.data());
  return out;
}

// One cuda::attention_prompt call into a fresh NaN-poisoned output, downloaded.
std::vector<float> run_cuda(const PromptInputs& in) {
  const PromptCase& c = in.c;
  DeviceBuffer<float> out = nan_buffer(in.out_size());
  cuda::attention_prompt(in.dq.get(), in.dk.get(), in.dv.get(), c.n, c.n_heads, c.n_kv_heads,
                         c.head_dim, in.scale, out.get());
  return out.download();
}

// Every value finite; otherwise how many are not and where the first is (an output left at its
// NaN poison shows up here).
::testing::AssertionResult all_finite(const std::vector<float>& x, int64_t head_dim,
                                      int64_t n_heads) {
  size_t bad = 0, first = SIZE_MAX;
  for (size_t i = 0; i < x.size(); ++i)
    if (!std::isfinite(x[i])) {
      ++bad;
      if (first == SIZE_MAX) first = i;
    }
  if (bad == 0) return ::testing::AssertionSuccess();
  const int64_t f = static_cast<int64_t>(first);
  return ::testing::AssertionFailure()
         << bad << " of " << x.size() << " outputs not finite (unwritten or overflowed); first "
         << "at token " << f / (n_heads * head_dim) << ", head " << (f / head_dim) % n_heads
         << ", dim " << f % head_dim << ": " << x[first];
}

using CudaPromptAttention = CudaParamTest<PromptCase>;

TEST_P(CudaPromptAttention, MatchesCpuAttentionWritesEverythingAndIsDeterministic) {
  const PromptCase c = GetParam();
  const uint32_t seed = static_cast<uint32_t>(500 + 31 * c.n + c.n_heads + c.head_dim);
  const PromptInputs in = make_inputs(c, seed);
  const std::vector<float> want = cpu_reference(in, seed + 1);

  const std::vector<float> got = run_cuda(in);
  ASSERT_TRUE(all_finite(got, c.head_dim, c.n_heads));
  EXPECT_TRUE(near_blocks(got, want, sz(c.head_dim), kPromptAttnRel))
      << "blocks are (token, head) vectors of head_dim " << c.head_dim;

  const std::vector<float> again = run_cuda(in);
  EXPECT_TRUE(bitwise_equal(again, got)) << "two calls on the same inputs differ";
}

// GQA 16/4 at head_dim 256 (Qwen3.5 full attention) from a single token to several query
// chunks; 8/2 with a chunk-internal length; 4/4 at head_dim 64 one token past a 512-row chunk;
// a peaky softmax (scores spread 30x wider: exp overflows unless the max is subtracted).
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaPromptAttention,
    ::testing::Values(PromptCase{1, 16, 4, 256, 1.0f}, PromptCase{37, 16, 4, 256, 1.0f},
                      PromptCase{300, 8, 2, 256, 1.0f}, PromptCase{513, 4, 4, 64, 1.0f},
                      PromptCase{2048, 16, 4, 256, 1.0f}, PromptCase{300, 8, 2, 256, 30.0f}),
    prompt_name);

using CudaPromptAttentionProps = CudaTest;

// Causality, bitwise: scaling the last token's key and value (signs kept, so masked products
// stay the same signed zeros) changes nothing for tokens 0..n-2 and does change token n-1.
// n = 600 spans two query chunks.
TEST_F(CudaPromptAttentionProps, LaterTokensDoNotReachEarlierOutputs) {
  const PromptCase c{600, 8, 2, 64, 1.0f};
  PromptInputs in = make_inputs(c, 4242);
  const std::vector<float> before = run_cuda(in);
  ASSERT_TRUE(all_finite(before, c.head_dim, c.n_heads));

  const int64_t row = c.n_kv_heads * c.head_dim, last = (c.n - 1) * row;
  for (int64_t i = 0; i < row; ++i) {
    in.k[sz(last + i)] *= 7.0f;
    in.v[sz(last + i)] *= 7.0f;
  }
  in.dk.upload(in.k);
  in.dv.upload(in.v);
  const std::vector<float> after = run_cuda(in);
  ASSERT_TRUE(all_finite(after, c.head_dim, c.n_heads));

  const size_t token = sz(c.n_heads * c.head_dim), early = sz(c.n - 1) * token;
  EXPECT_TRUE(bitwise_equal(slice(after, 0, early), slice(before, 0, early)))
      << "changing the last token's k/v changed an earlier token's output";
  EXPECT_FALSE(bitwise_equal(slice(after, early, token), slice(before, early, token)))
      << "the last token's output ignores its own key and value";
}

// A call's result depends on its inputs only: the scratch left by a call of another shape (which
// may also have grown it) does not change the bits.
TEST_F(CudaPromptAttentionProps, ResultsDoNotDependOnEarlierCalls) {
  const PromptInputs a = make_inputs({300, 8, 2, 256, 1.0f}, 77);
  const PromptInputs b = make_inputs({1100, 16, 4, 128, 1.0f}, 78);
  const std::vector<float> a1 = run_cuda(a);
  ASSERT_TRUE(all_finite(a1, 256, 8));
  const std::vector<float> b1 = run_cuda(b);
  ASSERT_TRUE(all_finite(b1, 128, 16));
  EXPECT_TRUE(bitwise_equal(run_cuda(a), a1)) << "row A after row B";
  EXPECT_TRUE(bitwise_equal(run_cuda(b), b1)) << "row B after row A";
}

TEST_F(CudaPromptAttentionProps, ZeroTokensIsANoOp) {
  DeviceBuffer<float> x(std::vector<float>(64, 1.0f));
  const std::vector<float> sentinel(64, 3.0f);
  DeviceBuffer<float> out(sentinel);
  EXPECT_NO_THROW(cuda::attention_prompt(x.get(), x.get(), x.get(), 0, 4, 2, 16, 0.25f, out.get()));
  EXPECT_NO_THROW(cuda::synchronize()) << "an empty call launched an invalid kernel";
  EXPECT_TRUE(bitwise_equal(out.download(), sentinel)) << "an empty call wrote its output";
}

TEST_F(CudaPromptAttentionProps, RejectsHeadsNotAMultipleOfKvHeads) {
  DeviceBuffer<float> x(6 * 4 * 16), out(6 * 4 * 16);
  try {
    cuda::attention_prompt(x.get(), x.get(), x.get(), 4, 6, 4, 16, 0.25f, out.get());
    ADD_FAILURE() << "attention_prompt accepted 6 query heads over 4 kv heads";
  } catch (const tandem::Error& e) {
    EXPECT_NE(std::string(e.what()).find("attention_prompt"), std::string::npos)
        << "error does not name the op: " << e.what();
  }
}

}  // namespace
}  // namespace tandem
