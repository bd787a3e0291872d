#!/usr/bin/env python3
"""Per-kernel share of a decode step, from a kernel timeline.

A diagnostic build (cmake -DTANDEM_CUDA_TRACE=ON) run with TANDEM_CUDA_TRACE_OUT=FILE writes one
line per kernel at exit: "unit ns grid_x grid_y grid_z block", where ns is when the kernel's first
block passed its PDL wait, i.e. when the kernel before it completed. The time from one mark to the
next is therefore the kernel's share of the critical path.

Steps are cut after each kernel of END_UNIT (default "sampling": greedy decoding's argmax ends
every step). The most common step (same kernels in the same order) is summarised: the median
share of every kernel in it, and per kernel kind (unit and launch shape) the count and total.

  TANDEM_CUDA_TRACE_OUT=/tmp/marks.txt ./build-trace/tandem bench --backend cuda \\
      --random-weights bench/configs/qwen35-9b.json --gen-tokens 64 --repeats 1
  tools/kernel_timeline.py /tmp/marks.txt [--end-unit sampling] [--positions]

With --gaps US it lists instead the runs of kernels that follow each other with less than US
between their marks (a graph, or launches the host queued back to back), each with its span, its
units and the gap after it: where the device waited for the host. The runs repeat per round, so
the most common run sequences are summarised by their medians.
"""
import argparse
import collections
import statistics
import sys


def read_marks(path):
    """Kernel marks [(ns, kind)] and graph launch marks [(device ns, host ns)], in time order."""
    marks, launches = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if len(parts) != 6:
                sys.exit(f"{path}:{n}: expected 'unit ns gx gy gz block', got {line.strip()!r}")
            unit, ns, gx, gy, gz, block = parts
            if unit == "launch":  # "launch device_ns host_ns 0 0 0"
                launches.append((int(ns), int(gx)))
            else:
                marks.append((int(ns), f"{unit}:{gx}x{gy}x{gz}/{block}"))
    marks.sort()
    launches.sort()
    return marks, launches


def read_waits(path):
    """The host's waits [(start ns, end ns, stack id)] from a TANDEM_CUDA_WAIT_OUT file."""
    waits = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts and parts[0] == "wait":
                waits.append((int(parts[1]), int(parts[2]), int(parts[3])))
    return sorted(waits)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("marks", help="file written through TANDEM_CUDA_TRACE_OUT")
    ap.add_argument("--end-unit", default="sampling", help="unit whose kernel ends a step")
    ap.add_argument("--positions", action="store_true", help="also list every kernel of the step")
    ap.add_argument("--gaps", type=float, metavar="US",
                    help="list runs of kernels separated by more than US microseconds instead")
    ap.add_argument("--waits", metavar="FILE",
                    help="with --gaps: the host's waits (TANDEM_CUDA_WAIT_OUT) for --detail")
    ap.add_argument("--detail", type=int, default=0, metavar="N",
                    help="with --gaps: list the last N runs in time order, with the graph launches' "
                         "slack and the host's waits placed on the device's clock")
    args = ap.parse_args()

    marks, launches = read_marks(args.marks)
    if args.gaps is not None:
        waits = read_waits(args.waits) if args.waits else []
        return print_runs(marks, launches, waits, args.gaps, args.detail)
    ends = [i for i, (_, kind) in enumerate(marks) if kind.startswith(args.end_unit + ":")]
    if len(ends) < 2:
        sys.exit(f"fewer than two '{args.end_unit}' kernels among {len(marks)} marks: no step")
    steps = [marks[a + 1 : b + 1] for a, b in zip(ends, ends[1:])]
    signature, count = collections.Counter(
        tuple(kind for _, kind in s) for s in steps).most_common(1)[0]
    chosen = [s for s in steps if tuple(kind for _, kind in s) == signature]
    n = len(signature)
    print(f"{len(marks)} marks; {len(steps)} steps; the most common one ({n} kernels) "
          f"occurs {count} times")
    # Kernel i's share: from its own mark to the next one. The step's last kernel (the argmax)
    # gets no row of its own: its time is inside the gap to the next step's first mark, printed
    # below together with the host's work between steps.
    share = [[(s[i + 1][0] - s[i][0]) / 1e3 for s in chosen] for i in range(n - 1)]
    span = statistics.median((s[-1][0] - s[0][0]) / 1e3 for s in chosen)
    gaps = [(marks[a + 1][0] - marks[a][0]) / 1e3 for a in ends[:-1]]
    print(f"first to last mark of a step: {span:.1f} us (median); "
          f"step end to the next step's first kernel: {statistics.median(gaps):.1f} us")
    medians = [statistics.median(v) for v in share]
    if args.positions:
        for i, m in enumerate(medians):
            print(f"{i:4d} {signature[i]:<45} {m:9.2f} us")
    kinds = collections.defaultdict(list)
    for i, m in enumerate(medians):
        kinds[signature[i]].append(m)
    print(f"{'kernel (unit:grid/block)':<45} {'count':>5} {'total us':>9} {'mean us':>8}")
    for kind, v in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"{kind:<45} {len(v):5d} {sum(v):9.1f} {sum(v) / len(v):8.2f}")


