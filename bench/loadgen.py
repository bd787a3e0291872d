#!/usr/bin/env python3
"""Load generator for `tandem serve` (any OpenAI-compatible server): streaming completions from N
concurrent clients; reports aggregate decode throughput, time to first token, inter-token latency
and time per output token percentiles per concurrency level. Python standard library only, so it
runs on the GPU machine and in CI alike.

  python3 bench/loadgen.py --url http://127.0.0.1:8000 --model qwen35-demo \
      --concurrency 1,8,32,64 --requests-per-client 4 --prompt-tokens 128 --max-tokens 128

Prompts are token ids (`--vocab` bounds them), so a model without a tokenizer works too;
`--prompts-file` (JSONL with "prompt") sends text instead. Every request sets ignore_eos so every
one generates exactly --max-tokens tokens.

--long-prompt-tokens N (with --long-prompt-at S) sends one extra N-token prompt S seconds into each
level and reports the inter-token latency of the other streams while it was being prefilled
(between its arrival and its first token) against the level's median.
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


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Result:
    def __init__(self):
        self.start = 0.0
        self.first = None
        self.arrivals = []  # (time, tokens in that chunk)
        self.tokens = 0
        self.error = None


def stream_request(url, body, timeout):
    """One streamed completion; returns a Result with chunk arrival times."""
    u = urllib.parse.urlparse(url)
    r = Result()
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    r.start = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return r
        buf = b""
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                r.error = ev["error"].get("message")
                break
            n = sum(len(c.get("token_ids") or []) for c in ev.get("choices", []))
            if n == 0:
                continue
            now = time.perf_counter()
            if r.first is None:
                r.first = now
            r.arrivals.append((now, n))
            r.tokens += n
        del buf
    except Exception as e:  # a failed request is reported, not fatal
        r.error = repr(e)
    finally:
        conn.close()
    return r


def make_body(args, rng, prompt_tokens, max_tokens, texts):
    body = {"model": args.model, "max_tokens": max_tokens, "temperature": args.temperature,
            "stream": True, "ignore_eos": True, "return_token_ids": True,
            "seed": rng.randrange(1 << 31)}
    if texts:
        body["prompt"] = rng.choice(texts)
    else:
        body["prompt"] = [rng.randrange(args.vocab_lo, args.vocab) for _ in range(prompt_tokens)]
    return body


def run_level(args, concurrency, texts):
    rng = random.Random(args.seed + concurrency)
    results = []
    lock = threading.Lock()

    def client(cid):
        crng = random.Random(args.seed * 1000 + cid)
        for _ in range(args.requests_per_client):
            r = stream_request(args.url, make_body(args, crng, args.prompt_tokens, args.max_tokens, texts),
                               args.timeout)
            with lock:
                results.append(r)

    long_result = []

    def long_client():
        time.sleep(args.long_prompt_at)
        r = stream_request(args.url, make_body(args, rng, args.long_prompt_tokens, 4, None), args.timeout)
        long_result.append(r)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    if args.long_prompt_tokens:
        threads.append(threading.Thread(target=long_client))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
        time.sleep(args.ramp / max(concurrency, 1))
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    tokens = sum(r.tokens for r in ok)
    ttft = [r.first - r.start for r in ok if r.first is not None]
    itl = []  # gap between consecutive chunks of a stream, per chunk
    tpot = []
    for r in ok:
        for (a, _), (b, _) in zip(r.arrivals, r.arrivals[1:]):
            itl.append(b - a)
        if r.tokens > 1:
            tpot.append((r.arrivals[-1][0] - r.first) / (r.tokens - 1))
    # Decode throughput: tokens over the span in which streams were decoding.
    first_start = min((r.start for r in ok), default=t0)
    last_end = max((r.arrivals[-1][0] for r in ok if r.arrivals), default=t0)
    out = {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(errors),
        "error_samples": errors[:3],
        "generated_tokens": tokens,
        "wall_seconds": wall,
        "throughput_tokens_per_second": tokens / (last_end - first_start) if last_end > first_start else 0.0,
        "ttft_ms": {p: 1000 * percentile(ttft, p) for p in (50, 90, 99)},
        "itl_ms": {p: 1000 * percentile(itl, p) for p in (50, 90, 99)},
        "tpot_ms": {p: 1000 * percentile(tpot, p) for p in (50, 90, 99)},
    }
    if long_result and long_result[0].error is None and long_result[0].first is not None:
        lr = long_result[0]
        during = []
        for r in ok:
            for (a, _), (b, _) in zip(r.arrivals, r.arrivals[1:]):
                if lr.start <= b <= lr.first:
                    during.append(b - a)
        out["long_prompt"] = {
            "tokens": args.long_prompt_tokens,
            "ttft_ms": 1000 * (lr.first - lr.start),
            "itl_during_prefill_ms": {p: 1000 * percentile(during, p) for p in (50, 99)},
            "itl_during_prefill_samples": len(during),
            "p99_during_over_level_median": percentile(during, 99) / statistics.median(itl) if itl and during else None,
        }
    elif long_result:
        out["long_prompt"] = {"error": long_result[0].error}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--vocab", type=int, default=4096, help="token ids are drawn below this")
    ap.add_argument("--vocab-lo", type=int, default=10)
    ap.add_argument("--prompts-file", help="JSONL with a 'prompt' per line (text prompts)")
    ap.add_argument("--ramp", type=float, default=1.0, help="seconds over which clients start")
    ap.add_argument("--long-prompt-tokens", type=int, default=0)
    ap.add_argument("--long-prompt-at", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", action="store_true", help="print one JSON object per level")
    args = ap.parse_args()
    texts = None
    if args.prompts_file:
        with open(args.prompts_file) as f:
            texts = [json.loads(l)["prompt"] for l in f if l.strip()]
    for c in [int(x) for x in args.concurrency.split(",")]:
        res = run_level(args, c, texts)
        res["label"] = args.label
        if args.json:
            print(json.dumps(res), flush=True)
        else:
            print(f"{args.label} c={c:3d}  {res['throughput_tokens_per_second']:9.1f} tok/s  "
                  f"ttft p50/p99 {res['ttft_ms'][50]:7.1f}/{res['ttft_ms'][99]:7.1f} ms  "
                  f"itl p50/p99 {res['itl_ms'][50]:6.1f}/{res['itl_ms'][99]:6.1f} ms  "
                  f"tpot p50 {res['tpot_ms'][50]:6.2f} ms  errors {res['errors']}", flush=True)
            if "long_prompt" in res:
                print(f"    long prompt: {json.dumps(res['long_prompt'])}", flush=True)
        if res["errors"]:
            print(f"errors: {res['error_samples']}", file=sys.stderr)


if __name__ == "__main__":
    main()
