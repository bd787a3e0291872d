"""GLM-5's NextN (MTP) layer in PyTorch, built from transformers' glm_moe_dsa modules, and the checkpoint
layout tandem binds. Shared by tools/train_glm_demo_model.py and tools/make_glm_nextn_fixture.py.

The computation (DESIGN.md 5.4; src/tandem/spec/glm_mtp_block.h). For tokens x_0..x_{L-1} with the
target's FINAL-NORMED hidden states h_0..h_{L-1} (output of model.model.norm = last_hidden_state):

    row p, p = 0..L-2, at rotary position p:
      e_p      = enorm(embed(x_{p+1}))           embed = the target's embed_tokens (shared)
      g_p      = hnorm(h_p)
      z_p      = eh_proj(concat(e_p, g_p))       Linear 2H -> H, no bias, embedding half FIRST
      y        = decoder_layer(z)                ONE GlmMoeDsaDecoderLayer (MLA + MoE with a shared
                                                 expert), attending causally to EVERY earlier row: no
                                                 DSA (the layer is built with index_topk >= any
                                                 length, so its indexer keeps every position)
      out_p    = shared_head.norm(y_p)
      logits_p = lm_head(out_p)                  the target's head (shared); predicts x_{p+2}

enorm, hnorm and shared_head.norm are GlmMoeDsaRMSNorm with the config's rms_norm_eps: a plain weight
multiply (not zero-centred). The MLA's inner norms (q_a_layernorm, kv_a_layernorm) are transformers'
own (eps 1e-6), as for the target's layers.

Checkpoint names (written next to the target's, under model.layers.{num_hidden_layers}.), exactly
what tandem's GlmMtpBlock / bind_glm5_layer read (no indexer, no embed_tokens, no head):

    enorm.weight [H]   hnorm.weight [H]   eh_proj.weight [H, 2H]   shared_head.norm.weight [H]
    input_layernorm.weight [H]   post_attention_layernorm.weight [H]
    self_attn.q_a_proj.weight [q_lora, H]   self_attn.q_a_layernorm.weight [q_lora]
    self_attn.q_b_proj.weight [heads * (nope + rope), q_lora]
    self_attn.kv_a_proj_with_mqa.weight [kv_lora + rope, H]   self_attn.kv_a_layernorm.weight [kv_lora]
    self_attn.kv_b_proj.weight [heads * (nope + v), kv_lora]   self_attn.o_proj.weight [H, heads * v]
    mlp.gate.weight [E, H]   mlp.gate.e_score_correction_bias [E] (fp32)
    mlp.experts.gate_up_proj [E, 2 * I_moe, H]   mlp.experts.down_proj [E, H, I_moe]
    mlp.shared_experts.{gate_proj,up_proj}.weight [I_moe * n_shared, H]
    mlp.shared_experts.down_proj.weight [H, I_moe * n_shared]
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Keys of a config.json dict that are not GlmMoeDsaConfig constructor arguments (or that we keep out
# of the constructor on purpose: transformers does not build the NextN layer).
CONFIG_ONLY_KEYS = ("architectures", "model_type", "num_nextn_predict_layers", "dtype", "torch_dtype",
                    "transformers_version", "quantization_config")
# The indexer-schedule keys a NextN config must not inherit (its single layer always runs "full").
_SCHEDULE_KEYS = ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")
# index_topk for the NextN layer: at least this, and at least max_position_embeddings, so that its
# indexer keeps every position of any sequence (dense attention).
DENSE_TOPK_MIN = 4096
# Checkpoint tensors kept in fp32 (as published); everything else is bf16.
FP32_SUFFIXES = ("e_score_correction_bias",)
NEXTN_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
_INDEXER = "self_attn.indexer."


def glm_modules():
    """(GlmMoeDsaConfig, GlmMoeDsaForCausalLM, GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm) of the
    installed transformers; raises RuntimeError when it has no glm_moe_dsa."""
    import transformers
    try:
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mod
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"transformers {transformers.__version__} has no glm_moe_dsa "
                           f"(GlmMoeDsaConfig / GlmMoeDsaForCausalLM): {exc!r}") from exc
    missing = [n for n in ("GlmMoeDsaDecoderLayer", "GlmMoeDsaRMSNorm") if not hasattr(mod, n)]
    if missing:
        raise RuntimeError(f"transformers {transformers.__version__}: modeling_glm_moe_dsa lacks {missing}")
    return GlmMoeDsaConfig, GlmMoeDsaForCausalLM, mod.GlmMoeDsaDecoderLayer, mod.GlmMoeDsaRMSNorm


def make_config(cfg: dict, attn_impl: str = "eager"):
    """A GlmMoeDsaConfig from a config.json-style dict (CONFIG_ONLY_KEYS left out)."""
    Config = glm_modules()[0]
    c = Config(**{k: v for k, v in cfg.items() if k not in CONFIG_ONLY_KEYS}, attn_implementation=attn_impl)
    c._attn_implementation = attn_impl
    return c


def nextn_config_dict(target: dict) -> dict:
    """The config of the NextN layer as a one-layer model: the target's shape, its one layer a
    mixture ("sparse") that runs its indexer ("full") with index_topk large enough to keep every
    position, i.e. dense causal attention."""
    kw = {k: v for k, v in target.items() if k not in CONFIG_ONLY_KEYS and k not in _SCHEDULE_KEYS}
    kw.pop("first_k_dense_replace", None)
    kw["num_hidden_layers"] = 1
    kw["mlp_layer_types"] = ["sparse"]
    if "indexer_types" in target:
        kw["indexer_types"] = ["full"]
    kw["index_topk"] = max(DENSE_TOPK_MIN, int(target.get("max_position_embeddings", 0) or 0))
    return kw


_MASKS: dict = {}


def causal_mask(n: int, device, batch: int = 1) -> torch.Tensor:
    """[batch, 1, n, n] float32 additive mask: 0 on and below the diagonal, -inf above. transformers
    passes a 4D mask through unchanged (masking_utils: "If the mask is already 4D, simply return
    as-is"), to the attention and to the DSA indexer (which adds it to its scores)."""
    key = (n, str(device))
    if key not in _MASKS:
        m = torch.full((n, n), float("-inf"), dtype=torch.float32, device=device).triu(1)
        _MASKS[key] = m[None, None]
    return _MASKS[key].expand(batch, 1, n, n)


class GlmNextN(nn.Module):
    """GLM-5's NextN layer (see the module docstring). Parameters: enorm, hnorm, eh_proj,
    shared_head.norm and `layer` (a GlmMoeDsaDecoderLayer; its indexer is frozen, unused for the
    selection and never exported)."""

    def __init__(self, target_cfg: dict, attn_impl: str = "eager"):
        super().__init__()
        _, _, DecoderLayer, RMSNorm = glm_modules()
        self.cfg_dict = nextn_config_dict(target_cfg)
        self.config = make_config(self.cfg_dict, attn_impl)
        try:
            # A standalone layer's config names no experts backend; say eager (the reference loop)
            # rather than let transformers warn and fall back to it.
            self.config._experts_implementation = "eager"
        except Exception:  # noqa: BLE001
            pass
        h, eps = self.config.hidden_size, self.config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(self.config, 0)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps)
        if not hasattr(self.layer, "self_attn") or not hasattr(self.layer.self_attn, "kv_b_proj"):
            raise RuntimeError("GlmMoeDsaDecoderLayer has no MLA self_attn (kv_b_proj): unknown transformers layout")
        if not hasattr(self.layer.mlp, "experts") or not hasattr(self.layer.mlp, "gate"):
            raise RuntimeError("the NextN layer's MLP is not a mixture (mlp.experts / mlp.gate missing)")
        indexer = getattr(self.layer.self_attn, "indexer", None)
        if indexer is not None:
            indexer.requires_grad_(False)
        for name, p in self.named_parameters():
            if name.endswith(FP32_SUFFIXES):
                p.requires_grad_(False)  # moved by the load-balancing rule, not by gradients

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """transformers' scheme for the trunk: matrices (and the fused experts) ~ N(0, std), norm
        weights 1, norm biases and the router's correction bias 0."""
        for name, p in self.named_parameters():
            if name.endswith(FP32_SUFFIXES) or name.endswith("norm.bias"):
                p.zero_()
            elif p.ndim >= 2:
                p.normal_(0.0, std)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.fill_(1.0)
            else:
                raise RuntimeError(f"NextN parameter {name} {tuple(p.shape)} has no init rule")
        for name, b in self.named_buffers():
            if name.endswith(FP32_SUFFIXES):
                b.zero_()

    def forward(self, emb_next, hidden, position_embeddings, attention_mask, position_ids):
        """emb_next [B, T, H] = embed(x_{p+1}), hidden [B, T, H] = h_p (final-normed),
        position_embeddings = the target's rotary (cos, sin) at positions p, attention_mask
        [B, 1, T, T] additive causal. Returns shared_head.norm output [B, T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(hidden)], dim=-1))
        out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=None,
                         use_cache=False, position_embeddings=position_embeddings)
        x = out[0] if isinstance(out, (tuple, list)) else out
        return self.shared_head.norm(x)


def nextn_rows(model, nextn: GlmNextN, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """x [B, L] token ids, hidden [B, L, H] the target's final-normed hiddens of x. Returns the NextN
    outputs [B, L-1, H] (after shared_head.norm); row p is built from (x[p+1], hidden[p]) at rotary
    position p and predicts x[p+2] through the target's lm_head."""
    b, n = x.shape
    emb = model.model.embed_tokens(x[:, 1:])
    pos = torch.arange(n - 1, device=x.device).unsqueeze(0).expand(b, -1)
    pe = model.model.rotary_emb(emb, pos)
    return nextn(emb, hidden[:, :-1], pe, causal_mask(n - 1, x.device, b), pos)


