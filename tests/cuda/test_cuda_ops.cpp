// CUDA op tests: every op of backend/cuda/cuda_ops.h against the CPU reference (cpu_ops.h) on the
// shapes of the real Qwen3.5 models and on awkward small ones, and batch invariance (DESIGN.md
// principle 2) checked BITWISE: a token's numbers are the same alone, in a verify window, or in a
// batch.
//
// Tolerances. linear: the CUDA path rounds activations and weights to bf16 and accumulates in
// fp32, so the reference is cpu::linear on bf16-rounded inputs with the same bf16 weights; the
// only difference left is fp32 summation order (1e-3 of the row's max |y| is generous for that,
// yet far below a wrong element, a missed row or an unrounded bf16 read). Every other op is fp32
// on both sides: 1e-5 (norms, rope, conv, elementwise) and 1e-4 (attention, delta rule) relative
// to the max |value| of the row or head vector. Pure data movement (embedding rows, KV writes,
// conv states, copy_rows, add) must be bit-exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/ops.h"

namespace tandem {
namespace {

using tandem::testing::bitwise_equal;
using tandem::testing::CudaParamTest;
using tandem::testing::CudaTest;
using tandem::testing::DeviceBuffer;
using tandem::testing::nan_buffer;
using tandem::testing::near_blocks;
using tandem::testing::randn;
using tandem::testing::round_bf16;
using tandem::testing::slice;
using tandem::testing::to_bf16;
using tandem::testing::uniform;

constexpr double kLinearRel = 1e-3;
constexpr double kNormRel = 1e-5;
// The CPU's layer_norm sums the mean and the variance in fp32, the GPU in double: where a row's
// mean is large next to its spread (these tests shift rows by up to 4), the CPU's centred values
// carry up to ~1e-4 of relative error (measured on the H200: 8.9e-5 at d = 1024).
constexpr double kLayerNormRel = 2e-4;
constexpr double kElemRel = 1e-5;
constexpr double kRopeRel = 1e-5;
constexpr double kConvRel = 1e-5;
constexpr double kAttnRel = 1e-4;
// A head's outputs can be 100-1000x smaller than the products they are summed from (q̂ nearly
// orthogonal to the state's columns), so fp32 sums in the GPU's order (eight lanes per column,
// four running sums each) and the CPU's differ by up to ~1e-4 of such a head's largest output.
constexpr double kDeltaRel = 2e-4;

inline size_t sz(int64_t v) {
  return static_cast<size_t>(v);
}

bool contains_nocase(std::string hay, std::string needle) {
  for (auto& c : hay) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (auto& c : needle) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return hay.find(needle) != std::string::npos;
}

// A vector weight (norm scale, A_log, dt_bias, conv taps): F32 on host and on device.
struct F32Weight {
  int64_t rows = 0, cols = 0;
  std::vector<float> host;
  DeviceBuffer<float> dev;
  ops::WeightRef host_ref() const { return {DType::F32, host.data(), rows, cols, {}}; }
  ops::WeightRef dev_ref() const { return {DType::F32, dev.get(), rows, cols, {}}; }
};
F32Weight f32_weight(std::vector<float> values, int64_t rows, int64_t cols) {
  F32Weight w;
  w.rows = rows;
  w.cols = cols;
  w.host = std::move(values);
  w.dev = DeviceBuffer<float>(w.host);
  return w;
}

// A matrix weight [rows, cols]: BF16 on host and on device, values ~ N(0, 1/sqrt(cols)) so that
// y = x·wᵀ has unit scale for unit-scale x.
struct Bf16Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<uint16_t> host;
  DeviceBuffer<uint16_t> dev;
  ops::WeightRef host_ref() const { return {DType::BF16, host.data(), rows, cols, {}}; }
  ops::WeightRef dev_ref() const { return {DType::BF16, dev.get(), rows, cols, {}}; }
};
Bf16Matrix bf16_matrix(int64_t rows, int64_t cols, std::mt19937& rng) {
  Bf16Matrix w;
  w.rows = rows;
  w.cols = cols;
  w.host = to_bf16(randn(sz(rows * cols), rng, 1.0f / std::sqrt(static_cast<float>(cols))));
  w.dev = DeviceBuffer<uint16_t>(w.host);
  return w;
}

// ---------------------------------------------------------------------------------------------
// Device and memory
// ---------------------------------------------------------------------------------------------

using CudaMemory = CudaTest;

TEST_F(CudaMemory, DeviceIsNamedAndStreamSynchronizes) {
  EXPECT_TRUE(cuda::available());
  std::string name;
  ASSERT_NO_THROW(name = cuda::device_name());
  EXPECT_FALSE(name.empty());
  EXPECT_NO_THROW(cuda::synchronize());
}

TEST_F(CudaMemory, AllocCopyRoundTrip) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> byte(0, 255);
  for (size_t bytes : {size_t(1), size_t(4097), size_t(3) << 20}) {
    std::vector<uint8_t> src(bytes);
    for (auto& b : src) b = static_cast<uint8_t>(byte(rng));
    void* a = cuda::alloc(bytes);
    void* b = cuda::alloc(bytes);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    cuda::copy_to_device(a, src.data(), bytes);
    cuda::copy_on_device(b, a, bytes);
    std::vector<uint8_t> back(bytes, 0), back2(bytes, 0);
    cuda::copy_to_host(back.data(), a, bytes);
    cuda::copy_to_host(back2.data(), b, bytes);
    EXPECT_TRUE(bitwise_equal(back, src)) << bytes << " bytes, host→device→host";
    EXPECT_TRUE(bitwise_equal(back2, src)) << bytes << " bytes, via copy_on_device";
    cuda::free(a);
    cuda::free(b);
  }
  EXPECT_NO_THROW(cuda::free(nullptr));
}

TEST_F(CudaMemory, SubRangeCopiesAndFillZeroTouchOnlyTheirBytes) {
  std::mt19937 rng(12);
  std::uniform_int_distribution<int> byte(1, 255);  // never 0, so fill_zero is visible
  const size_t n = 10000;
  std::vector<uint8_t> a(n), b(n);
  for (auto& x : a) x = static_cast<uint8_t>(byte(rng));
  for (auto& x : b) x = static_cast<uint8_t>(byte(rng));
  DeviceBuffer<uint8_t> da(a), db(b);
  // Unaligned device→device copy of 1000 bytes: b[17..1017) = a[5..1005).
  cuda::copy_on_device(db.get() + 17, da.get() + 5, 1000);
  std::copy(a.begin() + 5, a.begin() + 1005, b.begin() + 17);
  // Unaligned host→device copy of 333 bytes at 4000.
  std::vector<uint8_t> patch(333);
  for (auto& x : patch) x = static_cast<uint8_t>(byte(rng));
  cuda::copy_to_device(db.get() + 4000, patch.data(), patch.size());
  std::copy(patch.begin(), patch.end(), b.begin() + 4000);
  // fill_zero of 777 bytes at 6001.
  cuda::fill_zero(db.get() + 6001, 777);
  std::fill(b.begin() + 6001, b.begin() + 6001 + 777, uint8_t(0));
  EXPECT_TRUE(bitwise_equal(db.download(), b));
  // A partial device→host read.
  std::vector<uint8_t> part(100);
  cuda::copy_to_host(part.data(), db.get() + 3999, part.size());
  EXPECT_TRUE(bitwise_equal(part, slice(b, 3999, 100)));
  EXPECT_TRUE(bitwise_equal(da.download(), a)) << "the source buffer changed";
}

TEST_F(CudaMemory, OutOfMemoryThrowsErrorAndDeviceStaysUsable) {
  try {
    void* p = cuda::alloc(size_t(1) << 50);  // 1 PiB
    cuda::free(p);
    ADD_FAILURE() << "alloc(1 PiB) did not throw";
  } catch (const tandem::Error& e) {
    EXPECT_TRUE(contains_nocase(e.what(), "out of memory")) << e.what();
  }
  // The failed cudaMalloc must not poison later work.
  std::vector<float> v = {1.0f, 2.0f, 3.0f};
  DeviceBuffer<float> d(v);
  EXPECT_TRUE(bitwise_equal(d.download(), v));
  EXPECT_NO_THROW(cuda::synchronize());
}

TEST_F(CudaMemory, UploadBf16RoundsToNearestEven) {
  std::mt19937 rng(13);
  std::vector<float> v = randn(100001, rng, 3.0f);
  // Exact ties (round to even), just-off-ties, signed zeros, extremes, infinities.
  const float specials[] = {1.0f + 0x1p-8f,
                            1.0f + 3 * 0x1p-8f,
                            -(1.0f + 0x1p-8f),
                            1.0f + 0x1p-9f,
                            1.0f + 0x1.8p-8f,
                            0.0f,
                            -0.0f,
                            1e-30f,
                            -3.0e38f,
                            3.38e38f,
                            INFINITY,
                            -INFINITY,
                            65504.0f,
                            1.0f / 3.0f,
                            -2.5f};
  for (size_t i = 0; i < std::size(specials); ++i) v[i * 7] = specials[i];
  DeviceBuffer<uint16_t> d(v.size());
  cuda::upload_bf16(d.get(), v.data(), static_cast<int64_t>(v.size()));
  EXPECT_TRUE(bitwise_equal(d.download(), to_bf16(v)));
}

TEST_F(CudaMemory, CopyBandwidthIsPlausible) {
  const double bw = cuda::copy_bandwidth(size_t(256) << 20);
  EXPECT_TRUE(std::isfinite(bw));
  EXPECT_GT(bw, 1e10) << "below 10 GB/s: not a device-to-device copy rate";
  EXPECT_LT(bw, 1e14) << "above 100 TB/s: a units or timing bug";
}

// ---------------------------------------------------------------------------------------------
// Random fills
// ---------------------------------------------------------------------------------------------

using CudaFill = CudaTest;

TEST_F(CudaFill, RandomBf16IsDeterministicSeededAndInRange) {
  const int64_t n = (int64_t(1) << 20) + 7;
  const size_t guard = 64;
  const float scale = 0.02f;
  auto fill = [&](uint64_t seed) {
    DeviceBuffer<uint16_t> d(sz(n) + guard);
    cuda::fill_zero(d.get(), d.bytes());
    cuda::fill_random_bf16(d.get(), n, seed, scale);
    return d.download();
  };
  const auto a = fill(1234), a2 = fill(1234), b = fill(1235);
  for (size_t i = sz(n); i < a.size(); ++i)
    ASSERT_EQ(a[i], 0) << "fill_random_bf16 wrote past n at " << i;
  EXPECT_TRUE(bitwise_equal(a, a2)) << "same seed, different values";
  size_t same = 0;
  for (int64_t i = 0; i < n; ++i) same += a[sz(i)] == b[sz(i)];
  EXPECT_LT(same, sz(n) / 20) << "seeds 1234 and 1235 agree on " << same << " of " << n;

  // Uniform in [-scale, scale] (bf16 rounding may reach the bf16 neighbour of `scale`).
  const double bound = scale * (1.0 + 0x1p-8);
  double sum = 0, lo = 0, hi = 0;
  size_t quarter[4] = {0, 0, 0, 0};
  std::vector<uint16_t> sorted(a.begin(), a.begin() + n);
  for (int64_t i = 0; i < n; ++i) {
    const float f = bf16_to_f32(a[sz(i)]);
    ASSERT_TRUE(std::isfinite(f)) << "element " << i;
    ASSERT_LE(std::fabs(f), bound) << "element " << i;
    sum += f;
    lo = std::min<double>(lo, f);
    hi = std::max<double>(hi, f);
    const int q = std::clamp(static_cast<int>((f / scale + 1.0) * 2.0), 0, 3);
    ++quarter[q];
  }
  std::sort(sorted.begin(), sorted.end());
  const size_t distinct =
      static_cast<size_t>(std::unique(sorted.begin(), sorted.end()) - sorted.begin());
  EXPECT_GT(distinct, 200u) << "values are (nearly) all equal";
  EXPECT_LT(std::fabs(sum / static_cast<double>(n)), 0.01 * scale) << "mean far from 0";
  EXPECT_LT(lo, -0.99 * scale);
  EXPECT_GT(hi, 0.99 * scale);
  for (int q = 0; q < 4; ++q)
    EXPECT_NEAR(static_cast<double>(quarter[q]) / static_cast<double>(n), 0.25, 0.01)
        << "quarter " << q << " of [-scale, scale] is not a quarter of the values";

  // Tiny sizes are deterministic too and still vary with the seed.
  for (int64_t small : {1, 3}) {
    DeviceBuffer<uint16_t> x(sz(small)), y(sz(small));
    cuda::fill_random_bf16(x.get(), small, 77, 1.0f);
    cuda::fill_random_bf16(y.get(), small, 77, 1.0f);
    const auto hx = x.download();
    EXPECT_TRUE(bitwise_equal(hx, y.download())) << "n = " << small;
    for (uint16_t h : hx) EXPECT_LE(std::fabs(bf16_to_f32(h)), 1.0 + 0x1p-8);
  }
}

TEST_F(CudaFill, RandomF32HasOffsetScaleAndSeed) {
  const int64_t n = 300001;
  auto fill = [&](uint64_t seed, float offset, float scale) {
    DeviceBuffer<float> d(sz(n));
    cuda::fill_random_f32(d.get(), n, seed, offset, scale);
    return d.download();
  };
  const auto a = fill(5, 1.0f, 0.5f), a2 = fill(5, 1.0f, 0.5f), b = fill(6, 1.0f, 0.5f);
  EXPECT_TRUE(bitwise_equal(a, a2));
  size_t same = 0;
  double sum = 0, lo = INFINITY, hi = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float f = a[sz(i)];
    same += f == b[sz(i)];
    ASSERT_TRUE(std::isfinite(f));
    ASSERT_GE(f, 0.5f) << "element " << i;
    ASSERT_LE(f, 1.5f) << "element " << i;
    sum += f;
    lo = std::min<double>(lo, f);
    hi = std::max<double>(hi, f);
  }
  EXPECT_LT(same, sz(n) / 100);
  EXPECT_NEAR(sum / static_cast<double>(n), 1.0, 0.01);
  EXPECT_LT(lo, 0.51);
  EXPECT_GT(hi, 1.49);
}

// ---------------------------------------------------------------------------------------------
// linear
// ---------------------------------------------------------------------------------------------

// The CPU result the CUDA linear must reproduce up to summation order: bf16-rounded activations,
// the same bf16 weights, fp32 accumulation.
std::vector<float> cpu_linear_bf16(const std::vector<float>& x, int64_t m, const Bf16Matrix& w) {
  const auto xr = round_bf16(slice(x, 0, sz(m * w.cols)));
  std::vector<float> y(sz(m * w.rows));
  cpu::linear(xr.data(), m, w.host_ref(), y.data());
  return y;
}

// cuda::linear on rows [row0, row0 + m) of the device activations; output starts as NaN.
std::vector<float> cuda_linear(const DeviceBuffer<float>& x, int64_t row0, int64_t m,
                               const Bf16Matrix& w) {
  DeviceBuffer<float> y = nan_buffer(sz(m * w.rows));
  cuda::linear(x.get() + row0 * w.cols, m, w.dev_ref(), y.get());
  return y.download();
}

struct LinearShape {
  int64_t n, k;  // weight [n, k]: n outputs, k inputs
};
void PrintTo(const LinearShape& s, std::ostream* os) {
  *os << "N " << s.n << " K " << s.k;
}
std::string linear_name(const ::testing::TestParamInfo<LinearShape>& p) {
  return "N" + std::to_string(p.param.n) + "_K" + std::to_string(p.param.k);
}

using CudaLinear = CudaParamTest<LinearShape>;

TEST_P(CudaLinear, MatchesCpuOnBf16RoundedInputs) {
  const auto [n, k] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(1000 + 7 * n + k));
  const Bf16Matrix w = bf16_matrix(n, k, rng);
  const int64_t max_m = 120;
  const auto x = randn(sz(max_m * k), rng);
  // cpu::linear is batch invariant (tests/test_ops.cpp), so its row i is the reference for row i
  // of any call.
  const auto want = cpu_linear_bf16(x, max_m, w);
  const DeviceBuffer<float> dx(x);
  for (int64_t m : {1, 2, 3, 5, 16, 17, 40, 100}) {
    const auto got = cuda_linear(dx, 0, m, w);
    EXPECT_TRUE(near_blocks(got, slice(want, 0, sz(m * n)), sz(n), kLinearRel)) << "m = " << m;
  }
  // Rows taken from the middle of the activation buffer (pointer offset).
  const auto got = cuda_linear(dx, 3, 17, w);
  EXPECT_TRUE(near_blocks(got, slice(want, sz(3 * n), sz(17 * n)), sz(n), kLinearRel))
      << "rows 3..19";
}

// Qwen3.5 hidden sizes 384 / 1024 / 4096, a big N (4096x1024), N not a multiple of 8 (20, 17, 3),
// one K that is not a multiple of 8 or 16 (100), and the 9B down projection's K (12288: the
// decode kernel's bf16 rows then need more than the default 48 KiB of shared memory).
INSTANTIATE_TEST_SUITE_P(Shapes, CudaLinear,
                         ::testing::Values(LinearShape{20, 384}, LinearShape{1024, 384},
                                           LinearShape{384, 1024}, LinearShape{1024, 1024},
                                           LinearShape{4096, 1024}, LinearShape{1024, 4096},
                                           LinearShape{1000, 4096}, LinearShape{3, 1024},
                                           LinearShape{17, 100}, LinearShape{64, 12288}),
                         linear_name);

// fp8 e4m3 weights with block scales (GLM-5's published layout): the CUDA kernel decodes each
// weight exactly and scales it as the CPU does, so only the fp32 summation order differs; and a
// row's outputs are the same bits alone or among 16 others.
struct Fp8Shape {
  int64_t n, k, block_rows, block_cols;
  bool bf16_scales;
};
void PrintTo(const Fp8Shape& s, std::ostream* os) {
  *os << "N " << s.n << " K " << s.k << " blocks " << s.block_rows << "x" << s.block_cols
      << (s.bf16_scales ? " bf16" : " f32") << " scales";
}

using CudaLinearFp8 = CudaParamTest<Fp8Shape>;

TEST_P(CudaLinearFp8, MatchesCpuAndIsBatchInvariant) {
  const Fp8Shape p = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(77 + p.n * 3 + p.k));
  std::vector<uint8_t> codes(sz(p.n * p.k));
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint8_t& c : codes) {
    do c = static_cast<uint8_t>(byte(rng));
    while ((c & 0x7f) == 0x7f);  // e4m3's NaN codes
  }
  const int64_t grid =
      ((p.n + p.block_rows - 1) / p.block_rows) * ((p.k + p.block_cols - 1) / p.block_cols);
  std::vector<float> scales = uniform(sz(grid), rng, 0.001f, 0.02f);
  std::vector<uint16_t> scales_bf16 = to_bf16(scales);
  if (p.bf16_scales) scales = round_bf16(scales);
  ops::WeightRef host;
  host.dtype = DType::F8_E4M3;
  host.data = codes.data();
  host.rows = p.n;
  host.cols = p.k;
  host.scales = {p.bf16_scales ? static_cast<const void*>(scales_bf16.data())
                               : static_cast<const void*>(scales.data()),
                 p.bf16_scales ? DType::BF16 : DType::F32, p.block_rows, p.block_cols};
  const int64_t m = 17;
  const auto x = randn(sz(m * p.k), rng);
  std::vector<float> want(sz(m * p.n));
  cpu::linear(x.data(), m, host, want.data());

  const DeviceBuffer<uint8_t> dcodes(codes);
  const DeviceBuffer<float> dscales(scales);
  const DeviceBuffer<uint16_t> dscales_bf16(scales_bf16);
  ops::WeightRef dev = host;
  dev.data = dcodes.get();
  dev.scales.data = p.bf16_scales ? static_cast<const void*>(dscales_bf16.get())
                                  : static_cast<const void*>(dscales.get());
  const DeviceBuffer<float> dx(x);
  DeviceBuffer<float> dy = nan_buffer(sz(m * p.n));
  cuda::linear(dx.get(), m, dev, dy.get());
  const std::vector<float> got = dy.download();
  EXPECT_TRUE(near_blocks(got, want, sz(p.n), kElemRel));
  for (int64_t row : {int64_t{0}, int64_t{9}, m - 1}) {
    DeviceBuffer<float> one = nan_buffer(sz(p.n));
    cuda::linear(dx.get() + row * p.k, 1, dev, one.get());
    EXPECT_TRUE(bitwise_equal(one.download(), slice(got, sz(row * p.n), sz(p.n)))) << "row " << row;
  }
  // linear_add: the product added to y after its reduction (GLM-5's o_proj and down_proj).
  const auto y0 = randn(sz(m * p.n), rng);
  DeviceBuffer<float> dsum(y0);
  cuda::linear_add(dx.get(), m, dev, dsum.get());
  std::vector<float> want_sum = y0;
  for (size_t i = 0; i < want_sum.size(); ++i) want_sum[i] += got[i];
  EXPECT_TRUE(bitwise_equal(dsum.download(), want_sum)) << "linear_add";
}

// GLM-5's 128 x 128 blocks; blocks that split rows and columns unevenly; K not a multiple of 4
// (the unaligned tail path) and N not a multiple of the block's 8 columns.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaLinearFp8,
                         ::testing::Values(Fp8Shape{256, 384, 128, 128, false},
                                           Fp8Shape{96, 1024, 128, 128, true},
                                           Fp8Shape{40, 200, 16, 32, false},
                                           Fp8Shape{33, 70, 8, 16, true}));

// GLM-5's multi-head latent attention: the CUDA op (absorbed order, online softmax) against the
// CPU's absorbed order, with and without a DSA choice (unsorted, with -1 padding and positions
// past the query's), kv_b in f32 and bf16; a query's outputs are the same bits alone.
struct MlaShape {
  int64_t H, dn, dr, dv, R, ctx, topk;  // topk 0: every position up to the query's
  bool bf16;
};
void PrintTo(const MlaShape& s, std::ostream* os) {
  *os << "H " << s.H << " dn " << s.dn << " dr " << s.dr << " dv " << s.dv << " R " << s.R
      << " ctx " << s.ctx << " topk " << s.topk << (s.bf16 ? " bf16" : " f32");
}

using CudaMla = CudaParamTest<MlaShape>;

TEST_P(CudaMla, MatchesCpuAbsorbedAndIsBatchInvariant) {
  const MlaShape p = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(11 + p.H * 7 + p.R + p.ctx + p.topk));
  const std::vector<int64_t> pos = {0, 3, p.ctx / 2, p.ctx - 2, p.ctx - 1};
  const int64_t n = static_cast<int64_t>(pos.size());
  const auto qn = randn(sz(n * p.H * p.dn), rng, 0.3f);
  const auto qp = randn(sz(n * p.H * p.dr), rng, 0.3f);
  const auto latent = randn(sz(p.ctx * (p.R + p.dr)), rng);
  auto kv = randn(sz(p.H * (p.dn + p.dv) * p.R), rng, 0.1f);
  if (p.bf16) kv = round_bf16(kv);
  const std::vector<uint16_t> kv16 = to_bf16(kv);
  std::vector<int32_t> allowed;
  if (p.topk > 0) {
    std::uniform_int_distribution<int32_t> any(-1, static_cast<int32_t>(p.ctx - 1));
    for (int64_t j = 0; j < n * p.topk; ++j) allowed.push_back(any(rng));
  }
  ops::WeightRef w;
  w.dtype = DType::F32;
  w.data = kv.data();
  w.rows = p.H * (p.dn + p.dv);
  w.cols = p.R;
  const float scale = 1.0f / std::sqrt(static_cast<float>(p.dn + p.dr));
  std::vector<float> want(sz(n * p.H * p.dv));
  cpu::mla_attention(qn.data(), qp.data(), n, p.H, p.dn, p.dr, p.dv, latent.data(), p.ctx, p.R, w,
                     pos.data(), p.topk ? allowed.data() : nullptr, p.topk, scale, true,
                     want.data());

  const DeviceBuffer<float> dqn(qn), dqp(qp), dlat(latent), dkv(kv);
  const DeviceBuffer<uint16_t> dkv16(kv16);
  const DeviceBuffer<int64_t> dpos(pos);
  const DeviceBuffer<int32_t> dallowed(p.topk ? allowed : std::vector<int32_t>{0});
  ops::WeightRef dw = w;
  dw.dtype = p.bf16 ? DType::BF16 : DType::F32;
  dw.data = p.bf16 ? static_cast<const void*>(dkv16.get()) : static_cast<const void*>(dkv.get());
  auto run = [&](int64_t first, int64_t count) {
    DeviceBuffer<float> out = nan_buffer(sz(count * p.H * p.dv));
    cuda::mla_attention(dqn.get() + first * p.H * p.dn, dqp.get() + first * p.H * p.dr, count, p.H,
                        p.dn, p.dr, p.dv, dlat.get(), p.ctx, p.R, dw, dpos.get() + first,
                        p.topk ? dallowed.get() + first * p.topk : nullptr, p.topk, scale, true,
                        out.get());
    return out.download();
  };
  const std::vector<float> got = run(0, n);
  EXPECT_TRUE(near_blocks(got, want, sz(p.dv), kAttnRel));
  for (int64_t q = 0; q < n; ++q)
    EXPECT_TRUE(bitwise_equal(run(q, 1), slice(got, sz(q * p.H * p.dv), sz(p.H * p.dv))))
        << "query " << q;
}

