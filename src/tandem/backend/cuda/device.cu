// The CUDA device as the rest of tandem sees it: plain cudaMalloc'd buffers, and the copies and
// fills that load weights and move activations. Everything is queued on the current context's
// stream (context.cuh); only copy_to_host, synchronize, upload_bf16 and copy_bandwidth wait for
// it.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string_view>
#include <vector>

#if TANDEM_CUDA_TRACE
#include <dlfcn.h>
#include <execinfo.h>

#include <map>
#include <mutex>
#endif

#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/core/dtype.h"
#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {
// On unless TANDEM_CUDA_PDL=0 (prompt prefill never uses it, check.cuh). On the H200
// (BENCHMARKS.md, 2026-11-30 fifth session) it speeds a batch-1 decode step up from 4.77 to
// 4.60 ms; a 4-token verify window, whose projections are separated by norm kernels, gains less
// (5.16 to 5.09 ms with the gated norm releasing first), and stays at 1.11x a step.
bool g_pdl = env_switch_on("TANDEM_CUDA_PDL");

#if TANDEM_CUDA_TRACE
void record_wait(std::chrono::steady_clock::time_point t0,
                 std::chrono::steady_clock::time_point t1);
#endif

// The calling thread's time blocked on the device (wait_seconds): each wait adds its own span.
thread_local double thread_wait_seconds = 0.0;
struct WaitClock {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~WaitClock() {
    const auto t1 = std::chrono::steady_clock::now();
    thread_wait_seconds += std::chrono::duration<double>(t1 - t0).count();
#if TANDEM_CUDA_TRACE
    record_wait(t0, t1);
#endif
  }
};
}  // namespace

bool pdl_enabled() {
  return g_pdl;
}

void set_pdl_enabled(bool on) {
  g_pdl = on;
}

// --- Kernels -------------------------------------------------------------------------------------

namespace {

constexpr int kThreads = 256;

// splitmix64's output function: a bijective 64-bit mixer.
__device__ inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1) from (seed, index) alone: element `index` gets splitmix64's index-th output
// for this seed, so the values do not depend on the launch shape or the device. The top 24 bits
// make a float exactly (k · 2^-23 - 1 is representable for every 24-bit k).
__device__ inline float uniform_pm1(uint64_t seed, uint64_t index) {
  const uint64_t h = mix64(seed + (index + 1) * 0x9E3779B97F4A7C15ull);
  return static_cast<float>(h >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

// Round to nearest even, NaN kept quiet: bit for bit tandem::f32_to_bf16.
__device__ inline uint16_t f32_to_bf16_device(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__global__ void fill_random_bf16_kernel(uint16_t* dst, int64_t n, uint64_t seed, float scale) {
  pdl_wait();
  pdl_release();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = f32_to_bf16_device(uniform_pm1(seed, static_cast<uint64_t>(i)) * scale);
}

__global__ void fill_random_f32_kernel(float* dst, int64_t n, uint64_t seed, float offset,
                                       float scale) {
  pdl_wait();
  pdl_release();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = fmaf(uniform_pm1(seed, static_cast<uint64_t>(i)), scale, offset);
}

// dst[r, c] = src[r, c] with row strides; blockIdx.y walks rows, x-threads walk columns.
__global__ void copy_rows_kernel(float* dst, int64_t dst_stride, const float* src,
                                 int64_t src_stride, int64_t rows, int64_t cols) {
  pdl_wait();
  pdl_release();
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < cols;
         c += int64_t(gridDim.x) * blockDim.x)
      dst[r * dst_stride + c] = src[r * src_stride + c];
}

// Block i = blockIdx.y of moves (ops::copy_blocks); x-threads walk its floats. The moves are
// written by copies queued before, so they are read after pdl_wait().
__global__ void copy_blocks_kernel(float* dst, const float* src, const int32_t* moves, int64_t n,
                                   int64_t block_floats) {
  pdl_wait();
  pdl_release();
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    const float* from = src + static_cast<int64_t>(moves[i]) * block_floats;
    float* to = dst + static_cast<int64_t>(moves[n + i]) * block_floats;
    for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < block_floats;
         c += int64_t(gridDim.x) * blockDim.x)
      to[c] = from[c];
  }
}

}  // namespace

