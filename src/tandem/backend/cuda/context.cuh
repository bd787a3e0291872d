// The CUDA side of ops::Context (backend/context.h; internal: included by .cu files only). What an
// op keeps between calls lives in the current context, never in a static: the stream, the cuBLAS
// handles, each op file's scratch and plans (unit<T>()), the prompt-prefill tile and the launch
// helpers' device caches. Two contexts therefore never share an address a kernel writes, and a
// graph captured under one context never replays the other's scratch (graph keys include the
// context's id and scratch generation).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tandem::cuda {

size_t next_unit_slot();  // a new index for unit<T>() (context.cu), one per unit type

class Context {
 public:
  // Creates the stream (non-blocking: it never serialises against the legacy default stream)
  // and the ordering event on `device`; throws Error naming the device on failure.
  explicit Context(int device);
  // Waits for the stream, then frees the units (their device memory), handles, event and stream.
  // Never throws (also called while the process exits).
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // Recorded on stream() when another context's stream must wait for the work queued so far.
  cudaEvent_t order_event() const { return order_; }
  cublasHandle_t blas();       // created on first use, bound to stream()
  cublasLtHandle_t blas_lt();  // created on first use (cuBLASLt takes the stream per call)
  int multiprocessors();       // of device()

  // Bumped whenever an internal scratch of this context is reallocated (its address changes).
  uint64_t scratch_generation() const { return generation_; }
  void bump_scratch_generation() { ++generation_; }

  // Rows of every prompt-prefill GEMM tile (ops::set_prefill); 0: not in prefill mode.
  int64_t prefill_rows = 0;
  // The next kernel launched in this context waits for everything before it instead of starting
  // early under PDL (launch_clustered clears it): set after a kernel that writes metadata the
  // kernels after it read before their pdl_wait (check.cuh's invariant).
  bool serialize_next_launch = false;
  // Points of stream(): record_event numbers each event it records on the stream (1, 2, ...);
  // every point up to points_reached is known to have completed, because the host waited for it
  // or for a later one (streams run in order), so waiting for it again needs no device call.
  uint64_t points_recorded = 0;
  uint64_t points_reached = 0;
  // check.cuh's caches: the dynamic shared memory limit set for each kernel (allow_dynamic_smem),
  // and its resident blocks per multiprocessor at (kernel, dynamic shared memory).
  std::unordered_map<const void*, size_t> smem_allowed;
  std::map<std::pair<const void*, size_t>, int> blocks_per_sm;

  // The state of one op file (its scratch, tuned plans, counters) in this context: a T
  // default-constructed on first use and destroyed with the context, after its stream drained.
  // T is the unit's own type (usually in the file's anonymous namespace).
  template <class T>
  T& unit() {
    static const size_t slot = next_unit_slot();
    if (slot >= units_.size()) units_.resize(slot + 1);
    std::unique_ptr<UnitBase>& u = units_[slot];
    if (!u) u = std::make_unique<Unit<T>>();
    return static_cast<Unit<T>*>(u.get())->value;
  }

 private:
  struct UnitBase {
    virtual ~UnitBase() = default;
  };
  template <class T>
  struct Unit final : UnitBase {
    T value{};
  };

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t order_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  cublasLtHandle_t blas_lt_ = nullptr;
  int multiprocessors_ = 0;
  uint64_t generation_ = 0;
  std::vector<std::unique_ptr<UnitBase>> units_;
};

// Raises the dynamic shared memory limit of `kernel` on `device` (the current one) to at least
// `bytes` and returns the limit now in force. The limit is the device's, not a context's: one
// table for the process, under a lock, that only ever grows (a context setting a smaller limit
// would break another's launches). Throws Error naming `what` on failure.
size_t raise_dynamic_smem(const void* kernel, int device, size_t bytes, const char* what);

// The calling thread's current CUDA context: the innermost ops::ContextScope's, else the
// process's default CUDA context.
Context& current();

}  // namespace tandem::cuda
