#!/usr/bin/env python3
"""Train tandem's second demo model: a tiny GLM-5-architecture LM (glm_moe_dsa) with its NextN (MTP) layer.

Run once on a GPU machine with torch + transformers (>= 5 with glm_moe_dsa) + tokenizers + safetensors
(no network needed), after tools/train_demo_model.py has written models/qwen35-demo/ (whose tokenizer,
corpus rules and split this model shares):

    PYTHONUNBUFFERED=1 python3 tools/train_glm_demo_model.py --minutes 4 \\
        --site-packages /opt/torch/.venv/lib/python3.12/site-packages          # writes models/glm5-demo/
    python3 tools/train_glm_demo_model.py --minutes 0.5 --out /tmp/glm        # quick smoke run

The whole run takes about --minutes + 40 seconds (measured on an H100 with transformers 5.17: corpus,
self-tests, evaluation of 200K held-out tokens five ways, export and reload checks; the shipped
model trained at about 354K tokens/s on an H100, 4.3 passes over the 19.9M training tokens in 4
minutes).
Stages (each checks what it can; any surprise stops the run with a message):

  1. corpus     tools/train_demo_model.py's collect_corpus: the same files, the same held-out /
                validation / train split by sha1(relative path), so pass the same --site-packages as
                the Qwen demo's run (its training.json "command"). The held-out and validation file
                lists must equal models/qwen35-demo/training.json's (--allow-split-mismatch to go on).
  2. tokenizer  models/qwen35-demo/tokenizer.json (byte-level BPE, 4096 tokens, <|endoftext|> = 0), not
                retrained; tokenizer.json and tokenizer_config.json are copied into the export.
  3. model      transformers GlmMoeDsaForCausalLM: 4 layers (the first dense), MLA with a query LoRA,
                a DSA indexer in every layer keeping index_topk = 128 positions, 8 routed experts (4
                groups, 2 kept, 2 per token) + 1 shared expert, untied head; plus the NextN layer of
                tools/glm_nextn.py. Self-tests: the 4D-mask forward equals transformers' own, causality,
                the NextN layer attends densely, the indexer re-implementation below matches the
                indexer's choice, the experts backend (grouped_mm if it checks out, else eager).
  4. training   joint loss CE(next token) + 0.3 * CE(NextN: token t+2) + the DSA indexer's KL loss,
                AdamW, bf16 autocast, best-validation checkpoint; stops at --minutes, --steps-max or
                --epochs. Routers: DeepSeek-V3's auxiliary-loss-free balancing (each expert's
                e_score_correction_bias moves by --bias-update per step towards even load).
  5. evaluation held-out perplexity, target top-1, NextN top-1 and NextN agreement with the target's
                greedy choice (teacher-forced depth-1 acceptance), as the Qwen demo reports; also the
                perplexity with dense attention (what the DSA costs).
  6. export     the published GLM-5 layout: config.json (model_type glm_moe_dsa,
                num_nextn_predict_layers 1), model.safetensors (bf16; router biases fp32) with the
                target under transformers' names and the NextN layer under model.layers.4.*,
                generation_config.json, tokenizer files, training.json, heldout_sample.py, prompts.jsonl.
  7. reload     the file into a fresh transformers model and a fresh NextN layer: every tensor equals
                the trained one rounded to bf16, the logits equal the rounded trained model's, and
                GlmMoeDsaForCausalLM.from_pretrained(out) gives the same logits (it reports the NextN
                keys as unexpected, which is expected).

NextN convention (what tandem's glm-mtp drafter does; tools/glm_nextn.py): for x_0..x_{L-1} with the
target's FINAL-NORMED hidden states h_0..h_{L-1}, row p = eh_proj(concat(enorm(embed(x_{p+1})),
hnorm(h_p))) at rotary position p, one GLM decoder layer attending causally to every earlier row (no
DSA), shared_head.norm, the target's lm_head; row p predicts x_{p+2}.

DSA indexer training (DeepSeek-V3.2's warm-up objective). transformers' indexer runs under no_grad and
its top-k passes no gradient, so without help its weights would stay random. Per layer, forward hooks
take the attention's input, rotary (cos, sin) and mask, and its attention probabilities (eager
attention returns them); the index scores are recomputed WITH gradients from the indexer's own
weights (wq_b, wk, k_norm, weights_proj; relu per head, head weights * n_heads^-0.5), and
KL(p || softmax(scores)) is added, p = the detached attention probabilities summed over heads and
renormalised, on the first --index-kl-batch sequences of each batch. The indexer's inputs are
detached, so this loss trains only the indexer. The recomputation is checked against the indexer's
actual choice before training (three rotary layouts are tried); if none matches, or the attention
gives no probabilities (--attn sdpa), the loss is off and training.json says why. For the first
--dense-warmup of the training budget every layer keeps every position (index_topk = seq), so the
indexer learns from dense attention, as in DeepSeek-V3.2's dense warm-up; then DSA is on (128).
Validation always runs with DSA on.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

# train_demo_model sets the offline environment first and imports torch / transformers / tokenizers.
import train_demo_model as tdm  # noqa: E402
import make_glm5_fixtures as g5  # noqa: E402
import glm_nextn as gn  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
import tokenizers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

fail, check, banner, write_json, _nullctx = tdm.fail, tdm.check, tdm.banner, tdm.write_json, tdm._nullctx

REPO_ROOT = TOOLS.parent
DEFAULT_OUT = REPO_ROOT / "models" / "glm5-demo"
QWEN_DEMO = REPO_ROOT / "models" / "qwen35-demo"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

N_LAYERS = 4
INDEX_TOPK = 128
# The export stays small: the repository travels whole to the GPU machine (64 MiB with the
# binaries carried there), and it already holds the Qwen demo (31 MB).
MAX_BF16_BYTES = 8_500_000


def glm_config(vocab_size: int, eos_id: int, interleave: bool) -> dict:
    """config.json of the demo (GlmMoeDsaConfig arguments + the CONFIG_ONLY_KEYS added at export)."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": vocab_size, "hidden_size": 192, "intermediate_size": 384, "moe_intermediate_size": 64,
        "num_hidden_layers": N_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "mlp_layer_types": ["dense"] + ["sparse"] * (N_LAYERS - 1), "indexer_types": ["full"] * N_LAYERS,
        "index_topk": INDEX_TOPK, "index_head_dim": 32, "index_n_heads": 4,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "initializer_range": 0.02,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": interleave, "indexer_rope_interleave": interleave,
        "tie_word_embeddings": False, "use_cache": True,
        # pad_token_id must stay None: it would become nn.Embedding's padding_idx (a frozen zero row).
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": eos_id,
    }


def export_config(cfg: dict) -> dict:
    out = dict(cfg)
    out.update(num_nextn_predict_layers=1, dtype="bfloat16", torch_dtype="bfloat16",
               transformers_version=transformers.__version__)
    return out


# --------------------------------------------------------------------------------------------------
# 1-2. Corpus (the Qwen demo's) and tokenizer (the Qwen demo's file)
# --------------------------------------------------------------------------------------------------

