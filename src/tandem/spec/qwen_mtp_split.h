// `tandem mtp-split`: writes a companion MTP drafter directory (DESIGN.md §3) from a Qwen3.5
// checkpoint that carries its MTP layer under `mtp.*`.
#pragma once

#include <cstdint>
#include <string>

namespace tandem::spec {

struct MtpSplitResult {
  int64_t tensors = 0;
  uint64_t bytes = 0;  // tensor bytes written
};

// out_dir/config.json: model_type qwen3_5_mtp, the target's text_config, block_size,
// tie_word_embeddings. out_dir/model.safetensors: every `mtp.*` tensor with the prefix removed,
// dense, in its stored dtype; the zero-centred Qwen3.5 RMSNorm weights converted to runtime
// layout (1 + w, computed in fp32, rounded back to the stored dtype).
// Refuses a checkpoint without `mtp.*` tensors and an existing non-empty out_dir.
MtpSplitResult write_mtp_companion(const std::string& model_dir, const std::string& out_dir,
                                   int64_t block_size = 4);

}  // namespace tandem::spec
