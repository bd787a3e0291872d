#!/usr/bin/env python3
"""A tiny random-weight GLM-5 (glm_moe_dsa) checkpoint WITH its NextN (MTP) layer, and fp32 references
for tandem's NextN block (spec::GlmMtpBlock). No network; a few seconds on a CPU:

    python3 tools/make_glm_nextn_fixture.py            # writes tests/fixtures/glm5_nextn/

Shape: tests/fixtures/glm5_bf16's (vocab 160, hidden 64, 3 decoder layers [dense, sparse, sparse], MLA
with a query LoRA, 8 experts in 4 groups, 2 kept, 2 per token, one shared expert, a DSA indexer of 8
heads keeping 8 positions), except moe_intermediate_size 16 (32 there) to keep the directory under
600 KB, plus num_nextn_predict_layers 1: the NextN layer model.layers.3.* (enorm, hnorm, eh_proj,
shared_head.norm, one decoder layer with MLA and a mixture, no indexer). Weights bf16 (router
correction biases fp32), seed 93; the reference is computed from exactly the values written.

The NextN computation is tools/glm_nextn.py's (its docstring states it). For one prompt of 20 random
ids in [4, 160):

  prompt         int64 [L]        the ids x_0..x_{L-1}
  hidden         f32 [L, H]       the target's final-normed hidden states (last_hidden_state), one
                                  forward of transformers (eager attention, DSA active: 20 > 8)
  target_logits  f32 [L, V]       lm_head(hidden)
  nextn_out      f32 [L-1, H]     NextN rows p = 0..L-2 from (x_{p+1}, hidden_p) at position p, after
                                  shared_head.norm; the rows attend causally to every earlier row
  nextn_logits   f32 [L-1, V]     lm_head(nextn_out): row p predicts x_{p+2}
  nextn_logit_gap f32 [L-1]       top1 - top2 of nextn_logits per row

reference.json repeats the prompt and the NextN argmax per row, with versions and the rotary layout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

import make_glm5_fixtures as g5  # noqa: E402  (sets HF offline; imports torch, transformers, safetensors)
import glm_nextn as gn  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

NAME = "glm5_nextn"
SEED = 93
PROMPT_LEN = 20
MAX_BYTES = 600_000


def die(msg: str) -> None:
    sys.exit(f"make_glm_nextn_fixture: {msg}")


def config() -> dict:
    c = g5.config()
    c["moe_intermediate_size"] = 16
    interleave = g5.rope_layout()
    c["rope_interleave"] = interleave
    c["indexer_rope_interleave"] = interleave
    c["num_nextn_predict_layers"] = 1
    return c


def make(out: Path, seed: int) -> None:
    d = out / NAME
    d.mkdir(parents=True, exist_ok=True)
    cfg = config()
    N, V = cfg["num_hidden_layers"], cfg["vocab_size"]
    _, ForCausalLM, _, _ = gn.glm_modules()
    torch.manual_seed(seed)
    hf_cfg = gn.make_config(cfg, "eager")
    try:
        model = ForCausalLM._from_config(hf_cfg, attn_implementation="eager")
    except (TypeError, ValueError):
        model = ForCausalLM(hf_cfg)
    model = model.eval().float()
    g5.randomize(model, seed)
    nextn = gn.GlmNextN(cfg, "eager").eval().float()
    g5.randomize(nextn, seed + 7)

    # The file: the target's tensors and the NextN layer's, bf16 (router biases fp32).
    target = gn.to_checkpoint(model.state_dict())
    layer = gn.to_checkpoint(gn.nextn_tensors(nextn, N))
    try:
        gn.check_layout(target, gn.target_shapes(cfg), "target")
        gn.check_layout(layer, gn.nextn_shapes(cfg), "NextN layer")
    except ValueError as exc:
        die(str(exc))
    tensors = {**target, **layer}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=1))

    # The reference sees exactly the values written.
    with torch.no_grad():
        res = model.load_state_dict({k: v.float() for k, v in target.items()}, strict=True)
        if res.missing_keys or res.unexpected_keys:
            die(f"reload into the target: {res}")
        gn.load_nextn(nextn, layer, N)

    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(4, V, (PROMPT_LEN,), generator=g)
    x = prompt[None]
    L = PROMPT_LEN
    seen = []
    indexer = getattr(nextn.layer.self_attn, "indexer", None)
    handle = indexer.register_forward_hook(lambda m, a, o: seen.append(o)) if indexer is not None else None
    with torch.no_grad():
        out = model.model(input_ids=x, use_cache=False)       # transformers' own mask (as the oracle runs)
        hidden = out.last_hidden_state
        target_logits = model.lm_head(hidden)
        full = model(input_ids=x, use_cache=False).logits
        mine = model.model(input_ids=x, attention_mask=gn.causal_mask(L, x.device), use_cache=False)
        rows = gn.nextn_rows(model, nextn, x, hidden)
        nextn_logits = model.lm_head(rows)
        # Causality of the rows: changing the last token changes only the last row.
        x2 = x.clone()
        x2[0, -1] = (x2[0, -1] + 1 - 4) % (V - 4) + 4
        rows2 = gn.nextn_rows(model, nextn, x2, hidden)
    if handle is not None:
        handle.remove()
    d_full = (full - target_logits).abs().max().item()
    d_mask = (mine.last_hidden_state - hidden).abs().max().item()
    if d_full > 1e-5 or d_mask > 1e-5:
        die(f"target forms disagree: ForCausalLM vs lm_head(last_hidden_state) {d_full}, own 4D mask vs "
            f"transformers' mask {d_mask}")
    if (rows[0, :-1] - rows2[0, :-1]).abs().max().item() != 0.0 or (rows[0, -1] - rows2[0, -1]).abs().max() == 0:
        die("NextN rows are not causal (or ignore their token)")
    widths = sorted({int(o.shape[-1]) for o in seen if torch.is_tensor(o) and not o.is_floating_point()})
    if widths and widths != [L - 1]:
        die(f"the NextN layer's indexer kept {widths} positions of {L - 1}: it must attend to every row")

    gap = nextn_logits[0].float().topk(2, dim=-1).values
    gap = (gap[:, 0] - gap[:, 1]).contiguous()
    ref = {
        "prompt": prompt.to(torch.int64).contiguous(),
        "hidden": hidden[0].float().contiguous(),
        "target_logits": target_logits[0].float().contiguous(),
        "nextn_out": rows[0].float().contiguous(),
        "nextn_logits": nextn_logits[0].float().contiguous(),
        "nextn_logit_gap": gap,
    }
    save_file(ref, str(d / "reference.safetensors"))
    (d / "reference.json").write_text(json.dumps({
        "description": __doc__.split("\n")[0] + f" ({NAME}); see tools/make_glm_nextn_fixture.py",
        "seed": seed,
        "prompt": prompt.tolist(),
        "nextn_layer": f"model.layers.{N}",
        "rows": "row p (0..L-2) from (prompt[p+1], hidden[p]) at rotary position p; predicts prompt[p+2]",
        "hidden": "final-normed (model.norm output)",
        "nextn_argmax": nextn_logits[0].argmax(-1).tolist(),
        "min_nextn_logit_gap": float(gap.min()),
        "nextn_indexer_widths_seen": widths,
        "shapes": {k: list(v.shape) for k, v in ref.items()},
        "rope_interleave": cfg["rope_interleave"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }, indent=1))
    total = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
    print(f"wrote {d}: {len(tensors)} tensors ({len(layer)} NextN), prompt {L}, NextN argmax "
          f"{nextn_logits[0].argmax(-1).tolist()}, min gap {float(gap.min()):.4f}; {total:,} bytes")
    if total > MAX_BYTES:
        die(f"{d} is {total:,} bytes (> {MAX_BYTES:,})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=TOOLS.parent / "tests" / "fixtures")
    ap.add_argument("--seed", type=int, default=SEED)
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    try:
        gn.glm_modules()
    except RuntimeError as exc:
        die(str(exc))
    make(a.out, a.seed)


if __name__ == "__main__":
    main()