// --- Device and stream ---------------------------------------------------------------------------

bool available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: clear it so later checks do not see it
    return false;
  }
  return count > 0;
}

std::string device_name() {
  if (!available()) fail("no usable CUDA device");
  int device = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  TANDEM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

void synchronize() {
  Context& c = current();
  {
    const WaitClock clock;
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(c.stream()));
  }
  c.points_reached = c.points_recorded;
}

double wait_seconds() {
  return thread_wait_seconds;
}

// --- Memory --------------------------------------------------------------------------------------

void* alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaSuccess) return p;
  // A failed cudaMalloc is not sticky, but it is recorded as the last error; clear it so the
  // next op's launch check does not report it.
  (void)cudaGetLastError();
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    fail("cudaMalloc of ", bytes, " bytes failed: ", cudaGetErrorString(err));
  }
  if (err == cudaErrorMemoryAllocation)
    fail("CUDA out of memory: requested ", bytes, " bytes (", bytes >> 20, " MiB); ",
         free_bytes >> 20, " MiB free of ", total_bytes >> 20, " MiB");
  fail("cudaMalloc of ", bytes, " bytes failed (", free_bytes >> 20, " MiB free of ",
       total_bytes >> 20, " MiB): ", cudaGetErrorString(err));
}

void free(void* p) {
  if (p == nullptr) return;
  // Called from destructors, also while the process exits and the CUDA runtime is already
  // unloading: a failed free must not throw (nothing useful can be done about it). A sticky
  // error from an earlier kernel stays visible to the next checked call.
  const cudaError_t err = cudaFree(p);
  if (err == cudaErrorCudartUnloading || err == cudaErrorContextIsDestroyed) cudaGetLastError();
}

void copy_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, op_stream()));
}

namespace {

// On unless TANDEM_CUDA_KERNEL_READBACK=0, which sends every readback through the copy engine
// (for comparing the two).
bool kernel_readback_enabled() {
  static const bool on = env_switch_on("TANDEM_CUDA_KERNEL_READBACK");
  return on;
}

// This thread's pinned staging for small synchronous readbacks (copy_to_host), allocated on first
// use; freed at thread exit, where free_pinned tolerates a runtime that is already unloading.
struct SyncReadStaging {
  void* p = nullptr;
  ~SyncReadStaging() { free_pinned(p); }
  uint8_t* get() {
    if (p == nullptr) p = alloc_pinned(kKernelReadbackBytes);
    return static_cast<uint8_t*>(p);
  }
};
thread_local SyncReadStaging sync_staging;

// The reads of the running copy_reads_to_host that land in sync_staging (at `offset`, 16-byte
// aligned, in order), copied out once the host has waited; reads that did not fit went to their
// destination directly. Kept between calls so a forward's reads allocate nothing.
struct StagedRead {
  void* dst;
  size_t offset;
  size_t bytes;
};
thread_local std::vector<StagedRead> staged_reads;

}  // namespace

void copy_to_host(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  // A read a host round waits for (a verify's tokens): stored by a kernel into pinned memory, then
  // copied out, instead of a copy-engine transfer into pageable memory behind the kernels.
  const ops::HostRead read{dst, src, bytes};
  copy_reads_to_host(&read, 1, {});
}

void* alloc_pinned(size_t bytes) {
  void* p = nullptr;
  // Mapped: kernels write small readbacks into it directly (copy_to_pinned_async). With unified
  // addressing, which every device tandem runs on has, the device sees it at the same address.
  const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (err != cudaSuccess)
    fail("CUDA: cannot pin ", bytes, " bytes of host memory: ", cudaGetErrorString(err));
  return p;
}

void free_pinned(void* p) {
  if (p == nullptr) return;
  const cudaError_t err = cudaFreeHost(p);  // as free(): never throws, also at exit
  if (err != cudaSuccess) cudaGetLastError();
}

