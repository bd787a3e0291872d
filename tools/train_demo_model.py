#!/usr/bin/env python3
"""Train tandem's bundled demo model: a small Qwen3.5-architecture LM with one native MTP layer.

Run once on a GPU machine with torch + transformers + tokenizers + safetensors (no network needed):

    PYTHONUNBUFFERED=1 python3 tools/train_demo_model.py            # writes models/qwen35-demo/
    python3 tools/train_demo_model.py --minutes 1 --out /tmp/demo    # quick smoke run

Stages (each prints what it does and checks what it can; any surprise stops the run with a message):

  1. corpus     every *.py of this machine's Python standard library (sysconfig "stdlib"), minus
                site-/dist-packages, test/ and tests/ folders, idlelib, lib2to3, turtledemo, files over
                200 KB and files that are not UTF-8. Sorted by relative path. Held-out split: whole files
                with sha1(relative path) mod 50 == 0 (never trained on, not even by the tokenizer).
  2. tokenizer  byte-level BPE (Qwen structure: NFC, regex Split + ByteLevel, ByteLevel decoder),
                4096 tokens including <|endoftext|> (id 0), <|im_start|>, <|im_end|>.
  3. model      transformers Qwen3_5ForCausalLM (hybrid Gated DeltaNet + gated full attention) plus a
                DeepSeek-V3 / Qwen3.5-style MTP block written here (published `mtp.*` names).
  4. training   joint loss CE(next token) + 0.3 * CE(MTP: token t+2), AdamW, bf16 autocast, a fixed
                wall-clock budget (--minutes).
  5. evaluation held-out perplexity, target top-1, MTP top-1 and MTP agreement with the target's
                greedy choice (the depth-1 acceptance speculative decoding should see at T=0).
  6. export     the published Qwen3.5 layout (config.json model_type qwen3_5 + text_config,
                model.safetensors with model.language_model.* and mtp.*, tokenizer files,
                generation_config.json) + training.json, heldout_sample.py, prompts.jsonl; then
                reload the file and prove it is the trained model.

MTP convention (what the engine's qwen_mtp drafter must do): for a sequence x_0..x_{L-1} with the
target's FINAL-NORMED hidden states h_0..h_{L-1} (output of model.norm = last_hidden_state), MTP row
p is fc(concat(pre_fc_norm_embedding(embed(x_{p+1})), pre_fc_norm_hidden(h_p))) at rotary position p,
then one causal full-attention decoder layer over the MTP rows, then mtp.norm, then the shared
(tied) head; row p predicts x_{p+2}.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import math
import os
import platform
import sys
import sysconfig
import textwrap
import time
import unicodedata
from pathlib import Path

# No network on the GPU machine: never let huggingface_hub try to reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

# Make optional fast-kernel packages un-importable so transformers uses its pure-torch Gated DeltaNet
# and causal-conv1d functions (the reference the engine is checked against). They are not installed
# on the GPU machine anyway; this only makes the run independent of that.
for _name in ("fla", "causal_conv1d"):
    if _name not in sys.modules and importlib.util.find_spec(_name) is not None:
        print(f"note: blocking installed fast-kernel package {_name!r} (pure-torch reference path)")
    sys.modules.setdefault(_name, None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import transformers  # noqa: E402
import tokenizers  # noqa: E402
import safetensors  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "qwen35-demo"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                 "__pycache__"}
MAX_FILE_BYTES = 200_000
HELDOUT_MOD = 50

LIN, FULL = "linear_attention", "full_attention"
LAYER_TYPES = [LIN, LIN, LIN, FULL, LIN, LIN, LIN, FULL]


def fail(msg: str) -> None:
    raise SystemExit(f"\nTRAIN_DEMO ERROR: {msg}\n")


def check(cond: bool, msg: str) -> None:
    if not cond:
        fail(msg)


def banner(text: str) -> None:
    print("\n" + "=" * 100 + f"\n{text}\n" + "=" * 100, flush=True)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# 1. Corpus
# --------------------------------------------------------------------------------------------------

def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode("utf-8")).hexdigest(), 16) % HELDOUT_MOD == 0


def collect_corpus() -> dict:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    check(root.is_dir(), f"stdlib directory {root} does not exist")
    print(f"stdlib: {root} (Python {platform.python_version()})")
    files, skipped = [], {"too_big": [], "not_utf8": [], "empty": []}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            if not p.is_file():
                continue
            rel = p.relative_to(root).as_posix()
            data = p.read_bytes()
            if len(data) > MAX_FILE_BYTES:
                skipped["too_big"].append(rel)
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                skipped["not_utf8"].append(rel)
                continue
            if not text.strip():
                skipped["empty"].append(rel)
                continue
            files.append({"rel": rel, "text": text, "bytes": len(data), "heldout": is_heldout(rel)})
    files.sort(key=lambda f: f["rel"])
    train = [f for f in files if not f["heldout"]]
    held = [f for f in files if f["heldout"]]
    for k, v in skipped.items():
        print(f"  skipped {k}: {len(v)} {sorted(v)[:6]}{' ...' if len(v) > 6 else ''}")
    print(f"  files: {len(files)} kept, train {len(train)} ({sum(f['bytes'] for f in train):,} bytes), "
          f"held-out {len(held)} ({sum(f['bytes'] for f in held):,} bytes)")
    print(f"  held-out files: {[f['rel'] for f in held]}")
    check(len(train) >= 100, f"only {len(train)} training files found under {root}: is this a full stdlib?")
    check(len(held) >= 3, f"only {len(held)} held-out files: the split needs a few files")
    return {"root": str(root), "train": train, "heldout": held,
            "skipped": {k: sorted(v) for k, v in skipped.items()}}


# --------------------------------------------------------------------------------------------------
# 2. Tokenizer
# --------------------------------------------------------------------------------------------------

def train_tokenizer(train_texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    return tok


def check_tokenizer(tok, vocab_size: int, sample_texts: list[str]) -> dict:
    got = tok.get_vocab_size(with_added_tokens=True)
    print(f"  vocab size {got} (requested {vocab_size})")
    check(got <= vocab_size, f"tokenizer has {got} tokens > {vocab_size}")
    if got < vocab_size:
        print(f"  WARNING: BPE stopped at {got} tokens (< {vocab_size}); the model keeps vocab_size "
              f"{vocab_size} (unused rows)")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    print(f"  special token ids: {ids}")
    check(ids == {t: i for i, t in enumerate(SPECIAL_TOKENS)},
          f"special tokens must have ids 0, 1, 2 in order {SPECIAL_TOKENS}, got {ids}")
    from tokenizers import pre_tokenizers
    missing = [c for c in pre_tokenizers.ByteLevel.alphabet() if tok.token_to_id(c) is None]
    check(not missing, f"{len(missing)} byte-level alphabet characters are not in the vocab: {missing[:10]}")
    # Round trip (NFC-normalized text must come back byte-exact).
    for t in sample_texts:
        enc = tok.encode(t, add_special_tokens=False)
        back = tok.decode(enc.ids, skip_special_tokens=False)
        check(back == unicodedata.normalize("NFC", t), "tokenizer round trip failed on a held-out file")
    # The JSON the engine reads: added tokens must be special and not normalized.
    j = json.loads(tok.to_str())
    added = {a["content"]: a for a in j.get("added_tokens", [])}
    for i, t in enumerate(SPECIAL_TOKENS):
        a = added.get(t)
        check(a is not None and a["id"] == i, f"tokenizer.json added_tokens lacks {t} with id {i}: {a}")
        check(a.get("special") is True, f"tokenizer.json: {t} is not marked special: {a}")
    print(f"  pre_tokenizer: {json.dumps(j['pre_tokenizer'])[:300]}")
    print(f"  normalizer: {j['normalizer']}, decoder: {j['decoder']}, model type {j['model']['type']}, "
          f"{len(j['model']['merges'])} merges")
    print(f"  sample: {tok.encode('def foo(self, x):\n    return x + 1\n').tokens}")
    return {"vocab_size_trained": got, "merges": len(j["model"]["merges"]), "special_ids": ids}


def encode_files(tok, files: list[dict], eot: int) -> tuple[list[int], list[int]]:
    """Concatenate files, each followed by <|endoftext|>. Returns (stream, per-file token counts)."""
    encs = tok.encode_batch([f["text"] for f in files], add_special_tokens=False)
    stream, counts, stray = [], [], 0
    for f, e in zip(files, encs):
        ids = e.ids
        stray += sum(1 for i in ids if i < len(SPECIAL_TOKENS))
        stream.extend(ids)
        stream.append(eot)
        counts.append(len(ids))
    if stray:
        print(f"  note: {stray} special-token ids appear inside file texts (literal special strings)")
    return stream, counts


# --------------------------------------------------------------------------------------------------
# 3. Model: transformers Qwen3.5 text model + our MTP block
# --------------------------------------------------------------------------------------------------

def qwen35_modules():
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
    except Exception as exc:  # noqa: BLE001
        fail(f"transformers {transformers.__version__} does not provide the Qwen3.5 classes: {exc!r}")
    return Qwen3_5TextConfig, Qwen3_5ForCausalLM, Qwen3_5DecoderLayer, Qwen3_5RMSNorm


def text_config_kwargs(vocab_size: int, eos_id: int, layer_types: list[str]) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=384,
        intermediate_size=768,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=4096,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0, partial_rotary_factor=0.25,
                             mrope_section=[3, 3, 2], mrope_interleaved=True),
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        # pad_token_id must stay None: it becomes nn.Embedding's padding_idx, which would freeze (and
        # zero) the <|endoftext|> row of the tied embedding/head. Padding is a tokenizer-side notion.
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=eos_id,
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
    )


class MTPBlock(nn.Module):
    """Qwen3.5 / DeepSeek-V3 multi-token-prediction block (one layer), published parameter names:

    mtp.pre_fc_norm_embedding.weight [H], mtp.pre_fc_norm_hidden.weight [H] (zero-centred RMSNorm),
    mtp.fc.weight [H, 2H] (embedding half first), mtp.layers.0.* (a full-attention Qwen3.5 decoder
    layer), mtp.norm.weight [H]. The output goes through the target's (tied) head.
    """

    def __init__(self, layer_cfg, decoder_layer_cls, rmsnorm_cls):
        super().__init__()
        h, eps = layer_cfg.hidden_size, layer_cfg.rms_norm_eps
        check(layer_cfg.layer_types[0] == FULL, "the MTP layer config must make layer 0 full attention")
        self.pre_fc_norm_embedding = rmsnorm_cls(h, eps=eps)
        self.pre_fc_norm_hidden = rmsnorm_cls(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([decoder_layer_cls(layer_cfg, 0)])
        self.norm = rmsnorm_cls(h, eps=eps)
        check(hasattr(self.layers[0], "self_attn"), "MTP decoder layer has no self_attn (not full attention?)")
        self.reset_parameters(layer_cfg.initializer_range)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        # Same scheme transformers uses for the trunk: Linear ~ N(0, std); Qwen3.5 RMSNorm weights 0
        # (zero-centred: the effective scale is 1 + w).
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.zero_()
            else:
                fail(f"MTP parameter {name} {tuple(p.shape)} has no init rule")

    def forward(self, emb_next, hidden, position_embeddings, attention_mask, position_ids):
        x = torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        for layer in self.layers:
            out = layer(x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                        position_ids=position_ids, past_key_values=None)
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)


_MASKS: dict = {}


def causal_additive_mask(n: int, device) -> torch.Tensor:
    """[1, 1, n, n] float32: 0 on and below the diagonal, -inf above (eager adds it; sdpa takes it)."""
    key = (n, str(device))
    if key not in _MASKS:
        m = torch.full((n, n), float("-inf"), dtype=torch.float32, device=device).triu(1)
        _MASKS[key] = m[None, None]
    return _MASKS[key]


def build_models(vocab_size: int, eos_id: int, attn_impl: str, device):
    TextConfig, ForCausalLM, DecoderLayer, RMSNorm = qwen35_modules()
    cfg = TextConfig(**text_config_kwargs(vocab_size, eos_id, LAYER_TYPES), attn_implementation=attn_impl)
    model = ForCausalLM(cfg)

    def tied() -> bool:
        return model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    if not tied():
        print("  note: lm_head not tied after construction; calling model.tie_weights()")
        model.tie_weights()
    if not tied():
        print("  note: tie_weights() did not tie; sharing the Parameter by hand")
        model.lm_head.weight = model.model.embed_tokens.weight
    check(tied(), "could not tie lm_head.weight to model.embed_tokens.weight")

    mtp_cfg = TextConfig(**text_config_kwargs(vocab_size, eos_id, [FULL] * len(LAYER_TYPES)),
                         attn_implementation=attn_impl)
    mtp_cfg._attn_implementation = model.config._attn_implementation
    mtp = MTPBlock(mtp_cfg, DecoderLayer, RMSNorm)

    print(f"  attn_implementation: trunk {model.config._attn_implementation!r}, "
          f"MTP {mtp.layers[0].self_attn.config._attn_implementation!r}")
    check(model.config._attn_implementation in ("sdpa", "eager"),
          f"unexpected attention implementation {model.config._attn_implementation!r}")
    rp = model.config.rope_parameters
    print(f"  rope_parameters: {rp}; partial_rotary_factor attr "
          f"{getattr(model.config, 'partial_rotary_factor', None)}")
    inv = model.model.rotary_emb.inv_freq
    check(inv.numel() == 8, f"rotary inv_freq has {inv.numel()} entries, expected 8 (head_dim 64 x 0.25 / 2)")
    check(float(rp["rope_theta"]) == 1e6, f"rope_theta {rp.get('rope_theta')} != 1e6")
    check(list(model.config.layer_types) == LAYER_TYPES, f"layer_types {model.config.layer_types}")
    check(model.model.embed_tokens.padding_idx is None, "embed_tokens has a padding_idx (pad_token_id set?)")
    model.to(device)
    mtp.to(device)

    n_trunk = sum(p.numel() for p in model.parameters())  # parameters() dedups the tied head
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"  parameters: trunk {n_trunk:,} (tied head), MTP {n_mtp:,}, total {n_trunk + n_mtp:,}; "
          f"bf16 size ~{(n_trunk + n_mtp) * 2 / 1e6:.1f} MB")
    for name, p in list(model.named_parameters())[:0]:
        print(name, tuple(p.shape))
    return cfg, model, mtp, {"trunk": n_trunk, "mtp": n_mtp, "total": n_trunk + n_mtp}


def joint_forward(model, mtp, window: torch.Tensor):
    """window [B, L+1] token ids. Returns (target logits [B, L, V] for positions 0..L-1,
    MTP logits [B, L-1, V] for rows p = 0..L-2 (predicting window[:, p+2]))."""
    x = window[:, :-1]
    b, n = x.shape
    out = model.model(input_ids=x, use_cache=False)
    h = out.last_hidden_state                      # final-normed (model.norm output), [B, L, H]
    logits = model.lm_head(h)
    emb_next = model.model.embed_tokens(x[:, 1:])  # embed(x_{p+1}) for p = 0..L-2
    h_prev = h[:, :-1]                             # h_p
    pos = torch.arange(n - 1, device=x.device).unsqueeze(0).expand(b, -1)
    pos3 = pos.unsqueeze(0).expand(3, -1, -1)      # text-only mrope: t = h = w = p
    position_embeddings = model.model.rotary_emb(emb_next, pos3)
    mtp_h = mtp(emb_next, h_prev, position_embeddings, causal_additive_mask(n - 1, x.device), pos)
    mtp_logits = model.lm_head(mtp_h)
    return logits, mtp_logits


def self_test(model, mtp, device, vocab_size: int, use_autocast: bool) -> None:
    """Shapes, 'last_hidden_state is after model.norm', ForCausalLM logits == lm_head(h), and causality
    of both the trunk and the MTP block (changing tokens from position c on must not change
    target positions < c nor MTP rows < c-1)."""
    model.eval()
    mtp.eval()
    g = torch.Generator().manual_seed(123)
    win = torch.randint(3, vocab_size, (2, 65), generator=g).to(device)
    captured = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("norm", o))
    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if use_autocast else _nullctx()
    with torch.no_grad(), ctx:
        out = model.model(input_ids=win[:, :-1], use_cache=False, output_hidden_states=True)
        full = model(input_ids=win[:, :-1], use_cache=False)
        logits, mtp_logits = joint_forward(model, mtp, win)
        c = 40
        win2 = win.clone()
        win2[:, c:] = torch.randint(3, vocab_size, (2, win.shape[1] - c), generator=g).to(device)
        logits2, mtp_logits2 = joint_forward(model, mtp, win2)
    hook.remove()
    tag = "bf16 autocast" if use_autocast else "fp32"
    print(f"  [{tag}] logits {tuple(logits.shape)} {logits.dtype}, mtp_logits {tuple(mtp_logits.shape)}, "
          f"last_hidden_state {tuple(out.last_hidden_state.shape)} {out.last_hidden_state.dtype}")
    check(tuple(logits.shape) == (2, 64, vocab_size) and tuple(mtp_logits.shape) == (2, 63, vocab_size),
          "unexpected logits shapes")
    check(torch.equal(captured["norm"], out.last_hidden_state),
          "last_hidden_state is not the output of model.model.norm (final norm)")
    hs = getattr(out, "hidden_states", None)
    if hs:
        print(f"  note: output_hidden_states gives {len(hs)} tensors; hidden_states[-1] == last_hidden_state: "
              f"{torch.equal(hs[-1], out.last_hidden_state)} (we use last_hidden_state)")
    tol = 1e-2 if use_autocast else 1e-4
    d = (full.logits.float() - logits.float()).abs().max().item()
    check(d <= tol, f"Qwen3_5ForCausalLM logits differ from lm_head(last_hidden_state) by {d}")
    d_t = (logits[:, :c] - logits2[:, :c]).abs().max().item()
    d_m = (mtp_logits[:, :c - 1] - mtp_logits2[:, :c - 1]).abs().max().item()
    d_after = (mtp_logits[:, c:] - mtp_logits2[:, c:]).abs().max().item()
    print(f"  [{tag}] causality: target prefix diff {d_t:.2e}, MTP prefix diff {d_m:.2e} "
          f"(changed suffix diff {d_after:.2e})")
    check(d_t <= tol, f"trunk is not causal: logits before position {c} changed by {d_t}")
    check(d_m <= tol, f"MTP block is not causal: rows before {c - 1} changed by {d_m} (attention mask?)")
    check(d_after > 0, "MTP output did not react to changed inputs at all")


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# --------------------------------------------------------------------------------------------------
# 4. Training
# --------------------------------------------------------------------------------------------------

def param_groups(model, mtp, weight_decay: float):
    seen, decay, no_decay, names_nd = set(), [], [], []
    for prefix, module in (("", model), ("mtp.", mtp)):
        for name, p in module.named_parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if p.ndim >= 2:
                decay.append(p)
            else:
                no_decay.append(p)
                names_nd.append(prefix + name)
    print(f"  weight decay {weight_decay} on {len(decay)} matrices "
          f"({sum(p.numel() for p in decay):,} params); none on {len(no_decay)} vectors "
          f"(norms, A_log, dt_bias: {sum(p.numel() for p in no_decay):,} params)")
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(groups, lr: float, device):
    kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(groups, fused=True, **kw), "fused"
        except Exception as exc:  # noqa: BLE001
            print(f"  note: fused AdamW unavailable ({exc!r}); using the default implementation")
    return torch.optim.AdamW(groups, **kw), "default"


def lr_at(step: int, progress: float, peak: float, warmup: int, min_ratio: float) -> float:
    warm = min(1.0, (step + 1) / warmup)
    progress = min(max(progress, 0.0), 1.0)
    cos = min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * warm * cos


def losses(model, mtp, window):
    logits, mtp_logits = joint_forward(model, mtp, window)
    v = logits.shape[-1]
    loss_main = F.cross_entropy(logits.float().reshape(-1, v), window[:, 1:].reshape(-1))
    loss_mtp = F.cross_entropy(mtp_logits.float().reshape(-1, v), window[:, 2:].reshape(-1))
    return loss_main, loss_mtp


def train(model, mtp, train_ids: torch.Tensor, val_windows: torch.Tensor, args, device) -> dict:
    seq = args.seq
    batch = args.batch
    n = train_ids.numel()
    check(n > seq + 2, f"training stream too short ({n} tokens) for seq {seq}")
    groups = param_groups(model, mtp, args.weight_decay)
    params = [p for g in groups for p in g["params"]]
    opt, opt_kind = make_optimizer(groups, args.lr, device)
    use_autocast = device.type == "cuda"
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(seq + 1, device=device)
    budget = args.minutes * 60.0
    history, val_history = [], []
    step, tokens_seen, oom_events = 0, 0, 0
    run_main = run_mtp = None
    run_count = 0
    last_main = last_mtp = float("nan")
    model.train()
    mtp.train()
    print(f"  optimizer AdamW ({opt_kind}) lr {args.lr} betas (0.9, 0.95) wd {args.weight_decay}; warmup "
          f"{args.warmup} steps then cosine to {args.min_lr_ratio} x peak over the time budget "
          f"({args.minutes} min){f' / {args.steps_max} steps' if args.steps_max else ''}")
    print(f"  batch {batch} x seq {seq} = {batch * seq:,} tokens/step; train stream {n:,} tokens; "
          f"autocast {'bf16' if use_autocast else 'off'}; grad clip {args.clip}; MTP weight {args.mtp_weight}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.time()
    t_log, tok_log = t0, 0
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (args.steps_max and step >= args.steps_max):
            break
        progress = elapsed / budget
        if args.steps_max:
            progress = max(progress, step / args.steps_max)
        lr = lr_at(step, progress, args.lr, args.warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n - (seq + 1), (batch,), generator=gen).to(device)
        window = train_ids[starts[:, None] + offsets[None, :]]
        try:
            ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if use_autocast else _nullctx()
            with ctx:
                loss_main, loss_mtp = losses(model, mtp, window)
            loss = loss_main + args.mtp_weight * loss_mtp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip)
            opt.step()
        except torch.cuda.OutOfMemoryError:
            oom_events += 1
            opt.zero_grad(set_to_none=True)
            loss = loss_main = loss_mtp = None
            torch.cuda.empty_cache()
            check(batch > 4, "out of GPU memory even at batch 4")
            batch //= 2
            print(f"  OOM at step {step}: halving the batch to {batch}")
            continue
        step += 1
        tokens_seen += batch * seq
        tok_log += batch * seq
        lm, lt = loss_main.detach(), loss_mtp.detach()
        run_main = lm if run_main is None else run_main + lm
        run_mtp = lt if run_mtp is None else run_mtp + lt
        run_count += 1
        if step % args.log_every == 0 or step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.time()
            last_main = (run_main / run_count).item()
            last_mtp = (run_mtp / run_count).item()
            if not (math.isfinite(last_main) and math.isfinite(last_mtp)):
                fail(f"loss is not finite at step {step}: main {last_main}, mtp {last_mtp}")
            tps = tok_log / max(now - t_log, 1e-9)
            rec = dict(step=step, elapsed_s=round(now - t0, 1), lr=lr, loss=round(last_main, 4),
                       mtp_loss=round(last_mtp, 4), grad_norm=round(float(gnorm), 3), tokens_per_s=round(tps),
                       epochs=round(tokens_seen / n, 3), batch=batch)
            history.append(rec)
            print(f"  step {step:5d}  loss {last_main:.4f}  mtp {last_mtp:.4f}  lr {lr:.2e}  "
                  f"gnorm {float(gnorm):.2f}  {tps:,.0f} tok/s  {now - t0:6.1f}s  epoch {tokens_seen / n:.2f}")
            run_main = run_mtp = None
            run_count = 0
            t_log, tok_log = now, 0
        if args.val_every and step % args.val_every == 0 and val_windows.numel():
            vm = quick_val(model, mtp, val_windows, use_autocast)
            vm.update(step=step, elapsed_s=round(time.time() - t0, 1))
            val_history.append(vm)
            print(f"  [held-out slice @ step {step}] loss {vm['loss']:.4f} mtp {vm['mtp_loss']:.4f}")
            model.train()
            mtp.train()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - t0
    if run_count:
        last_main = (run_main / run_count).item()
        last_mtp = (run_mtp / run_count).item()
    print(f"  done: {step} steps, {tokens_seen:,} tokens ({tokens_seen / n:.2f} epochs) in {wall:.1f}s "
          f"({tokens_seen / max(wall, 1e-9):,.0f} tok/s)")
    check(step > 0, "no training step completed")
    return dict(steps=step, tokens_seen=tokens_seen, epochs=tokens_seen / n, wall_time_s=wall,
                final_train_loss=last_main, final_train_mtp_loss=last_mtp, final_batch=batch,
                oom_events=oom_events, optimizer=f"AdamW ({opt_kind})", history=history,
                heldout_slice_history=val_history)


@torch.no_grad()
def quick_val(model, mtp, windows, use_autocast) -> dict:
    model.eval()
    mtp.eval()
    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if use_autocast else _nullctx()
    with ctx:
        lm, lt = losses(model, mtp, windows)
    return {"loss": lm.item(), "mtp_loss": lt.item()}


# --------------------------------------------------------------------------------------------------
# 5. Evaluation
# --------------------------------------------------------------------------------------------------

def eval_windows(stream: torch.Tensor, seq: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping windows: window k covers tokens [k*seq, k*seq + seq] (seq+1 tokens, so that
    every one of its seq positions has a next-token label)."""
    n = min(stream.numel(), max_tokens + 1)
    k = (n - 1) // seq
    check(k >= 1, f"held-out stream too short ({stream.numel()} tokens) for one {seq}-token window")
    idx = torch.arange(k, device=stream.device)[:, None] * seq + torch.arange(seq + 1, device=stream.device)
    return stream[idx]


