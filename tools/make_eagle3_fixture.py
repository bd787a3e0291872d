#!/usr/bin/env python3
"""A small random EAGLE-3 head for the bundled demo model and its fp32 reference: the oracle of tandem's
C++ EAGLE-3 drafter. Runs on the CPU in seconds (torch + transformers >= 5 with qwen3_5 + tokenizers +
safetensors, no network):

    python3 tools/make_eagle3_fixture.py               # writes tests/fixtures/eagle3_demo/
    python3 tools/make_eagle3_fixture.py --self-test   # eagle3_head's self-test, then the fixture into a temp dir

The head (tools/eagle3_head.py states the layout and the arithmetic) is written in the published layout
under head/: hidden 384 (the demo's), intermediate 256, 6 heads / 2 kv heads / head_dim 64, rope_theta
10000, rms_norm_eps 1e-6, tap layers [1, 3, 6] of the 8-layer demo target, draft vocabulary 512 ids (a
random subset of the 4096 target ids that includes id 0; d2t int64 / t2d bool), no embed_tokens (the
target's embedding is used), bf16 weights drawn N(0, 1/fan_in) (o_proj and down_proj x 2, fc scaled to
unit output rms on the prompt) with norm weights 1 + 0.1 N(0, 1). The seed is the first from --seed
whose greedy chain has a top1 - top2 logit gap >= 0.02 at every step and >= 3 distinct tokens.

The reference is computed in fp32 on the CPU from exactly the stored values (the head's bf16 weights
and the demo's bf16 checkpoint, both upcast; the target runs through tools/train_demo_model.py's
model with eager attention, as tests/fixtures/demo_reference does). reference.safetensors (fp32 unless
said):

  prompt_ids      int32 [n]          n = 40 tokens of the first held-out prompt of models/qwen35-demo/
                                     prompts.jsonl (demo tokenizer) whose greedy next token has a
                                     top1 - top2 target logit gap >= 0.02
  taps            [n, 3*384]         the target's taps at layers [1, 3, 6] = output_hidden_states
                                     entries 1, 3, 6 (the residual stream entering those layers),
                                     concatenated in that order
  context_logits  [n-1, 512]         draft logits of rows p = 0..n-2 from (prompt_ids[p+1], taps[p]),
                                     at rotary position p, all in one causal pass
  pending         int32 [1]          x_n: the target's greedy next token after the prompt
  chain_logits    [4, 512]           greedy chain of depth 4: step 0 is row n-1 = (pending, taps[n-1]);
  chain_tokens    int32 [4]          step j is row n-1+j = (chain_tokens[j-1], chain_hidden[j-1]); each
  chain_hidden    [4, 384]           attends to the n-1 context rows and the chain's earlier rows; tokens
                                     are the d2t-mapped argmax (target ids), hidden is `out` (before norm)

reference.json documents every tensor, the head config, the prompt, the gaps, the checks made and the
versions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

# make_demo_reference imports tools/train_demo_model.py (offline environment, pure-torch Gated DeltaNet)
# and loads the demo checkpoint exactly as the demo reference does.
import make_demo_reference as mdr  # noqa: E402
import eagle3_head as e3  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

tdm = mdr.tdm
REPO_ROOT = TOOLS.parent
NAME = "eagle3_demo"
SEED = 22
TAP_LAYERS = [1, 3, 6]
DRAFT_VOCAB = 512
INTERMEDIATE = 256
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64
ROPE_THETA = 10000.0
PROMPT_LEN = 40
DEPTH = 4
MIN_GAP = 0.02
MIN_DISTINCT_CHAIN = 3
OUT_GAIN = 2.0
SEED_TRIES = 200
TOL = 1e-5
MAX_BYTES = 4_000_000


def die(msg: str) -> None:
    sys.exit(f"make_eagle3_fixture: {msg}")


def max_abs(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def top_gaps(logits: torch.Tensor) -> torch.Tensor:
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def head_config(cfg_json: dict) -> e3.Eagle3Config:
    text = cfg_json["text_config"]
    return e3.Eagle3Config(
        hidden_size=int(text["hidden_size"]), intermediate_size=INTERMEDIATE, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=int(text["vocab_size"]),
        draft_vocab_size=DRAFT_VOCAB, target_hidden_size=int(text["hidden_size"]), tap_layers=list(TAP_LAYERS),
        rms_norm_eps=1e-6, rope_theta=ROPE_THETA, max_position_embeddings=int(text["max_position_embeddings"]),
        has_embed_tokens=False)


@torch.no_grad()
def random_head(cfg: e3.Eagle3Config, seed: int, target_embed: torch.Tensor, taps: torch.Tensor) -> e3.Eagle3Head:
    """A random head whose weights are already the bf16 values that will be stored (upcast to fp32).
    fc is rescaled so that g = fc(taps) has unit rms over the prompt, and o_proj / down_proj get a gain
    of OUT_GAIN, so that the token of a chain step moves its output as much as the carried hidden does
    (otherwise chains repeat one token and a wrong token feed would go unseen)."""
    gen = torch.Generator().manual_seed(seed)
    head = e3.Eagle3Head(cfg)
    head.init_random(gen, norm_jitter=0.1)
    head.midlayer.self_attn.o_proj.weight.mul_(OUT_GAIN)
    head.midlayer.mlp.down_proj.weight.mul_(OUT_GAIN)
    head.fc.weight.div_(head.project(taps).pow(2).mean().sqrt())
    rest = torch.randperm(cfg.vocab_size - 1, generator=gen)[:cfg.draft_vocab_size - 1] + 1
    head.set_draft_vocab(torch.cat([torch.zeros(1, dtype=torch.int64), rest]))
    stored = e3.layout_tensors(head, torch.bfloat16)
    head.load_state_dict({k: (v if k in ("d2t", "t2d") else v.float()) for k, v in stored.items()}, strict=True)
    head.attach_target_embedding(target_embed)
    return head.eval()


@torch.no_grad()
def head_reference(head: e3.Eagle3Head, ids: torch.Tensor, taps: torch.Tensor, pending: int) -> dict:
    """Context rows, the greedy chain and the cross-checks (full recompute, one-pass row n-1)."""
    n = ids.numel()
    out_ctx, past = head.context_forward(ids[None, 1:], taps[None, :-1])
    ctx_logits = head.logits(out_ctx)[0]
    pend = torch.tensor([pending], dtype=torch.int64)
    tokens, logits, hidden = head.draft_chain(past, pend, taps[None, n - 1], n - 1, DEPTH)
    tokens, logits, hidden = tokens[0], logits[0], hidden[0]
    # Full recompute: rows 0..n-2+DEPTH in one causal pass, chain rows fed their own tokens and hiddens.
    ids_r = torch.cat([ids[1:], pend, tokens[:-1]])[None]
    g_r = torch.cat([head.project(taps), hidden[:-1]])[None]
    out_r, _ = head.rows(ids_r, g_r, torch.arange(n - 1 + DEPTH))
    d_recompute = max_abs(out_r[0, n - 1:], hidden)
    d_ctx = max_abs(out_r[0, :n - 1], out_ctx[0])
    # TTT step 0 over x_0..x_n (prompt + pending): its row n-1 is chain step 0 (the taps of x_n, a
    # placeholder row here, are never read).
    seq = torch.cat([ids, pend])[None]
    taps_ext = torch.cat([taps, torch.zeros(1, taps.shape[1])])[None]
    outs = head.ttt_forward(seq, taps_ext, 1)
    d_ttt0 = max_abs(outs[0][0, n - 1], hidden[0])
    return {"context_logits": ctx_logits, "chain_tokens": tokens, "chain_logits": logits, "chain_hidden": hidden,
            "checks": {"chain_vs_full_recompute_max_abs_diff": d_recompute,
                       "context_rows_in_recompute_max_abs_diff": d_ctx,
                       "chain_step0_vs_ttt_step0_max_abs_diff": d_ttt0}}


def choose_prompt(model, tok, model_dir: Path):
    """The first held-out prompt of prompts.jsonl with >= PROMPT_LEN tokens whose greedy next token is
    tie-free; heldout_sample.py windows as a fallback."""
    cands = []
    for line in (model_dir / "prompts.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        ids = tok.encode(rec["prompt"], add_special_tokens=False).ids
        if len(ids) >= PROMPT_LEN:
            cands.append((f"prompts.jsonl id {rec['id']!r} ({rec['source']}:{rec['function']}), first "
                          f"{PROMPT_LEN} of {len(ids)} tokens", ids[:PROMPT_LEN]))
    sample = tok.encode((model_dir / "heldout_sample.py").read_bytes().decode("utf-8"), add_special_tokens=False).ids
    for start in range(0, max(0, len(sample) - PROMPT_LEN), PROMPT_LEN):
        cands.append((f"heldout_sample.py tokens {start}..{start + PROMPT_LEN - 1}", sample[start:start + PROMPT_LEN]))
    for source, ids in cands:
        x = torch.tensor(ids, dtype=torch.int64)
        taps, last = e3.target_taps(model.model, x[None], TAP_LAYERS)
        logits = model.lm_head(last)[0]
        gap = float(top_gaps(logits[-1]))
        if gap >= MIN_GAP:
            return source, x, taps[0], logits, gap
        print(f"  skip {source}: target top1 - top2 gap {gap:.4f} < {MIN_GAP}")
    die("no held-out prompt with a tie-free greedy next token")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def make(model_dir: Path, out_root: Path, seed0: int) -> Path:
    t0 = time.time()
    d = out_root / NAME
    tdm.banner(f"load {model_dir}")
    model, _mtp, cfg_json = mdr.load_demo_model(model_dir, "eager")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    n_layers = int(cfg_json["text_config"]["num_hidden_layers"])
    cfg = head_config(cfg_json)
    target_embed = model.model.embed_tokens.weight.detach()

    with torch.no_grad():
        tdm.banner("prompt and taps")
        source, ids, taps, logits, pend_gap = choose_prompt(model, tok, model_dir)
        n = ids.numel()
        hooked, from_hidden_states = e3.taps_by_hooks(model.model, ids[None], TAP_LAYERS)
        if not torch.equal(hooked, from_hidden_states):
            die(f"output_hidden_states entries {TAP_LAYERS} differ from the inputs of those decoder layers by "
                f"{max_abs(hooked, from_hidden_states):.2e}")
        d_taps = max_abs(from_hidden_states[0], taps)
        if d_taps > TOL:
            die(f"two forwards of the prompt give taps {d_taps:.2e} apart")
        full = model(input_ids=ids[None], use_cache=False).logits[0]
        d_full = max_abs(full, logits)
        if d_full > TOL:
            die(f"Qwen3_5ForCausalLM logits differ from lm_head(last_hidden_state) by {d_full}")
        pending = int(logits[-1].argmax())
        print(f"  {source}: {ids.tolist()}\n  text {tok.decode(ids.tolist(), skip_special_tokens=False)!r}")
        print(f"  pending {pending} ({tok.decode([pending], skip_special_tokens=False)!r}), gap {pend_gap:.4f}; "
              f"taps {tuple(taps.shape)} equal the layer inputs (pre-hooks)")

        tdm.banner("head")
        for seed in range(seed0, seed0 + SEED_TRIES):
            head = random_head(cfg, seed, target_embed, taps)
            ref = head_reference(head, ids, taps, pending)
            gaps = top_gaps(ref["chain_logits"])
            distinct = len(set(ref["chain_tokens"].tolist()))
            if float(gaps.min()) >= MIN_GAP and distinct >= MIN_DISTINCT_CHAIN:
                break
            print(f"  seed {seed}: chain {ref['chain_tokens'].tolist()} ({distinct} distinct), gaps "
                  f"{[round(g, 4) for g in gaps.tolist()]}")
        else:
            die(f"no seed in [{seed0}, {seed0 + SEED_TRIES}) gives a tie-free chain")
        print(f"  seed {seed}: chain {ref['chain_tokens'].tolist()} "
              f"{tok.decode(ref['chain_tokens'].tolist(), skip_special_tokens=False)!r}, gaps "
              f"{[round(g, 4) for g in gaps.tolist()]}; checks {ref['checks']}")

        tdm.banner(f"write {d}")
        d.mkdir(parents=True, exist_ok=True)
        stored = e3.save_head(head, d / "head", metadata={"generator": "tools/make_eagle3_fixture.py"})
        # The reference comes from the files as written.
        disk = e3.load_head(d / "head", target_layers=n_layers)
        disk.attach_target_embedding(target_embed)
        disk.eval()
        for k, v in head.state_dict().items():
            if not torch.equal(disk.state_dict()[k], v):
                die(f"head/model.safetensors: {k} reloads differently from the in-memory head")
        ref = head_reference(disk, ids, taps, pending)
        for k, v in ref["checks"].items():
            if v > TOL:
                die(f"self-check {k} = {v:.2e} > {TOL}")
        if not bool(disk.t2d[0]):
            die("id 0 is not in the draft vocabulary")

    tensors = {
        "prompt_ids": ids.to(torch.int32).contiguous(),
        "taps": taps.float().contiguous(),
        "context_logits": ref["context_logits"].float().contiguous(),
        "pending": torch.tensor([pending], dtype=torch.int32),
        "chain_logits": ref["chain_logits"].float().contiguous(),
        "chain_tokens": ref["chain_tokens"].to(torch.int32).contiguous(),
        "chain_hidden": ref["chain_hidden"].float().contiguous(),
    }
    want = {"prompt_ids": [n], "taps": [n, len(TAP_LAYERS) * cfg.target_hidden_size],
            "context_logits": [n - 1, DRAFT_VOCAB], "pending": [1], "chain_logits": [DEPTH, DRAFT_VOCAB],
            "chain_tokens": [DEPTH], "chain_hidden": [DEPTH, cfg.hidden_size]}
    for k, shape in want.items():
        if list(tensors[k].shape) != shape:
            die(f"{k} has shape {list(tensors[k].shape)}, expected {shape}")
        if tensors[k].is_floating_point() and not bool(torch.isfinite(tensors[k]).all()):
            die(f"{k} has non-finite values")
    save_file(tensors, str(d / "reference.safetensors"), metadata={"format": "pt", "model": "qwen35-demo",
                                                                    "generator": "tools/make_eagle3_fixture.py"})

    ctx_gaps = top_gaps(ref["context_logits"])
    chain_gaps = top_gaps(ref["chain_logits"])
    draft_ids = disk.draft_ids()
    chain_draft = [int((draft_ids == t).nonzero()[0]) for t in ref["chain_tokens"].tolist()]

    def spec(name: str, meaning: str) -> dict:
        t = tensors[name]
        return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "meaning": meaning}

    model_file = model_dir / "model.safetensors"
    info = {
        "description": "fp32 CPU oracle of tandem's EAGLE-3 drafter: a small random head (head/, published "
                       "layout) for models/qwen35-demo, its context rows over a held-out prompt and a greedy "
                       "chain of depth 4. Weights: the stored bf16 values upcast (head and target).",
        "generator": "tools/make_eagle3_fixture.py (head arithmetic: tools/eagle3_head.py)",
        "seed": seed,
        "seed_rule": f"first seed from {seed0} whose chain has every top1 - top2 draft logit gap >= {MIN_GAP} "
                     f"and at least {MIN_DISTINCT_CHAIN} distinct tokens",
        "head": {
            "dir": "head/",
            "config": json.loads((d / "head" / "config.json").read_text(encoding="utf-8")),
            "tensors": {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
                        for k, v in sorted(stored.items())},
            "init": f"matrices N(0, 1/fan_in), o_proj and down_proj times {OUT_GAIN}, fc divided by the rms of "
                    "fc(taps) over the prompt, norm weights 1 + 0.1 N(0, 1); then rounded to bf16",
            "embed_tokens": "absent: rows embed with the target's embed_tokens (demo checkpoint, bf16 upcast)",
            "draft_vocab": f"{DRAFT_VOCAB} target ids: id 0 plus {DRAFT_VOCAB - 1} drawn by randperm(V - 1) + 1 "
                           "with the seed's generator, sorted ascending; draft id i = the i-th smallest",
            "draft_vocab_includes_0": True,
        },
        "target": {
            "dir": str(model_dir.relative_to(REPO_ROOT)) if model_dir.is_relative_to(REPO_ROOT) else str(model_dir),
            "model_safetensors_sha256": sha256_of(model_file),
            "layers": n_layers,
            "tap_layers": TAP_LAYERS,
            "taps": "hidden_states[i] of transformers' output_hidden_states for i in tap_layers (entry 0 = "
                    "embedding output): the residual stream entering decoder layer i; checked equal to the "
                    "layers' inputs read by forward pre-hooks",
            "compute": "transformers Qwen3_5ForCausalLM (tools/train_demo_model.py), eager attention, "
                       "use_cache=False, fp32 CPU",
        },
        "prompt": {"source": source, "ids": ids.tolist(),
                   "text": tok.decode(ids.tolist(), skip_special_tokens=False), "length": n},
        "pending": {"token": pending, "text": tok.decode([pending], skip_special_tokens=False),
                    "rule": "argmax of the target logits at position n-1 (ties: lowest id)",
                    "target_top1_top2_gap": pend_gap},
        "chain": {
            "depth": DEPTH,
            "tokens": ref["chain_tokens"].tolist(),
            "draft_ids": chain_draft,
            "text": tok.decode(ref["chain_tokens"].tolist(), skip_special_tokens=False),
            "top1_top2_gaps": chain_gaps.tolist(),
            "steps": f"step 0 = row {n - 1} = (pending, fc(taps[{n - 1}])) at rotary position {n - 1}; step j = "
                     f"row {n - 1}+j = (chain_tokens[j-1], chain_hidden[j-1]) at position {n - 1}+j, no fc; "
                     f"each attends to context rows 0..{n - 2} and the chain's rows before it and itself",
        },
        "context": {"rows": f"p = 0..{n - 2} from (prompt_ids[p+1], taps[p]) at rotary position p; causal over "
                            "rows; row p predicts x[p+2]",
                    "min_top1_top2_gap": float(ctx_gaps.min()),
                    "argmax_draft_ids": ref["context_logits"].argmax(-1).tolist()},
        "convention": {
            "row": "a = concat(input_layernorm(embed(t)), hidden_norm(g)) [2H]; q,k,v = projections of a; "
                   "rotary at the row's position; causal GQA attention over the head's rows (query head h "
                   "reads kv head h // 3), scale 1/sqrt(64); r = g + o_proj(attn); out = r + down(silu(gate(n)) "
                   "* up(n)), n = post_attention_layernorm(r); logits = lm_head(norm(out))",
            "g": "fc(concat(taps)) for context rows and chain step 0; the previous step's out for chain steps",
            "rms_norm": "Llama: x * rsqrt(mean(x^2) + 1e-6) * w",
            "rotary": "Llama default: rotate_half over the full head_dim 64, inv_freq_i = 10000^(-2i/64), "
                      "angles p * inv_freq formed in float64 then cos/sin rounded to fp32",
            "proposal": "target id = argmax draft id + d2t[argmax draft id] (ties: lowest draft id)",
        },
        "tensors": {
            "prompt_ids": spec("prompt_ids", "the prompt x_0..x_{n-1}"),
            "taps": spec("taps", f"target taps at layers {TAP_LAYERS}, concatenated per position in that order"),
            "context_logits": spec("context_logits", "draft logits of context rows p = 0..n-2, one causal pass"),
            "pending": spec("pending", "x_n, the target's greedy token after the prompt"),
            "chain_logits": spec("chain_logits", "draft logits of chain steps 0..3"),
            "chain_tokens": spec("chain_tokens", "chain proposals as target ids (d2t-mapped argmax)"),
            "chain_hidden": spec("chain_hidden", "out (before the final norm) of chain steps 0..3"),
        },
        "self_checks": {**ref["checks"], "causal_lm_logits_vs_lm_head_max_abs_diff": d_full,
                        "taps_equal_layer_inputs": True, "stored_head_reloads_exactly": True, "tolerance": TOL},
        "versions": tdm.versions(),
        "total_seconds": round(time.time() - t0, 1),
    }
    tdm.write_json(d / "reference.json", info)
    total = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    print(f"  wrote {d}: head {sum(v.numel() for v in stored.values()):,} values; prompt {n}; pending {pending}; "
          f"chain {ref['chain_tokens'].tolist()}; min gaps context {float(ctx_gaps.min()):.4f} / chain "
          f"{float(chain_gaps.min()):.4f}; {total:,} bytes; {time.time() - t0:.1f}s")
    if total > MAX_BYTES:
        die(f"{d} is {total:,} bytes (> {MAX_BYTES:,})")
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "qwen35-demo")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures",
                    help="parent directory (default tests/fixtures); the fixture goes to OUT/eagle3_demo")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--self-test", action="store_true",
                    help="run eagle3_head's self-test, then write the fixture into a temporary directory")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"versions: {tdm.versions()}")
    if args.self_test:
        e3.self_test()
        with tempfile.TemporaryDirectory() as tmp:
            make(args.model.resolve(), Path(tmp), args.seed)
        print("make_eagle3_fixture self-test passed (nothing written to the repository)")
        return
    make(args.model.resolve(), args.out.resolve(), args.seed)


if __name__ == "__main__":
    main()
