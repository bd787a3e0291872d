#!/usr/bin/env python3
"""Train an EAGLE-3 draft head for the bundled demo model (models/qwen35-demo, frozen) and compare it with
the demo's own MTP layer. Runs on a GPU machine with torch + transformers (>= 5, with qwen3_5) +
tokenizers + safetensors, no network, after tools/train_demo_model.py has written models/qwen35-demo/:

    PYTHONUNBUFFERED=1 python3 tools/train_eagle3_head.py              # writes models/qwen35-demo-eagle3/
    python3 tools/train_eagle3_head.py --smoke                         # every stage at toy sizes, about a
                                                                       # minute (most of it the corpus walk);
                                                                       # writes /tmp/qwen35-demo-eagle3-smoke/

The whole default run takes about --minutes (4.6) + 1 minute on an H100/H200 (corpus walk and encoding,
draft vocabulary, evaluation with fp32 greedy generation).
Stages (each checks what it can; any surprise stops the run with a message):

  1. corpus     tools/train_demo_model.py's collect_corpus with the demo's own arguments (read from
                models/qwen35-demo/training.json: its --site-packages roots and byte budget, the codec-table
                rule), so the files and the sha1(path) held-out / validation / train split are the demo's;
                the held-out and validation file lists must equal the demo's (--allow-split-mismatch to go
                on). The held-out split is never trained on and does not choose the draft vocabulary.
  2. tokenizer  models/qwen35-demo/tokenizer.json (not retrained).
  3. target     the demo checkpoint (bf16 upcast, frozen) through make_demo_reference.load_demo_model;
                taps at --taps (default [3, 5, 7]) = output_hidden_states entries, checked equal to the
                decoder layers' inputs. vLLM's default [2, L/2, L-3] = [2, 4, 5] with 2048 draft ids lost
                to the demo's MTP at every depth (BENCHMARKS.md).
  4. vocabulary the draft vocabulary (--draft-vocab, default 3072 of 4096): ids 0, 1, 2 (<|endoftext|>,
                <|im_start|>, <|im_end|>: a chain can propose the end of a text and chat turns), then the
                ids the target itself predicts most often (its greedy choice) over --vocab-tokens tokens of
                train windows, ties by corpus frequency in the train split, then by id. Only target-greedy
                tokens can be accepted at temperature 0, so this keeps the most acceptable ones.
  5. training   EAGLE-3's objective: for K = --ttt-steps (4) training-time-test steps, soft cross-entropy
                between the head's draft distribution and the target's next-token distribution restricted
                to the draft vocabulary (renormalised), at positions where the target's greedy token is in
                the draft vocabulary; step j weighted --ttt-decay^j (0.8). The TTT forward is
                eagle3_head.Eagle3Head.ttt_forward: step j of anchor p reads x_{p+j+1} and the head's own
                out_{j-1}, and attends exactly as a chain does at inference. AdamW, bf16 autocast, cosine
                schedule over --minutes; the best validation checkpoint is kept.
  6. export     config.json + model.safetensors in the published EAGLE-3 layout (bf16, d2t int64, t2d bool,
                no embed_tokens: the target's is used), README.md (model card), training.json; under 6 MB.
  7. reload     the saved directory into a fresh head: every tensor equals the trained one rounded to bf16
                and its logits equal the rounded in-memory head's.
  8. evaluation on held-out text, fp32 (TF32 off), with the SHIPPED weights, for the head and the demo's
                MTP layer alike: prompts of --eval-prompt held-out tokens continued by --eval-gen tokens of
                the target's own greedy decoding; at every anchor of the continuation a chain of depth 6 is
                drafted with the true taps / hiddens of the context (teacher forced) and checked against the
                target's greedy tokens. Reported per chain position j = 1..6: the fraction accepted given
                that positions 1..j-1 were (the chain's tokens after a miss do not count), and the expected
                number of accepted proposals at depth D = 1..6 (sum over j <= D of P(1..j accepted); tokens
                per round = 1 + that). On these sequences the target's greedy token equals the next token,
                so the TTT forward with true tokens is exactly the chain with its own tokens up to the first
                miss (checked on sampled anchors against real chains). Also the depth-1 agreement on held-out
                windows of true text (the number train_demo_model.py reports for MTP).

The MTP is evaluated with its chain rows attending to MTP rows built from the TRUE hiddens of the
context; tandem's MTP drafter keeps the rows it drafted for accepted positions instead, so its measured
acceptance can differ slightly. The benchmark measures both drafters in the engine.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

# make_demo_reference imports tools/train_demo_model.py first (offline environment, pure-torch Gated
# DeltaNet, torch / transformers / tokenizers) and loads the demo checkpoint as its reference does.
import make_demo_reference as mdr  # noqa: E402
import eagle3_head as e3  # noqa: E402

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

tdm = mdr.tdm
fail, check, banner, write_json, _nullctx = tdm.fail, tdm.check, tdm.banner, tdm.write_json, tdm._nullctx

REPO_ROOT = TOOLS.parent
DEMO = REPO_ROOT / "models" / "qwen35-demo"
DEFAULT_OUT = REPO_ROOT / "models" / "qwen35-demo-eagle3"
SMOKE_OUT = Path("/tmp/qwen35-demo-eagle3-smoke")
FORCED_IDS = (0, 1, 2)
MAX_DIR_BYTES = 6_000_000
SITE_BYTES_DEFAULT = 60_000_000   # train_demo_model.py's --site-packages-bytes default


def autocast_ctx(enabled: bool):
    return torch.autocast(device_type="cuda", dtype=torch.bfloat16) if enabled else _nullctx()


# --------------------------------------------------------------------------------------------------
# 1-2. Corpus and tokenizer: the demo's
# --------------------------------------------------------------------------------------------------

def demo_corpus_args(info: dict) -> dict:
    """collect_corpus arguments of the demo's own run, from its training.json."""
    data = info["data"]
    budget = SITE_BYTES_DEFAULT
    argv = shlex.split(info.get("command", ""))
    for i, a in enumerate(argv):
        if a == "--site-packages-bytes" and i + 1 < len(argv):
            budget = int(argv[i + 1])
        elif a.startswith("--site-packages-bytes="):
            budget = int(a.split("=", 1)[1])
    return {"site_packages": [r["root"] for r in data.get("site_packages", [])], "site_budget": budget,
            "keep_codec_tables": not data.get("codec_tables_excluded", True)}


