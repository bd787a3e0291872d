// Random-weight GLM-5 (glm_moe_dsa) checkpoints in the published layout, for tests that need
// shapes or layouts no fixture has, and benchmarks. Not a substitute for the parity fixtures
// (those come from transformers); the model loads these through the same loader as downloads.
#pragma once

#include <cstdint>
#include <string>

#include "tandem/core/dtype.h"

namespace tandem {

// Writes out_dir/config.json (a copy of config_path) and out_dir/model.safetensors with every
// tensor the target needs, random values of a realistic scale (norm scales near 1, router logits
// of O(1) spread), in `dtype` (F32, BF16 or F16). When the config has an fp8
// quantization_config, every Linear matrix of the blocks is written as e4m3 codes with fp32
// block scales (`weight_scale_inv`), the router, the indexer's weights_proj, the embedding and
// the head in `dtype`, as the published release does. Experts come fused (experts.gate_up_proj /
// down_proj, bf16 only) or, with per_expert_tensors (always with fp8), one tensor per projection
// and expert. With num_nextn_predict_layers >= 1 the NextN drafter layer model.layers.{N} is
// written too (its norms and eh_proj, attention without an indexer, a mixture). Layers that
// reuse the previous layer's DSA choice get no indexer, as transformers builds them. Creates
// out_dir; refuses to overwrite an existing model file.
void write_random_glm5(const std::string& config_path, const std::string& out_dir, DType dtype,
                       uint64_t seed, bool per_expert_tensors = false);

}  // namespace tandem
