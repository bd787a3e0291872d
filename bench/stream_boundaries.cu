// What the stream operations between CUDA graphs cost on this GPU: a graph boundary, a small
// host→device upload, a small device→host readback through the copy engine, and the same
// readback as a kernel storing into mapped pinned memory (cuda::copy_to_pinned_async). Each
// scenario runs 400 times back to back after a warm-up; the figure is device time per iteration
// (events around the loop), or wall time per iteration where the host waits each time, as a host
// round does. A "kernel" here is a 4 × 128-thread kernel doing next to nothing (~1 µs in a graph):
// the demo model's kernels are a few µs each, so these are the overheads its rounds pay.
//
//   ./build/tandem_bench_boundaries
//
// Results: BENCHMARKS.md ("Where a demo round's time goes between its graphs").
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

__global__ void nearly_nothing(float* p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  p[i] = p[i] * 1.0001f + 1.0f;
}

__global__ void copy_in(const int4* src, int4* dst, int n) {
  if (static_cast<int>(threadIdx.x) < n) dst[threadIdx.x] = src[threadIdx.x];
}

__global__ void store_out(const int* src, int* dst, int n) {
  if (static_cast<int>(threadIdx.x) < n) dst[threadIdx.x] = src[threadIdx.x];
  __threadfence_system();
}

struct Bench {
  cudaStream_t stream{};
  float* work = nullptr;
  int4* dev_in = nullptr;
  int* dev_out = nullptr;
  int4* host_in = nullptr;  // pinned, mapped
  int* host_out = nullptr;  // pinned, mapped

  // A graph of `kernels` kernels; with_io: a first kernel reads 256 bytes from host_in and a
  // last one stores 16 bytes into host_out (the uploads and readbacks inside the graph).
  cudaGraphExec_t graph(int kernels, bool with_io) {
    cudaGraph_t g;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
    if (with_io) copy_in<<<1, 32, 0, stream>>>(host_in, dev_in, 16);
    for (int k = 0; k < kernels; ++k) nearly_nothing<<<4, 128, 0, stream>>>(work);
    if (with_io) store_out<<<1, 32, 0, stream>>>(dev_out, host_out, 4);
    check(cudaStreamEndCapture(stream, &g), "end capture");
    cudaGraphExec_t exec;
    check(cudaGraphInstantiate(&exec, g, 0ULL), "instantiate");
    return exec;
  }
  void upload() {
    check(cudaMemcpyAsync(dev_in, host_in, 256, cudaMemcpyHostToDevice, stream), "upload");
  }
  void readback() {
    check(cudaMemcpyAsync(host_out, dev_out, 16, cudaMemcpyDeviceToHost, stream), "readback");
  }
  void launch(cudaGraphExec_t g) { check(cudaGraphLaunch(g, stream), "launch"); }
};

}  // namespace

int main() {
  Bench b;
  check(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking), "stream");
  check(cudaMalloc(&b.work, 1 << 20), "malloc");
  check(cudaMemset(b.work, 0, 1 << 20), "memset");
  check(cudaMalloc(&b.dev_in, 4096), "malloc");
  check(cudaMalloc(&b.dev_out, 4096), "malloc");
  check(cudaHostAlloc(&b.host_in, 4096, cudaHostAllocMapped), "host alloc");
  check(cudaHostAlloc(&b.host_out, 4096, cudaHostAllocMapped), "host alloc");
  cudaEvent_t start, stop, done;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event");
  const cudaGraphExec_t g20 = b.graph(20, false), g10 = b.graph(10, false),
                        g60 = b.graph(60, false), g20_io = b.graph(20, true);
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  std::printf("%s\n", prop.name);
  constexpr int kIterations = 400;
  auto run = [&](const char* name, auto body, bool host_waits) {
    for (int i = 0; i < 20; ++i) body();
    check(cudaStreamSynchronize(b.stream), "sync");
    check(cudaEventRecord(start, b.stream), "record");
    for (int i = 0; i < kIterations; ++i) {
      body();
      if (host_waits) {
        check(cudaEventRecord(done, b.stream), "record");
        check(cudaEventSynchronize(done), "wait");
      }
    }
    check(cudaEventRecord(stop, b.stream), "record");
    check(cudaEventSynchronize(stop), "wait");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    std::printf("%-58s %7.2f us\n", name, 1000.0f * ms / kIterations);
  };
  run(
      "graph of 20 kernels", [&] { b.launch(g20); }, false);
  run(
      "two graphs of 10 (one boundary more)",
      [&] {
        b.launch(g10);
        b.launch(g10);
      },
      false);
  run(
      "graph of 60 kernels", [&] { b.launch(g60); }, false);
  run(
      "upload 256 B + graph of 20",
      [&] {
        b.upload();
        b.launch(g20);
      },
      false);
  run(
      "upload + graph of 20 + copy-engine readback 16 B",
      [&] {
        b.upload();
        b.launch(g20);
        b.readback();
      },
      false);
  run(
      "graph of 20 with a copy-in and a store-out kernel", [&] { b.launch(g20_io); }, false);
  run(
      "host waits: graph of 20", [&] { b.launch(g20); }, true);
  run(
      "host waits: upload + graph of 20 + copy-engine readback",
      [&] {
        b.upload();
        b.launch(g20);
        b.readback();
      },
      true);
  run(
      "host waits: graph of 20 with copy-in and store-out kernels", [&] { b.launch(g20_io); },
      true);
  return 0;
}