def load_tokenizer(vocab_size: int, held_texts: list[str]):
    path = QWEN_DEMO / "tokenizer.json"
    for name in TOKENIZER_FILES:
        check((QWEN_DEMO / name).is_file(), f"{QWEN_DEMO / name} is missing: train the Qwen demo first "
              "(tools/train_demo_model.py), whose tokenizer this model shares")
    tok = tokenizers.Tokenizer.from_file(str(path))
    info = tdm.check_tokenizer(tok, vocab_size, held_texts)
    check(tok.get_vocab_size(with_added_tokens=True) == vocab_size,
          f"{path} has {tok.get_vocab_size(with_added_tokens=True)} tokens, expected {vocab_size}")
    info["source"] = str(path.relative_to(REPO_ROOT))
    info["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return tok, info


def compare_split(held_files, val_files, held_tokens: int, val_tokens: int, allow: bool) -> dict:
    """The split must be the Qwen demo's (same files, same token counts with the same tokenizer)."""
    p = QWEN_DEMO / "training.json"
    if not p.is_file():
        print(f"  WARNING: {p} not found; cannot compare the split with the Qwen demo's")
        return {"compared": False}
    q = json.loads(p.read_text(encoding="utf-8"))["data"]
    mine = {"heldout": [f["rel"] for f in held_files], "validation": [f["rel"] for f in val_files]}
    res = {"compared": True}
    for name, tokens in (("heldout", held_tokens), ("validation", val_tokens)):
        same_files = mine[name] == q[name]["file_list"]
        same_tokens = tokens == q[name]["tokens"]
        res[name] = {"same_files": same_files, "same_tokens": same_tokens, "tokens": tokens,
                     "qwen_tokens": q[name]["tokens"]}
        print(f"  {name}: same files as the Qwen demo {same_files}, tokens {tokens:,} vs {q[name]['tokens']:,}")
        if not (same_files and same_tokens):
            extra = sorted(set(mine[name]) - set(q[name]["file_list"]))[:8]
            gone = sorted(set(q[name]["file_list"]) - set(mine[name]))[:8]
            msg = (f"the {name} split differs from models/qwen35-demo/training.json (extra {extra}, missing "
                   f"{gone}): run with the Qwen demo's --site-packages (its training.json 'command'), or pass "
                   "--allow-split-mismatch")
            if not allow:
                fail(msg)
            print(f"  WARNING: {msg}")
    return res


# --------------------------------------------------------------------------------------------------
# 3. Model, joint forward, DSA helpers
# --------------------------------------------------------------------------------------------------

def indexers(model) -> list:
    out = []
    for li, layer in enumerate(model.model.layers):
        ix = getattr(layer.self_attn, "indexer", None)
        if ix is not None:
            out.append((li, layer.self_attn, ix))
    return out


def moe_modules(model, nextn) -> list:
    mods = [(f"layer{li}", layer.mlp) for li, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    mods.append(("nextn", nextn.layer.mlp))
    return mods


def build_models(cfg: dict, attn: str, device):
    _, ForCausalLM, _, _ = gn.glm_modules()
    hf_cfg = gn.make_config(cfg, attn)
    try:
        model = ForCausalLM._from_config(hf_cfg, attn_implementation=attn)
    except (TypeError, ValueError) as exc:
        print(f"  note: _from_config({attn!r}) failed ({exc!r}); constructing directly")
        model = ForCausalLM(hf_cfg)
    model = model.float()
    check(model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr(),
          "lm_head is tied to embed_tokens although tie_word_embeddings is false")
    check(model.model.embed_tokens.padding_idx is None, "embed_tokens has a padding_idx (pad_token_id set?)")
    check(len(model.model.layers) == cfg["num_hidden_layers"], f"{len(model.model.layers)} layers built")
    kinds = ["sparse" if hasattr(layer.mlp, "experts") else "dense" for layer in model.model.layers]
    check(kinds == cfg["mlp_layer_types"], f"layer MLP kinds {kinds} != mlp_layer_types {cfg['mlp_layer_types']}")
    check(len(indexers(model)) == cfg["num_hidden_layers"], "not every layer has a DSA indexer")
    nextn = gn.GlmNextN(cfg, model.config._attn_implementation)
    nextn.reset_parameters(cfg["initializer_range"])
    nextn.float()
    for name, p in model.named_parameters():
        if name.endswith(gn.FP32_SUFFIXES):
            p.requires_grad_(False)
    print(f"  attn_implementation: trunk {model.config._attn_implementation!r}, NextN "
          f"{nextn.layer.self_attn.config._attn_implementation!r}; rope {model.config.rope_parameters}, "
          f"rope_interleave {getattr(model.config, 'rope_interleave', None)}, indexer_rope_interleave "
          f"{getattr(model.config, 'indexer_rope_interleave', None)}")
    check(model.config._attn_implementation == attn, f"transformers chose attention {model.config._attn_implementation!r}")
    check(nextn.layer.self_attn.config._attn_implementation == attn, "the NextN layer's attention differs")
    # The names and shapes tandem binds, checked now rather than after training.
    try:
        gn.check_layout(model.state_dict(), gn.target_shapes(cfg), "target")
        gn.check_layout(gn.nextn_tensors(nextn, cfg["num_hidden_layers"]), gn.nextn_shapes(cfg), "NextN layer")
    except ValueError as exc:
        fail(str(exc))
    n_target = gn.count(gn.target_shapes(cfg))
    n_nextn = gn.count(gn.nextn_shapes(cfg))
    n_index = sum(p.numel() for _, _, ix in indexers(model) for p in ix.parameters())
    total = n_target + n_nextn
    print(f"  parameters (exported): target {n_target:,} (indexers {n_index:,}), NextN {n_nextn:,}, total "
          f"{total:,}; bf16 ~{total * 2 / 1e6:.1f} MB")
    check(total * 2 < MAX_BF16_BYTES, f"{total:,} parameters are {total * 2:,} bytes in bf16 (> {MAX_BF16_BYTES:,})")
    model.to(device)
    nextn.to(device)
    return model, nextn, {"target": n_target, "target_indexers": n_index, "nextn": n_nextn, "total": total}


def glm_joint_forward(model, nextn, window: torch.Tensor):
    """window [B, L+1]. Returns (target logits [B, L, V], NextN logits [B, L-1, V]); NextN row p
    predicts window[:, p+2]."""
    x = window[:, :-1]
    b, n = x.shape
    out = model.model(input_ids=x, attention_mask=gn.causal_mask(n, x.device, b), use_cache=False)
    h = out.last_hidden_state
    return model.lm_head(h), model.lm_head(gn.nextn_rows(model, nextn, x, h))


def set_index_topk(model, k: int) -> None:
    """Every target layer keeps k positions (k >= seq: dense attention)."""
    try:
        model.config.index_topk = k
    except Exception as exc:  # noqa: BLE001
        print(f"  note: config.index_topk not settable ({exc!r})")
    for _, attn, ix in indexers(model):
        for m in (ix, attn):
            if hasattr(m, "index_topk"):
                m.index_topk = k


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(x, cos, sin, variant: str):
    """x [..., d] with cos / sin broadcastable. half: rotate halves (NeoX); interleave: adjacent pairs,
    de-interleaved first (transformers' DeepSeek form, cos = cat(freqs, freqs)); pairs: adjacent pairs
    in place (cos repeated per pair)."""
    if variant == "interleave":
        *lead, d = x.shape
        x = x.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)
        return x * cos + rotate_half(x) * sin
    if variant == "half":
        return x * cos + rotate_half(x) * sin
    pair = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).reshape(x.shape)
    return x * cos + pair * sin


ROPE_VARIANTS = ("interleave", "half", "pairs")


def index_scores(cfg: dict, attn, ix, hs, cos, sin, variant: str):
    """The DSA index scores [B, S, T] of hs [B, S, H] (the attention's normed input), differentiable in
    the indexer's weights: sum_h w_h * relu(q_h . k * Di^-0.5), w = weights_proj(hs) * n_heads^-0.5."""
    b, s, _ = hs.shape
    nh, dh, dr = cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    with torch.no_grad():
        qa = attn.q_a_layernorm(attn.q_a_proj(hs))
    cos, sin = cos.float(), sin.float()
    q = ix.wq_b(qa).float().view(b, s, nh, dh)
    q = torch.cat([rope(q[..., :dr], cos[:, :, None], sin[:, :, None], variant), q[..., dr:]], dim=-1)
    k = ix.k_norm(ix.wk(hs)).float()
    k = torch.cat([rope(k[..., :dr], cos, sin, variant), k[..., dr:]], dim=-1)
    w = ix.weights_proj(hs).float() * nh ** -0.5
    sc = torch.einsum("bshd,btd->bsht", q, k) * dh ** -0.5
    return torch.einsum("bsht,bsh->bst", F.relu(sc), w)


