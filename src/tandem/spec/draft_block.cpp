#include "tandem/spec/draft_block.h"

namespace tandem::spec {

int64_t upload_segment_positions(std::span<const AttentionSegment> segs,
                                 std::vector<int64_t>& pos_host, Buffer<int64_t>& pos) {
  int64_t T = 0;
  for (const AttentionSegment& s : segs) T += s.n;
  if (T == 0) return 0;
  pos_host.resize(static_cast<size_t>(T));
  int64_t t = 0;
  for (const AttentionSegment& s : segs)
    for (int64_t j = 0; j < s.n; ++j) pos_host[static_cast<size_t>(t++)] = s.start + j;
  pos.grow_to(T);
  ops::copy_from_host(pos.data(), pos_host.data(), sizeof(int64_t) * pos_host.size());
  return T;
}

void concat_normed_pair(const float* embeds, const float* hidden, int64_t T, int64_t H,
                        const ops::WeightRef& norm_e, const ops::WeightRef& norm_h,
                        bool zero_centred, float eps, Buffer<float>& cat) {
  grow_to(cat, T * 2 * H);
  ops::rms_norm_pair(embeds, hidden, T, H, norm_e, norm_h, zero_centred, eps, cat.data());
}

}  // namespace tandem::spec