# --------------------------------------------------------------------------------------------------
# Checkpoint layout
# --------------------------------------------------------------------------------------------------

def checkpoint_dtype(name: str) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16


def to_checkpoint(tensors: dict) -> dict:
    """Detached, contiguous CPU copies in the published dtypes (bf16; router biases fp32)."""
    out = {}
    for k, v in tensors.items():
        if not v.is_floating_point():
            raise ValueError(f"{k} is not a floating tensor ({v.dtype})")
        out[k] = v.detach().to(device="cpu", dtype=checkpoint_dtype(k)).contiguous()
    return out


def nextn_tensors(nextn: GlmNextN, layer_index: int) -> dict:
    """The NextN layer's tensors under their checkpoint names (model.layers.{layer_index}.*), without
    the unused indexer."""
    prefix = f"model.layers.{layer_index}."
    out = {}
    for k, v in nextn.state_dict().items():
        if k.startswith("layer."):
            rest = k[len("layer."):]
            if rest.startswith(_INDEXER):
                continue
        elif k in NEXTN_OWN:
            rest = k
        else:
            raise ValueError(f"unexpected NextN state-dict key {k}")
        out[prefix + rest] = v
    return out


def load_nextn(nextn: GlmNextN, tensors: dict, layer_index: int) -> None:
    """Loads the NextN layer from checkpoint tensors (every model.layers.{layer_index}.* name); the
    indexer, which the checkpoint does not carry, keeps its values. Raises on any other gap."""
    prefix = f"model.layers.{layer_index}."
    sd = {}
    for k, v in tensors.items():
        if k.startswith(prefix):
            rest = k[len(prefix):]
            sd[rest if rest in NEXTN_OWN else "layer." + rest] = v
    if not sd:
        raise ValueError(f"no tensors under {prefix} (the NextN layer)")
    own = nextn.state_dict()
    cast = {k: v.to(dtype=own[k].dtype, device=own[k].device) if k in own else v for k, v in sd.items()}
    res = nextn.load_state_dict(cast, strict=False)
    missing = [k for k in res.missing_keys if not k.startswith("layer." + _INDEXER)]
    if missing or res.unexpected_keys:
        raise ValueError(f"NextN reload: missing {missing}, unexpected {list(res.unexpected_keys)}")