class IndexerTaps:
    """Forward hooks on every indexer layer's attention: its input, rotary, mask and probabilities
    (records only while .active), and optionally the indexer's own choice (for the self-test)."""

    def __init__(self, model, cfg: dict):
        self.cfg = cfg
        self.active = False
        self.want_choice = False
        self.records, self.choices = {}, {}
        self.handles = []
        for li, attn, ix in indexers(model):
            self.handles.append(attn.register_forward_hook(self._attn_hook(li), with_kwargs=True))
            self.handles.append(ix.register_forward_hook(self._ix_hook(li)))
        self.layers = {li: (attn, ix) for li, attn, ix in indexers(model)}

    def _attn_hook(self, li):
        def hook(module, args, kwargs, output):
            if not self.active:
                return
            hs = kwargs.get("hidden_states", args[0] if args else None)
            pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
            probs = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
            self.records[li] = (hs, pe, mask, probs)
        return hook

    def _ix_hook(self, li):
        def hook(module, args, output):
            if self.want_choice:
                t = output if torch.is_tensor(output) else next(
                    (o for o in output if torch.is_tensor(o) and not o.is_floating_point()), None)
                self.choices[li] = t
        return hook

    def clear(self):
        self.records, self.choices = {}, {}

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def scores(self, li, variant: str, rows: int | None = None, detach_probs: bool = True):
        """(scores [b, S, T] with gradient, allowed mask [b, S, T], probs [b, S, T] or None)."""
        hs, pe, mask, probs = self.records[li]
        attn, ix = self.layers[li]
        rows = hs.shape[0] if rows is None else min(rows, hs.shape[0])
        hs = hs[:rows].detach()
        cos, sin = pe[0][:rows].detach(), pe[1][:rows].detach()
        sc = index_scores(self.cfg, attn, ix, hs, cos, sin, variant)
        check(mask is not None and mask.dim() == 4, "the attention got no 4D mask (the forward must pass one)")
        allowed = mask[:rows, 0, :, : sc.shape[-1]] == 0
        p = None
        if probs is not None:
            p = probs[:rows].detach().float().sum(1)
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
        return sc, allowed, p

    def kl(self, variant: str, rows: int) -> torch.Tensor:
        """mean over layers and query rows of KL(p || softmax(index scores)) over allowed keys."""
        total, n = None, 0
        for li in sorted(self.records):
            sc, allowed, p = self.scores(li, variant, rows)
            check(p is not None, "the attention returned no probabilities (eager attention needed)")
            logq = torch.log_softmax(sc.masked_fill(~allowed, -1e9), dim=-1)
            kl = (p * (torch.log(p.clamp_min(1e-20)) - logq)).sum(-1).mean()
            total = kl if total is None else total + kl
            n += 1
        check(n > 0, "no indexer layer recorded anything")
        return total / n


def selection_matches(sc, allowed, sel) -> tuple[bool, float]:
    """Whether `sel` [B, S, k] keeps the k best of sc [B, S, T] among allowed keys (ties and
    near-ties swapped are fine: compares the kept scores, not the indices)."""
    s = sc.detach().masked_fill(~allowed, float("-inf"))
    k = sel.shape[-1]
    top = s.topk(k, dim=-1).values.nan_to_num(neginf=-1e30)
    got = s.gather(-1, sel.long()).sort(dim=-1, descending=True).values.nan_to_num(neginf=-1e30)
    scale = s[torch.isfinite(s)].abs().max().item() if torch.isfinite(s).any() else 1.0
    d = (top - got).abs().max().item()
    return d <= 1e-4 * scale + 1e-6, d / max(scale, 1e-12)


class ExpertLoad:
    """Counts the experts chosen per mixture (a forward pre-hook on mlp.experts finds the integer
    top-k index argument) and applies DeepSeek-V3's auxiliary-loss-free bias update from each step's
    counts; `window` accumulates the counts between logs."""

    def __init__(self, mods: list, n_experts: int, top_k: int, device):
        self.mods, self.E, self.k = mods, n_experts, top_k
        self.counts = torch.zeros(len(mods), n_experts, device=device)
        self.window = torch.zeros(len(mods), n_experts, device=device)
        self.active = False
        self.calls = 0
        self.handles = [m.experts.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                        for i, (_, m) in enumerate(mods)]

    def _hook(self, i):
        def hook(module, args, kwargs):
            if not self.active:
                return
            for a in list(args) + list(kwargs.values()):
                if torch.is_tensor(a) and not a.is_floating_point() and a.dim() >= 1 and a.shape[-1] == self.k:
                    self.counts[i] += torch.bincount(a.reshape(-1).long(), minlength=self.E)[: self.E].float()
                    self.calls += 1
                    return
        return hook

    def biases(self):
        return [m.gate.e_score_correction_bias for _, m in self.mods]

    @torch.no_grad()
    def update(self, rate: float) -> None:
        """bias += rate * sign(mean load - load) per mixture, from this step's counts."""
        if rate > 0:
            mean = self.counts.mean(-1, keepdim=True)
            step = rate * torch.sign(mean - self.counts)
            for i, b in enumerate(self.biases()):
                b.add_(step[i].to(b.dtype))
        self.window += self.counts
        self.counts.zero_()

    def imbalance(self) -> float:
        """Since the last call: max over mixtures of (most-used expert's load / mean load)."""
        c = self.window
        v = float((c.max(-1).values / c.mean(-1).clamp_min(1e-9)).max())
        self.window.zero_()
        return v

    def reset(self):
        self.counts.zero_()
        self.window.zero_()
        self.calls = 0


# --------------------------------------------------------------------------------------------------
# Self-tests
# --------------------------------------------------------------------------------------------------

def self_test(model, nextn, cfg: dict, device, use_autocast: bool) -> None:
    """Shapes; last_hidden_state is model.norm's output; ForCausalLM (transformers' own mask) equals
    lm_head(h) with our 4D mask; causality of the target and of the NextN rows with DSA active (T >
    index_topk); the NextN layer keeps every position."""
    model.eval()
    nextn.eval()
    V, T, c = cfg["vocab_size"], 2 * INDEX_TOPK, INDEX_TOPK + 72
    g = torch.Generator().manual_seed(123)
    win = torch.randint(3, V, (2, T + 1), generator=g).to(device)
    win2 = win.clone()
    win2[:, c:] = torch.randint(3, V, (2, T + 1 - c), generator=g).to(device)
    captured, widths = [], []
    h1 = model.model.norm.register_forward_hook(lambda m, i, o: captured.append(o))
    nix = getattr(nextn.layer.self_attn, "indexer", None)
    h2 = nix.register_forward_hook(lambda m, a, o: widths.append(int(o.shape[-1])) if torch.is_tensor(o)
                                   and not o.is_floating_point() else None) if nix is not None else None
    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if use_autocast else _nullctx()
    with torch.no_grad(), ctx:
        x = win[:, :-1]
        out = model.model(input_ids=x, attention_mask=gn.causal_mask(T, device, 2), use_cache=False)
        full = model(input_ids=x, use_cache=False).logits
        logits, mtp_logits = glm_joint_forward(model, nextn, win)
        logits2, mtp_logits2 = glm_joint_forward(model, nextn, win2)
    h1.remove()
    if h2 is not None:
        h2.remove()
    tag = "bf16 autocast" if use_autocast else "fp32"
    print(f"  [{tag}] logits {tuple(logits.shape)}, NextN logits {tuple(mtp_logits.shape)}, "
          f"last_hidden_state {tuple(out.last_hidden_state.shape)} {out.last_hidden_state.dtype}")
    check(tuple(logits.shape) == (2, T, V) and tuple(mtp_logits.shape) == (2, T - 1, V), "unexpected logits shapes")
    check(len(captured) >= 1 and torch.equal(captured[0], out.last_hidden_state),
          "last_hidden_state is not the output of model.model.norm (final norm)")
    tol = 2e-2 if use_autocast else 1e-4
    d = (full.float() - logits.float()).abs().max().item()
    print(f"  [{tag}] transformers' own mask vs our 4D mask: max |dlogit| {d:.2e}")
    check(d <= tol, f"GlmMoeDsaForCausalLM with its own mask differs from our 4D-mask forward by {d}")
    d_t = (logits[:, :c] - logits2[:, :c]).abs().max().item()
    d_m = (mtp_logits[:, :c - 1] - mtp_logits2[:, :c - 1]).abs().max().item()
    d_after = (mtp_logits[:, c:] - mtp_logits2[:, c:]).abs().max().item()
    print(f"  [{tag}] causality: target prefix diff {d_t:.2e}, NextN prefix diff {d_m:.2e} (changed suffix "
          f"{d_after:.2e}); NextN indexer widths {sorted(set(widths))} for {T - 1} rows")
    check(d_t <= tol, f"the target is not causal: logits before {c} changed by {d_t}")
    check(d_m <= tol, f"the NextN rows are not causal: rows before {c - 1} changed by {d_m}")
    check(d_after > 0, "NextN output did not react to changed inputs")
    check(all(w == T - 1 for w in widths), f"the NextN layer's indexer kept {sorted(set(widths))} of {T - 1} "
          "positions: it must attend to every earlier row")


