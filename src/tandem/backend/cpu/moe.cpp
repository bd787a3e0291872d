// Mixture-of-experts MLP on the CPU (ops::moe_mlp_add): route every token, then run each expert
// once over the rows routed to it (grouped by expert, tokens in order), then combine per token.
//
// Batch invariance: cpu::linear computes a row's products in an order fixed by the weight's
// shape (linear.cpp), so an expert's output for a row is the same bits whether 1 or 100 rows
// share the expert; a token's experts are then summed in ascending expert id, an order fixed by
// its own routing. So a token's output does not depend on the other tokens of the call, and a
// verify window computes what decoding one token at a time computes.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "tandem/backend/cpu/best_indices.h"
#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/core/error.h"

namespace tandem::cpu {

using ops::MoeWeights;

void route_top_k(const float* logits, int64_t E, int64_t k, bool renormalise, int32_t* ids,
                 float* weights) {
  if (E < 1 || k < 1 || k > E) fail("route_top_k: top ", k, " of ", E, " experts");
  // Softmax in fp32, max-subtracted as torch computes it.
  float mx = logits[0];
  for (int64_t e = 1; e < E; ++e) mx = std::max(mx, logits[e]);
  std::vector<float> p(static_cast<size_t>(E));
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    p[static_cast<size_t>(e)] = std::exp(logits[e] - mx);
    sum += p[static_cast<size_t>(e)];
  }
  for (float& v : p) v /= sum;
  const std::vector<int32_t> order = best_indices(p.data(), E, k);
  float top = 0.0f;
  for (int64_t j = 0; j < k; ++j) top += p[static_cast<size_t>(order[static_cast<size_t>(j)])];
  for (int64_t j = 0; j < k; ++j) {
    const int32_t e = order[static_cast<size_t>(j)];
    ids[j] = e;
    weights[j] = renormalise ? p[static_cast<size_t>(e)] / top : p[static_cast<size_t>(e)];
  }
}

void route_noaux_tc(const float* logits, const float* bias, int64_t E, int64_t k, int64_t n_group,
                    int64_t topk_group, bool renormalise, float scale, int32_t* ids,
                    float* weights) {
  if (E < 1 || n_group < 1 || E % n_group != 0 || topk_group < 1 || topk_group > n_group)
    fail("route_noaux_tc: ", E, " experts in ", n_group, " groups, top ", topk_group, " groups");
  const int64_t per = E / n_group;
  if (n_group > 1 && per < 2) fail("route_noaux_tc: groups of ", per, " expert (need two)");
  if (k < 1 || k > topk_group * per)
    fail("route_noaux_tc: top ", k, " of the ", topk_group * per, " experts of the kept groups");
  std::vector<float> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const auto i = static_cast<size_t>(e);
    score[i] = 1.0f / (1.0f + std::exp(-logits[e]));
    choice[i] = score[i] + bias[e];
  }
  if (n_group > 1) {
    std::vector<float> worth(static_cast<size_t>(n_group));
    for (int64_t g = 0; g < n_group; ++g) {
      const float* members = choice.data() + g * per;
      const auto best = best_indices(members, per, 2);
      worth[static_cast<size_t>(g)] = members[best[0]] + members[best[1]];
    }
    std::vector<bool> kept(static_cast<size_t>(n_group), false);
    for (const int32_t g : best_indices(worth.data(), n_group, topk_group))
      kept[static_cast<size_t>(g)] = true;
    for (int64_t e = 0; e < E; ++e)
      if (!kept[static_cast<size_t>(e / per)]) choice[static_cast<size_t>(e)] = -INFINITY;
  }
  const auto top = best_indices(choice.data(), E, k);
  float sum = 0.0f;
  for (const int32_t e : top) sum += score[static_cast<size_t>(e)];
  for (int64_t j = 0; j < k; ++j) {
    const int32_t e = top[static_cast<size_t>(j)];
    const float w = score[static_cast<size_t>(e)];
    ids[j] = e;
    weights[j] = (renormalise ? w / (sum + 1e-20f) : w) * scale;
  }
}

