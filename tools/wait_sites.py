#!/usr/bin/env python3
"""Where the host blocked on the device, by call stack.

A diagnostic build (cmake -DTANDEM_CUDA_TRACE=ON) run with TANDEM_CUDA_WAIT_OUT=FILE writes every
wait of the host on the device (stream and event synchronizations, synchronous reads) at exit: its
interval and its call stack as offsets into the executable. This names the stacks with addr2line
against the same executable (unstripped; a stripped copy of it may be what ran) and lists them by
total time.

  TANDEM_CUDA_WAIT_OUT=/tmp/waits.txt ./build-trace/tandem bench-spec ...
  tools/wait_sites.py /tmp/waits.txt ./build-trace/tandem [--frames 6] [--after NS]
"""
import argparse
import collections
import statistics
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("waits", help="file written through TANDEM_CUDA_WAIT_OUT")
    ap.add_argument("binary", help="the executable that ran, unstripped")
    ap.add_argument("--frames", type=int, default=6, help="frames of each stack to print")
    ap.add_argument("--after", type=int, default=0, metavar="NS",
                    help="only waits that start at or after this host time (steady_clock ns)")
    args = ap.parse_args()

    stacks, waits = {}, collections.defaultdict(list)
    with open(args.waits) as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if parts[0] == "stack":
                stacks[int(parts[1])] = parts[2:]
            elif parts[0] == "wait" and len(parts) == 4:
                start, end, stack = int(parts[1]), int(parts[2]), int(parts[3])
                if start >= args.after:
                    waits[stack].append((end - start) / 1e3)
            else:
                sys.exit(f"{args.waits}:{n}: expected 'stack ID OFFSET...' or 'wait START END ID'")
    offsets = sorted({o for s in stacks.values() for o in s[:args.frames]})
    names = {}
    if offsets:
        out = subprocess.run(["addr2line", "-f", "-C", "-e", args.binary, *offsets],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        # Two lines per offset: the function, then file:line ("??:0" without debug info).
        for o, fn in zip(offsets, out[0::2]):
            names[o] = fn if len(fn) < 110 else fn[:107] + "..."
    total = sum(sum(v) for v in waits.values())
    print(f"{sum(len(v) for v in waits.values())} waits, {total / 1e3:.1f} ms in all")
    for stack, v in sorted(waits.items(), key=lambda kv: -sum(kv[1])):
        print(f"\nstack {stack}: {len(v)} waits, {sum(v) / 1e3:.2f} ms, "
              f"median {statistics.median(v):.1f} us")
        for o in stacks[stack][:args.frames]:
            print(f"    {names.get(o, o)}")


if __name__ == "__main__":
    main()