@torch.no_grad()
def evaluate(model, mtp, windows: torch.Tensor, batch: int = 16, use_autocast: bool = False,
             late_from: int = 64) -> dict:
    """Teacher-forced metrics over windows [K, L+1]:
      ppl          exp(mean CE) of the target's next-token prediction (L predictions per window)
      top1         argmax target logits at p == x_{p+1}
      mtp_top1     argmax MTP row p == x_{p+2}            (L-1 rows per window)
      mtp_agree    argmax MTP row p == argmax target logits at p+1 (the target's greedy choice for
                   x_{p+2} given the true prefix): the depth-1 acceptance at temperature 0
      *_late       the same over positions p >= late_from only
    Argmax ties resolve to the lowest id (torch.argmax), as in the engine."""
    model.eval()
    mtp.eval()
    s = dict(nll=0.0, n=0, top1=0, mtp_nll=0.0, mtp_n=0, mtp_top1=0, agree=0, agree_late=0, n_late=0,
             top1_late=0, tlate=0)
    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if use_autocast else _nullctx()
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        with ctx:
            logits, mtp_logits = joint_forward(model, mtp, w)
        logits, mtp_logits = logits.float(), mtp_logits.float()
        v = logits.shape[-1]
        tgt = w[:, 1:]
        s["nll"] += F.cross_entropy(logits.reshape(-1, v), tgt.reshape(-1), reduction="sum").item()
        s["n"] += tgt.numel()
        t_arg = logits.argmax(-1)                  # [B, L]
        t_ok = t_arg == tgt
        s["top1"] += t_ok.sum().item()
        s["top1_late"] += t_ok[:, late_from:].sum().item()
        s["tlate"] += t_ok[:, late_from:].numel()
        mtgt = w[:, 2:]
        s["mtp_nll"] += F.cross_entropy(mtp_logits.reshape(-1, v), mtgt.reshape(-1), reduction="sum").item()
        s["mtp_n"] += mtgt.numel()
        m_arg = mtp_logits.argmax(-1)              # [B, L-1], row p
        s["mtp_top1"] += (m_arg == mtgt).sum().item()
        agree = m_arg == t_arg[:, 1:]              # row p vs target argmax at p+1
        s["agree"] += agree.sum().item()
        s["agree_late"] += agree[:, late_from:].sum().item()
        s["n_late"] += agree[:, late_from:].numel()
    return dict(
        windows=int(windows.shape[0]), window_tokens=int(windows.shape[1] - 1),
        target_predictions=s["n"], mtp_predictions=s["mtp_n"],
        ce=s["nll"] / s["n"], ppl=math.exp(s["nll"] / s["n"]), top1=s["top1"] / s["n"],
        top1_late=s["top1_late"] / max(s["tlate"], 1),
        mtp_ce=s["mtp_nll"] / s["mtp_n"], mtp_ppl=math.exp(s["mtp_nll"] / s["mtp_n"]),
        mtp_top1=s["mtp_top1"] / s["mtp_n"],
        mtp_agree=s["agree"] / s["mtp_n"], mtp_agree_late=s["agree_late"] / max(s["n_late"], 1),
        late_from=late_from, compute="bf16 autocast" if use_autocast else "fp32",
    )


