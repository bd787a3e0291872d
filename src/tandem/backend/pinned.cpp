#include "tandem/backend/pinned.h"

#include <cstdlib>

#include "tandem/core/error.h"

#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

void* pinned_alloc(ops::Backend where, size_t bytes) {
  const size_t n = bytes > 0 ? bytes : 1;
#ifdef TANDEM_HAVE_CUDA
  if (where == ops::Backend::Cuda) return cuda::alloc_pinned(n);
#endif
  (void)where;
  void* p = std::malloc(n);
  if (!p) fail("out of host memory for ", n, " bytes of copy staging");
  return p;
}

void pinned_free(ops::Backend where, void* p) {
  if (p == nullptr) return;
#ifdef TANDEM_HAVE_CUDA
  if (where == ops::Backend::Cuda) return cuda::free_pinned(p);
#endif
  (void)where;
  std::free(p);
}

}  // namespace tandem
