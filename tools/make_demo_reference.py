#!/usr/bin/env python3
"""Compute the fp32 oracle for the bundled demo model (target + native MTP drafter).

Run once, on any machine with torch + transformers (>= 5, with qwen3_5) + tokenizers + safetensors
(no network, no GPU needed; everything is computed on the CPU in fp32):

    python3 tools/make_demo_reference.py      # reads models/qwen35-demo, writes tests/fixtures/demo_reference/

The weights are the shipped bf16 checkpoint upcast to fp32 (exactly the stored values). The model
and MTP definitions are imported from tools/train_demo_model.py (the script that trained the model),
so the MTP reference is computed exactly as it was trained.

Written (see reference.json for the full description of every tensor):

  tokens_i           int64 [32]        seq 0: first prompt of prompts.jsonl (+ target greedy tokens
                                       if it is shorter than 32 tokens); seq 1: heldout_sample.py
  logits_i           fp32  [32, V]     target logits
  hidden_i           fp32  [32, H]     final-normed hidden (model.norm output = last_hidden_state)
  prenorm_hidden_i   fp32  [32, H]     last decoder layer's output (model.norm input)
  mtp_logits_i       fp32  [31, V]     MTP row p (p = 0..30) from (embed(tokens[p+1]), hidden[p]) at
                                       rotary position p, causal over rows; predicts tokens[p+2]
  mtp_hidden_i       fp32  [31, H]     the MTP block output after mtp.norm (feeds the head)
  chain_tokens       int64 [4]         greedy depth-4 draft chain for seq 0 (see below)
  chain_logits       fp32  [4, V]

Chain (seq 0): MTP history rows 0..29 teacher-forced; step 0 is row 30 = (tokens[31], hidden[30]) at
position 30 -> out_0 -> d_0 = argmax; step j is row 30+j = (d_{j-1}, out_{j-1}) at position 30+j.
Every step is a full recompute over rows 0..30+j (no KV cache).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = REPO_ROOT / "tools" / "train_demo_model.py"
SEQ_LEN = 32
CHAIN_DEPTH = 4
CHAIN_HISTORY = 30          # MTP rows 0..29 teacher-forced before the chain starts at row 30
TOL = 1e-5                  # same inputs and shapes: should be (near) bit-exact
CROSS_TOL = 1e-4            # same values computed over a different number of rows/positions


def load_train_module():
    """Import tools/train_demo_model.py as a module (it blocks fla / causal_conv1d at import)."""
    spec = importlib.util.spec_from_file_location("train_demo_model", TRAIN_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


tdm = load_train_module()
torch = tdm.torch
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

check = tdm.check


def max_abs(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


# --------------------------------------------------------------------------------------------------
# Model loading
# --------------------------------------------------------------------------------------------------

def load_demo_model(model_dir: Path, attn: str):
    """Build the training script's target + MTP modules and load the shipped weights as fp32."""
    cfg_json = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text_json = cfg_json["text_config"]
    vocab, eos = int(text_json["vocab_size"]), int(text_json["eos_token_id"])
    cfg, model, mtp, _ = tdm.build_models(vocab, eos, attn, torch.device("cpu"))

    # The training script hard-codes the architecture: make sure config.json says the same.
    for k in tdm.TEXT_CONFIG_KEYS:
        got, want = getattr(cfg, k), text_json.get(k)
        if isinstance(got, tuple):
            got = list(got)
        check(got == want, f"config.json text_config[{k!r}] = {want!r}, the training script builds {got!r}")
    check(cfg_json.get("tie_word_embeddings") is True, "config.json: tie_word_embeddings is not true")

    disk = load_file(str(model_dir / "model.safetensors"))
    prefix = tdm.TEXT_PREFIX
    for k, v in disk.items():
        want = torch.float32 if tdm.keep_fp32(k) else torch.bfloat16
        check(v.dtype == want, f"{k} is {v.dtype} on disk, expected {want}")
        check(k.startswith(prefix) or k.startswith("mtp."), f"unexpected tensor name on disk: {k}")
    text_sd = {"model." + k[len(prefix):]: v.float() for k, v in disk.items() if k.startswith(prefix)}
    mtp_sd = {k[len("mtp."):]: v.float() for k, v in disk.items() if k.startswith("mtp.")}
    res = model.load_state_dict(text_sd, strict=False)
    check(set(res.missing_keys) <= {"lm_head.weight"} and not res.unexpected_keys,
          f"load: missing {res.missing_keys}, unexpected {res.unexpected_keys}")
    mtp.load_state_dict(mtp_sd, strict=True)
    check(model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
          "lm_head is not tied to embed_tokens after loading")

    # Every parameter must hold exactly the stored value (upcast to fp32).
    loaded = {**{prefix + k[len("model."):]: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
              **{"mtp." + k: v for k, v in mtp.state_dict().items()}}
    check(set(loaded) == set(disk), f"name sets differ: only on disk {sorted(set(disk) - set(loaded))[:5]}, "
          f"only in the model {sorted(set(loaded) - set(disk))[:5]}")
    for k, v in disk.items():
        check(loaded[k].dtype == torch.float32 and torch.equal(loaded[k], v.float()),
              f"loaded {k} differs from the stored tensor")
    model.eval()
    mtp.eval()
    print(f"  loaded {len(disk)} tensors from {model_dir / 'model.safetensors'} (fp32 upcast, exact); "
          f"attention {model.config._attn_implementation!r}")
    return model, mtp, cfg_json


# --------------------------------------------------------------------------------------------------
# Forward passes
# --------------------------------------------------------------------------------------------------

def target_forward(model, tokens):
    """One forward of the text model over tokens [L]. Returns (logits, hidden, prenorm_hidden), [L, *]."""
    captured = {}

    def norm_hook(_m, inputs, output):
        captured["prenorm"] = inputs[0]
        captured["normed"] = output

    def layer_hook(_m, _inputs, output):
        captured["last_layer"] = output[0] if isinstance(output, tuple) else output

    hooks = [model.model.norm.register_forward_hook(norm_hook),
             model.model.layers[-1].register_forward_hook(layer_hook)]
    try:
        out = model.model(input_ids=tokens[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    hidden = out.last_hidden_state[0]
    check(torch.equal(captured["normed"][0], hidden), "last_hidden_state is not the output of model.norm")
    prenorm = captured["prenorm"][0]
    check(torch.equal(captured["last_layer"][0], prenorm),
          "model.norm's input is not the last decoder layer's output")
    d_norm = max_abs(model.model.norm(prenorm), hidden)
    check(d_norm <= TOL, f"model.norm(prenorm) differs from hidden by {d_norm:.2e}")
    logits = model.lm_head(hidden)
    return logits, hidden, prenorm


def mtp_forward(model, mtp, emb_next, hidden_prev):
    """MTP rows 0..n-1 at rotary positions 0..n-1, causal over rows, exactly as joint_forward does.
    emb_next [n, H] = embed(x_{p+1}), hidden_prev [n, H] = h_p. Returns (mtp_hidden [n, H], logits [n, V])."""
    n = emb_next.shape[0]
    pos = torch.arange(n).unsqueeze(0)                 # [1, n]
    pos3 = pos.unsqueeze(0).expand(3, -1, -1)          # text-only mrope: t = h = w = p
    position_embeddings = model.model.rotary_emb(emb_next[None], pos3)
    out = mtp(emb_next[None], hidden_prev[None], position_embeddings, tdm.causal_additive_mask(n, "cpu"), pos)
    out = out[0]
    return out, model.lm_head(out)


def greedy_extend(model, tokens: list[int], length: int) -> list[int]:
    """Append the target's greedy tokens (full recompute each step, ties -> lowest id) up to `length`."""
    tokens = list(tokens)
    while len(tokens) < length:
        logits, _, _ = target_forward(model, torch.tensor(tokens, dtype=torch.long))
        tokens.append(int(logits[-1].argmax()))
    return tokens


def draft_chain(model, mtp, tokens, hidden, history: int, depth: int):
    """Greedy MTP draft chain by full recompute: rows 0..history-1 teacher-forced from the sequence,
    then row history+j = (d_{j-1}, out_{j-1}) with (d_{-1}, out_{-1}) = (tokens[history+1], hidden[history])."""
    embed = model.model.embed_tokens
    emb_rows = embed(tokens[1:history + 1])            # embed(x_{p+1}), p = 0..history-1
    hid_rows = hidden[:history]                        # h_p
    ref_hidden, _ = mtp_forward(model, mtp, emb_rows, hid_rows)
    next_tok, next_h = tokens[history + 1], hidden[history]
    chain_tokens, chain_logits, chain_hidden = [], [], []
    worst_hist = 0.0
    for _ in range(depth):
        emb_rows = torch.cat([emb_rows, embed(next_tok.reshape(1))], dim=0)
        hid_rows = torch.cat([hid_rows, next_h.reshape(1, -1)], dim=0)
        out, logits = mtp_forward(model, mtp, emb_rows, hid_rows)
        # Causality: the history rows must not change when chain rows are appended.
        worst_hist = max(worst_hist, max_abs(out[:history], ref_hidden))
        d = logits[-1].argmax()
        chain_tokens.append(int(d))
        chain_logits.append(logits[-1])
        chain_hidden.append(out[-1])
        next_tok, next_h = d, out[-1]
    check(worst_hist <= CROSS_TOL, f"MTP history rows changed by {worst_hist:.2e} when chain rows were appended")
    return (torch.tensor(chain_tokens, dtype=torch.long), torch.stack(chain_logits), torch.stack(chain_hidden),
            worst_hist)


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------

def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "qwen35-demo",
                    help="demo model directory (default models/qwen35-demo)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "demo_reference",
                    help="output directory (default tests/fixtures/demo_reference)")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                    help="attention implementation for the reference (default eager)")
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()

    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir, out_dir = args.model.resolve(), args.out.resolve()
    vers = tdm.versions()
    print(f"versions: {vers}")
    print(f"model {model_dir}; out {out_dir}; CPU fp32, {args.threads} threads")

    tdm.banner("load")
    model, mtp, cfg_json = load_demo_model(model_dir, args.attn)
    vocab = int(cfg_json["text_config"]["vocab_size"])
    hsize = int(cfg_json["text_config"]["hidden_size"])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    with torch.no_grad():
        tdm.banner("sequences")
        first_line = (model_dir / "prompts.jsonl").read_text(encoding="utf-8").splitlines()[0]
        prompt = json.loads(first_line)
        prompt_ids = tok.encode(prompt["prompt"], add_special_tokens=False).ids
        seq0 = greedy_extend(model, prompt_ids[:SEQ_LEN], SEQ_LEN)
        n_prompt0 = min(len(prompt_ids), SEQ_LEN)
        # Read bytes and decode: no newline translation (the training run tokenized the raw text).
        sample_text = (model_dir / "heldout_sample.py").read_bytes().decode("utf-8")
        sample_ids = tok.encode(sample_text, add_special_tokens=False).ids
        check(len(sample_ids) >= SEQ_LEN, f"heldout_sample.py has only {len(sample_ids)} tokens")
        seq1 = sample_ids[:SEQ_LEN]
        seqs = [torch.tensor(seq0, dtype=torch.long), torch.tensor(seq1, dtype=torch.long)]
        sources = [
            {"source": f"prompts.jsonl line 1 (id {prompt['id']!r}, {prompt['source']}:{prompt['function']})",
             "prompt_tokens_total": len(prompt_ids), "prompt_tokens_used": n_prompt0,
             "greedy_tokens_appended": SEQ_LEN - n_prompt0},
            {"source": "heldout_sample.py (teacher text)", "file_tokens_total": len(sample_ids)},
        ]
        for i, s in enumerate(seqs):
            check(int(s.min()) >= 0 and int(s.max()) < vocab, f"seq {i}: token id out of range")
            print(f"  seq {i}: {sources[i]['source']}: {s.tolist()}")
            print(f"         text {tok.decode(s.tolist(), skip_special_tokens=False)!r}")
        print(f"  seq 0: {n_prompt0} prompt tokens (of {len(prompt_ids)}) + {SEQ_LEN - n_prompt0} greedy tokens")

        tdm.banner("target + teacher-forced MTP")
        tensors, per_seq = {}, []
        for i, toks in enumerate(seqs):
            logits, hidden, prenorm = target_forward(model, toks)
            full = model(input_ids=toks[None], use_cache=False).logits[0]
            d_full = max_abs(full, logits)
            check(d_full <= TOL, f"seq {i}: Qwen3_5ForCausalLM logits differ from lm_head(hidden) by {d_full}")

            emb_next = model.model.embed_tokens(toks[1:])          # embed(x_{p+1}), p = 0..30
            mtp_hidden, mtp_logits = mtp_forward(model, mtp, emb_next, hidden[:-1])

            # Cross-check against the training script's own joint_forward (window = the 32 tokens:
            # target positions 0..30, MTP rows 0..29).
            jl, jm = tdm.joint_forward(model, mtp, toks[None])
            d_jl, d_jm = max_abs(jl[0], logits[:-1]), max_abs(jm[0], mtp_logits[:-1])
            check(d_jl <= CROSS_TOL and d_jm <= CROSS_TOL,
                  f"seq {i}: differs from train_demo_model.joint_forward: target {d_jl:.2e}, MTP {d_jm:.2e}")

            check(tuple(logits.shape) == (SEQ_LEN, vocab) and tuple(hidden.shape) == (SEQ_LEN, hsize)
                  and tuple(mtp_logits.shape) == (SEQ_LEN - 1, vocab)
                  and tuple(mtp_hidden.shape) == (SEQ_LEN - 1, hsize), f"seq {i}: unexpected shapes")
            for name, t in (("logits", logits), ("hidden", hidden), ("prenorm_hidden", prenorm),
                            ("mtp_logits", mtp_logits), ("mtp_hidden", mtp_hidden)):
                check(bool(torch.isfinite(t).all()), f"seq {i}: {name} has non-finite values")
                tensors[f"{name}_{i}"] = t.float().contiguous()
            tensors[f"tokens_{i}"] = toks.clone()

            t_top1 = logits.argmax(-1)
            m_top1 = mtp_logits.argmax(-1)
            agree = (m_top1 == t_top1[1:])                         # row p vs target argmax at p+1
            mtp_true = (m_top1[:-1] == toks[2:])                   # row p vs x_{p+2}, p = 0..29
            tgt_true = (t_top1[:-1] == toks[1:])                   # position p vs x_{p+1}
            sorted_t = logits.sort(-1, descending=True).values
            min_gap = (sorted_t[:, 0] - sorted_t[:, 1]).min().item()
            sorted_m = mtp_logits.sort(-1, descending=True).values
            min_gap_m = (sorted_m[:, 0] - sorted_m[:, 1]).min().item()
            rec = {
                **sources[i],
                "tokens": toks.tolist(),
                "text": tok.decode(toks.tolist(), skip_special_tokens=False),
                "target_top1": t_top1.tolist(),
                "mtp_top1": m_top1.tolist(),
                "mtp_agree_with_target_argmax": round(agree.float().mean().item(), 4),
                "mtp_agree_rows": agree.int().tolist(),
                "mtp_top1_vs_true_next_next_token": round(mtp_true.float().mean().item(), 4),
                "target_top1_vs_true_next_token": round(tgt_true.float().mean().item(), 4),
                "min_top1_top2_logit_gap_target": min_gap,
                "min_top1_top2_logit_gap_mtp": min_gap_m,
                "checks": {"causal_lm_logits_max_abs_diff": d_full, "joint_forward_target_max_abs_diff": d_jl,
                           "joint_forward_mtp_max_abs_diff": d_jm},
            }
            per_seq.append(rec)
            print(f"  seq {i}: MTP agreement with target argmax {rec['mtp_agree_with_target_argmax']:.3f} "
                  f"({int(agree.sum())}/{agree.numel()}); MTP top-1 vs true x[p+2] "
                  f"{rec['mtp_top1_vs_true_next_next_token']:.3f}; target top-1 vs true "
                  f"{rec['target_top1_vs_true_next_token']:.3f}")
            print(f"         checks: ForCausalLM {d_full:.1e}, joint_forward target {d_jl:.1e} / MTP {d_jm:.1e}; "
                  f"min top1-top2 gap target {min_gap:.3e}, MTP {min_gap_m:.3e}")

        tdm.banner("draft chain (seq 0)")
        toks0, hidden0 = seqs[0], tensors["hidden_0"]
        chain_tokens, chain_logits, chain_hidden, worst_hist = draft_chain(
            model, mtp, toks0, hidden0, CHAIN_HISTORY, CHAIN_DEPTH)
        d_row30 = max_abs(chain_logits[0], tensors["mtp_logits_0"][CHAIN_HISTORY])
        d_row30_h = max_abs(chain_hidden[0], tensors["mtp_hidden_0"][CHAIN_HISTORY])
        check(d_row30 <= TOL and d_row30_h <= TOL,
              f"chain step 0 differs from teacher-forced MTP row {CHAIN_HISTORY}: logits {d_row30:.2e}, "
              f"hidden {d_row30_h:.2e}")
        tensors["chain_tokens"] = chain_tokens
        tensors["chain_logits"] = chain_logits.float().contiguous()
        sorted_c = chain_logits.sort(-1, descending=True).values
        chain_gaps = (sorted_c[:, 0] - sorted_c[:, 1]).tolist()
        pending = int(toks0[CHAIN_HISTORY + 1])
        pending_is_greedy = pending == int(tensors["logits_0"][CHAIN_HISTORY].argmax())
        print(f"  pending tokens[31] = {pending} (target greedy at position 30: {pending_is_greedy}); "
              f"chain {chain_tokens.tolist()} = {tok.decode(chain_tokens.tolist(), skip_special_tokens=False)!r}")
        print(f"  step 0 vs teacher-forced mtp row 30: logits {d_row30:.1e}, hidden {d_row30_h:.1e}; "
              f"history rows unchanged within {worst_hist:.1e}; top1-top2 gaps {[round(g, 4) for g in chain_gaps]}")

    tdm.banner("write")
    out_dir.mkdir(parents=True, exist_ok=True)
    st_path = out_dir / "reference.safetensors"
    save_file(tensors, str(st_path), metadata={"format": "pt", "model": "qwen35-demo",
                                                "generator": "tools/make_demo_reference.py"})

    def spec(name: str, meaning: str) -> dict:
        t = tensors[name]
        return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "meaning": meaning}

    tensor_doc = {}
    for i in range(len(seqs)):
        tensor_doc.update({
            f"tokens_{i}": spec(f"tokens_{i}", f"sequence {i} token ids (see sequences[{i}])"),
            f"logits_{i}": spec(f"logits_{i}", "target logits at positions 0..31 (row p predicts tokens[p+1]); "
                                               "one forward of the whole sequence, tied head"),
            f"hidden_{i}": spec(f"hidden_{i}", "target final-normed hidden (output of model.norm = "
                                               "last_hidden_state); logits = hidden @ embed^T"),
            f"prenorm_hidden_{i}": spec(f"prenorm_hidden_{i}", "last decoder layer's output before the final "
                                                               "norm (model.norm input)"),
            f"mtp_logits_{i}": spec(f"mtp_logits_{i}", "teacher-forced MTP logits, row p = 0..30 from "
                                    "(embed(tokens[p+1]), hidden[p]) at rotary position p, causal over rows; "
                                    "row p predicts tokens[p+2]"),
            f"mtp_hidden_{i}": spec(f"mtp_hidden_{i}", "MTP block output after mtp.norm for rows 0..30 (feeds "
                                    "the tied head; the hidden a chained draft step reuses as its h)"),
        })
    tensor_doc["chain_tokens"] = spec("chain_tokens", "greedy MTP draft chain d_0..d_3 for sequence 0")
    tensor_doc["chain_logits"] = spec("chain_logits", "MTP logits of chain steps 0..3 (step j is MTP row 30+j "
                                      "at rotary position 30+j); chain_logits[0] == mtp_logits_0[30]")

    model_file = model_dir / "model.safetensors"
    info = {
        "description": "fp32 CPU oracle for models/qwen35-demo: target logits/hiddens, teacher-forced native MTP "
                       "and a greedy MTP draft chain. Weights: the shipped bf16 checkpoint upcast to fp32 "
                       "(A_log/dt_bias stored fp32). Model + MTP code imported from tools/train_demo_model.py.",
        "generator": "tools/make_demo_reference.py",
        "model": {"dir": str(model_dir.relative_to(REPO_ROOT)) if model_dir.is_relative_to(REPO_ROOT)
                  else str(model_dir),
                  "model_safetensors_sha256": sha256_of(model_file),
                  "model_safetensors_bytes": model_file.stat().st_size,
                  "vocab_size": vocab, "hidden_size": hsize},
        "compute": {"device": "cpu", "dtype": "float32", "threads": args.threads, "attn_implementation": args.attn,
                    "target": "transformers Qwen3_5ForCausalLM (pure-torch Gated DeltaNet), use_cache=False",
                    "argmax_ties": "lowest id (torch.argmax)"},
        "convention": {
            "hidden": "final-normed (model.norm output); prenorm_hidden_i is given for drafters configured "
                      "for the pre-norm tap, but the MTP here was trained on and fed the final-normed hidden",
            "mtp_row": "row p = mtp.norm(decoder_layer(fc(concat(pre_fc_norm_embedding(embed(tokens[p+1])), "
                       "pre_fc_norm_hidden(hidden[p]))))) -- embedding first in the concat",
            "rotary_position": "MTP row p sits at rotary position p (text mrope: t = h = w = p); rows attend "
                               "causally to rows <= p through the MTP layer's own attention",
            "prediction": "MTP row p predicts tokens[p+2]; its logits use the tied head (embed_tokens)",
            "agreement": "argmax(mtp_logits[p]) == argmax(logits[p+1]) (depth-1 acceptance at T=0)",
        },
        "chain": {
            "sequence": 0,
            "history_rows": f"MTP rows 0..{CHAIN_HISTORY - 1} teacher-forced from tokens_0 / hidden_0",
            "pending_token": pending,
            "pending_is_target_greedy_at_position_30": pending_is_greedy,
            "h_true": f"hidden_0[{CHAIN_HISTORY}]",
            "steps": f"step 0 = row {CHAIN_HISTORY} = (tokens_0[{CHAIN_HISTORY + 1}], hidden_0[{CHAIN_HISTORY}]) "
                     f"at position {CHAIN_HISTORY} -> out_0 (after mtp.norm) -> d_0 = argmax; step j = "
                     f"(d_(j-1), out_(j-1)) at position {CHAIN_HISTORY}+j -> d_j; step j attends to rows "
                     f"0..{CHAIN_HISTORY}+j",
            "depth": CHAIN_DEPTH,
            "computed_by": "full recompute over the growing row sequence (no KV cache)",
            "chain_tokens": chain_tokens.tolist(),
            "chain_text": tok.decode(chain_tokens.tolist(), skip_special_tokens=False),
            "chain_top1_top2_logit_gaps": chain_gaps,
        },
        "sequences": per_seq,
        "self_checks": {
            "weights_equal_stored_values": True,
            "last_hidden_state_is_model_norm_output": True,
            "prenorm_is_last_layer_output": True,
            "chain_step0_vs_mtp_row30_logits_max_abs_diff": d_row30,
            "chain_step0_vs_mtp_row30_hidden_max_abs_diff": d_row30_h,
            "chain_history_rows_unchanged_max_abs_diff": worst_hist,
            "tolerance_same_inputs": TOL,
            "tolerance_cross_checks": CROSS_TOL,
        },
        "tensors": tensor_doc,
        "versions": vers,
    }
    json_path = out_dir / "reference.json"
    tdm.write_json(json_path, info)

    tdm.banner("summary")
    total = 0
    for p in (st_path, json_path):
        size = p.stat().st_size
        total += size
        print(f"  {p} ({size:,} bytes)")
    check(total < 3 * 1000 * 1000, f"output is {total:,} bytes (>= 3 MB)")
    for i, rec in enumerate(per_seq):
        print(f"  seq {i}: MTP agreement with target argmax {rec['mtp_agree_with_target_argmax']:.3f}, "
              f"MTP top-1 vs true {rec['mtp_top1_vs_true_next_next_token']:.3f}, target top-1 vs true "
              f"{rec['target_top1_vs_true_next_token']:.3f}")
    print(f"  chain (seq 0, pending {pending}): {chain_tokens.tolist()}")
    print(f"  total {total:,} bytes; {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
