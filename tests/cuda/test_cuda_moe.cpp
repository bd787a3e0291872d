// Qwen3.5-MoE on the CUDA backend (backend/cuda/moe.cu): the op against the CPU op, batch
// invariance of a token's output whichever tokens share its experts, a MoE model's decode bits
// alone / in a verify window / next to other rows, parity of the bf16 fixture with transformers,
// and lossless speculation (n-gram and the MoE MTP layer). Run on a GPU machine: `ctest -L cuda`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "cuda/cuda_test_util.h"
#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/ops.h"
#include "tandem/backend/weight_arena.h"
#include "tandem/core/dtype.h"
#include "tandem/core/tensor.h"
#include "tandem/engine/generator.h"
#include "tandem/engine/speculative.h"
#include "tandem/io/safetensors.h"
#include "tandem/model/moe_weights.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/model/qwen3_5_random.h"
#include "tandem/spec/ngram.h"
#include "tandem/spec/qwen_mtp.h"
#include "test_util.h"

namespace tandem {
namespace {

using testing::DeviceBuffer;
using testing::ScopedBackend;
using testing::ScratchDir;
using testing::write_text;

class CudaMoe : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!ops::cuda_available())
      GTEST_FAIL() << "no usable CUDA device: the `cuda` tests run on a GPU machine only";
  }
};

// Random bf16 values (kept as their bit patterns and as the fp32 values they are).
struct Bf16Values {
  std::vector<uint16_t> bits;
  std::vector<float> values;
  Bf16Values(size_t n, float scale, std::mt19937& rng) {
    std::normal_distribution<float> d(0.0f, scale);
    for (size_t i = 0; i < n; ++i) {
      bits.push_back(f32_to_bf16(d(rng)));
      values.push_back(bf16_to_f32(bits.back()));
    }
  }
};

// Overwrites v with values on a grid of 0.5 in [-lim, lim] (lim a multiple of 0.5). Products of
// two are multiples of 0.25, so a short row's dot product is exact in fp32 whatever the order of
// its sum: router logits from such rows and inputs are the same bits on the CPU and the GPU, and
// equal logits (exact ties) are common.
void set_grid_values(Bf16Values& v, float lim, std::mt19937& rng) {
  std::uniform_int_distribution<int> d(0, static_cast<int>(4 * lim));
  for (size_t i = 0; i < v.values.size(); ++i) {
    v.values[i] = -lim + 0.5f * static_cast<float>(d(rng));
    v.bits[i] = f32_to_bf16(v.values[i]);
  }
}

// One mixture: E experts of [I, H] gate/up and [H, I] down, top k, shared expert of Is (0: none).
// The same values feed the CPU op (fp32 refs on the host) and the CUDA op (bf16 on the device,
// experts stacked as stack_moe_experts lays them out; `stacked`: every stack it makes).
struct TestMixture {
  int64_t E, k, H, I, Is;
  Bf16Values router, gate_up, down, sh_gate, sh_up, sh_down, sh_g;
  std::vector<DeviceBuffer<uint16_t>> dev;
  TestMixture(int64_t E_, int64_t k_, int64_t H_, int64_t I_, int64_t Is_, std::mt19937& rng)
      : E(E_),
        k(k_),
        H(H_),
        I(I_),
        Is(Is_),
        router(static_cast<size_t>(E * H), 2.0f / std::sqrt(float(H)), rng),
        gate_up(static_cast<size_t>(E * 2 * I * H), 1.0f / std::sqrt(float(H)), rng),
        down(static_cast<size_t>(E * H * I), 1.0f / std::sqrt(float(I)), rng),
        sh_gate(static_cast<size_t>(Is * H), 1.0f / std::sqrt(float(H)), rng),
        sh_up(static_cast<size_t>(Is * H), 1.0f / std::sqrt(float(H)), rng),
        sh_down(static_cast<size_t>(H * Is), Is ? 1.0f / std::sqrt(float(Is)) : 0.0f, rng),
        sh_g(static_cast<size_t>(H), 1.0f / std::sqrt(float(H)), rng) {}

