// Readbacks on the GPU (backend/readback.h): small ones are stored into the mapped pinned buffer
// by a kernel, large ones go through the copy engine; either way wait() returns exactly the
// device bytes as they were when start() was queued, at any size and alignment.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <numeric>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/ops.h"
#include "tandem/backend/readback.h"

namespace tandem {
namespace {

using testing::CudaTest;
using testing::DeviceBuffer;
using testing::ScopedBackend;

class CudaReadback : public CudaTest {};

// Bytes past the largest kernel read (and 64 more for offsets), each a function of its index.
std::vector<uint8_t> patterned_bytes(size_t mul, size_t add, size_t mod) {
  std::vector<uint8_t> host(cuda::kKernelReadbackBytes + 4096 + 64);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>((i * mul + add) % mod);
  return host;
}

TEST_F(CudaReadback, ReturnsTheDeviceBytesAtEverySizeAndAlignment) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const std::vector<uint8_t> host = patterned_bytes(131, 7, 251);
  DeviceBuffer<uint8_t> dev(host);
  Readback rb;
  // Byte and 16-byte paths (offsets and sizes off and on the 16-byte grid), the largest kernel
  // read and the first read past it (the copy engine).
  for (const size_t offset : {size_t{0}, size_t{1}, size_t{16}, size_t{17}})
    for (const size_t bytes :
         {size_t{1}, size_t{4}, size_t{15}, size_t{16}, size_t{48}, size_t{4100}, size_t{65536},
          cuda::kKernelReadbackBytes, cuda::kKernelReadbackBytes + 16}) {
      rb.start(dev.get() + offset, bytes);
      const auto* got = static_cast<const uint8_t*>(rb.wait());
      for (size_t i = 0; i < bytes; ++i)
        ASSERT_EQ(got[i], host[offset + i])
            << "offset " << offset << " bytes " << bytes << " at " << i;
    }
}

TEST_F(CudaReadback, SeesTheWritesOfKernelsQueuedBeforeIt) {
  ScopedBackend cuda(ops::Backend::Cuda);
  std::vector<float> x(1000);
  std::iota(x.begin(), x.end(), 1.0f);
  DeviceBuffer<float> a(x);
  Readback rb;
  for (int round = 1; round <= 50; ++round) {
    // a *= 2, queued right before the readback: the read must see it (exact in fp32).
    ops::scale(a.get(), static_cast<int64_t>(x.size()), 2.0f);
    rb.start(a.get(), sizeof(float) * x.size());
    const auto* got = static_cast<const float*>(rb.wait());
    for (float& v : x) v *= 2.0f;
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(got[i], x[i]) << "round " << round;
  }
}

// ops::copy_to_host: a small read is stored by a kernel into this thread's pinned staging and
// copied out; a large one is a copy-engine transfer. Same bytes, into unaligned pageable memory.
TEST_F(CudaReadback, SynchronousReadsReturnTheDeviceBytes) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const std::vector<uint8_t> host = patterned_bytes(37, 11, 253);
  DeviceBuffer<uint8_t> dev(host);
  for (const size_t offset : {size_t{0}, size_t{3}})
    for (const size_t bytes : {size_t{1}, size_t{4}, size_t{17}, size_t{4096},
                               cuda::kKernelReadbackBytes, cuda::kKernelReadbackBytes + 16}) {
      std::vector<uint8_t> got(bytes + 1, 0);
      ops::copy_to_host(got.data() + 1, dev.get() + offset, bytes);
      for (size_t i = 0; i < bytes; ++i)
        ASSERT_EQ(got[1 + i], host[offset + i]) << "offset " << offset << " bytes " << bytes;
      EXPECT_EQ(got[0], 0) << "wrote before the destination";
    }
}

