// Helpers for the CUDA op tests: an RAII device buffer, a fixture that fails (never skips) when
// no CUDA device is present, and comparisons that report where and by how much results differ.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/ops.h"
#include "tandem/core/dtype.h"
#include "tandem/core/error.h"

namespace tandem::testing {

// `n` elements of T in device memory (tandem::cuda::alloc / free). Move-only.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n_ > 0) p_ = static_cast<T*>(cuda::alloc(n_ * sizeof(T)));
  }
  // Allocates host.size() elements and uploads them.
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }

  T* get() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

  // Host → device: host.size() elements starting at element `offset`.
  void upload(const std::vector<T>& host, size_t offset = 0) {
    if (offset + host.size() > n_)
      fail("DeviceBuffer::upload: ", host.size(), " elements at ", offset, " overflow a buffer of ",
           n_);
    if (!host.empty()) cuda::copy_to_device(p_ + offset, host.data(), host.size() * sizeof(T));
  }
  // Device → host: `count` elements starting at `offset` (all by default). Waits for the stream.
  std::vector<T> download(size_t offset = 0, size_t count = SIZE_MAX) const {
    if (count == SIZE_MAX) count = n_ - offset;
    if (offset + count > n_)
      fail("DeviceBuffer::download: ", count, " elements at ", offset, " overflow a buffer of ",
           n_);
    std::vector<T> host(count);
    if (count > 0) cuda::copy_to_host(host.data(), p_ + offset, count * sizeof(T));
    return host;
  }

 private:
  void release() noexcept {
    try {
      cuda::free(p_);
    } catch (...) {
    }
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
};

// A device float buffer filled with quiet NaNs: an output an op forgets to write stays NaN and
// fails the comparison (a fresh cudaMalloc may otherwise hand back a previous call's results).
inline DeviceBuffer<float> nan_buffer(size_t n) {
  return DeviceBuffer<float>(std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()));
}

// Makes `b` the active backend for the scope. Models, states and drafters must be used under the
// backend they were created with.
class ScopedBackend {
 public:
  explicit ScopedBackend(ops::Backend b) : prev_(ops::backend()) { ops::set_backend(b); }
  ~ScopedBackend() { ops::set_backend(prev_); }
  ScopedBackend(const ScopedBackend&) = delete;
  ScopedBackend& operator=(const ScopedBackend&) = delete;

 private:
  ops::Backend prev_;
};

// Every CUDA test derives from this. These tests only run on GPU machines, so a missing device
// is a failure with a clear message, not a silent skip. Each test leaves linear in its default
// (non-prefill) mode and surfaces asynchronous kernel errors at its end.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::available()) {
      GTEST_FAIL() << "no usable CUDA device (tandem::cuda::available() is false): the `cuda` "
                      "test label must run on a machine with an NVIDIA GPU";
    }
    cuda::set_prefill(false);
  }
  void TearDown() override {
    if (!cuda::available()) return;
    EXPECT_NO_THROW(cuda::synchronize()) << "a kernel of this test failed asynchronously";
    cuda::set_prefill(false);
  }
};

template <class P>
class CudaParamTest : public CudaTest, public ::testing::WithParamInterface<P> {};

// --- Host-side data --------------------------------------------------------------------------

inline std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.0f,
                                float mean = 0.0f) {
  std::normal_distribution<float> nd(mean, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

inline std::vector<float> uniform(size_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> ud(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = ud(rng);
  return v;
}

inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  return h;
}

// Each value rounded to bf16 and back: what the CUDA linear actually multiplies.
inline std::vector<float> round_bf16(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = bf16_to_f32(f32_to_bf16(v[i]));
  return r;
}

template <class T>
std::vector<T> slice(const std::vector<T>& v, size_t offset, size_t count) {
  return std::vector<T>(v.begin() + static_cast<std::ptrdiff_t>(offset),
                        v.begin() + static_cast<std::ptrdiff_t>(offset + count));
}

// --- Comparisons -----------------------------------------------------------------------------

// got ≈ want, where element i may differ by rel · (max |want| over its block of `block`
// consecutive elements) + abs. Blocks are rows (a token's outputs, a head's vector); block = 1
// makes the tolerance per element. Fails on NaN/Inf in `got`, on size mismatch, and on an
// all-zero reference (a setup bug that would let a broken op pass).
inline ::testing::AssertionResult near_blocks(const std::vector<float>& got,
                                              const std::vector<float>& want, size_t block,
                                              double rel, double abs = 0.0) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  if (block == 0) block = want.size();
  double ref_max = 0.0;
  for (float w : want) ref_max = std::max(ref_max, std::fabs(static_cast<double>(w)));
  if (!(ref_max > 0.0))
    return ::testing::AssertionFailure() << "reference is all zeros (test setup bug)";
  size_t bad = 0, first = SIZE_MAX;
  double worst = 0.0;  // max |got - want| / allowed
  size_t worst_i = 0;
  for (size_t b0 = 0; b0 < want.size(); b0 += block) {
    const size_t b1 = std::min(want.size(), b0 + block);
    double scale = 0.0;
    for (size_t i = b0; i < b1; ++i)
      scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    const double allowed = rel * scale + abs;
    for (size_t i = b0; i < b1; ++i) {
      const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
      const bool ok = std::isfinite(got[i]) && err <= allowed;
      const double ratio = allowed > 0 ? err / allowed : (err > 0 ? INFINITY : 0.0);
      if (!std::isfinite(got[i]) || ratio > worst) {
        worst = std::isfinite(got[i]) ? ratio : INFINITY;
        worst_i = i;
      }
      if (!ok) {
        ++bad;
        if (first == SIZE_MAX) first = i;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  const size_t wb0 = worst_i / block * block;
  double wscale = 0.0;
  for (size_t i = wb0; i < std::min(want.size(), wb0 + block); ++i)
    wscale = std::max(wscale, std::fabs(static_cast<double>(want[i])));
  return ::testing::AssertionFailure()
         << bad << " of " << want.size() << " elements outside rel " << rel << " (block " << block
         << ", abs " << abs << "); first at " << first << " (block " << first / block << ", offset "
         << first % block << "): got " << got[first] << " want " << want[first] << "; worst at "
         << worst_i << ": got " << got[worst_i] << " want " << want[worst_i]
         << ", |diff|/block max = "
         << std::fabs(static_cast<double>(got[worst_i]) - want[worst_i]) / wscale << " (" << worst
         << "x allowed)";
}

// Bitwise equality of n values; reports the first differing index.
template <class T>
::testing::AssertionResult bitwise_equal(const T* got, const T* want, size_t n) {
  if (std::memcmp(got, want, n * sizeof(T)) == 0) return ::testing::AssertionSuccess();
  size_t diff = 0, first = SIZE_MAX;
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(got + i, want + i, sizeof(T)) != 0) {
      ++diff;
      if (first == SIZE_MAX) first = i;
    }
  auto r = ::testing::AssertionFailure();
  r << diff << " of " << n << " values differ bitwise; first at " << first;
  if constexpr (std::is_floating_point_v<T>) {
    r << ": got " << static_cast<double>(got[first]) << " want " << static_cast<double>(want[first])
      << " (diff " << static_cast<double>(got[first]) - static_cast<double>(want[first]) << ")";
  } else {
    r << ": got " << +got[first] << " want " << +want[first];
  }
  return r;
}

template <class T>
::testing::AssertionResult bitwise_equal(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  return bitwise_equal(got.data(), want.data(), got.size());
}

}  // namespace tandem::testing
