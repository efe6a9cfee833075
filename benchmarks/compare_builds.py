#!/usr/bin/env python3
"""Whether a change moved performance: the same benchmarks on two builds, taken in turns.

For a change meant to leave speed alone (a restructuring), run the allreduce sweep at 2 and 4
ranks, the feed benchmark at K=4 and the overlap benchmark at 2 ranks on the build before and the
build after, alternately, `--repeat` times each, and print one markdown table: per figure the
runs of each build, their medians, after/before, and the run-to-run spread of the builds
(max/min of each build's runs). Every figure is a ratio within one run (flexcomm against
MPI_Allreduce, a feed against local_feed, hidden share of communication), so the machine's
drift between runs cancels.

  benchmarks/compare_builds.py --before build-old --after build [--repeat 3] [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SIZES = [4, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
FLEXCOMM = ("subgroup_allreduce", "subgroup_allreduce shm", "overlapped_ring", "overlapped_ring shm")


def run(mpiexec, ranks, exe, args, out):
    cmd = [mpiexec, "-n", str(ranks), exe] + args + [out]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, FLEXCOMM_TIMEOUT=os.environ.get("FLEXCOMM_TIMEOUT", "120")))
    if result.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}")
    with open(out) as f:
        return json.load(f)


def allreduce_figures(data, ranks):
    figures = {}
    for size in SIZES:
        rows = [r for r in data["results"] if r["size"] == size]
        best = max((r["busbw_ratio_vs_mpi"] for r in rows if r["impl"] in FLEXCOMM), default=float("nan"))
        figures[f"allreduce np{ranks} {size} B: best flexcomm / MPI_Allreduce"] = best
    return figures


def feed_figures(data):
    return {f"feed K={data['members']}: {r['feed']} wall vs local_feed": r["wall_ratio"]
            for r in data["results"] if r["feed"] != "local_feed"}


def overlap_figures(data):
    figures = {}
    for r in data["results"]:
        if r["adapter"] in ("overlapped_ring shm", "subgroup_allreduce shm (launch when full)"):
            figures[f"overlap np{r['ranks']} {r['model']}: {r['adapter']} hidden %"] = r[
                "hidden_vs_after_backward_percent"]
    return figures


def measure(build, mpiexec, scratch):
    figures = {}
    bench = lambda name: os.path.join(build, "benchmarks", name)
    for ranks in (2, 4):
        data = run(mpiexec, ranks, bench("allreduce"), ["-b", "4", "-e", "64M", "-f", "4", "-n", "20", "-w", "5",
                                                        "-c", "1", "-j"], os.path.join(scratch, "ar.json"))
        figures.update(allreduce_figures(data, ranks))
    data = run(mpiexec, 5, bench("feed"), ["--wait", "backoff:20000", "-J"], os.path.join(scratch, "feed.json"))
    figures.update(feed_figures(data))
    data = run(mpiexec, 2, bench("overlap"), ["--scale", "64", "-n", "25", "-w", "5", "-j"],
               os.path.join(scratch, "ov.json"))
    figures.update(overlap_figures(data))
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="build folder before the change")
    parser.add_argument("--after", required=True, help="build folder after the change")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mpiexec", default="mpiexec.mpich")
    parser.add_argument("--json", help="also write every run's figures here")
    o = parser.parse_args()
    runs = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(o.repeat):
            for name in ("before", "after"):
                print(f"# run {i + 1} of {o.repeat}: {name}", file=sys.stderr, flush=True)
                runs[name].append(measure(getattr(o, name), o.mpiexec, scratch))
    if o.json:
        with open(o.json, "w") as f:
            json.dump(runs, f, indent=1)
    print("| figure | before (runs) | after (runs) | after/before (medians) | spread before | spread after |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key in runs["before"][0]:
        b = [r[key] for r in runs["before"] if key in r]
        a = [r[key] for r in runs["after"] if key in r]
        spread = lambda v: max(v) / min(v) if min(v) > 0 else float("nan")
        mb, ma = statistics.median(b), statistics.median(a) if a else float("nan")
        fmt = lambda v: ", ".join(f"{x:.2f}" for x in v)
        print(f"| {key} | {fmt(b)} | {fmt(a)} | {ma / mb if mb else float('nan'):.2f} | {spread(b):.2f} | "
              f"{spread(a) if a else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
