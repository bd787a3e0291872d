// The kernel timeline of diagnostic builds (cmake -DTANDEM_CUDA_TRACE=ON): every kernel leaves
// one mark, in launch order, with its unit and launch shape. Default builds compile no kernel
// marks and this file holds no tests.
#include <string>

#include "cuda_test_util.h"
#include "tandem/backend/graph_cache.h"

#if TANDEM_CUDA_TRACE

namespace tandem::testing {
namespace {

using CudaTrace = CudaTest;

TEST_F(CudaTrace, EveryKernelLeavesOneMarkInLaunchOrder) {
  constexpr int64_t kRows = 3, kVocab = 50000;
  std::vector<float> logits(kRows * kVocab, 0.0f);
  DeviceBuffer<float> x(logits), y(logits);
  DeviceBuffer<int32_t> picked(kRows);
  cuda::clear_kernel_marks();
  cuda::add_inplace(x.get(), y.get(), kRows * kVocab);               // elementwise.cu
  cuda::argmax_rows(x.get(), kRows, kVocab, picked.get());           // sampling.cu
  cuda::copy_rows(y.get(), kVocab, x.get(), kVocab, kRows, kVocab);  // device.cu
  const std::vector<cuda::KernelMark> marks = cuda::kernel_marks();
  ASSERT_EQ(marks.size(), 3u);
  EXPECT_STREQ(marks[0].unit, "elementwise");
  EXPECT_STREQ(marks[1].unit, "sampling");
  EXPECT_STREQ(marks[2].unit, "device");
  EXPECT_LE(marks[0].ns, marks[1].ns);
  EXPECT_LE(marks[1].ns, marks[2].ns);
  EXPECT_EQ(marks[1].grid[1], static_cast<unsigned>(kRows));  // argmax: one grid row per row
  for (const cuda::KernelMark& m : marks) EXPECT_GT(m.block, 0u);

  cuda::clear_kernel_marks();
  EXPECT_TRUE(cuda::kernel_marks().empty());
}

// A graph launch leaves a "launch" mark carrying the host's clock when it was queued (no kernel
// shape): the capture run launches the graph it captured, the third run replays it.
TEST_F(CudaTrace, GraphLaunchesLeaveTheHostsClock) {
  ScopedBackend cuda_backend(ops::Backend::Cuda);  // GraphCache captures on the CUDA backend only
  DeviceBuffer<float> x(std::vector<float>(256, 1.0f)), y(std::vector<float>(256, 2.0f));
  GraphCache cache;
  const GraphKey key = GraphKey().add(uint64_t{77});
  cuda::clear_kernel_marks();
  for (int i = 0; i < 3; ++i) cache.run(key, [&] { cuda::add_inplace(x.get(), y.get(), 256); });
  const std::vector<cuda::KernelMark> marks = cuda::kernel_marks();
  std::vector<uint64_t> host;
  int kernels = 0;
  for (const cuda::KernelMark& m : marks) {
    if (std::string(m.unit) == "launch") {
      host.push_back(m.host_ns);
    } else {
      EXPECT_EQ(m.host_ns, 0u) << m.unit;
      ++kernels;
    }
  }
  EXPECT_EQ(kernels, 3);  // the eager run, the captured graph's launch, the replay
  ASSERT_EQ(host.size(), 2u);
  EXPECT_GT(host[0], 0u);
  EXPECT_LT(host[0], host[1]);
}

}  // namespace
}  // namespace tandem::testing

#endif
