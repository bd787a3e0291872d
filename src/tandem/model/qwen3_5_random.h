// Random-weight Qwen3.5 checkpoints in the published layout, for benchmarks at real sizes and
// tests that need shapes no fixture has. Not a substitute for parity fixtures (those come from
// transformers); the engine loads these through the same loader as downloaded models.
#pragma once

#include <cstdint>
#include <string>

#include "tandem/core/dtype.h"

namespace tandem {

// Writes `out_dir/config.json` (a copy of `config_path`) and `out_dir/model.safetensors` with
// every tensor a Qwen3.5 text model needs, random values of a realistic scale, in `dtype`
// (F32, BF16 or F16). Prefix follows the config form: `model.language_model.` for qwen3_5 and
// qwen3_5_moe, `model.` for the flat forms. A Qwen3.5-MoE config gets its router, experts and
// shared expert per layer, the experts fused (experts.gate_up_proj [E, 2I, H], experts.down_proj
// [E, H, I], as transformers writes them) or, with per_expert_tensors, one tensor per projection
// and expert. With mtp_num_hidden_layers >= 1 the native MTP layer (mtp.*) is written too, its
// MLP of the target's kind. Creates out_dir; refuses to overwrite an existing model file.
void write_random_qwen35(const std::string& config_path, const std::string& out_dir, DType dtype,
                         uint64_t seed, bool per_expert_tensors = false);

}  // namespace tandem
