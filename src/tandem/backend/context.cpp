#include "tandem/backend/context.h"

#include <atomic>

#include "tandem/core/error.h"
#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem::ops {

namespace {

thread_local Context* t_current = nullptr;  // the innermost open scope's context

uint64_t next_context_id() {
  static std::atomic<uint64_t> next{1};
  return next++;
}

}  // namespace

Context::Context(Backend backend, int device, void* native)
    : backend_(backend), device_(device), id_(next_context_id()), native_(native) {
  if (native_ != nullptr) return;  // the CUDA side's default context, adopted (never destroyed)
  if (backend == Backend::Cpu) {
    if (device != 0) fail("the CPU backend has one device (0), not device ", device);
    return;
  }
#ifdef TANDEM_HAVE_CUDA
  native_ = cuda::context_create(device);
#else
  fail("backend cuda: this tandem was built without the CUDA backend (no nvcc at build time)");
#endif
}

Context::~Context() {
#ifdef TANDEM_HAVE_CUDA
  if (native_) cuda::context_destroy(native_);
#endif
}

std::shared_ptr<Context> Context::create(int device) {
  return std::shared_ptr<Context>(new Context(ops::backend(), device, nullptr));
}

std::shared_ptr<Context> Context::for_new_model() {
  if (t_current != nullptr && t_current->backend() == ops::backend())
    return t_current->shared_from_this();
  return create();
}

Context& default_context(Backend b) {
  // One per backend, made on first use and never destroyed (see the header): the owning pointers
  // are leaked on purpose. The CUDA one wraps the CUDA side's default context, the one its ops
  // use outside any scope.
  if (b == Backend::Cpu) {
    static auto* const cpu = new std::shared_ptr<Context>(new Context(Backend::Cpu, 0, nullptr));
    return **cpu;
  }
#ifdef TANDEM_HAVE_CUDA
  static auto* const cuda =
      new std::shared_ptr<Context>(new Context(Backend::Cuda, 0, cuda::context_default()));
  return **cuda;
#else
  fail("backend cuda: this tandem was built without the CUDA backend (no nvcc at build time)");
#endif
}

Context& current_context() {
  return t_current ? *t_current : default_context(backend());
}

ContextScope::ContextScope(Context& context) : entered_(&context), previous_(t_current) {
  // Re-entering the current context (a model's entry point inside its engine's scope, the
  // common case on every hot path) changes nothing: no call into the backend.
  if (&context == t_current) {
    entered_ = nullptr;
    return;
  }
#ifdef TANDEM_HAVE_CUDA
  if (context.native()) previous_native_ = cuda::context_enter(context.native(), &previous_device_);
#endif
  t_current = &context;
}

ContextScope::~ContextScope() {
  if (entered_ == nullptr) return;
  t_current = previous_;
#ifdef TANDEM_HAVE_CUDA
  if (entered_->native())
    cuda::context_leave(entered_->native(), previous_native_, previous_device_);
#endif
}

}  // namespace tandem::ops