def print_eval(tag: str, m: dict) -> None:
    print(f"  [{tag}] {m['windows']} windows x {m['window_tokens']} tokens ({m['compute']}): "
          f"ppl {m['ppl']:.3f} (ce {m['ce']:.4f})  top1 {m['top1']:.4f}  | MTP: ppl {m['mtp_ppl']:.3f} "
          f"top1 {m['mtp_top1']:.4f}  agree {m['mtp_agree']:.4f}  agree(p>={m['late_from']}) "
          f"{m['mtp_agree_late']:.4f}")


# --------------------------------------------------------------------------------------------------
# 6. Export (published Qwen3.5 layout) and reload check
# --------------------------------------------------------------------------------------------------

TEXT_CONFIG_KEYS = [
    "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim", "hidden_act",
    "hidden_size", "initializer_range", "intermediate_size", "layer_types", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim",
    "max_position_embeddings", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
    "pad_token_id", "rms_norm_eps", "tie_word_embeddings", "use_cache", "vocab_size",
]

MTP_NAMES = {
    "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
    "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_proj.weight",
    "mtp.layers.0.self_attn.v_proj.weight", "mtp.layers.0.self_attn.o_proj.weight",
    "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight",
    "mtp.layers.0.mlp.gate_proj.weight", "mtp.layers.0.mlp.up_proj.weight", "mtp.layers.0.mlp.down_proj.weight",
}

