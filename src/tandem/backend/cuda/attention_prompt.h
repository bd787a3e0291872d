// Prompt prefill attention on the GPU: causal GQA self-attention of ONE row whose n prompt tokens
// sit at positions 0..n-1, computed from the row's contiguous projections instead of the paged KV
// cache (which the caller still fills with kv_write for the decode steps that follow).
//
// Numbers (see attention_prompt.cu for why):
//  - scores q·k are near fp32 (q and k split into bf16 hi + lo, three bf16 products, fp32
//    accumulation: ~1e-5 relative to |q||k|), then scaled by `scale`;
//  - softmax in fp32 over 0..t; masked positions are exact zeros;
//  - P·V multiplies P and V rounded to nearest TF32 (10-bit mantissa) with fp32 accumulation, so
//    out is within ~1e-3 of max |out| per (token, head) vector of what fp32 attention gives.
//  - Deterministic: the same q/k/v/n/shape give the same bits. The result depends only on this
//    row's inputs (no state survives between calls). Unlike cpu::attention, token t's bits may
//    differ between prompts of different n (the GEMM shapes change with n).
#pragma once

#include <cstdint>

namespace tandem::cuda {

// q:   [n, n_heads, head_dim]     fp32 device, the row's rotated, normed queries (token-major)
// k:   [n, n_kv_heads, head_dim]  fp32 device, its rotated, normed keys
// v:   [n, n_kv_heads, head_dim]  fp32 device, its values
// out: [n, n_heads, head_dim]     fp32 device, every element written; must not alias q/k/v
// Query t attends to tokens 0..t; query head h uses kv head h / (n_heads / n_kv_heads).
// n_heads must be a multiple of n_kv_heads; n == 0 does nothing. Queued on stream(); grows a
// device scratch on first use of a larger shape (see attention_prompt.cu for its size).
void attention_prompt(const float* q, const float* k, const float* v, int64_t n, int64_t n_heads,
                      int64_t n_kv_heads, int64_t head_dim, float scale, float* out);

}  // namespace tandem::cuda