  static ops::WeightRef ref(const void* data, DType dt, int64_t rows, int64_t cols) {
    ops::WeightRef w;
    w.data = data;
    w.dtype = dt;
    w.rows = rows;
    w.cols = cols;
    return w;
  }
  // Views of a stacked matrix: rows r0 .. r0 + rows.
  static ops::WeightRef rows_of(const ops::WeightRef& w, int64_t r0, int64_t rows) {
    ops::WeightRef v = w;
    v.data = static_cast<const char*>(w.data) + r0 * w.cols * dtype_size(w.dtype);
    v.rows = rows;
    return v;
  }
  // The mixture over tensors placed by place(values, rows, cols): the experts as views of one
  // gate/up tensor (*gu) and one down tensor (*dn).
  template <class Place>
  ops::MoeWeights assemble(Place&& place, ops::WeightRef* gu, ops::WeightRef* dn) {
    ops::MoeWeights m;
    m.top_k = k;
    m.router = place(router, E, H);
    *gu = place(gate_up, E * 2 * I, H);
    *dn = place(down, E * H, I);
    for (int64_t e = 0; e < E; ++e) {
      m.gate.push_back(rows_of(*gu, 2 * I * e, I));
      m.up.push_back(rows_of(*gu, 2 * I * e + I, I));
      m.down.push_back(rows_of(*dn, H * e, H));
    }
    if (Is > 0) {
      m.shared_gate_proj = place(sh_gate, Is, H);
      m.shared_up_proj = place(sh_up, Is, H);
      m.shared_down_proj = place(sh_down, H, Is);
      m.shared_gate = place(sh_g, 1, H);
    }
    return m;
  }
  ops::MoeWeights weights(bool cuda) {
    const DType dt = cuda ? DType::BF16 : DType::F32;
    auto place = [&](Bf16Values& v, int64_t rows, int64_t cols) {
      if (!cuda) return ref(v.values.data(), dt, rows, cols);
      dev.emplace_back(v.bits);
      return ref(dev.back().get(), dt, rows, cols);
    };
    ops::WeightRef gu, dn;
    ops::MoeWeights m = assemble(place, &gu, &dn);
    if (cuda) {
      m.experts_gate_up = gu;
      m.experts_down = dn;
    }
    return m;
  }
  // The CUDA weights as a model binds them: each tensor placed by `arena`, then
  // stack_moe_experts (the experts' views, the shared gate and up in the pair layout, the router
  // with the shared gate as its last row).
  ops::MoeWeights stacked(WeightArena& arena) {
    auto place = [&](Bf16Values& v, int64_t rows, int64_t cols) {
      return arena.matrix(ref(v.bits.data(), DType::BF16, rows, cols));
    };
    ops::WeightRef gu, dn;
    ops::MoeWeights m = assemble(place, &gu, &dn);
    stack_moe_experts(arena, &m);
    return m;
  }
};

// Inputs that are bf16 values (the GPU rounds a product's inputs to bf16; these are exact).
std::vector<float> bf16_rows(int64_t n, std::mt19937& rng) {
  return Bf16Values(static_cast<size_t>(n), 1.0f, rng).values;
}

// y = y0 + moe(x) on the device for the T rows of x.
std::vector<float> cuda_moe(const ops::MoeWeights& w, const std::vector<float>& x,
                            const std::vector<float>& y0, int64_t T,
                            std::vector<int32_t>* ids = nullptr,
                            std::vector<float>* weights = nullptr) {
  DeviceBuffer<float> dx(x), dy(y0);
  ops::moe_mlp_add(dx.get(), T, w, dy.get(), ids, weights);
  return dy.download();
}

// The largest |got - want| over the largest |want - y0| (the size of what the op added).
double relative_error(const std::vector<float>& got, const std::vector<float>& want,
                      const std::vector<float>& y0) {
  double scale = 0, worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::fabs(double(want[i] - y0[i])));
    worst = std::max(worst, std::fabs(double(got[i] - want[i])));
  }
  return worst / scale;
}

// y0 + moe(x) on the device for the T rows of x, checked against the CPU op: the same routing,
// the output within bf16 tolerance. ids (optional): the device's routing.
std::vector<float> cuda_moe_checked(const ops::MoeWeights& on_gpu, const ops::MoeWeights& on_cpu,
                                    const std::vector<float>& x, const std::vector<float>& y0,
                                    int64_t T, std::vector<int32_t>* ids = nullptr) {
  std::vector<int32_t> got_ids, want_ids;
  const auto got = cuda_moe(on_gpu, x, y0, T, &got_ids);
  std::vector<float> want = y0;
  cpu::moe_mlp_add(x.data(), T, on_cpu, want.data(), &want_ids, nullptr);
  EXPECT_EQ(got_ids, want_ids);
  EXPECT_LT(relative_error(got, want, y0), 2e-2);
  if (ids) *ids = got_ids;
  return got;
}

