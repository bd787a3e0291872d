#include "tandem/model/moe_weights.h"

#include <cstddef>

namespace tandem {

namespace {

// Rows [first, first + rows) of a fused tensor holding `cols` elements per row, as a weight.
ops::WeightRef rows_of(const ops::WeightRef& w, int64_t first, int64_t rows, int64_t cols) {
  ops::WeightRef v = w;
  v.data = static_cast<const std::byte*>(w.data) +
           static_cast<size_t>(first * cols) * dtype_size(w.dtype);
  v.rows = rows;
  v.cols = cols;
  return v;
}

}  // namespace

void bind_routed_experts(const std::string& p, int64_t E, int64_t I, int64_t H, bool fused,
                         const MoeTensorSource& get, ops::MoeWeights* m) {
  m->gate.resize(static_cast<size_t>(E));
  m->up.resize(static_cast<size_t>(E));
  m->down.resize(static_cast<size_t>(E));
  if (fused) {
    const ops::WeightRef gate_up = get(p + "gate_up_proj", {E, 2 * I, H});
    const ops::WeightRef down = get(p + "down_proj", {E, H, I});
    for (int64_t e = 0; e < E; ++e) {
      const auto i = static_cast<size_t>(e);
      // transformers chunks gate_up_proj[e] into gate (its first I rows) and up (the next I).
      m->gate[i] = rows_of(gate_up, 2 * I * e, I, H);
      m->up[i] = rows_of(gate_up, 2 * I * e + I, I, H);
      m->down[i] = rows_of(down, H * e, H, I);
    }
    return;
  }
  for (int64_t e = 0; e < E; ++e) {
    const auto i = static_cast<size_t>(e);
    const std::string x = p + std::to_string(e) + ".";
    m->gate[i] = get(x + "gate_proj.weight", {I, H});
    m->up[i] = get(x + "up_proj.weight", {I, H});
    m->down[i] = get(x + "down_proj.weight", {H, I});
  }
}

ops::MoeWeights bind_moe_weights(const Qwen35Config& c, const std::string& p, bool fused,
                                 const MoeTensorSource& get) {
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, H = c.hidden_size;
  const int64_t Is = c.shared_expert_intermediate_size;
  ops::MoeWeights m;
  m.router = get(p + "gate.weight", {E, H});
  m.top_k = c.num_experts_per_tok;
  // transformers' Qwen3_5MoeTopKRouter always renormalises the top-k probabilities; a config's
  // norm_topk_prob (qwen3_moe's switch) is ignored there (fixture qwen35_moe_no_shared).
  m.renormalise = true;
  bind_routed_experts(p + "experts.", E, I, H, fused, get, &m);
  if (Is == 0) return m;  // no shared expert: whatever empty tensors a checkpoint has are unused
  m.shared_gate_proj = get(p + "shared_expert.gate_proj.weight", {Is, H});
  m.shared_up_proj = get(p + "shared_expert.up_proj.weight", {Is, H});
  m.shared_down_proj = get(p + "shared_expert.down_proj.weight", {H, Is});
  m.shared_gate = get(p + "shared_expert_gate.weight", {1, H});
  return m;
}

namespace {

// Whether parts[0], parts[1], ... lie back to back in memory (one block's rows, in order).
bool contiguous(const std::vector<ops::WeightRef*>& parts) {
  const auto* next = static_cast<const char*>(parts.front()->data);
  for (const ops::WeightRef* p : parts) {
    if (p->data != next) return false;
    next += p->bytes();
  }
  return true;
}

ops::WeightRef stacked_view(const std::vector<ops::WeightRef*>& parts) {
  ops::WeightRef w = *parts.front();
  w.rows = 0;
  for (const ops::WeightRef* p : parts) w.rows += p->rows;
  return w;
}

}  // namespace

void stack_moe_experts(WeightArena& arena, ops::MoeWeights* m) {
  std::vector<ops::WeightRef*> gate_up, down;
  for (size_t e = 0; e < m->gate.size(); ++e) {
    gate_up.push_back(&m->gate[e]);
    gate_up.push_back(&m->up[e]);
    down.push_back(&m->down[e]);
  }
  if (gate_up.empty()) fail("stack_moe_experts: a mixture without experts");
  // fp8 experts always stack: their scale grids are separate blocks even where codes adjoin.
  auto stack = [&](const std::vector<ops::WeightRef*>& parts) {
    const bool view = parts.front()->dtype != DType::F8_E4M3 && contiguous(parts);
    return view ? stacked_view(parts) : arena.stack_rows(parts);
  };
  m->experts_gate_up = stack(gate_up);
  m->experts_down = stack(down);
  // The shared expert's small products, each a kernel launch and a pass over the input at batch
  // 1: with the routed experts' shape it joins their grouped launches as one more expert (its
  // gate and up stacked as theirs are); else gate and up become one pair-layout product. The
  // gate logit rides along with the router's.
  if (m->shared_gate_proj.rows == 0) return;
  const ops::WeightRef& e0 = m->gate.front();
  const bool bf16 = m->shared_gate_proj.dtype == DType::BF16 &&
                    m->shared_up_proj.dtype == DType::BF16 &&
                    m->shared_down_proj.dtype == DType::BF16 && e0.dtype == DType::BF16;
  if (!m->shared_gate_up.data && bf16 && m->shared_gate_proj.rows == e0.rows &&
      m->shared_gate_proj.cols == e0.cols) {
    m->shared_gate_up = arena.stack_rows({&m->shared_gate_proj, &m->shared_up_proj});
    m->shared_in_groups = true;
  }
  // (Not for fp8: interleaving rows in groups of kGateUpGroup would split its scale blocks.)
  if (!m->shared_gate_up.data && m->shared_gate_proj.dtype != DType::F8_E4M3 &&
      m->shared_gate_proj.rows % ops::kGateUpGroup == 0)
    m->shared_gate_up =
        arena.interleave_rows(&m->shared_gate_proj, &m->shared_up_proj, ops::kGateUpGroup);
  if (!m->router_shared_gate.data && m->shared_gate.rows == 1)
    m->router_shared_gate = arena.stack_rows({&m->router, &m->shared_gate});
}

uint64_t moe_expert_bytes(const ops::MoeWeights& m) {
  uint64_t n = 0;
  for (const auto* experts : {&m.gate, &m.up, &m.down})
    for (const ops::WeightRef& w : *experts) n += w.bytes();
  return n;
}

uint64_t moe_weight_bytes(const ops::MoeWeights& m) {
  uint64_t n = 0;
  for_each_moe_matrix(m, [&](const ops::WeightRef& w) { n += w.bytes(); });
  return n;
}

}  // namespace tandem
