#include "tandem/backend/staged_upload.h"

#include <cstring>
#include <vector>

#include "tandem/core/error.h"

#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

uint8_t* StagedUpload::host(size_t bytes) {
  return slots_[next_].reserve(bytes);
}

void StagedUpload::start_together(std::span<const Part> parts) {
  // Checked before anything is queued: an error leaves every upload as it was.
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& p = parts[i];
    TANDEM_CHECK(p.upload != nullptr, "StagedUpload::start_together: part ", i, " has no upload");
    for (size_t j = 0; j < i; ++j)
      TANDEM_CHECK(parts[j].upload != p.upload, "StagedUpload::start_together: parts ", j, " and ",
                   i, " are the same upload");
    const PinnedBuffer& s = p.upload->slots_[p.upload->next_];
    if (s.data() == nullptr || p.bytes > s.capacity())
      fail("StagedUpload: ", p.bytes, " bytes exceed the ", s.capacity(), " staged");
  }
#ifdef TANDEM_HAVE_CUDA
  bool cuda = !parts.empty();
  for (const Part& p : parts)
    cuda = cuda && p.upload->slots_[p.upload->next_].where() == ops::Backend::Cuda;
  if (cuda) {
    std::vector<cuda::PinnedCopy> copies;
    for (const Part& p : parts)
      copies.push_back({p.dst, p.upload->slots_[p.upload->next_].data(), p.bytes});
    cuda::copy_from_pinned_parts(copies.data(), copies.size());
    for (const Part& p : parts) {
      p.upload->slots_[p.upload->next_].queued();
      p.upload->next_ ^= 1;
    }
    return;
  }
#endif
  for (const Part& p : parts) p.upload->start(p.dst, p.bytes);
}

void StagedUpload::consumed() {
  if (ops::backend() == ops::Backend::Cuda) readers_done_.record();
}

void StagedUpload::start(void* dst, size_t bytes) {
  PinnedBuffer& s = slots_[next_];
  if (s.data() == nullptr || bytes > s.capacity())
    fail("StagedUpload: ", bytes, " bytes exceed the ", s.capacity(), " staged");
  next_ ^= 1;
#ifdef TANDEM_HAVE_CUDA
  if (s.where() == ops::Backend::Cuda) {
    // The last upload's readers done: nothing queued still touches dst.
    const bool ahead = readers_done_.recorded() && readers_done_.reached();
    readers_done_.forget();
    if (ahead)
      cuda::copy_from_pinned_ahead(dst, s.data(), bytes);
    else
      cuda::copy_from_pinned_async(dst, s.data(), bytes);
    s.queued();
    return;
  }
#endif
  std::memcpy(dst, s.data(), bytes);
}

}  // namespace tandem
