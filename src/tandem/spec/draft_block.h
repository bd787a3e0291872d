// Steps the drafters' own decoder blocks (spec/qwen_mtp_block.h, spec/eagle3_block.h,
// spec/glm_mtp_block.h) share: each reads one (token embedding, hidden) pair per row and runs it
// at the row's rotary position.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/ops.h"
#include "tandem/model/gated_attention.h"

namespace tandem::spec {

// Returns T = Σ segs[i].n and, when T > 0, uploads the rows' positions (segment after segment,
// segment i's from segs[i].start on) into pos [T] through the host staging pos_host.
int64_t upload_segment_positions(std::span<const AttentionSegment> segs,
                                 std::vector<int64_t>& pos_host, Buffer<int64_t>& pos);

// cat [T, 2H] = [norm_e(embeds) | norm_h(hidden)] per row, embedding first (RMS norms, zero
// centred or not; one launch). All arrays are backend memory.
void concat_normed_pair(const float* embeds, const float* hidden, int64_t T, int64_t H,
                        const ops::WeightRef& norm_e, const ops::WeightRef& norm_h,
                        bool zero_centred, float eps, Buffer<float>& cat);

}  // namespace tandem::spec