def compare_split(corpus: dict, info: dict, allow: bool) -> dict:
    res = {}
    for name in ("heldout", "validation"):
        mine = [f["rel"] for f in corpus[name]]
        theirs = info["data"][name].get("file_list", [])
        same = mine == theirs
        res[f"{name}_equal_to_demo"] = same
        if not same:
            msg = (f"the {name} split differs from {DEMO / 'training.json'}: only here "
                   f"{sorted(set(mine) - set(theirs))[:5]}, only there {sorted(set(theirs) - set(mine))[:5]} "
                   "(pass the demo's --site-packages, see its training.json 'command')")
            if not allow:
                fail(msg)
            print(f"  WARNING: {msg}")
    n_train = len(corpus["train"])
    res["train_files"], res["demo_train_files"] = n_train, info["data"]["train"]["files"]
    if n_train != info["data"]["train"]["files"]:
        print(f"  WARNING: {n_train} train files here, the demo trained on {info['data']['train']['files']}")
    return res


# --------------------------------------------------------------------------------------------------
# 3. Target
# --------------------------------------------------------------------------------------------------

@torch.no_grad()
def target_outputs(model, ids: torch.Tensor, taps: list, use_autocast: bool):
    """(taps [B, T, n*H], final-normed hidden [B, T, H], logits [B, T, V]) of the frozen target."""
    with autocast_ctx(use_autocast):
        tapped, last = e3.target_taps(model.model, ids, taps)
        logits = model.lm_head(last)
    return tapped, last, logits


@torch.no_grad()
def check_taps(model, ids: torch.Tensor, taps: list) -> None:
    hooked, tapped = e3.taps_by_hooks(model.model, ids, taps)
    d = (tapped.float() - hooked.float()).abs().max().item()
    check(d == 0.0, f"output_hidden_states entries {taps} differ from the decoder layers' inputs by {d:.2e}")
    print(f"  taps {taps}: output_hidden_states entries equal the inputs of those decoder layers "
          f"(shape {tuple(tapped.shape)}, rms {tapped.float().pow(2).mean().sqrt().item():.3f})")


# --------------------------------------------------------------------------------------------------
# 4. Draft vocabulary
# --------------------------------------------------------------------------------------------------

@torch.no_grad()
def choose_draft_vocab(model, train_ids: torch.Tensor, vocab: int, args, device) -> tuple[torch.Tensor, dict]:
    corpus = torch.bincount(train_ids, minlength=vocab).cpu()
    greedy = torch.zeros(vocab, dtype=torch.int64)
    gen = torch.Generator().manual_seed(args.seed + 1)
    n = train_ids.numel()
    windows = max(1, args.vocab_tokens // args.seq)
    starts = torch.randint(0, n - args.seq, (windows,), generator=gen)
    offsets = torch.arange(args.seq, device=device)
    for i in range(0, windows, args.batch):
        w = train_ids[starts[i:i + args.batch].to(device)[:, None] + offsets[None, :]]
        with autocast_ctx(device.type == "cuda"):
            logits = model.lm_head(model.model(input_ids=w, use_cache=False).last_hidden_state)
        greedy += torch.bincount(logits.argmax(-1).flatten(), minlength=vocab).cpu()
    # Order: greedy count, then corpus count (both descending), then id (the stable sorts keep it).
    by_corpus = torch.sort(corpus, descending=True, stable=True).indices
    order = by_corpus[torch.sort(greedy[by_corpus], descending=True, stable=True).indices]
    forced = list(FORCED_IDS)
    chosen = forced + [i for i in order.tolist() if i not in forced][:args.draft_vocab - len(forced)]
    ids = torch.tensor(sorted(chosen), dtype=torch.int64)
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids] = True
    info = {
        "size": args.draft_vocab,
        "rule": f"ids {forced} (<|endoftext|>, <|im_start|>, <|im_end|>), then by the target's greedy-token "
                f"count over {windows * args.seq:,} tokens of random train windows, ties by train-split token "
                "frequency, then by id; sorted ascending (draft id i = the i-th smallest target id)",
        "greedy_tokens_counted": int(greedy.sum()),
        "greedy_distinct_ids": int((greedy > 0).sum()),
        "greedy_mass_covered_train": float(greedy[mask].sum()) / max(1, int(greedy.sum())),
        "corpus_mass_covered_train": float(corpus[mask].sum()) / max(1, int(corpus.sum())),
        "forced_ids": forced,
        "forced_ids_greedy_counts": [int(greedy[i]) for i in forced],
    }
    print(f"  draft vocabulary {args.draft_vocab}: covers {info['greedy_mass_covered_train']:.4f} of the target's "
          f"greedy tokens ({info['greedy_distinct_ids']} distinct ids seen) and "
          f"{info['corpus_mass_covered_train']:.4f} of the train tokens")
    return ids, info


# --------------------------------------------------------------------------------------------------
# 5. Training
# --------------------------------------------------------------------------------------------------

def build_head(args, cfg_json: dict, model, draft_ids: torch.Tensor, device) -> e3.Eagle3Head:
    text = cfg_json["text_config"]
    h = int(text["hidden_size"])
    cfg = e3.Eagle3Config(
        hidden_size=h, intermediate_size=args.intermediate, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=int(text["vocab_size"]),
        draft_vocab_size=args.draft_vocab, target_hidden_size=h, tap_layers=list(args.taps),
        rms_norm_eps=float(text["rms_norm_eps"]), rope_theta=args.rope_theta,
        max_position_embeddings=int(text["max_position_embeddings"]), has_embed_tokens=False)
    head = e3.Eagle3Head(cfg)
    head.init_random(torch.Generator().manual_seed(args.seed), std=args.init_std)
    head.set_draft_vocab(draft_ids)
    with torch.no_grad():
        # Start from the target's own head: its tied embedding rows of the draft ids, and its final
        # norm (zero-centred, y = x^ (1 + w)) as the Llama norm's weight 1 + w.
        emb = model.model.embed_tokens.weight.detach().float().cpu()
        head.lm_head.weight.copy_(emb[draft_ids])
        head.norm.weight.copy_(1.0 + model.model.norm.weight.detach().float().cpu())
    head.to(device)
    head.attach_target_embedding(model.model.embed_tokens.weight)
    n_params = sum(p.numel() for p in head.parameters())
    print(f"  head: H {h}, I {args.intermediate}, heads {args.heads} / kv {args.kv_heads} / hd {args.head_dim}, "
          f"taps {args.taps}, Vd {args.draft_vocab}; {n_params:,} parameters (bf16 {n_params * 2 / 1e6:.2f} MB)")
    return head