// A small shape with a choice of 8 and without; GLM-5's head (dn 192, dr 64, dv 256, latent 512)
// with its choice of 2048 over a shorter context and more positions than one chunk.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaMla,
                         ::testing::Values(MlaShape{4, 32, 16, 32, 64, 40, 8, false},
                                           MlaShape{4, 32, 16, 32, 64, 40, 0, true},
                                           MlaShape{2, 192, 64, 256, 512, 600, 0, true},
                                           MlaShape{2, 192, 64, 256, 512, 700, 2048, false}));

using CudaLinearModes = CudaTest;

// GLM-5's DSA indexer choice: the CUDA op against the CPU's, position for position. Grid-valued
// queries, keys and head weights (multiples of 0.5, D = 16 so the scale is 0.25) make every score
// exact on both sides, so equal scores are common and the tie rule (the lower position) is
// checked too; a choice shorter than topk (dense) and one that drops positions; contexts whose
// keys sort in shared memory (100) and in global scratch (5,000: past 4,096).
TEST_F(CudaLinearModes, DsaSelectMatchesTheCpuIncludingTies) {
  std::mt19937 rng(31);
  const int64_t heads = 4, D = 16;
  std::uniform_int_distribution<int> grid(-4, 4);
  auto values = [&](int64_t count) {
    std::vector<float> v(sz(count));
    for (float& x : v) x = 0.5f * static_cast<float>(grid(rng));
    return v;
  };
  for (const int64_t ctx : {int64_t{100}, int64_t{5000}}) {
    const std::vector<int64_t> pos = {0, 3, 7, 20, 63, ctx - 1};
    const int64_t n = static_cast<int64_t>(pos.size());
    const auto q = values(n * heads * D), w = values(n * heads), keys = values(ctx * D);
    const DeviceBuffer<float> dq(q), dw(w), dkeys(keys);
    const DeviceBuffer<int64_t> dpos(pos);
    for (const int64_t topk : {int64_t{8}, int64_t{128}}) {
      std::vector<int32_t> want(sz(n * topk));
      cpu::dsa_select(q.data(), w.data(), n, heads, D, keys.data(), ctx, pos.data(), topk,
                      want.data());
      DeviceBuffer<int32_t> dout(sz(n * topk));
      cuda::dsa_select(dq.get(), dw.get(), n, heads, D, dkeys.get(), ctx, dpos.get(), topk,
                       dout.get());
      EXPECT_EQ(dout.download(), want) << "context " << ctx << ", topk " << topk;
      DeviceBuffer<int32_t> one(sz(topk));
      cuda::dsa_select(dq.get() + 5 * heads * D, dw.get() + 5 * heads, 1, heads, D, dkeys.get(),
                       ctx, dpos.get() + 5, topk, one.get());
      EXPECT_EQ(one.download(), slice(want, sz(5 * topk), sz(topk)))
          << "context " << ctx << ", the last query alone";
    }
  }
}

// The CUDA linear rounds each activation to bf16 (round to nearest even) before multiplying.
// With weights exactly 1, 2 or 0.5 and K = 64 equal activations, every sum is exact in fp32, so
// the output tells exactly how the activation was rounded.
TEST_F(CudaLinearModes, RoundsActivationsToBf16NearestEven) {
  const int64_t k = 64;
  const float wv[3] = {1.0f, 2.0f, 0.5f};
  std::vector<uint16_t> wh(sz(3 * k));
  for (int64_t j = 0; j < 3; ++j)
    for (int64_t c = 0; c < k; ++c) wh[sz(j * k + c)] = f32_to_bf16(wv[j]);
  // 1 + 2^-9 rounds down to 1; 1 + 3·2^-9 rounds up to 1 + 2^-7 (truncation would give 1);
  // 1 + 2^-8 is a tie and rounds to even (1).
  const float xv[4] = {1.0f + 0x1p-9f, 1.0f + 3 * 0x1p-9f, -(1.0f + 3 * 0x1p-9f), 1.0f + 0x1p-8f};
  const float rounded[4] = {1.0f, 1.0f + 0x1p-7f, -(1.0f + 0x1p-7f), 1.0f};
  std::vector<float> x(sz(4 * k));
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t c = 0; c < k; ++c) x[sz(i * k + c)] = xv[i];
  DeviceBuffer<uint16_t> dw(wh);
  DeviceBuffer<float> dx(x);
  DeviceBuffer<float> dy = nan_buffer(12);
  cuda::linear(dx.get(), 4, {DType::BF16, dw.get(), 3, k, {}}, dy.get());
  const auto y = dy.download();
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 3; ++j)
      EXPECT_EQ(y[sz(i * 3 + j)], static_cast<float>(k) * rounded[i] * wv[j])
          << "row " << i << " (x = " << xv[i] << "), weight " << wv[j];
}

// Prefill mode lets linear use cuBLAS for m >= 64; it must still match the CPU.
TEST_F(CudaLinearModes, PrefillModeMatchesCpu) {
  std::mt19937 rng(21);
  for (const LinearShape s : {LinearShape{1024, 1024}, LinearShape{4096, 1024},
                              LinearShape{1000, 4096}, LinearShape{20, 384}}) {
    const Bf16Matrix w = bf16_matrix(s.n, s.k, rng);
    const int64_t max_m = 257;
    const auto x = randn(sz(max_m * s.k), rng);
    const auto want = cpu_linear_bf16(x, max_m, w);
    const DeviceBuffer<float> dx(x);
    cuda::set_prefill(true);
    for (int64_t m : {64, 100, 257, 1, 17}) {
      const auto got = cuda_linear(dx, 0, m, w);
      EXPECT_TRUE(near_blocks(got, slice(want, 0, sz(m * s.n)), sz(s.n), kLinearRel))
          << "prefill, N " << s.n << " K " << s.k << " m " << m;
    }
    cuda::set_prefill(false);
  }
  // Back in the default mode the same call is the batch-invariant kernel again.
  const Bf16Matrix w = bf16_matrix(64, 256, rng);
  const auto x = randn(sz(100 * 256), rng);
  const DeviceBuffer<float> dx(x);
  const auto all = cuda_linear(dx, 0, 100, w);
  EXPECT_TRUE(near_blocks(all, cpu_linear_bf16(x, 100, w), 64, kLinearRel));
  EXPECT_TRUE(bitwise_equal(cuda_linear(dx, 99, 1, w), slice(all, 99 * 64, 64)))
      << "after set_prefill(false), m = 100 is not batch invariant";
}

// Every prefill GEMM tile an engine can pick (ops::prefill_gemm_rows: 16..4096 rows) matches the
// CPU, and within one tile size a row's bits do not depend on how many rows share the call or
// where the row falls among the tiles: what lets a small chunk use a small tile and still give a
// prompt the same numbers alone and next to other prompts.
TEST_F(CudaLinearModes, EveryPrefillTileMatchesCpuAndIsBatchInvariant) {
  std::mt19937 rng(23);
  const LinearShape s{1024, 2048};
  const Bf16Matrix w = bf16_matrix(s.n, s.k, rng);
  const int64_t max_m = 300;
  const auto x = randn(sz(max_m * s.k), rng);
  const auto want = cpu_linear_bf16(x, max_m, w);
  const DeviceBuffer<float> dx(x);
  for (const int64_t chunk : {1, 16, 32, 50, 64, 128, 256, 1000, 4096, 9000}) {
    const int64_t tile = ops::prefill_gemm_rows(chunk);
    ASSERT_EQ(tile % 16, 0) << "chunk " << chunk;
    ASSERT_GE(tile, std::min<int64_t>(chunk, ops::kMaxPrefillGemmRows)) << "chunk " << chunk;
    cuda::set_prefill(true, tile);
    const auto all = cuda_linear(dx, 0, max_m, w);
    EXPECT_TRUE(near_blocks(all, want, sz(s.n), kLinearRel)) << "tile " << tile;
    for (const auto& [first, m] : {std::pair<int64_t, int64_t>{0, 1},
                                   {7, 1},
                                   {37, 5},
                                   {std::min(tile, max_m - 1) - 1, 2},
                                   {299, 1},
                                   {100, 64}}) {
      EXPECT_TRUE(
          bitwise_equal(cuda_linear(dx, first, m, w), slice(all, sz(first * s.n), sz(m * s.n))))
          << "tile " << tile << ": rows " << first << "+" << m << " differ from the same rows of a "
          << max_m << "-row call";
    }
    cuda::set_prefill(false);
  }
}

// gate_up_swiglu on the pair layout gives the bits of the gate and up linears followed by
// swiglu, in every decode-side path (in-register rounding for m <= 4, the bf16 scratch above, the
// warp kernel for K not a multiple of 16); in prompt prefill (cuBLAS on a [2I, K] weight instead
// of two [I, K] ones) it matches within the linear tolerance.
TEST_F(CudaLinearModes, GateUpSwigluIsTheTwoLinearsThenSwiglu) {
  std::mt19937 rng(22);
  const int64_t G = ops::kGateUpGroup;
  for (const LinearShape s :
       {LinearShape{1024, 4096}, LinearShape{40, 1024}, LinearShape{16, 100}}) {
    const int64_t I = s.n;
    const Bf16Matrix gate = bf16_matrix(I, s.k, rng), up = bf16_matrix(I, s.k, rng);
    std::vector<uint16_t> pairs;
    for (int64_t blk = 0; blk < I / G; ++blk)
      for (const Bf16Matrix* part : {&gate, &up})
        pairs.insert(pairs.end(), part->host.begin() + blk * G * s.k,
                     part->host.begin() + (blk + 1) * G * s.k);
    const DeviceBuffer<uint16_t> dpairs(pairs);
    const ops::WeightRef gate_up{DType::BF16, dpairs.get(), 2 * I, s.k, {}};
    for (bool prefill : {false, true}) {
      for (int64_t m : {1, 3, 5, 40, 257}) {
        const auto x = randn(sz(m * s.k), rng);
        const DeviceBuffer<float> dx(x);
        DeviceBuffer<float> g = nan_buffer(sz(m * I)), u = nan_buffer(sz(m * I));
        DeviceBuffer<float> want = nan_buffer(sz(m * I)), got = nan_buffer(sz(m * I));
        cuda::set_prefill(prefill);
        cuda::linear(dx.get(), m, gate.dev_ref(), g.get());
        cuda::linear(dx.get(), m, up.dev_ref(), u.get());
        cuda::swiglu(g.get(), u.get(), m * I, want.get());
        cuda::gate_up_swiglu(dx.get(), m, gate_up, got.get());
        cuda::set_prefill(false);
        const std::string where = "I " + std::to_string(I) + " K " + std::to_string(s.k) + " m " +
                                  std::to_string(m) + " prefill " + std::to_string(prefill);
        if (prefill)
          EXPECT_TRUE(near_blocks(got.download(), want.download(), sz(I), kLinearRel)) << where;
        else
          EXPECT_TRUE(bitwise_equal(got.download(), want.download())) << where;
      }
    }
  }
}

TEST_F(CudaLinearModes, RejectsNonBf16Weights) {
  DeviceBuffer<float> w(64 * 32), x(2 * 32), y(2 * 64);
  cuda::fill_zero(w.get(), w.bytes());
  cuda::fill_zero(x.get(), x.bytes());
  try {
    cuda::linear(x.get(), 2, {DType::F32, w.get(), 64, 32, {}}, y.get());
    ADD_FAILURE() << "linear accepted an F32 weight";
  } catch (const tandem::Error& e) {
    EXPECT_TRUE(contains_nocase(e.what(), "BF16")) << "error does not name the dtype: " << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// embed_rows
// ---------------------------------------------------------------------------------------------

using CudaOps = CudaTest;

TEST_F(CudaOps, EmbedRowsCopiesBf16RowsExactly) {
  std::mt19937 rng(31);
  const int64_t vocab = 1000;
  for (int64_t d : {384, 1024, 4096}) {
    const Bf16Matrix table = bf16_matrix(vocab, d, rng);
    for (int64_t n : {1, 7, 33}) {
      std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
      std::vector<int32_t> ids(sz(n));
      for (auto& i : ids) i = id(rng);
      ids[0] = n > 1 ? 0 : static_cast<int32_t>(vocab - 1);
      if (n > 2) {
        ids[sz(n - 1)] = static_cast<int32_t>(vocab - 1);
        ids[2] = ids[1];  // a repeated token
      }
      std::vector<float> want(sz(n * d));
      cpu::embed_rows(table.host_ref(), ids.data(), n, want.data());
      DeviceBuffer<int32_t> dids(ids);
      DeviceBuffer<float> out = nan_buffer(sz(n * d));
      cuda::embed_rows(table.dev_ref(), dids.get(), n, out.get());
      EXPECT_TRUE(bitwise_equal(out.download(), want)) << "d " << d << " n " << n;
    }
  }
}

TEST_F(CudaOps, EmbedRowsSelectedMatchesCpu) {
  std::mt19937 rng(32);
  const int64_t vocab = 500, d = 384;
  const Bf16Matrix table = bf16_matrix(vocab, d, rng);
  const std::vector<int32_t> ids = {7, 0, 0, 0, 499, 0, 0};
  const std::vector<int32_t> source = {3, 17, 250, -1, 498, 12};
  const std::vector<int32_t> from = {-1, 0, 2, 1, -1, 4, 3};  // the last: a failed draw (-1)
  std::vector<float> want(sz(7 * d));
  cpu::embed_rows_selected(table.host_ref(), ids.data(), source.data(), from.data(), 7,
                           want.data());
  DeviceBuffer<int32_t> dids(ids), dsource(source), dfrom(from);
  DeviceBuffer<float> out = nan_buffer(sz(7 * d));
  cuda::embed_rows_selected(table.dev_ref(), dids.get(), dsource.get(), dfrom.get(), 7, out.get());
  EXPECT_TRUE(bitwise_equal(out.download(), want));
}

// The verify-window ops (a round settled on the device) against the CPU's, on many rows.
TEST_F(CudaOps, WindowOpsMatchCpu) {
  std::mt19937 rng(33);
  const int64_t R = 300, vocab = 50;
  std::vector<int32_t> bounds = {0}, ids, from, verified, source;
  std::vector<int64_t> token_row;
  for (int64_t r = 0; r < R; ++r) {
    const int n = std::uniform_int_distribution<int>(1, 6)(rng);
    for (int j = 0; j < n; ++j) {
      token_row.push_back(r);
      verified.push_back(std::uniform_int_distribution<int32_t>(0, 3)(rng));
      // Proposals mostly right so that walks run long; some still in the drafter's source.
      int32_t t = j > 0 && rng() % 4 != 0 ? verified[verified.size() - 2]
                                          : std::uniform_int_distribution<int32_t>(0, 3)(rng);
      if (j > 0 && rng() % 3 == 0) {
        from.push_back(static_cast<int32_t>(source.size()));
        source.push_back(t);
        t = static_cast<int32_t>(vocab - 1);  // a placeholder
      } else {
        from.push_back(-1);
      }
      ids.push_back(t);
    }
    bounds.push_back(static_cast<int32_t>(ids.size()));
  }
  const int64_t T = static_cast<int64_t>(ids.size());
  std::vector<int32_t> acc_want(sz(R)), next_want(sz(R));
  cpu::accept_windows(verified.data(), ids.data(), source.data(), from.data(), bounds.data(),
                      nullptr, R, acc_want.data(), next_want.data());
  DeviceBuffer<int32_t> dver(verified), dids(ids), dsource(source), dfrom(from), dbounds(bounds);
  DeviceBuffer<int32_t> dacc(sz(R)), dnext(sz(R));
  cuda::accept_windows(dver.get(), dids.get(), dsource.get(), dfrom.get(), dbounds.get(), nullptr,
                       R, dacc.get(), dnext.get());
  EXPECT_EQ(dacc.download(), acc_want);
  EXPECT_EQ(dnext.download(), next_want);
  // With limits (a drafter that proposed fewer tokens than its window holds).
  std::vector<int32_t> limits(sz(R));
  for (auto& l : limits) l = std::uniform_int_distribution<int32_t>(0, 5)(rng);
  std::vector<int32_t> acc_lim(sz(R)), next_lim(sz(R));
  cpu::accept_windows(verified.data(), ids.data(), source.data(), from.data(), bounds.data(),
                      limits.data(), R, acc_lim.data(), next_lim.data());
  DeviceBuffer<int32_t> dlimits(limits), dacc_lim(sz(R)), dnext_lim(sz(R));
  cuda::accept_windows(dver.get(), dids.get(), dsource.get(), dfrom.get(), dbounds.get(),
                       dlimits.get(), R, dacc_lim.get(), dnext_lim.get());
  EXPECT_EQ(dacc_lim.download(), acc_lim);
  EXPECT_EQ(dnext_lim.download(), next_lim);
  EXPECT_NE(acc_lim, acc_want);  // some limit cut a walk
  int64_t walked = 0;
  for (int32_t a : acc_want) walked += a;
  EXPECT_GT(walked, R / 2);  // the walks are not all empty

  // Settle every other row into slots in reverse order, with 3 layers of descriptors.
  std::vector<ops::SettledRow> rows;
  for (int64_t r = 0; r < R; r += 2)
    rows.push_back({static_cast<int32_t>(R - 1 - r), static_cast<int32_t>(r)});
  const int64_t n = static_cast<int64_t>(rows.size()), layers = 3;
  std::vector<int64_t> shift(sz(R));
  for (auto& v : shift) v = std::uniform_int_distribution<int64_t>(0, 9)(rng);
  std::vector<ops::RecurrentRow> replay(sz(n * layers));
  std::vector<int64_t> shift_want = shift;
  std::vector<ops::RecurrentRow> replay_want = replay;
  cpu::settle_windows(acc_want.data(), rows.data(), n, shift_want.data(), replay_want.data(),
                      layers);
  DeviceBuffer<ops::SettledRow> drows(rows);
  DeviceBuffer<int64_t> dshift(shift);
  DeviceBuffer<ops::RecurrentRow> dreplay(replay);
  cuda::settle_windows(dacc.get(), drows.get(), n, dshift.get(), dreplay.get(), layers);
  EXPECT_EQ(dshift.download(), shift_want);
  const auto got = dreplay.download();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].n, replay_want[i].n) << i;

  // The next forward's positions: every row at some length, tables of 16-position blocks.
  const int64_t stride = 8, block = 16;
  std::vector<int32_t> slot_of(sz(R)), tables(sz(R * stride));
  std::vector<int64_t> known(sz(R)), pos(sz(T)), kv(sz(T), -1);
  for (auto& b : tables) b = std::uniform_int_distribution<int32_t>(0, 999)(rng);
  for (int64_t r = 0; r < R; ++r) {
    slot_of[sz(r)] = static_cast<int32_t>((r * 7) % R);
    known[sz(r)] =
        shift_want[sz(slot_of[sz(r)])] - std::uniform_int_distribution<int64_t>(0, 4)(rng);
  }
  for (int64_t t = 0; t < T; ++t) pos[sz(t)] = 20 + t - bounds[sz(token_row[sz(t)])];
  std::vector<ops::SampleRow> draws(sz(T));
  for (int64_t t = 0; t < T; ++t) draws[sz(t)].index = static_cast<uint64_t>(t);
  std::vector<int64_t> pos_want = pos, kv_want = kv;
  std::vector<ops::SampleRow> draws_want = draws;
  ops::PositionShift s;
  s.shift = shift_want.data();
  s.row_slot = slot_of.data();
  s.known = known.data();
  s.token_row = token_row.data();
  s.tokens = T;
  s.rows = R;
  s.tables = tables.data();
  s.table_stride = stride;
  s.block_size = block;
  s.sample = draws_want.data();
  cpu::shift_positions(s, pos_want.data(), kv_want.data());
  DeviceBuffer<int64_t> dshift2(shift_want), dknown(known), dtoken_row(token_row), dpos(pos),
      dkv(kv);
  DeviceBuffer<int32_t> dslot_of(slot_of), dtables(tables);
  DeviceBuffer<ops::SampleRow> ddraws(draws);
  ops::PositionShift ds = s;
  ds.shift = dshift2.get();
  ds.row_slot = dslot_of.get();
  ds.known = dknown.get();
  ds.token_row = dtoken_row.get();
  ds.tables = dtables.get();
  ds.sample = ddraws.get();
  cuda::shift_positions(ds, dpos.get(), dkv.get());
  EXPECT_EQ(dpos.download(), pos_want);
  EXPECT_EQ(dkv.download(), kv_want);
  const auto got_draws = ddraws.download();
  for (size_t t = 0; t < got_draws.size(); ++t)
    EXPECT_EQ(got_draws[t].index, draws_want[t].index) << t;
  EXPECT_NE(pos_want, pos);  // some rows moved

  // Leading tokens parked (an MTP chain's completion rows), and the gather of each window's
  // last accepted token's hidden row.
  std::vector<int32_t> accepted_rows(sz(R));
  for (auto& a : accepted_rows) a = std::uniform_int_distribution<int32_t>(0, 3)(rng);
  DeviceBuffer<int32_t> daccepted(accepted_rows);
  std::vector<int64_t> pos_park = pos, kv_park = kv;
  ops::PositionShift p = s;
  p.sample = nullptr;
  p.park_tokens = T / 2;
  p.park_unless = accepted_rows.data();
  p.park_full = 3;
  p.park_by = 4;
  cpu::shift_positions(p, pos_park.data(), kv_park.data());
  DeviceBuffer<int64_t> dpos2(pos), dkv2(kv);
  ops::PositionShift dp = ds;
  dp.sample = nullptr;
  dp.park_tokens = T / 2;
  dp.park_unless = daccepted.get();
  dp.park_full = 3;
  dp.park_by = 4;
  cuda::shift_positions(dp, dpos2.get(), dkv2.get());
  EXPECT_EQ(dpos2.download(), pos_park);
  EXPECT_EQ(dkv2.download(), kv_park);
  const int64_t width = 37, windows = 50, window = 4;
  const std::vector<float> rows_src = randn(sz(windows * window * width), rng);
  std::vector<float> gathered(sz(windows * width));
  cpu::gather_window_rows(rows_src.data(), width, window, 0, accepted_rows.data(), windows,
                          gathered.data());
  DeviceBuffer<float> dsrc(rows_src), dgathered(sz(windows * width));
  cuda::gather_window_rows(dsrc.get(), width, window, 0, daccepted.get(), windows, dgathered.get());
  EXPECT_TRUE(bitwise_equal(dgathered.download(), gathered));
}

