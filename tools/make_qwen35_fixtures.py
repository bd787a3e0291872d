#!/usr/bin/env python3
"""Create tiny random-weight Qwen3.5 checkpoints and fp32 reference outputs for tandem's tests.

Run once, from anywhere, on a machine with torch + transformers (no network needed):

    python3 tools/make_qwen35_fixtures.py            # writes tests/fixtures/qwen35_*/
    python3 tools/make_qwen35_fixtures.py --copy-tokenizer-only   # add tests/fixtures/tokenizer/* later

Three models are written, each in the published Hugging Face directory layout:

  qwen35_tied            nested config (model_type qwen3_5), Qwen3_5ForConditionalGeneration,
                         tied embeddings, float32, one file, vision tower + native MTP tensors.
  qwen35_untied_sharded  flat text-only config (model_type qwen3_5_text), Qwen3_5ForCausalLM,
                         bfloat16, >= 3 shards + index, legacy top-level rope fields and
                         full_attention_interval instead of layer_types (when transformers accepts it).
  qwen35_gqa_f16         nested config, untied, float16, one file, vision tensors stripped.

References are computed in fp32 on CPU from the checkpoint as saved (bf16/f16 weights are reloaded
with dtype=float32, so the reference sees exactly the rounded weights) and written next to each
checkpoint as reference.safetensors + reference.json. Seeds are tried in a fixed order until the
greedy continuations are varied, EOS-free and free of near-ties (see --min-greedy-gap, --min-distinct).

The script checks everything it can and fails loudly (SystemExit with a message) when something is
not as expected: tensor names/prefixes on disk, that the reloaded model holds exactly the tensors on
disk, the config fields the C++ loader reads, and that the final directory still reproduces the
reference logits.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

# No network on the target machine: never let huggingface_hub try to reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures"
TOKENIZER_DIR_NAME = "tokenizer"

# Optional fast-kernel packages that transformers would pick instead of its pure-torch reference
# functions (GatedDeltaNet chunk/recurrent rules, causal conv1d). They are CUDA/Triton kernels and
# are not the reference we want on CPU, so by default we make them un-importable.
FAST_KERNEL_PACKAGES = ("fla", "causal_conv1d")


def block_fast_kernel_packages(allow: bool) -> list[str]:
    found = [name for name in FAST_KERNEL_PACKAGES if importlib.util.find_spec(name) is not None]
    if found:
        if allow:
            print(f"WARNING: fast-kernel packages installed and allowed: {found} (references may "
                  "not come from transformers' pure-torch code path)")
        else:
            print(f"note: blocking installed fast-kernel packages {found} so transformers uses its "
                  "pure-torch reference functions")
    if not allow:
        for name in FAST_KERNEL_PACKAGES:
            if name not in sys.modules:
                sys.modules[name] = None  # `import name` now raises ImportError
    return found


# torch / transformers are imported in main() after the kernel packages are blocked.
torch = None
transformers = None


def fail(msg: str) -> None:
    raise SystemExit(f"\nFIXTURE ERROR: {msg}\n")


def banner(text: str) -> None:
    print("\n" + "=" * 100 + f"\n{text}\n" + "=" * 100)


# --------------------------------------------------------------------------------------------------
# Model specifications
# --------------------------------------------------------------------------------------------------

@dataclass
class ModelSpec:
    name: str                  # directory name under --out
    nested: bool               # True: Qwen3_5Config + Qwen3_5ForConditionalGeneration
    disk_dtype: str            # "float32" | "bfloat16" | "float16"
    text: dict                 # Qwen3_5TextConfig fields
    tied: bool
    eos_in_config: object      # eos_token_id written in the (text) config, None = omit the key
    generation: dict           # generation_config.json content
    seed: int
    embed_std: float = 1.0
    proj_std: float = 0.1
    lm_head_std: float = 0.15
    vision: dict | None = None             # vision_config for nested models
    strip_vision: bool = False             # remove model.visual.* from the files after saving
    mtp_layers: int | None = None          # text_config.mtp_num_hidden_layers (None: omit the key)
    add_mtp_tensors: bool = False
    num_shards_min: int = 1                # > 1: save sharded with at least this many shards
    legacy_text_config: bool = False       # flat config: rope fields top-level, no layer_types
    full_attention_interval: int | None = None
    notes: list = field(default_factory=list)


def layer_types_from_interval(n: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def tiny_vision(out_hidden: int) -> dict:
    return dict(
        depth=1,
        hidden_size=32,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=out_hidden,
        num_position_embeddings=16,
    )


def model_specs(keep_vision_in_c: bool) -> list[ModelSpec]:
    lin, full = "linear_attention", "full_attention"
    a = ModelSpec(
        name="qwen35_tied",
        nested=True,
        disk_dtype="float32",
        tied=True,
        text=dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            layer_types=[lin, lin, lin, full],
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
            linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            max_position_embeddings=4096, rms_norm_eps=1e-6,
        ),
        eos_in_config=2,
        generation=dict(eos_token_id=2, do_sample=True, temperature=0.6, top_k=20, top_p=0.95),
        seed=1001,
        # Tied head: logits = <h, e_t>. A smaller embedding keeps the residual stream from being
        # dominated by the current token's own embedding (which makes greedy repeat the last token).
        embed_std=0.5,
        proj_std=0.12,
        vision=tiny_vision(out_hidden=64),
        mtp_layers=1,
        add_mtp_tensors=True,
    )
    b = ModelSpec(
        name="qwen35_untied_sharded",
        nested=False,
        disk_dtype="bfloat16",
        tied=False,
        text=dict(
            vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=6,
            layer_types=layer_types_from_interval(6, 3),
            num_attention_heads=6, num_key_value_heads=1, head_dim=16,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5),
            linear_num_key_heads=3, linear_num_value_heads=3,
            linear_key_head_dim=32, linear_value_head_dim=24, linear_conv_kernel_dim=3,
            max_position_embeddings=4096, rms_norm_eps=1e-6,
        ),
        eos_in_config=None,
        generation=dict(eos_token_id=[2, 3]),
        seed=2002,
        num_shards_min=3,
        legacy_text_config=True,
        full_attention_interval=3,
    )
    c = ModelSpec(
        name="qwen35_gqa_f16",
        nested=True,
        disk_dtype="float16",
        tied=False,
        text=dict(
            vocab_size=512, hidden_size=80, intermediate_size=192, num_hidden_layers=5,
            layer_types=[lin, full, lin, lin, full],
            num_attention_heads=8, num_key_value_heads=4, head_dim=24,
            rope_parameters=dict(rope_type="default", rope_theta=500000.0, partial_rotary_factor=1.0 / 3.0,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
            linear_num_key_heads=2, linear_num_value_heads=6,
            linear_key_head_dim=16, linear_value_head_dim=20, linear_conv_kernel_dim=4,
            max_position_embeddings=4096, rms_norm_eps=1e-6,
        ),
        eos_in_config=2,
        generation=dict(eos_token_id=2),
        seed=3003,
        vision=tiny_vision(out_hidden=80),
        strip_vision=not keep_vision_in_c,
        mtp_layers=0,
    )
    for spec in (a, b, c):
        t = spec.text
        rotary_dim = int(t["head_dim"] * t["rope_parameters"]["partial_rotary_factor"])
        sec = t["rope_parameters"].get("mrope_section")
        if rotary_dim % 2 or (sec is not None and sum(sec) != rotary_dim // 2):
            fail(f"{spec.name}: bad rope spec: rotary_dim {rotary_dim}, mrope_section {sec}")
    return [a, b, c]


# --------------------------------------------------------------------------------------------------
# transformers access (defensive imports)
# --------------------------------------------------------------------------------------------------

def qwen35_classes():
    names = ["Qwen3_5Config", "Qwen3_5TextConfig", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"]
    out = {}
    for n in names:
        obj = getattr(transformers, n, None)
        if obj is None:
            try:
                from transformers.models import qwen3_5 as q  # noqa: PLC0415
                obj = getattr(q, n, None)
            except Exception as exc:  # noqa: BLE001
                fail(f"cannot import transformers.models.qwen3_5 ({exc!r}); transformers "
                     f"{transformers.__version__} has no Qwen3.5 support?")
        if obj is None:
            fail(f"transformers {transformers.__version__} does not provide {n}")
        out[n] = obj
    return out


def torch_dtype(name: str):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_config(spec: ModelSpec, cls):
    text = copy.deepcopy(spec.text)
    # Qwen3_5TextConfig sets a default `partial_rotary_factor` kwarg (0.25) that may also be kept as
    # a plain attribute; pass the real value so any stray top-level copy agrees with rope_parameters.
    text["partial_rotary_factor"] = text["rope_parameters"]["partial_rotary_factor"]
    text["tie_word_embeddings"] = spec.tied
    if spec.eos_in_config is not None:
        text["eos_token_id"] = spec.eos_in_config
    if not spec.nested:
        return cls["Qwen3_5TextConfig"](**text)
    return cls["Qwen3_5Config"](
        text_config=text,
        vision_config=copy.deepcopy(spec.vision),
        tie_word_embeddings=spec.tied,
        # keep the multimodal special ids inside the tiny vocabulary (above the tokenizer's 503)
        image_token_id=508,
        video_token_id=509,
        vision_start_token_id=510,
        vision_end_token_id=511,
    )


def text_prefix(spec: ModelSpec) -> str:
    return "model.language_model." if spec.nested else "model."


# --------------------------------------------------------------------------------------------------
# Random initialisation
# --------------------------------------------------------------------------------------------------

def randn(gen, shape, std, mean=0.0):
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std + mean


def uniform(gen, shape, lo, hi):
    return torch.rand(tuple(shape), generator=gen, dtype=torch.float32) * (hi - lo) + lo


def init_value(spec: ModelSpec, local: str, shape, gen):
    """Random value for one text-model parameter (local name without the text prefix)."""
    if local == "embed_tokens.weight":
        return randn(gen, shape, spec.embed_std)
    if local == "lm_head.weight":
        return randn(gen, shape, spec.lm_head_std)
    if local.endswith("linear_attn.A_log"):
        return torch.log(uniform(gen, shape, 0.02, 2.0))        # decay rates from slow to fast
    if local.endswith("linear_attn.dt_bias"):
        return randn(gen, shape, 1.0)
    if local.endswith("linear_attn.conv1d.weight"):
        return randn(gen, shape, 0.3)
    if local.endswith("linear_attn.norm.weight"):
        return randn(gen, shape, 0.1, mean=1.0)                 # RMSNormGated: plain weight
    if len(shape) == 1 and "norm" in local:
        return randn(gen, shape, 0.1)                            # zero-centred (1 + w) RMSNorm
    if len(shape) == 2:
        return randn(gen, shape, spec.proj_std)
    return None


def randomize_weights(model, spec: ModelSpec, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    prefix = text_prefix(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head is deduplicated here
            if name.startswith("model.visual."):
                continue  # keep transformers' (seeded, deterministic) init for the vision tower
            if name == "lm_head.weight":
                local = name
            elif name.startswith(prefix):
                local = name[len(prefix):]
            else:
                fail(f"{spec.name}: unexpected parameter name {name!r} (expected prefix {prefix!r})")
            value = init_value(spec, local, p.shape, gen)
            if value is None:
                print(f"  WARNING: no init rule for {name} {tuple(p.shape)}; using N(0, 0.02)")
                value = randn(gen, p.shape, 0.02)
            p.copy_(value.to(p.dtype))


def mtp_tensors(spec: ModelSpec, seed: int) -> dict:
    """Random native-MTP tensors in the published Qwen3.5 naming (one full-attention layer)."""
    t = spec.text
    h, inter = t["hidden_size"], t["intermediate_size"]
    nh, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
    }
    for i in range(spec.mtp_layers or 0):
        p = f"mtp.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * hd * 2, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    dt = torch_dtype(spec.disk_dtype)
    out = {}
    for name, shape in shapes.items():
        std = 0.1 if len(shape) == 1 else spec.proj_std
        out[name] = randn(gen, shape, std).to(dt).contiguous()
    return out


# --------------------------------------------------------------------------------------------------
# Checkpoint files
# --------------------------------------------------------------------------------------------------

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def checkpoint_files(d: Path) -> list[Path]:
    if (d / INDEX_NAME).exists():
        weight_map = json.loads((d / INDEX_NAME).read_text())["weight_map"]
        return [d / f for f in sorted(set(weight_map.values()))]
    if (d / SINGLE_NAME).exists():
        return [d / SINGLE_NAME]
    fail(f"{d}: no {SINGLE_NAME} and no {INDEX_NAME}; files there: {sorted(p.name for p in d.iterdir())}")
    return []


def read_checkpoint(d: Path) -> dict:
    from safetensors.torch import load_file  # noqa: PLC0415
    tensors = {}
    for f in checkpoint_files(d):
        for k, v in load_file(str(f)).items():
            if k in tensors:
                fail(f"{d}: tensor {k} appears in more than one shard")
            tensors[k] = v
    return tensors


def checkpoint_header(d: Path) -> dict:
    """name -> (dtype string, shape, file) without loading data."""
    from safetensors import safe_open  # noqa: PLC0415
    out = {}
    for f in checkpoint_files(d):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = (str(sl.get_dtype()), list(sl.get_shape()), f.name)
    return out


def write_checkpoint(d: Path, tensors: dict, num_shards: int) -> None:
    """Write tensors in the HF layout: model.safetensors, or N shards + index."""
    from safetensors.torch import save_file  # noqa: PLC0415
    for p in d.iterdir():
        if p.name in (SINGLE_NAME, INDEX_NAME) or SHARD_RE.match(p.name):
            p.unlink()
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    if num_shards <= 1:
        save_file(tensors, str(d / SINGLE_NAME), metadata={"format": "pt"})
        return
    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    total = sum(sizes.values())
    target = total / num_shards
    groups, cur, acc = [], [], 0
    for k in tensors:
        if cur and acc + sizes[k] > target and len(groups) < num_shards - 1:
            groups.append(cur)
            cur, acc = [], 0
        cur.append(k)
        acc += sizes[k]
    groups.append(cur)
    n = len(groups)
    weight_map = {}
    for i, keys in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def rewrite_checkpoint(d: Path, transform) -> None:
    """Load all tensors, apply transform(dict) -> dict, write back with the same shard count."""
    n = len(checkpoint_files(d))
    tensors = read_checkpoint(d)
    write_checkpoint(d, transform(tensors), n)


def expected_names(model, spec: ModelSpec) -> set:
    names = set(model.state_dict().keys())
    if spec.tied:
        names.discard("lm_head.weight")
    return names


def check_layout(spec: ModelSpec, names, stage: str) -> None:
    """Assert the published prefixes (and only those) are present."""
    names = set(names)
    p = text_prefix(spec)
    t = spec.text
    required = [p + "embed_tokens.weight", p + "norm.weight"]
    for i, kind in enumerate(t["layer_types"]):
        lp = f"{p}layers.{i}."
        required += [lp + "input_layernorm.weight", lp + "post_attention_layernorm.weight",
                     lp + "mlp.gate_proj.weight", lp + "mlp.up_proj.weight", lp + "mlp.down_proj.weight"]
        if kind == "linear_attention":
            required += [lp + "linear_attn." + s for s in (
                "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")]
        else:
            required += [lp + "self_attn." + s for s in (
                "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                "q_norm.weight", "k_norm.weight")]
    allowed = [p, "lm_head."]
    if spec.nested:
        allowed.append("model.visual.")
    if stage == "final" and spec.add_mtp_tensors:
        allowed.append("mtp.")
        required += ["mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"]
    problems = []
    missing = sorted(set(required) - names)
    if missing:
        problems.append(f"missing {len(missing)} required tensors, e.g. {missing[:8]}")
    stray = sorted(n for n in names if not any(n.startswith(a) for a in allowed))
    if stray:
        problems.append(f"{len(stray)} tensors outside the allowed prefixes {allowed}, e.g. {stray[:8]}")
    if spec.tied and "lm_head.weight" in names:
        problems.append("lm_head.weight is stored although the embeddings are tied")
    if not spec.tied and "lm_head.weight" not in names:
        problems.append("lm_head.weight is missing although the embeddings are untied")
    if not spec.nested and any(n.startswith("model.language_model.") for n in names):
        problems.append("text-only checkpoint uses the nested prefix model.language_model.")
    if spec.nested:
        has_visual = any(n.startswith("model.visual.") for n in names)
        want_visual = not (stage == "final" and spec.strip_vision)
        if has_visual != want_visual:
            problems.append(f"model.visual.* present={has_visual}, expected {want_visual}")
    if problems:
        fail(f"{spec.name} ({stage}): tensor layout is wrong:\n  - " + "\n  - ".join(problems)
             + f"\n  all names: {sorted(names)}")
    print(f"  layout check ({stage}): OK ({len(names)} tensors)")


def verify_saved_names(model, spec: ModelSpec, d: Path, num_shards: int) -> str:
    """Compare what save_pretrained wrote with the module's own names; rewrite by hand if needed."""
    header = checkpoint_header(d)
    on_disk = set(header)
    expected = expected_names(model, spec)
    print(f"  save_pretrained wrote {len(on_disk)} tensors in {len(checkpoint_files(d))} file(s)")
    if on_disk == expected:
        return "save_pretrained"
    extra, missing = sorted(on_disk - expected), sorted(expected - on_disk)
    print("  " + "!" * 96)
    print(f"  WARNING: save_pretrained names differ from the module names (published layout).")
    print(f"    on disk but not expected ({len(extra)}): {extra[:12]}")
    print(f"    expected but not on disk ({len(missing)}): {missing[:12]}")
    print("    -> rewriting the checkpoint by hand from the in-memory state dict")
    print("  " + "!" * 96)
    sd = {k: v for k, v in model.state_dict().items() if k in expected}
    write_checkpoint(d, sd, num_shards)
    if set(checkpoint_header(d)) != expected:
        fail(f"{spec.name}: hand-written checkpoint still has the wrong names")
    spec.notes.append(f"save_pretrained names differed (extra {extra[:4]}, missing {missing[:4]}); "
                      "files rewritten by hand from the module state dict")
    return "manual (save_pretrained names differed)"