TEXT_PREFIX = "model.language_model."


def keep_fp32(name: str) -> bool:
    return name.endswith("linear_attn.A_log") or name.endswith("linear_attn.dt_bias")


def config_json(cfg, rope: dict) -> dict:
    text = {k: getattr(cfg, k) for k in TEXT_CONFIG_KEYS}
    text["layer_types"] = list(text["layer_types"])
    text["model_type"] = "qwen3_5_text"
    text["partial_rotary_factor"] = rope["partial_rotary_factor"]
    text["rope_parameters"] = dict(rope)
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    text["dtype"] = "bfloat16"
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "transformers_version": transformers.__version__,
    }


def export_tensors(model, mtp) -> dict:
    sd = model.state_dict()
    emb = sd.get("model.embed_tokens.weight")
    check(emb is not None, "state dict has no model.embed_tokens.weight")
    lm = sd.get("lm_head.weight")
    if lm is not None:
        check(lm.data_ptr() == emb.data_ptr(), "lm_head.weight does not share storage with embed_tokens")
    out = {}
    for k, v in sd.items():
        if k == "lm_head.weight":
            continue
        check(k.startswith("model."), f"unexpected text state-dict key {k}")
        out[TEXT_PREFIX + k[len("model."):]] = v
    for k, v in mtp.state_dict().items():
        out["mtp." + k] = v
    got_mtp = {k for k in out if k.startswith("mtp.")}
    check(got_mtp == MTP_NAMES, f"MTP names differ from the published ones: extra {sorted(got_mtp - MTP_NAMES)}, "
          f"missing {sorted(MTP_NAMES - got_mtp)}")
    tensors = {}
    for k, v in out.items():
        check(v.is_floating_point(), f"{k} is not a floating tensor ({v.dtype})")
        dt = torch.float32 if keep_fp32(k) else torch.bfloat16
        tensors[k] = v.detach().to(device="cpu", dtype=dt).contiguous()
    n_alog = sum(1 for k in tensors if k.endswith("linear_attn.A_log"))
    n_dtb = sum(1 for k in tensors if k.endswith("linear_attn.dt_bias"))
    n_lin = LAYER_TYPES.count(LIN)
    check(n_alog == n_lin and n_dtb == n_lin, f"found {n_alog} A_log / {n_dtb} dt_bias, expected {n_lin} each")
    for must in ("model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
                 "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
                 "model.language_model.layers.0.linear_attn.norm.weight",
                 "model.language_model.layers.0.linear_attn.conv1d.weight",
                 "model.language_model.layers.3.self_attn.q_proj.weight",
                 "model.language_model.layers.3.self_attn.q_norm.weight"):
        check(must in tensors, f"expected tensor {must} is missing from the export")
    return tensors


