// Copies into device memory on the GPU: staged uploads (backend/staged_upload.h) and copies between
// device buffers (ops::copy). Small ones are a kernel (reading the mapped pinned staging, or device
// memory), large ones a copy-engine transfer; either way the destination holds exactly the source
// bytes, no byte around it changes, and the copy keeps its place in the stream: kernels queued
// before it read the old contents, kernels queued after it the new ones.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/ops.h"
#include "tandem/backend/readback.h"
#include "tandem/backend/staged_upload.h"

namespace tandem {
namespace {

using testing::CudaTest;
using testing::DeviceBuffer;
using testing::ScopedBackend;

class CudaCopies : public CudaTest {};

TEST_F(CudaCopies, UploadsLandTheStagedBytesAtEverySizeAndAlignment) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const size_t span = cuda::kKernelUploadBytes + 4096;
  const std::vector<uint8_t> fence(span, 0xab);
  DeviceBuffer<uint8_t> dev(fence);
  StagedUpload up;
  int round = 0;
  // Byte and 16-byte kernel paths (destinations and sizes off and on the 16-byte grid), the
  // largest kernel upload and the first one past it (the copy engine).
  for (const size_t offset : {size_t{0}, size_t{1}, size_t{16}, size_t{17}})
    for (const size_t bytes :
         {size_t{1}, size_t{4}, size_t{15}, size_t{16}, size_t{48}, size_t{4100},
          cuda::kKernelUploadBytes, cuda::kKernelUploadBytes + 16}) {
      ++round;
      uint8_t* h = up.host(bytes);
      for (size_t i = 0; i < bytes; ++i) h[i] = static_cast<uint8_t>((i * 131 + round) % 251);
      up.start(dev.get() + offset, bytes);
      std::vector<uint8_t> got(offset + bytes + 64);
      ops::copy_to_host(got.data(), dev.get(), got.size());
      for (size_t i = 0; i < got.size(); ++i) {
        const bool inside = i >= offset && i < offset + bytes;
        const uint8_t want =
            inside ? static_cast<uint8_t>(((i - offset) * 131 + round) % 251) : uint8_t{0xab};
        ASSERT_EQ(got[i], want) << "offset " << offset << " bytes " << bytes << " at " << i
                                << (inside ? " (uploaded)" : " (outside the upload)");
      }
      ops::copy_from_host(dev.get(), fence.data(), fence.size());  // restore the fence
    }
}

TEST_F(CudaCopies, AnUploadKeepsItsPlaceBetweenTheKernelsAroundIt) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const size_t n = 4096;  // 16 KiB: the kernel path
  ASSERT_LE(n * sizeof(float), cuda::kKernelUploadBytes);
  DeviceBuffer<float> a(n);
  StagedUpload up;
  auto stage = [&](float base) {
    auto* h = reinterpret_cast<float*>(up.host(n * sizeof(float)));
    for (size_t i = 0; i < n; ++i) h[i] = base + static_cast<float>(i);
    up.start(a.get(), n * sizeof(float));
  };
  Readback first, second;
  for (int round = 1; round <= 50; ++round) {
    const float b1 = static_cast<float>(round) * 10000.0f, b2 = b1 + 5000.0f;
    // upload, a kernel that must read it, a read, a second upload that must wait for both.
    stage(b1);
    ops::scale(a.get(), static_cast<int64_t>(n), 2.0f);
    first.start(a.get(), n * sizeof(float));
    stage(b2);
    ops::scale(a.get(), static_cast<int64_t>(n), 3.0f);
    second.start(a.get(), n * sizeof(float));
    const auto* got1 = static_cast<const float*>(first.wait());
    const auto* got2 = static_cast<const float*>(second.wait());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(got1[i], 2.0f * (b1 + static_cast<float>(i))) << "round " << round << " at " << i;
      ASSERT_EQ(got2[i], 3.0f * (b2 + static_cast<float>(i))) << "round " << round << " at " << i;
    }
  }
}