void copy_to_host_async(void* dst_pinned, const void* src, size_t bytes) {
  if (bytes == 0) return;
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst_pinned, src, bytes, cudaMemcpyDeviceToHost, op_stream()));
}

namespace {

// The byte copies done by kernels (readbacks into mapped host memory, uploads from it, small
// device copies): each thread moves 16 bytes, or one byte where src, dst or bytes are not 16-byte
// aligned (`wide` false).
struct ByteCopyShape {
  bool wide;
  unsigned blocks;
  static constexpr unsigned kThreads = 256;
};

ByteCopyShape byte_copy_shape(const void* dst, const void* src, size_t bytes) {
  const bool wide =
      (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | bytes) % 16 == 0;
  const size_t items = wide ? bytes / 16 : bytes;
  return {wide,
          static_cast<unsigned>((items + ByteCopyShape::kThreads - 1) / ByteCopyShape::kThreads)};
}

__device__ __forceinline__ void move_bytes(const uint8_t* __restrict__ src,
                                           uint8_t* __restrict__ dst, size_t bytes, bool wide) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (wide) {
    if (i < bytes / 16) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else if (i < bytes) {
    dst[i] = src[i];
  }
}

// Into mapped host memory: posted PCIe writes, which land before the kernel counts as complete.
__global__ void copy_to_mapped_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                      size_t bytes, bool wide) {
  move_bytes(src, dst, bytes, wide);
  __threadfence_system();  // the host reads them once the event after this kernel completes
}

}  // namespace

void copy_to_pinned_async(void* dst_pinned, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (!kernel_readback_enabled()) return copy_to_host_async(dst_pinned, src, bytes);
  // A copy-engine transfer behind kernels costs ~9 µs on an H100 however small it is; a kernel
  // storing the bytes into the mapped buffer ~3 µs. Large reads (a 9B model's logits) stay with
  // the copy engine, which moves them at full PCIe bandwidth.
  if (bytes > kKernelReadbackBytes) return copy_to_host_async(dst_pinned, src, bytes);
  const ByteCopyShape shape = byte_copy_shape(dst_pinned, src, bytes);
  copy_to_mapped_kernel<<<shape.blocks, ByteCopyShape::kThreads, 0, op_stream()>>>(
      static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst_pinned), bytes, shape.wide);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

namespace {

// On unless TANDEM_CUDA_KERNEL_COPY=0, which sends every staged upload and device copy through the
// copy engine (for comparing the two).
bool kernel_copy_enabled() {
  static const bool on = env_switch_on("TANDEM_CUDA_KERNEL_COPY");
  return on;
}

// Into device memory, from device memory or from mapped host memory the host wrote before the
// launch. It stores once the kernel before it is done, which may still read dst.
__global__ void copy_bytes_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                  size_t bytes, bool wide) {
  pdl_wait();
  move_bytes(src, dst, bytes, wide);
}

// A copy-engine transfer between kernels leaves the device idle for several microseconds however
// small it is; a kernel does not, and under PDL it is even scheduled while the kernel before it
// drains.
void queue_copy_kernel(const char* op, void* dst, const void* src, size_t bytes) {
  const ByteCopyShape shape = byte_copy_shape(dst, src, bytes);
  launch(op, copy_bytes_kernel, dim3(shape.blocks), dim3(ByteCopyShape::kThreads), 0,
         static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), bytes, shape.wide);
  // A copy's destination may be read by the next kernels before their pdl_wait (uploaded
  // metadata, a recurrent state: check.cuh), as after a copy-engine transfer: the next launch
  // must not start before it has completed.
  current().serialize_next_launch = true;
}

}  // namespace

void copy_from_pinned_async(void* dst, const void* src_pinned, size_t bytes) {
  if (bytes == 0) return;
  if (!kernel_copy_enabled() || bytes > kKernelUploadBytes)
    return copy_to_device(dst, src_pinned, bytes);
  queue_copy_kernel("copy_from_pinned", dst, src_pinned, bytes);
}

