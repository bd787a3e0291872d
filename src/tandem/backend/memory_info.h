// Memory the active backend could still give out: what a server sizes its KV pool from when it
// is given no budget.
#pragma once

#include <cstdint>

namespace tandem {

// CPU: MemAvailable from /proc/meminfo. CUDA: the device's free memory (cudaMemGetInfo).
// 0 when it cannot be read.
uint64_t available_memory_bytes();

}  // namespace tandem
