#!/usr/bin/env python3
"""The EAGLE-3 draft head in PyTorch, in the published layout tandem's projected-context drafter reads.
Shared by tools/train_eagle3_head.py (trains one for the demo model) and tools/make_eagle3_fixture.py
(the oracle of tandem's C++ drafter). Needs only torch (+ safetensors to load or save):

    python3 tools/eagle3_head.py --self-test      # tiny random heads on the CPU, a few seconds

Layout (a directory; what SafeAILab EAGLE-3, SpecForge, vLLM and SGLang read):

  config.json        architectures [LlamaForCausalLMEagle3] (Eagle3LlamaForCausalLM accepted), llama fields
                     hidden_size H, intermediate_size I, num_attention_heads, num_key_value_heads, head_dim
                     (default H / heads), rms_norm_eps, rope_theta (default 10000), rope_scaling (null only),
                     max_position_embeddings, vocab_size V (the target's), draft_vocab_size Vd (default V),
                     num_hidden_layers (1), hidden_act (silu), target_hidden_size Ht (default H),
                     eagle_config.eagle_aux_hidden_state_layer_ids (the tapped target layers, in order;
                     default [2, L/2, L-3] for an L-layer target)
  model.safetensors  fc.weight [H, n_taps*Ht]; midlayer.input_layernorm.weight [H] (on the embedding);
                     midlayer.hidden_norm.weight [H] (on the hidden); midlayer.self_attn.{q,k,v}_proj.weight
                     [heads*hd | kv*hd, 2H], o_proj.weight [H, heads*hd]; midlayer.post_attention_layernorm
                     .weight [H]; midlayer.mlp.{gate,up}_proj.weight [I, H], down_proj.weight [H, I];
                     norm.weight [H]; lm_head.weight [Vd, H]; d2t int64 [Vd] (target id = draft id +
                     d2t[draft id]); t2d bool [V] (true exactly for the draft vocabulary's target ids);
                     optional embed_tokens.weight [V, H] (else the target's embedding). Weights bf16 (fp16 and
                     fp32 are read too). No biases.

Arithmetic (the contract the C++ drafter follows). RMSNorm is Llama's: y = x * rsqrt(mean(x^2) + eps) * w.
Rotary is Llama's default: rotate_half, the full head_dim, inv_freq_i = theta^(-2i/hd), angles computed
in float64 here. A tap at layer i is the residual stream entering target decoder layer i
(transformers' output_hidden_states entry i; entry 0 is the embedding output). One row at position p
from token t and hidden g [H]:

    g   = fc(concat(taps of layers i0, i1, ... at p))       context rows and chain step 0
    g   = out of the previous chain step                    chain steps j >= 1 (no fc)
    a   = concat(input_layernorm(embed(t)), hidden_norm(g))  [2H], embedding first
    q, k, v = q_proj(a), k_proj(a), v_proj(a); rotary at p on q and k; causal attention over the head's
              own rows at positions <= p (GQA: query head h reads kv head h // (heads / kv_heads);
              scale 1/sqrt(hd))
    r   = g + o_proj(attention)
    out = r + down(silu(gate(n)) * up(n)),   n = post_attention_layernorm(r)
    logits = lm_head(norm(out))  over the Vd draft ids; a proposal is d2t-mapped to a target id.

Row convention (as tandem's MTP drafters): the row at position p is built from (x_{p+1}, taps of x_p)
and predicts x_{p+2}. A chain from pending x_{P+1} with the taps of x_P: step 0 is row P -> d_0;
step j is row P+j from (d_{j-1}, out_{j-1}) -> d_j, attending every row before it.

Training-time test (ttt_forward, EAGLE-3's TTT unrolled exactly as inference runs): step 0 builds every
row p from (x_{p+1}, fc(taps_p)) in one causal pass; step j builds, for every anchor row p, the row at
position p+j from (x_{p+j+1}, out_{j-1} of anchor p); it attends to the step-0 rows at positions <= p
and to its own anchor's rows of steps 1..j (the diagonal of each step's keys). Given d_0..d_{j-1} =
x_{p+2}..x_{p+j+1} (all accepted), step j of anchor p is exactly the chain's step j from row p.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    tap_layers: list = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    has_embed_tokens: bool = False

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd (rotary needs pairs)")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} not in [1, vocab_size {self.vocab_size}]")
        if not self.tap_layers:
            raise ValueError("no tap layers")

    def to_json(self) -> dict:
        """config.json in the published form."""
        return {
            "architectures": [ARCHITECTURES[0]],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.tap_layers),
                             "use_aux_hidden_state": True},
        }

    @classmethod
    def from_json(cls, d: dict, target_layers: int | None = None, where: str = "config.json") -> "Eagle3Config":
        """Reads a published config.json dict with the contract's defaults; refuses what it cannot run."""
        arch = d.get("architectures") or []
        if not any(a in ARCHITECTURES for a in arch):
            raise ValueError(f"{where}: architectures {arch} names no EAGLE-3 head ({' or '.join(ARCHITECTURES)})")

        def need(key):
            if key not in d or d[key] is None:
                raise ValueError(f"{where}: missing {key!r}")
            return d[key]

        h, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"{where}: num_hidden_layers {d['num_hidden_layers']} (an EAGLE-3 head has 1)")
        if d.get("rope_scaling") is not None:
            raise ValueError(f"{where}: rope_scaling {d['rope_scaling']!r} is not supported (absent or null only)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r} (only silu)")
        vocab = int(need("vocab_size"))
        taps = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if taps is None:
            if target_layers is None:
                raise ValueError(f"{where}: no eagle_config.eagle_aux_hidden_state_layer_ids and no target "
                                 "layer count to default from")
            taps = [2, target_layers // 2, target_layers - 3]
        taps = [int(t) for t in taps]
        if target_layers is not None:
            bad = [t for t in taps if not 0 <= t < target_layers]
            if bad:
                raise ValueError(f"{where}: tap layers {bad} out of range for a {target_layers}-layer target")
        cfg = cls(
            hidden_size=h,
            intermediate_size=int(need("intermediate_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or h // heads),
            vocab_size=vocab,
            draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
            target_hidden_size=int(d.get("target_hidden_size") or h),
            tap_layers=taps,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta") or 10000.0),
            max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
        )
        cfg.validate()
        return cfg


def expected_shapes(cfg: Eagle3Config) -> dict:
    """Every tensor of the published layout (without the optional embed_tokens.weight) and its shape."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qd, kvd = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    m = "midlayer."
    return {
        "fc.weight": (h, len(cfg.tap_layers) * cfg.target_hidden_size),
        m + "input_layernorm.weight": (h,),
        m + "hidden_norm.weight": (h,),
        m + "self_attn.q_proj.weight": (qd, 2 * h),
        m + "self_attn.k_proj.weight": (kvd, 2 * h),
        m + "self_attn.v_proj.weight": (kvd, 2 * h),
        m + "self_attn.o_proj.weight": (h, qd),
        m + "post_attention_layernorm.weight": (h,),
        m + "mlp.gate_proj.weight": (i, h),
        m + "mlp.up_proj.weight": (i, h),
        m + "mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------

class LlamaRMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * w, computed in fp32 (weight w, not Qwen3.5's 1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Midlayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin [*positions.shape, head_dim] float32 (halves repeated: rotate_half layout); the angles
    p * theta^(-2i/hd) are formed in float64 so that positions in the thousands keep full precision."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    inv_freq = torch.pow(torch.tensor(float(theta), dtype=torch.float64, device=positions.device), -exponent)
    ang = positions.to(torch.float64)[..., None] * inv_freq
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, n, hd]; cos/sin [n, hd] (shared by the batch) or [B, n, hd]."""
    if cos.dim() == 2:
        cos, sin = cos[None, None], sin[None, None]
    else:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, kv, n, hd] -> [B, heads, n, hd]; query head h reads kv head h // (heads / kv)."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float):
    """q [B, heads, n, hd], k/v [B, kv, m, hd], allowed bool [n, m] (True = may attend). Scores and
    softmax in fp32. Returns [B, heads, n, hd]."""
    heads = q.shape[1]
    k, v = expand_kv(k, heads), expand_kv(v, heads)
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p.to(v.dtype), v)


def ttt_attention(q: torch.Tensor, ks: list, vs: list, scale: float) -> torch.Tensor:
    """Attention of TTT step j = len(ks) - 1 for every anchor p at once. q [B, heads, N, hd] (query of
    anchor p in row p); ks[0]/vs[0] the step-0 rows (anchor q's row at position q), ks[i]/vs[i] (i >= 1)
    step i's rows. Anchor p attends to step-0 rows q <= p (causal block) and to its own row of every
    step 1..j (the diagonal of those blocks): one softmax over N + j scores."""
    heads, n = q.shape[1], q.shape[2]
    k0, v0 = expand_kv(ks[0], heads), expand_kv(vs[0], heads)
    s0 = torch.matmul(q, k0.transpose(-1, -2)).float() * scale
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [((q * expand_kv(k, heads)).sum(-1).float() * scale)[..., None] for k in ks[1:]]
    p = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)
    out = torch.matmul(p[..., :n].to(v0.dtype), v0)
    for i, v in enumerate(vs[1:]):
        out = out + p[..., n + i, None].to(v.dtype) * expand_kv(v, heads)
    return out