namespace {

// Up to N byte copies in one launch: part p takes blocks first_block[p] .. first_block[p + 1] - 1,
// each thread 16 bytes where the part is `wide`, else one byte (as move_bytes). Passed by value.
template <int N>
struct ByteCopyParts {
  const uint8_t* src[N];
  uint8_t* dst[N];
  size_t bytes[N];
  unsigned first_block[N + 1];
  bool wide[N];
  int parts;

  bool full() const { return parts == N; }
  unsigned blocks() const { return first_block[parts]; }
  void add(void* to, const void* from, size_t n) {
    const ByteCopyShape shape = byte_copy_shape(to, from, n);
    src[parts] = static_cast<const uint8_t*>(from);
    dst[parts] = static_cast<uint8_t*>(to);
    bytes[parts] = n;
    wide[parts] = shape.wide;
    first_block[parts + 1] = first_block[parts] + shape.blocks;
    ++parts;
  }
  void clear() {
    parts = 0;
    first_block[0] = 0;
  }
};

template <int N>
__device__ __forceinline__ void move_part_bytes(const ByteCopyParts<N>& c) {
  int p = 0;
  while (p + 1 < c.parts && blockIdx.x >= c.first_block[p + 1]) ++p;
  const size_t i = static_cast<size_t>(blockIdx.x - c.first_block[p]) * blockDim.x + threadIdx.x;
  if (c.wide[p]) {
    if (i < c.bytes[p] / 16)
      reinterpret_cast<uint4*>(c.dst[p])[i] = reinterpret_cast<const uint4*>(c.src[p])[i];
  } else if (i < c.bytes[p]) {
    c.dst[p][i] = c.src[p][i];
  }
}

// A forward's reads into the mapped staging, up to 8 a launch.
using MappedGather = ByteCopyParts<8>;

__global__ void gather_to_mapped_kernel(MappedGather g) {
  move_part_bytes(g);
  __threadfence_system();  // the host reads them once the event after this kernel completes
}

void launch_gather(MappedGather& g) {
  if (g.parts == 0) return;
  gather_to_mapped_kernel<<<g.blocks(), ByteCopyShape::kThreads, 0, op_stream()>>>(g);
  TANDEM_CUDA_CHECK(cudaGetLastError());
  g.clear();
}

// Recorded after a forward's reads (copy_reads_to_host), so the host waits for them alone.
struct ReadsDoneEvent {
  void* e = nullptr;
  ~ReadsDoneEvent() { destroy_event(e); }
  void* get() {
    if (e == nullptr) e = create_event();
    return e;
  }
};
thread_local ReadsDoneEvent reads_done;

}  // namespace

void copy_reads_to_host(const ops::HostRead* reads, size_t n, const std::function<void()>& then) {
  TANDEM_CHECK(staged_reads.empty(), "copy_reads_to_host: reads of another call are pending");
  MappedGather g{};
  size_t at = 0;
  try {
    for (size_t i = 0; i < n; ++i) {
      const ops::HostRead& r = reads[i];
      if (r.bytes == 0) continue;
      if (!kernel_readback_enabled() || at + r.bytes > kKernelReadbackBytes) {
        const WaitClock clock;  // into pageable memory: returns once the bytes have landed
        copy_to_host_async(r.dst_host, r.src, r.bytes);
        continue;
      }
      if (g.full()) launch_gather(g);
      g.add(sync_staging.get() + at, r.src, r.bytes);
      staged_reads.push_back({r.dst_host, at, r.bytes});
      at = (at + r.bytes + 15) / 16 * 16;
    }
    launch_gather(g);
    const StreamPoint point = record_event(reads_done.get());
    if (then) then();
    wait_event(reads_done.get(), point);
  } catch (...) {
    staged_reads.clear();  // a failed call leaves no reads for the next caller
    throw;
  }
  for (const StagedRead& r : staged_reads)
    std::memcpy(r.dst, sync_staging.get() + r.offset, r.bytes);
  staged_reads.clear();
}