def layer_shapes(cfg: dict, prefix: str, sparse: bool, indexer: bool) -> dict:
    """Names and shapes of one GLM-5 decoder layer, as tandem's bind_glm5_layer binds them (fused
    experts, as transformers writes them)."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    R, qr = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    a = prefix + "self_attn."
    s = {
        prefix + "input_layernorm.weight": (H,),
        prefix + "post_attention_layernorm.weight": (H,),
        a + "q_a_proj.weight": (qr, H),
        a + "q_a_layernorm.weight": (qr,),
        a + "q_b_proj.weight": (nh * (dn + dr), qr),
        a + "kv_a_proj_with_mqa.weight": (R + dr, H),
        a + "kv_a_layernorm.weight": (R,),
        a + "kv_b_proj.weight": (nh * (dn + dv), R),
        a + "o_proj.weight": (H, nh * dv),
    }
    if indexer:
        x, Di, ih = a + "indexer.", cfg["index_head_dim"], cfg["index_n_heads"]
        s.update({x + "wq_b.weight": (ih * Di, qr), x + "wk.weight": (Di, H), x + "k_norm.weight": (Di,),
                  x + "k_norm.bias": (Di,), x + "weights_proj.weight": (ih, H)})
    m = prefix + "mlp."
    if sparse:
        E, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        s.update({m + "gate.weight": (E, H), m + "gate.e_score_correction_bias": (E,),
                  m + "experts.gate_up_proj": (E, 2 * I, H), m + "experts.down_proj": (E, H, I)})
        ns = cfg.get("n_shared_experts", 1)
        if ns:
            Is = I * ns
            s.update({m + "shared_experts.gate_proj.weight": (Is, H), m + "shared_experts.up_proj.weight": (Is, H),
                      m + "shared_experts.down_proj.weight": (H, Is)})
    else:
        I = cfg["intermediate_size"]
        s.update({m + "gate_proj.weight": (I, H), m + "up_proj.weight": (I, H), m + "down_proj.weight": (H, I)})
    return s


def target_shapes(cfg: dict) -> dict:
    """Every tensor of the target (embedding, layers, final norm, untied head)."""
    H, V, N = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    types = cfg.get("indexer_types") or ["full"] * N
    s = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.get("tie_word_embeddings", False):
        s["lm_head.weight"] = (V, H)
    for i in range(N):
        s.update(layer_shapes(cfg, f"model.layers.{i}.", cfg["mlp_layer_types"][i] == "sparse",
                              i == 0 or types[i] != "shared"))
    return s


def nextn_shapes(cfg: dict) -> dict:
    """Every tensor of the NextN layer model.layers.{num_hidden_layers}.*."""
    H, N = cfg["hidden_size"], cfg["num_hidden_layers"]
    p = f"model.layers.{N}."
    s = {p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H),
         p + "shared_head.norm.weight": (H,)}
    s.update(layer_shapes(cfg, p, sparse=True, indexer=False))
    return s


def check_layout(tensors: dict, expected: dict, what: str) -> None:
    """Raises ValueError unless `tensors` has exactly the expected names and shapes."""
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    extra = sorted(set(got) - set(expected))
    missing = sorted(set(expected) - set(got))
    wrong = sorted(f"{k}: {got[k]} != {tuple(expected[k])}" for k in set(got) & set(expected)
                   if got[k] != tuple(expected[k]))
    if extra or missing or wrong:
        raise ValueError(f"{what}: the tensors differ from the layout tandem binds: extra {extra[:12]}, "
                         f"missing {missing[:12]}, wrong shapes {wrong[:12]}")


def count(shapes: dict) -> int:
    return sum(math.prod(s) for s in shapes.values())
