#include "tandem/backend/memory_info.h"

#include <fstream>
#include <sstream>
#include <string>

#include "tandem/backend/ops.h"

#if TANDEM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tandem {

uint64_t available_memory_bytes() {
#if TANDEM_HAVE_CUDA
  if (ops::backend() == ops::Backend::Cuda) {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return free_bytes;
  }
#endif
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::string key;
    uint64_t kib = 0;
    if (ss >> key >> kib && key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

}  // namespace tandem