def ttt_losses(head: e3.Eagle3Head, tokens: torch.Tensor, taps: torch.Tensor, logits_t: torch.Tensor,
               steps: int, decay: float):
    """EAGLE-3 TTT loss over windows tokens [B, T] with the target's taps and logits [B, T, V].
    Returns (weighted mean loss, per-step [loss, agreement, cumulative agreement] as 0-d tensors).
    agreement: the head's d2t-mapped argmax equals the target's greedy token at that position (true-text
    inputs); cumulative: and every earlier step of the same anchor agreed."""
    t = tokens.shape[1]
    n = t - 1
    outs = head.ttt_forward(tokens, taps, steps)
    t_arg = logits_t.argmax(-1)
    t_p = logits_t[..., head.draft_ids()].float().softmax(-1)   # restricted to the draft ids, renormalised
    total, wsum, stats, prev = 0.0, 0.0, [], None
    for j, out in enumerate(outs):
        m = n - j                                   # anchors p = 0..n-1-j have a label at p+j+1 <= t-1
        lg = head.logits(out[:, :m]).float()
        lab = slice(j + 1, j + 1 + m)
        keep = head.t2d[t_arg[:, lab]].float()      # the target's greedy token is a draft id
        ce = -(t_p[:, lab] * lg.log_softmax(-1)).sum(-1)
        loss_j = (ce * keep).sum() / keep.sum().clamp(min=1.0)
        w = decay ** j
        total, wsum = total + w * loss_j, wsum + w
        ok = head.to_target(lg.argmax(-1)) == t_arg[:, lab]
        cum = ok if prev is None else ok & prev[:, :m]
        prev = cum
        stats.append((loss_j.detach(), ok.float().mean().detach(), cum.float().mean().detach()))
    return total / wsum, stats


@torch.no_grad()
def validate(head, model, windows: torch.Tensor, args, use_autocast: bool, batch: int = 16) -> dict:
    head.eval()
    loss = 0.0
    per = [[0.0, 0.0, 0.0] for _ in range(args.ttt_steps)]
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        taps, _, lt = target_outputs(model, w, args.taps, use_autocast)
        with autocast_ctx(use_autocast):
            l, stats = ttt_losses(head, w, taps, lt, args.ttt_steps, args.ttt_decay)
        loss += l.item() * w.shape[0]
        for j, s in enumerate(stats):
            for k in range(3):
                per[j][k] += s[k].item() * w.shape[0]
    head.train()
    k = windows.shape[0]
    return {"loss": loss / k, "step_loss": [p[0] / k for p in per], "agree": [p[1] / k for p in per],
            "cum_agree": [p[2] / k for p in per]}


def train(head, model, train_ids: torch.Tensor, val_windows: torch.Tensor, args, device) -> dict:
    decay, no_decay = [], []
    for _, p in head.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    params = decay + no_decay
    opt, opt_kind = tdm.make_optimizer(groups, args.lr, device)
    use_ac = device.type == "cuda"
    gen = torch.Generator().manual_seed(args.seed)
    seq, batch, n = args.seq, args.batch, train_ids.numel()
    check(n > seq + 1, f"training stream too short ({n} tokens) for seq {seq}")
    offsets = torch.arange(seq, device=device)
    budget = args.minutes * 60.0
    history, val_history = [], []
    step, tokens_seen, oom_events = 0, 0, 0
    run, run_n, best = None, 0, None
    print(f"  AdamW ({opt_kind}) lr {args.lr} betas (0.9, 0.95) wd {args.weight_decay} (matrices); warmup "
          f"{args.warmup} then cosine to {args.min_lr_ratio} x over {args.minutes} min"
          f"{f' / {args.steps_max} steps' if args.steps_max else ''}; batch {batch} x seq {seq}; TTT steps "
          f"{args.ttt_steps}, decay {args.ttt_decay}; autocast {'bf16' if use_ac else 'off'}")

    def do_val():
        nonlocal best
        v = validate(head, model, val_windows, args, use_ac)
        v.update(step=step, epoch=round(tokens_seen / n, 3), elapsed_s=round(time.time() - t0, 1))
        val_history.append(v)
        is_best = best is None or v["loss"] < best[0]
        print(f"  [validation @ {step}] loss {v['loss']:.4f}  agree {[round(a, 3) for a in v['agree']]}  "
              f"cumulative {[round(a, 3) for a in v['cum_agree']]}{'  (best)' if is_best else ''}")
        if is_best:
            best = (v["loss"], step, {k: t.detach().clone() for k, t in head.state_dict().items()})

    head.train()
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
        lr = tdm.lr_at(step, progress, args.lr, args.warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n - seq, (batch,), generator=gen).to(device)
        w = train_ids[starts[:, None] + offsets[None, :]]
        try:
            taps, _, lt = target_outputs(model, w, args.taps, use_ac)
            with autocast_ctx(use_ac):
                loss, stats = ttt_losses(head, w, taps, lt, args.ttt_steps, args.ttt_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip)
            opt.step()
        except torch.cuda.OutOfMemoryError:
            oom_events += 1
            opt.zero_grad(set_to_none=True)
            loss = stats = taps = lt = None
            torch.cuda.empty_cache()
            check(batch > 2, "out of GPU memory even at batch 2")
            batch //= 2
            print(f"  OOM at step {step}: halving the batch to {batch}")
            continue
        step += 1
        tokens_seen += batch * seq
        tok_log += batch * seq
        cur = torch.stack([loss.detach()] + [s[2] for s in stats])
        run = cur if run is None else run + cur
        run_n += 1
        if step % args.log_every == 0 or step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.time()
            avg = (run / run_n).tolist()
            if not math.isfinite(avg[0]):
                fail(f"loss is not finite at step {step}")
            tps = tok_log / max(now - t_log, 1e-9)
            history.append({"step": step, "elapsed_s": round(now - t0, 1), "lr": lr, "loss": round(avg[0], 4),
                            "cum_agree": [round(a, 4) for a in avg[1:]], "grad_norm": round(float(gnorm), 3),
                            "tokens_per_s": round(tps), "epochs": round(tokens_seen / n, 3), "batch": batch})
            print(f"  step {step:5d}  loss {avg[0]:.4f}  cumulative agree {[round(a, 3) for a in avg[1:]]}  "
                  f"lr {lr:.2e}  gnorm {float(gnorm):.2f}  {tps:,.0f} tok/s  {now - t0:6.1f}s  "
                  f"epoch {tokens_seen / n:.2f}")
            run, run_n, t_log, tok_log = None, 0, now, 0
        if args.val_every and step % args.val_every == 0:
            do_val()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - t0
    check(step > 0, "no training step completed")
    if not val_history or val_history[-1]["step"] != step:
        do_val()
    restored = None
    if args.keep_best and best[1] != step:
        head.load_state_dict(best[2])
        restored = {"step": best[1], "validation_loss": best[0]}
        print(f"  restored the best validation checkpoint: step {best[1]}, loss {best[0]:.4f} (final "
              f"{val_history[-1]['loss']:.4f})")
    print(f"  done: {step} steps, {tokens_seen:,} tokens ({tokens_seen / n:.2f} epochs) in {wall:.1f}s")
    shipped = restored["step"] if restored else step
    return {"steps": step, "tokens_seen": tokens_seen, "epochs": tokens_seen / n, "wall_time_s": wall,
            "optimizer": f"AdamW ({opt_kind})", "final_batch": batch, "oom_events": oom_events,
            "history": history, "validation_history": val_history, "restored_best": restored,
            "shipped_step": shipped,
            "shipped_validation": next(v for v in val_history if v["step"] == shipped)}