def reload_into_fresh(path: Path, cfg, vocab_size: int, eos_id: int, attn_impl: str, device, model, mtp):
    disk = load_file(str(path))
    for k, v in disk.items():
        want = torch.float32 if keep_fp32(k) else torch.bfloat16
        check(v.dtype == want, f"{k} is {v.dtype} on disk, expected {want}")
        check(k.startswith(TEXT_PREFIX) or k.startswith("mtp."), f"unexpected tensor name on disk: {k}")
    check("lm_head.weight" not in disk, "lm_head.weight must not be on disk (tied)")
    _, model2, mtp2, _ = build_models(vocab_size, eos_id, attn_impl, device)
    text_sd = {"model." + k[len(TEXT_PREFIX):]: v.float() for k, v in disk.items() if k.startswith(TEXT_PREFIX)}
    mtp_sd = {k[len("mtp."):]: v.float() for k, v in disk.items() if k.startswith("mtp.")}
    res = model2.load_state_dict(text_sd, strict=False)
    check(set(res.missing_keys) <= {"lm_head.weight"} and not res.unexpected_keys,
          f"reload: missing {res.missing_keys}, unexpected {res.unexpected_keys}")
    check(model2.lm_head.weight.data_ptr() == model2.model.embed_tokens.weight.data_ptr(),
          "reloaded model lost the embedding tie")
    mtp2.load_state_dict(mtp_sd, strict=True)
    # Every reloaded weight must equal the trained fp32 weight rounded to the stored dtype.
    trained = {**{TEXT_PREFIX + k[len("model."):]: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
               **{"mtp." + k: v for k, v in mtp.state_dict().items()}}
    reloaded = {**{TEXT_PREFIX + k[len("model."):]: v for k, v in model2.state_dict().items() if k != "lm_head.weight"},
                **{"mtp." + k: v for k, v in mtp2.state_dict().items()}}
    check(set(trained) == set(reloaded) == set(disk), "name sets of trained / reloaded / disk differ")
    for k in disk:
        want = trained[k].to(disk[k].dtype).float()
        check(torch.equal(reloaded[k].float(), want), f"reloaded {k} differs from the trained weights")
    print(f"  reload: {len(disk)} tensors; all equal the trained weights rounded to their stored dtype")
    return model2, mtp2


def oracle_check(out: Path, model2, mtp2, window: torch.Tensor, tok) -> dict:
    """Non-fatal: does transformers itself load the exported directory (as the engine's oracle will)?"""
    res = {}
    try:
        from transformers import AutoConfig, Qwen3_5ForConditionalGeneration
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
        conf = AutoConfig.from_pretrained(str(out))
        tc = conf.text_config
        print(f"  AutoConfig: {type(conf).__name__} model_type {conf.model_type}; text {type(tc).__name__} "
              f"layer_types {tc.layer_types}, rope {tc.rope_parameters}, mtp_num_hidden_layers "
              f"{getattr(tc, 'mtp_num_hidden_layers', None)}, tie {conf.tie_word_embeddings}")
        # No vision tower is shipped: give the loader a tiny one (random, unused) instead of the
        # default full-size tower, to keep this check fast.
        conf.vision_config = Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 patch_size=4, out_hidden_size=tc.hidden_size,
                                                 num_position_embeddings=16)
        hf, info = Qwen3_5ForConditionalGeneration.from_pretrained(
            str(out), config=conf, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        missing = [k for k in info.get("missing_keys", []) if not k.startswith("model.visual.")]
        unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith("mtp.")]
        print(f"  from_pretrained: missing (non-visual) {missing[:8]}, unexpected (non-mtp) {unexpected[:8]}")
        hf.to(window.device).eval()
        x = window[:1, :-1]
        with torch.no_grad():
            ref = hf(input_ids=x, use_cache=False).logits.float()
            mine = model2(input_ids=x, use_cache=False).logits.float()
        d = (ref - mine).abs().max().item()
        same_greedy = bool(torch.equal(ref.argmax(-1), mine.argmax(-1)))
        print(f"  transformers Qwen3_5ForConditionalGeneration vs our reloaded model: max |dlogit| {d:.2e}, "
              f"same greedy tokens {same_greedy}")
        res.update(from_pretrained_max_abs_logit_diff=d, same_greedy=same_greedy,
                   missing_non_visual=missing, unexpected_non_mtp=unexpected)
        if d > 1e-3 or missing or unexpected:
            print("  WARNING: transformers does not load the export exactly as trained (see above)")
        del hf
    except Exception as exc:  # noqa: BLE001
        print(f"  WARNING: transformers could not load the exported model: {exc!r}")
        res["model_error"] = repr(exc)
    try:
        from transformers import AutoTokenizer
        ht = AutoTokenizer.from_pretrained(str(out))
        sample = "def f(x):\n    \"\"\"Return x + 1.\"\"\"\n    return x + 1  # café\n"
        a = ht(sample, add_special_tokens=False)["input_ids"]
        b = tok.encode(sample, add_special_tokens=False).ids
        chat = ht.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                      tokenize=False)
        want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        print(f"  AutoTokenizer {type(ht).__name__}: same ids as tokenizers {a == b}; eos {ht.eos_token!r} "
              f"pad {ht.pad_token!r}; chat template ok {chat == want}")
        res.update(autotokenizer_class=type(ht).__name__, autotokenizer_same_ids=a == b,
                   chat_template_ok=chat == want)
        if a != b or chat != want:
            print(f"  WARNING: AutoTokenizer mismatch: {a[:20]} vs {b[:20]}; chat {chat!r}")
    except Exception as exc:  # noqa: BLE001
        print(f"  WARNING: AutoTokenizer could not load the exported tokenizer: {exc!r}")
        res["tokenizer_error"] = repr(exc)
    return res