# --------------------------------------------------------------------------------------------------
# Config post-processing
# --------------------------------------------------------------------------------------------------

def load_json(p: Path) -> dict:
    return json.loads(p.read_text())


def dump_json(p: Path, obj: dict) -> None:
    p.write_text(json.dumps(obj, indent=2) + "\n")


def fix_text_config_json(spec: ModelSpec, d: Path) -> None:
    """Make config.json carry exactly the fields the fixture promises (noting every edit)."""
    path = d / "config.json"
    cfg = load_json(path)
    text = cfg["text_config"] if spec.nested else cfg
    edits = []

    def setv(obj, key, value, where):
        if obj.get(key, "<absent>") != value:
            edits.append(f"{where}{key}: {obj.get(key, '<absent>')!r} -> {value!r}")
            obj[key] = value

    want_rope = spec.text["rope_parameters"]
    rope = text.get("rope_parameters")
    if not isinstance(rope, dict):
        edits.append(f"text rope_parameters was {rope!r}")
        rope = {}
        text["rope_parameters"] = rope
    for k, v in want_rope.items():
        setv(rope, k, v, "rope_parameters.")
    if "partial_rotary_factor" in text:
        setv(text, "partial_rotary_factor", want_rope["partial_rotary_factor"], "")
    setv(text, "tie_word_embeddings", spec.tied, "")
    if spec.nested:
        setv(cfg, "tie_word_embeddings", spec.tied, "(outer) ")
    if spec.mtp_layers is not None:
        setv(text, "mtp_num_hidden_layers", spec.mtp_layers, "")
        setv(text, "mtp_use_dedicated_embeddings", False, "")
    if spec.eos_in_config is None:
        if "eos_token_id" in text:
            edits.append(f"removed eos_token_id {text.pop('eos_token_id')!r} (generation_config only)")
    else:
        setv(text, "eos_token_id", spec.eos_in_config, "")
    if text.get("layer_types") != spec.text["layer_types"]:
        fail(f"{spec.name}: config.json layer_types {text.get('layer_types')} != {spec.text['layer_types']}")
    dump_json(path, cfg)
    for e in edits:
        print(f"  config.json edit: {e}")
    if edits:
        spec.notes.append("config.json edited after save_pretrained: " + "; ".join(edits))