# --------------------------------------------------------------------------------------------------
# 7. Reload
# --------------------------------------------------------------------------------------------------

def rounded_copy(head: e3.Eagle3Head) -> e3.Eagle3Head:
    r = copy.deepcopy(head)
    with torch.no_grad():
        for p in r.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return r


@torch.no_grad()
def reload_check(out: Path, head: e3.Eagle3Head, model, windows: torch.Tensor, n_layers: int, args, device) -> tuple:
    disk = e3.load_head(out, target_layers=n_layers, device=device)
    disk.attach_target_embedding(model.model.embed_tokens.weight)
    disk.eval()
    ref = rounded_copy(head).eval()
    for k, v in ref.state_dict().items():
        check(torch.equal(disk.state_dict()[k], v), f"{out}/model.safetensors: {k} differs from the trained "
              "head rounded to bf16")
    w = windows[:4]
    taps, _, _ = target_outputs(model, w, args.taps, False)
    a = [disk.logits(o) for o in disk.ttt_forward(w, taps, args.ttt_steps)]
    b = [ref.logits(o) for o in ref.ttt_forward(w, taps, args.ttt_steps)]
    c = [head.logits(o) for o in head.ttt_forward(w, taps, args.ttt_steps)]
    d_rounded = max((x - y).abs().max().item() for x, y in zip(a, b))
    d_master = max((x - y).abs().max().item() for x, y in zip(a, c))
    same = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, c)) / sum(x[..., 0].numel() for x in a)
    print(f"  reload: every tensor equals the trained head rounded to bf16; logits vs the rounded in-memory head "
          f"{d_rounded:.1e}, vs the fp32 master {d_master:.2e} (same argmax {same:.4f})")
    check(d_rounded <= 1e-5, f"the reloaded head's logits differ from the in-memory head's by {d_rounded}")
    return disk, {"tensors_equal_rounded": True, "logits_vs_rounded_max_abs_diff": d_rounded,
                  "logits_vs_fp32_master_max_abs_diff": d_master, "argmax_same_as_fp32_master": same}


# --------------------------------------------------------------------------------------------------
# 8. Evaluation
# --------------------------------------------------------------------------------------------------