// The n-gram drafter's device lookup and append (settled n-gram rounds) against the CPU's: rows
// of many lengths over a small vocabulary (matches at every n), some longer than a block's
// threads, one row of a single token; then each row appends what a verify kept.
TEST_F(CudaOps, NgramLookupAndAppendMatchCpu) {
  std::mt19937 rng(35);
  const int64_t R = 40, stride = 1200;
  const int depth = 4;
  std::vector<int32_t> tokens(sz(R * stride), 0);
  std::vector<int64_t> lengths(sz(R));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t len = r == 0 ? 1 : std::uniform_int_distribution<int64_t>(2, 1100)(rng);
    const int32_t vocab = static_cast<int32_t>(2 + r % 9);
    for (int64_t i = 0; i < len; ++i)
      tokens[sz(r * stride + i)] = std::uniform_int_distribution<int32_t>(0, vocab)(rng);
    lengths[sz(r)] = len;
  }
  for (int min_n : {1, 2}) {
    for (int max_n : {min_n, 3, 6}) {
      ops::TokenHistories h{tokens.data(), lengths.data(), stride, R};
      std::vector<int32_t> ids_want(sz(R + R * depth)), counts_want(sz(R));
      cpu::ngram_lookup(h, min_n, max_n, depth, ids_want.data(), counts_want.data());
      DeviceBuffer<int32_t> dtokens(tokens), dids(sz(R + R * depth)), dcounts(sz(R));
      DeviceBuffer<int64_t> dlengths(lengths);
      ops::TokenHistories dh{dtokens.get(), dlengths.get(), stride, R};
      cuda::ngram_lookup(dh, min_n, max_n, depth, dids.get(), dcounts.get());
      EXPECT_EQ(dids.download(), ids_want) << min_n << ".." << max_n;
      EXPECT_EQ(dcounts.download(), counts_want) << min_n << ".." << max_n;
      int64_t found = 0;
      for (int32_t c : counts_want) found += c;
      EXPECT_GT(found, R);  // most rows found a match
      if (min_n != 1 || max_n != 3) continue;
      // Append: accepted counts of 0..depth, next tokens of any id.
      std::vector<int32_t> accepted(sz(R)), next(sz(R));
      for (int64_t r = 0; r < R; ++r) {
        accepted[sz(r)] = std::uniform_int_distribution<int32_t>(0, depth)(rng);
        next[sz(r)] = std::uniform_int_distribution<int32_t>(0, 99)(rng);
      }
      std::vector<int32_t> tokens_want = tokens;
      std::vector<int64_t> lengths_want = lengths;
      cpu::history_append({tokens_want.data(), lengths_want.data(), stride, R}, ids_want.data(),
                          depth, accepted.data(), next.data());
      DeviceBuffer<int32_t> daccepted(accepted), dnext(next);
      cuda::history_append(dh, dids.get(), depth, daccepted.get(), dnext.get());
      EXPECT_EQ(dtokens.download(), tokens_want);
      EXPECT_EQ(dlengths.download(), lengths_want);
      EXPECT_NE(lengths_want, lengths);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// rms_norm, gated_rms_norm
// ---------------------------------------------------------------------------------------------

// m rows of d values, row r scaled by 10^(r % 5 - 2) so that the normalisation matters.
std::vector<float> norm_input(int64_t m, int64_t d, std::mt19937& rng) {
  auto x = randn(sz(m * d), rng);
  for (int64_t r = 0; r < m; ++r) {
    const float s = std::pow(10.0f, static_cast<float>(r % 5 - 2));
    for (int64_t i = 0; i < d; ++i) x[sz(r * d + i)] *= s;
  }
  return x;
}

TEST_F(CudaOps, RmsNormMatchesCpuPlainAndZeroCentred) {
  std::mt19937 rng(41);
  const float eps = 1e-6f;
  for (int64_t d : {384, 1024, 4096, 256, 64, 37}) {
    for (bool zc : {false, true}) {
      // Zero-centred weights are deltas around 0 (scale = 1 + w); plain ones sit around 1.
      const F32Weight w = f32_weight(randn(sz(d), rng, 0.1f, zc ? 0.0f : 1.0f), 1, d);
      for (int64_t m : {1, 3, 17}) {
        const auto x = norm_input(m, d, rng);
        std::vector<float> want(x.size());
        cpu::rms_norm(x.data(), m, d, w.host_ref(), zc, eps, want.data());
        DeviceBuffer<float> dx(x);
        DeviceBuffer<float> dy = nan_buffer(x.size());
        cuda::rms_norm(dx.get(), m, d, w.dev_ref(), zc, eps, dy.get());
        const auto got = dy.download();
        EXPECT_TRUE(near_blocks(got, want, sz(d), kNormRel))
            << "d " << d << " m " << m << " zero_centred " << zc;
        // In place (y == x) gives the same bits.
        cuda::rms_norm(dx.get(), m, d, w.dev_ref(), zc, eps, dx.get());
        EXPECT_TRUE(bitwise_equal(dx.download(), got))
            << "in place, d " << d << " m " << m << " zero_centred " << zc;
      }
    }
  }
}

// argmax_rows keeps its contract on every path (one block for a draft step's vocabulary, slices
// and a last block for the target's): the lowest index among the maxima, -inf ignored, -1 for a
// row holding NaN or +inf or only -inf.
TEST_F(CudaOps, ArgmaxRowsKeepTheContract) {
  std::mt19937 rng(47);
  for (int64_t V : {1, 37, 4096, 4097, 70000, 248320}) {
    const int64_t rows = 6;
    std::vector<float> l = randn(sz(rows * V), rng);
    auto row = [&](int64_t r) { return l.data() + r * V; };
    // Row 1: the maximum three times, in the first and the last slice (lowest index wins).
    for (int64_t j : {V - 1, V / 2, int64_t{0}}) row(1)[j] = 50.0f;
    std::fill(row(2), row(2) + V, -INFINITY);  // only -inf
    row(3)[V / 3] = NAN;
    row(4)[V - 1] = INFINITY;
    // Row 5: -inf everywhere but one token.
    std::fill(row(5), row(5) + V, -INFINITY);
    row(5)[(V * 2) / 3] = -3.0f;
    std::vector<int32_t> want(sz(rows));
    for (int64_t r = 0; r < rows; ++r) {
      int32_t best = -1;
      for (int64_t j = 0; j < V; ++j) {
        const float x = row(r)[j];
        if (std::isnan(x) || x == INFINITY) {
          best = -1;
          break;
        }
        if (x != -INFINITY && (best < 0 || x > row(r)[best])) best = static_cast<int32_t>(j);
      }
      want[sz(r)] = best;
    }
    DeviceBuffer<float> dl(l);
    DeviceBuffer<int32_t> out(sz(rows));
    for (int rep = 0; rep < 2; ++rep) {  // the slice counts reset for the next launch
      cuda::argmax_rows(dl.get(), rows, V, out.get());
      EXPECT_EQ(out.download(), want) << "V " << V << " launch " << rep;
    }
  }
}

// rms_norm_pair's halves carry cuda::rms_norm's bits in every norm order (so a drafter's numbers
// do not change with the fusion), near the CPU's pair.
// copy_blocks on the GPU moves exactly the named blocks, as the CPU's copies do: a drafter row's
// KV blocks (2 x 16 positions x 2 heads x 64 floats) and an odd block length, in shuffled order.
TEST_F(CudaOps, CopyBlocksMatchesCpu) {
  std::mt19937 rng(46);
  for (const int64_t bf : {int64_t{4096}, int64_t{37}}) {
    const int64_t blocks = 40, n = 13;  // blocks order[0..n) move to order[n..2n)
    const auto src = randn(sz(blocks * bf), rng, 1.0f);
    const auto before = randn(sz(blocks * bf), rng, 1.0f);
    std::vector<int32_t> order(blocks);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<int32_t> moves(order.begin(), order.begin() + 2 * n);
    std::vector<float> want = before;
    {
      const testing::ScopedBackend cpu(ops::Backend::Cpu);
      ops::copy_blocks(want.data(), src.data(), moves.data(), n, bf);
    }
    DeviceBuffer<float> dsrc(src), ddst(before);
    DeviceBuffer<int32_t> dmoves(moves);
    cuda::copy_blocks(ddst.get(), dsrc.get(), dmoves.get(), n, bf);
    EXPECT_TRUE(bitwise_equal(ddst.download(), want)) << "blocks of " << bf << " floats";
  }
}

TEST_F(CudaOps, RmsNormPairIsTwoNormsSideBySide) {
  std::mt19937 rng(45);
  const float eps = 1e-6f;
  for (int64_t d : {384, 4096, 12288, 37}) {
    for (bool zc : {false, true}) {
      const F32Weight wa = f32_weight(randn(sz(d), rng, 0.1f, zc ? 0.0f : 1.0f), 1, d);
      const F32Weight wb = f32_weight(randn(sz(d), rng, 0.1f, zc ? 0.0f : 1.0f), 1, d);
      for (int64_t m : {1, 3, 17}) {
        const auto a = norm_input(m, d, rng), b = norm_input(m, d, rng);
        DeviceBuffer<float> da(a), db(b), na = nan_buffer(a.size()), nb = nan_buffer(b.size());
        DeviceBuffer<float> y = nan_buffer(2 * a.size());
        cuda::rms_norm(da.get(), m, d, wa.dev_ref(), zc, eps, na.get());
        cuda::rms_norm(db.get(), m, d, wb.dev_ref(), zc, eps, nb.get());
        cuda::rms_norm_pair(da.get(), db.get(), m, d, wa.dev_ref(), wb.dev_ref(), zc, eps, y.get());
        const auto got = y.download(), ga = na.download(), gb = nb.download();
        std::vector<float> first, second;
        for (int64_t r = 0; r < m; ++r) {
          first.insert(first.end(), got.begin() + 2 * r * d, got.begin() + 2 * r * d + d);
          second.insert(second.end(), got.begin() + 2 * r * d + d, got.begin() + 2 * (r + 1) * d);
        }
        EXPECT_TRUE(bitwise_equal(first, ga)) << "first half, d " << d << " m " << m;
        EXPECT_TRUE(bitwise_equal(second, gb)) << "second half, d " << d << " m " << m;
        std::vector<float> want(got.size());
        cpu::rms_norm_pair(a.data(), b.data(), m, d, wa.host_ref(), wb.host_ref(), zc, eps,
                           want.data());
        EXPECT_TRUE(near_blocks(got, want, sz(d), kNormRel)) << "vs CPU, d " << d << " m " << m;
      }
    }
  }
}

// rms_norm_pair_embedded is embed_rows then rms_norm_pair, bit for bit, in every norm order: the
// draft step's fused input changes no drafted token. An id out of range gives the NaN row
// embed_rows gives it (normed: NaN), a repeated id the same row twice.
TEST_F(CudaOps, RmsNormPairEmbeddedIsEmbedThenPair) {
  std::mt19937 rng(47);
  const float eps = 1e-6f;
  const int64_t vocab = 300;
  for (int64_t d : {384, 4096, 12288, 36}) {
    const Bf16Matrix table = bf16_matrix(vocab, d, rng);
    for (bool zc : {false, true}) {
      const F32Weight wa = f32_weight(randn(sz(d), rng, 0.1f, zc ? 0.0f : 1.0f), 1, d);
      const F32Weight wb = f32_weight(randn(sz(d), rng, 0.1f, zc ? 0.0f : 1.0f), 1, d);
      for (int64_t m : {1, 3, 9}) {
        std::vector<int32_t> ids(sz(m));
        std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
        for (auto& i : ids) i = id(rng);
        if (m > 2) {
          ids[1] = -1;  // a draw that failed on NaN logits
          ids[2] = ids[0];
        }
        const auto b = norm_input(m, d, rng);
        DeviceBuffer<int32_t> dids(ids);
        DeviceBuffer<float> db(b), emb = nan_buffer(sz(m * d));
        DeviceBuffer<float> want = nan_buffer(sz(2 * m * d)), got = nan_buffer(sz(2 * m * d));
        cuda::embed_rows(table.dev_ref(), dids.get(), m, emb.get());
        cuda::rms_norm_pair(emb.get(), db.get(), m, d, wa.dev_ref(), wb.dev_ref(), zc, eps,
                            want.get());
        cuda::rms_norm_pair_embedded(table.dev_ref(), dids.get(), db.get(), m, wa.dev_ref(),
                                     wb.dev_ref(), zc, eps, got.get());
        EXPECT_TRUE(bitwise_equal(got.download(), want.download()))
            << "d " << d << " m " << m << " zc " << zc;
      }
    }
  }
}

// rms_norm_bf16 writes rms_norm's values rounded to bf16 (nearest even), for each norm order.
TEST_F(CudaOps, RmsNormBf16IsRmsNormRounded) {
  std::mt19937 rng(44);
  for (int64_t d : {384, 4096, 12288, 37}) {
    const F32Weight w = f32_weight(randn(sz(d), rng, 0.1f), 1, d);
    for (int64_t m : {1, 5}) {
      const auto x = norm_input(m, d, rng);
      DeviceBuffer<float> dx(x), y = nan_buffer(x.size());
      DeviceBuffer<uint16_t> yb(x.size());
      cuda::rms_norm(dx.get(), m, d, w.dev_ref(), true, 1e-6f, y.get());
      cuda::rms_norm_bf16(dx.get(), m, d, w.dev_ref(), true, 1e-6f, yb.get());
      EXPECT_EQ(yb.download(), to_bf16(y.download())) << "d " << d << " m " << m;
    }
  }
}

// The fused residual add + norm gives the bits of cuda::add_inplace then cuda::rms_norm (so the
// model's numbers do not change with the fusion), and is near the CPU.
TEST_F(CudaOps, AddRmsNormIsBitwiseAddThenNorm) {
  std::mt19937 rng(43);
  const float eps = 1e-6f;
  for (int64_t d : {4096, 1024, 37}) {
    const F32Weight w = f32_weight(randn(sz(d), rng, 0.1f), 1, d);
    for (int64_t m : {1, 3, 17}) {
      const auto x = norm_input(m, d, rng);
      const auto r = randn(x.size(), rng, 3.0f);
      DeviceBuffer<float> ux(x), ur(r);
      DeviceBuffer<float> uy = nan_buffer(x.size());
      cuda::add_inplace(ux.get(), ur.get(), m * d);
      cuda::rms_norm(ux.get(), m, d, w.dev_ref(), true, eps, uy.get());
      DeviceBuffer<float> fx(x), fr(r);
      cuda::add_rms_norm(fx.get(), fr.get(), m, d, w.dev_ref(), true, eps, fr.get());  // y == r
      EXPECT_TRUE(bitwise_equal(fx.download(), ux.download())) << "x, d " << d << " m " << m;
      const auto got = fr.download();
      EXPECT_TRUE(bitwise_equal(got, uy.download())) << "y, d " << d << " m " << m;
      std::vector<float> cx = x, want(x.size());
      cpu::add_inplace(cx.data(), r.data(), m * d);
      cpu::rms_norm(cx.data(), m, d, w.host_ref(), true, eps, want.data());
      EXPECT_TRUE(near_blocks(got, want, sz(d), kNormRel)) << "vs CPU, d " << d << " m " << m;
    }
  }
}

// A projection with an input norm gives the bits of rms_norm into a temporary followed by the
// projection on every path: decode shapes normalising while they stage their rows (m = 1; each
// of the three norm orders: K = 384, 4096, 12288; 4 and 8 warps), rms_norm_bf16 first on the
// register kernel (2..16 rows), the ring kernel (17..32) and beyond, prompt prefill (rms_norm
// first), a row too long to stage (K = 65,552: rms_norm_bf16 first at one row too), and K not a
// multiple of 16 (the warp kernel). x is left as it was.
TEST_F(CudaLinearModes, InputNormIsBitwiseRmsNormThenProduct) {
  std::mt19937 rng(23);
  for (const LinearShape c :
       {LinearShape{96, 384}, LinearShape{8208, 4096}, LinearShape{64, 4096},
        LinearShape{48, 12288}, LinearShape{16, 65552}, LinearShape{32, 100}}) {
    const Bf16Matrix w = bf16_matrix(c.n, c.k, rng);  // also read as gate/up pairs (n % 16 == 0)
    for (bool zc : {true, false}) {
      const F32Weight nw = f32_weight(randn(sz(c.k), rng, 0.1f, zc ? 0.0f : 1.0f), 1, c.k);
      const ops::RowNorm norm{nw.dev_ref(), zc, 1e-6f};
      for (bool prefill : {false, true}) {
        for (int64_t m : {1, 2, 4, 5, 8, 16, 17, 32, 40}) {
          const auto x = norm_input(m, c.k, rng);
          const DeviceBuffer<float> dx(x);
          DeviceBuffer<float> h = nan_buffer(x.size());
          const int64_t n0 = c.n / 2;  // two output slices
          DeviceBuffer<float> want0 = nan_buffer(sz(m * n0)), want1 = nan_buffer(sz(m * n0));
          DeviceBuffer<float> got0 = nan_buffer(sz(m * n0)), got1 = nan_buffer(sz(m * n0));
          DeviceBuffer<float> act_want = nan_buffer(sz(m * n0)), act_got = nan_buffer(sz(m * n0));
          const ops::OutputSlice want_out[] = {{want0.get(), n0}, {want1.get(), c.n - n0}};
          const ops::OutputSlice got_out[] = {{got0.get(), n0}, {got1.get(), c.n - n0}};
          const ops::WeightRef pairs = w.dev_ref();
          cuda::set_prefill(prefill);
          cuda::rms_norm(dx.get(), m, c.k, nw.dev_ref(), zc, 1e-6f, h.get());
          cuda::linear_split(h.get(), m, w.dev_ref(), want_out, 2);
          cuda::linear_split(dx.get(), m, w.dev_ref(), got_out, 2, &norm);
          cuda::gate_up_swiglu(h.get(), m, pairs, act_want.get());
          cuda::gate_up_swiglu(dx.get(), m, pairs, act_got.get(), &norm);
          cuda::set_prefill(false);
          const std::string where = "N " + std::to_string(c.n) + " K " + std::to_string(c.k) +
                                    " m " + std::to_string(m) + " zero_centred " +
                                    std::to_string(zc) + " prefill " + std::to_string(prefill);
          EXPECT_TRUE(bitwise_equal(got0.download(), want0.download())) << "slice 0, " << where;
          EXPECT_TRUE(bitwise_equal(got1.download(), want1.download())) << "slice 1, " << where;
          EXPECT_TRUE(bitwise_equal(act_got.download(), act_want.download()))
              << "gate_up_swiglu, " << where;
          EXPECT_TRUE(bitwise_equal(dx.download(), x)) << "x changed, " << where;
        }
      }
    }
  }
  // A norm that is not an F32 vector of K is refused by name.
  const Bf16Matrix w = bf16_matrix(16, 64, rng);
  const F32Weight short_norm = f32_weight(randn(63, rng), 1, 63);
  const ops::RowNorm bad{short_norm.dev_ref(), true, 1e-6f};
  DeviceBuffer<float> x(64), y(16);
  try {
    cuda::linear_split(x.get(), 1, w.dev_ref(), std::array{ops::OutputSlice{y.get(), 16}}.data(), 1,
                       &bad);
    ADD_FAILURE() << "linear_split accepted a 63-element norm for K = 64";
  } catch (const tandem::Error& e) {
    EXPECT_TRUE(contains_nocase(e.what(), "norm")) << e.what();
  }
}

// linear_add gives the bits of linear into a temporary then add_inplace: the epilogue add on
// every decode path, cuBLAS then add_inplace in prompt prefill.
TEST_F(CudaLinearModes, LinearAddIsBitwiseLinearThenAdd) {
  std::mt19937 rng(24);
  for (const LinearShape s :
       {LinearShape{96, 4096}, LinearShape{64, 12288}, LinearShape{32, 100}}) {
    const Bf16Matrix w = bf16_matrix(s.n, s.k, rng);
    for (bool prefill : {false, true}) {
      for (int64_t m : {1, 4, 5, 40, 300}) {
        const DeviceBuffer<float> x(randn(sz(m * s.k), rng));
        const auto y0 = randn(sz(m * s.n), rng, 4.0f);
        DeviceBuffer<float> product = nan_buffer(y0.size()), want(y0), got(y0);
        cuda::set_prefill(prefill);
        cuda::linear(x.get(), m, w.dev_ref(), product.get());
        cuda::add_inplace(want.get(), product.get(), m * s.n);
        cuda::linear_add(x.get(), m, w.dev_ref(), got.get());
        cuda::set_prefill(false);
        EXPECT_TRUE(bitwise_equal(got.download(), want.download()))
            << "N " << s.n << " K " << s.k << " m " << m << " prefill " << prefill;
      }
    }
  }
}

// linear_add with a gated norm gives the bits of gated_rms_norm into a temporary followed by
// linear_add on every path: the bf16 norm kernel first (decode, windows on the register and
// ring kernels, batches; heads of 128, 64 and 48), prefill, and the warp kernel (K not a
// multiple of 16). x is left as it was.
TEST_F(CudaLinearModes, LinearAddWithGatedNormIsNormThenLinearAdd) {
  std::mt19937 rng(26);
  struct GatedShape {
    int64_t n, k, hd;
  };
  for (const GatedShape c : {GatedShape{4096, 4096, 128}, GatedShape{384, 512, 64},
                             GatedShape{64, 96, 48}, GatedShape{32, 100, 50}}) {
    const Bf16Matrix w = bf16_matrix(c.n, c.k, rng);
    const F32Weight nw = f32_weight(randn(sz(c.hd), rng, 0.1f, 1.0f), 1, c.hd);
    for (bool prefill : {false, true}) {
      for (int64_t m : {1, 2, 4, 5, 8, 16, 17, 32, 40}) {
        const auto x = norm_input(m, c.k, rng);
        const auto y0 = randn(sz(m * c.n), rng, 2.0f);
        const DeviceBuffer<float> dx(x), z(randn(x.size(), rng, 2.0f));
        DeviceBuffer<float> normed = nan_buffer(x.size()), want(y0), got(y0);
        const ops::GatedNorm gated{z.get(), nw.dev_ref(), 1e-6f};
        cuda::set_prefill(prefill);
        cuda::gated_rms_norm(dx.get(), z.get(), m * (c.k / c.hd), c.hd, nw.dev_ref(), 1e-6f,
                             normed.get());
        cuda::linear_add(normed.get(), m, w.dev_ref(), want.get());
        cuda::linear_add(dx.get(), m, w.dev_ref(), got.get(), &gated);
        cuda::set_prefill(false);
        const std::string where = "N " + std::to_string(c.n) + " K " + std::to_string(c.k) +
                                  " head " + std::to_string(c.hd) + " m " + std::to_string(m) +
                                  " prefill " + std::to_string(prefill);
        EXPECT_TRUE(bitwise_equal(got.download(), want.download())) << where;
        EXPECT_TRUE(bitwise_equal(dx.download(), x)) << "x changed, " << where;
      }
    }
  }
}

// gated_rms_norm_bf16 writes gated_rms_norm's values rounded to bf16.
TEST_F(CudaOps, GatedRmsNormBf16IsGatedRmsNormRounded) {
  std::mt19937 rng(45);
  for (int64_t d : {128, 64, 37}) {
    const F32Weight w = f32_weight(randn(sz(d), rng, 0.1f, 1.0f), 1, d);
    const int64_t m = 32;
    const auto x = norm_input(m, d, rng);
    DeviceBuffer<float> dx(x), z(randn(x.size(), rng, 2.0f)), y = nan_buffer(x.size());
    DeviceBuffer<uint16_t> yb(x.size());
    cuda::gated_rms_norm(dx.get(), z.get(), m, d, w.dev_ref(), 1e-6f, y.get());
    cuda::gated_rms_norm_bf16(dx.get(), z.get(), m, d, w.dev_ref(), 1e-6f, yb.get());
    EXPECT_EQ(yb.download(), to_bf16(y.download())) << "d " << d;
  }
}

// swiglu_mlp_add gives the bits of gate_up_swiglu into an fp32 temporary followed by linear_add
// (the bf16 activations between its projections are the rounding the down projection applies
// anyway), with and without an input norm, at decode, window and batch sizes and in prefill.
TEST_F(CudaLinearModes, SwigluMlpAddIsGateUpThenLinearAdd) {
  std::mt19937 rng(25);
  struct MlpShape {
    int64_t h, I;
  };
  for (const MlpShape s : {MlpShape{4096, 1024}, MlpShape{384, 768}, MlpShape{64, 40}}) {
    const Bf16Matrix gate_up = bf16_matrix(2 * s.I, s.h, rng), down = bf16_matrix(s.h, s.I, rng);
    const F32Weight nw = f32_weight(randn(sz(s.h), rng, 0.1f), 1, s.h);
    const ops::RowNorm norm{nw.dev_ref(), true, 1e-6f};
    for (const ops::RowNorm* n : {static_cast<const ops::RowNorm*>(nullptr), &norm}) {
      for (bool prefill : {false, true}) {
        for (int64_t m : {1, 2, 4, 5, 40}) {
          const auto x = norm_input(m, s.h, rng);
          DeviceBuffer<float> act = nan_buffer(sz(m * s.I)), want(x), got(x);
          cuda::set_prefill(prefill);
          cuda::gate_up_swiglu(want.get(), m, gate_up.dev_ref(), act.get(), n);
          cuda::linear_add(act.get(), m, down.dev_ref(), want.get());
          cuda::swiglu_mlp_add(got.get(), m, gate_up.dev_ref(), down.dev_ref(), got.get(), n);
          cuda::set_prefill(false);
          EXPECT_TRUE(bitwise_equal(got.download(), want.download()))
              << "H " << s.h << " I " << s.I << " m " << m << " norm " << (n != nullptr)
              << " prefill " << prefill;
        }
      }
    }
  }
}

TEST_F(CudaOps, GatedRmsNormMatchesCpu) {
  std::mt19937 rng(42);
  const float eps = 1e-6f;
  // DeltaNet: d = dv = 128 per value head, m = tokens × value heads (16 or 32).
  for (int64_t d : {128, 64}) {
    const F32Weight w = f32_weight(randn(sz(d), rng, 0.1f, 1.0f), 1, d);
    for (int64_t m : {1, 7, 3 * 16, 17 * 32}) {
      const auto x = norm_input(m, d, rng);
      const auto z = randn(x.size(), rng, 2.0f);
      std::vector<float> want(x.size());
      cpu::gated_rms_norm(x.data(), z.data(), m, d, w.host_ref(), eps, want.data());
      DeviceBuffer<float> dx(x), dz(z);
      DeviceBuffer<float> dy = nan_buffer(x.size());
      cuda::gated_rms_norm(dx.get(), dz.get(), m, d, w.dev_ref(), eps, dy.get());
      EXPECT_TRUE(near_blocks(dy.download(), want, sz(d), kNormRel)) << "d " << d << " m " << m;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// swiglu, sigmoid_gate, add_inplace
// ---------------------------------------------------------------------------------------------

// Gate values: N(0, 3), with the saturated ends (±20, ±100) and 0 planted at the front of the
// longer vectors.
std::vector<float> gate_values(int64_t n, std::mt19937& rng) {
  auto g = randn(sz(n), rng, 3.0f);
  const float planted[] = {-100.0f, 100.0f, -20.0f, 20.0f, 0.0f};
  if (g.size() >= 8) std::copy(std::begin(planted), std::end(planted), g.begin());
  return g;
}

const int64_t kElementCounts[] = {1, 17, 3 * 3584, (int64_t(1) << 20) + 3};

TEST_F(CudaOps, SwigluMatchesCpu) {
  std::mt19937 rng(51);
  for (int64_t n : kElementCounts) {
    const auto gate = gate_values(n, rng);
    const auto up = randn(sz(n), rng);
    std::vector<float> want(sz(n));
    cpu::swiglu(gate.data(), up.data(), n, want.data());
    DeviceBuffer<float> dg(gate), du(up);
    DeviceBuffer<float> dout = nan_buffer(sz(n));
    cuda::swiglu(dg.get(), du.get(), n, dout.get());
    EXPECT_TRUE(near_blocks(dout.download(), want, 1, kElemRel, 1e-30)) << "n " << n;
  }
}

TEST_F(CudaOps, SigmoidGateMatchesCpu) {
  std::mt19937 rng(52);
  for (int64_t n : kElementCounts) {
    const auto gate = gate_values(n, rng);
    const auto x = randn(sz(n), rng);
    std::vector<float> want = x;
    cpu::sigmoid_gate(want.data(), gate.data(), n);
    DeviceBuffer<float> dx(x), dg(gate);
    cuda::sigmoid_gate(dx.get(), dg.get(), n);
    EXPECT_TRUE(near_blocks(dx.download(), want, 1, kElemRel, 1e-30)) << "n " << n;
  }
}

TEST_F(CudaOps, AddInplaceIsExact) {
  std::mt19937 rng(53);
  for (int64_t n : kElementCounts) {
    const auto x = randn(sz(n), rng);
    const auto y = randn(sz(n), rng, 10.0f);
    std::vector<float> want = x;
    cpu::add_inplace(want.data(), y.data(), n);
    DeviceBuffer<float> dx(x), dy(y);
    cuda::add_inplace(dx.get(), dy.get(), n);
    EXPECT_TRUE(bitwise_equal(dx.download(), want)) << "n " << n;
  }
}

// ---------------------------------------------------------------------------------------------
// rope
// ---------------------------------------------------------------------------------------------

// inv_freq[i] = theta^(-2i / rotary_dim), computed in fp32 as the model does.
std::vector<float> inv_freq(double theta, int64_t rotary_dim) {
  std::vector<float> f(sz(rotary_dim / 2));
  const float base = static_cast<float>(theta);
  for (int64_t i = 0; i < rotary_dim / 2; ++i)
    f[sz(i)] = 1.0f / std::pow(base, static_cast<float>(2 * i) / static_cast<float>(rotary_dim));
  return f;
}

TEST_F(CudaOps, RopeMatchesCpuOnPartialRotaryAndScatteredPositions) {
  struct Case {
    int64_t tokens, heads, head_dim, rotary_dim;
    double theta;
  };
  // Qwen3.5 full attention: head_dim 256 with rotary_dim 64 (partial_rotary_factor 0.25), 16 query
  // / 4 kv heads; the small model's head_dim 64; full rotary; an odd token count.
  const Case cases[] = {{5, 16, 256, 64, 1e7}, {5, 4, 256, 64, 1e7}, {1, 2, 64, 16, 1e4},
                        {9, 2, 64, 64, 1e4},   {17, 3, 64, 32, 1e6}, {3, 16, 256, 256, 1e7}};
  // Not contiguous, not sorted, repeated, up to 32767.
  const int64_t pos_pool[] = {7, 3,   1000, 0, 4095, 12, 13, 32767, 1,
                              2, 500, 501,  9, 8,    77, 13, 100};
  std::mt19937 rng(61);
  for (const Case& c : cases) {
    std::vector<int64_t> pos(pos_pool, pos_pool + c.tokens);
    const auto freq = inv_freq(c.theta, c.rotary_dim);
    const auto x = randn(sz(c.tokens * c.heads * c.head_dim), rng);
    std::vector<float> want = x;
    cpu::rope(want.data(), c.tokens, c.heads, c.head_dim, c.rotary_dim, pos.data(), freq.data());
    DeviceBuffer<float> dx(x), dfreq(freq);
    DeviceBuffer<int64_t> dpos(pos);
    cuda::rope(dx.get(), c.tokens, c.heads, c.head_dim, c.rotary_dim, dpos.get(), dfreq.get());
    const auto got = dx.download();
    const std::string what = "tokens " + std::to_string(c.tokens) + " heads " +
                             std::to_string(c.heads) + " head_dim " + std::to_string(c.head_dim) +
                             " rotary_dim " + std::to_string(c.rotary_dim);
    EXPECT_TRUE(near_blocks(got, want, sz(c.head_dim), kRopeRel)) << what;
    // The dims past rotary_dim are untouched, bit for bit.
    size_t changed = 0;
    for (int64_t v = 0; v < c.tokens * c.heads; ++v)
      for (int64_t i = c.rotary_dim; i < c.head_dim; ++i) {
        const size_t at = sz(v * c.head_dim + i);
        changed += std::memcmp(&got[at], &x[at], sizeof(float)) != 0;
      }
    EXPECT_EQ(changed, 0u) << what << ": dims past rotary_dim changed";
  }
}

// GLM-5's rotary embedding of a slice of each head: the rope of the attention's [nope | rope]
// heads (offset 192 of 256), the latent cache's rotary key (offset 512 of 576), the indexer's
// leading slice, in both pair layouts; every value outside the slice untouched.
TEST_F(CudaOps, RopeSliceMatchesCpuInBothLayoutsAndTouchesOnlyTheSlice) {
  struct Case {
    int64_t tokens, heads, stride, offset, dim;
  };
  const Case cases[] = {{5, 16, 256, 192, 64},
                        {3, 1, 576, 512, 64},
                        {7, 4, 128, 0, 64},
                        {1, 2, 48, 16, 32},
                        {9, 3, 24, 8, 16}};
  const int64_t pos_pool[] = {7, 3, 1000, 0, 4095, 12, 13, 32767, 1};
  std::mt19937 rng(67);
  for (const Case& c : cases)
    for (bool interleaved : {false, true}) {
      std::vector<int64_t> pos(pos_pool, pos_pool + c.tokens);
      const auto freq = inv_freq(1e4, c.dim);
      const auto x = randn(sz(c.tokens * c.heads * c.stride), rng);
      std::vector<float> want = x;
      cpu::rope_slice(want.data(), c.tokens, c.heads, c.stride, c.offset, c.dim, pos.data(),
                      freq.data(), interleaved);
      DeviceBuffer<float> dx(x), dfreq(freq);
      DeviceBuffer<int64_t> dpos(pos);
      cuda::rope_slice(dx.get(), c.tokens, c.heads, c.stride, c.offset, c.dim, dpos.get(),
                       dfreq.get(), interleaved);
      const auto got = dx.download();
      const std::string what = "stride " + std::to_string(c.stride) + " offset " +
                               std::to_string(c.offset) + " dim " + std::to_string(c.dim) +
                               (interleaved ? " interleaved" : " halves");
      EXPECT_TRUE(near_blocks(got, want, sz(c.stride), kRopeRel)) << what;
      size_t changed = 0;
      for (int64_t v = 0; v < c.tokens * c.heads; ++v)
        for (int64_t i = 0; i < c.stride; ++i) {
          if (i >= c.offset && i < c.offset + c.dim) continue;
          const size_t at = sz(v * c.stride + i);
          changed += std::memcmp(&got[at], &x[at], sizeof(float)) != 0;
        }
      EXPECT_EQ(changed, 0u) << what << ": values outside the slice changed";
    }
  DeviceBuffer<float> dx(std::vector<float>(64, 1.0f));
  EXPECT_THROW(cuda::rope_slice(dx.get(), 1, 1, 64, 40, 32, nullptr, nullptr, false), Error);
  EXPECT_THROW(cuda::rope_slice(dx.get(), 1, 1, 64, 0, 7, nullptr, nullptr, false), Error);
}

// GLM-5's indexer key norm: near the CPU on rows of different scales and offsets, each row's bits
// independent of the rows beside it, in place the same bits.
TEST_F(CudaOps, LayerNormMatchesCpuAndRowsAreIndependent) {
  std::mt19937 rng(71);
  for (int64_t d : {128, 64, 37, 1024}) {
    const F32Weight w = f32_weight(randn(sz(d), rng, 0.2f, 1.0f), 1, d);
    const F32Weight b = f32_weight(randn(sz(d), rng, 0.1f, 0.0f), 1, d);
    const int64_t m = 9;
    auto x = norm_input(m, d, rng);
    for (int64_t r = 0; r < m; ++r)  // a mean well away from 0
      for (int64_t i = 0; i < d; ++i) x[sz(r * d + i)] += static_cast<float>(r) - 4.0f;
    std::vector<float> want(x.size());
    cpu::layer_norm(x.data(), m, d, w.host_ref(), b.host_ref(), 1e-6f, want.data());
    DeviceBuffer<float> dx(x);
    DeviceBuffer<float> dy = nan_buffer(x.size());
    cuda::layer_norm(dx.get(), m, d, w.dev_ref(), b.dev_ref(), 1e-6f, dy.get());
    const auto got = dy.download();
    EXPECT_TRUE(near_blocks(got, want, sz(d), kLayerNormRel)) << "d " << d;
    for (int64_t r : {int64_t(0), int64_t(5)}) {
      DeviceBuffer<float> one = nan_buffer(sz(d));
      cuda::layer_norm(dx.get() + r * d, 1, d, w.dev_ref(), b.dev_ref(), 1e-6f, one.get());
      EXPECT_TRUE(bitwise_equal(one.download(), slice(got, sz(r * d), sz(d))))
          << "row " << r << " alone, d " << d;
    }
    cuda::layer_norm(dx.get(), m, d, w.dev_ref(), b.dev_ref(), 1e-6f, dx.get());
    EXPECT_TRUE(bitwise_equal(dx.download(), got)) << "in place, d " << d;
  }
  const F32Weight w = f32_weight(std::vector<float>(8, 1.0f), 1, 8);
  DeviceBuffer<float> dx(std::vector<float>(8, 1.0f));
  EXPECT_THROW(cuda::layer_norm(dx.get(), 1, 16, w.dev_ref(), w.dev_ref(), 1e-6f, dx.get()), Error);
}

TEST_F(CudaOps, ScaleIsExact) {
  std::mt19937 rng(73);
  const auto x = randn(1000, rng);
  std::vector<float> want = x;
  cpu::scale(want.data(), static_cast<int64_t>(want.size()), 0.125f * 3.0f);
  DeviceBuffer<float> dx(x);
  cuda::scale(dx.get(), static_cast<int64_t>(x.size()), 0.125f * 3.0f);
  EXPECT_TRUE(bitwise_equal(dx.download(), want));
}

// The fused query/key preparation gives the bits of its parts on the GPU (copy_rows, rms_norm,
// rope) and is near the CPU: the 9B attention shape (16 / 4 heads of 256, rotary 64), full and
// no rotary, several tokens at scattered positions.
TEST_F(CudaOps, QkNormRopeIsBitwiseItsParts) {
  struct Case {
    int64_t tokens, heads, kv_heads, head_dim, rotary_dim;
  };
  const Case cases[] = {
      {1, 16, 4, 256, 64}, {5, 16, 4, 256, 64}, {3, 8, 2, 128, 128}, {2, 2, 1, 64, 0}};
  const int64_t pos_pool[] = {511, 3, 1000, 0, 4095};
  std::mt19937 rng(62);
  for (const Case& c : cases) {
    const int64_t T = c.tokens, hd = c.head_dim;
    std::vector<int64_t> pos(pos_pool, pos_pool + T);
    const auto freq = inv_freq(1e7, c.rotary_dim);
    const auto qg = randn(sz(T * c.heads * 2 * hd), rng, 3.0f);
    const auto k = randn(sz(T * c.kv_heads * hd), rng, 3.0f);
    const F32Weight qn = f32_weight(randn(sz(hd), rng, 0.1f), 1, hd);
    const F32Weight kn = f32_weight(randn(sz(hd), rng, 0.1f), 1, hd);
    ops::QkNormRope s;
    s.n_tokens = T;
    s.n_heads = c.heads;
    s.n_kv_heads = c.kv_heads;
    s.head_dim = hd;
    s.rotary_dim = c.rotary_dim;
    DeviceBuffer<float> dqg(qg), dk_fused(k), dk_parts(k),
        dfreq(freq.empty() ? std::vector<float>{0.f} : freq);
    DeviceBuffer<int64_t> dpos(pos);
    DeviceBuffer<float> q_fused = nan_buffer(sz(T * c.heads * hd)),
                        g_fused = nan_buffer(sz(T * c.heads * hd));
    DeviceBuffer<float> q_parts = nan_buffer(sz(T * c.heads * hd)),
                        g_parts = nan_buffer(sz(T * c.heads * hd));
    cuda::qk_norm_rope(s, dqg.get(), qn.dev_ref(), kn.dev_ref(), dpos.get(), dfreq.get(),
                       q_fused.get(), g_fused.get(), dk_fused.get());
    cuda::copy_rows(q_parts.get(), hd, dqg.get(), 2 * hd, T * c.heads, hd);
    cuda::copy_rows(g_parts.get(), hd, dqg.get() + hd, 2 * hd, T * c.heads, hd);
    cuda::rms_norm(q_parts.get(), T * c.heads, hd, qn.dev_ref(), true, s.eps, q_parts.get());
    cuda::rms_norm(dk_parts.get(), T * c.kv_heads, hd, kn.dev_ref(), true, s.eps, dk_parts.get());
    cuda::rope(q_parts.get(), T, c.heads, hd, c.rotary_dim, dpos.get(), dfreq.get());
    cuda::rope(dk_parts.get(), T, c.kv_heads, hd, c.rotary_dim, dpos.get(), dfreq.get());
    const std::string what = "tokens " + std::to_string(T) + " heads " + std::to_string(c.heads) +
                             " head_dim " + std::to_string(hd) + " rotary " +
                             std::to_string(c.rotary_dim);
    const auto qf = q_fused.download(), kf = dk_fused.download();
    EXPECT_TRUE(bitwise_equal(qf, q_parts.download())) << "q, " << what;
    EXPECT_TRUE(bitwise_equal(g_fused.download(), g_parts.download())) << "gate, " << what;
    EXPECT_TRUE(bitwise_equal(kf, dk_parts.download())) << "k, " << what;
    std::vector<float> cq(qf.size()), cg(qf.size()), ck = k;
    ASSERT_EQ(ops::backend(), ops::Backend::Cpu) << "the op tests call the CUDA ops directly";
    ops::qk_norm_rope(s, qg.data(), qn.host_ref(), kn.host_ref(), pos.data(), freq.data(),
                      cq.data(), cg.data(), ck.data());
    EXPECT_TRUE(near_blocks(qf, cq, sz(hd), kRopeRel)) << "q vs CPU, " << what;
    EXPECT_TRUE(near_blocks(kf, ck, sz(hd), kRopeRel)) << "k vs CPU, " << what;
  }
}

// ---------------------------------------------------------------------------------------------
// Paged KV: kv_write + attention
// ---------------------------------------------------------------------------------------------

constexpr int64_t kBlockSize = 16;

// One layer's paged KV pool on host and device, holding the same bytes, and one row's block
// table of shuffled, non-contiguous block ids. Unwritten slots hold large garbage (±1000): an
// attention that reads past its causal prefix gets a visibly wrong answer. T: the stored
// element, float (fp32 KV) or uint16_t (bf16 KV).
template <class T = float>
struct PagedKV {
  static constexpr DType kDType = std::is_same_v<T, float> ? DType::F32 : DType::BF16;
  int64_t n_kv_heads = 0, head_dim = 0, n_blocks = 0;
  std::vector<T> host;
  DeviceBuffer<T> dev;
  std::vector<int32_t> table;
  DeviceBuffer<int32_t> dev_table;
  ops::KVLayerView host_view() { return {host.data(), kBlockSize, n_kv_heads, head_dim, kDType}; }
  ops::KVLayerView dev_view() const {
    return {dev.get(), kBlockSize, n_kv_heads, head_dim, kDType};
  }
  int64_t row() const { return n_kv_heads * head_dim; }
};

template <class T = float>
PagedKV<T> make_paged_kv(int64_t len, int64_t n_kv_heads, int64_t head_dim, std::mt19937& rng) {
  PagedKV<T> kv;
  kv.n_kv_heads = n_kv_heads;
  kv.head_dim = head_dim;
  const int64_t used = std::max<int64_t>(1, (len + kBlockSize - 1) / kBlockSize);
  kv.n_blocks = used + 5;
  std::vector<int32_t> ids(sz(kv.n_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  kv.table.assign(ids.begin(), ids.begin() + used);
  if (used >= 2 && kv.table[1] == kv.table[0] + 1) std::swap(kv.table[0], kv.table[1]);
  const auto garbage =
      uniform(sz(kv.n_blocks * 2 * kBlockSize * n_kv_heads * head_dim), rng, -1000.0f, 1000.0f);
  if constexpr (std::is_same_v<T, float>) {
    kv.host = garbage;
  } else {
    for (const float x : garbage) kv.host.push_back(f32_to_bf16(x));
  }
  kv.dev = DeviceBuffer<T>(kv.host);
  kv.dev_table = DeviceBuffer<int32_t>(kv.table);
  return kv;
}

// Positions from..to-1 on the host, and the same array on the device (kv_write and attention
// read positions from backend memory).
std::vector<int64_t> position_range(int64_t from, int64_t to) {
  std::vector<int64_t> pos(sz(std::max<int64_t>(0, to - from)));
  std::iota(pos.begin(), pos.end(), from);
  return pos;
}

// Writes the k, v rows of `pos` on both sides: token j of the call is the row of position
// pos[j] (k, v hold one row per position 0..len-1).
template <class T>
void write_kv(PagedKV<T>& kv, const std::vector<float>& k, const std::vector<float>& v,
              const std::vector<int64_t>& pos) {
  if (pos.empty()) return;
  std::vector<float> kj, vj;
  for (const int64_t p : pos) {
    kj.insert(kj.end(), k.begin() + p * kv.row(), k.begin() + (p + 1) * kv.row());
    vj.insert(vj.end(), v.begin() + p * kv.row(), v.begin() + (p + 1) * kv.row());
  }
  const int64_t n = static_cast<int64_t>(pos.size());
  cpu::kv_write(kv.host_view(), kv.table.data(), pos.data(), n, kj.data(), vj.data());
  const DeviceBuffer<float> dk(kj), dv(vj);
  const DeviceBuffer<int64_t> dpos(pos);
  cuda::kv_write(kv.dev_view(), kv.dev_table.get(), dpos.get(), n, dk.get(), dv.get());
}

// qk_norm_rope with a KV target writes the very words its keys and kv_write would: the pool
// after the fused pass equals the pool after qk_norm_rope + kv_write, on the device bitwise and
// on the host too (same slots, negative ones skipped), and the keys in k are unchanged by it.
TEST_F(CudaOps, QkNormRopeWritesTheKVOfKvWrite) {
  std::mt19937 rng(63);
  const int64_t T = 5, nh = 16, nkv = 4, hd = 256, rot = 64;
  const std::vector<int64_t> pos = {40, 41, 17, 3, 63};
  PagedKV<> fused = make_paged_kv(64, nkv, hd, rng);
  PagedKV<> parts;
  parts.n_kv_heads = nkv;
  parts.head_dim = hd;
  parts.n_blocks = fused.n_blocks;
  parts.host = fused.host;
  parts.table = fused.table;
  parts.dev = DeviceBuffer<float>(parts.host);
  parts.dev_table = DeviceBuffer<int32_t>(parts.table);
  std::vector<int64_t> slots;
  for (const int64_t p : pos)
    slots.push_back(int64_t{fused.table[sz(p / kBlockSize)]} * kBlockSize + p % kBlockSize);
  slots[2] = -1;  // no write for this token
  const auto freq = inv_freq(1e7, rot);
  const auto qg = randn(sz(T * nh * 2 * hd), rng, 3.0f);
  const auto k = randn(sz(T * nkv * hd), rng, 3.0f);
  const auto v = randn(sz(T * nkv * hd), rng, 3.0f);
  const F32Weight qn = f32_weight(randn(sz(hd), rng, 0.1f), 1, hd);
  const F32Weight kn = f32_weight(randn(sz(hd), rng, 0.1f), 1, hd);
  ops::QkNormRope s{
      .n_tokens = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .rotary_dim = rot};
  DeviceBuffer<float> dqg(qg), dk_fused(k), dk_parts(k), dv(v), dfreq(freq);
  DeviceBuffer<int64_t> dpos(pos), dslots(slots);
  DeviceBuffer<float> q1 = nan_buffer(sz(T * nh * hd)), g1 = nan_buffer(sz(T * nh * hd));
  DeviceBuffer<float> q2 = nan_buffer(sz(T * nh * hd)), g2 = nan_buffer(sz(T * nh * hd));
  cuda::qk_norm_rope(s, dqg.get(), qn.dev_ref(), kn.dev_ref(), dpos.get(), dfreq.get(), q2.get(),
                     g2.get(), dk_parts.get());
  // kv_write for every token but the skipped one, one call per token (its own position).
  const auto kp = dk_parts.download();
  for (int64_t t = 0; t < T; ++t) {
    if (slots[sz(t)] < 0) continue;
    const DeviceBuffer<int64_t> p1(std::vector<int64_t>{pos[sz(t)]});
    cuda::kv_write(parts.dev_view(), parts.dev_table.get(), p1.get(), 1,
                   dk_parts.get() + t * nkv * hd, dv.get() + t * nkv * hd);
  }
  const ops::KVLayerView view = fused.dev_view();
  s.kv = &view;
  s.kv_slots = dslots.get();
  s.v = dv.get();
  cuda::qk_norm_rope(s, dqg.get(), qn.dev_ref(), kn.dev_ref(), dpos.get(), dfreq.get(), q1.get(),
                     g1.get(), dk_fused.get());
  EXPECT_TRUE(bitwise_equal(dk_fused.download(), kp)) << "k";
  EXPECT_TRUE(bitwise_equal(q1.download(), q2.download())) << "q";
  const auto pool = fused.dev.download();
  EXPECT_TRUE(bitwise_equal(pool, parts.dev.download())) << "KV pool";
  // The host op: the same slots, from its own keys.
  ASSERT_EQ(ops::backend(), ops::Backend::Cpu) << "the op tests call the CUDA ops directly";
  std::vector<float> cq(sz(T * nh * hd)), cg(cq.size()), ck = k;
  const ops::KVLayerView host_view = fused.host_view();
  s.kv = &host_view;
  s.kv_slots = slots.data();
  s.v = v.data();
  ops::qk_norm_rope(s, qg.data(), qn.host_ref(), kn.host_ref(), pos.data(), freq.data(), cq.data(),
                    cg.data(), ck.data());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = pos[sz(t)], row = nkv * hd;
    const int32_t block = fused.table[sz(p / kBlockSize)];
    const auto* hk = reinterpret_cast<const float*>(host_view.key(block, p % kBlockSize));
    const auto* hv = reinterpret_cast<const float*>(host_view.value(block, p % kBlockSize));
    const float* dvp = pool.data() + (hv - fused.host.data());
    if (slots[sz(t)] < 0) continue;
    EXPECT_TRUE(std::equal(hv, hv + row, v.begin() + t * row)) << "host value row " << t;
    EXPECT_TRUE(std::equal(hk, hk + row, ck.begin() + t * row)) << "host key row " << t;
    EXPECT_TRUE(std::equal(dvp, dvp + row, v.begin() + t * row)) << "device value row " << t;
  }
}

// Fixes how many of a row's queries an attention block serves (cuda::set_attention_runs) for a
// scope; back to the grid's choice after it.
struct AttentionRuns {
  explicit AttentionRuns(int most) { cuda::set_attention_runs(most); }
  ~AttentionRuns() { cuda::set_attention_runs(0); }
  AttentionRuns(const AttentionRuns&) = delete;
  AttentionRuns& operator=(const AttentionRuns&) = delete;
};

// cuda::attention of queries q [pos.size(), n_heads, head_dim] at positions `pos`.
template <class T>
std::vector<float> cuda_attention(const PagedKV<T>& kv, const std::vector<int64_t>& pos,
                                  int64_t bound, const std::vector<float>& q, int64_t n_heads,
                                  float scale) {
  const DeviceBuffer<float> dq(q);
  const DeviceBuffer<int64_t> dpos(pos);
  DeviceBuffer<float> out = nan_buffer(q.size());
  cuda::attention(kv.dev_view(), kv.dev_table.get(), dpos.get(), static_cast<int64_t>(pos.size()),
                  bound, dq.get(), n_heads, scale, out.get());
  return out.download();
}

struct AttnCase {
  int64_t n_heads, n_kv_heads, head_dim, start, n;
  float sharpness;    // multiplies the softmax scale; != 1 also plants a huge score (see below)
  int64_t bound = 0;  // position_bound; 0: start + n, the tightest
};
void PrintTo(const AttnCase& c, std::ostream* os) {
  *os << "heads " << c.n_heads << "/" << c.n_kv_heads << " head_dim " << c.head_dim << " start "
      << c.start << " n " << c.n << " sharpness " << c.sharpness << " bound " << c.bound;
}
std::string attn_name(const ::testing::TestParamInfo<AttnCase>& p) {
  const AttnCase& c = p.param;
  return "H" + std::to_string(c.n_heads) + "_KV" + std::to_string(c.n_kv_heads) + "_D" +
         std::to_string(c.head_dim) + "_start" + std::to_string(c.start) + "_n" +
         std::to_string(c.n) + (c.sharpness != 1.0f ? "_sharp" : "") +
         (c.bound != 0 ? "_bound" + std::to_string(c.bound) : "");
}

using CudaAttention = CudaParamTest<AttnCase>;

// kv_write on both backends leaves the same pool bits, and attention matches the CPU op; the
// output gate gives the ungated bits followed by sigmoid_gate. T: the KV's stored element.
template <class T>
void check_kv_write_and_attention(const AttnCase& c) {
  std::mt19937 rng(static_cast<uint32_t>(71 + c.start * 13 + c.n + c.head_dim));
  const int64_t len = c.start + c.n;
  const int64_t bound = c.bound != 0 ? c.bound : len;
  PagedKV<T> kv = make_paged_kv<T>(len, c.n_kv_heads, c.head_dim, rng);
  const auto k = randn(sz(len * kv.row()), rng);
  const auto v = randn(sz(len * kv.row()), rng);
  auto q = randn(sz(c.n * c.n_heads * c.head_dim), rng);
  if (c.sharpness != 1.0f) {
    // Query 0 of every head points along the key of position start / 2: a score of 1000-2000, so
    // exp() overflows unless the kernel subtracts the running max.
    const int64_t p = c.start / 2, group = c.n_heads / c.n_kv_heads;
    for (int64_t h = 0; h < c.n_heads; ++h)
      for (int64_t i = 0; i < c.head_dim; ++i)
        q[sz(h * c.head_dim + i)] = 4.0f * k[sz((p * c.n_kv_heads + h / group) * c.head_dim + i)];
  }
  // The cached prefix in two writes (the second starting mid-block), then the new tokens with
  // their positions in reverse order (a write goes where positions[j] says, not to slot j).
  write_kv(kv, k, v, position_range(0, c.start / 2));
  write_kv(kv, k, v, position_range(c.start / 2, c.start));
  std::vector<int64_t> fresh = position_range(c.start, len);
  std::reverse(fresh.begin(), fresh.end());
  write_kv(kv, k, v, fresh);
  EXPECT_TRUE(bitwise_equal(kv.dev.download(), kv.host))
      << "KV pools differ after kv_write (wrong slot, block or extra writes)";

  const float scale = c.sharpness / std::sqrt(static_cast<float>(c.head_dim));
  const std::vector<int64_t> pos = position_range(c.start, len);
  std::vector<float> want(q.size());
  cpu::attention(kv.host_view(), kv.table.data(), pos.data(), c.n, bound, q.data(), c.n_heads,
                 scale, want.data());
  const std::vector<float> got = cuda_attention(kv, pos, bound, q, c.n_heads, scale);
  // bf16 KV: the CPU's widening is exact, so both sides attend over the same values.
  EXPECT_TRUE(near_blocks(got, want, sz(c.head_dim), kAttnRel));

  // With the output gate: the bits of the ungated result followed by sigmoid_gate.
  const DeviceBuffer<float> dq(q), gate(randn(q.size(), rng, 3.0f));
  const DeviceBuffer<int64_t> dpos(pos);
  DeviceBuffer<float> gated = nan_buffer(q.size()), want_gated(got);
  cuda::sigmoid_gate(want_gated.get(), gate.get(), static_cast<int64_t>(q.size()));
  cuda::attention(kv.dev_view(), kv.dev_table.get(), dpos.get(), c.n, bound, dq.get(), c.n_heads,
                  scale, gated.get(), gate.get());
  EXPECT_TRUE(bitwise_equal(gated.download(), want_gated.download())) << "with the output gate";
}

TEST_P(CudaAttention, KvWriteAndAttentionMatchCpu) {
  check_kv_write_and_attention<float>(GetParam());
}

TEST_P(CudaAttention, Bf16KvWriteAndAttentionMatchCpu) {
  check_kv_write_and_attention<uint16_t>(GetParam());
}

// kv_write_stored: bf16 rows saved from one pool and restored into other blocks of another are
// the same bits, and attention over them is bitwise the original's.
TEST_F(CudaOps, KvWriteStoredRestoresTheSavedBf16Bits) {
  std::mt19937 rng(77);
  const int64_t nh = 16, nkv = 4, hd = 256, len = 37;
  PagedKV<uint16_t> a = make_paged_kv<uint16_t>(len, nkv, hd, rng);
  PagedKV<uint16_t> b = make_paged_kv<uint16_t>(len, nkv, hd, rng);
  const auto k = randn(sz(len * a.row()), rng), v = randn(sz(len * a.row()), rng);
  const auto pos = position_range(0, len);
  write_kv(a, k, v, pos);
  std::vector<uint16_t> keys, values;  // the saved rows, position order
  for (const int64_t p : pos) {
    const size_t at =
        sz(((int64_t{a.table[sz(p / kBlockSize)]} * 2) * kBlockSize + p % kBlockSize) * a.row());
    keys.insert(keys.end(), a.host.begin() + at, a.host.begin() + at + sz(a.row()));
    values.insert(values.end(), a.host.begin() + at + sz(kBlockSize * a.row()),
                  a.host.begin() + at + sz((kBlockSize + 1) * a.row()));
  }
  const DeviceBuffer<uint16_t> dk(keys), dv(values);
  const DeviceBuffer<int64_t> dpos(pos);
  cuda::kv_write_stored(b.dev_view(), b.dev_table.get(), dpos.get(), len, dk.get(), dv.get());
  cpu::kv_write_stored(b.host_view(), b.table.data(), pos.data(), len, keys.data(), values.data());
  EXPECT_TRUE(bitwise_equal(b.dev.download(), b.host)) << "pools after kv_write_stored";
  const auto q = randn(sz(4 * nh * hd), rng);
  const std::vector<int64_t> last = position_range(len - 4, len);
  EXPECT_TRUE(bitwise_equal(cuda_attention(b, last, len, q, nh, 0.0625f),
                            cuda_attention(a, last, len, q, nh, 0.0625f)));
}

// GQA 16 query / 4 kv heads at head_dim 256, 24 / 4 (groups of 6: chunks of 2 heads), 8 / 2 and
// 2 / 2 at head_dim 64 and 2 / 1 at head_dim 96 (a partial float4 row per lane); start 0,
// mid-block, crossing a block boundary, exactly on one, every partition size up to 128
// positions (512, 1000, 4000, 9000 cross the 32 → 64 → 128 → 256 steps), n in {1, 4, 9}; a prefill
// of 300 queries under a bound so loose that the partial buffer cuts it into many launches.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttention,
    ::testing::Values(AttnCase{16, 4, 256, 0, 1, 1}, AttnCase{16, 4, 256, 0, 9, 1},
                      AttnCase{16, 4, 256, 5, 4, 1}, AttnCase{16, 4, 256, 15, 4, 1},
                      AttnCase{16, 4, 256, 37, 9, 1}, AttnCase{16, 4, 256, 40, 4, 30},
                      AttnCase{16, 4, 256, 508, 9, 1, 1024}, AttnCase{16, 4, 256, 1000, 4, 1},
                      AttnCase{16, 4, 256, 4000, 1, 1}, AttnCase{16, 4, 256, 4000, 8, 30, 4096},
                      AttnCase{16, 4, 256, 9000, 1, 1, 9216}, AttnCase{24, 4, 256, 300, 4, 1},
                      AttnCase{8, 2, 256, 3, 9, 1}, AttnCase{2, 2, 64, 0, 1, 1},
                      AttnCase{2, 2, 64, 16, 1, 1}, AttnCase{2, 2, 64, 31, 4, 1},
                      AttnCase{2, 2, 64, 7, 9, 30}, AttnCase{2, 2, 64, 100, 9, 1},
                      AttnCase{2, 1, 96, 70, 4, 1}, AttnCase{16, 4, 256, 0, 300, 1, 200000}),
    attn_name);

using CudaAttentionBounds = CudaTest;

// A position at or past position_bound is the caller's bug: the kernel writes NaN for that query
// (never a partial answer), leaves the other queries right, and the next call is unaffected (no
// partition counter left behind).
TEST_F(CudaAttentionBounds, PositionPastTheBoundGivesNanAndLeavesNoTrace) {
  std::mt19937 rng(97);
  const int64_t nh = 16, nkv = 4, hd = 256, len = 700;
  PagedKV kv = make_paged_kv(len, nkv, hd, rng);
  const auto k = randn(sz(len * kv.row()), rng), v = randn(sz(len * kv.row()), rng);
  write_kv(kv, k, v, position_range(0, len));
  const auto q = randn(sz(2 * nh * hd), rng);
  const float scale = 1.0f / 16.0f;
  const std::vector<int64_t> pos = {650, 699};
  const auto got = cuda_attention(kv, pos, 680, q, nh, scale);  // 699 is past the bound
  const auto good = cuda_attention(kv, pos, 700, q, nh, scale);
  EXPECT_TRUE(bitwise_equal(slice(got, 0, sz(nh * hd)), slice(good, 0, sz(nh * hd))))
      << "the in-bound query changed";
  size_t nans = 0;
  for (size_t i = sz(nh * hd); i < got.size(); ++i) nans += std::isnan(got[i]) ? 1 : 0;
  EXPECT_EQ(nans, sz(nh * hd)) << "the out-of-bound query must be all NaN";
  std::vector<float> want(q.size());
  cpu::attention(kv.host_view(), kv.table.data(), pos.data(), 2, 700, q.data(), nh, scale,
                 want.data());
  EXPECT_TRUE(near_blocks(cuda_attention(kv, pos, 700, q, nh, scale), want, sz(hd), kAttnRel))
      << "a call after the bad one";
}

// ---------------------------------------------------------------------------------------------
// causal_conv_silu
// ---------------------------------------------------------------------------------------------

constexpr int64_t kConvKernel = 4;

struct ConvCase {
  int64_t channels, n;
};
void PrintTo(const ConvCase& c, std::ostream* os) {
  *os << "channels " << c.channels << " n " << c.n;
}
using ConvParam = std::tuple<ConvCase, bool>;  // with state_after
std::string conv_name(const ::testing::TestParamInfo<ConvParam>& p) {
  const ConvCase c = std::get<0>(p.param);
  return "C" + std::to_string(c.channels) + "_n" + std::to_string(c.n) +
         (std::get<1>(p.param) ? "_state_after" : "_no_state_after");
}

using CudaConv = CudaParamTest<ConvParam>;

TEST_P(CudaConv, MatchesCpu) {
  const auto [c, with_after] = GetParam();
  const int64_t C = c.channels, n = c.n, hist = kConvKernel - 1;
  std::mt19937 rng(static_cast<uint32_t>(81 + C + n));
  const F32Weight w = f32_weight(randn(sz(C * kConvKernel), rng, 0.5f), C, kConvKernel);
  const auto x = randn(sz(n * C), rng);
  const auto state0 = randn(sz(C * hist), rng);  // a carried-over state, not zeros

  std::vector<float> st = state0, want(sz(n * C)), after(with_after ? sz(n * C * hist) : 0);
  cpu::causal_conv_silu(x.data(), n, C, kConvKernel, w.host_ref(), st.data(), want.data(),
                        with_after ? after.data() : nullptr);

  DeviceBuffer<float> dx(x), dst(state0);
  DeviceBuffer<float> dout = nan_buffer(sz(n * C));
  DeviceBuffer<float> dafter = nan_buffer(after.size());
  cuda::causal_conv_silu(dx.get(), n, C, kConvKernel, w.dev_ref(), dst.get(), dout.get(),
                         with_after ? dafter.get() : nullptr);
  EXPECT_TRUE(near_blocks(dout.download(), want, sz(C), kConvRel)) << "out";
  // The state is a window of past inputs: exact.
  EXPECT_TRUE(bitwise_equal(dst.download(), st)) << "final state";
  if (with_after) {
    EXPECT_TRUE(bitwise_equal(dafter.download(), after)) << "state_after";
  }
}

// DeltaNet conv channels: 2·16·128 + 32·128 = 8192 and 2·8·128 + 16·128 = 4096; odd ones.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaConv,
                         ::testing::Combine(::testing::Values(ConvCase{8192, 1}, ConvCase{8192, 9},
                                                              ConvCase{4096, 3}, ConvCase{4096, 17},
                                                              ConvCase{37, 9}, ConvCase{1, 5}),
                                            ::testing::Bool()),
                         conv_name);

// ---------------------------------------------------------------------------------------------
// gated_delta_rule
// ---------------------------------------------------------------------------------------------

constexpr int64_t kDeltaDim = 128;  // dk = dv = 128 in every Qwen3.5 model

struct DeltaInputs {
  ops::DeltaHeads h;
  int64_t n;
  std::vector<float> q, k, v, a, b, state0;
  F32Weight A_log, dt_bias;
  DeviceBuffer<float> dq, dk, dv, da, db;

  size_t state_size() const { return sz(h.n_v_heads * h.dk * h.dv); }
  size_t out_size() const { return sz(n * h.n_v_heads * h.dv); }
  int64_t qk_row() const { return h.n_k_heads * h.dk; }
  int64_t v_row() const { return h.n_v_heads * h.dv; }
};

DeltaInputs delta_inputs(int64_t n_k_heads, int64_t n_v_heads, int64_t n, std::mt19937& rng) {
  DeltaInputs in;
  in.h = {n_k_heads, n_v_heads, kDeltaDim, kDeltaDim};
  in.n = n;
  in.q = randn(sz(n * in.qk_row()), rng);
  in.k = randn(sz(n * in.qk_row()), rng);
  in.v = randn(sz(n * in.v_row()), rng);
  in.a = randn(sz(n * n_v_heads), rng, 2.0f);
  in.b = randn(sz(n * n_v_heads), rng, 2.0f);
  // The softplus saturation branch (a + dt_bias > 20) and near-zero decay.
  in.a[0] = 30.0f;
  if (in.a.size() > 1) in.a[1] = -30.0f;
  in.state0 = randn(in.state_size(), rng, 0.1f);
  // As the random-model generator draws them: A_log in [0, 2.7], dt_bias in [0.5, 1.5].
  in.A_log = f32_weight(uniform(sz(n_v_heads), rng, 0.0f, 2.7f), 1, n_v_heads);
  in.dt_bias = f32_weight(uniform(sz(n_v_heads), rng, 0.5f, 1.5f), 1, n_v_heads);
  in.dq = DeviceBuffer<float>(in.q);
  in.dk = DeviceBuffer<float>(in.k);
  in.dv = DeviceBuffer<float>(in.v);
  in.da = DeviceBuffer<float>(in.a);
  in.db = DeviceBuffer<float>(in.b);
  return in;
}

// cuda::gated_delta_rule on tokens [t0, t0 + count) of the inputs.
void cuda_delta(const DeltaInputs& in, int64_t t0, int64_t count, float* state, float* out,
                float* state_after) {
  cuda::gated_delta_rule(in.dq.get() + t0 * in.qk_row(), in.dk.get() + t0 * in.qk_row(),
                         in.dv.get() + t0 * in.v_row(), in.da.get() + t0 * in.h.n_v_heads,
                         in.db.get() + t0 * in.h.n_v_heads, in.A_log.dev_ref(),
                         in.dt_bias.dev_ref(), count, in.h, state, out, state_after);
}

struct DeltaCase {
  int64_t n_k_heads, n_v_heads, n;
};
void PrintTo(const DeltaCase& c, std::ostream* os) {
  *os << "key heads " << c.n_k_heads << " value heads " << c.n_v_heads << " n " << c.n;
}
using DeltaParam = std::tuple<DeltaCase, bool>;  // with state_after
std::string delta_name(const ::testing::TestParamInfo<DeltaParam>& p) {
  const DeltaCase c = std::get<0>(p.param);
  return "K" + std::to_string(c.n_k_heads) + "_V" + std::to_string(c.n_v_heads) + "_n" +
         std::to_string(c.n) + (std::get<1>(p.param) ? "_state_after" : "_no_state_after");
}

using CudaDelta = CudaParamTest<DeltaParam>;

TEST_P(CudaDelta, MatchesCpu) {
  const auto [c, with_after] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(91 + c.n_v_heads * 5 + c.n));
  const DeltaInputs in = delta_inputs(c.n_k_heads, c.n_v_heads, c.n, rng);
  const size_t S = in.state_size();

  std::vector<float> st = in.state0, want(in.out_size()), after(with_after ? S * sz(c.n) : 0);
  cpu::gated_delta_rule(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(),
                        in.A_log.host_ref(), in.dt_bias.host_ref(), c.n, in.h, st.data(),
                        want.data(), with_after ? after.data() : nullptr);

  DeviceBuffer<float> dst(in.state0);
  DeviceBuffer<float> dout = nan_buffer(in.out_size());
  DeviceBuffer<float> dafter = nan_buffer(after.size());
  cuda_delta(in, 0, c.n, dst.get(), dout.get(), with_after ? dafter.get() : nullptr);
  const size_t head = sz(kDeltaDim * kDeltaDim);
  EXPECT_TRUE(near_blocks(dout.download(), want, sz(kDeltaDim), kDeltaRel)) << "out";
  EXPECT_TRUE(near_blocks(dst.download(), st, head, kDeltaRel)) << "final state";
  if (with_after) {
    EXPECT_TRUE(near_blocks(dafter.download(), after, head, kDeltaRel)) << "state_after";
  }
}

// 16 key / 32 value heads and 8 / 16 (the two model sizes), 2 / 2 (no grouping), 1 / 4.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaDelta,
    ::testing::Combine(::testing::Values(DeltaCase{16, 32, 1}, DeltaCase{16, 32, 3},
                                         DeltaCase{16, 32, 9}, DeltaCase{8, 16, 1},
                                         DeltaCase{8, 16, 4}, DeltaCase{8, 16, 17},
                                         DeltaCase{2, 2, 5}, DeltaCase{1, 4, 3}),
                       ::testing::Bool()),
    delta_name);

// ---------------------------------------------------------------------------------------------
// copy_rows
// ---------------------------------------------------------------------------------------------

TEST_F(CudaOps, CopyRowsIsStridedAndExact) {
  struct Case {
    int64_t rows, cols, src_stride, dst_stride, src_offset, dst_offset;
  };
  const Case cases[] = {{1, 1024, 1024, 1024, 0, 0}, {17, 20, 37, 21, 0, 0},
                        {5, 128, 4096, 128, 256, 0}, {3, 1, 1, 5, 0, 2},
                        {100, 256, 512, 300, 7, 33}, {33, 4096, 4096, 8192, 0, 4096}};
  std::mt19937 rng(101);
  for (const Case& c : cases) {
    const size_t src_n = sz(c.src_offset + (c.rows - 1) * c.src_stride + c.cols);
    const size_t dst_n = sz(c.dst_offset + (c.rows - 1) * c.dst_stride + c.cols + 3);
    const auto src = randn(src_n, rng);
    std::vector<float> want = uniform(dst_n, rng, 100.0f, 200.0f);  // sentinel: must survive
    DeviceBuffer<float> dsrc(src), ddst(want);
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t i = 0; i < c.cols; ++i)
        want[sz(c.dst_offset + r * c.dst_stride + i)] =
            src[sz(c.src_offset + r * c.src_stride + i)];
    cuda::copy_rows(ddst.get() + c.dst_offset, c.dst_stride, dsrc.get() + c.src_offset,
                    c.src_stride, c.rows, c.cols);
    EXPECT_TRUE(bitwise_equal(ddst.download(), want))
        << "rows " << c.rows << " cols " << c.cols << " strides " << c.src_stride << " -> "
        << c.dst_stride;
  }
}

// ---------------------------------------------------------------------------------------------
// Empty calls and dtype checks
// ---------------------------------------------------------------------------------------------

TEST_F(CudaOps, ZeroSizedCallsAreNoOps) {
  std::mt19937 rng(111);
  const auto sentinel = randn(64, rng);
  DeviceBuffer<float> y(sentinel), x(sentinel);
  DeviceBuffer<uint16_t> w(std::vector<uint16_t>(64 * 64, f32_to_bf16(1.0f)));
  const F32Weight nw = f32_weight(std::vector<float>(64, 1.0f), 1, 64);
  EXPECT_NO_THROW(cuda::linear(x.get(), 0, {DType::BF16, w.get(), 64, 64, {}}, y.get()));
  EXPECT_NO_THROW(cuda::rms_norm(x.get(), 0, 64, nw.dev_ref(), true, 1e-6f, y.get()));
  EXPECT_NO_THROW(cuda::swiglu(x.get(), x.get(), 0, y.get()));
  EXPECT_NO_THROW(cuda::sigmoid_gate(y.get(), x.get(), 0));
  EXPECT_NO_THROW(cuda::add_inplace(y.get(), x.get(), 0));
  EXPECT_NO_THROW(cuda::copy_rows(y.get(), 64, x.get(), 64, 0, 64));
  EXPECT_NO_THROW(cuda::synchronize()) << "an empty call launched an invalid kernel";
  EXPECT_TRUE(bitwise_equal(y.download(), sentinel)) << "an empty call wrote its output";
}

TEST_F(CudaOps, VectorOpsRejectNonF32Weights) {
  DeviceBuffer<float> x(4 * 64), y(4 * 64);
  cuda::fill_zero(x.get(), x.bytes());
  DeviceBuffer<uint16_t> w(std::vector<uint16_t>(64, f32_to_bf16(1.0f)));
  try {
    cuda::rms_norm(x.get(), 4, 64, {DType::BF16, w.get(), 1, 64, {}}, false, 1e-6f, y.get());
    ADD_FAILURE() << "rms_norm accepted a BF16 weight";
  } catch (const tandem::Error& e) {
    EXPECT_TRUE(contains_nocase(e.what(), "F32")) << "error does not name the dtype: " << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Batch invariance, bitwise (DESIGN.md principle 2)
// ---------------------------------------------------------------------------------------------

// (a) linear: each of 37 rows alone, in chunks of 5 and of 16, in the 37-row call and in a
// 100-row call gives the same bits.
using CudaLinearInvariance = CudaParamTest<LinearShape>;

TEST_P(CudaLinearInvariance, RowsAreBitwiseIndependentOfTheBatch) {
  const auto [n, k] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(2000 + 7 * n + k));
  const Bf16Matrix w = bf16_matrix(n, k, rng);
  const int64_t m = 37, big = 100;
  const auto x = randn(sz(big * k), rng);
  const DeviceBuffer<float> dx(x);
  const auto all = cuda_linear(dx, 0, m, w);
  // Bitwise equality of garbage proves nothing: the reference call must be right first.
  ASSERT_TRUE(near_blocks(all, cpu_linear_bf16(x, m, w), sz(n), kLinearRel));
  for (int64_t i = 0; i < m; ++i)
    EXPECT_TRUE(bitwise_equal(cuda_linear(dx, i, 1, w), slice(all, sz(i * n), sz(n))))
        << "row " << i << " alone vs in a batch of " << m;
  for (int64_t chunk : {5, 16})
    for (int64_t r0 = 0; r0 < m; r0 += chunk) {
      const int64_t cnt = std::min(chunk, m - r0);
      EXPECT_TRUE(bitwise_equal(cuda_linear(dx, r0, cnt, w), slice(all, sz(r0 * n), sz(cnt * n))))
          << "rows " << r0 << ".." << r0 + cnt - 1 << " (chunks of " << chunk << ")";
    }
  const auto hundred = cuda_linear(dx, 0, big, w);
  EXPECT_TRUE(bitwise_equal(slice(hundred, 0, sz(m * n)), all)) << "first 37 rows of m = 100";
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLinearInvariance,
                         ::testing::Values(LinearShape{1000, 4096}, LinearShape{4096, 1024},
                                           LinearShape{1024, 1024}, LinearShape{20, 384},
                                           LinearShape{3, 1024}, LinearShape{64, 12288}),
                         linear_name);

using CudaBatchInvariance = CudaTest;

// (b) attention: a row's 8 queries in one call, one call each, and 3 + 5, give the same bits
// (the KV of all 8 positions is written first); so do the 8 in shuffled order, and calls under
// other position bounds (a bound sizes the grid and scratch only, which a graph captured at one
// bound and replayed at later positions relies on).
// attention_rows: the queries of several rows (different lengths, windows, block tables; one
// row skipped) in one launch give bitwise what each row's attention() call gives alone, with and
// without the output gate, and match the CPU op; a skipped query's output is left untouched.
// So under every window hint and with blocks serving 1, 2 or 4 queries (or as many as the grid
// takes), for ragged windows (a group of queries then spans rows) and equal ones (a block serves
// one row's window).
// The many-row products (17..32 rows: linear_ring.cu; more: linear_tiles.cu) against one row at
// a time (the register kernel of linear.cu): a row's outputs are the same bits in a call of 1 row
// and of 17..200, for narrow weights (K split 8 ways) and wide ones (4 ways), K with a partial
// last chunk (1040) and K under one chunk per split (48), N off the 128-column tile; then the MLP
// (SwiGLU epilogue, bf16 activations, the residual added in the down projection's epilogue) with
// and without its norm.
TEST_F(CudaBatchInvariance, ManyRowProductsEqualSingleRowCalls) {
  std::mt19937 rng(91);
  const int64_t max_m = 200;
  for (const LinearShape s : {LinearShape{1000, 4096}, LinearShape{8200, 1040},
                              LinearShape{272, 48}, LinearShape{384, 12288}}) {
    const Bf16Matrix w = bf16_matrix(s.n, s.k, rng);
    const DeviceBuffer<float> dx(randn(sz(max_m * s.k), rng));
    std::vector<float> alone(sz(max_m * s.n));
    for (int64_t r = 0; r < max_m; ++r) {
      const std::vector<float> y = cuda_linear(dx, r, 1, w);
      std::copy(y.begin(), y.end(), alone.begin() + r * s.n);
    }
    for (int64_t m : {17, 24, 32, 33, 64, 65, 128, 129, 200})
      EXPECT_TRUE(bitwise_equal(cuda_linear(dx, 0, m, w), slice(alone, 0, sz(m * s.n))))
          << "N " << s.n << " K " << s.k << " m " << m;
  }
  struct MlpShape {
    int64_t h, I;
  };
  for (const MlpShape s : {MlpShape{1024, 4160}, MlpShape{384, 768}}) {
    const Bf16Matrix gate_up = bf16_matrix(2 * s.I, s.h, rng), down = bf16_matrix(s.h, s.I, rng);
    const F32Weight nw = f32_weight(randn(sz(s.h), rng, 0.1f), 1, s.h);
    const ops::RowNorm norm{nw.dev_ref(), true, 1e-6f};
    const int64_t rows = 100;
    const std::vector<float> x = norm_input(rows, s.h, rng);
    for (const ops::RowNorm* n : {static_cast<const ops::RowNorm*>(nullptr), &norm}) {
      std::vector<float> alone(x.size());
      for (int64_t r = 0; r < rows; ++r) {
        DeviceBuffer<float> y(slice(x, sz(r * s.h), sz(s.h)));
        cuda::swiglu_mlp_add(y.get(), 1, gate_up.dev_ref(), down.dev_ref(), y.get(), n);
        const std::vector<float> got = y.download();
        std::copy(got.begin(), got.end(), alone.begin() + r * s.h);
      }
      for (int64_t m : {17, 32, 40, 100}) {
        DeviceBuffer<float> y(slice(x, 0, sz(m * s.h)));
        cuda::swiglu_mlp_add(y.get(), m, gate_up.dev_ref(), down.dev_ref(), y.get(), n);
        EXPECT_TRUE(bitwise_equal(y.download(), slice(alone, 0, sz(m * s.h))))
            << "H " << s.h << " I " << s.I << " m " << m << " norm " << (n != nullptr);
      }
    }
  }
}

void attention_rows_equal_each_row_alone(const std::vector<int64_t>& lens,
                                         const std::vector<int64_t>& wins) {
  std::mt19937 rng(404);
  const int64_t nh = 16, nkv = 4, hd = 256, row = nkv * hd, qrow = nh * hd;
  const int64_t skipped = 5;  // a prompt's first chunk in the model: attention_prompt serves it
  const int64_t R = static_cast<int64_t>(lens.size());
  int64_t stride = 0, blocks = 0;
  for (const int64_t l : lens) {
    stride = std::max(stride, (l + kBlockSize - 1) / kBlockSize);
    blocks += (l + kBlockSize - 1) / kBlockSize;
  }
  std::vector<int32_t> ids(sz(blocks + 3));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> tables(sz(R * stride), 0);
  int64_t next = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < (lens[sz(r)] + kBlockSize - 1) / kBlockSize; ++b)
      tables[sz(r * stride + b)] = ids[sz(next++)];
  std::vector<float> pool = randn(sz(static_cast<int64_t>(ids.size()) * 2 * kBlockSize * row), rng);
  const DeviceBuffer<float> dpool(pool);
  const DeviceBuffer<int32_t> dtables(tables);
  const ops::KVLayerView host_view{pool.data(), kBlockSize, nkv, hd};
  const ops::KVLayerView dev_view{dpool.get(), kBlockSize, nkv, hd};
  std::vector<int64_t> pos, query_rows;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = lens[sz(r)] - wins[sz(r)]; j < lens[sz(r)]; ++j) {
      pos.push_back(j);
      query_rows.push_back(r == skipped ? -1 : r);
    }
  const int64_t T = static_cast<int64_t>(pos.size()), bound = 1024;
  const auto q = randn(sz(T * qrow), rng);
  const auto gate = randn(q.size(), rng, 3.0f);
  const DeviceBuffer<float> dq(q), dgate(gate);
  const DeviceBuffer<int64_t> dpos(pos), drows(query_rows);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (const bool gated : {false, true})
    for (const int64_t window : {1, 2, 3, 4, 8})
      for (const int most : {0, 2, 4}) {
        DeviceBuffer<float> out = nan_buffer(q.size());
        {
          const AttentionRuns runs(most);
          cuda::attention_rows(dev_view, dtables.get(), stride, drows.get(), dpos.get(), T, bound,
                               window, dq.get(), nh, scale, out.get(),
                               gated ? dgate.get() : nullptr);
        }
        const auto got = out.download();
        int64_t t0 = 0;
        for (int64_t r = 0; r < R; ++r) {
          const int64_t n = wins[sz(r)];
          const std::string what = "row " + std::to_string(r) + (gated ? " gated" : "") +
                                   " window " + std::to_string(window) + " runs of " +
                                   std::to_string(most);
          const auto mine = slice(got, sz(t0 * qrow), sz(n * qrow));
          if (r == skipped) {
            EXPECT_TRUE(
                std::all_of(mine.begin(), mine.end(), [](float x) { return std::isnan(x); }))
                << what << ": a skipped query was written";
          } else {
            // Alone, under the row's own bound, with its own table.
            const DeviceBuffer<int32_t> table(std::vector<int32_t>(
                tables.begin() + r * stride, tables.begin() + (r + 1) * stride));
            const DeviceBuffer<int64_t> rpos(slice(pos, sz(t0), sz(n)));
            const DeviceBuffer<float> rq(slice(q, sz(t0 * qrow), sz(n * qrow)));
            const DeviceBuffer<float> rg(slice(gate, sz(t0 * qrow), sz(n * qrow)));
            DeviceBuffer<float> alone = nan_buffer(sz(n * qrow));
            cuda::attention(dev_view, table.get(), rpos.get(), n, lens[sz(r)], rq.get(), nh, scale,
                            alone.get(), gated ? rg.get() : nullptr);
            EXPECT_TRUE(bitwise_equal(mine, alone.download())) << what << ": batched vs alone";
            if (!gated) {
              std::vector<float> want(sz(n * qrow));
              cpu::attention(host_view, tables.data() + r * stride, pos.data() + t0, n, bound,
                             q.data() + t0 * qrow, nh, scale, want.data());
              EXPECT_TRUE(near_blocks(mine, want, sz(hd), kAttnRel)) << what << ": vs the CPU op";
            }
          }
          t0 += n;
        }
      }
}