def probe_indexer(model, nextn, cfg: dict, device, taps: IndexerTaps, seq: int) -> dict:
    """fp32: which rotary variant reproduces the indexer's choice; whether index_topk can be switched
    (dense warm-up); whether the attention returns probabilities; KL gradients reach only the indexer.
    Any surprise here turns the indexer loss off (res["reason"] says why) rather than stopping the run."""
    res = {"variant": None, "toggle": False, "probs": False}
    try:
        return _probe_indexer(model, nextn, cfg, device, taps, seq, res)
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        print(f"  WARNING: the indexer probe failed: {exc!r}")
        res.update(variant=None, reason=f"the indexer probe failed: {exc!r}")
        return res
    finally:
        taps.active = taps.want_choice = False
        taps.clear()
        set_index_topk(model, INDEX_TOPK)
        model.zero_grad(set_to_none=True)


def _probe_indexer(model, nextn, cfg, device, taps, seq, res) -> dict:
    model.eval()
    V, T = cfg["vocab_size"], 2 * INDEX_TOPK
    win = torch.randint(3, V, (2, T + 1), generator=torch.Generator().manual_seed(7)).to(device)
    taps.active, taps.want_choice = True, True
    taps.clear()
    with torch.no_grad():
        glm_joint_forward(model, nextn, win)
    recs, choices = dict(taps.records), dict(taps.choices)
    check(sorted(recs) == sorted(taps.layers), f"attention hooks recorded layers {sorted(recs)}")
    res["probs"] = all(r[3] is not None and r[3].dim() == 4 for r in recs.values())
    widths = sorted({int(t.shape[-1]) for t in choices.values() if t is not None})
    print(f"  indexer choices seen for layers {sorted(k for k, v in choices.items() if v is not None)}, "
          f"widths {widths}; attention probabilities {'returned' if res['probs'] else 'NOT returned'}")
    if len(choices) != len(taps.layers) or any(t is None for t in choices.values()) or widths != [INDEX_TOPK]:
        res["reason"] = f"could not observe the indexer's choice (widths {widths})"
        return res
    with torch.no_grad():
        for variant in ROPE_VARIANTS:
            worst, ok = 0.0, True
            for li in sorted(recs):
                sc, allowed, _ = taps.scores(li, variant)
                good, rel = selection_matches(sc, allowed, choices[li])
                ok, worst = ok and good, max(worst, rel)
            print(f"  index-score re-implementation, rotary '{variant}': "
                  f"{'matches' if ok else 'differs'} (worst relative gap {worst:.2e})")
            if ok:
                res["variant"] = variant
                break
    if res["variant"] is None:
        res["reason"] = "no rotary variant of the re-implemented index scores reproduces the indexer's choice"
        return res
    # Dense warm-up needs index_topk to be switchable at run time.
    set_index_topk(model, seq)
    taps.clear()
    with torch.no_grad():
        glm_joint_forward(model, nextn, win)
    dense_w = sorted({int(t.shape[-1]) for t in taps.choices.values() if t is not None})
    set_index_topk(model, INDEX_TOPK)
    taps.clear()
    with torch.no_grad():
        glm_joint_forward(model, nextn, win)
    sparse_w = sorted({int(t.shape[-1]) for t in taps.choices.values() if t is not None})
    res["toggle"] = dense_w == [T] and sparse_w == [INDEX_TOPK]
    print(f"  index_topk switch: dense widths {dense_w}, back to sparse {sparse_w} -> "
          f"{'works' if res['toggle'] else 'does NOT work (no dense warm-up)'}")
    if not res["probs"]:
        res["reason"] = "the attention returns no probabilities (use --attn eager)"
        return res
    # The KL loss trains only the indexer.
    model.zero_grad(set_to_none=True)
    taps.clear()
    glm_joint_forward(model, nextn, win)
    kl = taps.kl(res["variant"], 2)
    kl.backward()
    ix_names = [n for n, p in model.named_parameters() if ".indexer." in n and p.grad is not None
                and p.grad.abs().sum() > 0]
    other = [n for n, p in model.named_parameters() if ".indexer." not in n and p.grad is not None]
    model.zero_grad(set_to_none=True)
    print(f"  KL {kl.item():.4f}: gradients reach {len(ix_names)} indexer tensors and {len(other)} others")
    check(math.isfinite(kl.item()), f"indexer KL is not finite ({kl.item()})")
    check(not other, f"the indexer KL leaks gradients into {other[:5]}")
    check(len(ix_names) >= 3 * len(taps.layers), f"indexer KL gradients reach only {ix_names}")
    return res


def experts_impl(model, nextn, want: str, device, cfg: dict) -> str:
    """Chooses the experts backend: `want` if it gives the eager backend's logits and gradients (fp32)
    and runs under bf16 autocast, else eager."""
    def set_impl(name):
        model.set_experts_implementation(name)
        try:
            nextn.config._experts_implementation = name
        except Exception as exc:  # noqa: BLE001
            print(f"  note: the NextN layer keeps its experts backend ({exc!r})")

    if not hasattr(model, "set_experts_implementation"):
        print("  experts backend: transformers has no set_experts_implementation; using its default")
        return "default"
    try:
        set_impl("eager")
    except Exception as exc:  # noqa: BLE001
        print(f"  experts backend: cannot select 'eager' ({exc!r}); using transformers' default")
        return "default"
    if want == "eager":
        return "eager"
    win = torch.randint(3, cfg["vocab_size"], (2, 97), generator=torch.Generator().manual_seed(5)).to(device)
    expert_params = [p for n, p in list(model.named_parameters()) + list(nextn.named_parameters())
                     if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]

    def run(autocast: bool):
        model.zero_grad(set_to_none=True)
        nextn.zero_grad(set_to_none=True)
        ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if autocast else _nullctx()
        with ctx:
            lg, mlg = glm_joint_forward(model, nextn, win)
            loss = lg.float().logsumexp(-1).mean() + mlg.float().logsumexp(-1).mean()
        loss.backward()
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in expert_params]
        return lg.detach().float(), mlg.detach().float(), grads

    try:
        ref = run(False)
        set_impl(want)
        got = run(False)
        d = max((ref[0] - got[0]).abs().max().item(), (ref[1] - got[1]).abs().max().item())
        dg = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item() for a, b in zip(ref[2], got[2]))
        bf = run(True)
        finite = all(torch.isfinite(t).all().item() for t in (bf[0], bf[1], *bf[2]))
        print(f"  experts backend {want!r} vs eager (fp32): max |dlogit| {d:.2e}, max relative grad diff "
              f"{dg:.2e}; bf16 autocast finite {finite}")
        if d > 1e-3 or dg > 1e-2 or not finite:
            raise RuntimeError("results differ from the eager backend")
        return want
    except Exception as exc:  # noqa: BLE001
        print(f"  experts backend {want!r} not used ({exc!r}); using eager")
        try:
            set_impl("eager")
        except Exception as exc2:  # noqa: BLE001
            fail(f"cannot switch the experts backend back to eager: {exc2!r}")
        return "eager"
    finally:
        model.zero_grad(set_to_none=True)
        nextn.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------------
# 4. Training
# --------------------------------------------------------------------------------------------------