// ops::copy_to_host of several reads, one wait: reads of every size and alignment side by side,
// more small reads than the staging holds (the rest through the copy engine), a read of zero
// bytes, each into its own unaligned pageable destination; every read sees the kernel queued
// before it.
TEST_F(CudaReadback, SeveralReadsInOneWaitReturnEachReadsBytes) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const std::vector<uint8_t> host = patterned_bytes(53, 5, 241);
  DeviceBuffer<uint8_t> dev(host);
  struct Case {
    size_t offset, bytes;
  };
  const std::vector<std::vector<Case>> calls = {
      {{0, 4}, {3, 17}, {16, 4096}, {1, 1}},
      {{0, 0}, {5, 48}},
      {{0, cuda::kKernelReadbackBytes / 2},
       {7, cuda::kKernelReadbackBytes / 2},
       {9, cuda::kKernelReadbackBytes / 2 + 3},
       {2, 33}},
      {{0, cuda::kKernelReadbackBytes + 16}, {1, 100}},
  };
  for (size_t c = 0; c < calls.size(); ++c) {
    std::vector<std::vector<uint8_t>> got;
    std::vector<ops::HostRead> reads;
    for (const Case& k : calls[c]) got.emplace_back(k.bytes + 2, uint8_t{0});
    for (size_t i = 0; i < calls[c].size(); ++i)
      reads.push_back({got[i].data() + 1, dev.get() + calls[c][i].offset, calls[c][i].bytes});
    ops::copy_to_host(reads.data(), reads.size());
    for (size_t i = 0; i < calls[c].size(); ++i) {
      const Case& k = calls[c][i];
      for (size_t b = 0; b < k.bytes; ++b)
        ASSERT_EQ(got[i][1 + b], host[k.offset + b])
            << "call " << c << " read " << i << " at " << b;
      EXPECT_EQ(got[i][0], 0) << "call " << c << " read " << i << " wrote before its destination";
      EXPECT_EQ(got[i][k.bytes + 1], 0) << "call " << c << " read " << i << " wrote past its end";
    }
  }
  // Each read of a call sees what the kernels queued before the call wrote.
  std::vector<float> x(300);
  std::iota(x.begin(), x.end(), 1.0f);
  DeviceBuffer<float> a(x);
  for (int round = 1; round <= 20; ++round) {
    ops::scale(a.get(), static_cast<int64_t>(x.size()), 2.0f);
    for (float& v : x) v *= 2.0f;
    std::vector<float> head(100), tail(200);
    const ops::HostRead reads[] = {{head.data(), a.get(), sizeof(float) * 100},
                                   {tail.data(), a.get() + 100, sizeof(float) * 200}};
    ops::copy_to_host(reads, 2);
    for (size_t i = 0; i < 100; ++i) ASSERT_EQ(head[i], x[i]) << "round " << round;
    for (size_t i = 0; i < 200; ++i) ASSERT_EQ(tail[i], x[100 + i]) << "round " << round;
  }
}

// ops::copy_to_host with `then`: more reads than one gather launch takes (each its own bytes), and
// the work `then` queues runs behind the reads: they hold the values from before it, and it has
// run once the stream is synchronised.
TEST_F(CudaReadback, WorkQueuedAfterTheReadsDoesNotChangeThem) {
  ScopedBackend cuda(ops::Backend::Cuda);
  std::vector<float> x(1200);
  std::iota(x.begin(), x.end(), 1.0f);
  DeviceBuffer<float> a(x);
  for (int round = 1; round <= 10; ++round) {
    std::vector<std::vector<float>> got(12);
    std::vector<ops::HostRead> reads;
    for (size_t i = 0; i < got.size(); ++i) {
      got[i].assign(100, 0.0f);
      reads.push_back({got[i].data(), a.get() + 100 * i, sizeof(float) * 100});
    }
    bool ran = false;
    ops::copy_to_host(reads.data(), reads.size(), [&] {
      ran = true;
      ops::scale(a.get(), static_cast<int64_t>(x.size()), 2.0f);
    });
    ASSERT_TRUE(ran);
    for (size_t i = 0; i < got.size(); ++i)
      for (size_t j = 0; j < 100; ++j)
        ASSERT_EQ(got[i][j], x[100 * i + j]) << "round " << round << " read " << i;
    for (float& v : x) v *= 2.0f;
    ops::synchronize();
    std::vector<float> now(x.size());
    ops::copy_to_host(now.data(), a.get(), sizeof(float) * now.size());
    ASSERT_EQ(now, x) << "round " << round << ": the work queued after the reads did not run";
  }
  // No read: `then` still runs, and nothing waits.
  bool ran = false;
  ops::copy_to_host(nullptr, 0, [&] { ran = true; });
  EXPECT_TRUE(ran);
}

// ops::device_wait_seconds counts the time the thread spends blocked on the device: a wait for
// queued work adds about its span, work merely queued adds nothing.
TEST_F(CudaReadback, TimeBlockedOnTheDeviceIsCounted) {
  ScopedBackend cuda(ops::Backend::Cuda);
  std::vector<float> x(size_t{1} << 24, 1.0f);
  DeviceBuffer<float> a(x);
  ops::synchronize();
  auto queue_work = [&] {
    for (int i = 0; i < 200; ++i) ops::scale(a.get(), static_cast<int64_t>(x.size()), 1.0f);
  };
  const double w0 = ops::device_wait_seconds();
  queue_work();
  const double w1 = ops::device_wait_seconds();
  EXPECT_EQ(w1, w0) << "queueing work counted as waiting";
  const auto t0 = std::chrono::steady_clock::now();
  ops::synchronize();
  const double span = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double w2 = ops::device_wait_seconds();
  EXPECT_GT(w2 - w1, 0.5 * span) << "the wait for 200 kernels was not counted";
  EXPECT_LE(w2 - w1, span + 1e-3);
  queue_work();
  float head = 0.0f;
  ops::copy_to_host(&head, a.get(), sizeof(float));
  EXPECT_GT(ops::device_wait_seconds(), w2) << "a synchronous read's wait was not counted";
  EXPECT_EQ(head, 1.0f);
}

}  // namespace
}  // namespace tandem