namespace {

// A graph's uploads from mapped pinned staging, up to 4 a launch.
using UploadParts = ByteCopyParts<4>;

__global__ void copy_parts_kernel(UploadParts u) {
  pdl_wait();
  move_part_bytes(u);
}

void launch_parts(UploadParts& u) {
  if (u.parts == 0) return;
  launch("copy_from_pinned", copy_parts_kernel, dim3(u.blocks()), dim3(ByteCopyShape::kThreads), 0,
         u);
  // As queue_copy_kernel: the next launch must not start before the copies completed.
  current().serialize_next_launch = true;
  u.clear();
}

}  // namespace

void copy_from_pinned_parts(const PinnedCopy* parts, size_t n) {
  UploadParts u{};
  for (size_t i = 0; i < n; ++i) {
    const PinnedCopy& c = parts[i];
    if (c.bytes == 0) continue;
    if (!kernel_copy_enabled() || c.bytes > kKernelUploadBytes) {
      copy_to_device(c.dst, c.src_pinned, c.bytes);
      continue;
    }
    if (u.full()) launch_parts(u);
    u.add(c.dst, c.src_pinned, c.bytes);
  }
  launch_parts(u);
}

namespace {

// A second stream of a context for uploads that overlap the work queued before them
// (copy_from_pinned_ahead), and the event the context's stream waits on. Created on first use;
// drained and destroyed with the context.
struct AheadStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  AheadStream() = default;
  AheadStream(const AheadStream&) = delete;
  AheadStream& operator=(const AheadStream&) = delete;
  ~AheadStream() {
    if (stream) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    if (done) cudaEventDestroy(done);
    cudaGetLastError();  // nothing to report from a destructor
  }
};

}  // namespace

void copy_from_pinned_ahead(void* dst, const void* src_pinned, size_t bytes) {
  if (bytes == 0) return;
  if (!kernel_copy_enabled() || bytes > kKernelUploadBytes)
    return copy_from_pinned_async(dst, src_pinned, bytes);
  Context& c = current();
  AheadStream& a = c.unit<AheadStream>();
  if (a.stream == nullptr) {
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&a.stream, cudaStreamNonBlocking));
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&a.done, cudaEventDisableTiming));
  }
  const ByteCopyShape shape = byte_copy_shape(dst, src_pinned, bytes);
  copy_bytes_kernel<<<shape.blocks, ByteCopyShape::kThreads, 0, a.stream>>>(
      static_cast<const uint8_t*>(src_pinned), static_cast<uint8_t*>(dst), bytes, shape.wide);
  TANDEM_CUDA_CHECK(cudaGetLastError());
  TANDEM_CUDA_CHECK(cudaEventRecord(a.done, a.stream));
  TANDEM_CUDA_CHECK(cudaStreamWaitEvent(c.stream(), a.done, 0));
}

void* create_event() {
  cudaEvent_t e = nullptr;
  TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void destroy_event(void* event) {
  if (event && cudaEventDestroy(static_cast<cudaEvent_t>(event)) != cudaSuccess) cudaGetLastError();
}

StreamPoint record_event(void* event) {
  Context& c = current();
  TANDEM_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), c.stream()));
  return {&c, ++c.points_recorded};
}

void wait_event(void* event, StreamPoint point) {
  Context& c = current();
  const bool ours = point.context == &c;
  if (ours && point.seq <= c.points_reached) return;
  {
    const WaitClock clock;
    TANDEM_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  }
  if (ours) c.points_reached = point.seq;
}

bool event_completed(void* event, StreamPoint point) {
  Context& c = current();
  const bool ours = point.context == &c;
  if (ours && point.seq <= c.points_reached) return true;
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();  // not an error: clear it for the next check
    return false;
  }
  TANDEM_CUDA_CHECK(err);
  if (ours) c.points_reached = std::max(c.points_reached, point.seq);
  return true;
}

void copy_on_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  const bool overlap = d < s + bytes && s < d + bytes;  // left to the copy engine, as before
  if (kernel_copy_enabled() && bytes <= kKernelDeviceCopyBytes && !overlap)
    return queue_copy_kernel("copy_on_device", dst, src, bytes);
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, op_stream()));
}

