// CUDA graph capture and replay of the work queued on the current context's stream
// (backend/graph_cache.h).
#include <cuda_runtime.h>

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

void graph_launch(void* exec) {
  TANDEM_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), op_stream()));
}

void graph_destroy(void* exec) {
  cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
}

}  // namespace tandem::cuda