// linear_grouped with its mixture options (rows gathered from the tokens' rows, SwiGLU over
// transformers' gate-then-up halves) against the unfused ops: each
// pair row bitwise cuda::linear of its expert's gate and up rows for that token alone, then
// cuda::swiglu, on the staged path (groups of up to 4 rows) and the bf16-copy paths (1, 2 and 4
// m-tiles).
TEST_F(CudaMoe, GroupedSwigluOfGatheredRowsIsBitwiseTheUnfusedProducts) {
  ScopedBackend cuda(ops::Backend::Cuda);
  std::mt19937 rng(11);
  const int64_t E = 6, H = 64, I = 48;
  TestMixture mix(E, 2, H, I, 0, rng);
  const ops::MoeWeights w = mix.weights(true);
  for (const int64_t T : {1, 3, 6, 20, 40}) {
    SCOPED_TRACE("tokens " + std::to_string(T));
    const auto x = bf16_rows(T * H, rng);
    // Pair rows grouped by expert (ascending), each a random token; a group holds at most T rows.
    std::uniform_int_distribution<int> pick_token(0, static_cast<int>(T) - 1);
    std::vector<int32_t> expert, start, token_of;
    for (int32_t e = 0; e < E; e += 2) {  // every other expert, so stacked offsets matter
      expert.push_back(e);
      start.push_back(static_cast<int32_t>(token_of.size()));
      const int64_t rows = e == 2 ? T : 1 + pick_token(rng) / 2;
      for (int64_t r = 0; r < rows; ++r) token_of.push_back(pick_token(rng));
    }
    start.push_back(static_cast<int32_t>(token_of.size()));
    const int64_t P = static_cast<int64_t>(token_of.size());
    const int64_t groups = static_cast<int64_t>(expert.size());
    DeviceBuffer<float> dx(x), act(std::vector<float>(static_cast<size_t>(P * I), -1.0f));
    DeviceBuffer<int32_t> d_expert(expert), d_start(start), d_token(token_of);
    cuda::GroupedOptions opt;
    opt.gather = d_token.get();
    opt.swiglu = true;
    cuda::linear_grouped(dx.get(), P, T, w.experts_gate_up, E, groups, d_expert.get(),
                         d_start.get(), act.get(), opt);
    const auto got = act.download();
    for (int64_t g = 0; g < groups; ++g)
      for (int32_t r = start[g]; r < start[g + 1]; ++r) {
        const int32_t t = token_of[r];
        const std::vector<float> xt(x.begin() + t * H, x.begin() + (t + 1) * H);
        const auto n = static_cast<size_t>(I);
        DeviceBuffer<float> one(xt), gate(n), up(n), want(n);
        cuda::linear(one.get(), 1, w.gate[expert[g]], gate.get());
        cuda::linear(one.get(), 1, w.up[expert[g]], up.get());
        cuda::swiglu(gate.get(), up.get(), I, want.get());
        const auto ref = want.download();
        EXPECT_EQ(0, std::memcmp(ref.data(), got.data() + r * I, sizeof(float) * I))
            << "pair row " << r << " (token " << t << ", expert " << expert[g] << ")";
      }
  }
}

// The op against the CPU op on the same values, with and without a shared expert, at decode,
// window and batch sizes (the staged-row and bf16-copy paths of the grouped products, 1, 2 and 4
// m-tiles; the grouping by one warp up to 32 pairs and by a block beyond): within bf16
// tolerance, the same experts chosen; and each token's row bitwise the one it gets alone. A
// shared expert of the routed experts' shape, stacked as a model stacks it, runs as one more
// group of the grouped products.
TEST_F(CudaMoe, OpMatchesTheCpuOpAndEachTokenIsBitwiseItsOwn) {
  ScopedBackend cuda(ops::Backend::Cuda);
  std::mt19937 rng(5);
  for (const int64_t Is : {48, 32, 0}) {
    SCOPED_TRACE("shared expert " + std::to_string(Is));
    TestMixture mix(8, 3, 64, 32, Is, rng);
    WeightArena arena;
    const ops::MoeWeights on_gpu = Is == 32 ? mix.stacked(arena) : mix.weights(true);
    const ops::MoeWeights on_cpu = mix.weights(false);
    ASSERT_EQ(on_gpu.shared_in_groups, Is == 32);
    for (const int64_t T : {1, 3, 6, 20, 40}) {
      const auto x = bf16_rows(T * mix.H, rng);
      const auto y0 = bf16_rows(T * mix.H, rng);
      std::vector<int32_t> ids;
      const auto got = cuda_moe(on_gpu, x, y0, T, &ids);
      std::vector<float> want = y0;
      std::vector<int32_t> want_ids;
      cpu::moe_mlp_add(x.data(), T, on_cpu, want.data(), &want_ids, nullptr);
      EXPECT_EQ(ids, want_ids) << "T " << T;
      double scale = 0, worst = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        scale = std::max(scale, std::fabs(double(want[i] - y0[i])));
        worst = std::max(worst, std::fabs(double(got[i] - want[i])));
      }
      EXPECT_LT(worst, 2e-2 * scale) << "T " << T << ": moe output scale " << scale;
      for (int64_t t = 0; t < T; ++t) {
        const std::vector<float> xt(x.begin() + t * mix.H, x.begin() + (t + 1) * mix.H);
        const std::vector<float> yt(y0.begin() + t * mix.H, y0.begin() + (t + 1) * mix.H);
        const auto alone = cuda_moe(on_gpu, xt, yt, 1);
        EXPECT_EQ(0, std::memcmp(alone.data(), got.data() + t * mix.H, sizeof(float) * mix.H))
            << "token " << t << " of " << T << " differs from the token alone";
      }
    }
  }
}