void moe_mlp_add(const float* x, int64_t T, const MoeWeights& w, float* y,
                 std::vector<int32_t>* routed_ids, std::vector<float>* routed_weights) {
  if (T <= 0) return;
  const int64_t E = w.router.rows, H = w.router.cols, k = w.top_k;
  const int64_t I = w.gate.front().rows, Is = w.shared_gate_proj.rows;
  // 1. Routing.
  std::vector<float> logits(static_cast<size_t>(T * E));
  cpu::linear(x, T, w.router, logits.data());
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  std::vector<float> weights(static_cast<size_t>(T * k));
  for (int64_t t = 0; t < T; ++t) {
    if (w.routing == ops::MoeRouting::NoauxTc)
      route_noaux_tc(logits.data() + t * E, static_cast<const float*>(w.score_bias.data), E, k,
                     w.n_group, w.topk_group, w.renormalise, w.routed_scale, ids.data() + t * k,
                     weights.data() + t * k);
    else
      route_top_k(logits.data() + t * E, E, k, w.renormalise, ids.data() + t * k,
                  weights.data() + t * k);
  }
  // 2. Each routed expert once over its rows. out[t·k + j] is token t's j-th choice's output.
  std::vector<std::vector<int64_t>> rows_of(static_cast<size_t>(E));  // entries t·k + j
  for (int64_t i = 0; i < T * k; ++i)
    rows_of[static_cast<size_t>(ids[static_cast<size_t>(i)])].push_back(i);
  std::vector<float> out(static_cast<size_t>(T * k * H));
  std::vector<float> in, gate, up, down;
  for (int64_t e = 0; e < E; ++e) {
    const auto& rows = rows_of[static_cast<size_t>(e)];
    if (rows.empty()) continue;
    const auto n = static_cast<int64_t>(rows.size());
    in.resize(static_cast<size_t>(n * H));
    for (int64_t r = 0; r < n; ++r)
      std::copy_n(x + (rows[static_cast<size_t>(r)] / k) * H, H, in.data() + r * H);
    gate.resize(static_cast<size_t>(n * I));
    up.resize(gate.size());
    down.resize(static_cast<size_t>(n * H));
    cpu::linear(in.data(), n, w.gate[static_cast<size_t>(e)], gate.data());
    cpu::linear(in.data(), n, w.up[static_cast<size_t>(e)], up.data());
    cpu::swiglu(gate.data(), up.data(), n * I, gate.data());
    cpu::linear(gate.data(), n, w.down[static_cast<size_t>(e)], down.data());
    for (int64_t r = 0; r < n; ++r)
      std::copy_n(down.data() + r * H, H, out.data() + rows[static_cast<size_t>(r)] * H);
  }
  // 3. The shared expert and its gate, over all tokens (none: nothing is added for it).
  const bool has_shared = Is > 0, gated = w.shared_gate.rows > 0;
  std::vector<float> sg, sh_gate, sh_up, shared;
  if (has_shared) {
    sg.resize(static_cast<size_t>(T));
    sh_gate.resize(static_cast<size_t>(T * Is));
    sh_up.resize(sh_gate.size());
    shared.resize(static_cast<size_t>(T * H));
    if (gated) cpu::linear(x, T, w.shared_gate, sg.data());
    cpu::linear(x, T, w.shared_gate_proj, sh_gate.data());
    cpu::linear(x, T, w.shared_up_proj, sh_up.data());
    cpu::swiglu(sh_gate.data(), sh_up.data(), T * Is, sh_gate.data());
    cpu::linear(sh_gate.data(), T, w.shared_down_proj, shared.data());
  }
  // 4. Per token: the experts in ascending id, then the gated shared expert, then the residual.
  std::vector<float> acc(static_cast<size_t>(H));
  std::vector<int64_t> by_id(static_cast<size_t>(k));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(by_id.begin(), by_id.end(), int64_t{0});
    std::sort(by_id.begin(), by_id.end(), [&](int64_t a, int64_t b) {
      return ids[static_cast<size_t>(t * k + a)] < ids[static_cast<size_t>(t * k + b)];
    });
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (const int64_t j : by_id) {
      const float wt = weights[static_cast<size_t>(t * k + j)];
      const float* o = out.data() + (t * k + j) * H;
      for (int64_t i = 0; i < H; ++i) acc[static_cast<size_t>(i)] += wt * o[i];
    }
    float* yt = y + t * H;
    if (!has_shared) {
      for (int64_t i = 0; i < H; ++i) yt[i] += acc[static_cast<size_t>(i)];
      continue;
    }
    const float* s = shared.data() + t * H;
    if (!gated) {  // GLM-5: the shared expert's output added as it is
      for (int64_t i = 0; i < H; ++i) yt[i] += acc[static_cast<size_t>(i)] + s[i];
      continue;
    }
    const float g = 1.0f / (1.0f + std::exp(-sg[static_cast<size_t>(t)]));
    for (int64_t i = 0; i < H; ++i) yt[i] += acc[static_cast<size_t>(i)] + g * s[i];
  }
  if (routed_ids) *routed_ids = std::move(ids);
  if (routed_weights) *routed_weights = std::move(weights);
}

}  // namespace tandem::cpu