// StagedUpload::start_together (cuda::copy_from_pinned_parts): up to a launch's parts in one
// kernel, the rest in the next, a part past the kernel bound through the copy engine; each lands
// exactly its staged bytes at its own size and alignment, and nothing around it changes.
TEST_F(CudaCopies, UploadsStartedTogetherLandEachPartsBytes) {
  ScopedBackend cuda(ops::Backend::Cuda);
  struct Case {
    size_t offset, bytes;
  };
  const std::vector<Case> cases = {
      {0, 16}, {1, 5}, {16, 4100}, {3, 48}, {32, 1}, {17, 333}, {0, cuda::kKernelUploadBytes + 16}};
  const size_t span = cuda::kKernelUploadBytes + 4096;
  const std::vector<uint8_t> fence(span, 0xab);
  std::vector<DeviceBuffer<uint8_t>> devs;
  std::vector<StagedUpload> ups(cases.size());
  std::vector<StagedUpload::Part> parts;
  for (size_t p = 0; p < cases.size(); ++p) {
    devs.emplace_back(fence);
    uint8_t* h = ups[p].host(cases[p].bytes);
    for (size_t i = 0; i < cases[p].bytes; ++i) h[i] = static_cast<uint8_t>((i * 7 + p * 31) % 253);
    parts.push_back({&ups[p], devs[p].get() + cases[p].offset, cases[p].bytes});
  }
  StagedUpload::start_together(parts);
  for (size_t p = 0; p < cases.size(); ++p) {
    std::vector<uint8_t> got(cases[p].offset + cases[p].bytes + 64);
    ops::copy_to_host(got.data(), devs[p].get(), got.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const bool inside = i >= cases[p].offset && i < cases[p].offset + cases[p].bytes;
      const uint8_t want =
          inside ? static_cast<uint8_t>(((i - cases[p].offset) * 7 + p * 31) % 253) : uint8_t{0xab};
      ASSERT_EQ(got[i], want) << "part " << p << " at " << i
                              << (inside ? " (uploaded)" : " (outside the upload)");
    }
  }
}

// An upload whose destination's readers have completed (StagedUpload::consumed) runs beside the
// work queued since, on a second stream: a kernel queued after it still reads its bytes, kernels
// queued before it on other buffers are untouched, and an upload whose readers may still run
// keeps its place behind them.
TEST_F(CudaCopies, AnUploadAfterItsReadersCompletedLandsBeforeTheNextKernel) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const size_t n = 2048;
  DeviceBuffer<float> meta(n), busy(size_t{1} << 22);
  StagedUpload up;
  Readback read;
  for (int round = 1; round <= 30; ++round) {
    const float base = static_cast<float>(round) * 1000.0f;
    auto* h = reinterpret_cast<float*>(up.host(n * sizeof(float)));
    for (size_t i = 0; i < n; ++i) h[i] = base + static_cast<float>(i);
    // Work on another buffer queued before the upload (what the draft chain is to a verify).
    for (int k = 0; k < 20; ++k) ops::scale(busy.get(), int64_t{1} << 22, 1.0f);
    up.start(meta.get(), n * sizeof(float));
    ops::scale(meta.get(), static_cast<int64_t>(n), 2.0f);  // the reader
    up.consumed();
    read.start(meta.get(), n * sizeof(float));
    const auto* got = static_cast<const float*>(read.wait());
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i], 2.0f * (base + static_cast<float>(i))) << "round " << round << " at " << i;
    if (round % 3 == 0) {
      // Readers still queued (no wait since): the next upload must land after them.
      for (int k = 0; k < 20; ++k) ops::scale(meta.get(), static_cast<int64_t>(n), 2.0f);
      up.consumed();
      auto* h2 = reinterpret_cast<float*>(up.host(n * sizeof(float)));
      for (size_t i = 0; i < n; ++i) h2[i] = -1.0f;
      up.start(meta.get(), n * sizeof(float));
      read.start(meta.get(), n * sizeof(float));
      const auto* after = static_cast<const float*>(read.wait());
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(after[i], -1.0f) << "round " << round;
    }
  }
}