TEST_F(CudaBatchInvariance, AttentionRowsEqualsEachRowAlone) {
  attention_rows_equal_each_row_alone({1, 17, 300, 1000, 40, 16, 5}, {1, 4, 1, 2, 8, 2, 3});
  attention_rows_equal_each_row_alone({4, 17, 300, 1000, 40, 16, 5}, {4, 4, 4, 4, 4, 4, 4});
}

TEST_F(CudaBatchInvariance, AttentionQueriesAreBitwiseIndependentOfTheWindowAndBound) {
  struct Case {
    int64_t n_heads, n_kv_heads, head_dim, start;
  };
  const int64_t n = 8;
  for (const Case c : {Case{16, 4, 256, 21}, Case{16, 4, 256, 0}, Case{2, 2, 64, 13},
                       Case{16, 4, 256, 1000}, Case{16, 4, 256, 4090}, Case{24, 4, 256, 509}}) {
    std::mt19937 rng(static_cast<uint32_t>(121 + c.start + c.head_dim));
    const int64_t len = c.start + n, qrow = c.n_heads * c.head_dim;
    PagedKV kv = make_paged_kv(len, c.n_kv_heads, c.head_dim, rng);
    const auto k = randn(sz(len * kv.row()), rng);
    const auto v = randn(sz(len * kv.row()), rng);
    const auto q = randn(sz(n * qrow), rng);
    write_kv(kv, k, v, position_range(0, len));
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    const std::vector<int64_t> pos = position_range(c.start, len);
    // Queries t0..t0+cnt-1 of the window in one call under `bound`.
    auto run = [&](int64_t t0, int64_t cnt, int64_t bound) {
      return cuda_attention(kv, slice(pos, sz(t0), sz(cnt)), bound,
                            slice(q, sz(t0 * qrow), sz(cnt * qrow)), c.n_heads, scale);
    };
    const auto all = run(0, n, len);
    std::vector<float> want(q.size());
    cpu::attention(kv.host_view(), kv.table.data(), pos.data(), n, len, q.data(), c.n_heads, scale,
                   want.data());
    const std::string what = "heads " + std::to_string(c.n_heads) + "/" +
                             std::to_string(c.n_kv_heads) + " start " + std::to_string(c.start);
    ASSERT_TRUE(near_blocks(all, want, sz(c.head_dim), kAttnRel)) << what;
    for (int64_t t = 0; t < n; ++t)
      EXPECT_TRUE(bitwise_equal(run(t, 1, c.start + t + 1), slice(all, sz(t * qrow), sz(qrow))))
          << what << ": query " << t << " alone vs in the window";
    // Blocks serving 1, 2 or 4 of the queries (each of them a run, or split where the partition
    // size changes: start 509); then by the grid, as above.
    for (const int most : {1, 2, 4, 0}) {
      const AttentionRuns runs(most);
      const std::string what_runs = what + ", runs of " + std::to_string(most);
      EXPECT_TRUE(bitwise_equal(run(0, n, len), all)) << what_runs;
      EXPECT_TRUE(bitwise_equal(run(1, n - 1, len), slice(all, sz(qrow), sz((n - 1) * qrow))))
          << what_runs << ": queries 1..7";
      auto split = run(0, 3, len);
      const auto rest = run(3, 5, len);
      split.insert(split.end(), rest.begin(), rest.end());
      EXPECT_TRUE(bitwise_equal(split, all)) << what_runs << ": windows 3 + 5 vs 8";
      // Bounds: the next multiple of 1024 (what the model passes), one far past it (more grid
      // partitions and a larger partition-size tier than any query here uses), and a decode query
      // replayed under a bound it shares with the whole window.
      for (const int64_t bound : {(len + 1023) / 1024 * 1024, int64_t{150000}})
        EXPECT_TRUE(bitwise_equal(run(0, n, bound), all)) << what_runs << ": bound " << bound;
      EXPECT_TRUE(bitwise_equal(run(n - 1, 1, 150000), slice(all, sz((n - 1) * qrow), sz(qrow))))
          << what_runs << ": last query alone under bound 150000";
      // Shuffled: query j of the call is window query order[j].
      std::vector<int64_t> order(sz(n));
      std::iota(order.begin(), order.end(), int64_t{0});
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<int64_t> pos_shuffled;
      std::vector<float> q_shuffled;
      for (const int64_t t : order) {
        pos_shuffled.push_back(pos[sz(t)]);
        q_shuffled.insert(q_shuffled.end(), q.begin() + t * qrow, q.begin() + (t + 1) * qrow);
      }
      const auto shuffled = cuda_attention(kv, pos_shuffled, len, q_shuffled, c.n_heads, scale);
      for (int64_t j = 0; j < n; ++j)
        EXPECT_TRUE(bitwise_equal(slice(shuffled, sz(j * qrow), sz(qrow)),
                                  slice(all, sz(order[sz(j)] * qrow), sz(qrow))))
            << what_runs << ": query " << order[sz(j)] << " at slot " << j << " of a shuffled call";
    }
  }
}

