// fp8 e4m3 products on CUDA beyond single-row streaming (test_cuda_ops.cpp's CudaLinearFp8):
//  - prompt prefill on the FP8 tensor cores (cuBLASLt, 128 x 128 weight scales, the input rows
//    quantised per row and 128 columns): equal, up to fp32 summation order, to the product of the
//    quantised rows with the dequantised weight computed here; a prompt row's bits do not depend
//    on how many rows share the call; linear_add adds it; GLM-5's shapes take that route;
//  - prefill of other block shapes: the weight dequantised to bf16 for the bf16 prefill product;
//  - a mixture's fp8 experts (linear_grouped): decode rows bitwise linear_fp8 of their expert
//    alone (then swiglu), whatever the group sizes; prefill bitwise the bf16 grouped product of
//    the dequantised stack.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/ops.h"
#include "tandem/core/dtype.h"

namespace tandem {
namespace {

using tandem::testing::bitwise_equal;
using tandem::testing::CudaTest;
using tandem::testing::DeviceBuffer;
using tandem::testing::nan_buffer;
using tandem::testing::near_blocks;
using tandem::testing::randn;
using tandem::testing::slice;
using tandem::testing::uniform;

inline size_t sz(int64_t v) {
  return static_cast<size_t>(v);
}

// An fp8 weight [rows, cols] with f32 block scales, on the host and on the device.
struct Fp8Weight {
  int64_t rows, cols, br, bc;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  DeviceBuffer<uint8_t> dcodes;
  DeviceBuffer<float> dscales;

  Fp8Weight(int64_t r, int64_t c, int64_t block_rows, int64_t block_cols, std::mt19937& rng)
      : rows(r), cols(c), br(block_rows), bc(block_cols) {
    std::uniform_int_distribution<int> byte(0, 255);
    codes.resize(sz(rows * cols));
    for (uint8_t& b : codes) {
      do b = static_cast<uint8_t>(byte(rng));
      while ((b & 0x7f) == 0x7f || (b & 0x78) == 0x78);  // no NaN, no magnitudes past 256
    }
    scales = uniform(sz(((rows + br - 1) / br) * ((cols + bc - 1) / bc)), rng, 0.0005f, 0.004f);
    dcodes = DeviceBuffer<uint8_t>(codes);
    dscales = DeviceBuffer<float>(scales);
  }
  float value(int64_t r, int64_t c) const {
    const int64_t scale_cols = (cols + bc - 1) / bc;
    return fp8_e4m3_to_f32(codes[sz(r * cols + c)]) * scales[sz((r / br) * scale_cols + c / bc)];
  }
  ops::WeightRef dev() const {
    ops::WeightRef w;
    w.dtype = DType::F8_E4M3;
    w.data = dcodes.get();
    w.rows = rows;
    w.cols = cols;
    w.scales = {dscales.get(), DType::F32, br, bc};
    return w;
  }
};

// Rows quantised as the prefill kernel does: per row and 128 columns, scale = max |x| / 448
// (1 for an all-zero block), each value the nearest e4m3 code of x / scale.
std::vector<float> quantised_rows(const std::vector<float>& x, int64_t m, int64_t K) {
  std::vector<float> q(x.size());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c0 = 0; c0 < K; c0 += 128) {
      const int64_t c1 = std::min(K, c0 + 128);
      float amax = 0;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[sz(r * K + c)]));
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      for (int64_t c = c0; c < c1; ++c)
        q[sz(r * K + c)] = fp8_e4m3_to_f32(f32_to_fp8_e4m3(x[sz(r * K + c)] / s)) * s;
    }
  return q;
}

// y[m, N] = x · Wᵀ in double, W as `value` gives it.
template <class Value>
std::vector<float> product(const std::vector<float>& x, int64_t m, int64_t N, int64_t K,
                           Value value) {
  std::vector<float> y(sz(m * N));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t r = 0; r < m; ++r) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<double>(x[sz(r * K + k)]) * value(n, k);
      y[sz(r * N + n)] = static_cast<float>(s);
    }
  return y;
}

struct PrefillOn {
  explicit PrefillOn(int64_t tile) { cuda::set_prefill(true, tile); }
  ~PrefillOn() { cuda::set_prefill(false); }
};

using CudaFp8Prefill = CudaTest;

