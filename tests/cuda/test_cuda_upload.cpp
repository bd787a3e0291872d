// Staged uploads on the GPU (backend/staged_upload.h): small ones are a kernel reading the mapped
// pinned staging, large ones a copy-engine transfer; either way the destination holds exactly the
// staged bytes, no byte around it changes, and the upload keeps its place in the stream: kernels
// queued before it read the old contents, kernels queued after it the new ones.
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

class CudaUpload : public CudaTest {};

TEST_F(CudaUpload, LandsTheStagedBytesAtEverySizeAndAlignment) {
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

TEST_F(CudaUpload, KeepsItsPlaceBetweenTheKernelsAroundIt) {
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

}  // namespace
}  // namespace tandem