// One token's routing and gate/up products run as one kernel whose producer warp streams the
// chosen experts' rows (moe_token_gate_up_kernel), and its down products and combination as one
// whose blocks own output columns of every chosen expert (moe_token_down_kernel), at a model's
// shapes: each token alone is bitwise the same token among others (the routing kernel, the
// grouped products and the combining kernel), its routing the same experts and weights, with the
// shared expert as a group, as its own products, or absent; gate/up rings of 4 stages (H =
// 2,048) and 2 (H = 4,096); more shared-expert items than blocks (I = 1,024); 257..512 experts
// (16 a routing lane); down blocks of 16 columns (I = 512), of 8 (I = 1,024: 16 would not fit
// shared memory) and the grouped down fallback (I = 2,048, whose groups the gate/up kernel
// writes); against the CPU op within bf16 tolerance.
TEST_F(CudaMoe, OneTokenKernelsAreBitwiseTheGroupedPath) {
  ScopedBackend cuda(ops::Backend::Cuda);
  std::mt19937 rng(31);
  struct Shape {
    int64_t E, k, H, I, Is;
  };
  for (const Shape sh :
       {Shape{16, 8, 2048, 512, 512}, Shape{16, 8, 2048, 512, 0}, Shape{16, 8, 2048, 512, 256},
        Shape{12, 8, 1024, 1024, 1024}, Shape{8, 8, 512, 2048, 2048}, Shape{40, 32, 256, 64, 64},
        Shape{24, 10, 4096, 256, 256}, Shape{300, 8, 256, 64, 64}}) {
    SCOPED_TRACE("E " + std::to_string(sh.E) + " k " + std::to_string(sh.k) + " H " +
                 std::to_string(sh.H) + " I " + std::to_string(sh.I) + " shared " +
                 std::to_string(sh.Is));
    TestMixture mix(sh.E, sh.k, sh.H, sh.I, sh.Is, rng);
    WeightArena arena;
    const ops::MoeWeights on_gpu = mix.stacked(arena);
    const ops::MoeWeights on_cpu = mix.weights(false);
    ASSERT_EQ(on_gpu.shared_in_groups, sh.Is == sh.I && sh.Is > 0);
    const int64_t T = 3;
    const auto x = bf16_rows(T * mix.H, rng);
    const auto y0 = bf16_rows(T * mix.H, rng);
    std::vector<int32_t> ids;
    const auto together = cuda_moe_checked(on_gpu, on_cpu, x, y0, T, &ids);
    std::vector<int32_t> ids_again;
    std::vector<float> wts;
    cuda_moe(on_gpu, x, y0, T, &ids_again, &wts);
    ASSERT_EQ(ids_again, ids);
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<float> xt(x.begin() + t * mix.H, x.begin() + (t + 1) * mix.H);
      const std::vector<float> yt(y0.begin() + t * mix.H, y0.begin() + (t + 1) * mix.H);
      std::vector<int32_t> alone_ids;
      const auto alone = cuda_moe_checked(on_gpu, on_cpu, xt, yt, 1, &alone_ids);
      EXPECT_TRUE(std::equal(alone_ids.begin(), alone_ids.end(), ids.begin() + t * mix.k));
      std::vector<int32_t> ids_alone_again;
      std::vector<float> alone_wts;
      cuda_moe(on_gpu, xt, yt, 1, &ids_alone_again, &alone_wts);
      EXPECT_EQ(0, std::memcmp(alone_wts.data(), wts.data() + t * mix.k, sizeof(float) * mix.k))
          << "token " << t << "'s routing weights alone differ from the token's among " << T;
      EXPECT_EQ(0, std::memcmp(alone.data(), together.data() + t * mix.H, sizeof(float) * mix.H))
          << "token " << t << " alone differs from the token among " << T;
    }
  }
}

// GLM-5's mixtures on CUDA: noaux_tc routing (sigmoid scores, a correction bias, groups) and a
// shared expert without a gate, against the CPU op: the same experts in the same order, weights
// within fp32 rounding, outputs within bf16 tolerance, a token's row bitwise its own alone.
// Grid-valued router rows and inputs make the router logits exact on both sides.
TEST_F(CudaMoe, NoauxTcRoutingAndAnUngatedSharedExpertMatchTheCpu) {
  ScopedBackend cuda(ops::Backend::Cuda);
  std::mt19937 rng(23);
  TestMixture mix(16, 4, 64, 32, 48, rng);
  set_grid_values(mix.router, 1.0f, rng);
  std::vector<float> bias(16);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (float& b : bias) b = nd(rng);
  const DeviceBuffer<float> dbias(bias);
  auto glm = [&](ops::MoeWeights m, const float* b) {
    m.routing = ops::MoeRouting::NoauxTc;
    m.n_group = 4;
    m.topk_group = 2;
    m.routed_scale = 2.5f;
    m.score_bias = TestMixture::ref(b, DType::F32, 1, 16);
    m.shared_gate = {};
    return m;
  };
  const ops::MoeWeights on_gpu = glm(mix.weights(true), dbias.get());
  const ops::MoeWeights on_cpu = glm(mix.weights(false), bias.data());
  for (const int64_t T : {1, 5, 33}) {
    Bf16Values xv(static_cast<size_t>(T * mix.H), 1.0f, rng);
    set_grid_values(xv, 1.0f, rng);
    const std::vector<float>& x = xv.values;
    const auto y0 = bf16_rows(T * mix.H, rng);
    std::vector<int32_t> ids, want_ids;
    std::vector<float> wts, want_wts;
    const auto got = cuda_moe(on_gpu, x, y0, T, &ids, &wts);
    std::vector<float> want = y0;
    cpu::moe_mlp_add(x.data(), T, on_cpu, want.data(), &want_ids, &want_wts);
    ASSERT_EQ(ids, want_ids) << "T " << T;
    for (size_t i = 0; i < wts.size(); ++i)
      EXPECT_NEAR(wts[i], want_wts[i], 1e-6 * std::fabs(want_wts[i]) + 1e-7) << i;
    EXPECT_LT(relative_error(got, want, y0), 2e-2) << "T " << T;
    for (int64_t t = 0; t < T; t += 4) {
      const std::vector<float> xt(x.begin() + t * mix.H, x.begin() + (t + 1) * mix.H);
      const std::vector<float> yt(y0.begin() + t * mix.H, y0.begin() + (t + 1) * mix.H);
      const auto alone = cuda_moe(on_gpu, xt, yt, 1);
      EXPECT_EQ(0, std::memcmp(alone.data(), got.data() + t * mix.H, sizeof(float) * mix.H))
          << "token " << t << " of " << T;
    }
  }
}