// GLM-5's projection shapes at reduced width where they have one: kv_a (576 rows: 4.5 row
// blocks), q_b, and the rows a dense MLP's down projection reads; 37 rows (padded to 40 inside)
// and 64 (straight into y).
TEST_F(CudaFp8Prefill, TensorCoresMatchTheQuantisedRowsAndRowsDoNotDependOnTheirCount) {
  std::mt19937 rng(2031);
  struct Shape {
    int64_t n, k;
  };
  for (const Shape s : {Shape{576, 512}, Shape{512, 1536}, Shape{256, 2048}}) {
    const Fp8Weight w(s.n, s.k, 128, 128, rng);
    PrefillOn prefill(64);
    const std::string route = cuda::fp8_prefill_route(w.dev());
    RecordProperty("route_" + std::to_string(s.n) + "x" + std::to_string(s.k), route);
    ASSERT_EQ(route.rfind("fp8 tensor cores", 0), 0u)
        << "[" << s.n << " x " << s.k << "]: " << route;
    // bf16 outputs (where cuBLASLt offers no fp32 ones) round each output to 8 bits.
    const double tol = route.find("bf16 outputs") != std::string::npos ? 6e-3 : 2e-3;
    for (const int64_t m : {int64_t{37}, int64_t{64}}) {
      const auto x = randn(sz(m * s.k), rng);
      const auto want = product(quantised_rows(x, m, s.k), m, s.n, s.k,
                                [&](int64_t n, int64_t k) { return w.value(n, k); });
      const DeviceBuffer<float> dx(x);
      DeviceBuffer<float> dy = nan_buffer(sz(m * s.n));
      cuda::linear(dx.get(), m, w.dev(), dy.get());
      const auto got = dy.download();
      EXPECT_TRUE(near_blocks(got, want, sz(s.n), tol))
          << "[" << s.n << " x " << s.k << "], " << m << " rows";
      // The first 8 rows alone, and row 5 alone: the same bits.
      for (const int64_t part : {int64_t{8}, int64_t{1}}) {
        const int64_t r0 = part == 1 ? 5 : 0;
        DeviceBuffer<float> some = nan_buffer(sz(part * s.n));
        cuda::linear(dx.get() + r0 * s.k, part, w.dev(), some.get());
        EXPECT_TRUE(bitwise_equal(some.download(), slice(got, sz(r0 * s.n), sz(part * s.n))))
            << "[" << s.n << " x " << s.k << "], rows " << r0 << ".." << r0 + part << " of " << m;
      }
      const auto y0 = randn(sz(m * s.n), rng);
      DeviceBuffer<float> dsum(y0);
      cuda::linear_add(dx.get(), m, w.dev(), dsum.get());
      std::vector<float> want_sum = y0;
      for (size_t i = 0; i < want_sum.size(); ++i) want_sum[i] += got[i];
      EXPECT_TRUE(near_blocks(dsum.download(), want_sum, sz(s.n), 1e-6, 1e-6))
          << "linear_add, " << m << " rows";
    }
  }
}

// Blocks other than 128 x 128 (the tiny fixtures' 16 x 16): dequantised to bf16, the bf16
// prefill product on bf16 rows.
TEST_F(CudaFp8Prefill, OtherBlockShapesTakeTheBf16Product) {
  std::mt19937 rng(2032);
  const int64_t N = 96, K = 64, m = 21;
  const Fp8Weight w(N, K, 16, 16, rng);
  PrefillOn prefill(64);
  EXPECT_EQ(cuda::fp8_prefill_route(w.dev()).rfind("bf16 (not a block-scaled shape", 0), 0u);
  const auto x = randn(sz(m * K), rng);
  std::vector<float> xb = x;
  for (float& v : xb) v = bf16_to_f32(f32_to_bf16(v));
  const auto want = product(
      xb, m, N, K, [&](int64_t n, int64_t k) { return bf16_to_f32(f32_to_bf16(w.value(n, k))); });
  const DeviceBuffer<float> dx(x);
  DeviceBuffer<float> dy = nan_buffer(sz(m * N));
  cuda::linear(dx.get(), m, w.dev(), dy.get());
  EXPECT_TRUE(near_blocks(dy.download(), want, sz(N), 1e-4));
}

using CudaFp8Grouped = CudaTest;