@torch.no_grad()
def greedy_sequences(model, held_ids: torch.Tensor, n_seq: int, prompt_len: int, gen_len: int) -> torch.Tensor:
    """n_seq prompts of prompt_len held-out tokens at evenly spaced offsets, each continued by gen_len
    greedy target tokens (full recompute per token, ties to the lowest id). [n_seq, prompt_len + gen_len]."""
    span = held_ids.numel() - prompt_len
    check(span > n_seq, f"held-out stream too short for {n_seq} prompts of {prompt_len} tokens")
    starts = torch.arange(n_seq, device=held_ids.device) * (span // n_seq)
    cur = held_ids[starts[:, None] + torch.arange(prompt_len, device=held_ids.device)[None, :]]
    for _ in range(gen_len):
        last = model.model(input_ids=cur, use_cache=False).last_hidden_state[:, -1]
        cur = torch.cat([cur, model.lm_head(last).argmax(-1, keepdim=True)], dim=1)
    return cur


def block_mask(n: int, blocks: int, device) -> torch.Tensor:
    """Additive [1, 1, blocks*n, blocks*n] mask of the TTT row layout: row (step i, anchor p) sees the
    step-0 rows q <= p and its own anchor's rows of steps 1..i."""
    r = torch.arange(blocks * n, device=device)
    bq, pq = (r // n)[:, None], (r % n)[:, None]
    bk, pk = (r // n)[None, :], (r % n)[None, :]
    allowed = ((bk == 0) & (pk <= pq)) | ((bk >= 1) & (bk <= bq) & (pk == pq))
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))[None, None]


def mtp_rows(model, mtp, emb, hid, pos, mask):
    pos = pos[None].expand(emb.shape[0], -1)
    pe = model.model.rotary_emb(emb, pos[None].expand(3, -1, -1))   # text-only mrope: t = h = w = position
    return mtp(emb, hid, pe, mask, pos)


@torch.no_grad()
def mtp_ttt(model, mtp, tokens: torch.Tensor, hidden: torch.Tensor, steps: int) -> list:
    """The demo MTP's chain steps for every anchor at once, as Eagle3Head.ttt_forward does for the head:
    step j of anchor p is the MTP row at position p+j from (embed(x_{p+j+1}), out_{j-1}) (step 0: the
    target's final-normed hidden h_p), attending to the step-0 rows <= p and its own rows of steps 1..j.
    Computed by one pass over all steps' rows with block_mask. Returns [B, N, H] per step (after mtp.norm)."""
    b, t = tokens.shape
    n = t - 1
    base = torch.arange(n, device=tokens.device)
    embs, hids, poss, outs = [], [], [], []
    for j in range(steps):
        embs.append(model.model.embed_tokens(tokens[:, (base + j + 1).clamp(max=t - 1)]))
        hids.append(hidden[:, :-1] if j == 0 else outs[-1])
        poss.append(base + j)
        o = mtp_rows(model, mtp, torch.cat(embs, 1), torch.cat(hids, 1), torch.cat(poss),
                     block_mask(n, j + 1, tokens.device))
        outs.append(o[:, j * n:])
    return outs


def chain_stats(ok: list, valid: torch.Tensor) -> dict:
    """ok[j] bool [S, N]: step j of anchor p proposed the right token; valid bool [S, N]: anchors counted.
    Per position j+1: P(accepted | 1..j accepted); expected accepted proposals at depth D."""
    cum, rates, p_all, prev_count = None, [], [], int(valid.sum())
    for o in ok:
        cum = (o & valid) if cum is None else (cum & o)
        c = int(cum.sum())
        rates.append(c / max(prev_count, 1))
        p_all.append(c / max(int(valid.sum()), 1))
        prev_count = c
    al = [sum(p_all[:d]) for d in range(1, len(ok) + 1)]
    return {"anchors": int(valid.sum()), "accept_rate_given_previous": rates, "p_first_j_accepted": p_all,
            "expected_accepted_at_depth": al, "tokens_per_round_at_depth": [1.0 + a for a in al]}


@torch.no_grad()
def evaluate_chains(head, model, mtp, y: torch.Tensor, prompt_len: int, depth: int, eot: int, args,
                    chunk: int = 8) -> dict:
    """Greedy-continuation evaluation (module docstring, stage 8) of the head and the MTP."""
    s, t = y.shape
    n = t - 1
    ok_head = [[] for _ in range(depth)]
    ok_mtp = [[] for _ in range(depth)]
    for i in range(0, s, chunk):
        w = y[i:i + chunk]
        taps, hidden, _ = target_outputs(model, w, args.taps, False)
        for j, out in enumerate(head.ttt_forward(w, taps, depth)):
            pred = head.to_target(head.logits(out).argmax(-1))
            ok_head[j].append(pred == w[:, (torch.arange(n, device=w.device) + j + 2).clamp(max=t - 1)])
        for j, out in enumerate(mtp_ttt(model, mtp, w, hidden, depth)):
            pred = model.lm_head(out).argmax(-1)
            ok_mtp[j].append(pred == w[:, (torch.arange(n, device=w.device) + j + 2).clamp(max=t - 1)])
    ok_head = [torch.cat(o) for o in ok_head]
    ok_mtp = [torch.cat(o) for o in ok_mtp]
    # Anchors P = prompt_len-1 .. with all `depth` proposals inside the sequence, stopping at the first
    # generated <|endoftext|> (a request ends there; the EOS itself may be proposed).
    gen = y[:, prompt_len:] == eot
    first = torch.where(gen.any(1), gen.float().argmax(1) + prompt_len + 1,
                        torch.full_like(gen[:, 0], t, dtype=torch.long))
    p = torch.arange(n, device=y.device)[None, :]
    valid = (p >= prompt_len - 1) & (p + depth + 1 <= first[:, None] - 1)
    heads = chain_stats(ok_head, valid)
    mtps = chain_stats(ok_mtp, valid)
    heads["sequences_with_eos"] = mtps["sequences_with_eos"] = int(gen.any(1).sum())
    return {"head": heads, "mtp": mtps, "ok_head": ok_head, "valid": valid}


@torch.no_grad()
def chain_checks(head, model, mtp, y: torch.Tensor, ev: dict, depth: int, args, problems: list,
                 samples: int = 24) -> dict:
    """On sampled anchors: (1) TTT outputs equal chains recomputed with forced tokens (head and MTP), and
    (2) the head's real greedy chain (its own tokens, KV-cached) accepts as many as the TTT count says."""
    valid = ev["valid"]
    idx = valid.nonzero()
    g = torch.Generator().manual_seed(args.seed + 7)
    pick = idx[torch.randperm(idx.shape[0], generator=g)[:samples]]
    worst_head = worst_mtp = 0.0
    mismatched = []
    for s, p in pick.tolist():
        w = y[s:s + 1, :p + depth + 2]
        taps, hidden, _ = target_outputs(model, w, args.taps, False)
        outs = head.ttt_forward(w, taps, depth)
        # Forced chain through the KV-cached row path.
        past = None
        if p > 0:
            _, past = head.context_forward(w[:, 1:p + 1], taps[:, :p])
        g_row = head.project(taps[:, p:p + 1])
        for j in range(depth):
            o, past = head.rows(w[:, p + j + 1:p + j + 2], g_row, torch.tensor([p + j], device=w.device), past)
            worst_head = max(worst_head, (o[0, 0] - outs[j][0, p]).abs().max().item())
            g_row = o
        # Real chain with the head's own tokens.
        past = None
        if p > 0:
            _, past = head.context_forward(w[:, 1:p + 1], taps[:, :p])
        toks, _, _ = head.draft_chain(past, w[:, p + 1], taps[:, p], p, depth)
        real = 0
        while real < depth and int(toks[0, real]) == int(w[0, p + 2 + real]):
            real += 1
        ttt = 0
        while ttt < depth and bool(ev["ok_head"][ttt][s, p]):
            ttt += 1
        if real != ttt:
            mismatched.append({"sequence": s, "anchor": p, "real_chain": real, "ttt": ttt})
        # MTP: step j of anchor p recomputed over rows 0..p+j with causal attention.
        mouts = mtp_ttt(model, mtp, w, hidden, depth)
        emb = model.model.embed_tokens(w[:, 1:p + 2])
        hid = hidden[:, :p + 1]
        for j in range(depth):
            rows = p + 1 + j
            o = mtp_rows(model, mtp, emb, hid, torch.arange(rows, device=w.device),
                         tdm.causal_additive_mask(rows, w.device))
            worst_mtp = max(worst_mtp, (o[0, -1] - mouts[j][0, p]).abs().max().item())
            emb = torch.cat([emb, model.model.embed_tokens(w[:, p + j + 2:p + j + 3])], 1)
            hid = torch.cat([hid, mouts[j][:, p:p + 1]], 1)
    print(f"  chain checks on {pick.shape[0]} anchors: head TTT vs forced KV-cached chain {worst_head:.1e}, MTP TTT "
          f"vs recomputed chain {worst_mtp:.1e}; real greedy chains accepting differently from the TTT count: "
          f"{len(mismatched)} {mismatched[:4]}")
    if worst_head > 1e-3 or worst_mtp > 1e-3:
        problems.append(f"TTT forwards differ from real chains (head {worst_head:.2e}, MTP {worst_mtp:.2e}): the "
                        "evaluation's masks or positions are wrong, its numbers are not chain acceptance")
    if len(mismatched) > max(1, samples // 10):
        problems.append(f"{len(mismatched)} of {pick.shape[0]} real chains accept differently from the TTT count: "
                        f"{mismatched[:6]}")
    return {"anchors": int(pick.shape[0]), "head_ttt_vs_forced_chain_max_abs_diff": worst_head,
            "mtp_ttt_vs_recomputed_chain_max_abs_diff": worst_mtp, "real_chain_count_mismatches": mismatched}


@torch.no_grad()
def depth1_true_text(head, model, mtp, windows: torch.Tensor, args, problems: list, batch: int = 8) -> dict:
    """Teacher-forced on true held-out text: row p agrees when its proposal equals the target's greedy
    token at p+1 (train_demo_model.py's mtp_agree). Also checks mtp_ttt's step 0 against joint_forward."""
    agree_h = agree_m = total = 0
    d_joint = None
    for i in range(0, windows.shape[0], batch):
        win = windows[i:i + batch]
        x = win[:, :-1]
        taps, hidden, logits = target_outputs(model, x, args.taps, False)
        t_next = logits.argmax(-1)[:, 1:]
        h_pred = head.to_target(head.logits(head.ttt_forward(x, taps, 1)[0]).argmax(-1))
        m_out = mtp_ttt(model, mtp, x, hidden, 1)[0]
        m_pred = model.lm_head(m_out).argmax(-1)
        if d_joint is None:
            _, jm = tdm.joint_forward(model, mtp, win)
            d_joint = (jm - model.lm_head(m_out)).abs().max().item()
            if d_joint > 1e-3:
                problems.append(f"mtp_ttt step 0 differs from train_demo_model.joint_forward by {d_joint:.2e}")
        agree_h += int((h_pred == t_next).sum())
        agree_m += int((m_pred == t_next).sum())
        total += t_next.numel()
    return {"windows": int(windows.shape[0]), "rows": total, "head_agree": agree_h / total,
            "mtp_agree": agree_m / total, "mtp_step0_vs_joint_forward_max_abs_diff": d_joint}


# --------------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------------

def fmt_row(name: str, vals: list, digits: int = 3) -> str:
    return f"| {name} | " + " | ".join(f"{v:.{digits}f}" for v in vals) + " |"


def goal_line(h: dict, m: dict) -> str:
    """Issue 22's goal: a higher mean accepted length than the MTP at depth >= 3."""
    deep = [d for d in range(3, len(h["expected_accepted_at_depth"]) + 1)]
    wins = [d for d in deep if h["expected_accepted_at_depth"][d - 1] > m["expected_accepted_at_depth"][d - 1]]
    verdict = "met at every depth >= 3" if wins == deep else f"met at depths {wins}" if wins else "not met"
    return (f"Goal (issue 22: more accepted tokens per round than the MTP at depth >= 3): {verdict} on this "
            "evaluation.")


def model_card(info: dict) -> str:
    ev, tr, dv, d1 = info["heldout_eval"], info["training"], info["draft_vocab"], info["heldout_depth1_true_text"]
    h, m = ev["head"], ev["mtp"]
    depth = len(h["accept_rate_given_previous"])
    cols = " | ".join(str(j) for j in range(1, depth + 1))
    sep = "|---|" + "---|" * depth
    c = info["config"]
    val = tr["shipped_validation"]
    lines = [
        "# qwen35-demo-eagle3",
        "",
        "An EAGLE-3 draft head for tandem's bundled demo model (`models/qwen35-demo`), trained by "
        "`tools/train_eagle3_head.py` with the target frozen. Published EAGLE-3 layout (`config.json` with "
        "`LlamaForCausalLMEagle3`, `model.safetensors` with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; "
        "bf16; no `embed_tokens`: the target's embedding is used). The arithmetic is stated in "
        "`tools/eagle3_head.py`.",
        "",
        "## Shape",
        "",
        f"- taps: target layers {c['eagle_config']['eagle_aux_hidden_state_layer_ids']} (the residual stream "
        "entering those decoder layers), fused by `fc` "
        f"[{c['hidden_size']}, {len(c['eagle_config']['eagle_aux_hidden_state_layer_ids']) * c['target_hidden_size']}]",
        f"- one decoder layer: hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, "
        f"{c['num_attention_heads']} heads / {c['num_key_value_heads']} kv heads / head_dim {c['head_dim']}, "
        f"rope_theta {c['rope_theta']:g}, Llama RMSNorm (eps {c['rms_norm_eps']:g})",
        f"- draft vocabulary: {c['draft_vocab_size']} of {c['vocab_size']} target ids; {info['parameters']:,} "
        f"parameters; {info['files'].get('model.safetensors', 0) / 1e6:.2f} MB",
        "",
        "## Held-out acceptance (greedy, teacher-forced chains)",
        "",
        f"{ev['sequences']} held-out prompts of {ev['prompt_tokens']} tokens, each continued by "
        f"{ev['generated_tokens']} "
        "tokens of the target's own greedy decoding (fp32); at every anchor of the continuation a chain of depth "
        f"{depth} is drafted from the true context and compared with the target's greedy tokens "
        f"({h['anchors']:,} anchors; sequences stop at a generated `<|endoftext|>`). The MTP row is the demo "
        "checkpoint's own `mtp.*` layer measured the same way (its chain rows attend to MTP rows built from the "
        "true hiddens of the context).",
        "",
        "Acceptance at chain position j, given positions 1..j-1 were accepted:",
        "",
        f"| drafter | {cols} |",
        sep,
        fmt_row("EAGLE-3 head", h["accept_rate_given_previous"]),
        fmt_row("demo MTP", m["accept_rate_given_previous"]),
        "",
        "Expected accepted proposals per round at depth D (tokens per round = 1 + this):",
        "",
        f"| drafter | {cols} |",
        sep,
        fmt_row("EAGLE-3 head", h["expected_accepted_at_depth"]),
        fmt_row("demo MTP", m["expected_accepted_at_depth"]),
        "",
        goal_line(h, m),
        "",
        f"Depth-1 agreement on {d1['windows']} held-out windows of true text ({d1['rows']:,} rows; a row agrees "
        f"when its proposal is the target's greedy token): head {d1['head_agree']:.4f}, MTP {d1['mtp_agree']:.4f}.",
        "",
        "## Training",
        "",
        "- data: the demo model's corpus, split and tokenizer (CPython standard library and installed "
        "site-packages sources, whole-file split by sha1(path) mod 50: held-out 0, validation 1); the held-out "
        "split is never trained on and does not choose the draft vocabulary",
        f"- objective: EAGLE-3's training-time test over {info['hyper']['ttt_steps']} steps (step j weighted "
        f"{info['hyper']['ttt_decay']}^j): soft cross-entropy against the target's next-token distribution "
        "restricted to the draft vocabulary, at positions whose target greedy token is a draft id",
        f"- {tr['steps']} steps of {info['hyper']['batch']} x {info['hyper']['seq']} tokens "
        f"({tr['epochs']:.2f} epochs, {tr['wall_time_s']:.0f} s, {info['versions'].get('gpu', 'CPU')}), AdamW lr "
        f"{info['hyper']['lr']} cosine, {info['precision']}; shipped the best validation checkpoint (step "
        f"{tr['shipped_step']}: validation loss {val['loss']:.4f}, teacher-forced cumulative agreement by step "
        f"{[round(a, 3) for a in val['cum_agree']]})",
        f"- initialisation: `lm_head` = the target's tied head rows of the draft ids, `norm` = the target's final "
        f"norm (1 + w); other matrices N(0, {info['hyper']['init_std']}^2)",
        "",
        "## Draft vocabulary",
        "",
        f"{dv['rule']}. It covers {dv['greedy_mass_covered_train']:.4f} of the target's greedy tokens on train "
        f"windows and {ev['heldout_greedy_tokens_in_draft_vocab']:.4f} of the greedy continuation tokens "
        "above: a proposal outside it is impossible, so that is the ceiling of depth-1 acceptance. Id 0 "
        "(`<|endoftext|>`, the demo's EOS) is always in, so a chain can end a text.",
        "",
        "`training.json` has every number, the command and the versions.",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEMO, help="the demo model directory")
    ap.add_argument("--out", type=Path, default=None, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--smoke", action="store_true", help="every stage at toy sizes (seconds of training)")
    ap.add_argument("--minutes", type=float, default=4.6, help="wall-clock budget of the training loop")
    ap.add_argument("--steps-max", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--ttt-decay", type=float, default=0.8)
    ap.add_argument("--taps", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5, 7],
                    help="target layers to tap, comma-separated (default 2,4,5)")
    ap.add_argument("--draft-vocab", type=int, default=3072)
    ap.add_argument("--vocab-tokens", type=int, default=2_000_000,
                    help="train tokens the draft vocabulary is counted on")
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--val-windows", type=int, default=32)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--no-keep-best", dest="keep_best", action="store_false")
    ap.add_argument("--eval-seqs", type=int, default=64)
    ap.add_argument("--eval-prompt", type=int, default=128)
    ap.add_argument("--eval-gen", type=int, default=160)
    ap.add_argument("--eval-depth", type=int, default=6)
    ap.add_argument("--eval-windows", type=int, default=64, help="true-text held-out windows for depth 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--site-packages", action="append", default=None,
                    help="override the demo's --site-packages (default: read from its training.json)")
    ap.add_argument("--site-packages-bytes", type=int, default=None)
    ap.add_argument("--allow-split-mismatch", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.steps_max, args.batch, args.seq = 0.5, 12, 4, 128
        args.val_every, args.val_windows, args.log_every, args.warmup = 6, 4, 2, 4
        args.vocab_tokens, args.eval_seqs, args.eval_prompt, args.eval_gen = 4 * 128, 4, 32, 24
        args.eval_windows = 4
    if args.out is None:
        args.out = SMOKE_OUT if args.smoke else DEFAULT_OUT
    return args


def main() -> None:
    args = parse_args()
    t_start = time.time()
    device = torch.device(args.device)
    out = args.out.resolve()
    model_dir = args.model.resolve()
    vers = tdm.versions()
    print(f"versions: {vers}\ndevice {device}; model {model_dir}; out {out}{'; SMOKE' if args.smoke else ''}")
    torch.manual_seed(args.seed)
    demo_info = json.loads((model_dir / "training.json").read_text(encoding="utf-8"))

    banner("1. corpus (the demo's)")
    ca = demo_corpus_args(demo_info)
    if args.site_packages is not None:
        ca["site_packages"] = args.site_packages
    if args.site_packages_bytes is not None:
        ca["site_budget"] = args.site_packages_bytes
    print(f"  collect_corpus arguments: {ca}")
    corpus = tdm.collect_corpus(ca["keep_codec_tables"], ca["site_packages"], ca["site_budget"])
    split = compare_split(corpus, demo_info, args.allow_split_mismatch)
    train_files, val_files, held_files = corpus["train"], corpus["validation"], corpus["heldout"]
    if args.smoke:
        train_files = train_files[:300]

    banner("2. tokenizer (models/qwen35-demo/tokenizer.json)")
    t = time.time()
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    check(eot == 0, f"<|endoftext|> has id {eot}, expected 0")
    train_stream, _ = tdm.encode_files(tok, train_files, eot)
    val_stream, _ = tdm.encode_files(tok, val_files, eot)
    held_stream, _ = tdm.encode_files(tok, held_files, eot)
    print(f"  train {len(train_stream):,} tokens (demo: {demo_info['data']['train']['tokens']:,}), validation "
          f"{len(val_stream):,} (demo: {demo_info['data']['validation']['tokens']:,}), held-out {len(held_stream):,} "
          f"(demo: {demo_info['data']['heldout']['tokens']:,}); {time.time() - t:.1f}s")
    if not args.smoke:
        for name, mine in (("validation", len(val_stream)), ("heldout", len(held_stream))):
            if mine != demo_info["data"][name]["tokens"]:
                msg = (f"the {name} split has {mine} tokens here, {demo_info['data'][name]['tokens']} in the demo's "
                       "training.json (different files or tokenizer?)")
                if not args.allow_split_mismatch:
                    fail(msg)
                print(f"  WARNING: {msg}")

    banner("3. target (frozen)")
    model, mtp, cfg_json = mdr.load_demo_model(model_dir, args.attn)
    model.to(device).eval().requires_grad_(False)
    mtp.to(device).eval().requires_grad_(False)
    text = cfg_json["text_config"]
    vocab, n_layers = int(text["vocab_size"]), int(text["num_hidden_layers"])
    bad = [i for i in args.taps if not 0 <= i < n_layers]
    check(not bad, f"--taps {bad} out of range for the {n_layers}-layer demo")
    train_ids = torch.tensor(train_stream, dtype=torch.long, device=device)
    val_ids = torch.tensor(val_stream, dtype=torch.long, device=device)
    held_ids = torch.tensor(held_stream, dtype=torch.long, device=device)
    val_windows = tdm.eval_windows(val_ids, args.seq, args.val_windows * args.seq)[:, :args.seq]
    check_taps(model, val_windows[:2, :64], args.taps)

    banner("4. draft vocabulary")
    draft_ids, vocab_info = choose_draft_vocab(model, train_ids, vocab, args, device)

    banner("5. training")
    head = build_head(args, cfg_json, model, draft_ids, device)
    n_params = sum(p.numel() for p in head.parameters())
    tr = train(head, model, train_ids, val_windows, args, device)
    head.eval()

    banner("6. export")
    out.mkdir(parents=True, exist_ok=True)
    e3.save_head(head, out, metadata={"generator": "tools/train_eagle3_head.py", "target": "qwen35-demo"})
    print(f"  wrote {out / 'config.json'}, {out / 'model.safetensors'} "
          f"({(out / 'model.safetensors').stat().st_size:,} bytes)")

    banner("7. reload")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    held_windows = tdm.eval_windows(held_ids, args.seq, args.eval_windows * args.seq)
    shipped, reload_info = reload_check(out, head, model, held_windows[:, :args.seq], n_layers, args, device)

    banner("8. held-out evaluation (shipped weights, fp32)")
    t = time.time()
    y = greedy_sequences(model, held_ids, args.eval_seqs, args.eval_prompt, args.eval_gen)
    t_gen = time.time() - t
    ev = evaluate_chains(shipped, model, mtp, y, args.eval_prompt, args.eval_depth, eot, args)
    problems = []
    checks = chain_checks(shipped, model, mtp, y, ev, args.eval_depth, args, problems, samples=8 if args.smoke else 24)
    d1 = depth1_true_text(shipped, model, mtp, held_windows, args, problems)
    gen_tokens = y[:, args.eval_prompt:]
    in_vocab = float(shipped.t2d[gen_tokens].float().mean())
    ev_out = {"sequences": args.eval_seqs, "prompt_tokens": args.eval_prompt, "generated_tokens": args.eval_gen,
              "depth": args.eval_depth, "head": ev["head"], "mtp": ev["mtp"],
              "heldout_greedy_tokens_in_draft_vocab": in_vocab, "generation_seconds": round(t_gen, 1),
              "seconds": round(time.time() - t, 1), "chain_checks": checks,
              "definition": "stage 8 of tools/train_eagle3_head.py's docstring"}
    for name, r in (("EAGLE-3 head", ev["head"]), ("demo MTP", ev["mtp"])):
        print(f"  {name:12s} accept | previous {[round(a, 3) for a in r['accept_rate_given_previous']]}  "
              f"expected accepted @depth {[round(a, 3) for a in r['expected_accepted_at_depth']]}  "
              f"({r['anchors']:,} anchors)")
    print(f"  depth 1 on true held-out text ({d1['rows']:,} rows): head {d1['head_agree']:.4f}, "
          f"MTP {d1['mtp_agree']:.4f} "
          f"(demo's training.json: MTP {demo_info['heldout_eval']['shipped_weights_fp32']['mtp_agree']:.4f}); "
          f"greedy tokens in the draft vocabulary {in_vocab:.4f}; {time.time() - t:.1f}s (generation {t_gen:.1f}s)")

    banner("9. model card, training.json")
    cfg_out = json.loads((out / "config.json").read_text(encoding="utf-8"))
    info = {
        "model": "EAGLE-3 draft head for models/qwen35-demo, trained by tools/train_eagle3_head.py",
        "config": cfg_out,
        "parameters": n_params,
        "target": {"dir": "models/qwen35-demo", "frozen": True, "tap_layers": args.taps,
                   "taps": "output_hidden_states entries (the residual stream entering those decoder layers)"},
        "data": {"corpus_arguments": ca, "split": split, "rules": "tools/train_demo_model.py collect_corpus: "
                 "sha1(relative path) mod 50 == 0 held-out, == 1 validation, rest train (whole files)",
                 "train_tokens": len(train_stream), "validation_tokens": len(val_stream),
                 "heldout_tokens": len(held_stream), "tokenizer": "models/qwen35-demo/tokenizer.json",
                 "smoke_subset": "first 300 train files" if args.smoke else None},
        "draft_vocab": vocab_info,
        "hyper": {k: getattr(args, k) for k in ("batch", "seq", "lr", "min_lr_ratio", "warmup", "weight_decay",
                                                 "clip", "init_std", "ttt_steps", "ttt_decay", "minutes",
                                                 "steps_max", "seed", "keep_best", "draft_vocab", "intermediate",
                                                 "heads", "kv_heads", "head_dim", "rope_theta")},
        "precision": "fp32 master weights, bf16 autocast (target and head)" if device.type == "cuda" else "fp32",
        "objective": "sum_j ttt_decay^j * masked soft CE(target softmax over draft ids | head log-softmax) / "
                     "sum_j ttt_decay^j; mask: the target's greedy token is a draft id",
        "training": tr,
        "reload": reload_info,
        "heldout_eval": ev_out,
        "heldout_depth1_true_text": d1,
        "demo_training_json_mtp_agree": demo_info["heldout_eval"]["shipped_weights_fp32"]["mtp_agree"],
        "versions": vers,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "python": platform.python_version(),
        "problems": problems,
    }
    info["files"] = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    (out / "README.md").write_text(model_card(info), encoding="utf-8")
    info["total_script_time_s"] = round(time.time() - t_start, 1)
    write_json(out / "training.json", info)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    total = sum(files.values())

    banner("summary")
    for name, size in files.items():
        print(f"    {name:20s} {size:>12,} bytes")
    print(f"  {out}: {total:,} bytes; training {tr['steps']} steps ({tr['epochs']:.2f} epochs) in "
          f"{tr['wall_time_s']:.0f}s, shipped step {tr['shipped_step']}; total {time.time() - t_start:.0f}s")
    if total > MAX_DIR_BYTES:
        problems.append(f"{out} holds {total:,} bytes (> {MAX_DIR_BYTES:,}): lower --draft-vocab")
    if problems:
        fail("evaluation checks failed (the files are written; training.json 'problems'):\n  " + "\n  ".join(problems))


if __name__ == "__main__":
    main()