// Routing many tokens over 256 experts, top 8, against the CPU op: every token's experts equal,
// in the same order, with exact ties between probabilities (grid-valued router rows and inputs
// give the same logits on both; experts 2j and 2j + 1 share a router row for j < 16; every
// seventh token is zero, so all 256 experts tie and 0..7 win), weights and outputs within
// tolerance. Both router layouts: alone, and with the shared gate as its last row (E + 1 logits
// per token). Up to 2400 pairs are grouped in up to 32 runs (a wrong grouping would show in the
// outputs), and a token's row is bitwise its own alone.
TEST_F(CudaMoe, RoutingOfManyTokensMatchesTheCpuIncludingTies) {
  ScopedBackend cuda(ops::Backend::Cuda);
  std::mt19937 rng(11);
  TestMixture mix(256, 8, 64, 16, 16, rng);
  const int64_t H = mix.H, k = mix.k;
  set_grid_values(mix.router, 1.0f, rng);
  for (int64_t e = 0; e < 32; e += 2)
    for (int64_t c = 0; c < H; ++c) {
      const auto from = static_cast<size_t>(e * H + c), to = static_cast<size_t>((e + 1) * H + c);
      mix.router.bits[to] = mix.router.bits[from];
      mix.router.values[to] = mix.router.values[from];
    }
  WeightArena arena;
  const ops::MoeWeights separate = mix.weights(true), stacked = mix.stacked(arena);
  const ops::MoeWeights on_cpu = mix.weights(false);
  ASSERT_EQ(stacked.router_shared_gate.rows, mix.E + 1);
  for (const int64_t T : {1, 5, 64, 300}) {
    Bf16Values xv(static_cast<size_t>(T * H), 1.0f, rng);
    set_grid_values(xv, 2.0f, rng);
    std::vector<float> x = xv.values;
    for (int64_t t = 3; t < T; t += 7) std::fill_n(x.begin() + t * H, H, 0.0f);
    const auto y0 = bf16_rows(T * H, rng);
    std::vector<float> want = y0, want_w;
    std::vector<int32_t> want_ids;
    cpu::moe_mlp_add(x.data(), T, on_cpu, want.data(), &want_ids, &want_w);
    for (int64_t t = 3; t < T; t += 7)
      for (int64_t j = 0; j < k; ++j)
        ASSERT_EQ(want_ids[static_cast<size_t>(t * k + j)], j) << "the CPU's rule on a full tie";
    for (const ops::MoeWeights* w : {&separate, &stacked}) {
      SCOPED_TRACE(std::string(w == &stacked ? "stacked" : "separate") + " router, T " +
                   std::to_string(T));
      std::vector<int32_t> ids;
      std::vector<float> wts;
      const auto got = cuda_moe(*w, x, y0, T, &ids, &wts);
      EXPECT_EQ(ids, want_ids);
      ASSERT_EQ(wts.size(), want_w.size());
      for (size_t i = 0; i < wts.size(); ++i) EXPECT_NEAR(wts[i], want_w[i], 1e-5f) << "pair " << i;
      EXPECT_LT(relative_error(got, want, y0), 2e-2);
      for (const int64_t t : {int64_t{0}, T / 2, T - 1}) {
        const std::vector<float> xt(x.begin() + t * H, x.begin() + (t + 1) * H);
        const std::vector<float> yt(y0.begin() + t * H, y0.begin() + (t + 1) * H);
        const auto alone = cuda_moe(*w, xt, yt, 1);
        EXPECT_EQ(0, std::memcmp(alone.data(), got.data() + t * H, sizeof(float) * H))
            << "token " << t << " differs from the token alone";
      }
    }
  }
}