def print_runs(marks, launches, waits, gap_us, detail):
    # Host steady clock to device clock: a launch's device mark minus its host time is the launch
    # latency plus the time the launch sat queued behind earlier work (its slack). The least of
    # them is taken as the latency alone, so a launch with ~0 slack found the device idle: the
    # device waited for the host there.
    offset = min(d - h for d, h in launches) if launches else None
    slack_at = {d: (d - h - offset) / 1e3 for d, h in launches}
    runs = [[marks[0]]]
    for prev, mark in zip(marks, marks[1:]):
        if (mark[0] - prev[0]) / 1e3 > gap_us:
            runs.append([])
        runs[-1].append(mark)
    # A run's label: its kernel count and its units in order of first appearance.
    def label(run):
        units = list(dict.fromkeys(kind.split(":")[0] for _, kind in run))
        return f"{len(run)} kernels: {' '.join(units[:6])}{' ...' if len(units) > 6 else ''}"
    rows = []
    for i, run in enumerate(runs):
        span = (run[-1][0] - run[0][0]) / 1e3
        after = (runs[i + 1][0][0] - run[-1][0]) / 1e3 if i + 1 < len(runs) else 0.0
        rows.append((label(run), span, after))
    if detail:
        print_detail(runs, slack_at, waits, offset, detail)
    print(f"{len(marks)} marks in {len(runs)} runs separated by more than {gap_us} us")
    by_label = collections.defaultdict(list)
    for lab, span, after in rows:
        by_label[lab].append((span, after))
    print(f"{'run':<70} {'count':>5} {'span us':>8} {'gap after':>9}")
    for lab, v in sorted(by_label.items(), key=lambda kv: -len(kv[1])):
        print(f"{lab:<70} {len(v):5d} {statistics.median(s for s, _ in v):8.1f} "
              f"{statistics.median(a for _, a in v):9.1f}")
    # The cycle of runs that covers most of the timeline without overlapping itself (a round);
    # the shortest wins a tie, so two rounds never pass for one.
    labels = [lab for lab, _, _ in rows]
    best = (0, ())
    for length in range(1, 13):
        seen = collections.Counter(tuple(labels[i:i + length])
                                   for i in range(len(labels) - length + 1))
        for cycle, _ in seen.most_common(8):
            i, count = 0, 0
            while i + length <= len(labels):
                if tuple(labels[i:i + length]) == cycle:
                    count, i = count + 1, i + length
                else:
                    i += 1
            if count * length > best[0]:
                best = (count * length, cycle, count)
    _, cycle, count = best
    print(f"most common cycle ({count} times):")
    for lab in cycle:
        v = by_label[lab]
        print(f"  {lab:<68} span {statistics.median(s for s, _ in v):7.1f} us, "
              f"gap after {statistics.median(a for _, a in v):6.1f} us")


def print_detail(runs, slack_at, waits, offset, count):
    """The last `count` runs on the device's clock, each graph launch with its slack (how long the
    launch was queued before the device reached it; ~0: the device waited for the host), and the
    host's waits moved onto the device's clock with the launches' least offset."""
    first = runs[-count][0][0]
    events = []
    for run in runs[-count:]:
        units = list(dict.fromkeys(kind.split(":")[0] for _, kind in run))
        events.append((run[0][0], f"run of {len(run):3d} kernels, {(run[-1][0] - run[0][0]) / 1e3:7.1f} us:"
                                   f" {' '.join(units[:5])}"))
    for d, slack in slack_at.items():
        if d >= first:
            events.append((d, f"  graph launch, slack {slack:6.1f} us"))
    if offset is not None:
        for start, end, stack in waits:
            if end + offset >= first:
                events.append((start + offset, f"  host waits {(end - start) / 1e3:6.1f} us "
                                               f"(stack {stack}), until {(end + offset - first) / 1e3:.1f}"))
    print(f"last {count} runs (us from the first):")
    for t, text in sorted(events):
        print(f"{(t - first) / 1e3:9.1f}  {text}")


if __name__ == "__main__":
    main()
