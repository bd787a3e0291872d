#!/usr/bin/env python3
"""Tiny random-weight Qwen3.5-MoE checkpoints with fp32 transformers references, for tandem's tests.

Run on a machine with torch + transformers (no network needed):

    python3 tools/make_qwen35_moe_fixtures.py --out tests/fixtures

Three checkpoints of different shapes, the same text model class (Qwen3_5MoeForCausalLM), in the
layouts tandem must load:

  qwen35_moe_fused       flat config (model_type qwen3_5_moe_text), float32, one file, experts
                         fused as transformers holds them (mlp.experts.gate_up_proj [E, 2I, H],
                         mlp.experts.down_proj [E, H, I]); 8 experts, 2 per token.
  qwen35_moe_per_expert  nested config (model_type qwen3_5_moe, text under text_config, tensors
                         under model.language_model.), bfloat16, two shards + index, one tensor
                         per expert projection (mlp.experts.{e}.{gate,up,down}_proj.weight);
                         6 experts, 3 per token.
  qwen35_moe_no_shared   flat, float32, fused; no shared expert (shared_expert_intermediate_size
                         0: transformers keeps zero-size shared-expert tensors and the gate, which
                         add nothing) and norm_topk_prob false in its config, which
                         transformers' qwen3_5_moe router ignores (it always renormalises the
                         chosen probabilities); 4 experts, 1 per token.

The weights are drawn at realistic scales (projections ~1/sqrt(fan_in), router logits of O(1)
spread so routing has clear margins). References are computed in fp32 on the CPU from exactly the
values written (bf16 weights rounded first): for two prompts, greedy_i (8 tokens, a full forward
per step) with greedy_gap_i (top-1 minus top-2 logit), tokens_i = prompt_i + greedy_i, logits_i
[len, vocab] of ONE forward over tokens_i, and the routing of that forward: routing_i [layers,
len, k] (expert ids in transformers' topk order) and routing_margin_i [layers, len] (the k-th
minus the (k+1)-th routing probability; a position whose margin is tiny may flip legitimately).
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

# transformers would pick these CUDA/Triton kernel packages (Gated DeltaNet, causal conv) over its
# pure-torch reference functions when installed; the reference is the pure-torch path.
for _name in ("fla", "causal_conv1d"):
    sys.modules.setdefault(_name, None)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
import transformers  # noqa: E402


def text_config(experts: int, top_k: int, shared: int = 48, norm_topk: bool = True,
                vocab: int = 160) -> dict:
    return {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_experts": experts, "num_experts_per_tok": top_k,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": shared,
        "norm_topk_prob": norm_topk,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
    }


def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("A_log"):
                v = torch.rand(shape, generator=g) * 2.7
            elif name.endswith("dt_bias"):
                v = torch.rand(shape, generator=g) + 0.5
            elif name.endswith("linear_attn.norm.weight"):
                v = 0.9 + 0.2 * torch.rand(shape, generator=g)
            elif "norm" in name and p.dim() == 1:
                v = 0.2 * torch.rand(shape, generator=g) - 0.1  # zero-centred RMSNorm weights
            elif name.endswith("conv1d.weight"):
                v = torch.rand(shape, generator=g) - 0.5
            elif name.endswith("embed_tokens.weight"):
                v = torch.randn(shape, generator=g)
            elif name.endswith("mlp.gate.weight"):
                v = torch.randn(shape, generator=g) * (2.0 / math.sqrt(shape[-1]))
            else:
                fan_in = shape[-1]
                v = torch.randn(shape, generator=g) / math.sqrt(fan_in)
            p.copy_(v.to(p.dtype))


def route_hooks(model, sink: list):
    handles = []
    for layer in model.model.layers:
        gate = layer.mlp.gate

        def hook(module, args, output, idx=len(handles)):
            logits = output[0].float()
            probs = torch.softmax(logits, dim=-1)
            top = torch.topk(probs, module.top_k + 1 if module.top_k < probs.shape[-1] else module.top_k, dim=-1).values
            margin = (top[:, module.top_k - 1] - top[:, module.top_k]) if top.shape[-1] > module.top_k \
                else torch.ones(probs.shape[0])
            sink.append((idx, output[2].to(torch.int32), margin))

        handles.append(gate.register_forward_hook(hook))
    return handles


def make(out: Path, name: str, experts: int, top_k: int, dtype: str, nested: bool,
         per_expert: bool, shards: int, seed: int, shared: int = 48, norm_topk: bool = True) -> None:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    tc = text_config(experts, top_k, shared, norm_topk)
    cfg = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in tc.items() if k != "model_type"})
    for key in ("shared_expert_intermediate_size", "norm_topk_prob"):
        if getattr(cfg, key, None) != tc[key]:
            sys.exit(f"{name}: transformers' config does not keep {key}={tc[key]}")
    torch.manual_seed(seed)
    try:
        model = transformers.Qwen3_5MoeForCausalLM._from_config(cfg, attn_implementation="eager")
    except (TypeError, ValueError):
        model = transformers.Qwen3_5MoeForCausalLM(cfg)
    model = model.eval().float()
    if shared == 0:  # the block must really add nothing besides its routed experts
        block = model.model.layers[0].mlp
        probe = torch.randn(3, tc["hidden_size"])
        with torch.no_grad():
            extra = block.shared_expert(probe) if hasattr(block, "shared_expert") else torch.zeros(1)
        if extra.abs().max() != 0:
            sys.exit(f"{name}: a shared expert of intermediate size 0 still adds to the output")
    randomize(model, seed)
    if dtype == "bfloat16":  # the reference sees exactly the rounded weights
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("A_log") or n.endswith("dt_bias"):
                    continue  # published checkpoints keep these in fp32
                p.copy_(p.to(torch.bfloat16).float())
    # Tensors as written.
    prefix = "model.language_model." if nested else "model."
    tensors = {}
    for n, p in model.state_dict().items():
        t = p.detach().clone()
        if dtype == "bfloat16" and not (n.endswith("A_log") or n.endswith("dt_bias")):
            t = t.to(torch.bfloat16)
        key = n.replace("model.", prefix, 1) if n.startswith("model.") else n
        if per_expert and key.endswith("mlp.experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                tensors[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
            continue
        if per_expert and key.endswith("mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            for e in range(t.shape[0]):
                tensors[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
            continue
        tensors[key] = t.contiguous()
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    else:
        per = (len(names) + shards - 1) // shards
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {}}
        for s in range(shards):
            part = names[s * per:(s + 1) * per]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, str(d / fname), metadata={"format": "pt"})
            for n in part:
                index["weight_map"][n] = fname
        (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = dict(tc)
    if nested:
        config = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                  "tie_word_embeddings": False, "text_config": tc}
    else:
        config["architectures"] = ["Qwen3_5MoeForCausalLM"]
    (d / "config.json").write_text(json.dumps(config, indent=1))

    # References.
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(4, tc["vocab_size"], (n,), generator=g).tolist() for n in (7, 12)]
    ref = {}
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            seq = list(prompt)
            gaps = []
            for _ in range(8):
                logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
                top2 = torch.topk(logits, 2).values
                gaps.append(float(top2[0] - top2[1]))
                seq.append(int(torch.argmax(logits)))
            sink = []
            handles = route_hooks(model, sink)
            logits = model(torch.tensor([seq]), use_cache=False).logits[0].float()
            for h in handles:
                h.remove()
            sink.sort(key=lambda x: x[0])
            if len(sink) != tc["num_hidden_layers"]:
                sys.exit(f"{name}: captured {len(sink)} routings for {tc['num_hidden_layers']} layers")
            ref[f"prompt_{i}"] = torch.tensor(prompt, dtype=torch.int64)
            ref[f"tokens_{i}"] = torch.tensor(seq, dtype=torch.int64)
            ref[f"greedy_{i}"] = torch.tensor(seq[len(prompt):], dtype=torch.int64)
            ref[f"greedy_gap_{i}"] = torch.tensor(gaps, dtype=torch.float32)
            ref[f"logits_{i}"] = logits.contiguous()
            ref[f"routing_{i}"] = torch.stack([s[1] for s in sink]).contiguous()
            ref[f"routing_margin_{i}"] = torch.stack([s[2].float() for s in sink]).contiguous()
    save_file(ref, str(d / "reference.safetensors"))
    (d / "reference.json").write_text(json.dumps({
        "description": __doc__.split("\n")[0] + f" ({name}); see tools/make_qwen35_moe_fixtures.py",
        "seed": seed, "dtype": dtype, "nested": nested, "per_expert_tensors": per_expert,
        "shards": shards, "num_experts": experts, "num_experts_per_tok": top_k,
        "shared_expert_intermediate_size": shared, "norm_topk_prob": norm_topk,
        "tie_threshold": 1e-3, "routing_margin_threshold": 1e-4,
        "min_greedy_gap": min(min(ref[f"greedy_gap_{i}"].tolist()) for i in range(2)),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }, indent=1))
    print(f"wrote {d}: {len(tensors)} tensors, prompts {[len(p) for p in prompts]}, "
          f"greedy {[ref[f'greedy_{i}'].tolist() for i in range(2)]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "fixtures")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    make(a.out, "qwen35_moe_fused", 8, 2, "float32", nested=False, per_expert=False, shards=1, seed=71)
    make(a.out, "qwen35_moe_per_expert", 6, 3, "bfloat16", nested=True, per_expert=True, shards=2, seed=73)
    make(a.out, "qwen35_moe_no_shared", 4, 1, "float32", nested=False, per_expert=False, shards=1, seed=79,
         shared=0, norm_topk=False)


if __name__ == "__main__":
    main()