// The shared expert as stack_moe_experts lays it out, the gate logit as the router's last row,
// against the CPU op within tolerance, and bitwise the separate products' result on the GPU:
// an inner size other than the experts' (48) gives gate and up as one pair-layout product with
// the SwiGLU in its epilogue; the experts' own (32) makes it one more group of their grouped
// products. A second stacking changes nothing.
TEST_F(CudaMoe, StackedSharedExpertMatchesTheCpuAndTheSeparateProducts) {
  for (const int64_t Is : {48, 32}) {
    SCOPED_TRACE("shared expert " + std::to_string(Is));
    ScopedBackend cuda(ops::Backend::Cuda);
    std::mt19937 rng(9);
    TestMixture mix(8, 3, 64, 32, Is, rng);
    WeightArena arena;
    ops::MoeWeights stacked = mix.stacked(arena);
    const ops::MoeWeights separate = mix.weights(true), on_cpu = mix.weights(false);
    ASSERT_EQ(stacked.shared_gate_up.rows, 2 * mix.Is);
    ASSERT_EQ(stacked.router_shared_gate.rows, mix.E + 1);
    ASSERT_EQ(stacked.shared_in_groups, Is == mix.I);
    if (stacked.shared_in_groups)
      EXPECT_EQ(stacked.shared_gate_proj.data, stacked.shared_gate_up.data)
          << "the gate is the stacked weight's first rows";
    else
      EXPECT_EQ(stacked.shared_gate_proj.data, nullptr) << "gate and up live on only interleaved";
    const void* gate_row = static_cast<const char*>(stacked.router_shared_gate.data) +
                           mix.E * mix.H * sizeof(uint16_t);
    EXPECT_EQ(stacked.shared_gate.data, gate_row) << "the gate is the router's last row";
    for (const int64_t T : {1, 3, 6, 20, 40}) {
      SCOPED_TRACE("T " + std::to_string(T));
      const auto x = bf16_rows(T * mix.H, rng);
      const auto y0 = bf16_rows(T * mix.H, rng);
      const auto got = cuda_moe_checked(stacked, on_cpu, x, y0, T);
      const auto apart = cuda_moe(separate, x, y0, T);
      EXPECT_EQ(0, std::memcmp(got.data(), apart.data(), sizeof(float) * got.size()))
          << "the stacked products differ from the separate ones";
    }
    const ops::MoeWeights before = stacked;
    stack_moe_experts(arena, &stacked);
    EXPECT_EQ(stacked.shared_gate_up.data, before.shared_gate_up.data);
    EXPECT_EQ(stacked.router_shared_gate.data, before.router_shared_gate.data);
    EXPECT_EQ(stacked.experts_gate_up.data, before.experts_gate_up.data);
  }
}

// The post-attention norm inside the op (ops::MoeInputNorm, the residual stream updated in
// place): the router folds it for one token of a hidden size it normalises in registers (2,048
// and 4,096: moe_token_router_kernel, whose blocks own 8 of the 9 stacked router rows, then 1),
// else a norm kernel runs first; either way the normalised rows, the routing and the output are
// bitwise the norm kernel followed by the op.
TEST_F(CudaMoe, InputNormInsideTheMixtureIsBitwiseTheNormFirst) {
  ScopedBackend cuda(ops::Backend::Cuda);
  for (const int64_t H : {64, 2048, 4096}) {
    SCOPED_TRACE("hidden size " + std::to_string(H));
    std::mt19937 rng(21);
    TestMixture mix(8, 3, H, 32, 32, rng);
    WeightArena arena;
    const ops::MoeWeights stacked = mix.stacked(arena);
    ASSERT_TRUE(stacked.shared_in_groups);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> norm_w(static_cast<size_t>(H));
    for (float& v : norm_w) v = 0.1f * d(rng);
    DeviceBuffer<float> weight(norm_w);
    const ops::RowNorm row_norm{TestMixture::ref(weight.get(), DType::F32, 1, H), true, 1e-6f};
    for (const int64_t T : {1, 2, 5}) {
      SCOPED_TRACE("T " + std::to_string(T));
      std::vector<float> x(static_cast<size_t>(T * H));
      for (float& v : x) v = 3.0f * d(rng);
      DeviceBuffer<float> stream(x), normed(x.size()), want_stream(x), want_normed(x.size());
      std::vector<int32_t> ids, want_ids;
      ops::rms_norm(want_stream.get(), T, H, row_norm.w, true, row_norm.eps, want_normed.get());
      ops::moe_mlp_add(want_normed.get(), T, stacked, want_stream.get(), &want_ids);
      const ops::MoeInputNorm norm{row_norm, normed.get()};
      ops::moe_mlp_add(stream.get(), T, stacked, stream.get(), &ids, nullptr, &norm);
      EXPECT_EQ(ids, want_ids);
      const auto got_n = normed.download(), want_n = want_normed.download();
      EXPECT_EQ(0, std::memcmp(got_n.data(), want_n.data(), sizeof(float) * got_n.size()))
          << "the normalised rows differ from rms_norm's";
      const auto got = stream.download(), want = want_stream.download();
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), sizeof(float) * got.size()))
          << "the mixture's output differs from the norm-first op's";
    }
  }
}