def train(model, nextn, cfg, train_ids, val_windows, args, device, taps, variant, toggle, load) -> dict:
    seq, batch, n = args.seq, args.batch, train_ids.numel()
    check(n > seq + 2, f"training stream too short ({n} tokens) for seq {seq}")
    groups = tdm.param_groups(model, nextn, args.weight_decay)
    params = [p for g in groups for p in g["params"]]
    ix_ids = {id(p) for _, _, ix in indexers(model) for p in ix.parameters()}
    main_params = [p for p in params if id(p) not in ix_ids]
    ix_params = [p for p in params if id(p) in ix_ids]
    opt, opt_kind = tdm.make_optimizer(groups, args.lr, device)
    use_autocast = device.type == "cuda"
    use_kl = variant is not None and args.index_kl_weight > 0
    dense_until = args.dense_warmup if (use_kl and toggle) else 0.0
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(seq + 1, device=device)
    budget = args.minutes * 60.0
    max_tokens = int(args.epochs * n) if args.epochs else 0
    history, val_history = [], []
    step, tokens_seen, oom_events, dense_steps = 0, 0, 0, 0
    run = {"main": None, "mtp": None, "kl": None}
    run_count = 0
    last = {"main": float("nan"), "mtp": float("nan"), "kl": float("nan")}
    best = None
    diverged = None
    dense_now = False
    fwd = glm_joint_forward

    def val(step_, tokens_):
        nonlocal best
        if dense_now:
            set_index_topk(model, INDEX_TOPK)
        best = tdm.validate(model, nextn, val_windows, use_autocast, args, step_, tokens_ / n, t0, val_history,
                            best, forward=fwd)
        if dense_now:
            set_index_topk(model, seq)
        model.train()
        nextn.train()

    model.train()
    nextn.train()
    print(f"  optimizer AdamW ({opt_kind}) lr {args.lr} betas (0.9, 0.95) wd {args.weight_decay}; warmup "
          f"{args.warmup} steps then cosine to {args.min_lr_ratio} x peak over the time budget ({args.minutes} min)"
          f"{f' / {args.steps_max} steps' if args.steps_max else ''}{f' / {args.epochs} epochs' if args.epochs else ''}")
    print(f"  batch {batch} x seq {seq}; train stream {n:,} tokens; autocast {'bf16' if use_autocast else 'off'}; "
          f"grad clip {args.clip} (indexers clipped apart); NextN weight {args.mtp_weight}; indexer KL "
          f"{f'weight {args.index_kl_weight} on {args.index_kl_batch} sequences, rotary {variant!r}' if use_kl else 'off'}"
          f"; dense warm-up {dense_until:.0%} of the budget; router bias update {args.bias_update}/step")
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.time()
    t_log, tok_log = t0, 0
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (args.steps_max and step >= args.steps_max) or (max_tokens and tokens_seen >= max_tokens):
            break
        progress = elapsed / budget
        if args.steps_max:
            progress = max(progress, step / args.steps_max)
        if max_tokens:
            progress = max(progress, tokens_seen / max_tokens)
        want_dense = progress < dense_until
        if want_dense != dense_now:
            set_index_topk(model, seq if want_dense else INDEX_TOPK)
            dense_now = want_dense
            print(f"  step {step}: DSA {'off (dense warm-up)' if dense_now else f'on (index_topk {INDEX_TOPK})'}")
        lr = tdm.lr_at(step, progress, args.lr, args.warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n - (seq + 1), (batch,), generator=gen).to(device)
        window = train_ids[starts[:, None] + offsets[None, :]]
        try:
            ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if use_autocast else _nullctx()
            taps.active = use_kl
            load.active = True
            with ctx:
                logits, mtp_logits = fwd(model, nextn, window)
                v = logits.shape[-1]
                loss_main = F.cross_entropy(logits.float().reshape(-1, v), window[:, 1:].reshape(-1))
                loss_mtp = F.cross_entropy(mtp_logits.float().reshape(-1, v), window[:, 2:].reshape(-1))
                loss_kl = taps.kl(variant, args.index_kl_batch) if use_kl else torch.zeros((), device=device)
            taps.active = load.active = False
            taps.clear()
            loss = loss_main + args.mtp_weight * loss_mtp + args.index_kl_weight * loss_kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(main_params, args.clip)
            if ix_params:
                torch.nn.utils.clip_grad_norm_(ix_params, args.clip)
            opt.step()
            load.update(args.bias_update)
        except torch.cuda.OutOfMemoryError:
            taps.active = load.active = False
            taps.clear()
            load.counts.zero_()
            oom_events += 1
            opt.zero_grad(set_to_none=True)
            logits = mtp_logits = loss = loss_main = loss_mtp = loss_kl = None
            torch.cuda.empty_cache()
            check(batch > 4, "out of GPU memory even at batch 4")
            batch //= 2
            print(f"  OOM at step {step}: halving the batch to {batch}")
            continue
        step += 1
        dense_steps += int(dense_now)
        tokens_seen += batch * seq
        tok_log += batch * seq
        for key, t in (("main", loss_main), ("mtp", loss_mtp), ("kl", loss_kl)):
            t = t.detach().float()
            run[key] = t if run[key] is None else run[key] + t
        run_count += 1
        if step % args.log_every == 0 or step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.time()
            last = {k: (v / run_count).item() for k, v in run.items()}
            imb = load.imbalance() if load.calls else float("nan")
            bias_abs = max(float(b.abs().max()) for b in load.biases())
            if not (math.isfinite(last["main"]) and math.isfinite(last["mtp"]) and math.isfinite(last["kl"])):
                diverged = {"step": step, "losses": last}
                print(f"  NON-FINITE loss at step {step}: {last}")
                break
            tps = tok_log / max(now - t_log, 1e-9)
            rec = dict(step=step, elapsed_s=round(now - t0, 1), lr=lr, loss=round(last["main"], 4),
                       mtp_loss=round(last["mtp"], 4), index_kl=round(last["kl"], 4), grad_norm=round(float(gnorm), 3),
                       tokens_per_s=round(tps), epochs=round(tokens_seen / n, 3), batch=batch, dense=dense_now,
                       expert_imbalance=round(imb, 3), max_abs_router_bias=round(bias_abs, 4))
            history.append(rec)
            print(f"  step {step:5d}  loss {last['main']:.4f}  nextn {last['mtp']:.4f}  kl {last['kl']:.4f}  "
                  f"lr {lr:.2e}  gnorm {float(gnorm):.2f}  load max/mean {imb:.2f}  |bias| {bias_abs:.3f}  "
                  f"{tps:,.0f} tok/s  {now - t0:6.1f}s  epoch {tokens_seen / n:.2f}{'  dense' if dense_now else ''}")
            run = {"main": None, "mtp": None, "kl": None}
            run_count = 0
            t_log, tok_log = now, 0
        if args.val_every and step % args.val_every == 0:
            val(step, tokens_seen)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - t0
    taps.active = load.active = False
    if dense_now:
        set_index_topk(model, INDEX_TOPK)
        dense_now = False
    if diverged is not None:
        check(best is not None and best[3] is not None,
              f"loss became non-finite at step {diverged['step']} before any validation checkpoint")
        print(f"  training stopped at step {step} (non-finite loss); shipping the best validation checkpoint")
    elif run_count:
        last = {k: (v / run_count).item() for k, v in run.items()}
    check(step > 0, "no training step completed")
    if diverged is None and (not val_history or val_history[-1]["step"] != step):
        val(step, tokens_seen)
    final_val = val_history[-1]
    restored = None
    if (args.keep_best or diverged is not None) and best is not None and best[3] is not None and best[1] != step:
        model.load_state_dict(best[3]["model"])
        nextn.load_state_dict(best[3]["mtp"])
        restored = dict(step=best[1], epoch=best[2], objective=best[0])
        print(f"  restored the best validation checkpoint: step {best[1]} (epoch {best[2]:.2f}), objective "
              f"{best[0]:.4f} vs final {final_val['objective']:.4f}")
    else:
        print(f"  keeping the final weights (validation objective {final_val['objective']:.4f})")
    set_index_topk(model, INDEX_TOPK)
    print(f"  done: {step} steps ({dense_steps} dense), {tokens_seen:,} tokens ({tokens_seen / n:.2f} epochs) in "
          f"{wall:.1f}s ({tokens_seen / max(wall, 1e-9):,.0f} tok/s)")
    return dict(steps=step, dense_steps=dense_steps, tokens_seen=tokens_seen, epochs=tokens_seen / n, wall_time_s=wall,
                final_train_loss=last["main"], final_train_mtp_loss=last["mtp"], final_train_index_kl=last["kl"],
                final_batch=batch, oom_events=oom_events, optimizer=f"AdamW ({opt_kind})", history=history,
                validation_history=val_history, final_validation=final_val, restored_best=restored,
                diverged=diverged, shipped_step=restored["step"] if restored else step,
                shipped_epoch=restored["epoch"] if restored else tokens_seen / n)