// (c) causal_conv_silu: a window of n tokens (with state_after, as verify runs it), the same
// window without state_after, and n single-token calls (as decode runs them) give the same
// outputs and final state, and state_after[t] is the state after t + 1 single steps.
TEST_F(CudaBatchInvariance, ConvWindowEqualsSingleSteps) {
  const int64_t hist = kConvKernel - 1;
  for (const int64_t C : {8192, 4096, 37}) {
    const int64_t n = 9;
    std::mt19937 rng(static_cast<uint32_t>(131 + C));
    const F32Weight w = f32_weight(randn(sz(C * kConvKernel), rng, 0.5f), C, kConvKernel);
    const auto x = randn(sz(n * C), rng);
    const auto state0 = randn(sz(C * hist), rng);
    const DeviceBuffer<float> dx(x);

    DeviceBuffer<float> st_win(state0), out_win = nan_buffer(sz(n * C));
    DeviceBuffer<float> after = nan_buffer(sz(n * C * hist));
    cuda::causal_conv_silu(dx.get(), n, C, kConvKernel, w.dev_ref(), st_win.get(), out_win.get(),
                           after.get());
    const auto out_w = out_win.download(), st_w = st_win.download(), after_w = after.download();
    {  // the window is right before it is compared with itself
      std::vector<float> st = state0, want(sz(n * C));
      cpu::causal_conv_silu(x.data(), n, C, kConvKernel, w.host_ref(), st.data(), want.data(),
                            nullptr);
      ASSERT_TRUE(near_blocks(out_w, want, sz(C), kConvRel)) << "C " << C;
    }

    DeviceBuffer<float> st_plain(state0), out_plain = nan_buffer(sz(n * C));
    cuda::causal_conv_silu(dx.get(), n, C, kConvKernel, w.dev_ref(), st_plain.get(),
                           out_plain.get(), nullptr);
    EXPECT_TRUE(bitwise_equal(out_plain.download(), out_w)) << "C " << C << ": without state_after";
    EXPECT_TRUE(bitwise_equal(st_plain.download(), st_w)) << "C " << C << ": without state_after";

    DeviceBuffer<float> st_one(state0), out_one = nan_buffer(sz(n * C));
    for (int64_t t = 0; t < n; ++t) {
      cuda::causal_conv_silu(dx.get() + t * C, 1, C, kConvKernel, w.dev_ref(), st_one.get(),
                             out_one.get() + t * C, nullptr);
      EXPECT_TRUE(bitwise_equal(st_one.download(), slice(after_w, sz(t * C * hist), sz(C * hist))))
          << "C " << C << ": state_after[" << t << "] vs " << t + 1 << " single steps";
    }
    EXPECT_TRUE(bitwise_equal(out_one.download(), out_w)) << "C " << C << ": single steps, out";
    EXPECT_TRUE(bitwise_equal(st_one.download(), st_w)) << "C " << C << ": single steps, state";
  }
}