// A model config for the model tests: experts whose inner size is a multiple of 16 (the
// tensor-core products), a shared expert and a native MTP layer.
const char* kModelConfig = R"({
  "model_type": "qwen3_5_moe",
  "tie_word_embeddings": false,
  "text_config": {
    "model_type": "qwen3_5_moe_text", "vocab_size": 97, "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48, "mtp_num_hidden_layers": 1,
    "hidden_act": "silu", "max_position_embeddings": 4096, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5}
  }
})";

std::vector<int32_t> sequence(int n, int seed) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = (seed * 31 + i * 17) % 97;
  return v;
}

class CudaMoeModel : public CudaMoe {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("cuda-moe");
    write_text(dir_->file("source_config.json"), kModelConfig);
    write_random_qwen35(dir_->file("source_config.json"), dir_->file("fused"), DType::BF16, 13);
    write_random_qwen35(dir_->file("source_config.json"), dir_->file("split"), DType::BF16, 13,
                        true);
  }
  static void TearDownTestSuite() { delete dir_; }
  static ScratchDir* dir_;
};
ScratchDir* CudaMoeModel::dir_ = nullptr;

// Decoding a row token by token, the same tokens as one verify window, and the same steps next to
// two other rows (one taking several tokens): every token's logits bitwise equal, with the experts
// read in place from the fused tensors and stacked from per-expert ones. (The two random
// checkpoints hold different values; the stacked layout's numbers are checked against
// transformers by the per-expert bf16 fixture below.)
TEST_F(CudaMoeModel, TokenLogitsAreBitwiseIndependentOfWindowAndBatch) {
  ScopedBackend cuda(ops::Backend::Cuda);
  for (const char* layout : {"fused", "split"}) {
    SCOPED_TRACE(layout);
    const auto m = Qwen35Model::load(dir_->file(layout));
    const int64_t V = m->config().vocab_size;
    const auto prompt = sequence(11, 2), x = sequence(4, 7);
    auto prefill = [&](Qwen35State& st, int slot, const std::vector<int32_t>& p) {
      const RowInput row{slot, static_cast<int64_t>(p.size())};
      ForwardRequest req{p, {&row, 1}, false, false};
      req.prompt = true;
      ForwardOutput out;
      m->forward(st, req, &out);
    };
    std::vector<float> steps;
    {
      Qwen35State st(m->config());
      const int slot = st.open_row();
      prefill(st, slot, prompt);
      for (int j = 0; j < 4; ++j) {
        const RowInput row{slot, 1};
        ForwardOutput out;
        m->forward(st, {std::span(x).subspan(j, 1), {&row, 1}, true, false}, &out);
        steps.insert(steps.end(), out.logits.begin(), out.logits.end());
      }
    }
    {
      Qwen35State st(m->config());
      const int slot = st.open_row();
      prefill(st, slot, prompt);
      const RowInput w{slot, 4, true};
      ForwardOutput out;
      m->forward(st, {x, {&w, 1}, true, false}, &out);
      EXPECT_EQ(0, std::memcmp(out.logits.data(), steps.data(), sizeof(float) * 4 * V))
          << "a verify window differs from decoding one token at a time";
    }
    {
      Qwen35State st(m->config());
      const int a = st.open_row(), s = st.open_row(), b = st.open_row();
      prefill(st, a, sequence(5, 3));
      prefill(st, s, prompt);
      prefill(st, b, sequence(9, 4));
      for (int j = 0; j < 4; ++j) {
        const std::vector<int32_t> toks = {5, x[static_cast<size_t>(j)], 11, 12, 13};
        const std::vector<RowInput> rows = {{a, 1}, {s, 1}, {b, 3}};
        ForwardOutput out;
        m->forward(st, {toks, rows, true, false}, &out);
        EXPECT_EQ(0, std::memcmp(out.logits.data() + V, steps.data() + j * V, sizeof(float) * V))
            << "step " << j << ": batched decode differs from decoding alone";
      }
    }
  }
}