// Streams run in order, so once the host has waited for a read, every read queued before it has
// landed too: waiting for one of those costs no device call (no time in cuda::wait_seconds()),
// and it still hands out the bytes of its own point in the stream.
TEST_F(CudaCopies, AReadQueuedBeforeOneWaitedForNeedsNoWait) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const size_t n = size_t{1} << 22;  // 16 MiB: each scale keeps the device busy a while
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 1000);
  DeviceBuffer<float> a(x);
  const size_t head = 64;
  Readback early, late;
  for (int round = 0; round < 5; ++round) {
    ops::scale(a.get(), static_cast<int64_t>(n), 2.0f);
    early.start(a.get(), head * sizeof(float));
    for (int i = 0; i < 8; ++i) ops::scale(a.get(), static_cast<int64_t>(n), 1.5f);
    late.start(a.get(), head * sizeof(float));
    const double before_late = cuda::wait_seconds();
    const auto* got_late = static_cast<const float*>(late.wait());
    const double after_late = cuda::wait_seconds();
    EXPECT_GT(after_late, before_late) << "round " << round << ": the late read was not waited for";
    const auto* got_early = static_cast<const float*>(early.wait());
    EXPECT_EQ(cuda::wait_seconds(), after_late)
        << "round " << round << ": the early read waited although the late one had landed";
    for (size_t i = 0; i < head; ++i) {
      x[i] *= 2.0f;  // the host's mirror of the first `head` values, one scale at a time
      ASSERT_EQ(got_early[i], x[i]) << "round " << round << " at " << i;
      for (int k = 0; k < 8; ++k) x[i] *= 1.5f;
      ASSERT_EQ(got_late[i], x[i]) << "round " << round << " at " << i;
    }
  }
}

TEST_F(CudaCopies, DeviceCopiesLandTheSourceBytesAtEverySizeAndAlignment) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const size_t span = cuda::kKernelDeviceCopyBytes + 4096;
  std::vector<uint8_t> source(span);
  for (size_t i = 0; i < span; ++i) source[i] = static_cast<uint8_t>((i * 37 + 11) % 253);
  const std::vector<uint8_t> fence(span, 0xab);
  DeviceBuffer<uint8_t> src(source), dst(fence);
  for (const size_t from : {size_t{0}, size_t{5}, size_t{16}})
    for (const size_t to : {size_t{0}, size_t{1}, size_t{16}, size_t{17}})
      for (const size_t bytes : {size_t{1}, size_t{15}, size_t{16}, size_t{48}, size_t{4100},
                                 cuda::kKernelDeviceCopyBytes, cuda::kKernelDeviceCopyBytes + 16}) {
        ops::copy(dst.get() + to, src.get() + from, bytes);
        std::vector<uint8_t> got(to + bytes + 64);
        ops::copy_to_host(got.data(), dst.get(), got.size());
        for (size_t i = 0; i < got.size(); ++i) {
          const bool inside = i >= to && i < to + bytes;
          ASSERT_EQ(got[i], inside ? source[from + i - to] : uint8_t{0xab})
              << "from " << from << " to " << to << " bytes " << bytes << " at " << i;
        }
        ops::copy_from_host(dst.get(), fence.data(), fence.size());
      }
  // Overlapping ranges keep the copy engine's behaviour: a forward move of 16 bytes.
  ops::copy(src.get() + 8, src.get(), 16);
  std::vector<uint8_t> got(24);
  ops::copy_to_host(got.data(), src.get(), got.size());
  for (size_t i = 0; i < 16; ++i) EXPECT_EQ(got[8 + i], source[i]) << i;
}

TEST_F(CudaCopies, ADeviceCopyKeepsItsPlaceBetweenTheKernelsAroundIt) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const size_t n = 1 << 16;  // 256 KiB: the kernel path
  ASSERT_LE(n * sizeof(float), cuda::kKernelDeviceCopyBytes);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i);
  DeviceBuffer<float> a(x), b(n);
  Readback read;
  for (int round = 1; round <= 50; ++round) {
    // a *= 2 (a kernel), b = a (must see it), b *= 3 (must see the copy), a *= 2 again (must not
    // change what the copy read).
    ops::scale(a.get(), static_cast<int64_t>(n), 2.0f);
    ops::copy(b.get(), a.get(), n * sizeof(float));
    ops::scale(b.get(), static_cast<int64_t>(n), 3.0f);
    ops::scale(a.get(), static_cast<int64_t>(n), 0.5f);
    read.start(b.get(), n * sizeof(float));
    const auto* got = static_cast<const float*>(read.wait());
    for (size_t i = 0; i < n; i += 7)
      ASSERT_EQ(got[i], 6.0f * x[i]) << "round " << round << " at " << i;
  }
}

}  // namespace
}  // namespace tandem