// (c) gated_delta_rule: the same three ways, bitwise.
TEST_F(CudaBatchInvariance, DeltaRuleWindowEqualsSingleSteps) {
  for (const DeltaCase c : {DeltaCase{16, 32, 8}, DeltaCase{8, 16, 8}, DeltaCase{2, 2, 8}}) {
    std::mt19937 rng(static_cast<uint32_t>(141 + c.n_v_heads));
    const DeltaInputs in = delta_inputs(c.n_k_heads, c.n_v_heads, c.n, rng);
    const size_t S = in.state_size(), O = sz(in.v_row());
    const std::string what =
        "heads " + std::to_string(c.n_k_heads) + "/" + std::to_string(c.n_v_heads);

    DeviceBuffer<float> st_win(in.state0), out_win = nan_buffer(in.out_size());
    DeviceBuffer<float> after = nan_buffer(S * sz(c.n));
    cuda_delta(in, 0, c.n, st_win.get(), out_win.get(), after.get());
    const auto out_w = out_win.download(), st_w = st_win.download(), after_w = after.download();
    {
      std::vector<float> st = in.state0, want(in.out_size());
      cpu::gated_delta_rule(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(),
                            in.A_log.host_ref(), in.dt_bias.host_ref(), c.n, in.h, st.data(),
                            want.data(), nullptr);
      ASSERT_TRUE(near_blocks(out_w, want, sz(kDeltaDim), kDeltaRel)) << what;
      ASSERT_TRUE(near_blocks(st_w, st, sz(kDeltaDim * kDeltaDim), kDeltaRel)) << what;
    }

    DeviceBuffer<float> st_plain(in.state0), out_plain = nan_buffer(in.out_size());
    cuda_delta(in, 0, c.n, st_plain.get(), out_plain.get(), nullptr);
    EXPECT_TRUE(bitwise_equal(out_plain.download(), out_w)) << what << ": without state_after";
    EXPECT_TRUE(bitwise_equal(st_plain.download(), st_w)) << what << ": without state_after";

    DeviceBuffer<float> st_one(in.state0), out_one = nan_buffer(in.out_size());
    for (int64_t t = 0; t < c.n; ++t) {
      cuda_delta(in, t, 1, st_one.get(), out_one.get() + sz(t) * O, nullptr);
      EXPECT_TRUE(bitwise_equal(st_one.download(), slice(after_w, sz(t) * S, S)))
          << what << ": state_after[" << t << "] vs " << t + 1 << " single steps";
    }
    EXPECT_TRUE(bitwise_equal(out_one.download(), out_w)) << what << ": single steps, out";
    EXPECT_TRUE(bitwise_equal(st_one.download(), st_w)) << what << ": single steps, state";
  }
}