void fill_zero(void* p, size_t bytes) {
  if (bytes == 0) return;
  TANDEM_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, op_stream()));
}

void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
               int64_t cols) {
  if (rows < 0 || cols < 0) fail("copy_rows: negative shape ", rows, " x ", cols);
  if (rows == 0 || cols == 0) return;
  const dim3 grid(grid_stride_blocks(cols, kThreads),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  launch("copy_rows", copy_rows_kernel, grid, kThreads, 0, dst, dst_stride, src, src_stride, rows,
         cols);
}

void copy_blocks(float* dst, const float* src, const int32_t* moves, int64_t n,
                 int64_t block_floats) {
  const dim3 grid(grid_stride_blocks(block_floats, kThreads),
                  static_cast<unsigned>(std::min<int64_t>(n, 65535)));
  launch("copy_blocks", copy_blocks_kernel, grid, kThreads, 0, dst, src, moves, n, block_floats);
}

// --- Weights -------------------------------------------------------------------------------------

void upload_bf16(uint16_t* dst, const float* src, int64_t n) {
  if (n <= 0) return;
  // Converted on the host in 4 MiB chunks through one staging buffer, so a multi-GiB tensor
  // needs no tensor-sized temporary. A pageable-memory cudaMemcpyAsync is only guaranteed to
  // have read its source once the stream has passed it, hence the wait before each reuse.
  constexpr int64_t kChunk = int64_t(1) << 21;
  std::vector<uint16_t> staging(static_cast<size_t>(std::min(n, kChunk)));
  for (int64_t off = 0; off < n; off += kChunk) {
    const int64_t len = std::min(kChunk, n - off);
    for (int64_t i = 0; i < len; ++i) staging[i] = f32_to_bf16(src[off + i]);
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst + off, staging.data(), len * sizeof(uint16_t),
                                      cudaMemcpyHostToDevice, op_stream()));
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(op_stream()));
  }
}

void fill_random_bf16(uint16_t* dst, int64_t n, uint64_t seed, float scale) {
  if (n <= 0) return;
  launch("fill_random_bf16", fill_random_bf16_kernel, grid_stride_blocks(n, kThreads), kThreads, 0,
         dst, n, seed, scale);
}

void fill_random_f32(float* dst, int64_t n, uint64_t seed, float offset, float scale) {
  if (n <= 0) return;
  launch("fill_random_f32", fill_random_f32_kernel, grid_stride_blocks(n, kThreads), kThreads, 0,
         dst, n, seed, offset, scale);
}

// --- Bandwidth -----------------------------------------------------------------------------------

namespace {

// Owns the buffers and events of one measurement. Release runs on the error path too, so it
// must not throw: failures there are cleared, not reported (the measurement's own error is).
struct BandwidthProbe {
  void* src = nullptr;
  void* dst = nullptr;
  std::vector<cudaEvent_t> events;
  BandwidthProbe() = default;
  BandwidthProbe(const BandwidthProbe&) = delete;
  BandwidthProbe& operator=(const BandwidthProbe&) = delete;
  ~BandwidthProbe() {
    for (cudaEvent_t e : events)
      if (cudaEventDestroy(e) != cudaSuccess) (void)cudaGetLastError();
    if (src != nullptr && cudaFree(src) != cudaSuccess) (void)cudaGetLastError();
    if (dst != nullptr && cudaFree(dst) != cudaSuccess) (void)cudaGetLastError();
  }
};

}  // namespace

