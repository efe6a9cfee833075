#!/usr/bin/env python3
"""overlap_tail: what a step's last buckets leave after backward, from a flexcomm trace.

    python3 benchmarks/overlap_tail.py [--steps 25] [--buckets 3] TRACE.json [TRACE.json ...]

Reads the per-rank Chrome traces that `benchmarks/overlap --trace-dir` writes (one file per
rank). A step is the bucket reductions posted since the previous `finish`, up to the end of its
own `finish`. For each of the last --buckets buckets of a step it prints when the reduction was
posted and when it was done, and how long it took, each the median over the last --steps steps,
in microseconds from the start of `finish()` (negative: during backward); then the median
`finish()` itself, which is what backward left. Python's standard library only.
"""
import argparse
import json
import statistics


def events(path):
    with open(path) as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def steps(evs):
    """[(finish start, finish duration, [(posted, done) of each bucket reduction in the step])]."""
    finishes = sorted((e["ts"], e["dur"]) for e in evs if e.get("name") == "finish" and e.get("ph") == "X")
    spans = {}
    for e in evs:
        if e.get("name") == "bucket reduce" and e.get("ph") in ("b", "e"):
            spans.setdefault(e["id"], {})[e["ph"]] = e["ts"]
    reductions = sorted((s["b"], s["e"]) for s in spans.values() if "b" in s and "e" in s)
    out, since = [], float("-inf")
    for start, dur in finishes:
        end = start + dur
        out.append((start, dur, [r for r in reductions if since < r[0] <= end]))
        since = end
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=25, help="the last this many steps (the timed ones)")
    ap.add_argument("--buckets", type=int, default=3, help="the last this many buckets of each step")
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args()
    print("| trace | bucket | posted (us) | done (us) | took (us) |")
    print("| --- | --- | --- | --- | --- |")
    for path in args.traces:
        timed = [s for s in steps(events(path)) if s[2]][-args.steps:]
        if not timed:
            print(f"| {path} | no step with a bucket reduction | | | |")
            continue
        last = min(args.buckets, min(len(s[2]) for s in timed))
        for k in range(last, 0, -1):
            posted = statistics.median(s[2][-k][0] - s[0] for s in timed)
            done = statistics.median(s[2][-k][1] - s[0] for s in timed)
            took = statistics.median(s[2][-k][1] - s[2][-k][0] for s in timed)
            name = "last" if k == 1 else f"{k}th-last" if k > 3 else ("2nd-last", "3rd-last")[k - 2]
            print(f"| {path} | {name} | {posted:.0f} | {done:.0f} | {took:.0f} |")
        print(f"| {path} | finish() ({len(timed)} steps) | 0 | {statistics.median(s[1] for s in timed):.0f} | |")


if __name__ == "__main__":
    main()
