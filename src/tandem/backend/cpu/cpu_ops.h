// The CPU implementation of the op set: the same signatures and semantics as backend/ops.h, on
// host memory. backend/ops.cpp dispatches to these when the CPU backend is active; tests call
// them directly as the reference for the CUDA backend.
#pragma once

#include "tandem/backend/ops.h"

namespace tandem::cpu {

void linear(const float* x, int64_t m, const ops::WeightRef& w, float* y);
void embed_rows(const ops::WeightRef& table, const int32_t* ids, int64_t n, float* out);
void embed_rows_selected(const ops::WeightRef& table, const int32_t* ids, const int32_t* source,
                         const int32_t* from, int64_t n, float* out);
void rms_norm(const float* x, int64_t m, int64_t d, const ops::WeightRef& w, bool zero_centred,
              float eps, float* y);
void rms_norm_pair(const float* a, const float* b, int64_t m, int64_t d, const ops::WeightRef& wa,
                   const ops::WeightRef& wb, bool zero_centred, float eps, float* y);
void rms_norm_pair_embedded(const ops::WeightRef& table, const int32_t* ids, const float* b,
                            int64_t m, const ops::WeightRef& wa, const ops::WeightRef& wb,
                            bool zero_centred, float eps, float* y);
void gated_rms_norm(const float* x, const float* z, int64_t m, int64_t d, const ops::WeightRef& w,
                    float eps, float* y);
void swiglu(const float* gate, const float* up, int64_t n, float* out);
void sample_rows(const float* logits, int64_t rows, int64_t V, const ops::SampleRow* params,
                 int32_t* out);
void accept_windows(const int32_t* verified, const int32_t* ids, const int32_t* source,
                    const int32_t* from, const int32_t* bounds, const int32_t* limits,
                    int64_t n_rows, int32_t* accepted, int32_t* next);
void recurrent_layers_rows(const ops::RecurrentLayers& layers, int64_t channels, int64_t kernel,
                           const ops::RecurrentRow* rows, int64_t n_rows, int64_t max_n,
                           const ops::DeltaHeads& h);
void settle_windows(const int32_t* accepted, const ops::SettledRow* rows, int64_t n_rows,
                    int64_t* shift, ops::RecurrentRow* replay, int64_t layers);
void shift_positions(const ops::PositionShift& s, int64_t* positions, int64_t* kv_slots);
void gather_window_rows(const float* src, int64_t width, int64_t row_stride, int64_t at,
                        const int32_t* offsets, int64_t n, float* dst);
void ngram_lookup(const ops::TokenHistories& h, int min_n, int max_n, int depth, int32_t* ids,
                  int32_t* counts);
void history_append(const ops::TokenHistories& h, const int32_t* ids, int depth,
                    const int32_t* accepted, const int32_t* next);
void route_top_k(const float* logits, int64_t E, int64_t k, bool renormalise, int32_t* ids,
                 float* weights);
void mla_attention(const float* q_nope, const float* q_pe, int64_t n, int64_t H, int64_t dn,
                   int64_t dr, int64_t dv, const float* latent, int64_t ctx, int64_t R,
                   const ops::WeightRef& kv_b, const int64_t* pos, const int32_t* allowed,
                   int64_t topk, float scale, bool absorbed, float* out);
void dsa_select(const float* q, const float* w, int64_t n, int64_t heads, int64_t D,
                const float* keys, int64_t ctx, const int64_t* pos, int64_t topk, int32_t* out);
void route_noaux_tc(const float* logits, const float* bias, int64_t E, int64_t k, int64_t n_group,
                    int64_t topk_group, bool renormalise, float scale, int32_t* ids,
                    float* weights);
void moe_mlp_add(const float* x, int64_t T, const ops::MoeWeights& w, float* y,
                 std::vector<int32_t>* routed_ids, std::vector<float>* routed_weights);
void sigmoid_gate(float* x, const float* gate, int64_t n);
void add_inplace(float* x, const float* y, int64_t n);
void scale(float* x, int64_t n, float s);
void rope(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t rotary_dim,
          const int64_t* positions, const float* inv_freq);
void rope_slice(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_stride, int64_t offset,
                int64_t dim, const int64_t* positions, const float* inv_freq, bool interleaved);
void layer_norm(const float* x, int64_t m, int64_t d, const ops::WeightRef& w,
                const ops::WeightRef& b, float eps, float* y);
void kv_write(const ops::KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
              int64_t n, const float* k, const float* v);
void kv_write_stored(const ops::KVLayerView& kv, const int32_t* block_table,
                     const int64_t* positions, int64_t n, const void* k, const void* v);
// kv_write at physical slots (block · block_size + offset) instead of a block table and positions
// (qk_norm_rope's KV target); negative slots are skipped.
void kv_write_slots(const ops::KVLayerView& kv, const int64_t* slots, int64_t n, const float* k,
                    const float* v);
void attention(const ops::KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
               int64_t n, int64_t position_bound, const float* q, int64_t n_heads, float scale,
               float* out);
void causal_conv_silu(const float* x, int64_t n, int64_t channels, int64_t kernel,
                      const ops::WeightRef& w, float* state, float* out, float* state_after);
void gated_delta_rule(const float* q, const float* k, const float* v, const float* a,
                      const float* b, const ops::WeightRef& A_log, const ops::WeightRef& dt_bias,
                      int64_t n, const ops::DeltaHeads& h, float* state, float* out,
                      float* state_after);
// Descriptors are host memory here: each row runs the single-row op above.
void causal_conv_silu_rows(const float* x, int64_t channels, int64_t kernel,
                           const ops::WeightRef& w, const ops::RecurrentRow* rows, int64_t n_rows,
                           int64_t max_n, float* out);
void gated_delta_rule_rows(const float* q, const float* k, const float* v, const float* a,
                           const float* b, const ops::WeightRef& A_log,
                           const ops::WeightRef& dt_bias, const ops::RecurrentRow* rows,
                           int64_t n_rows, int64_t max_n, const ops::DeltaHeads& h, float* out);
void linear_quantized(const float* x, int64_t m, const ops::QuantWeightRef& w, float* y);

}  // namespace tandem::cpu

namespace tandem::cpu {
// Rows r0..r0+n-1 of an MLX-affine quantized weight, dequantized to fp32 [n, cols] (the values
// linear_quantized multiplies with).
void dequantize_rows(const ops::QuantWeightRef& w, int64_t r0, int64_t n, float* out);
// linear's fp8 path (w.dtype F8_E4M3 with its block scales).
void linear_fp8(const float* x, int64_t m, const ops::WeightRef& w, float* y);
// Rows r0 .. r0 + n of an fp8 block-scaled weight, dequantized into out [n, cols].
void dequantize_fp8_rows(const ops::WeightRef& w, int64_t r0, int64_t n, float* out);
// Element i (row-major) of an fp8 block-scaled weight.
float fp8_element(const ops::WeightRef& w, int64_t i);
}  // namespace tandem::cpu