// (d) rms_norm and gated_rms_norm: a row's result does not depend on m or on its place.
TEST_F(CudaBatchInvariance, NormRowsAreBitwiseIndependentOfTheBatch) {
  const int64_t m = 37;
  for (const int64_t d : {1024, 256, 4096, 384, 128}) {
    std::mt19937 rng(static_cast<uint32_t>(151 + d));
    const F32Weight w = f32_weight(randn(sz(d), rng, 0.1f), 1, d);
    const auto x = norm_input(m, d, rng);
    const auto z = randn(x.size(), rng, 2.0f);
    const DeviceBuffer<float> dx(x), dz(z);
    for (const bool gated : {false, true}) {
      auto run = [&](int64_t r0, int64_t cnt) {
        DeviceBuffer<float> y = nan_buffer(sz(cnt * d));
        if (gated)
          cuda::gated_rms_norm(dx.get() + r0 * d, dz.get() + r0 * d, cnt, d, w.dev_ref(), 1e-6f,
                               y.get());
        else
          cuda::rms_norm(dx.get() + r0 * d, cnt, d, w.dev_ref(), true, 1e-6f, y.get());
        return y.download();
      };
      const auto all = run(0, m);
      std::vector<float> want(x.size());
      if (gated)
        cpu::gated_rms_norm(x.data(), z.data(), m, d, w.host_ref(), 1e-6f, want.data());
      else
        cpu::rms_norm(x.data(), m, d, w.host_ref(), true, 1e-6f, want.data());
      const std::string what =
          std::string(gated ? "gated_rms_norm" : "rms_norm") + " d " + std::to_string(d);
      ASSERT_TRUE(near_blocks(all, want, sz(d), kNormRel)) << what;
      for (int64_t i = 0; i < m; ++i)
        EXPECT_TRUE(bitwise_equal(run(i, 1), slice(all, sz(i * d), sz(d))))
            << what << ": row " << i << " alone";
      for (int64_t chunk : {5, 16})
        for (int64_t r0 = 0; r0 < m; r0 += chunk) {
          const int64_t cnt = std::min(chunk, m - r0);
          EXPECT_TRUE(bitwise_equal(run(r0, cnt), slice(all, sz(r0 * d), sz(cnt * d))))
              << what << ": rows " << r0 << ".." << r0 + cnt - 1;
        }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// gated_delta_rule: long windows, odd head sizes, unaligned inputs
// ---------------------------------------------------------------------------------------------
// The CUDA kernel stages tokens in chunks of 16 (8 when dk > 128), pads dk to 64, 128 or 256 rows
// and tiles dv by 32 columns, and copies with 16-byte or 4-byte transfers depending on alignment;
// none of these may change a result.

// delta_inputs with any head sizes.
DeltaInputs delta_inputs_sized(int64_t n_k_heads, int64_t n_v_heads, int64_t dk, int64_t dv,
                               int64_t n, std::mt19937& rng) {
  DeltaInputs in;
  in.h = {n_k_heads, n_v_heads, dk, dv};
  in.n = n;
  in.q = randn(sz(n * in.qk_row()), rng);
  in.k = randn(sz(n * in.qk_row()), rng);
  in.v = randn(sz(n * in.v_row()), rng);
  in.a = randn(sz(n * n_v_heads), rng, 2.0f);
  in.b = randn(sz(n * n_v_heads), rng, 2.0f);
  in.state0 = randn(in.state_size(), rng, 0.1f);
  in.A_log = f32_weight(uniform(sz(n_v_heads), rng, 0.0f, 2.7f), 1, n_v_heads);
  in.dt_bias = f32_weight(uniform(sz(n_v_heads), rng, 0.5f, 1.5f), 1, n_v_heads);
  in.dq = DeviceBuffer<float>(in.q);
  in.dk = DeviceBuffer<float>(in.k);
  in.dv = DeviceBuffer<float>(in.v);
  in.da = DeviceBuffer<float>(in.a);
  in.db = DeviceBuffer<float>(in.b);
  return in;
}

struct DeltaResult {
  std::vector<float> out, state, after;
};

DeltaResult cpu_delta_all(const DeltaInputs& in) {
  DeltaResult r{std::vector<float>(in.out_size()), in.state0,
                std::vector<float>(in.state_size() * sz(in.n))};
  cpu::gated_delta_rule(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(),
                        in.A_log.host_ref(), in.dt_bias.host_ref(), in.n, in.h, r.state.data(),
                        r.out.data(), r.after.data());
  return r;
}

DeltaResult cuda_delta_all(const DeltaInputs& in, bool with_after) {
  DeviceBuffer<float> st(in.state0), out = nan_buffer(in.out_size());
  DeviceBuffer<float> after = nan_buffer(with_after ? in.state_size() * sz(in.n) : 0);
  cuda_delta(in, 0, in.n, st.get(), out.get(), with_after ? after.get() : nullptr);
  return {out.download(), st.download(), with_after ? after.download() : std::vector<float>()};
}

double max_abs(const std::vector<float>& v) {
  double m = 0.0;
  for (const float x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

// One call over the whole window vs calls over `splits` (summing to n): same bits for the
// outputs, and each call's final state equals state_after at its last token.
void expect_delta_splits_bitwise(const DeltaInputs& in, const DeltaResult& whole,
                                 const std::vector<int64_t>& splits, const std::string& what) {
  const size_t S = in.state_size(), O = sz(in.v_row());
  DeviceBuffer<float> st(in.state0), out = nan_buffer(in.out_size());
  int64_t t0 = 0;
  for (const int64_t cnt : splits) {
    cuda_delta(in, t0, cnt, st.get(), out.get() + sz(t0) * O, nullptr);
    t0 += cnt;
    EXPECT_TRUE(bitwise_equal(st.download(), slice(whole.after, sz(t0 - 1) * S, S)))
        << what << ": state after a call ending at token " << t0 - 1;
  }
  ASSERT_EQ(t0, in.n) << "splits must cover the window";
  EXPECT_TRUE(bitwise_equal(out.download(), whole.out)) << what << ": split calls, out";
  EXPECT_TRUE(bitwise_equal(st.download(), whole.state)) << what << ": split calls, state";
}

// Prompt-prefill mode for the duration of a scope (the delta rule's layout for long prompts); the
// default is restored even when an assertion returns early.
struct PrefillScope {
  explicit PrefillScope(bool on) { cuda::set_prefill(on); }
  ~PrefillScope() { cuda::set_prefill(false); }
};

// Windows longer than a chunk: one call (with and without state_after) vs split calls whose
// boundaries fall inside and on chunk edges, in the decode/verify layout and the prompt one.
TEST_F(CudaBatchInvariance, DeltaRuleLongWindowEqualsSplitCalls) {
  struct Case {
    DeltaCase c;
    std::vector<int64_t> splits;
  };
  for (const bool prefill : {false, true})
    for (const Case& k : {Case{DeltaCase{16, 32, 40}, {1, 15, 17, 7}},
                          Case{DeltaCase{2, 4, 70}, {1, 15, 16, 17, 21}}}) {
      const PrefillScope mode(prefill);
      const DeltaCase c = k.c;
      std::mt19937 rng(static_cast<uint32_t>(171 + c.n_v_heads + c.n));
      const DeltaInputs in = delta_inputs(c.n_k_heads, c.n_v_heads, c.n, rng);
      const std::string what = "heads " + std::to_string(c.n_k_heads) + "/" +
                               std::to_string(c.n_v_heads) + " n " + std::to_string(c.n) +
                               " prefill " + std::to_string(prefill);
      const DeltaResult whole = cuda_delta_all(in, true);
      {
        const DeltaResult want = cpu_delta_all(in);
        const size_t head = sz(kDeltaDim * kDeltaDim);
        // Some head vectors of this window come out ~1e-7, sums whose terms cancel: the rounding
        // of two summation orders is then large relative to the vector itself, though not to the
        // output. The per-vector tolerance gets an absolute floor at 1e-4 of the largest output.
        ASSERT_TRUE(near_blocks(whole.out, want.out, sz(kDeltaDim), kDeltaRel,
                                kDeltaRel * max_abs(want.out)))
            << what;
        ASSERT_TRUE(near_blocks(whole.state, want.state, head, kDeltaRel)) << what;
        ASSERT_TRUE(near_blocks(whole.after, want.after, head, kDeltaRel)) << what;
      }
      const DeltaResult plain = cuda_delta_all(in, false);
      EXPECT_TRUE(bitwise_equal(plain.out, whole.out)) << what << ": without state_after";
      EXPECT_TRUE(bitwise_equal(plain.state, whole.state)) << what << ": without state_after";
      expect_delta_splits_bitwise(in, whole, k.splits, what);
    }
}

// Head sizes other than 128: dk padded to 64 / 128 / 256 rows, dv not a multiple of the 16- or
// 32-column tile, and dk or dv not a multiple of 4 (4-byte staging); both layouts.
TEST_F(CudaOps, DeltaRuleOddHeadSizesMatchCpuAndSingleSteps) {
  struct Case {
    int64_t n_k_heads, n_v_heads, dk, dv, n;
  };
  for (const bool prefill : {false, true})
    for (const Case c : {Case{1, 2, 64, 48, 20}, Case{1, 2, 100, 72, 19}, Case{2, 2, 50, 40, 18},
                         Case{1, 2, 256, 128, 10}, Case{1, 1, 130, 33, 9}}) {
      const PrefillScope mode(prefill);
      std::mt19937 rng(static_cast<uint32_t>(181 + c.dk + c.dv));
      const DeltaInputs in = delta_inputs_sized(c.n_k_heads, c.n_v_heads, c.dk, c.dv, c.n, rng);
      const std::string what = "dk " + std::to_string(c.dk) + " dv " + std::to_string(c.dv) +
                               " heads " + std::to_string(c.n_k_heads) + "/" +
                               std::to_string(c.n_v_heads) + " prefill " + std::to_string(prefill);
      const DeltaResult whole = cuda_delta_all(in, true);
      const DeltaResult want = cpu_delta_all(in);
      ASSERT_TRUE(near_blocks(whole.out, want.out, sz(c.dv), kDeltaRel)) << what;
      ASSERT_TRUE(near_blocks(whole.state, want.state, sz(c.dk * c.dv), kDeltaRel)) << what;
      ASSERT_TRUE(near_blocks(whole.after, want.after, sz(c.dk * c.dv), kDeltaRel)) << what;
      const DeltaResult plain = cuda_delta_all(in, false);
      EXPECT_TRUE(bitwise_equal(plain.out, whole.out)) << what << ": without state_after";
      EXPECT_TRUE(bitwise_equal(plain.state, whole.state)) << what << ": without state_after";
      expect_delta_splits_bitwise(in, whole, std::vector<int64_t>(sz(c.n), 1), what);
    }
}

// q, k, v that are only 4-byte aligned take the 4-byte staging path; the bits must not change.
TEST_F(CudaBatchInvariance, DeltaRuleUnalignedInputsGiveTheSameBits) {
  std::mt19937 rng(191);
  const DeltaInputs in = delta_inputs(2, 4, 21, rng);
  const DeltaResult aligned = cuda_delta_all(in, false);
  ASSERT_TRUE(near_blocks(aligned.out, cpu_delta_all(in).out, sz(kDeltaDim), kDeltaRel));
  auto shifted = [](const std::vector<float>& x) {
    std::vector<float> y(x.size() + 1, 0.0f);
    std::copy(x.begin(), x.end(), y.begin() + 1);
    return DeviceBuffer<float>(y);
  };
  const DeviceBuffer<float> sq = shifted(in.q), sk = shifted(in.k), sv = shifted(in.v);
  DeviceBuffer<float> st(in.state0), out = nan_buffer(in.out_size());
  cuda::gated_delta_rule(sq.get() + 1, sk.get() + 1, sv.get() + 1, in.da.get(), in.db.get(),
                         in.A_log.dev_ref(), in.dt_bias.dev_ref(), in.n, in.h, st.get(), out.get(),
                         nullptr);
  EXPECT_TRUE(bitwise_equal(out.download(), aligned.out)) << "unaligned q, k, v: out";
  EXPECT_TRUE(bitwise_equal(st.download(), aligned.state)) << "unaligned q, k, v: state";
}

// ---------------------------------------------------------------------------------------------
// Batched recurrent ops: causal_conv_silu_rows and gated_delta_rule_rows
// ---------------------------------------------------------------------------------------------
// Rows of different lengths, each with its own states, some keeping per-token states and some
// not, in one call of each op: every row's outputs, final states and per-token states must be
// bitwise those of the single-row op run on a copy of that row's inputs and states.

// Which tokens each row of a batched call owns. Rows take consecutive token blocks in `order`,
// not in descriptor order, so the kernels must take each row's place from its descriptor.
struct RowsLayout {
  std::vector<int64_t> n;        // tokens per row
  std::vector<bool> after;       // the row keeps per-token states
  std::vector<int64_t> first;    // the row's first token in the call's arrays
  std::vector<int64_t> settled;  // ops::RecurrentRow::settled per row (all tokens by default)
  int64_t tokens = 0, max_n = 0;
  int64_t rows() const { return static_cast<int64_t>(n.size()); }
};
RowsLayout rows_layout(std::vector<int64_t> n, std::vector<bool> after,
                       const std::vector<size_t>& order) {
  RowsLayout L;
  L.n = std::move(n);
  L.after = std::move(after);
  L.first.assign(L.n.size(), 0);
  L.settled.assign(L.n.size(), -1);
  for (const size_t r : order) {
    L.first[r] = L.tokens;
    L.tokens += L.n[r];
  }
  for (const int64_t n_r : L.n) L.max_n = std::max(L.max_n, n_r);
  return L;
}

struct RecurrentShape {
  int64_t channels;  // conv channels (kernel kConvKernel)
  ops::DeltaHeads h;
};

// Device inputs, outputs and per-row states of one batched call of both ops, which share one
// descriptor array as a model's layer does (the two ops' inputs are drawn independently here).
// The call's arrays and the descriptors are sized once for `capacity` tokens and `max_rows` rows,
// and load() refills them in place, as the model refreshes a captured graph's buffers.
struct RecurrentBatch {
  RecurrentShape s{};
  int64_t capacity = 0;
  F32Weight conv_w, A_log, dt_bias;
  DeviceBuffer<float> dx, dq, dk, dv, da, db, conv_out, delta_out;
  DeviceBuffer<ops::RecurrentRow> desc;
  // The loaded layout, its inputs (host copies) and each row's initial and device states.
  RowsLayout L;
  std::vector<float> x, q, k, v, a, b;
  std::vector<std::vector<float>> conv0, state0;
  std::vector<DeviceBuffer<float>> conv, conv_after, state, state_after;

  int64_t hist() const { return kConvKernel - 1; }
  int64_t qk_row() const { return s.h.n_k_heads * s.h.dk; }
  int64_t v_row() const { return s.h.n_v_heads * s.h.dv; }
  int64_t state_size() const { return s.h.n_v_heads * s.h.dk * s.h.dv; }
};

RecurrentBatch recurrent_batch(const RecurrentShape& s, int64_t capacity, int64_t max_rows,
                               std::mt19937& rng) {
  RecurrentBatch B;
  B.s = s;
  B.capacity = capacity;
  const int64_t C = s.channels, nv = s.h.n_v_heads;
  B.conv_w = f32_weight(randn(sz(C * kConvKernel), rng, 0.5f), C, kConvKernel);
  B.A_log = f32_weight(uniform(sz(nv), rng, 0.0f, 2.7f), 1, nv);
  B.dt_bias = f32_weight(uniform(sz(nv), rng, 0.5f, 1.5f), 1, nv);
  B.dx = DeviceBuffer<float>(sz(capacity * C));
  B.dq = DeviceBuffer<float>(sz(capacity * B.qk_row()));
  B.dk = DeviceBuffer<float>(sz(capacity * B.qk_row()));
  B.dv = DeviceBuffer<float>(sz(capacity * B.v_row()));
  B.da = DeviceBuffer<float>(sz(capacity * nv));
  B.db = DeviceBuffer<float>(sz(capacity * nv));
  B.conv_out = DeviceBuffer<float>(sz(capacity * C));
  B.delta_out = DeviceBuffer<float>(sz(capacity * B.v_row()));
  B.desc = DeviceBuffer<ops::RecurrentRow>(sz(max_rows));
  return B;
}

// New inputs, fresh states and descriptors for layout L; outputs reset to NaN.
void load(RecurrentBatch& B, const RowsLayout& L, std::mt19937& rng) {
  ASSERT_LE(L.tokens, B.capacity);
  ASSERT_LE(sz(L.rows()), B.desc.size());
  const int64_t T = L.tokens, C = B.s.channels, nv = B.s.h.n_v_heads;
  B.L = L;
  B.x = randn(sz(T * C), rng);
  B.q = randn(sz(T * B.qk_row()), rng);
  B.k = randn(sz(T * B.qk_row()), rng);
  B.v = randn(sz(T * B.v_row()), rng);
  B.a = randn(sz(T * nv), rng, 2.0f);
  B.b = randn(sz(T * nv), rng, 2.0f);
  B.dx.upload(B.x);
  B.dq.upload(B.q);
  B.dk.upload(B.k);
  B.dv.upload(B.v);
  B.da.upload(B.a);
  B.db.upload(B.b);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  B.conv_out.upload(std::vector<float>(B.conv_out.size(), nan));
  B.delta_out.upload(std::vector<float>(B.delta_out.size(), nan));

  const size_t R = sz(L.rows()), S = sz(B.state_size()), CS = sz(C * B.hist());
  B.conv0.assign(R, {});
  B.state0.assign(R, {});
  B.conv.clear();
  B.conv_after.clear();
  B.state.clear();
  B.state_after.clear();
  std::vector<ops::RecurrentRow> desc(R);
  for (size_t r = 0; r < R; ++r) {
    const size_t n = sz(L.n[r]), kept = L.after[r] ? n : 0;
    B.conv0[r] = randn(CS, rng);
    B.state0[r] = randn(S, rng, 0.1f);
    B.conv.emplace_back(B.conv0[r]);
    B.state.emplace_back(B.state0[r]);
    B.conv_after.push_back(nan_buffer(kept * CS));
    B.state_after.push_back(nan_buffer(kept * S));
    desc[r].first_token = L.first[r];
    desc[r].n = L.n[r];
    desc[r].conv_state = B.conv[r].get();
    desc[r].conv_after = B.conv_after[r].get();  // null when the row keeps none
    desc[r].state = B.state[r].get();
    desc[r].state_after = B.state_after[r].get();
    desc[r].settled = L.settled[r];
  }
  B.desc.upload(desc);
}

// Both batched ops over the loaded rows, one launch each.
void run_rows(const RecurrentBatch& B) {
  const RowsLayout& L = B.L;
  cuda::causal_conv_silu_rows(B.dx.get(), B.s.channels, kConvKernel, B.conv_w.dev_ref(),
                              B.desc.get(), L.rows(), L.max_n, B.conv_out.get());
  cuda::gated_delta_rule_rows(B.dq.get(), B.dk.get(), B.dv.get(), B.da.get(), B.db.get(),
                              B.A_log.dev_ref(), B.dt_bias.dev_ref(), B.desc.get(), L.rows(),
                              L.max_n, B.s.h, B.delta_out.get());
}

// Every row of the last run against the single-row CUDA ops on copies of its inputs and states.
void expect_rows_equal_single_calls(const RecurrentBatch& B, const std::string& what) {
  const RowsLayout& L = B.L;
  const int64_t C = B.s.channels, S = B.state_size(), CS = C * B.hist();
  const auto conv_all = B.conv_out.download(), delta_all = B.delta_out.download();
  for (int64_t r = 0; r < L.rows(); ++r) {
    const int64_t n = L.n[r], t0 = L.first[r];
    const bool after = L.after[r];
    const std::string row = what + ", row " + std::to_string(r) + " (n " + std::to_string(n) +
                            (after ? ", per-token states)" : ")");

    const DeviceBuffer<float> x(slice(B.x, sz(t0 * C), sz(n * C)));
    DeviceBuffer<float> conv(B.conv0[r]), conv_out = nan_buffer(sz(n * C));
    DeviceBuffer<float> conv_after = nan_buffer(after ? sz(n * CS) : 0);
    cuda::causal_conv_silu(x.get(), n, C, kConvKernel, B.conv_w.dev_ref(), conv.get(),
                           conv_out.get(), after ? conv_after.get() : nullptr);
    EXPECT_TRUE(bitwise_equal(slice(conv_all, sz(t0 * C), sz(n * C)), conv_out.download()))
        << row << ": conv out";
    // A row's outputs are those of the whole run; its state is the one its settled tokens leave.
    const int64_t kept = L.settled[r] < 0 ? n : std::min(L.settled[r], n);
    if (kept < n) {
      conv.upload(B.conv0[r]);
      DeviceBuffer<float> scratch = nan_buffer(sz(n * C));
      if (kept > 0)
        cuda::causal_conv_silu(x.get(), kept, C, kConvKernel, B.conv_w.dev_ref(), conv.get(),
                               scratch.get(), nullptr);
    }
    EXPECT_TRUE(bitwise_equal(B.conv[r].download(), conv.download())) << row << ": conv state";
    if (after) {
      EXPECT_TRUE(bitwise_equal(B.conv_after[r].download(), conv_after.download()))
          << row << ": conv_after";
    }

    const int64_t qk = B.qk_row(), vr = B.v_row(), nv = B.s.h.n_v_heads;
    const DeviceBuffer<float> q(slice(B.q, sz(t0 * qk), sz(n * qk)));
    const DeviceBuffer<float> k(slice(B.k, sz(t0 * qk), sz(n * qk)));
    const DeviceBuffer<float> v(slice(B.v, sz(t0 * vr), sz(n * vr)));
    const DeviceBuffer<float> a(slice(B.a, sz(t0 * nv), sz(n * nv)));
    const DeviceBuffer<float> b(slice(B.b, sz(t0 * nv), sz(n * nv)));
    DeviceBuffer<float> state(B.state0[r]), out = nan_buffer(sz(n * vr));
    DeviceBuffer<float> state_after = nan_buffer(after ? sz(n * S) : 0);
    cuda::gated_delta_rule(q.get(), k.get(), v.get(), a.get(), b.get(), B.A_log.dev_ref(),
                           B.dt_bias.dev_ref(), n, B.s.h, state.get(), out.get(),
                           after ? state_after.get() : nullptr);
    EXPECT_TRUE(bitwise_equal(slice(delta_all, sz(t0 * vr), sz(n * vr)), out.download()))
        << row << ": delta out";
    if (kept < n) {
      state.upload(B.state0[r]);
      DeviceBuffer<float> scratch = nan_buffer(sz(n * vr));
      if (kept > 0)
        cuda::gated_delta_rule(q.get(), k.get(), v.get(), a.get(), b.get(), B.A_log.dev_ref(),
                               B.dt_bias.dev_ref(), kept, B.s.h, state.get(), scratch.get(),
                               nullptr);
    }
    EXPECT_TRUE(bitwise_equal(B.state[r].download(), state.download())) << row << ": state";
    if (after) {
      EXPECT_TRUE(bitwise_equal(B.state_after[r].download(), state_after.download()))
          << row << ": state_after";
    }
  }
}

// The last run against the CPU's batched ops (host descriptors over host copies of the initial
// states): the single-row comparison above would also pass if both CUDA paths were wrong alike.
void expect_rows_near_cpu(const RecurrentBatch& B, const std::string& what) {
  const RowsLayout& L = B.L;
  const int64_t T = L.tokens, C = B.s.channels;
  std::vector<std::vector<float>> conv = B.conv0, state = B.state0;
  std::vector<ops::RecurrentRow> desc(sz(L.rows()));
  for (size_t r = 0; r < desc.size(); ++r) {
    desc[r].first_token = L.first[r];
    desc[r].n = L.n[r];
    desc[r].conv_state = conv[r].data();
    desc[r].state = state[r].data();
    desc[r].settled = L.settled[r];
  }
  std::vector<float> conv_want(sz(T * C)), delta_want(sz(T * B.v_row()));
  cpu::causal_conv_silu_rows(B.x.data(), C, kConvKernel, B.conv_w.host_ref(), desc.data(), L.rows(),
                             L.max_n, conv_want.data());
  cpu::gated_delta_rule_rows(B.q.data(), B.k.data(), B.v.data(), B.a.data(), B.b.data(),
                             B.A_log.host_ref(), B.dt_bias.host_ref(), desc.data(), L.rows(),
                             L.max_n, B.s.h, delta_want.data());
  EXPECT_TRUE(near_blocks(B.conv_out.download(0, conv_want.size()), conv_want, sz(C), kConvRel))
      << what << ": conv out vs CPU";
  // Head vectors whose terms cancel can be tiny: an absolute floor at 1e-4 of the largest output.
  EXPECT_TRUE(near_blocks(B.delta_out.download(0, delta_want.size()), delta_want, sz(B.s.h.dv),
                          kDeltaRel, kDeltaRel * max_abs(delta_want)))
      << what << ": delta out vs CPU";
  for (size_t r = 0; r < desc.size(); ++r) {
    EXPECT_TRUE(bitwise_equal(B.conv[r].download(), conv[r])) << what << ": conv state " << r;
    EXPECT_TRUE(near_blocks(B.state[r].download(), state[r], sz(B.s.h.dk * B.s.h.dv), kDeltaRel,
                            kDeltaRel * max_abs(state[r])))
        << what << ": state " << r;
  }
}

// Qwen3.5-9B's linear-attention layer (conv over 2·16·128 + 32·128 = 8192 channels, 16 key and 32
// value heads of 128), tiny heads whose dv is not a multiple of 4 (4-byte staging, one partial
// column tile), and dk > 128 (64 rows per lane).
const RecurrentShape kRowsShapes[] = {
    {8192, {16, 32, 128, 128}}, {37, {2, 4, 8, 6}}, {5, {1, 2, 160, 40}}};

std::string shape_name(const RecurrentShape& s) {
  return "channels " + std::to_string(s.channels) + ", heads " + std::to_string(s.h.n_k_heads) +
         "/" + std::to_string(s.h.n_v_heads) + ", dk " + std::to_string(s.h.dk) + ", dv " +
         std::to_string(s.h.dv);
}

// Five rows of 1, 4, 1, 9 and 2 tokens in one call, with per-token states on rows 0, 3, 4, then
// on the others (the complement) and in another token order.
TEST_F(CudaBatchInvariance, RecurrentRowsEqualSingleRowCalls) {
  const std::vector<int64_t> n = {1, 4, 1, 9, 2};
  const RowsLayout layouts[] = {rows_layout(n, {true, false, false, true, true}, {3, 0, 4, 2, 1}),
                                rows_layout(n, {false, true, true, false, false}, {0, 1, 2, 3, 4})};
  for (const RecurrentShape& s : kRowsShapes) {
    std::mt19937 rng(static_cast<uint32_t>(211 + s.channels + s.h.dk));
    RecurrentBatch B = recurrent_batch(s, layouts[0].tokens, 5, rng);
    for (size_t i = 0; i < std::size(layouts); ++i) {
      const std::string what = shape_name(s) + ", layout " + std::to_string(i);
      load(B, layouts[i], rng);
      run_rows(B);
      expect_rows_near_cpu(B, what);
      expect_rows_equal_single_calls(B, what);
    }
  }
}

// Prompt-length rows, which causal_conv_silu_rows splits into token chunks (one block per 64
// tokens of a row): rows longer than a chunk, exactly one chunk, one token past it, shorter than
// the conv window, idle, with and without per-token states. Every row's outputs and final states
// must be bitwise the single-row op's, whose one thread walks all of the row's tokens; rows that
// settle part of their tokens (inside the first chunk, at its end, in a later one) leave the
// states those tokens leave.
TEST_F(CudaBatchInvariance, LongRowsEqualSingleRowCalls) {
  const std::vector<int64_t> n = {200, 2, 0, 130, 64, 65};
  RowsLayout settled = rows_layout(n, {true, false, false, false, true, false}, {5, 4, 3, 2, 1, 0});
  settled.settled = {150, 1, 0, 64, 100, 1};
  const RowsLayout layouts[] = {
      rows_layout(n, {false, true, false, true, false, false}, {3, 0, 4, 2, 1, 5}),
      rows_layout(n, {false, false, true, false, true, true}, {0, 1, 2, 3, 4, 5}), settled};
  for (const RecurrentShape& s : {kRowsShapes[0], kRowsShapes[1]}) {
    for (bool prefill : {false, true}) {
      std::mt19937 rng(static_cast<uint32_t>(307 + s.channels + prefill));
      RecurrentBatch B = recurrent_batch(s, layouts[0].tokens, 6, rng);
      for (size_t i = 0; i < std::size(layouts); ++i) {
        const std::string what = shape_name(s) + ", layout " + std::to_string(i) + ", prefill " +
                                 std::to_string(prefill);
        load(B, layouts[i], rng);
        cuda::set_prefill(prefill);
        run_rows(B);
        expect_rows_equal_single_calls(B, what);
        cuda::set_prefill(false);
      }
    }
  }
}

// A call whose rows all hold one token (a decode step; max_n == 1) runs the delta rule's
// single-token kernel: every row's output and states must still be bitwise the chunked
// single-row op's, with and without per-token states, beside idle rows, at the decode and the
// prefill lane counts (the second shape's dk 160 pads to 256; the third's dv 6 keeps the chunked
// kernel, whose 4-byte staging the single-token kernel does not replace).
TEST_F(CudaBatchInvariance, SingleTokenRowsEqualSingleRowCalls) {
  const RowsLayout layouts[] = {
      rows_layout({1, 1, 1, 0, 1}, {true, false, false, false, true}, {3, 0, 4, 2, 1}),
      rows_layout({1, 0, 1, 1, 1}, {false, true, true, false, false}, {0, 1, 2, 3, 4})};
  const RecurrentShape shapes[] = {kRowsShapes[0], kRowsShapes[2], kRowsShapes[1]};
  for (const RecurrentShape& s : shapes) {
    for (bool prefill : {false, true}) {
      std::mt19937 rng(static_cast<uint32_t>(229 + s.channels + s.h.dk + prefill));
      RecurrentBatch B = recurrent_batch(s, 4, 5, rng);
      for (size_t i = 0; i < std::size(layouts); ++i) {
        const std::string what = shape_name(s) + ", layout " + std::to_string(i) + ", prefill " +
                                 std::to_string(prefill);
        load(B, layouts[i], rng);
        cuda::set_prefill(prefill);
        run_rows(B);
        expect_rows_equal_single_calls(B, what);
        cuda::set_prefill(false);
        expect_rows_near_cpu(B, what);
      }
    }
  }
}

// Calls whose rows hold at most 8 tokens (decode steps, verify windows, commit replays) run the
// delta rule's short-row kernel on the 9B shape, with 1, 2 or 4 column tiles per block by the
// batch's size: every row's output, final and per-token states must be bitwise the chunked
// single-row op's, rows that settle fewer tokens than they run (Replay's verify windows settle
// one) must leave both states as the single-row op leaves them after those tokens, beside idle
// rows; the other shapes keep the earlier kernels under the same checks, and the
// prefill lane count too.
TEST_F(CudaBatchInvariance, ShortRowsEqualSingleRowCalls) {
  RowsLayout settled =
      rows_layout({1, 4, 0, 8, 2, 3}, {false, true, false, false, true, false}, {5, 0, 4, 2, 1, 3});
  settled.settled = {0, 1, 0, 3, 0, -1};
  RowsLayout windows =
      rows_layout({4, 4, 0, 8, 2, 4}, {false, true, false, false, true, false}, {1, 0, 4, 2, 5, 3});
  windows.settled = {1, 1, 1, 1, 1, 1};
  RowsLayout single =
      rows_layout({1, 1, 0, 1, 1, 1}, {true, false, false, false, true, false}, {0, 1, 2, 3, 4, 5});
  single.settled = {-1, 0, -1, 1, -1, 0};
  const RowsLayout layouts[] = {
      settled, windows, single,
      rows_layout({8, 1, 5, 2, 7, 4}, {false, false, true, false, false, false},
                  {3, 4, 5, 0, 1, 2})};
  for (const RecurrentShape& s : kRowsShapes) {
    for (bool prefill : {false, true}) {
      std::mt19937 rng(static_cast<uint32_t>(233 + s.channels + s.h.dk + prefill));
      RecurrentBatch B = recurrent_batch(s, 32, 6, rng);
      for (size_t i = 0; i < std::size(layouts); ++i) {
        const std::string what = shape_name(s) + ", layout " + std::to_string(i) + ", prefill " +
                                 std::to_string(prefill);
        for (int tiles : {0, 1, 2, 4}) {
          load(B, layouts[i], rng);
          cuda::set_short_delta_tiles(tiles);
          cuda::set_prefill(prefill);
          run_rows(B);
          cuda::set_short_delta_tiles(0);
          const std::string at = what + ", tiles " + std::to_string(tiles);
          expect_rows_equal_single_calls(B, at);  // the single-row ops in the same mode
          cuda::set_prefill(false);
          expect_rows_near_cpu(B, at);
        }
      }
    }
  }
}

// ops::recurrent_layers_rows, the Replay commit of every linear layer at once: each layer's rows
// (their own weights, inputs and states; rows that settle part of their tokens, idle rows) end
// bitwise as the two per-layer calls leave them, near the CPU's. Short rows go in one launch per
// op on the shapes the short-row kernel takes (the demo's and the 9B's); dk 8, and rows past 8
// tokens, run layer by layer.
TEST_F(CudaBatchInvariance, LayeredRowsEqualPerLayerCalls) {
  const int64_t nl = 3, K = kConvKernel, hist = K - 1;
  RowsLayout short_rows =
      rows_layout({3, 1, 0, 4, 2}, {false, false, false, false, false}, {4, 0, 1, 3, 2});
  short_rows.settled = {-1, 0, -1, 2, -1};
  const RowsLayout layouts[] = {short_rows,
                                rows_layout({12, 1, 3}, {false, false, false}, {2, 0, 1})};
  const RecurrentShape shapes[] = {
      {1024, {4, 8, 64, 64}}, {8192, {16, 32, 128, 128}}, {64, {2, 4, 8, 8}}};
  for (const RecurrentShape& shape : shapes) {
    ops::DeltaHeads h = shape.h;
    h.qkv_token_stride = shape.channels;
    const int64_t C = shape.channels, nv = h.n_v_heads, kd = h.n_k_heads * h.dk;
    const int64_t vr = nv * h.dv, S = nv * h.dk * h.dv;
    for (size_t li = 0; li < std::size(layouts); ++li) {
      const RowsLayout& L = layouts[li];
      const int64_t R = L.rows(), T = L.tokens;
      const std::string what = shape_name(shape) + ", layout " + std::to_string(li);
      std::mt19937 rng(static_cast<uint32_t>(401 + C + li));
      std::vector<F32Weight> conv_w, A_log, dt_bias;
      std::vector<DeviceBuffer<float>> input, a, b, conv_out, out, ref_conv_out, ref_out;
      std::vector<std::vector<float>> host_input, host_a, host_b;
      for (int64_t l = 0; l < nl; ++l) {
        conv_w.push_back(f32_weight(randn(sz(C * K), rng, 0.5f), C, K));
        A_log.push_back(f32_weight(randn(sz(nv), rng, 0.5f), 1, nv));
        dt_bias.push_back(f32_weight(randn(sz(nv), rng, 0.5f), 1, nv));
        host_input.push_back(randn(sz(T * C), rng));
        host_a.push_back(randn(sz(T * nv), rng, 2.0f));
        host_b.push_back(randn(sz(T * nv), rng, 2.0f));
        input.emplace_back(host_input.back());
        a.emplace_back(host_a.back());
        b.emplace_back(host_b.back());
        for (auto* v : {&conv_out, &ref_conv_out}) v->push_back(nan_buffer(sz(T * C)));
        for (auto* v : {&out, &ref_out}) v->push_back(nan_buffer(sz(T * vr)));
      }
      // States per (layer, row): the layered call's, the per-layer calls', the CPU's.
      std::vector<std::vector<float>> conv0, state0;
      std::vector<DeviceBuffer<float>> conv, state, ref_conv, ref_state;
      for (int64_t i = 0; i < nl * R; ++i) {
        conv0.push_back(randn(sz(C * hist), rng));
        state0.push_back(randn(sz(S), rng, 0.1f));
        conv.emplace_back(conv0.back());
        ref_conv.emplace_back(conv0.back());
        state.emplace_back(state0.back());
        ref_state.emplace_back(state0.back());
      }
      // Layer-major descriptors over per-(layer, row) states: device buffers or host vectors.
      auto base = [](auto& b) -> float* {
        if constexpr (requires { b.get(); })
          return b.get();
        else
          return b.data();
      };
      auto descriptors = [&](auto& cs, auto& ss) {
        std::vector<ops::RecurrentRow> d(sz(nl * R));
        for (int64_t l = 0; l < nl; ++l)
          for (int64_t r = 0; r < R; ++r) {
            ops::RecurrentRow& e = d[sz(l * R + r)];
            e.first_token = L.first[sz(r)];
            e.n = L.n[sz(r)];
            e.settled = L.settled[sz(r)];
            e.conv_state = base(cs[sz(l * R + r)]);
            e.state = base(ss[sz(l * R + r)]);
          }
        return d;
      };
      std::vector<ops::RecurrentLayer> table(sz(nl));
      for (int64_t l = 0; l < nl; ++l) {
        ops::RecurrentLayer& e = table[sz(l)];
        e.conv_input = input[sz(l)].get();
        e.conv_weight = conv_w[sz(l)].dev_ref();
        e.a = a[sz(l)].get();
        e.b = b[sz(l)].get();
        e.A_log = A_log[sz(l)].dev_ref();
        e.dt_bias = dt_bias[sz(l)].dev_ref();
        e.conv_out = conv_out[sz(l)].get();
        e.out = out[sz(l)].get();
      }
      DeviceBuffer<ops::RecurrentLayer> table_dev(table);
      DeviceBuffer<ops::RecurrentRow> desc(descriptors(conv, state));
      cuda::recurrent_layers_rows({table.data(), table_dev.get(), nl}, C, K, desc.get(), R, L.max_n,
                                  h);
      DeviceBuffer<ops::RecurrentRow> ref_desc(descriptors(ref_conv, ref_state));
      for (int64_t l = 0; l < nl; ++l) {
        const ops::RecurrentRow* d = ref_desc.get() + l * R;
        float* co = ref_conv_out[sz(l)].get();
        cuda::causal_conv_silu_rows(input[sz(l)].get(), C, K, conv_w[sz(l)].dev_ref(), d, R,
                                    L.max_n, co);
        cuda::gated_delta_rule_rows(co, co + kd, co + 2 * kd, a[sz(l)].get(), b[sz(l)].get(),
                                    A_log[sz(l)].dev_ref(), dt_bias[sz(l)].dev_ref(), d, R, L.max_n,
                                    h, ref_out[sz(l)].get());
      }
      // The CPU's layered call on host copies.
      std::vector<std::vector<float>> cpu_conv = conv0, cpu_state = state0;
      std::vector<std::vector<float>> cpu_conv_out(sz(nl), std::vector<float>(sz(T * C), NAN));
      std::vector<std::vector<float>> cpu_out(sz(nl), std::vector<float>(sz(T * vr), NAN));
      std::vector<ops::RecurrentRow> cpu_desc = descriptors(cpu_conv, cpu_state);
      std::vector<ops::RecurrentLayer> cpu_table(sz(nl));
      for (int64_t l = 0; l < nl; ++l) {
        cpu_table[sz(l)] = {host_input[sz(l)].data(),   conv_w[sz(l)].host_ref(),
                            host_a[sz(l)].data(),       host_b[sz(l)].data(),
                            A_log[sz(l)].host_ref(),    dt_bias[sz(l)].host_ref(),
                            cpu_conv_out[sz(l)].data(), cpu_out[sz(l)].data()};
      }
      cpu::recurrent_layers_rows({cpu_table.data(), cpu_table.data(), nl}, C, K, cpu_desc.data(), R,
                                 L.max_n, h);
      for (int64_t l = 0; l < nl; ++l) {
        const std::string at = what + ", layer " + std::to_string(l);
        const auto got_out = out[sz(l)].download();
        EXPECT_TRUE(bitwise_equal(conv_out[sz(l)].download(), ref_conv_out[sz(l)].download()))
            << at << ": conv out";
        EXPECT_TRUE(bitwise_equal(got_out, ref_out[sz(l)].download())) << at << ": delta out";
        for (int64_t r = 0; r < R; ++r) {
          const size_t i = sz(l * R + r);
          EXPECT_TRUE(bitwise_equal(conv[i].download(), ref_conv[i].download()))
              << at << ", row " << r << ": conv state";
          EXPECT_TRUE(bitwise_equal(state[i].download(), ref_state[i].download()))
              << at << ", row " << r << ": state";
          EXPECT_TRUE(near_blocks(state[i].download(), cpu_state[i], sz(h.dk * h.dv), kDeltaRel,
                                  kDeltaRel * max_abs(cpu_state[i])))
              << at << ", row " << r << ": state vs CPU";
          const int64_t t0 = L.first[sz(r)], n = L.n[sz(r)];
          if (n == 0) continue;  // an idle row has no outputs
          EXPECT_TRUE(near_blocks(slice(got_out, sz(t0 * vr), sz(n * vr)),
                                  slice(cpu_out[sz(l)], sz(t0 * vr), sz(n * vr)), sz(h.dv),
                                  kDeltaRel, kDeltaRel * max_abs(cpu_out[sz(l)])))
              << at << ", row " << r << ": delta out vs CPU";
        }
      }
    }
  }
}

// The batched ops captured into a CUDA graph once and replayed after the descriptors (and inputs)
// changed under it: other row lengths, token order, states and per-token-state choices, and an
// idle row (n = 0, whose states must stay as they were). Each replay gives the single-row bits.
TEST_F(CudaBatchInvariance, RecurrentRowsGraphReplaysWithNewDescriptors) {
  const RowsLayout layouts[] = {
      rows_layout({1, 4, 1, 9, 2, 0}, {true, false, false, true, true, false}, {0, 1, 2, 3, 4, 5}),
      rows_layout({9, 0, 2, 1, 4, 1}, {false, true, true, false, false, true}, {4, 2, 0, 5, 1, 3}),
      rows_layout({1, 1, 1, 1, 1, 1}, {false, false, false, false, false, false},
                  {5, 4, 3, 2, 1, 0})};
  for (const RecurrentShape& s : {kRowsShapes[0], kRowsShapes[1]}) {
    std::mt19937 rng(static_cast<uint32_t>(223 + s.channels));
    RecurrentBatch B = recurrent_batch(s, layouts[0].tokens, 6, rng);
    // Captured under the first layout: its row count (6) and max_n (9) hold for every later one.
    load(B, layouts[0], rng);
    void* graph = cuda::graph_capture([&] { run_rows(B); });
    for (size_t i = 0; i < std::size(layouts); ++i) {
      const std::string what = shape_name(s) + ", replay " + std::to_string(i);
      load(B, layouts[i], rng);
      cuda::graph_launch(graph);
      expect_rows_equal_single_calls(B, what);
    }
    cuda::graph_destroy(graph);
  }
}

// linear_split writes each column slice of a stacked weight to its own buffer: every value is
// bitwise the one a plain linear over the whole weight gives, at decode, window and batch sizes,
// and in prefill mode (cuBLAS chunks, then copies).
TEST_F(CudaTest, LinearSplitEqualsLinearColumns) {
  std::mt19937 rng(77);
  const int64_t K = 1024;
  const std::vector<int64_t> cols = {512, 256, 16, 16};  // like DeltaNet's qkv | z | b | a
  int64_t N = 0;
  for (int64_t c : cols) N += c;
  std::vector<uint16_t> wh(sz(N * K));
  {
    const std::vector<float> wf = randn(sz(N * K), rng, 0.03f);
    for (size_t i = 0; i < wh.size(); ++i) wh[i] = f32_to_bf16(wf[i]);
  }
  DeviceBuffer<uint16_t> w(wh);
  const ops::WeightRef ref{DType::BF16, w.get(), N, K, {}};
  for (bool prefill : {false, true}) {
    cuda::set_prefill(prefill);
    for (int64_t m : {1, 4, 9, 40, 300}) {
      DeviceBuffer<float> x(randn(sz(m * K), rng));
      DeviceBuffer<float> y(sz(m * N));
      cuda::linear(x.get(), m, ref, y.get());
      std::vector<DeviceBuffer<float>> parts;
      std::vector<ops::OutputSlice> slices;
      for (int64_t c : cols) {
        parts.emplace_back(sz(m * c));
        slices.push_back({parts.back().get(), c});
      }
      cuda::linear_split(x.get(), m, ref, slices.data(), static_cast<int>(slices.size()));
      const std::vector<float> full = y.download();
      int64_t c0 = 0;
      for (size_t p = 0; p < cols.size(); ++p) {
        const std::vector<float> got = parts[p].download();
        std::vector<float> want(sz(m * cols[p]));
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < cols[p]; ++c)
            want[sz(r * cols[p] + c)] = full[sz(r * N + c0 + c)];
        EXPECT_TRUE(bitwise_equal(got, want))
            << "slice " << p << " m " << m << " prefill " << prefill;
        c0 += cols[p];
      }
    }
  }
  cuda::set_prefill(false);
  const ops::OutputSlice short_slice{nullptr, 5};
  EXPECT_THROW(cuda::linear_split(nullptr, 1, ref, &short_slice, 1), Error);
}

// linear_split with a DeltaNet's conv on its first slice (the in-projection's q|k|v): every
// output, conv state and per-token window is bitwise the product followed by
// causal_conv_silu_rows, where decode steps (rows of one token each, up to one m-tile) run the
// conv inside the product and other calls (windows, more rows, prefill) after it. Rows keep their
// windows (conv_after) or not, settle their token or not; the weights take both warp counts and
// the one-n-tile rule, and one row folds its input norm too.
TEST_F(CudaTest, LinearSplitConvIsTheProductThenTheConv) {
  std::mt19937 rng(79);
  constexpr int64_t K = 256, kTaps = 4, H = kTaps - 1;
  struct Shape {
    std::vector<int64_t> cols;  // qkv | z | b | a
  };
  const std::vector<Shape> shapes = {{{512, 256, 16, 16}},   // 8 k-split warps
                                     {{8192, 128, 16, 16}},  // 4 warps (>= 8,192 rows)
                                     {{240, 16, 16}}};       // one n-tile a warp (few groups)
  const F32Weight norm_w = f32_weight(randn(sz(K), rng, 0.1f), K, 1);
  const ops::RowNorm norm{norm_w.dev_ref(), true, 1e-6f};
  for (const Shape& shape : shapes) {
    int64_t N = 0;
    for (int64_t c : shape.cols) N += c;
    const int64_t C = shape.cols[0];
    const Bf16Matrix w = bf16_matrix(N, K, rng);
    const F32Weight conv_w = f32_weight(randn(sz(C * kTaps), rng, 0.5f), C, kTaps);
    for (bool prefill : {false, true}) {
      cuda::set_prefill(prefill);
      // (tokens per row, rows): decode steps of 1..16 rows (folded), more rows and windows.
      for (const auto& [n, R] : std::vector<std::pair<int64_t, int64_t>>{
               {1, 1}, {1, 2}, {1, 4}, {1, 5}, {1, 16}, {1, 17}, {2, 3}, {4, 4}}) {
        const int64_t m = n * R;
        const std::vector<float> xh = randn(sz(m * K), rng);
        DeviceBuffer<float> x(xh);
        std::vector<std::vector<float>> state0(sz(R));
        for (auto& s0 : state0) s0 = randn(sz(C * H), rng);
        // Two runs on fresh copies of the states: [0] the product then the conv, [1] one call.
        struct Run {
          std::vector<DeviceBuffer<float>> parts, states, after;
          DeviceBuffer<float> out;
          DeviceBuffer<ops::RecurrentRow> desc;
        };
        Run run[2];
        for (Run& r : run) {
          std::vector<ops::OutputSlice> slices;
          for (int64_t c : shape.cols) {
            r.parts.push_back(nan_buffer(sz(m * c)));
            slices.push_back({r.parts.back().get(), c});
          }
          r.out = nan_buffer(sz(m * C));
          std::vector<ops::RecurrentRow> desc(sz(R));
          for (int64_t i = 0; i < R; ++i) {
            r.states.emplace_back(state0[sz(i)]);
            const bool keeps = i % 3 == 1;
            r.after.push_back(nan_buffer(keeps ? sz(n * C * H) : 0));
            ops::RecurrentRow& d = desc[sz(i)];
            d.first_token = i * n;
            d.n = n;
            d.conv_state = r.states.back().get();
            d.conv_after = r.after.back().get();
            d.settled = i % 4 == 2 ? 0 : -1;
          }
          r.desc = DeviceBuffer<ops::RecurrentRow>(desc);
          const ops::RowNorm* fold = m == 1 ? &norm : nullptr;
          if (&r == &run[0]) {
            cuda::linear_split(x.get(), m, w.dev_ref(), slices.data(),
                               static_cast<int>(slices.size()), fold);
            cuda::causal_conv_silu_rows(r.parts[0].get(), C, kTaps, conv_w.dev_ref(), r.desc.get(),
                                        R, n, r.out.get());
          } else {
            const ops::SliceConv conv{conv_w.dev_ref(), kTaps, r.desc.get(), R, n, r.out.get()};
            cuda::linear_split(x.get(), m, w.dev_ref(), slices.data(),
                               static_cast<int>(slices.size()), fold, nullptr, &conv);
          }
        }
        const std::string what = "qkv " + std::to_string(C) + ", " + std::to_string(R) +
                                 " rows of " + std::to_string(n) + ", prefill " +
                                 std::to_string(prefill);
        EXPECT_TRUE(bitwise_equal(run[1].out.download(), run[0].out.download())) << what;
        for (size_t p = 0; p < shape.cols.size(); ++p)
          EXPECT_TRUE(bitwise_equal(run[1].parts[p].download(), run[0].parts[p].download()))
              << what << ", slice " << p;
        for (size_t i = 0; i < sz(R); ++i) {
          EXPECT_TRUE(bitwise_equal(run[1].states[i].download(), run[0].states[i].download()))
              << what << ", state of row " << i;
          if (run[0].after[i].size() > 0) {
            EXPECT_TRUE(bitwise_equal(run[1].after[i].download(), run[0].after[i].download()))
                << what << ", windows of row " << i;
          }
        }
        // The conv did run: row 0 settles its tokens, so its state moved on.
        const std::vector<float> moved = run[1].states[0].download();
        EXPECT_FALSE(bitwise_equal(moved, state0[0])) << what;
      }
    }
  }
  cuda::set_prefill(false);
}

// A prefetch hint (another weight for L2 to fetch as the projection's blocks finish) changes no
// value and no byte of either weight, whatever its size or alignment, at every row count: the
// decode and verify shapes that issue it and the batches and prefill that ignore it. The same
// for the hint of linear_add (with and without its gated norm) and of swiglu_mlp_add.
TEST_F(CudaTest, ProjectionPrefetchChangesNoValue) {
  std::mt19937 rng(78);
  const int64_t K = 1024, N = 272, NP = 4096, I = 256, HD = 128;
  const Bf16Matrix w = bf16_matrix(N, K, rng), p = bf16_matrix(NP, K, rng);
  const ops::WeightRef ref = w.dev_ref();
  // linear_add's [K, K] weight, the MLP's gate/up [2I, K] and down [K, I].
  const Bf16Matrix sq = bf16_matrix(K, K, rng), gu = bf16_matrix(2 * I, K, rng),
                   dn = bf16_matrix(K, I, rng);
  const ops::WeightRef sq_ref = sq.dev_ref(), gu_ref = gu.dev_ref(), dn_ref = dn.dev_ref();
  const F32Weight gnw = f32_weight(randn(sz(HD), rng, 0.1f, 1.0f), 1, HD);
  const ops::WeightRef whole = p.dev_ref();
  // 2 bytes past a 16-byte boundary, ending mid-row: the fetch keeps to whole 16-byte pieces
  // inside the range.
  const ops::WeightRef odd{DType::BF16, p.dev.get() + 1, 7, 333, {}};
  const std::vector<ops::WeightRef> hints = {whole, ops::leading_rows(whole, 0.5),
                                             ops::leading_rows(whole, 0.0), odd};
  for (bool prefill : {false, true}) {
    cuda::set_prefill(prefill);
    for (int64_t m : {1, 4, 16, 17, 40}) {
      DeviceBuffer<float> x(randn(sz(m * K), rng));
      DeviceBuffer<float> want(sz(m * N));
      const ops::OutputSlice plain{want.get(), N};
      cuda::linear_split(x.get(), m, ref, &plain, 1);
      const std::vector<float> expected = want.download();
      for (size_t h = 0; h < hints.size(); ++h) {
        DeviceBuffer<float> got(sz(m * N));
        const ops::OutputSlice out{got.get(), N};
        cuda::linear_split(x.get(), m, ref, &out, 1, nullptr, &hints[h]);
        EXPECT_TRUE(bitwise_equal(got.download(), expected))
            << "hint " << h << " m " << m << " prefill " << prefill;
      }
      const std::vector<float> y0 = randn(sz(m * K), rng);
      DeviceBuffer<float> z(randn(sz(m * K), rng));
      const ops::GatedNorm gated{z.get(), gnw.dev_ref(), 1e-6f};
      for (const ops::GatedNorm* norm : {static_cast<const ops::GatedNorm*>(nullptr), &gated}) {
        DeviceBuffer<float> y_want(y0), y_got(y0);
        cuda::linear_add(x.get(), m, sq_ref, y_want.get(), norm);
        cuda::linear_add(x.get(), m, sq_ref, y_got.get(), norm, &hints[0]);
        EXPECT_TRUE(bitwise_equal(y_got.download(), y_want.download()))
            << "linear_add m " << m << " gated " << (norm != nullptr) << " prefill " << prefill;
      }
      DeviceBuffer<float> y_want(y0), y_got(y0);
      cuda::swiglu_mlp_add(x.get(), m, gu_ref, dn_ref, y_want.get());
      cuda::swiglu_mlp_add(x.get(), m, gu_ref, dn_ref, y_got.get(), nullptr, &hints[1]);
      EXPECT_TRUE(bitwise_equal(y_got.download(), y_want.download()))
          << "swiglu_mlp_add m " << m << " prefill " << prefill;
    }
  }
  cuda::set_prefill(false);
  EXPECT_EQ(w.dev.download(), w.host);
  EXPECT_EQ(p.dev.download(), p.host);
}

// The recurrence reading q, k, v in place from a conv output ([q | k | v] per token,
// qkv_token_stride apart) gives the bits of packed inputs, for every row of a batched call.
TEST_F(CudaTest, DeltaRuleReadsStridedQkvLikePacked) {
  std::mt19937 rng(91);
  const int64_t nk = 16, nv = 32, d = 128, kd = nk * d, vd = nv * d, cd = 2 * kd + vd;
  const std::vector<int64_t> lens = {3, 1, 5};
  int64_t T = 0;
  for (int64_t n : lens) T += n;
  const std::vector<float> conv = randn(sz(T * cd), rng);
  std::vector<float> q(sz(T * kd)), k(q.size()), v(sz(T * vd));
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(conv.begin() + t * cd, kd, q.begin() + t * kd);
    std::copy_n(conv.begin() + t * cd + kd, kd, k.begin() + t * kd);
    std::copy_n(conv.begin() + t * cd + 2 * kd, vd, v.begin() + t * vd);
  }
  const std::vector<float> a = randn(sz(T * nv), rng), b = randn(sz(T * nv), rng);
  const std::vector<float> state0 = randn(sz(3 * nv * d * d), rng, 0.1f);
  DeviceBuffer<float> dconv(conv), dq(q), dk(k), dv(v), da(a), db(b);
  DeviceBuffer<float> alog(uniform(sz(nv), rng, 0.0f, 2.0f)), dtb(uniform(sz(nv), rng, 0.5f, 1.5f));
  const ops::WeightRef A{DType::F32, alog.get(), 1, nv, {}}, B{DType::F32, dtb.get(), 1, nv, {}};
  std::vector<std::vector<float>> outs, states;
  for (bool strided : {false, true}) {
    DeviceBuffer<float> st(state0), out(sz(T * vd)), after(sz(5 * nv * d * d));
    std::vector<ops::RecurrentRow> rows;
    int64_t t0 = 0;
    for (size_t r = 0; r < lens.size(); ++r) {
      ops::RecurrentRow row;
      row.first_token = t0;
      row.n = lens[r];
      row.state = st.get() + r * nv * d * d;
      row.state_after = r == 2 ? after.get() : nullptr;
      rows.push_back(row);
      t0 += lens[r];
    }
    DeviceBuffer<ops::RecurrentRow> drows(rows);
    ops::DeltaHeads h{nk, nv, d, d};
    if (strided) h.qkv_token_stride = cd;
    const float* pq = strided ? dconv.get() : dq.get();
    const float* pk = strided ? dconv.get() + kd : dk.get();
    const float* pv = strided ? dconv.get() + 2 * kd : dv.get();
    cuda::gated_delta_rule_rows(pq, pk, pv, da.get(), db.get(), A, B, drows.get(), 3, 5, h,
                                out.get());
    outs.push_back(out.download());
    std::vector<float> s_all = st.download(), s_after = after.download();
    s_all.insert(s_all.end(), s_after.begin(), s_after.end());
    states.push_back(s_all);
  }
  EXPECT_TRUE(bitwise_equal(outs[1], outs[0]));
  EXPECT_TRUE(bitwise_equal(states[1], states[0]));
}

}  // namespace
}  // namespace tandem