# --------------------------------------------------------------------------------------------------
# 5-7. Evaluation, export, reload
# --------------------------------------------------------------------------------------------------

def evaluate(model, nextn, windows, use_autocast=False):
    return tdm.evaluate(model, nextn, windows, use_autocast=use_autocast, forward=glm_joint_forward)


def evaluate_dense(model, nextn, windows, seq: int):
    set_index_topk(model, seq)
    try:
        return evaluate(model, nextn, windows)
    finally:
        set_index_topk(model, INDEX_TOPK)


def export_tensors(model, nextn, cfg: dict) -> dict:
    target = gn.to_checkpoint(model.state_dict())
    layer = gn.to_checkpoint(gn.nextn_tensors(nextn, cfg["num_hidden_layers"]))
    try:
        gn.check_layout(target, gn.target_shapes(cfg), "target")
        gn.check_layout(layer, gn.nextn_shapes(cfg), "NextN layer")
    except ValueError as exc:
        fail(str(exc))
    return {**target, **layer}


@torch.no_grad()
def rounded_copy(module):
    """A copy whose checkpoint tensors (its state dict: parameters and persistent buffers, not e.g. the
    rotary inv_freq) hold the values the checkpoint stores."""
    m = copy.deepcopy(module)
    for name, t in m.state_dict().items():
        if t.is_floating_point() and not name.endswith(gn.FP32_SUFFIXES):
            t.copy_(t.to(torch.bfloat16).float())
    return m


def reload_checks(path: Path, out: Path, cfg: dict, attn: str, device, model, nextn, window, problems: list):
    """Fresh model + NextN from the file; every tensor equals the trained one rounded; the outputs equal
    the rounded trained model's; transformers' from_pretrained gives the same logits."""
    N = cfg["num_hidden_layers"]
    disk = load_file(str(path))
    for k, v in disk.items():
        check(v.dtype == gn.checkpoint_dtype(k), f"{k} is {v.dtype} on disk, expected {gn.checkpoint_dtype(k)}")
    model2, nextn2, _ = build_models(cfg, attn, device)
    target = {k: v for k, v in disk.items() if not k.startswith(f"model.layers.{N}.")}
    res = model2.load_state_dict({k: v.float() for k, v in target.items()}, strict=False)
    check(not res.missing_keys and not res.unexpected_keys,
          f"reload: missing {res.missing_keys}, unexpected {res.unexpected_keys}")
    try:
        gn.load_nextn(nextn2, disk, N)
    except ValueError as exc:
        fail(str(exc))
    trained = {**gn.to_checkpoint(model.state_dict()), **gn.to_checkpoint(gn.nextn_tensors(nextn, N))}
    reloaded = {**gn.to_checkpoint(model2.state_dict()), **gn.to_checkpoint(gn.nextn_tensors(nextn2, N))}
    check(set(trained) == set(reloaded) == set(disk), "name sets of trained / reloaded / disk differ")
    for k in disk:
        check(torch.equal(reloaded[k], trained[k]) and torch.equal(disk[k], trained[k]),
              f"reloaded {k} differs from the trained weights")
    print(f"  reload: {len(disk)} tensors ({len(disk) - len(target)} NextN); all equal the trained weights "
          "rounded to their stored dtype")
    # Outputs: the reloaded pair vs the trained pair rounded to the stored values.
    model_r, nextn_r = rounded_copy(model), rounded_copy(nextn)
    for m in (model2, nextn2, model_r, nextn_r):
        m.eval()
    with torch.no_grad():
        a = glm_joint_forward(model2, nextn2, window)
        b = glm_joint_forward(model_r, nextn_r, window)
    d_t = (a[0] - b[0]).abs().max().item()
    d_n = (a[1] - b[1]).abs().max().item()
    print(f"  reloaded vs trained-rounded on a held-out window of {window.shape[1] - 1} tokens: max |dlogit| "
          f"target {d_t:.2e}, NextN {d_n:.2e}")
    if d_t > 1e-4 or d_n > 1e-4:
        problems.append(f"reloaded model's logits differ from the trained (rounded) model's: {d_t}, {d_n}")
    del model_r, nextn_r
    checks = {"reload_equal_to_trained_rounded": True, "reload_vs_trained_rounded_max_abs_logit_diff":
              {"target": d_t, "nextn": d_n}}
    # transformers' own loader over the exported directory (the engine's oracle).
    try:
        _, ForCausalLM, _, _ = gn.glm_modules()
        hf, info = ForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager",
                                               output_loading_info=True)
        missing = list(info.get("missing_keys", []))
        unexpected = list(info.get("unexpected_keys", []))
        foreign = [k for k in unexpected if not k.startswith(f"model.layers.{N}.")]
        print(f"  from_pretrained: {type(hf.config).__name__} num_nextn_predict_layers "
              f"{getattr(hf.config, 'num_nextn_predict_layers', None)}; missing {missing[:8]}; unexpected "
              f"{len(unexpected)} (all NextN: {not foreign})")
        hf.to(device).eval()
        x = window[:, :-1]
        with torch.no_grad():
            ref = hf(input_ids=x, use_cache=False)
            mine = model2(input_ids=x, use_cache=False).logits.float()
            hf_h = hf.model(input_ids=x, use_cache=False).last_hidden_state
            ref_next = hf.lm_head(gn.nextn_rows(hf, nextn2, x, hf_h)).float()
        d = (ref.logits.float() - mine).abs().max().item()
        d_next = (ref_next - a[1].float()).abs().max().item()
        same_greedy = bool(torch.equal(ref.logits.argmax(-1), mine.argmax(-1)))
        print(f"  from_pretrained vs reloaded: max |dlogit| {d:.2e} (same greedy tokens {same_greedy}); NextN on "
              f"its hiddens {d_next:.2e}")
        checks.update(from_pretrained_max_abs_logit_diff=d, from_pretrained_nextn_max_abs_logit_diff=d_next,
                      same_greedy=same_greedy, missing=missing, unexpected_non_nextn=foreign,
                      unexpected_nextn=len(unexpected) - len(foreign))
        if d > 1e-4 or d_next > 1e-4 or missing or foreign:
            problems.append(f"transformers' from_pretrained does not reproduce the export: |dlogit| {d}, NextN "
                            f"{d_next}, missing {missing[:5]}, unexpected {foreign[:5]}")
        del hf
    except Exception as exc:  # noqa: BLE001
        print(f"  from_pretrained FAILED: {exc!r}")
        checks["from_pretrained_error"] = repr(exc)
        problems.append(f"transformers could not load the export: {exc!r}")
    return model2, nextn2, checks


def check_config_json(cj: dict) -> None:
    """AutoConfig must read config.json back (checked before training)."""
    import tempfile
    from transformers import AutoConfig
    with tempfile.TemporaryDirectory() as d:
        write_json(Path(d) / "config.json", cj)
        try:
            c = AutoConfig.from_pretrained(d)
        except Exception as exc:  # noqa: BLE001
            fail(f"transformers' AutoConfig cannot read the config.json we would write: {exc!r}")
    for k in ("num_hidden_layers", "index_topk", "n_routed_experts", "q_lora_rank", "mlp_layer_types"):
        check(getattr(c, k, None) == cj[k], f"AutoConfig reads {k} = {getattr(c, k, None)!r}, we write {cj[k]!r}")
    print(f"  config.json reads back as {type(c).__name__} (num_nextn_predict_layers "
          f"{getattr(c, 'num_nextn_predict_layers', None)})")