def pick_sample_file(held: list[dict]) -> dict:
    cands = [f for f in held if 2000 <= f["bytes"] < 8000 and "\ndef " in f["text"]]
    if not cands:
        cands = [f for f in held if f["bytes"] < 8000]
    check(bool(cands), "no held-out file under 8 KB for heldout_sample.py")
    return cands[0]


def make_prompts(held: list[dict], want: int = 8) -> list[dict]:
    """Function signature + docstring prompts from held-out files (one per file first, then more)."""
    per_file = []
    for f in held:
        try:
            tree = ast.parse(f["text"])
        except SyntaxError:
            continue
        lines = f["text"].splitlines()
        found = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if not node.body or ast.get_docstring(node) is None or node.name.startswith("__"):
                continue
            doc = node.body[0]
            if len(node.body) < 2:
                continue
            text = textwrap.dedent("\n".join(lines[node.lineno - 1:doc.end_lineno])) + "\n"
            if not (60 <= len(text) <= 700):
                continue
            found.append({"source": f["rel"], "function": node.name, "lineno": node.lineno, "prompt": text})
        found.sort(key=lambda r: r["lineno"])
        if found:
            per_file.append(found)
    out, rnd = [], 0
    while len(out) < want and any(len(fs) > rnd for fs in per_file):
        for fs in per_file:
            if len(fs) > rnd and len(out) < want:
                out.append(fs[rnd])
        rnd += 1
    for i, r in enumerate(out):
        r["id"] = f"heldout-{i}"
    return out


