"""table: flexcomm's benchmarks and the peers' (Gloo, DDP) side by side, from their JSON files.

    python3 benchmarks/peers/table.py DIR [--ranks 2,4] [--json peers.json]

DIR holds what run.sh wrote: allreduce_npN.json (benchmarks/allreduce), gloo_npN.json
(allreduce_gloo.py), overlap_npN.json (benchmarks/overlap), ddp_npN.json (overlap_ddp.py).
Allreduce: flexcomm's better adapter per size against Gloo's busbw; ratio = flexcomm / Gloo.
Overlap: hidden shares (each side against its own sync-after-backward in the same run) and the
time communication adds to a step (Overall - Compute). "loses" marks rows where flexcomm is behind.
"""
import argparse
import json
import os
import sys

# The adapters as a user gets them: with shared memory off, and (the default on one host) on;
# the allreduce benchmark's "probe" and "memcpy" columns are limits, not adapters.
ADAPTERS = ("subgroup_allreduce", "overlapped_ring", "subgroup_allreduce shm", "overlapped_ring shm")
RING, EARLY = "overlapped_ring", "subgroup_allreduce (launch when full)"
DDP = "DDP (its buckets and hooks)"


def load(directory, name):
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        sys.exit(f"table: {path} missing (run benchmarks/peers/run.sh)")
    with open(path) as f:
        return json.load(f)["results"]


def mib(size):
    return f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size / 2**10:g} KiB"


def allreduce_rows(directory, ranks):
    rows = []
    for n in ranks:
        ours = load(directory, f"allreduce_np{n}.json")
        gloo = {r["size"]: r for r in load(directory, f"gloo_np{n}.json")}
        for size in sorted({r["size"] for r in ours}):
            if size not in gloo:
                continue
            best = max((r for r in ours if r["size"] == size and r["impl"] in ADAPTERS), key=lambda r: r["busbw"])
            mpi = next(r for r in ours if r["size"] == size and r["impl"] == "MPI_Allreduce")
            g = gloo[size]
            rows.append({"ranks": n, "size": size, "flexcomm_adapter": best["impl"], "flexcomm_busbw": best["busbw"],
                         "mpi_busbw": mpi["busbw"], "gloo_busbw": g["busbw"], "ratio": best["busbw"] / g["busbw"],
                         "wrong": best["wrong"] + g["wrong"]})
    return rows


def overlap_rows(directory, ranks):
    rows = []
    for n in ranks:
        ours = [r for r in load(directory, f"overlap_np{n}.json") if not r.get("tracing")]
        ddp = load(directory, f"ddp_np{n}.json")
        for r in ddp:
            if r["adapter"] != DDP:
                continue
            mine = {x["adapter"]: x for x in ours if x["model"] == r["model"] and x["backward"] == r["backward"]}
            if RING not in mine:
                continue
            best = min((x for x in mine.values()), key=lambda x: x["overall_us"])
            rows.append({"ranks": n, "model": r["model"], "backward": r["backward"],
                         "flexcomm_ring_hidden": mine[RING]["hidden_vs_after_backward_percent"],
                         "flexcomm_early_hidden": mine[EARLY]["hidden_vs_after_backward_percent"],
                         "ddp_hidden": r["hidden_vs_after_backward_percent"],
                         "flexcomm_compute_us": best["compute_us"],
                         "flexcomm_added_us": best["overall_us"] - best["compute_us"],
                         "flexcomm_best": best["adapter"],
                         "ddp_compute_us": r["compute_us"], "ddp_added_us": r["overall_us"] - r["compute_us"]})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--json", help="also write both tables here")
    a = p.parse_args()
    ranks = [int(x) for x in a.ranks.split(",")]
    ar, ov = allreduce_rows(a.directory, ranks), overlap_rows(a.directory, ranks)
    print("Allreduce, float sum in place, busbw GB/s "
          "(ratio = flexcomm's better adapter / Gloo, same machine, back to back)\n")
    print("| ranks | size | flexcomm adapter | flexcomm busbw | MPI_Allreduce busbw | Gloo busbw | flexcomm / Gloo | |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in ar:
        flag = "loses" if r["ratio"] < 1 else ""
        if r["wrong"]:
            flag += f" #wrong {r['wrong']}"
        print(f"| {r['ranks']} | {mib(r['size'])} | {r['flexcomm_adapter']} | {r['flexcomm_busbw']:.3f} "
              f"| {r['mpi_busbw']:.3f} | {r['gloo_busbw']:.3f} | {r['ratio']:.2f} | {flag.strip()} |")
    print("\nOverlap, synthetic backward: hidden share of the communication that sync-after-backward exposes (%),"
          "\nand what communication adds to a step (Overall - Compute, ms) with flexcomm's fastest adapter and DDP\n")
    print("| ranks | model | backward | flexcomm ring hidden | flexcomm launch-when-full hidden | DDP hidden "
          "| flexcomm compute / added (ms) | DDP compute / added (ms) | |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in ov:
        best = max(r["flexcomm_ring_hidden"], r["flexcomm_early_hidden"])
        flag = "loses" if best < r["ddp_hidden"] else ""
        print(f"| {r['ranks']} | {r['model']} | {r['backward']} | {r['flexcomm_ring_hidden']:.0f} | "
              f"{r['flexcomm_early_hidden']:.0f} | {r['ddp_hidden']:.0f} | "
              f"{r['flexcomm_compute_us'] / 1e3:.1f} / {r['flexcomm_added_us'] / 1e3:.1f} | "
              f"{r['ddp_compute_us'] / 1e3:.1f} / {r['ddp_added_us'] / 1e3:.1f} | {flag} |")
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"allreduce": ar, "overlap": ov}, out, indent=1)


if __name__ == "__main__":
    main()