double copy_bandwidth(size_t bytes) {
  if (bytes == 0) fail("copy_bandwidth: bytes must be positive");
  constexpr int kRuns = 7;
  const cudaStream_t s = op_stream();
  BandwidthProbe probe;
  probe.src = alloc(bytes);
  probe.dst = alloc(bytes);
  for (int i = 0; i < 2 * kRuns; ++i) {
    cudaEvent_t e = nullptr;
    TANDEM_CUDA_CHECK(cudaEventCreate(&e));
    probe.events.push_back(e);
  }
  // Touch both buffers and warm the copy path before timing.
  fill_zero(probe.src, bytes);
  copy_on_device(probe.dst, probe.src, bytes);
  for (int r = 0; r < kRuns; ++r) {
    TANDEM_CUDA_CHECK(cudaEventRecord(probe.events[2 * r], s));
    copy_on_device(probe.dst, probe.src, bytes);
    TANDEM_CUDA_CHECK(cudaEventRecord(probe.events[2 * r + 1], s));
  }
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<double> rates;
  for (int r = 0; r < kRuns; ++r) {
    float ms = 0.0f;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, probe.events[2 * r], probe.events[2 * r + 1]));
    if (ms > 0.0f) rates.push_back(2.0 * static_cast<double>(bytes) / (ms * 1e-3));
  }
  if (rates.empty()) fail("copy_bandwidth: copies of ", bytes, " bytes took no measurable time");
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

TANDEM_CUDA_TRACE_UNIT(device)

#if TANDEM_CUDA_TRACE
// Every unit that defines kernels names itself with TANDEM_CUDA_TRACE_UNIT and is listed here; a
// unit missing from the list would simply be absent from the timeline.
// clang-format off
#define TANDEM_CUDA_TRACE_UNITS(X) \
  X(attention) X(attention_prompt) X(device) X(dsa) X(elementwise) X(graph) X(linear) X(linear_fp8) \
  X(linear_ring) X(linear_tiles) X(mla) X(moe) X(recurrent) X(sampling)
// clang-format on
#define TANDEM_DECLARE_UNIT(name)                                 \
  void trace_collect_##name(std::vector<KernelMark>&, uint64_t&); \
  void trace_clear_##name();
TANDEM_CUDA_TRACE_UNITS(TANDEM_DECLARE_UNIT)
#undef TANDEM_DECLARE_UNIT

namespace {

std::vector<KernelMark> gather_marks(uint64_t& dropped) {
  synchronize();
  std::vector<KernelMark> marks;
#define TANDEM_COLLECT_UNIT(name) trace_collect_##name(marks, dropped);
  TANDEM_CUDA_TRACE_UNITS(TANDEM_COLLECT_UNIT)
#undef TANDEM_COLLECT_UNIT
  std::stable_sort(marks.begin(), marks.end(),
                   [](const KernelMark& a, const KernelMark& b) { return a.ns < b.ns; });
  return marks;
}

// At exit: "unit ns grid_x grid_y grid_z block" per line to $TANDEM_CUDA_TRACE_OUT. Errors go to
// stderr; an exit handler must not throw.
void dump_marks_at_exit() {
  const char* path = std::getenv("TANDEM_CUDA_TRACE_OUT");
  if (path == nullptr) return;
  try {
    uint64_t dropped = 0;
    const std::vector<KernelMark> marks = gather_marks(dropped);
    std::FILE* f = std::fopen(path, "w");
    if (f == nullptr) {
      std::fprintf(stderr, "tandem: cannot write the kernel timeline to %s\n", path);
      return;
    }
    for (const KernelMark& m : marks)
      if (m.host_ns != 0)  // a graph launch: "launch ns host_ns 0 0 0"
        std::fprintf(f, "launch %llu %llu 0 0 0\n", static_cast<unsigned long long>(m.ns),
                     static_cast<unsigned long long>(m.host_ns));
      else
        std::fprintf(f, "%s %llu %u %u %u %u\n", m.unit, static_cast<unsigned long long>(m.ns),
                     m.grid[0], m.grid[1], m.grid[2], m.block);
    std::fclose(f);
    std::fprintf(stderr, "tandem: %zu kernel marks written to %s", marks.size(), path);
    if (dropped > 0)
      std::fprintf(stderr, " (%llu dropped: buffer full)",
                   static_cast<unsigned long long>(dropped));
    std::fprintf(stderr, "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem: kernel timeline: %s\n", e.what());
  }
}

}  // namespace