def check_loaded_text_config(spec: ModelSpec, text_cfg) -> list[str]:
    """Differences between a loaded (transformers) text config and the spec."""
    problems = []
    t = spec.text
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
        if getattr(text_cfg, k, None) != t[k]:
            problems.append(f"{k}={getattr(text_cfg, k, None)!r} (want {t[k]!r})")
    if list(getattr(text_cfg, "layer_types", []) or []) != t["layer_types"]:
        problems.append(f"layer_types={getattr(text_cfg, 'layer_types', None)} (want {t['layer_types']})")
    rope = getattr(text_cfg, "rope_parameters", None) or {}
    want = t["rope_parameters"]
    for k in ("rope_theta", "partial_rotary_factor"):
        got = rope.get(k) if isinstance(rope, dict) else None
        if got is None or float(got) != float(want[k]):
            problems.append(f"rope_parameters.{k}={got!r} (want {want[k]!r})")
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r}")
    return problems


def apply_legacy_text_config(spec: ModelSpec, d: Path, cls) -> None:
    """Flat config only: move rope_theta / partial_rotary_factor to the top level, drop
    rope_parameters and layer_types, and add full_attention_interval -- if transformers still
    reads that form back identically. Otherwise keep the modern form and say so."""
    path = d / "config.json"
    original = path.read_text()
    cfg = json.loads(original)
    rope = cfg.pop("rope_parameters", None) or {}
    cfg.pop("rope_scaling", None)
    cfg["rope_theta"] = rope.get("rope_theta", spec.text["rope_parameters"]["rope_theta"])
    cfg["partial_rotary_factor"] = rope.get("partial_rotary_factor",
                                            spec.text["rope_parameters"]["partial_rotary_factor"])
    cfg.pop("layer_types", None)
    cfg["full_attention_interval"] = spec.full_attention_interval
    dump_json(path, cfg)
    try:
        loaded = cls["Qwen3_5TextConfig"].from_pretrained(str(d))
        problems = check_loaded_text_config(spec, loaded)
    except Exception as exc:  # noqa: BLE001
        problems = [f"loading raised {exc!r}"]
    if not problems:
        print("  legacy config form (top-level rope_theta/partial_rotary_factor, full_attention_interval, "
              "no layer_types/rope_parameters) reloads identically in transformers: kept")
        spec.notes.append("config.json in legacy form: top-level rope_theta + partial_rotary_factor, "
                          "no rope_parameters, full_attention_interval instead of layer_types "
                          "(verified: transformers derives the same layer_types and rope values)")
        return
    print("  " + "!" * 96)
    print("  WARNING: transformers does not read the legacy config form back identically:")
    for p in problems:
        print(f"    - {p}")
    print("    -> keeping the modern form written by save_pretrained")
    print("  " + "!" * 96)
    path.write_text(original)
    spec.notes.append("legacy config form rejected (" + "; ".join(problems) + "); modern form kept")


