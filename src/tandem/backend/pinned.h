// Host memory that asynchronous device copies read from or land in (Readback, StagedUpload):
// pinned on CUDA (a pageable buffer would make the copy block the host), plain malloc on the CPU
// backend. Freed by the backend that allocated it; pinned_free never throws.
#pragma once

#include <cstddef>

#include "tandem/backend/ops.h"

namespace tandem {

void* pinned_alloc(ops::Backend where, size_t bytes);  // throws Error when out of memory
void pinned_free(ops::Backend where, void* p);

}  // namespace tandem
