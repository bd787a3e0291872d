// CUDA graph capture and replay of the work queued on the current context's stream
// (backend/graph_cache.h).
#include <cuda_runtime.h>

#include <chrono>

#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"

namespace tandem::cuda {

void* graph_capture(const std::function<void()>& body) {
  const cudaStream_t s = op_stream();
  // Thread-local mode: an unsafe call from this thread during capture (an allocation, a
  // synchronous copy) fails loudly instead of being silently left out of the graph.
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    body();
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(s, &broken);
    if (broken) cudaGraphDestroy(broken);
    cudaGetLastError();
    throw;
  }
  cudaGraph_t graph = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  TANDEM_CUDA_CHECK(err);
  return exec;
}

#if TANDEM_CUDA_TRACE
namespace {
__global__ void launch_mark_kernel(unsigned long long host_ns) {
  trace_launch_mark(host_ns);
}
}  // namespace
#endif

void graph_launch(void* exec) {
#if TANDEM_CUDA_TRACE
  const auto host_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now().time_since_epoch())
                           .count();
  launch_mark_kernel<<<1, 1, 0, op_stream()>>>(static_cast<unsigned long long>(host_ns));
  TANDEM_CUDA_CHECK(cudaGetLastError());
#endif
  TANDEM_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), op_stream()));
}

void graph_destroy(void* exec) {
  cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
}

TANDEM_CUDA_TRACE_UNIT(graph)

}  // namespace tandem::cuda