def write_generation_config(spec: ModelSpec, d: Path) -> None:
    path = d / "generation_config.json"
    try:
        gc = transformers.GenerationConfig(**spec.generation)
        gc.save_pretrained(str(d))
        got = load_json(path)
        for k, v in spec.generation.items():
            if got.get(k) != v:
                raise ValueError(f"{k}: wrote {got.get(k)!r}, want {v!r}")
    except Exception as exc:  # noqa: BLE001
        print(f"  note: GenerationConfig.save_pretrained failed or differs ({exc!r}); writing JSON directly")
        obj = dict(spec.generation)
        obj["transformers_version"] = transformers.__version__
        dump_json(path, obj)


# --------------------------------------------------------------------------------------------------
# Loading and references
# --------------------------------------------------------------------------------------------------

def load_fp32(spec: ModelSpec, d: Path, cls):
    model_cls = cls["Qwen3_5ForConditionalGeneration"] if spec.nested else cls["Qwen3_5ForCausalLM"]
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    info = None
    try:
        model, info = model_cls.from_pretrained(str(d), output_loading_info=True, **kwargs)
    except TypeError as exc:
        print(f"  note: from_pretrained(output_loading_info=True, dtype=...) raised {exc!r}; retrying plainly")
        model = model_cls.from_pretrained(str(d), torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    for k, v in (info or {}).items():
        if v:
            items = sorted(map(str, v)) if isinstance(v, (set, list, tuple)) else [str(v)]
            more = f" ... ({len(items)} in all)" if len(items) > 10 else ""
            print(f"  loading info {k}: {items[:10]}{more}")
    return model


def check_reloaded_matches_disk(model, spec: ModelSpec, d: Path) -> None:
    """Every tensor the model holds must equal the file (upcast); nothing may be left random."""
    disk = read_checkpoint(d)
    sd = model.state_dict()
    bad, unset = [], []
    for k, v in sd.items():
        if k in disk:
            if tuple(disk[k].shape) != tuple(v.shape) or not torch.equal(disk[k].to(torch.float32), v.float()):
                bad.append(k)
        elif k == "lm_head.weight" and spec.tied:
            emb = sd[text_prefix(spec) + "embed_tokens.weight"]
            if not torch.equal(v, emb):
                bad.append(k + " (not tied to embed_tokens)")
        elif k.startswith("model.visual.") and spec.strip_vision:
            continue
        else:
            unset.append(k)
    unused = sorted(k for k in disk if k not in sd and not k.startswith("mtp."))
    if bad or unset or unused:
        fail(f"{spec.name}: reloaded model differs from the files: mismatched {bad[:10]}, "
             f"not loaded from disk {unset[:10]}, unused on disk {unused[:10]}")
    print(f"  reload check: all {len(sd)} model tensors equal the files (fp32 upcast)")


def make_prompts(seed: int, lengths=(7, 12), lo=4, hi=500) -> list[list[int]]:
    """Random prompt ids in [lo, hi): skips 0..3 (eos ids 2, 3) and stays inside the tokenizer's vocab."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (n,), generator=gen).tolist() for n in lengths]


def compute_references(model, spec: ModelSpec, prompts, n_new: int, tie_threshold: float):
    tensors, per_prompt = {}, []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            seq = list(prompt)
            greedy, gaps, step_logits = [], [], []
            for _ in range(n_new):
                out = model(input_ids=torch.tensor([seq], dtype=torch.long), use_cache=False)
                last = out.logits[0, -1].float()
                top = torch.topk(last, 2)
                tok = int(top.indices[0])
                if tok != int(torch.argmax(last)):
                    print(f"  note: topk/argmax disagree at a tie (prompt {i}, step {len(greedy)})")
                greedy.append(tok)
                gaps.append(float(top.values[0] - top.values[1]))
                step_logits.append(last.clone())
                seq.append(tok)
            tokens = torch.tensor(seq, dtype=torch.long)
            out = model(input_ids=tokens[None], use_cache=False)
            logits = out.logits[0].float().contiguous()
            base = model.model(input_ids=tokens[None], use_cache=False)
            hidden = base.last_hidden_state[0].float().contiguous()
            head_diff = float((model.lm_head(hidden) - logits).abs().max())
            if head_diff > 1e-4:
                fail(f"{spec.name}: lm_head(last_hidden_state) differs from logits by {head_diff}")
            n_p = len(prompt)
            step_diff = max(float((step_logits[s] - logits[n_p - 1 + s]).abs().max()) for s in range(n_new))
            top2 = torch.topk(logits, 2, dim=-1).values
            pos_gap = (top2[:, 0] - top2[:, 1]).contiguous()

            tensors[f"prompt_{i}"] = torch.tensor(prompt, dtype=torch.int64)
            tensors[f"prompt_len_{i}"] = torch.tensor(n_p, dtype=torch.int64)
            tensors[f"greedy_{i}"] = torch.tensor(greedy, dtype=torch.int64)
            tensors[f"greedy_gap_{i}"] = torch.tensor(gaps, dtype=torch.float32)
            tensors[f"tokens_{i}"] = tokens.to(torch.int64)
            tensors[f"logits_{i}"] = logits
            tensors[f"hidden_{i}"] = hidden
            tensors[f"logit_gap_{i}"] = pos_gap
            per_prompt.append(dict(
                index=i,
                prompt=list(prompt),
                prompt_len=n_p,
                greedy=greedy,
                greedy_gap=gaps,
                greedy_tie_free=[g > tie_threshold for g in gaps],
                tokens=seq,
                tie_free_positions=[p for p in range(len(seq)) if float(pos_gap[p]) > tie_threshold],
                max_abs_logit=float(logits.abs().max()),
                logit_std=float(logits.std()),
                max_abs_hidden=float(hidden.abs().max()),
                greedy_step_vs_full_forward_max_abs_diff=step_diff,
                lm_head_of_hidden_vs_logits_max_abs_diff=head_diff,
            ))
    return tensors, per_prompt


def greedy_quality(per_prompt, eos_ids, min_gap_wanted: float, min_distinct: int) -> tuple[bool, float, str]:
    """Acceptance test for a seed: varied, eos-free greedy continuations with clear top1-top2 gaps
    (a near-tie early in the continuation would make every later greedy token fragile)."""
    min_gap = min(min(p["greedy_gap"]) for p in per_prompt)
    reasons = []
    for p in per_prompt:
        if any(t in eos_ids for t in p["greedy"]):
            reasons.append(f"prompt {p['index']} greedy hits eos")
        if len(set(p["greedy"])) < min_distinct:
            reasons.append(f"prompt {p['index']} greedy has only {len(set(p['greedy']))} distinct tokens")
    if min_gap < min_gap_wanted:
        reasons.append(f"min greedy gap {min_gap:.3g} < {min_gap_wanted:g}")
    return (not reasons), min_gap, "; ".join(reasons)


# --------------------------------------------------------------------------------------------------
# One model
# --------------------------------------------------------------------------------------------------

def eos_ids_of(spec: ModelSpec) -> list[int]:
    ids = []
    for v in (spec.eos_in_config, spec.generation.get("eos_token_id")):
        if v is None:
            continue
        for x in (v if isinstance(v, list) else [v]):
            if x not in ids:
                ids.append(x)
    return ids


def build_and_save(spec: ModelSpec, d: Path, cls, seed: int) -> str:
    """Build, randomise and save in the on-disk dtype; check the tensor names. Returns the writer used."""
    torch.manual_seed(seed)
    config = build_config(spec, cls)
    model_cls = cls["Qwen3_5ForConditionalGeneration"] if spec.nested else cls["Qwen3_5ForCausalLM"]
    model = model_cls(config)
    model.eval()

    def is_tied():
        return model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    if spec.tied and not is_tied():
        print("  note: lm_head not tied after construction; calling model.tie_weights()")
        model.tie_weights()
    if is_tied() != spec.tied:
        text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        fail(f"{spec.name}: lm_head tied={is_tied()} but tie_word_embeddings={spec.tied} "
             f"(outer config: {getattr(config, 'tie_word_embeddings', None)}, "
             f"text config: {getattr(text_cfg, 'tie_word_embeddings', None)})")
    randomize_weights(model, spec, seed)
    model = model.to(torch_dtype(spec.disk_dtype))

    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    num_shards = 1
    if spec.num_shards_min > 1:
        num_shards = spec.num_shards_min + 1
        total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
        shard_bytes = int(total // num_shards)
        print(f"  state dict {total} bytes; save_pretrained(max_shard_size={shard_bytes})")
        try:
            model.save_pretrained(str(d), max_shard_size=shard_bytes)
        except (TypeError, ValueError) as exc:
            print(f"  note: int max_shard_size rejected ({exc!r}); retrying with '{shard_bytes // 1000}KB'")
            model.save_pretrained(str(d), max_shard_size=f"{shard_bytes // 1000}KB")
    else:
        model.save_pretrained(str(d))
    written = sorted(p.name for p in d.iterdir())
    print(f"  save_pretrained wrote: {written}")
    actual_shards = len(checkpoint_files(d))
    if spec.num_shards_min > 1 and actual_shards < spec.num_shards_min:
        print(f"  WARNING: save_pretrained wrote only {actual_shards} shard(s); re-sharding by hand")
        rewrite_checkpoint_into(d, num_shards)
        spec.notes.append(f"save_pretrained wrote {actual_shards} shard(s); re-sharded by hand into {num_shards}")
    if spec.num_shards_min <= 1 and actual_shards != 1:
        fail(f"{spec.name}: expected a single model.safetensors, got {actual_shards} files")
    writer = verify_saved_names(model, spec, d, len(checkpoint_files(d)))
    check_layout(spec, checkpoint_header(d).keys(), "saved")
    return writer


def rewrite_checkpoint_into(d: Path, num_shards: int) -> None:
    tensors = read_checkpoint(d)
    write_checkpoint(d, tensors, num_shards)


def postprocess_files(spec: ModelSpec, d: Path, seed: int) -> None:
    if spec.add_mtp_tensors:
        extra = mtp_tensors(spec, seed + 17)

        def add(t):
            clash = sorted(set(t) & set(extra))
            if clash:
                fail(f"{spec.name}: MTP tensors already present: {clash[:5]}")
            out = dict(t)
            out.update(extra)
            return out

        rewrite_checkpoint(d, add)
        print(f"  added {len(extra)} random mtp.* tensors ({spec.disk_dtype})")
        spec.notes.append(f"{len(extra)} random mtp.* tensors added after save_pretrained "
                          "(transformers does not model the MTP head; it ignores ^mtp.* on load)")
    if spec.strip_vision:
        def strip(t):
            return {k: v for k, v in t.items() if not k.startswith("model.visual.")}
        before = len(checkpoint_header(d))
        rewrite_checkpoint(d, strip)
        after = len(checkpoint_header(d))
        print(f"  stripped {before - after} model.visual.* tensors (config.json keeps its vision_config)")
        spec.notes.append(f"{before - after} model.visual.* tensors removed after the reference was computed "
                          "(Qwen3_5ForConditionalGeneration always builds a vision tower); config.json "
                          "still has vision_config")


def final_check(spec: ModelSpec, d: Path, cls, ref: dict) -> str:
    """Reload the final directory and compare with the stored reference logits."""
    try:
        model = load_fp32(spec, d, cls)
        with torch.no_grad():
            logits = model(input_ids=ref["tokens_0"][None], use_cache=False).logits[0].float()
        diff = float((logits - ref["logits_0"]).abs().max())
    except Exception as exc:  # noqa: BLE001
        msg = f"final reload failed: {exc!r}"
        if spec.strip_vision:
            print(f"  WARNING: {msg} (vision tensors were stripped; the reference was computed before)")
            spec.notes.append(msg)
            return msg
        fail(f"{spec.name}: {msg}")
    if diff > 1e-5:
        fail(f"{spec.name}: final directory reproduces logits_0 only to {diff:.3g}")
    print(f"  final reload: logits_0 reproduced, max |diff| = {diff:.3g}")
    return f"ok (max |diff| {diff:.3g})"


def run_attempt(spec: ModelSpec, d: Path, cls, args, prompts, seed: int, base_notes: list) -> dict:
    """Build + save one seed, finish the config files, reload in fp32 and compute the references."""
    spec.notes = list(base_notes)
    writer = build_and_save(spec, d, cls, seed)
    fix_text_config_json(spec, d)
    if spec.legacy_text_config:
        apply_legacy_text_config(spec, d, cls)
    write_generation_config(spec, d)
    ref_model = load_fp32(spec, d, cls)
    check_reloaded_matches_disk(ref_model, spec, d)
    problems = check_loaded_text_config(spec, ref_model.config.get_text_config())
    if problems:
        fail(f"{spec.name}: reloaded config differs from the spec: {problems}")
    tensors, per_prompt = compute_references(ref_model, spec, prompts, args.new_tokens, args.tie_threshold)
    for p in per_prompt:
        print(f"  prompt {p['index']}: greedy {p['greedy']} min gap {min(p['greedy_gap']):.4g} "
              f"max|logit| {p['max_abs_logit']:.3g}")
    return dict(seed=seed, writer=writer, tensors=tensors, per_prompt=per_prompt, notes=list(spec.notes))


def make_model(spec: ModelSpec, out: Path, cls, args, versions: dict) -> dict:
    banner(f"{spec.name}: {'nested qwen3_5' if spec.nested else 'flat qwen3_5_text'}, {spec.disk_dtype}, "
           f"{'tied' if spec.tied else 'untied'}")
    d = out / spec.name
    prompts = make_prompts(args.prompt_seed)
    eos_ids = eos_ids_of(spec)
    base_notes = list(spec.notes)
    best, last_seed = None, None
    for attempt in range(args.max_attempts):
        seed = spec.seed + 7919 * attempt
        print(f"- attempt {attempt}: seed {seed}")
        res = run_attempt(spec, d, cls, args, prompts, seed, base_notes)
        last_seed = seed
        ok, min_gap, why = greedy_quality(res["per_prompt"], eos_ids, args.min_greedy_gap,
                                          args.min_distinct)
        res.update(attempt=attempt, ok=ok, min_gap=min_gap, why=why)
        if ok:
            best = res
            break
        print(f"  seed rejected: {why}")
        if best is None or min_gap > best["min_gap"]:
            best = res
    if not best["ok"]:
        print(f"  WARNING: no seed met every criterion; using the best one (seed {best['seed']}): {best['why']}")
        if best["seed"] != last_seed:  # the files on disk belong to the last attempt: redo the chosen one
            keep = best
            best = run_attempt(spec, d, cls, args, prompts, keep["seed"], base_notes)
            best.update(attempt=keep["attempt"], ok=False, min_gap=keep["min_gap"], why=keep["why"])
        best["notes"].append(f"greedy quality criteria not met: {best['why']}")
    spec.notes = best["notes"]
    seed, attempt, writer = best["seed"], best["attempt"], best["writer"]
    tensors, per_prompt = best["tensors"], best["per_prompt"]

    postprocess_files(spec, d, seed)
    header = checkpoint_header(d)
    check_layout(spec, header.keys(), "final")
    from safetensors.torch import save_file  # noqa: PLC0415
    save_file(tensors, str(d / "reference.safetensors"), metadata={"format": "pt"})
    final = final_check(spec, d, cls, tensors)

    copied = copy_tokenizer(out, d)
    cfg_json = load_json(d / "config.json")
    files = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}
    ckpt_files = [p.name for p in checkpoint_files(d)]
    reference = dict(
        description=(
            f"Tiny random-weight Qwen3.5 fixture '{spec.name}' made by tools/make_qwen35_fixtures.py. "
            "References: fp32 CPU forward of transformers' model loaded from these files "
            "(dtype=float32, attn_implementation=eager, use_cache=False). For prompt i: greedy_i = "
            f"{args.new_tokens} greedy tokens (full forward over the growing sequence each step), "
            "greedy_gap_i = top1-top2 logit gap at each greedy step, tokens_i = prompt_i + greedy_i, "
            "logits_i [len(tokens_i), vocab] and hidden_i [len, hidden] (final-normed "
            "last_hidden_state of the text model) from ONE forward over tokens_i, logit_gap_i = "
            "top1-top2 gap per position of logits_i, prompt_len_i (scalar). A position/step is "
            f"tie-free when its gap > tie_threshold."
        ),
        model=spec.name,
        architecture="Qwen3_5ForConditionalGeneration" if spec.nested else "Qwen3_5ForCausalLM",
        model_type=cfg_json.get("model_type"),
        disk_dtype=spec.disk_dtype,
        tie_word_embeddings=spec.tied,
        eos_token_ids=eos_ids,
        seed=seed,
        seed_attempt=attempt,
        prompt_seed=args.prompt_seed,
        tie_threshold=args.tie_threshold,
        versions=versions,
        checkpoint=dict(
            files=ckpt_files,
            writer=writer,
            num_tensors=len(header),
            num_elements=sum(math.prod(s) for _, s, _ in header.values()),
            tensors={k: dict(dtype=v[0], shape=v[1], file=v[2]) for k, v in sorted(header.items())},
        ),
        text_config=spec.text,
        mtp_num_hidden_layers=spec.mtp_layers,
        vision_tensors_present=any(k.startswith("model.visual.") for k in header),
        tokenizer_copied=copied,
        final_reload_check=final,
        notes=spec.notes,
        prompts=per_prompt,
        reference_tensors={k: dict(dtype=str(v.dtype).replace("torch.", ""), shape=list(v.shape))
                           for k, v in sorted(tensors.items())},
        files=files,
    )
    dump_json(d / "reference.json", reference)
    files = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}
    return dict(spec=spec, dir=d, header=header, per_prompt=per_prompt, files=files,
                params=reference["checkpoint"]["num_elements"], writer=writer, seed=seed, final=final)


def copy_tokenizer(out: Path, d: Path) -> list[str]:
    src = out / TOKENIZER_DIR_NAME
    copied = []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            shutil.copyfile(src / name, d / name)
            copied.append(name)
    if not copied:
        print(f"  note: {src / 'tokenizer.json'} does not exist; no tokenizer copied (run the tokenizer "
              "fixture script first, then re-run this one to include it)")
    else:
        print(f"  copied {copied} from {src}")
    return copied


def copy_tokenizer_into_existing(out: Path) -> None:
    if not (out / TOKENIZER_DIR_NAME / "tokenizer.json").exists():
        fail(f"{out / TOKENIZER_DIR_NAME / 'tokenizer.json'} does not exist")
    for name in ("qwen35_tied", "qwen35_untied_sharded", "qwen35_gqa_f16"):
        d = out / name
        if not (d / "reference.json").exists():
            print(f"skip {d}: no fixture there")
            continue
        print(f"{name}:")
        copied = copy_tokenizer(out, d)
        ref = load_json(d / "reference.json")
        ref["tokenizer_copied"] = copied
        ref["files"] = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}
        dump_json(d / "reference.json", ref)


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------

def print_summary(results: list[dict], out: Path, tie_threshold: float) -> None:
    banner("SUMMARY")
    for r in results:
        spec = r["spec"]
        print(f"\n### {spec.name}  ({spec.disk_dtype}, {'tied' if spec.tied else 'untied'}, "
              f"{'nested' if spec.nested else 'flat'}; seed {r['seed']}; writer: {r['writer']})")
        print(f"  elements on disk: {r['params']:,}")
        print("  files: " + ", ".join(f"{k} ({v:,} B)" for k, v in r["files"].items()))
        print(f"  tensors ({len(r['header'])}):")
        for k, (dt, shape, f) in sorted(r["header"].items()):
            print(f"    {k:70s} {dt:9s} {str(shape):14s} {f}")
        dtypes = sorted({v[0] for v in r["header"].values()})
        if len(dtypes) > 1:
            print(f"  WARNING: mixed dtypes on disk: {dtypes}")
        for p in r["per_prompt"]:
            tf = sum(p["greedy_tie_free"])
            print(f"  prompt {p['index']} (len {p['prompt_len']}): greedy {p['greedy']}")
            print(f"    max|logit| {p['max_abs_logit']:.4g}, logit std {p['logit_std']:.3g}, "
                  f"min greedy gap {min(p['greedy_gap']):.4g}, tie-free greedy steps {tf}/{len(p['greedy'])}, "
                  f"tie-free positions {len(p['tie_free_positions'])}/{len(p['tokens'])} (gap > {tie_threshold:g})")
            print(f"    greedy-step vs full-forward logits max|diff| "
                  f"{p['greedy_step_vs_full_forward_max_abs_diff']:.3g}")
        print(f"  final reload: {r['final']}")
        for n in spec.notes:
            print(f"  NOTE: {n}")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"\nTotal size of {out}: {total:,} bytes")
    if total > 4_500_000:
        print("WARNING: fixtures exceed ~4.5 MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"fixture root (default: {DEFAULT_OUT})")
    ap.add_argument("--only", nargs="*", default=None, help="model names to (re)make (default: all)")
    ap.add_argument("--tie-threshold", type=float, default=1e-3,
                    help="top1-top2 logit gap above which a position counts as tie-free")
    ap.add_argument("--new-tokens", type=int, default=8, help="greedy continuation length")
    ap.add_argument("--prompt-seed", type=int, default=12345)
    ap.add_argument("--max-attempts", type=int, default=16,
                    help="seeds to try per model until greedy output is varied, eos-free and tie-free")
    ap.add_argument("--min-greedy-gap", type=float, default=0.02,
                    help="seed acceptance: every greedy step's top1-top2 gap must be at least this")
    ap.add_argument("--min-distinct", type=int, default=5,
                    help="seed acceptance: distinct tokens required in each greedy continuation")
    ap.add_argument("--keep-vision-in-c", action="store_true",
                    help="keep model.visual.* in qwen35_gqa_f16 (default: strip them)")
    ap.add_argument("--allow-fast-kernels", action="store_true",
                    help="do not block the fla / causal_conv1d packages")
    ap.add_argument("--copy-tokenizer-only", action="store_true",
                    help="only copy <out>/tokenizer/tokenizer.json (+ tokenizer_config.json) into the "
                         "existing model directories and record it in reference.json (no torch needed)")
    args = ap.parse_args()

    if args.copy_tokenizer_only:
        copy_tokenizer_into_existing(args.out.resolve())
        return

    fast = block_fast_kernel_packages(args.allow_fast_kernels)

    global torch, transformers  # noqa: PLW0603
    import torch as _torch  # noqa: PLC0415
    import transformers as _transformers  # noqa: PLC0415
    torch, transformers = _torch, _transformers

    torch.set_num_threads(1)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
    except Exception as exc:  # noqa: BLE001
        print(f"note: use_deterministic_algorithms unavailable: {exc!r}")

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}
    for mod in ("safetensors", "tokenizers", "numpy", "huggingface_hub"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            versions[mod] = None
    versions["fast_kernel_packages_installed"] = fast
    versions["fast_kernel_packages_blocked"] = bool(fast) and not args.allow_fast_kernels
    print("versions:", json.dumps(versions))
    if not transformers.__version__.startswith("5."):
        print(f"WARNING: transformers {transformers.__version__}; this script targets 5.x (written for 5.17.0)")

    cls = qwen35_classes()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    specs = model_specs(args.keep_vision_in_c)
    if args.only:
        unknown = set(args.only) - {s.name for s in specs}
        if unknown:
            fail(f"unknown model(s) {sorted(unknown)}; choose from {[s.name for s in specs]}")
        specs = [s for s in specs if s.name in args.only]

    results = [make_model(spec, out, cls, args, versions) for spec in specs]
    print_summary(results, out, args.tie_threshold)
    print("\nDone.")


if __name__ == "__main__":
    main()
