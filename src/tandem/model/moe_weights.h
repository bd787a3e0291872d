// Binding a Qwen3.5-MoE mixture of experts (a target layer's MLP, or the MTP layer's) from its
// published tensors under "<...>.mlp.": the router `gate.weight` [E, H], the experts fused as
// transformers writes them (`experts.gate_up_proj` [E, 2I, H]: gate rows then up rows per
// expert; `experts.down_proj` [E, H, I]) or one tensor per projection and expert
// (`experts.{e}.{gate,up,down}_proj.weight`), and the shared expert with its sigmoid gate (none
// when shared_expert_intermediate_size is 0).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tandem/backend/ops.h"
#include "tandem/backend/weight_arena.h"
#include "tandem/model/qwen3_5_config.h"

namespace tandem {

// The tensor `name`, which must have `shape` (the caller checks and names mismatches).
using MoeTensorSource =
    std::function<ops::WeightRef(const std::string& name, const std::vector<int64_t>& shape)>;

// The E routed experts under `prefix` ("...mlp.experts.") into m->gate, up and down: fused as
// transformers writes them (`gate_up_proj` [E, 2I, H], gate rows then up rows per expert;
// `down_proj` [E, H, I]), viewed per expert, or one tensor per projection and expert
// (`{e}.{gate,up,down}_proj.weight`). Shared by Qwen3.5-MoE and GLM-5.
void bind_routed_experts(const std::string& prefix, int64_t E, int64_t I, int64_t H, bool fused,
                         const MoeTensorSource& get, ops::MoeWeights* m);

// prefix: "...mlp.". fused: the experts come as the two fused tensors (else one per expert).
ops::MoeWeights bind_moe_weights(const Qwen35Config& c, const std::string& prefix, bool fused,
                                 const MoeTensorSource& get);

// The CUDA layout of the mixture, made once at bind time (a second call changes nothing):
//  - the experts (ops::MoeWeights::experts_gate_up / experts_down): views of the fused tensors
//    where they already are (a fused checkpoint keeps gate then up rows per expert), else one
//    stacked copy in `arena`, each expert's own block released (no weight is held twice);
//  - the shared expert's gate and up as one weight (shared_gate_up): stacked as a routed
//    expert's where it has their shape in bf16 (shared_in_groups: it runs as one more group of
//    their grouped products), else interleaved into the pair layout (when its inner size is a
//    multiple of ops::kGateUpGroup); and its gate row stacked under the router
//    (router_shared_gate), their own blocks released.
void stack_moe_experts(WeightArena& arena, ops::MoeWeights* m);

// fn(ref) on every matrix the mixture holds: the router, the shared expert and its gate (empty
// refs when there is none), then each expert's gate, up and down. Not the CUDA stacked weights,
// which hold the same values (the shared gate and up keep their shapes, so byte counts hold).
template <class MoeW, class Fn>
void for_each_moe_matrix(MoeW& m, Fn&& fn) {
  for (auto* w :
       {&m.router, &m.shared_gate_proj, &m.shared_up_proj, &m.shared_down_proj, &m.shared_gate})
    fn(*w);
  for (auto* experts : {&m.gate, &m.up, &m.down})
    for (auto& w : *experts) fn(w);
}

// Bytes of every weight the mixture holds (router, experts, shared expert and gate), and of its
// routed experts alone.
uint64_t moe_weight_bytes(const ops::MoeWeights& m);
uint64_t moe_expert_bytes(const ops::MoeWeights& m);

}  // namespace tandem