def write_prompts_and_sample(out: Path, held_files) -> dict:
    sample = tdm.pick_sample_file(held_files)
    (out / "heldout_sample.py").write_bytes(sample["text"].encode("utf-8"))
    prompts = tdm.make_prompts(held_files)
    lines = [json.dumps({"id": r["id"], "source": r["source"], "function": r["function"], "lineno": r["lineno"],
                         "prompt": r["prompt"]}, ensure_ascii=False) + "\n" for r in prompts]
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(lines)
    same = {}
    for name in ("prompts.jsonl", "heldout_sample.py"):
        q = QWEN_DEMO / name
        same[name] = q.is_file() and q.read_bytes() == (out / name).read_bytes()
    print(f"  heldout_sample.py <- {sample['rel']} ({sample['bytes']} bytes); prompts.jsonl: {len(prompts)} prompts; "
          f"identical to the Qwen demo's: {same}")
    if len(prompts) < 8:
        print(f"  WARNING: only {len(prompts)} prompts found")
    return {"heldout_sample": {"source": sample["rel"], "bytes": sample["bytes"]}, "prompts": len(prompts),
            "same_as_qwen_demo": same}


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget of the training loop "
                    "(the whole run takes about 40 seconds more)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps-max", type=int, default=0, help="stop after this many steps (0: no step cap)")
    ap.add_argument("--epochs", type=float, default=tdm.EPOCHS_DEFAULT, help="stop after this many passes (0: no cap)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the NextN loss")
    ap.add_argument("--index-kl-weight", type=float, default=1.0, help="weight of the indexer KL (0: off)")
    ap.add_argument("--index-kl-batch", type=int, default=16, help="sequences per batch the indexer KL uses")
    ap.add_argument("--dense-warmup", type=float, default=0.25,
                    help="fraction of the budget trained with dense attention (the indexer learns from it)")
    ap.add_argument("--bias-update", type=float, default=1e-3,
                    help="router e_score_correction_bias step per training step (DeepSeek-V3 balancing; 0: off)")
    ap.add_argument("--experts", default="grouped_mm", choices=["eager", "grouped_mm", "batched_mm"],
                    help="experts backend to try (checked against eager; falls back to eager)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-tokens", type=int, default=200_000, help="cap on held-out tokens evaluated")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--val-every", type=int, default=100, help="validation loss every N steps (0: off)")
    ap.add_argument("--no-keep-best", dest="keep_best", action="store_false",
                    help="ship the final weights instead of the best-validation checkpoint")
    ap.add_argument("--site-packages", action="append", default=[],
                    help="also train on this installed-packages directory (as the Qwen demo's run did)")
    ap.add_argument("--site-packages-bytes", type=int, default=60_000_000)
    ap.add_argument("--keep-codec-tables", action="store_true")
    ap.add_argument("--allow-split-mismatch", action="store_true",
                    help="go on when the held-out / validation split differs from the Qwen demo's")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                    help="attention (the indexer KL needs eager's probabilities)")
    args = ap.parse_args()
    check(args.seq > INDEX_TOPK, f"--seq {args.seq} must exceed index_topk {INDEX_TOPK} (DSA active in training)")

    t_start = time.time()
    device = torch.device(args.device)
    out: Path = args.out.resolve()
    vers = tdm.versions()
    print(f"versions: {vers}")
    print(f"device {device}; out {out}")
    try:
        gn.glm_modules()
    except RuntimeError as exc:
        fail(str(exc))
    torch.manual_seed(args.seed)

    banner("1. corpus (the Qwen demo's rules and split)")
    corpus = tdm.collect_corpus(args.keep_codec_tables, args.site_packages, args.site_packages_bytes)
    train_files, val_files, held_files = corpus["train"], corpus["validation"], corpus["heldout"]

    banner("2. tokenizer (models/qwen35-demo/tokenizer.json)")
    t = time.time()
    vocab = 4096
    tok, tok_info = load_tokenizer(vocab, [f["text"] for f in held_files[:20]])
    eot = tok.token_to_id("<|endoftext|>")
    check(eot == 0, f"<|endoftext|> has id {eot}, expected 0")
    train_stream, train_counts = tdm.encode_files(tok, train_files, eot)
    val_stream, val_counts = tdm.encode_files(tok, val_files, eot)
    held_stream, held_counts = tdm.encode_files(tok, held_files, eot)
    print(f"  train {len(train_stream):,} tokens, validation {len(val_stream):,}, held-out {len(held_stream):,}; "
          f"{time.time() - t:.1f}s")
    split_check = compare_split(held_files, val_files, len(held_stream), len(val_stream), args.allow_split_mismatch)

    banner("3. model")
    cfg = glm_config(vocab, eot, g5.rope_layout())
    cj = export_config(cfg)
    check_config_json(cj)
    model, nextn, n_params = build_models(cfg, args.attn, device)
    experts_backend = experts_impl(model, nextn, args.experts, device, cfg)
    self_test(model, nextn, cfg, device, use_autocast=False)
    if device.type == "cuda":
        self_test(model, nextn, cfg, device, use_autocast=True)
    taps = IndexerTaps(model, cfg)
    probe = probe_indexer(model, nextn, cfg, device, taps, args.seq)
    variant = probe["variant"] if (probe["probs"] and args.index_kl_weight > 0) else None
    if variant is None:
        why = probe.get("reason") or ("--index-kl-weight 0" if args.index_kl_weight <= 0 else "unknown")
        print(f"  WARNING: the DSA indexer stays untrained ({why}); its choice is whatever random weights give")
        probe.setdefault("reason", why)
    load = ExpertLoad(moe_modules(model, nextn), cfg["n_routed_experts"], cfg["num_experts_per_tok"], device)
    load.active = True
    with torch.no_grad():
        glm_joint_forward(model, nextn, torch.randint(3, vocab, (2, 65), device=device))
    load.active = False
    want = 2 * 64 * cfg["num_experts_per_tok"]
    sums = [int(s) for s in load.counts.sum(-1).tolist()]
    check(load.calls == len(load.mods) and sums[:-1] == [want] * (len(sums) - 1) and sums[-1] == 2 * 63 * 2,
          f"expert-load counting failed: {load.calls} calls for {len(load.mods)} mixtures, sums {sums}")
    load.reset()

    banner("4. training")
    train_ids = torch.tensor(train_stream, dtype=torch.long, device=device)
    held_ids = torch.tensor(held_stream, dtype=torch.long, device=device)
    all_held = tdm.eval_windows(held_ids, args.seq, args.eval_tokens)
    val_ids = torch.tensor(val_stream, dtype=torch.long, device=device)
    val_windows = tdm.eval_windows(val_ids, args.seq, 64 * args.seq)
    torch.manual_seed(args.seed)
    tr = train(model, nextn, cfg, train_ids, val_windows, args, device, taps, variant, probe["toggle"], load)
    taps.remove()
    biases = {name: [round(x, 4) for x in m.gate.e_score_correction_bias.float().tolist()]
              for name, m in load.mods}

    banner("5. held-out evaluation (trained fp32 master weights)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ev_master = evaluate(model, nextn, all_held)
    tdm.print_eval("master fp32", ev_master)
    ev_master_bf16 = None
    if device.type == "cuda":
        ev_master_bf16 = evaluate(model, nextn, all_held, use_autocast=True)
        tdm.print_eval("master bf16 autocast", ev_master_bf16)

    banner("6. export")
    out.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(model, nextn, cfg)
    st_path = out / "model.safetensors"
    save_file(tensors, str(st_path), metadata={"format": "pt"})
    size = st_path.stat().st_size
    print(f"  wrote {st_path} ({size / 1e6:.2f} MB, {len(tensors)} tensors)")
    check(size < 40 * 1000 * 1000, f"model.safetensors is {size} bytes (>= 40 MB)")
    write_json(out / "config.json", cj)
    for name in TOKENIZER_FILES:
        shutil.copyfile(QWEN_DEMO / name, out / name)
    write_json(out / "generation_config.json", {
        "bos_token_id": None, "eos_token_id": eot, "pad_token_id": eot, "do_sample": False,
        "transformers_version": transformers.__version__,
    })
    extras = write_prompts_and_sample(out, held_files)

    banner("7. reload checks")
    problems: list[str] = []
    model2, nextn2, export_checks = reload_checks(st_path, out, cfg, args.attn, device, model, nextn,
                                                  all_held[:1], problems)
    ev_reload = evaluate(model2, nextn2, all_held)
    tdm.print_eval("reloaded bf16 weights, fp32 compute", ev_reload)
    check(abs(math.log(ev_reload["ppl"]) - math.log(ev_master["ppl"])) < 0.05,
          "the reloaded checkpoint's perplexity differs from the trained model's by more than 5%")
    ev_reload_bf16 = None
    if device.type == "cuda":
        ev_reload_bf16 = evaluate(model2, nextn2, all_held, use_autocast=True)
        tdm.print_eval("reloaded, bf16 autocast", ev_reload_bf16)
    ev_dense = evaluate_dense(model2, nextn2, all_held, args.seq)
    tdm.print_eval("reloaded, fp32, DSA off (dense attention)", ev_dense)
    export_checks["tokenizer"] = tdm.tokenizer_oracle_check(out, tok)

    files_written = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    N = cfg["num_hidden_layers"]
    info = {
        "model": "tandem demo: GLM-5 architecture (glm_moe_dsa: MLA + DSA indexer, MoE with a shared expert) "
                 "with its NextN (MTP) layer, trained by tools/train_glm_demo_model.py",
        "config": cj,
        "attn_implementation_used": args.attn,
        "experts_backend": experts_backend,
        "parameters": n_params,
        "safetensors_bytes": size,
        "data": {
            "source": f"the Qwen demo's corpus: CPython {platform.python_version()} standard library sources at "
                      f"{corpus['root']} plus --site-packages (license: PSF License Agreement and the packages' own)",
            "stdlib_root": corpus["root"], "site_packages": corpus["site_packages"],
            "rules": "tools/train_demo_model.py collect_corpus (same exclusions, sha1(relative path) mod "
                     f"{tdm.HELDOUT_MOD}: 0 held-out, 1 validation)",
            "same_split_as_qwen_demo": split_check,
            "document_separator": "<|endoftext|> after every file",
            "train": {"files": len(train_files), "tokens": len(train_stream), "text_tokens": sum(train_counts)},
            "validation": {"files": len(val_files), "tokens": len(val_stream), "text_tokens": sum(val_counts)},
            "heldout": {"files": len(held_files), "tokens": len(held_stream), "text_tokens": sum(held_counts),
                        "file_list": [f["rel"] for f in held_files]},
        },
        "tokenizer": tok_info,
        "training": {
            "objective": f"CE(next token) + {args.mtp_weight} * CE(NextN row p -> token p+2) + "
                         f"{args.index_kl_weight if variant else 0} * indexer KL; the NextN loss reaches the trunk, "
                         "the KL only the indexers",
            "nextn_convention": "row p: eh_proj(concat(enorm(embed(x[p+1])), hnorm(h[p]))), h = final-normed hidden, "
                                "rotary position p, one GLM decoder layer attending causally to every earlier row "
                                f"(no DSA), shared_head.norm, the target's lm_head; predicts x[p+2]; weights under "
                                f"model.layers.{N}.",
            "indexer": {
                "trained": variant is not None,
                "objective": "DeepSeek-V3.2 warm-up: KL(sum over heads of the detached attention probabilities, "
                             "renormalised || softmax of the index scores) over causal keys, per indexer layer, "
                             "inputs detached", "rotary_variant": variant, "probe": probe,
                "kl_sequences_per_batch": args.index_kl_batch, "dense_warmup_fraction": args.dense_warmup,
                "dense_steps": tr["dense_steps"], "index_topk": INDEX_TOPK,
                "untrained_reason": None if variant else probe.get("reason"),
            },
            "routers": {"balancing": f"aux-loss-free: e_score_correction_bias += {args.bias_update} * "
                                     "sign(mean load - load) after every step", "final_biases": biases},
            "optimizer": tr["optimizer"], "lr": args.lr, "betas": [0.9, 0.95], "weight_decay": args.weight_decay,
            "schedule": f"linear warmup {args.warmup} steps, cosine to {args.min_lr_ratio} x peak over the budget",
            "grad_clip": f"{args.clip} on the model, {args.clip} on the indexers apart",
            "precision": "fp32 master weights, bf16 autocast" if device.type == "cuda" else "fp32",
            "seq_len": args.seq, "batch_requested": args.batch, "batch_final": tr["final_batch"],
            "oom_events": tr["oom_events"], "minutes_budget": args.minutes, "steps_max": args.steps_max,
            "epochs_max": args.epochs, "steps": tr["steps"], "tokens_seen": tr["tokens_seen"], "epochs": tr["epochs"],
            "wall_time_s": tr["wall_time_s"], "final_train_loss": tr["final_train_loss"],
            "final_train_nextn_loss": tr["final_train_mtp_loss"], "final_train_index_kl": tr["final_train_index_kl"],
            "seed": args.seed, "diverged": tr["diverged"],
            "early_stopping": "best validation objective (CE + mtp_weight * NextN CE, DSA on) among checks every "
                              "--val-every steps and at the end" if args.keep_best else "off",
            "restored_best": tr["restored_best"], "shipped_step": tr["shipped_step"],
            "shipped_epoch": tr["shipped_epoch"], "final_validation": tr["final_validation"],
            "history": tr["history"], "validation_history": tr["validation_history"],
        },
        "heldout_eval": {
            "definition": "teacher-forced over non-overlapping windows of seq tokens (+1 label token) of the held-out "
                          "stream (tools/train_demo_model.py evaluate); mtp_* are the NextN layer's: agree = "
                          "argmax(NextN row p) == argmax(target logits at p+1), the depth-1 acceptance at T=0",
            "shipped_weights_fp32": ev_reload,
            "shipped_weights_bf16_autocast": ev_reload_bf16,
            "shipped_weights_fp32_dense_attention": ev_dense,
            "trained_master_fp32": ev_master,
            "trained_master_bf16_autocast": ev_master_bf16,
        },
        "export_checks": export_checks,
        **extras,
        "files": files_written,
        "versions": vers,
        "problems": problems,
        "total_script_time_s": time.time() - t_start,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }
    write_json(out / "training.json", info)

    banner("summary")
    print(f"  output: {out}")
    for name, sz in {**files_written, "training.json": (out / "training.json").stat().st_size}.items():
        print(f"    {name:24s} {sz:>12,} bytes")
    print(f"  params {n_params['total']:,} (target {n_params['target']:,} + NextN {n_params['nextn']:,})")
    print(f"  training: {tr['steps']} steps ({tr['dense_steps']} dense), {tr['tokens_seen']:,} tokens "
          f"({tr['epochs']:.2f} epochs), {tr['wall_time_s']:.0f}s; shipped step {tr['shipped_step']}; indexer "
          f"{'trained (' + variant + ')' if variant else 'UNTRAINED: ' + str(probe.get('reason'))}; experts "
          f"{experts_backend}")
    tdm.print_eval("SHIPPED weights, fp32", ev_reload)
    if ev_reload_bf16:
        tdm.print_eval("SHIPPED weights, bf16", ev_reload_bf16)
    print(f"  DSA cost: ppl {ev_reload['ppl']:.3f} with index_topk {INDEX_TOPK} vs {ev_dense['ppl']:.3f} dense")
    print(f"  total time {time.time() - t_start:.0f}s")
    if problems:
        fail("export checks failed (files are written; see training.json 'problems'):\n  " + "\n  ".join(problems))


if __name__ == "__main__":
    main()