def versions() -> dict:
    v = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
             tokenizers=tokenizers.__version__, safetensors=getattr(safetensors, "__version__", "?"))
    try:
        import numpy
        v["numpy"] = numpy.__version__
    except Exception:  # noqa: BLE001
        pass
    v["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
    return v


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget of the training loop")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps-max", type=int, default=0, help="stop after this many steps (0: time budget only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-tokens", type=int, default=200_000, help="cap on held-out tokens evaluated")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--val-every", type=int, default=250, help="held-out slice loss every N steps (0: off)")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    args = ap.parse_args()

    t_start = time.time()
    device = torch.device(args.device)
    out: Path = args.out.resolve()
    vers = versions()
    print(f"versions: {vers}")
    print(f"device {device}; out {out}")
    torch.manual_seed(args.seed)

    banner("1. corpus")
    corpus = collect_corpus()
    train_files, held_files = corpus["train"], corpus["heldout"]

    banner("2. tokenizer")
    t = time.time()
    tok = train_tokenizer([f["text"] for f in train_files], args.vocab)
    tok_info = check_tokenizer(tok, args.vocab, [f["text"] for f in held_files[:20]])
    eot = tok.token_to_id("<|endoftext|>")
    train_stream, train_counts = encode_files(tok, train_files, eot)
    held_stream, held_counts = encode_files(tok, held_files, eot)
    print(f"  train {len(train_stream):,} tokens ({sum(f['bytes'] for f in train_files) / len(train_stream):.2f} "
          f"bytes/token), held-out {len(held_stream):,} tokens; {time.time() - t:.1f}s")

    banner("3. model")
    cfg, model, mtp, n_params = build_models(args.vocab, eot, args.attn, device)
    self_test(model, mtp, device, args.vocab, use_autocast=False)
    if device.type == "cuda":
        self_test(model, mtp, device, args.vocab, use_autocast=True)
    rope = dict(model.config.rope_parameters)

    banner("4. training")
    train_ids = torch.tensor(train_stream, dtype=torch.long, device=device)
    held_ids = torch.tensor(held_stream, dtype=torch.long, device=device)
    all_held_windows = eval_windows(held_ids, args.seq, args.eval_tokens)
    val_windows = all_held_windows[:8]
    torch.manual_seed(args.seed)
    tr = train(model, mtp, train_ids, val_windows, args, device)

    banner("5. held-out evaluation (trained fp32 master weights)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ev_master = evaluate(model, mtp, all_held_windows)
    print_eval("master fp32", ev_master)
    ev_master_bf16 = None
    if device.type == "cuda":
        ev_master_bf16 = evaluate(model, mtp, all_held_windows, use_autocast=True)
        print_eval("master bf16 autocast", ev_master_bf16)

    banner("6. export")
    out.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(model, mtp)
    st_path = out / "model.safetensors"
    save_file(tensors, str(st_path), metadata={"format": "pt"})
    size = st_path.stat().st_size
    print(f"  wrote {st_path} ({size / 1e6:.2f} MB, {len(tensors)} tensors)")
    check(size < 40 * 1000 * 1000, f"model.safetensors is {size} bytes (>= 40 MB)")
    cfg_json = config_json(cfg, rope)
    write_json(out / "config.json", cfg_json)
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    })
    write_json(out / "generation_config.json", {
        "bos_token_id": None, "eos_token_id": eot, "pad_token_id": eot, "do_sample": False,
        "transformers_version": transformers.__version__,
    })
    sample = pick_sample_file(held_files)
    (out / "heldout_sample.py").write_bytes(sample["text"].encode("utf-8"))
    print(f"  heldout_sample.py <- {sample['rel']} ({sample['bytes']} bytes)")
    prompts = make_prompts(held_files)
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as fh:
        for r in prompts:
            fh.write(json.dumps({"id": r["id"], "source": r["source"], "function": r["function"],
                                 "lineno": r["lineno"], "prompt": r["prompt"]}, ensure_ascii=False) + "\n")
    print(f"  prompts.jsonl: {len(prompts)} prompts from {sorted({r['source'] for r in prompts})}")
    if len(prompts) < 8:
        print(f"  WARNING: only {len(prompts)} prompts found")

    banner("7. reload check")
    model2, mtp2 = reload_into_fresh(st_path, cfg, args.vocab, eot, args.attn, device, model, mtp)
    ev_reload = evaluate(model2, mtp2, all_held_windows)
    print_eval("reloaded bf16 weights, fp32 compute", ev_reload)
    slice_n = min(16, all_held_windows.shape[0])
    ev_slice_master = evaluate(model, mtp, all_held_windows[:slice_n])
    ev_slice_reload = evaluate(model2, mtp2, all_held_windows[:slice_n])
    print(f"  slice of {slice_n} windows: ppl master {ev_slice_master['ppl']:.4f} vs reloaded "
          f"{ev_slice_reload['ppl']:.4f}")
    check(abs(math.log(ev_slice_reload["ppl"]) - math.log(ev_slice_master["ppl"])) < 0.05,
          "reloaded checkpoint's perplexity differs from the trained model's by more than 5% "
          "(the saved file is not the trained model?)")
    ev_reload_bf16 = None
    if device.type == "cuda":
        ev_reload_bf16 = evaluate(model2, mtp2, all_held_windows, use_autocast=True)
        print_eval("reloaded, bf16 autocast", ev_reload_bf16)
    oracle = oracle_check(out, model2, mtp2, all_held_windows[:1, :129], tok)

    files_written = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    info = {
        "model": "tandem demo: Qwen3.5 architecture (hybrid Gated DeltaNet + gated full attention) with one "
                 "native MTP layer, trained by tools/train_demo_model.py",
        "config": {"text_config": cfg_json["text_config"], "attn_implementation_used": args.attn},
        "parameters": n_params,
        "safetensors_bytes": size,
        "data": {
            "source": f"CPython {platform.python_version()} standard library sources (*.py) as installed on the "
                      f"training machine at {corpus['root']} (license: PSF License Agreement)",
            "stdlib_root": corpus["root"],
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "max_file_bytes": MAX_FILE_BYTES,
            "skipped": corpus["skipped"],
            "heldout_rule": f"sha1(relative path) mod {HELDOUT_MOD} == 0 (whole files)",
            "document_separator": "<|endoftext|> after every file",
            "train": {"files": len(train_files), "bytes": sum(f["bytes"] for f in train_files),
                      "tokens": len(train_stream), "text_tokens": sum(train_counts)},
            "heldout": {"files": len(held_files), "bytes": sum(f["bytes"] for f in held_files),
                        "tokens": len(held_stream), "text_tokens": sum(held_counts),
                        "file_list": [f["rel"] for f in held_files]},
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": args.vocab, **tok_info,
                      "pattern": QWEN_PATTERN, "special_tokens": SPECIAL_TOKENS, "trained_on": "train split only"},
        "training": {
            "objective": f"CE(next token) + {args.mtp_weight} * CE(MTP row p -> token p+2); gradients of the MTP "
                         "loss flow into the trunk",
            "mtp_convention": "row p: fc(concat(norm_e(embed(x[p+1])), norm_h(h[p]))), h = final-normed "
                              "hidden (model.norm output), rotary position p, causal attention over rows, "
                              "mtp.norm, tied head; predicts x[p+2]",
            "optimizer": tr["optimizer"], "lr": args.lr, "betas": [0.9, 0.95], "weight_decay": args.weight_decay,
            "weight_decay_on": "parameters with ndim >= 2 (incl. the tied embedding and conv1d)",
            "schedule": f"linear warmup {args.warmup} steps, cosine to {args.min_lr_ratio} x peak over the "
                        f"wall-clock budget",
            "grad_clip": args.clip, "precision": "fp32 master weights, bf16 autocast" if device.type == "cuda"
            else "fp32", "seq_len": args.seq, "batch_requested": args.batch, "batch_final": tr["final_batch"],
            "oom_events": tr["oom_events"], "minutes_budget": args.minutes, "steps_max": args.steps_max,
            "steps": tr["steps"], "tokens_seen": tr["tokens_seen"], "epochs": tr["epochs"],
            "wall_time_s": tr["wall_time_s"], "final_train_loss": tr["final_train_loss"],
            "final_train_mtp_loss": tr["final_train_mtp_loss"], "seed": args.seed,
            "window_sampling": "uniform random contiguous windows of seq+1 tokens from the concatenated train "
                               "stream (torch.Generator seeded with --seed)",
            "history": tr["history"], "heldout_slice_history": tr["heldout_slice_history"],
        },
        "heldout_eval": {
            "definition": "teacher-forced over non-overlapping windows of seq tokens (+1 label token) of the "
                          "held-out stream; agree = argmax(MTP row p) == argmax(target logits at p+1), i.e. "
                          "the depth-1 acceptance at T=0",
            "shipped_weights_fp32": ev_reload,
            "shipped_weights_bf16_autocast": ev_reload_bf16,
            "trained_master_fp32": ev_master,
            "trained_master_bf16_autocast": ev_master_bf16,
        },
        "export_checks": {"reload_equal_to_trained_rounded": True, "slice_ppl_master": ev_slice_master["ppl"],
                          "slice_ppl_reloaded": ev_slice_reload["ppl"], "transformers_oracle": oracle},
        "heldout_sample": {"source": sample["rel"], "bytes": sample["bytes"]},
        "prompts": len(prompts),
        "files": files_written,
        "versions": vers,
        "total_script_time_s": time.time() - t_start,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }
    write_json(out / "training.json", info)

    banner("summary")
    print(f"  output: {out}")
    for name, sz in files_written.items():
        print(f"    {name:24s} {sz:>12,} bytes")
    print(f"  params {n_params['total']:,} (trunk {n_params['trunk']:,} + MTP {n_params['mtp']:,})")
    print(f"  data: {len(train_files)} train files / {len(train_stream):,} tokens; {len(held_files)} held-out "
          f"files / {len(held_stream):,} tokens; Python {platform.python_version()}")
    print(f"  training: {tr['steps']} steps, {tr['tokens_seen']:,} tokens ({tr['epochs']:.2f} epochs), "
          f"{tr['wall_time_s']:.0f}s; final train loss {tr['final_train_loss']:.4f} / MTP "
          f"{tr['final_train_mtp_loss']:.4f}")
    print_eval("SHIPPED weights, fp32", ev_reload)
    if ev_reload_bf16:
        print_eval("SHIPPED weights, bf16", ev_reload_bf16)
    print(f"  total time {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
