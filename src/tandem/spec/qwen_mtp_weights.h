// The weights and shape of a Qwen3.5 MTP block (DESIGN.md §3, §5.4), from one of three sources:
//  - inside a target checkpoint: tensors `mtp.*`, HF layout (zero-centred norms, scale = 1 + w),
//    dense projections;
//  - a companion directory (`model_type: qwen3_5_mtp`): the same names without `mtp.`, norms in
//    runtime layout (scale = w), projections dense or MLX-affine quantized;
//  - random weights of a config's shape, created directly in the active backend's memory (no
//    files), for benchmarks of targets built with Qwen35Model::random.
// The layout is decided by the source format, never by looking at the values.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tandem/backend/ops.h"
#include "tandem/backend/weight_arena.h"
#include "tandem/io/weight_store.h"
#include "tandem/model/qwen3_5_config.h"

namespace tandem::spec {

// The graph-shaping numbers of the MTP block.
struct QwenMtpConfig {
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;
  double rope_theta = 0;
  double rms_norm_eps = 1e-6;
  bool norms_zero_centred = true;  // HF layout (in-checkpoint); companions store runtime layout
  int64_t block_size = 0;          // companion's suggested drafting depth + 1 (0: none given)
  int quant_bits = 0;              // 0: dense projections
  int64_t quant_group_size = 0;
  // Qwen3.5-MoE: the block's MLP is a mixture of experts of the target's shape (these fields as
  // in Qwen35Config; the dense MLP of intermediate_size when moe.num_experts is 0).
  Qwen35Config moe;
};

// A projection: dense, or MLX-affine quantized.
struct MtpLinear {
  ops::WeightRef dense;
  std::optional<ops::QuantWeightRef> quant;
  int64_t out_features() const { return quant ? quant->rows : dense.rows; }
  int64_t in_features() const { return quant ? quant->cols : dense.cols; }
  // y[m, out] = x[m, in] · Wᵀ
  void apply(const float* x, int64_t m, float* y) const;
  uint64_t bytes() const;
};

// The tensors of one MTP block. Exactly one owner keeps what the refs below point at alive:
//  - `store` for weights bound from files: mapped host memory in the stored dtypes (placed is
//    false, so QwenMtpBlock copies them into the backend's memory where that is not the host);
//  - `arena` for random weights: bf16 matrices and fp32 vectors created in the active backend's
//    memory (placed is true, so QwenMtpBlock computes on them as they are).
// Move-only (the arena is); a move keeps every ref valid, since the arena's buffers stay put.
struct QwenMtpWeights {
  QwenMtpConfig cfg;
  WeightStore store;    // file-backed weights: keeps the mapped tensors alive
  WeightArena arena;    // random weights: owns them in backend memory
  bool placed = false;  // the refs already point into the active backend's memory (arena)
  ops::WeightRef pre_fc_norm_embedding, pre_fc_norm_hidden, input_layernorm,
      post_attention_layernorm, q_norm, k_norm, norm;
  MtpLinear fc, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
  ops::MoeWeights moe;  // cfg.moe.moe(): the MLP (gate/up/down_proj unused)

  uint64_t bytes() const;
};

// The MTP shape of a target's config (requires mtp_num_hidden_layers == 1): the target's
// attention and MLP sizes, HF layout (zero-centred norms). Needs the parsed config only;
// `source` names it in errors (e.g. "DIR/config.json").
QwenMtpConfig mtp_config_from_target(const Qwen35Config& target, const std::string& source);
// Parses a companion config.json object (model_type qwen3_5_mtp). `source` names it in errors.
QwenMtpConfig parse_mtp_companion_config(const nlohmann::json& config, const std::string& source);

// Binds and validates (names, shapes, dtypes) every tensor of the block. `prefix` is "mtp." for a
// target checkpoint and "" for a companion; quantized projections need cfg.quant_bits > 0.
QwenMtpWeights bind_mtp_weights(const QwenMtpConfig& cfg, WeightStore store,
                                const std::string& prefix);

// Every tensor of the block with random values, created directly in the active backend's memory
// and owned by the returned weights' arena (see QwenMtpWeights). Scales follow
// Qwen35Model::random: projections bf16 uniform in ±1/sqrt(in_features); norm weights fp32,
// small offsets (uniform ±0.1) around the identity of cfg's norm layout (0 zero-centred, 1
// runtime). Deterministic per (cfg, seed, backend); the per-tensor streams are salted apart
// from Qwen35Model::random's, so a target and a drafter built from one seed share no values.
// Dense only (cfg.quant_bits == 0).
QwenMtpWeights random_mtp_weights(const QwenMtpConfig& cfg, uint64_t seed);

// The tensor-name suffixes of the MTP block (after `mtp.` / in a companion), and which of them are
// Qwen3.5 RMSNorm weights (zero-centred in HF layout).
const std::vector<std::string>& mtp_norm_names();
const std::vector<std::string>& mtp_projection_names();  // without ".weight"

}  // namespace tandem::spec
