#!/usr/bin/env python3
"""Prefix-cache benchmark for `tandem serve`: time to first token on the two workloads a prefix
cache exists for. Run it against a server with the cache and one without
(`--prefix-cache-memory 0`) on the same model; Python standard library only.

  python3 bench/prefix_bench.py --url http://127.0.0.1:8000 --model q9b --vocab 248320 \
      --turns 10 --system-tokens 8192 --shared-requests 64 --concurrency 8

1. A multi-turn conversation: turn n+1's prompt is turn n's prompt, its answer and a new user
   message (token ids), as a chat client resends the whole conversation every turn.
2. Requests sharing one long system prompt, each with its own user message, `--concurrency` at a
   time (after one warm-up request that leaves the prompt saved).

Prompts are token ids (a model without a tokenizer works). Each request streams and reports TTFT
and usage.prompt_tokens_details.cached_tokens; the summary adds the server's prefix-cache metrics
(hit rate, bytes per saved boundary). One JSON line per workload on stdout.
"""
import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse


def stream(url, body):
    """POST a streamed completion; returns (ttft seconds, generated ids, cached tokens)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    res = conn.getresponse()
    if res.status != 200:
        raise RuntimeError(f"HTTP {res.status}: {res.read()[:300]!r}")
    ttft, ids, cached, buf = None, [], 0, b""
    while True:
        chunk = res.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            d = json.loads(event[6:])
            for c in d.get("choices", []):
                if c.get("token_ids"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    ids += c["token_ids"]
            if d.get("usage"):
                cached = d["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    conn.close()
    return ttft, ids, cached


def metrics(url):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", "/metrics")
    out = {}
    for line in conn.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def cache_summary(before, after):
    d = lambda k: after.get(k, 0) - before.get(k, 0)
    hits = d('tandem_prefix_cache_requests_total{tier="memory",result="hit"}')
    misses = d('tandem_prefix_cache_requests_total{tier="memory",result="miss"}')
    entries = after.get("tandem_prefix_cache_entries", 0)
    return {
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "reused_tokens": d("tandem_prefix_cache_reused_tokens_total"),
        "entries": entries,
        "bytes": after.get("tandem_prefix_cache_bytes", 0),
        "bytes_per_boundary": after.get("tandem_prefix_cache_bytes", 0) / entries if entries else None,
        "evictions": d("tandem_prefix_cache_evictions_total"),
    }


def body(args, prompt, seed):
    return {"model": args.model, "prompt": prompt, "max_tokens": args.answer_tokens, "temperature": 0,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "ignore_eos": True}


def conversation(args, rng):
    before = metrics(args.url)
    prompt = [rng.randrange(args.vocab) for _ in range(args.first_turn_tokens)]
    turns = []
    for t in range(args.turns):
        ttft, ids, cached = stream(args.url, body(args, prompt, t))
        turns.append({"turn": t, "prompt_tokens": len(prompt), "cached_tokens": cached, "ttft_ms": ttft * 1e3})
        print(f"  turn {t}: prompt {len(prompt)} tokens, cached {cached}, TTFT {ttft * 1e3:.1f} ms",
              file=sys.stderr)
        prompt = prompt + ids + [rng.randrange(args.vocab) for _ in range(args.turn_tokens)]
    later = [x["ttft_ms"] for x in turns[1:]]
    return {"workload": "conversation", "turns": turns, "ttft_ms_mean_after_first": statistics.mean(later),
            "cache": cache_summary(before, metrics(args.url))}


def shared_system_prompt(args, rng):
    before = metrics(args.url)
    system = [rng.randrange(args.vocab) for _ in range(args.system_tokens)]
    prompts = [system + [rng.randrange(args.vocab) for _ in range(args.user_tokens)]
               for _ in range(args.shared_requests + 1)]
    warm_ttft, _, warm_cached = stream(args.url, body(args, prompts[0], 0))
    results, lock, nxt = [], threading.Lock(), [1]

    def client():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(prompts):
                return
            ttft, _, cached = stream(args.url, body(args, prompts[i], i))
            with lock:
                results.append((ttft * 1e3, cached))

    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    return {"workload": "shared_system_prompt", "system_tokens": args.system_tokens,
            "requests": len(results), "concurrency": args.concurrency,
            "first_request_ttft_ms": warm_ttft * 1e3, "first_request_cached": warm_cached,
            "ttft_ms": {"50": statistics.median(ttfts), "mean": statistics.mean(ttfts),
                        "99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]},
            "cached_tokens_mean": statistics.mean(r[1] for r in results), "wall_s": wall,
            "cache": cache_summary(before, metrics(args.url))}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--vocab", type=int, required=True, help="token ids are drawn below this")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--first-turn-tokens", type=int, default=512)
    p.add_argument("--turn-tokens", type=int, default=64, help="new user tokens per turn")
    p.add_argument("--answer-tokens", type=int, default=32, help="max_tokens of every request")
    p.add_argument("--system-tokens", type=int, default=8192)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--shared-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workloads", default="conversation,shared")
    args = p.parse_args()
    for i, w in enumerate(args.workloads.split(",")):
        # Each workload its own tokens, so that one does not hit what the other saved.
        rng = random.Random(args.seed * 1000 + i)
        r = conversation(args, rng) if w == "conversation" else shared_system_prompt(args, rng)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