namespace {

// Where the host blocked on the device: with $TANDEM_CUDA_WAIT_OUT set, every wait's interval on
// the host's steady clock (the clock of the graph launch marks) and its call stack, as offsets
// into the executable, written at exit for tools/wait_sites.py to name:
//   stack ID OFFSET...        (return addresses minus one: the call instructions)
//   wait START_NS END_NS ID
struct WaitLog {
  std::mutex mu;
  std::map<std::vector<uintptr_t>, uint32_t> ids;
  std::vector<const std::vector<uintptr_t>*> stacks;  // by id, pointing into `ids`
  std::vector<std::array<int64_t, 3>> waits;          // start, end, stack id
};

WaitLog& wait_log() {
  static WaitLog* log = new WaitLog;  // never destroyed: waits may come during exit
  return *log;
}

int64_t steady_ns(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

void dump_waits_at_exit() {
  const char* path = std::getenv("TANDEM_CUDA_WAIT_OUT");
  WaitLog& log = wait_log();
  std::lock_guard lock(log.mu);
  std::FILE* f = std::fopen(path, "w");
  if (f == nullptr) {
    std::fprintf(stderr, "tandem: cannot write the host's waits to %s\n", path);
    return;
  }
  Dl_info self{};
  dladdr(reinterpret_cast<void*>(&dump_waits_at_exit), &self);
  for (size_t id = 0; id < log.stacks.size(); ++id) {
    std::fprintf(f, "stack %zu", id);
    for (uintptr_t pc : *log.stacks[id]) {
      Dl_info info{};  // frames outside the executable (libc, the driver) are left out
      if (dladdr(reinterpret_cast<void*>(pc), &info) == 0 || info.dli_fbase != self.dli_fbase)
        continue;
      std::fprintf(f, " 0x%zx",
                   static_cast<size_t>(pc - reinterpret_cast<uintptr_t>(info.dli_fbase) - 1));
    }
    std::fprintf(f, "\n");
  }
  for (const auto& w : log.waits)
    std::fprintf(f, "wait %lld %lld %lld\n", static_cast<long long>(w[0]),
                 static_cast<long long>(w[1]), static_cast<long long>(w[2]));
  std::fclose(f);
  std::fprintf(stderr, "tandem: %zu waits written to %s\n", log.waits.size(), path);
}

void record_wait(std::chrono::steady_clock::time_point t0,
                 std::chrono::steady_clock::time_point t1) {
  static const bool on = [] {
    if (std::getenv("TANDEM_CUDA_WAIT_OUT") == nullptr) return false;
    std::atexit(dump_waits_at_exit);
    return true;
  }();
  if (!on) return;
  // Raw return addresses here (the unwinding alone slows the host: keep it short); they become
  // offsets at exit.
  void* frames[14];
  const int n = backtrace(frames, 14);
  std::vector<uintptr_t> stack;
  for (int i = 2; i < n; ++i)  // past record_wait and ~WaitClock
    stack.push_back(reinterpret_cast<uintptr_t>(frames[i]));
  WaitLog& log = wait_log();
  std::lock_guard lock(log.mu);
  const auto [it, added] = log.ids.try_emplace(std::move(stack), log.stacks.size());
  if (added) log.stacks.push_back(&it->first);
  log.waits.push_back({steady_ns(t0), steady_ns(t1), static_cast<int64_t>(it->second)});
}

}  // namespace

void trace_register_dump() {
  static const bool registered = [] { return std::atexit(dump_marks_at_exit) == 0; }();
  (void)registered;
}

std::vector<KernelMark> kernel_marks() {
  uint64_t dropped = 0;
  std::vector<KernelMark> marks = gather_marks(dropped);
  if (dropped > 0)
    fail("kernel_marks: ", dropped, " marks were dropped (", kTraceCapacity,
         " per unit); clear_kernel_marks() more often");
  return marks;
}

void clear_kernel_marks() {
  synchronize();
#define TANDEM_CLEAR_UNIT(name) trace_clear_##name();
  TANDEM_CUDA_TRACE_UNITS(TANDEM_CLEAR_UNIT)
#undef TANDEM_CLEAR_UNIT
}
#endif

}  // namespace tandem::cuda