# --------------------------------------------------------------------------------------------------
# The head
# --------------------------------------------------------------------------------------------------

class Eagle3Head(nn.Module):
    """Parameters and buffers carry the published names (state_dict() is the layout). The target's
    embedding, used when the head has no embed_tokens, is a non-persistent buffer (never saved):
    attach it with attach_target_embedding()."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.tap_layers) * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Midlayer(cfg)
        self.norm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if cfg.has_embed_tokens else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("target_embed", torch.zeros(0), persistent=False)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    # ---- vocabulary ----------------------------------------------------------------------------

    @torch.no_grad()
    def set_draft_vocab(self, target_ids) -> None:
        """target_ids: the Vd target ids of the draft vocabulary; draft id i is the i-th smallest."""
        ids = torch.as_tensor(target_ids, dtype=torch.int64).flatten().sort().values.to(self.d2t.device)
        if ids.numel() != self.cfg.draft_vocab_size:
            raise ValueError(f"draft vocabulary has {ids.numel()} ids, draft_vocab_size is {self.cfg.draft_vocab_size}")
        if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"draft vocabulary ids must be distinct and in [0, {self.cfg.vocab_size})")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor:
        """[Vd] the target id of every draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target(self, draft_idx: torch.Tensor) -> torch.Tensor:
        return draft_idx + self.d2t[draft_idx]

    # ---- the row computation ---------------------------------------------------------------------

    @torch.no_grad()
    def attach_target_embedding(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(f"target embedding is {tuple(weight.shape)}, the head needs "
                             f"({self.cfg.vocab_size}, {self.cfg.hidden_size}) (vocab_size, hidden_size)")
        self.target_embed = weight.detach().to(self.fc.weight.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        if self.target_embed.numel() == 0:
            raise RuntimeError("the head has no embed_tokens and no target embedding attached")
        return F.embedding(ids, self.target_embed)

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """fc over concatenated taps [..., n_taps*Ht] -> g [..., H] (fp32)."""
        return self.fc(taps).float()

    def qkv(self, ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor):
        """Rows from tokens ids [B, n] and hiddens g [B, n, H] at positions ([n] or [B, n]).
        Returns q [B, heads, n, hd], k, v [B, kv, n, hd] (rotary applied to q and k)."""
        m, c = self.midlayer, self.cfg
        a = torch.cat([m.input_layernorm(self.embed(ids)).float(), m.hidden_norm(g).float()], dim=-1)
        b, n = ids.shape
        q = m.self_attn.q_proj(a).view(b, n, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = m.self_attn.k_proj(a).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = m.self_attn.v_proj(a).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(positions, c.head_dim, c.rope_theta)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """out = r + mlp(post_attention_layernorm(r)), r = g + o_proj(attn); attn [B, heads, n, hd]."""
        m = self.midlayer
        b, heads, n, hd = attn.shape
        r = g + m.self_attn.o_proj(attn.transpose(1, 2).reshape(b, n, heads * hd)).float()
        return r + m.mlp(m.post_attention_layernorm(r)).float()

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] = lm_head(norm(out))."""
        return self.lm_head(self.norm(out))

    def rows(self, ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, past=None):
        """New rows (ids [B, n], g [B, n, H], positions [n]) after `past` = (k, v) [B, kv, m, hd] of
        earlier rows: each new row attends to every past row and to the new rows up to itself.
        Returns (out [B, n, H], (k, v) of past + new rows)."""
        q, k, v = self.qkv(ids, g, positions)
        m = 0
        if past is not None:
            m = past[0].shape[2]
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        n = ids.shape[1]
        col = torch.arange(m + n, device=ids.device)
        allowed = (col[None, :] < m) | (col[None, :] - m <= torch.arange(n, device=ids.device)[:, None])
        return self.finish(g, attention(q, k, v, allowed, self.scale)), (k, v)

    def context_forward(self, next_ids: torch.Tensor, taps: torch.Tensor, start: int = 0, past=None):
        """Context rows p = start..start+n-1 in one causal pass: row p from (next_ids[:, p-start] =
        x_{p+1}, taps[:, p-start] = taps of x_p). Returns (out [B, n, H], (k, v))."""
        n = next_ids.shape[1]
        pos = torch.arange(start, start + n, device=next_ids.device)
        return self.rows(next_ids, self.project(taps), pos, past)

    def draft_chain(self, past, pending: torch.Tensor, tap_row: torch.Tensor, position: int, depth: int):
        """Greedy chain from row `position` = (pending [B], fc(tap_row [B, n_taps*Ht])) after the context
        rows in `past` (positions 0..position-1). Step j >= 1 is row position+j from (d_{j-1}, out_{j-1}).
        Returns (target ids [B, depth], draft logits [B, depth, Vd], out [B, depth, H]); argmax ties go
        to the lowest draft id."""
        tok, g = pending[:, None], self.project(tap_row[:, None])
        tokens, logits, hidden = [], [], []
        for j in range(depth):
            pos = torch.tensor([position + j], device=pending.device)
            out, past = self.rows(tok, g, pos, past)
            lg = self.logits(out)[:, 0]
            d = self.to_target(lg.argmax(-1))
            tokens.append(d)
            logits.append(lg)
            hidden.append(out[:, 0])
            tok, g = d[:, None], out
        return torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(hidden, 1)

    def ttt_forward(self, tokens: torch.Tensor, taps: torch.Tensor, steps: int) -> list:
        """EAGLE-3 training-time test over tokens [B, T] = x_0..x_{T-1} with taps [B, T, n_taps*Ht] (taps
        of x_p at p). Returns `steps` tensors out_j [B, N, H], N = T-1: out_j[:, p] is chain step j of
        anchor row p (position p+j, token x_{p+j+1}); valid for p <= N-1-j (the rest read a clamped token
        and must be masked by the caller)."""
        b, t = tokens.shape
        n = t - 1
        base = torch.arange(n, device=tokens.device)
        g = self.project(taps[:, :-1])
        ks, vs, outs = [], [], []
        for j in range(steps):
            ids = tokens[:, (base + j + 1).clamp(max=t - 1)]
            q, k, v = self.qkv(ids, g, base + j)
            ks.append(k)
            vs.append(v)
            out = self.finish(g, ttt_attention(q, ks, vs, self.scale))
            outs.append(out)
            g = out
        return outs

    # ---- initialisation --------------------------------------------------------------------------

    @torch.no_grad()
    def init_random(self, gen: torch.Generator, std: float | None = None, norm_jitter: float = 0.0) -> None:
        """Matrices ~ N(0, std^2) (default 1/sqrt(fan_in)); norm weights 1 + norm_jitter * N(0, 1)."""
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                s = std if std is not None else 1.0 / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) * s)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + norm_jitter * torch.randn(p.shape, generator=gen))
            else:
                raise ValueError(f"no init rule for {name} {tuple(p.shape)}")


# --------------------------------------------------------------------------------------------------
# Published layout: save / load
# --------------------------------------------------------------------------------------------------

def layout_tensors(head: Eagle3Head, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The head's tensors under their published names, weights in `dtype`, d2t int64, t2d bool (CPU)."""
    out = {}
    for k, v in head.state_dict().items():
        if k in ("d2t", "t2d"):
            out[k] = v.detach().cpu().contiguous()
        else:
            out[k] = v.detach().to(device="cpu", dtype=dtype).contiguous()
    check_layout(out, head.cfg, "in-memory head")
    return out


def check_layout(tensors: dict, cfg: Eagle3Config, where: str) -> None:
    """Raises ValueError unless the names, shapes, dtypes and vocabulary maps are the published layout's."""
    want = expected_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    optional = {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    extra = sorted(k for k in got if k not in want and k not in optional)
    missing = sorted(k for k in want if k not in got)
    if extra or missing:
        raise ValueError(f"{where}: tensors differ from the EAGLE-3 layout: missing {missing}, unexpected {extra}")
    for k, shape in {**want, **optional}.items():
        if k in got and got[k] != tuple(shape):
            raise ValueError(f"{where}: tensor {k} has shape {list(got[k])}, expected {list(shape)}")
    for k, v in tensors.items():
        if k == "d2t" and v.dtype != torch.int64:
            raise ValueError(f"{where}: d2t is {v.dtype}, expected int64")
        elif k == "t2d" and v.dtype != torch.bool:
            raise ValueError(f"{where}: t2d is {v.dtype}, expected bool")
        elif k not in ("d2t", "t2d") and v.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"{where}: tensor {k} is {v.dtype}, expected bfloat16, float16 or float32")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    ids = torch.arange(d2t.numel()) + d2t.cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ValueError(f"{where}: d2t maps draft ids to target ids outside [0, {cfg.vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{where}: d2t maps two draft ids to the same target id")
    mask = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    mask[ids] = True
    if not torch.equal(mask, t2d.cpu()):
        raise ValueError(f"{where}: t2d ({int(t2d.sum())} ids set) disagrees with d2t ({ids.numel()} target ids)")
    if "embed_tokens.weight" not in tensors and cfg.has_embed_tokens:
        raise ValueError(f"{where}: config says embed_tokens but the file has no embed_tokens.weight")


def save_head(head: Eagle3Head, out_dir: Path, dtype: torch.dtype = torch.bfloat16,
              metadata: dict | None = None) -> dict:
    """Writes out_dir/config.json and out_dir/model.safetensors. Returns the tensors written."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = layout_tensors(head, dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    (out_dir / "config.json").write_text(json.dumps(head.cfg.to_json(), indent=2) + "\n", encoding="utf-8")
    return tensors


def load_head(path: Path, target_layers: int | None = None, device="cpu",
              dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Reads a head directory (config.json + model.safetensors); weights are converted to `dtype`
    (float32: exactly the stored values upcast). Raises ValueError naming the file and tensor on any
    layout error."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path, st_path = path / "config.json", path / "model.safetensors"
    for p in (cfg_path, st_path):
        if not p.is_file():
            raise ValueError(f"{path}: {p.name} is missing")
    cfg = Eagle3Config.from_json(json.loads(cfg_path.read_text(encoding="utf-8")), target_layers, str(cfg_path))
    tensors = load_file(str(st_path))
    cfg.has_embed_tokens = "embed_tokens.weight" in tensors
    check_layout(tensors, cfg, str(st_path))
    head = Eagle3Head(cfg)
    sd = {k: (v if k in ("d2t", "t2d") else v.to(dtype)) for k, v in tensors.items()}
    head.load_state_dict(sd, strict=True)
    return head.to(device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# Target taps
# --------------------------------------------------------------------------------------------------

_FALLBACK_WARNED = []


def _from_hidden_states(out, layers: list, n_layers: int):
    """The taps from a forward's output_hidden_states (entry i = the input of decoder layer i), or None
    when this transformers gave no such tuple."""
    hs = getattr(out, "hidden_states", None)
    if hs is None or len(hs) != n_layers + 1:
        if not _FALLBACK_WARNED:
            _FALLBACK_WARNED.append(True)
            print(f"  WARNING: output_hidden_states gave {None if hs is None else len(hs)} tensors, expected "
                  f"{n_layers + 1} (embedding + one per layer): taps are read by forward pre-hooks instead")
        return None
    return torch.cat([hs[i] for i in layers], dim=-1)


def _hooked_forward(text_model, ids: torch.Tensor, layers: list, output_hidden_states: bool):
    """One forward that records the input of each tapped decoder layer (forward pre-hooks)."""
    seen = {}

    def hook(i):
        def fn(_module, args, kwargs):
            seen[i] = args[0] if args else kwargs["hidden_states"]
        return fn

    handles = [text_model.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in set(layers)]
    try:
        out = text_model(input_ids=ids, use_cache=False, output_hidden_states=output_hidden_states)
    finally:
        for h in handles:
            h.remove()
    return torch.cat([seen[i] for i in layers], dim=-1), out


def _check_layers(text_model, layers: list) -> int:
    n_layers = len(text_model.layers)
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"tap layers {bad} out of range for a {n_layers}-layer target")
    return n_layers


def target_taps(text_model, ids: torch.Tensor, layers: list):
    """One forward of a transformers decoder-only text model (e.g. Qwen3_5TextModel = model.model) over
    ids [B, T] with output_hidden_states. Returns (taps [B, T, n_taps*H] = hidden_states[i] for i in
    layers, concatenated in that order; last_hidden_state [B, T, H])."""
    n_layers = _check_layers(text_model, layers)
    out = text_model(input_ids=ids, use_cache=False, output_hidden_states=True)
    taps = _from_hidden_states(out, layers, n_layers)
    if taps is None:
        taps, out = _hooked_forward(text_model, ids, layers, False)
    return taps, out.last_hidden_state


def taps_by_hooks(text_model, ids: torch.Tensor, layers: list):
    """For checking that output_hidden_states' entry i is the residual stream entering decoder layer i:
    one forward that reads both the inputs of the tapped layers (forward pre-hooks) and the
    output_hidden_states entries. Returns (taps from the hooks, taps from output_hidden_states), both
    [B, T, n_taps*H] (the second is the first when output_hidden_states gives nothing)."""
    n_layers = _check_layers(text_model, layers)
    hooked, out = _hooked_forward(text_model, ids, layers, True)
    taps = _from_hidden_states(out, layers, n_layers)
    return hooked, hooked if taps is None else taps


# --------------------------------------------------------------------------------------------------
# Self-test (tiny random heads, CPU)
# --------------------------------------------------------------------------------------------------

def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def tiny_config(embed: bool) -> Eagle3Config:
    return Eagle3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=50, draft_vocab_size=20, target_hidden_size=24,
                        tap_layers=[0, 2, 3], rms_norm_eps=1e-6, rope_theta=10000.0,
                        max_position_embeddings=64, has_embed_tokens=embed)


def tiny_head(embed: bool, seed: int) -> Eagle3Head:
    cfg = tiny_config(embed)
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(cfg)
    head.init_random(gen, norm_jitter=0.1)
    ids = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(cfg.vocab_size - 1, generator=gen)[:19] + 1])
    head.set_draft_vocab(ids)
    if not embed:
        head.attach_target_embedding(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen))
    return head.eval()


def self_test() -> None:
    tol = 2e-5
    for embed in (False, True):
        torch.manual_seed(0)
        head = tiny_head(embed, 11 + embed)
        cfg = head.cfg
        gen = torch.Generator().manual_seed(5)
        b, t, depth = 2, 12, 4
        tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
        taps = torch.randn(b, t, len(cfg.tap_layers) * cfg.target_hidden_size, generator=gen) * 2.0
        n = t - 1
        with torch.no_grad():
            # One causal pass over the context rows == rows appended one at a time.
            out_all, (k_all, v_all) = head.context_forward(tokens[:, 1:], taps[:, :-1])
            past, worst = None, 0.0
            for p in range(n):
                o, past = head.context_forward(tokens[:, p + 1:p + 2], taps[:, p:p + 1], start=p, past=past)
                worst = max(worst, _max_abs(o[:, 0], out_all[:, p]))
            assert worst <= tol, f"incremental rows differ from the one-pass forward by {worst}"
            assert _max_abs(past[0], k_all) <= tol and _max_abs(past[1], v_all) <= tol
            # Causality: changing x_c changes no row before c-1 (row c-1 reads x_c).
            c = 7
            tokens2 = tokens.clone()
            tokens2[:, c] = (tokens2[:, c] + 1) % cfg.vocab_size
            out2, _ = head.context_forward(tokens2[:, 1:], taps[:, :-1])
            assert _max_abs(out2[:, :c - 1], out_all[:, :c - 1]) == 0.0, "context rows are not causal"
            assert _max_abs(out2[:, c - 1], out_all[:, c - 1]) > 0.0, "row c-1 ignores its token"

            # TTT step j of anchor p == the chain from row p with tokens forced to x_{p+j+1}.
            outs = head.ttt_forward(tokens, taps, depth)
            assert _max_abs(outs[0], out_all) <= tol, "TTT step 0 differs from the context pass"
            worst_ttt = 0.0
            for p in range(n):
                past = None if p == 0 else (k_all[:, :, :p], v_all[:, :, :p])
                g = head.project(taps[:, p:p + 1])
                for j in range(depth):
                    if p + j > n - 1:
                        break
                    pos = torch.tensor([p + j])
                    o, past = head.rows(tokens[:, p + j + 1:p + j + 2], g, pos, past)
                    worst_ttt = max(worst_ttt, _max_abs(o[:, 0], outs[j][:, p]))
                    g = o
            assert worst_ttt <= tol, f"TTT differs from the forced chain by {worst_ttt}"

            # The greedy chain: step 0 is the context row; every step equals a full recompute.
            P = 8
            ctx = (k_all[:, :, :P], v_all[:, :, :P])
            toks, lg, hid = head.draft_chain(ctx, tokens[:, P + 1], taps[:, P], P, depth)
            assert _max_abs(hid[:, 0], out_all[:, P]) <= tol, "chain step 0 differs from context row P"
            assert bool(head.t2d[toks].all()), "a chain token is outside the draft vocabulary"
            ids_r = torch.cat([tokens[:, 1:P + 2], toks[:, :-1]], dim=1)
            g_r = torch.cat([head.project(taps[:, :P + 1]), hid[:, :-1]], dim=1)
            o_r, _ = head.rows(ids_r, g_r, torch.arange(P + depth))
            assert _max_abs(o_r[:, P:], hid) <= tol, "chain differs from a full recompute"
            assert _max_abs(head.logits(o_r[:, P:]), lg) <= 1e-4

            # TTT attention with one step is plain causal attention (the masks agree).
            q, k, v = head.qkv(tokens[:, 1:], head.project(taps[:, :-1]), torch.arange(n))
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            assert _max_abs(ttt_attention(q, [k], [v], head.scale), attention(q, k, v, causal, head.scale)) <= tol

        # Config round trip and defaults.
        j = cfg.to_json()
        back = Eagle3Config.from_json(j, target_layers=4)
        back.has_embed_tokens = cfg.has_embed_tokens
        assert back == cfg, f"config round trip: {back} != {cfg}"
        j2 = dict(j)
        j2.pop("eagle_config")
        j2.pop("head_dim")
        assert Eagle3Config.from_json(j2, target_layers=8).tap_layers == [2, 4, 5]
        assert Eagle3Config.from_json(j2, target_layers=8).head_dim == cfg.hidden_size // cfg.num_attention_heads
        for bad, word in (({"rope_scaling": {"type": "linear"}}, "rope_scaling"),
                          ({"num_hidden_layers": 2}, "num_hidden_layers"),
                          ({"architectures": ["LlamaForCausalLM"]}, "architectures")):
            try:
                Eagle3Config.from_json({**j, **bad}, target_layers=4)
                raise AssertionError(f"config with {bad} was accepted")
            except ValueError as exc:
                assert word in str(exc), exc
        try:
            Eagle3Config.from_json(j, target_layers=3)
            raise AssertionError("tap layer 3 accepted for a 3-layer target")
        except ValueError as exc:
            assert "out of range" in str(exc), exc

        # Layout checks.
        tensors = layout_tensors(head, torch.bfloat16)
        assert ("embed_tokens.weight" in tensors) == embed
        for mutate, word in ((lambda d: d.pop("d2t"), "d2t"),
                             (lambda d: d.__setitem__("t2d", ~d["t2d"]), "t2d"),
                             (lambda d: d.__setitem__("fc.weight", d["fc.weight"][:, 1:]), "fc.weight"),
                             (lambda d: d.__setitem__("d2t", d["d2t"].int()), "d2t")):
            bad = dict(tensors)
            mutate(bad)
            try:
                check_layout(bad, cfg, "test")
                raise AssertionError(f"layout error not caught ({word})")
            except ValueError as exc:
                assert word in str(exc), exc

        # Save / load round trip (needs safetensors).
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            print("  note: safetensors is not installed: save/load round trip skipped")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            save_head(head, Path(tmp))
            back = load_head(Path(tmp), target_layers=4)
            if not embed:
                back.attach_target_embedding(head.target_embed)
            for k, v in head.state_dict().items():
                want = v if k in ("d2t", "t2d") else v.to(torch.bfloat16).float()
                assert torch.equal(back.state_dict()[k], want), f"reloaded {k} differs"
            rounded = tiny_head(embed, 11 + embed)
            rounded.load_state_dict({k: (v if k in ("d2t", "t2d") else v.to(torch.bfloat16).float())
                                     for k, v in head.state_dict().items()})
            if not embed:
                rounded.attach_target_embedding(head.target_embed)
            with torch.no_grad():
                d = _max_abs(back.ttt_forward(tokens, taps, 2)[1], rounded.ttt_forward(tokens, taps, 2)[1])
            assert d == 0.0, f"reloaded head differs from the rounded in-memory head by {d}"
        print(f"  embed_tokens {embed}: one-pass vs incremental {worst:.1e}, TTT vs forced chain {worst_ttt:.1e}")
    print("eagle3_head self-test passed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--self-test", action="store_true", help="run the CPU self-test (tiny random heads)")
    args = ap.parse_args()
    if not args.self_test:
        ap.print_help()
        sys.exit(0)
    torch.set_num_threads(1)
    self_test()


if __name__ == "__main__":
    main()
