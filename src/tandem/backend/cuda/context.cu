// CUDA contexts (context.cuh) and the thread's current one. Switching contexts orders their
// streams with the leaving context's event, so work queued across a switch runs in program order.
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/context.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

thread_local Context* t_current = nullptr;  // the innermost scope's; null: the default context

// The default context, created on first use and never destroyed: it lives as long as the CUDA
// runtime (destroying it in a static destructor would race the runtime's own unloading).
Context& default_context() {
  static Context* const created = [] {
    int device = 0;
    TANDEM_CUDA_CHECK(cudaGetDevice(&device));
    return new Context(device);
  }();
  return *created;
}

// `to`'s stream waits for the work queued on `from`'s so far. Not checked: called from scope
// destructors; a failure here is a sticky device error the next checked call reports.
void order(Context* from, Context* to) {
  if (cudaEventRecord(from->order_event(), from->stream()) == cudaSuccess)
    (void)cudaStreamWaitEvent(to->stream(), from->order_event(), 0);
}

// Restores the current device when a constructor or destructor switched to its own.
struct DeviceGuard {
  int previous = -1;
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous) != cudaSuccess) {
      (void)cudaGetLastError();
      previous = -1;
    }
    if (previous != device) (void)cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous >= 0) (void)cudaSetDevice(previous);
  }
};

}  // namespace

size_t raise_dynamic_smem(const void* kernel, int device, size_t bytes, const char* what) {
  static std::mutex lock;
  static std::map<std::pair<int, const void*>, size_t> limits;  // the driver's, as last set
  const std::lock_guard<std::mutex> hold(lock);
  size_t& limit = limits[{device, kernel}];
  if (bytes > limit) {
    if (const cudaError_t err = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
        err != cudaSuccess)
      fail(what, ": ", bytes, " bytes of shared memory: ", cudaGetErrorString(err));
    limit = bytes;
  }
  return limit;
}

size_t next_unit_slot() {
  static std::atomic<size_t> next{0};
  return next++;
}

Context::Context(int device) : device_(device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  if (device < 0 || device >= count)
    fail("CUDA device ", device, " does not exist (", count, " visible)");
  DeviceGuard on(device);
  TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  if (const cudaError_t err = cudaEventCreateWithFlags(&order_, cudaEventDisableTiming);
      err != cudaSuccess) {
    cudaStreamDestroy(stream_);
    fail("CUDA device ", device, ": cannot create an event: ", cudaGetErrorString(err));
  }
}

Context::~Context() {
  DeviceGuard on(device_);
  (void)cudaStreamSynchronize(stream_);
  units_.clear();
  if (blas_) cublasDestroy(blas_);
  if (blas_lt_) cublasLtDestroy(blas_lt_);
  cudaEventDestroy(order_);
  cudaStreamDestroy(stream_);
}

cublasHandle_t Context::blas() {
  if (blas_ == nullptr) {
    cublasHandle_t h = nullptr;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) fail("cuBLAS: cublasCreate failed");
    if (cublasSetStream(h, stream_) != CUBLAS_STATUS_SUCCESS) {
      cublasDestroy(h);
      fail("cuBLAS: cublasSetStream failed");
    }
    blas_ = h;
  }
  return blas_;
}

cublasLtHandle_t Context::blas_lt() {
  if (blas_lt_ == nullptr) {
    cublasLtHandle_t h = nullptr;
    if (cublasLtCreate(&h) != CUBLAS_STATUS_SUCCESS) fail("cuBLASLt: cublasLtCreate failed");
    blas_lt_ = h;
  }
  return blas_lt_;
}

int Context::multiprocessors() {
  if (multiprocessors_ == 0) {
    int n = 0;
    TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device_));
    multiprocessors_ = n > 0 ? n : 1;
  }
  return multiprocessors_;
}

Context& current() {
  return t_current ? *t_current : default_context();
}

// --- cuda_ops.h --------------------------------------------------------------------------------

void* context_create(int device) {
  return new Context(device);
}

void context_destroy(void* context) {
  delete static_cast<Context*>(context);
}

void* context_default() {
  return &default_context();
}

void* context_enter(void* context, int* previous_device) {
  auto* c = static_cast<Context*>(context);
  *previous_device = -1;
  // The default context is made here if it does not exist yet: work queued outside any scope
  // after this one closes runs on it, and must wait for this context's.
  Context* from = t_current ? t_current : &default_context();
  // Contexts know their devices, so only a switch between devices asks the runtime.
  if (from->device() != c->device()) {
    TANDEM_CUDA_CHECK(cudaSetDevice(c->device()));
    *previous_device = from->device();
  }
  if (from != c) order(from, c);
  Context* previous = t_current;
  t_current = c;
  return previous;
}

void context_leave(void* context, void* previous, int previous_device) {
  auto* c = static_cast<Context*>(context);
  t_current = static_cast<Context*>(previous);
  // The default context exists: context_enter made it (so this cannot throw).
  if (Context* to = t_current ? t_current : &default_context(); to != c) order(c, to);
  if (previous_device >= 0) (void)cudaSetDevice(previous_device);
}

void* stream() {
  return current().stream();
}

uint64_t scratch_generation() {
  return current().scratch_generation();
}

void bump_scratch_generation() {
  current().bump_scratch_generation();
}

}  // namespace tandem::cuda