// Four experts of gate/up [2 x 128, 256] and down [256, 128]; groups of 3, 0, 1 and 4 pair rows
// gathered from 5 tokens, expert ids not in group order.
TEST_F(CudaFp8Grouped, ExpertRowsEqualTheirExpertAloneAndPrefillTheBf16Stack) {
  std::mt19937 rng(2033);
  const int64_t E = 4, I = 128, H = 256, T = 5;
  const Fp8Weight gate_up(E * 2 * I, H, 128, 128, rng);
  const std::vector<int32_t> expert = {2, 0, 3, 1};
  const std::vector<int32_t> start = {0, 3, 3, 4, 8};
  const std::vector<int32_t> gather = {0, 2, 4, 1, 0, 1, 3, 4};
  const int64_t P = 8;
  const auto x = randn(sz(T * H), rng);
  const DeviceBuffer<float> dx(x);
  const DeviceBuffer<int32_t> dexpert(expert), dstart(start), dgather(gather);
  cuda::GroupedOptions opt;
  opt.gather = dgather.get();
  opt.swiglu = true;
  DeviceBuffer<float> act = nan_buffer(sz(P * I));
  cuda::linear_grouped(dx.get(), P, 4, gate_up.dev(), E, 4, dexpert.get(), dstart.get(), act.get(),
                       opt);
  const auto got = act.download();
  // Each pair row: linear_fp8 of its expert's gate rows and up rows for its token alone, then
  // swiglu.
  auto expert_rows = [&](int64_t e, int64_t first, int64_t rows) {
    ops::WeightRef v = gate_up.dev();
    v.data = gate_up.dcodes.get() + (e * 2 * I + first) * H;
    v.scales.data = gate_up.dscales.get() + ((e * 2 * I + first) / 128) * (H / 128);
    v.rows = rows;
    return v;
  };
  for (int g = 0; g < 4; ++g)
    for (int32_t r = start[sz(g)]; r < start[sz(g) + 1]; ++r) {
      DeviceBuffer<float> gate = nan_buffer(sz(I)), up = nan_buffer(sz(I)), out = nan_buffer(sz(I));
      const float* row = dx.get() + gather[sz(r)] * H;
      cuda::linear_fp8(row, 1, expert_rows(expert[sz(g)], 0, I), gate.get());
      cuda::linear_fp8(row, 1, expert_rows(expert[sz(g)], I, I), up.get());
      cuda::swiglu(gate.get(), up.get(), I, out.get());
      EXPECT_TRUE(bitwise_equal(out.download(), slice(got, sz(r * I), sz(I))))
          << "pair row " << r << " (expert " << expert[sz(g)] << ")";
    }
  // Without swiglu and without gather: the down-projection shape, each row its expert's alone.
  const Fp8Weight down(E * H, I, 128, 128, rng);
  DeviceBuffer<float> out = nan_buffer(sz(P * H));
  cuda::linear_grouped(act.get(), P, 4, down.dev(), E, 4, dexpert.get(), dstart.get(), out.get());
  const auto got_down = out.download();
  for (int g = 0; g < 4; ++g)
    for (int32_t r = start[sz(g)]; r < start[sz(g) + 1]; ++r) {
      ops::WeightRef v = down.dev();
      v.data = down.dcodes.get() + expert[sz(g)] * H * I;
      v.scales.data = down.dscales.get() + (expert[sz(g)] * H / 128) * (I / 128);
      v.rows = H;
      DeviceBuffer<float> one = nan_buffer(sz(H));
      cuda::linear_fp8(act.get() + r * I, 1, v, one.get());
      EXPECT_TRUE(bitwise_equal(one.download(), slice(got_down, sz(r * H), sz(H))))
          << "down, pair row " << r;
    }
  // Prefill: the stack dequantised to bf16, then the bf16 grouped product.
  std::vector<uint16_t> stack_bf16(sz(E * 2 * I * H));
  for (int64_t n = 0; n < E * 2 * I; ++n)
    for (int64_t k = 0; k < H; ++k) stack_bf16[sz(n * H + k)] = f32_to_bf16(gate_up.value(n, k));
  const DeviceBuffer<uint16_t> dstack(stack_bf16);
  ops::WeightRef bf16 = gate_up.dev();
  bf16.dtype = DType::BF16;
  bf16.data = dstack.get();
  bf16.scales = {};
  PrefillOn prefill(64);
  DeviceBuffer<float> pre = nan_buffer(sz(P * I)), want = nan_buffer(sz(P * I));
  cuda::linear_grouped(dx.get(), P, 4, gate_up.dev(), E, 4, dexpert.get(), dstart.get(), pre.get(),
                       opt);
  cuda::linear_grouped(dx.get(), P, 4, bf16, E, 4, dexpert.get(), dstart.get(), want.get(), opt);
  EXPECT_TRUE(bitwise_equal(pre.download(), want.download())) << "prefill";
}

}  // namespace
}  // namespace tandem