// Speculation on a MoE target on the GPU: n-gram drafting, the checkpoint's own MoE MTP layer and
// a random one give plain decoding's tokens, batched, greedy and sampled.
TEST_F(CudaMoeModel, SpeculationIsLosslessWithBothDrafters) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const auto model = Qwen35Model::load(dir_->file("fused"));
  const spec::QwenTargetView target(*model, "moe-target");
  const auto own = spec::QwenMtpProvider::from_target(target, spec::HiddenTap::FinalNormed);
  const auto drawn = spec::QwenMtpProvider::random(target, 4);
  spec::NgramProvider ngram(spec::NgramOptions{});
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    GenerateRequest r;
    for (int rep = 0; rep < 3; ++rep)
      for (int32_t id : sequence(6 + i, i)) r.prompt.push_back(id);
    r.max_tokens = 20;
    r.ignore_eos = true;
    r.sampling.temperature = i % 2 ? 0.7f : 0.0f;
    r.sampling.seed = 3 + static_cast<uint64_t>(i);
    reqs.push_back(r);
  }
  Generator plain(*model);
  std::vector<std::vector<int32_t>> want;
  for (const auto& r : reqs) want.push_back(plain.run({r}).at(0).tokens);
  for (const spec::DraftProvider* drafter :
       std::vector<const spec::DraftProvider*>{&ngram, own.get(), drawn.get()}) {
    SpecOptions o{3, spec::VerifyMode::Match};
    o.health_probe = false;  // random layers accept little; this checks losslessness
    SpeculativeGenerator gen(*model, drafter, "moe-target", o);
    std::vector<SpecStats> stats;
    const auto got = gen.run(reqs, {}, nullptr, &stats);
    int64_t drafted = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i]) << "request " << i;
      drafted += stats[i].drafted;
    }
    EXPECT_GT(drafted, 0);
  }
}

// The bf16 fixture (tools/make_qwen35_moe_fixtures.py) on the GPU: logits within 3e-2 of the
// logit scale of transformers' fp32 ones (the dense models' bound is 2e-2; a mixture rounds the
// inputs of three more products per layer to bf16 — router, experts, shared expert — and this
// tiny random model reached 2.0e-2 on the H200), routing equal wherever the k-th and (k+1)-th
// probabilities are 1e-2 apart, and greedy tokens equal while transformers' top-2 gap exceeds
// 4e-2 of the scale.
TEST_F(CudaMoe, Bf16FixtureMatchesTransformers) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const std::string dir = std::string(TANDEM_FIXTURES_DIR) + "/qwen35_moe_per_expert";
  const auto model = Qwen35Model::load(dir);
  const auto ref = SafetensorsFile::open(dir + "/reference.safetensors");
  auto tensor = [&](const std::string& name) -> const TensorView& {
    const TensorView* t = ref->find(name);
    if (!t) fail("reference tensor ", name, " missing");
    return *t;
  };
  auto ints = [&](const std::string& name) {
    const TensorView& t = tensor(name);
    std::vector<int32_t> v;
    for (int64_t i = 0; i < t.numel(); ++i)
      v.push_back(t.dtype == DType::I64
                      ? static_cast<int32_t>(static_cast<const int64_t*>(t.data)[i])
                      : static_cast<const int32_t*>(t.data)[i]);
    return v;
  };
  auto floats = [&](const std::string& name) { return to_f32(tensor(name)); };
  const Qwen35Config& c = model->config();
  const int64_t K = c.num_experts_per_tok;
  int64_t routed = 0, greedy = 0;
  for (int i = 0; i < 2; ++i) {
    const std::string n = std::to_string(i);
    const auto tokens = ints("tokens_" + n), routing = ints("routing_" + n);
    const auto want = floats("logits_" + n), margin = floats("routing_margin_" + n);
    const auto T = static_cast<int64_t>(tokens.size());
    Qwen35State st(c, RecurrentRollback::PerPositionStates, DType::F32);
    const RowInput row{st.open_row(), T};
    ForwardRequest req{tokens, {&row, 1}, true, false};
    req.want_routing = true;
    ForwardOutput out;
    model->forward(st, req, &out);
    ASSERT_EQ(out.logits.size(), want.size());
    double scale = 0, worst = 0;
    for (float v : want) scale = std::max(scale, std::fabs(double(v)));
    for (size_t j = 0; j < want.size(); ++j)
      worst = std::max(worst, std::fabs(double(out.logits[j] - want[j])));
    EXPECT_LT(worst, 3e-2 * scale) << "prompt " << i;
    RecordProperty("max_rel_logit_error_" + n, std::to_string(worst / scale));
    ASSERT_EQ(out.routing.size(), routing.size());
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      for (int64_t t = 0; t < T; ++t) {
        if (margin[static_cast<size_t>(l * T + t)] <= 1e-2) continue;
        auto at = [&](const std::vector<int32_t>& v) {
          std::vector<int32_t> s(v.begin() + (l * T + t) * K, v.begin() + (l * T + t + 1) * K);
          std::sort(s.begin(), s.end());
          return s;
        };
        EXPECT_EQ(at(out.routing), at(routing))
            << "prompt " << i << " layer " << l << " token " << t;
        ++routed;
      }
    GenerateRequest r;
    r.prompt = ints("prompt_" + n);
    r.max_tokens = 8;
    r.ignore_eos = true;
    const auto got = Generator(*model).run({r}).at(0).tokens;
    const auto want_greedy = ints("greedy_" + n);
    const auto gaps = floats("greedy_gap_" + n);
    for (size_t j = 0; j < want_greedy.size(); ++j) {
      if (gaps[j] <= 4e-2 * scale) break;
      EXPECT_EQ(got[j], want_greedy[j]) << "prompt " << i << " step " << j;
      ++greedy;
    }
  }
  EXPECT_GT(routed, 0);
  EXPECT_GT(greedy, 0);
}

}  // namespace
}  // namespace tandem
