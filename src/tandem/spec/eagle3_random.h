// Random-weight EAGLE-3 heads in the published layout (spec/eagle3_head.h), for tests and
// benchmarks that need a head of some shape for a target: acceptance is meaningless, the
// arithmetic and the engine's handling of it are not. The drafter loads them like any head.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/core/dtype.h"

namespace tandem::spec {

struct Eagle3RandomShape {
  int64_t hidden_size = 0;        // H
  int64_t intermediate_size = 0;  // I
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;            // 0: H / heads (no head_dim field written)
  int64_t vocab_size = 0;          // V, the target's
  int64_t target_hidden_size = 0;  // 0: H
  // Target ids of the draft vocabulary, in draft-id order (distinct, in [0, V)); empty: a
  // random sorted subset of draft_vocab_size ids that includes id 0.
  std::vector<int32_t> draft_ids;
  int64_t draft_vocab_size = 0;  // with draft_ids empty; 0: V
  std::vector<int> tap_layers;   // empty: config.json names none (the target's default list)
  bool own_embedding = false;    // write embed_tokens.weight [V, H]
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
};

// Writes out_dir/config.json and out_dir/model.safetensors (matrices and norms in `dtype`: F32,
// BF16 or F16; d2t I64, t2d BOOL). Creates out_dir; refuses to overwrite a model file.
void write_random_eagle3_head(const Eagle3RandomShape& shape, const std::string& out_dir,
                              DType dtype, uint64_t seed);

}  // namespace tandem::spec
