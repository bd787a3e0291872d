#!/usr/bin/env python3
"""Tiny random-weight GLM-5 (glm_moe_dsa) checkpoints with fp32 transformers references, for tandem's tests.

Run on a machine with torch + transformers >= 5 (no network needed):

    python3 tools/make_glm5_fixtures.py --out tests/fixtures

Two checkpoints of one tiny shape (3 decoder layers, the first dense; MLA with a query LoRA; 8
experts in 4 groups, 2 kept, 2 per token, one shared expert; a DSA indexer of 8 heads keeping 8
positions, so the reference prompts of 20+ tokens exercise sparse attention; 8 heads make exact
ties between index scores, which a ReLU per head invites, improbable):

  glm5_bf16   bf16 weights (e_score_correction_bias in fp32, as published), one file.
  glm5_fp8    the same weights quantized as the published release is: every Linear matrix in fp8
              e4m3 with one fp32 `weight_scale_inv` per 16 x 16 block (`quantization_config` with
              `weight_block_size` [16, 16]; the published block is 128 x 128, which would be one
              block per tiny matrix), experts one tensor per expert and projection; the router,
              the indexer's weights_proj, the embedding and the head stay bf16, as published.
              Its reference is computed from the dequantized values.

The rotary layout follows the installed transformers: versions with
apply_rotary_pos_emb_interleave rotate adjacent pairs in the attention and the indexer, older ones
rotate halves; config.json's rope_interleave and indexer_rope_interleave say which, so tandem
(which follows the config) is compared with what transformers actually ran.

A third checkpoint, glm5_shared_index (bf16, another seed), has indexer_types [full, shared,
full]: its second layer has no indexer and attends where the first chose.

References (fp32, CPU, from exactly the values written): for two prompts, greedy_i (8 tokens, a
full forward per step) with greedy_gap_i, tokens_i = prompt_i + greedy_i, logits_i [len, vocab] of
ONE forward over tokens_i, routing_i [sparse layers, len, k] (expert ids as transformers picks
them) with routing_margin_i (k-th minus (k+1)-th biased choice), and index_i [layers, len, topk]
(the indexer's selected positions; -1 where a query has fewer positions than topk).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
import transformers  # noqa: E402

BLOCK = 16
E4M3_MAX = 448.0


def config() -> dict:
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "mlp_layer_types": ["dense", "sparse", "sparse"], "index_topk": 8, "index_head_dim": 16,
        "index_n_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_interleave": True,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    }


def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("e_score_correction_bias"):
                v = 0.1 * torch.randn(shape, generator=g)
            elif "norm" in name and p.dim() == 1:
                v = 1.0 + 0.1 * torch.randn(shape, generator=g)
            elif name.endswith("embed_tokens.weight"):
                v = torch.randn(shape, generator=g)
            elif name.endswith("mlp.gate.weight"):
                v = torch.randn(shape, generator=g) * (2.0 / math.sqrt(shape[-1]))
            else:
                v = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            p.copy_(v.to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(tuple(b.shape), generator=g))


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and per-block scale_inv such that w ~= codes * scale_inv (block-wise)."""
    rows, cols = w.shape
    br, bc = (rows + BLOCK - 1) // BLOCK, (cols + BLOCK - 1) // BLOCK
    scale = torch.empty(br, bc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            s = max(float(blk.abs().max()) / E4M3_MAX, 1e-12)
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    s = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q.float() * s


def record_hooks(model, routing: list, index: list):
    """Captures each sparse layer's expert choice (the router's output: logits, weights, ids) and
    each indexer's selection."""
    handles = []
    for li, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            def routed(module, args, output, _li=li):
                logits, _, ids = output
                routing.append((_li, ids.to(torch.int32).clone(), logits.detach().float().clone()))

            handles.append(mlp.gate.register_forward_hook(routed))
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            def hook(module, args, output, _li=li):
                index.append((_li, output.to(torch.int64).clone()))

            handles.append(indexer.register_forward_hook(hook))
    return handles


def remove(handles) -> None:
    for h in handles:
        h.remove()


def margins(gate, router_logits: torch.Tensor, k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """Per token, how far the routing is from a tie: the smaller of the k-th minus (k+1)-th
    biased choice among the kept groups and the topk_group-th minus next group worth (noaux_tc)."""
    choice = router_logits.sigmoid() + gate.e_score_correction_bias.float()
    groups = choice.view(choice.shape[0], n_group, -1)
    worth = groups.topk(2, dim=-1).values.sum(-1)
    inf = torch.full((choice.shape[0],), float("inf"))
    if n_group > topk_group:
        w = worth.topk(topk_group + 1, dim=-1).values
        group_margin = w[:, topk_group - 1] - w[:, topk_group]
    else:
        group_margin = inf
    kept = torch.zeros_like(worth, dtype=torch.bool)
    kept.scatter_(1, worth.topk(topk_group, dim=-1).indices, True)
    masked = choice.masked_fill(~kept.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
    top = masked.topk(k + 1, dim=-1).values
    expert_margin = torch.where(torch.isinf(top[:, k]), inf, top[:, k - 1] - top[:, k])
    return torch.minimum(group_margin, expert_margin)


def rope_layout() -> bool:
    """Whether the installed glm_moe_dsa rotates interleaved pairs (newer transformers)."""
    import inspect
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mod
    return "apply_rotary_pos_emb_interleave" in inspect.getsource(mod)


def keep_bf16(name: str) -> bool:
    """Tensors the published fp8 release keeps in bf16 (not nn.Linear weights of the blocks)."""
    return ("embed_tokens" in name or "lm_head" in name or "weights_proj" in name
            or name.endswith("mlp.gate.weight"))


def make(out: Path, name: str, fp8: bool, seed: int, indexer_types: list | None = None) -> None:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    cfg_dict = config()
    if indexer_types is not None:
        cfg_dict["indexer_types"] = indexer_types
    interleave = rope_layout()
    cfg_dict["rope_interleave"] = interleave
    cfg_dict["indexer_rope_interleave"] = interleave
    cfg = transformers.GlmMoeDsaConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    try:
        model = transformers.GlmMoeDsaForCausalLM._from_config(cfg, attn_implementation="eager")
    except (TypeError, ValueError):
        model = transformers.GlmMoeDsaForCausalLM(cfg)
    model = model.eval().float()
    randomize(model, seed)
    tensors = {}
    with torch.no_grad():
        for n, p in model.state_dict().items():
            t = p.detach().clone()
            keep_fp32 = n.endswith("e_score_correction_bias")
            if keep_fp32:
                tensors[n] = t.float().contiguous()
                continue
            t = t.to(torch.bfloat16)
            if fp8 and t.dim() == 3 and n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # Fused experts, written one quantized tensor per expert and projection.
                base = n[: n.rindex(".")]
                inner = cfg_dict["moe_intermediate_size"]
                value = torch.empty(t.shape, dtype=torch.float32)
                for e in range(t.shape[0]):
                    if n.endswith("gate_up_proj"):
                        parts = [("gate_proj", t[e, :inner], slice(0, inner)),
                                 ("up_proj", t[e, inner:], slice(inner, 2 * inner))]
                    else:
                        parts = [("down_proj", t[e], slice(None))]
                    for proj, w, rows in parts:
                        q, sc = quantize_fp8(w.float())
                        tensors[f"{base}.{e}.{proj}.weight"] = q.contiguous()
                        tensors[f"{base}.{e}.{proj}.weight_scale_inv"] = sc.contiguous()
                        value[e, rows] = dequantize_fp8(q, sc)
            elif fp8 and t.dim() == 2 and not keep_bf16(n):
                q, s = quantize_fp8(t.float())
                tensors[n] = q.contiguous()
                tensors[n.replace(".weight", ".weight_scale_inv")] = s.contiguous()
                value = dequantize_fp8(q, s)
            else:
                tensors[n] = t.contiguous()
                value = t.float()
            # The reference sees exactly the values written.
            target = dict(model.named_parameters()).get(n)
            if target is None:
                target = dict(model.named_buffers()).get(n)
            if target is None:
                sys.exit(f"{name}: no parameter or buffer named {n}")
            target.copy_(value.to(target.dtype).reshape(target.shape))
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    config_json = dict(cfg_dict)
    if fp8:
        config_json["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                              "activation_scheme": "dynamic",
                                              "weight_block_size": [BLOCK, BLOCK]}
    (d / "config.json").write_text(json.dumps(config_json, indent=1))

    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(4, cfg_dict["vocab_size"], (n,), generator=g).tolist() for n in (20, 27)]
    ref = {}
    k = cfg_dict["num_experts_per_tok"]
    topk = cfg_dict["index_topk"]
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            seq = list(prompt)
            gaps = []
            for _ in range(8):
                logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
                top2 = torch.topk(logits, 2).values
                gaps.append(float(top2[0] - top2[1]))
                seq.append(int(torch.argmax(logits)))
            routing, index = [], []
            handles = record_hooks(model, routing, index)
            logits = model(torch.tensor([seq]), use_cache=False).logits[0].float()
            remove(handles)
            routing.sort(key=lambda x: x[0])
            index.sort(key=lambda x: x[0])
            sparse = [li for li, t in enumerate(cfg_dict["mlp_layer_types"]) if t == "sparse"]
            if [r[0] for r in routing] != sparse:
                sys.exit(f"{name}: captured routing of layers {[r[0] for r in routing]}, expected {sparse}")
            layers = cfg_dict["num_hidden_layers"]
            shared = [t == "shared" for t in cfg_dict.get("indexer_types", ["full"] * layers)]
            full = [li for li in range(layers) if not shared[li]]
            if [x[0] for x in index] != full:
                sys.exit(f"{name}: captured index selections of layers {[x[0] for x in index]}, expected {full}")
            n = len(seq)
            # Every layer's choice: its own indexer's, or (shared layers) the previous layer's.
            sel = torch.full((layers, n, topk), -1, dtype=torch.int64)
            captured = dict(index)
            for li in range(layers):
                if shared[li]:
                    sel[li] = sel[li - 1]
                else:
                    idx = captured[li].reshape(n, -1)
                    sel[li, :, : idx.shape[1]] = idx
            ref[f"prompt_{i}"] = torch.tensor(prompt, dtype=torch.int64)
            ref[f"tokens_{i}"] = torch.tensor(seq, dtype=torch.int64)
            ref[f"greedy_{i}"] = torch.tensor(seq[len(prompt):], dtype=torch.int64)
            ref[f"greedy_gap_{i}"] = torch.tensor(gaps, dtype=torch.float32)
            ref[f"logits_{i}"] = logits.contiguous()
            ref[f"routing_{i}"] = torch.stack([r[1].reshape(n, k) for r in routing]).contiguous()
            ref[f"routing_margin_{i}"] = torch.stack(
                [margins(model.model.layers[li].mlp.gate, rl, k, cfg_dict["n_group"],
                         cfg_dict["topk_group"]) for li, _, rl in routing]).contiguous()
            ref[f"index_{i}"] = sel.contiguous()
    save_file(ref, str(d / "reference.safetensors"))
    (d / "reference.json").write_text(json.dumps({
        "description": __doc__.split("\n")[0] + f" ({name}); see tools/make_glm5_fixtures.py",
        "seed": seed, "fp8": fp8, "fp8_block": BLOCK if fp8 else None,
        "min_greedy_gap": min(min(ref[f"greedy_gap_{i}"].tolist()) for i in range(2)),
        "rope_interleave": interleave,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }, indent=1))
    print(f"wrote {d}: {len(tensors)} tensors, prompts {[len(p) for p in prompts]}, "
          f"greedy {[ref[f'greedy_{i}'].tolist() for i in range(2)]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "fixtures")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    if not hasattr(transformers, "GlmMoeDsaForCausalLM"):
        sys.exit(f"transformers {transformers.__version__} has no GlmMoeDsaForCausalLM (glm_moe_dsa)")
    make(a.out, "glm5_bf16", fp8=False, seed=91)
    make(a.out, "glm5_fp8", fp8=True, seed=91)
    # Layer 1 reuses layer 0's DSA choice (transformers' indexer_types "shared").
    make(a.out, "glm5_shared_index", fp8=False, seed=92, indexer_types=["full", "shared", "full"])


if __name__ == "__main__":
    main()
