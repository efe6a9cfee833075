"""allreduce_gloo: benchmarks/allreduce's sweep done by torch.distributed's Gloo backend.

Started the way DDP users start it:
    torchrun --standalone --nproc_per_node 4 benchmarks/peers/allreduce_gloo.py -b 4K -e 64M -f 2 -n 20 -w 3 -c 1 \
        -j gloo.json

Same method and columns as benchmarks/allreduce.cpp: one float buffer of `size` bytes reduced
in place (dist.all_reduce, SUM); `w` warm-up calls, one checked call (#wrong: elements that differ
from the locally computed sum of the same small-integer fill), then `n` timed calls after a
barrier; time is the slowest rank's mean, algbw = size / time, busbw = algbw * 2(n-1)/n.
"""
import argparse
import json
import os
import re
import time

import torch
import torch.distributed as dist


def parse_bytes(text):
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not m:
        raise SystemExit(f"allreduce_gloo: expected a size such as 4096, 4K, 64M; got '{text}'")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def fill(buf, rank):
    # (rank + i) % 3 + 1, as benchmarks/allreduce.cpp: small integers keep the sum exact.
    buf.copy_(torch.remainder(torch.arange(buf.numel(), dtype=torch.int64) + rank, 3) + 1)


def count_wrong(buf, ranks):
    want = torch.zeros_like(buf)
    other = torch.empty_like(buf)
    for r in range(ranks):
        fill(other, r)
        want.add_(other)
    return int((buf != want).sum())


def slowest(value, op=dist.ReduceOp.MAX):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t[0])


def measure(buf, warmup, iters, check, ranks, rank):
    fill(buf, rank)
    for _ in range(warmup):
        dist.all_reduce(buf)
    wrong = 0
    if check:
        fill(buf, rank)
        dist.all_reduce(buf)
        wrong = int(slowest(count_wrong(buf, ranks), dist.ReduceOp.SUM))
    fill(buf, rank)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    us = slowest((time.perf_counter() - start) * 1e6 / iters)
    algbw = buf.numel() * buf.element_size() / us / 1e3  # GB/s
    return {"time_us": us, "algbw": algbw, "busbw": algbw * 2 * (ranks - 1) / ranks, "wrong": wrong}


def main():
    p = argparse.ArgumentParser(description="allreduce sweep through torch.distributed (Gloo), nccl-tests flags")
    p.add_argument("-b", "--minbytes", default="4K")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=float, default=2)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-c", "--check", type=int, default=1)
    p.add_argument("-j", "--json", help="write results as JSON here (rank 0)")
    a = p.parse_args()
    if a.stepfactor <= 1:
        raise SystemExit("allreduce_gloo: -f must be > 1")
    # Without a store address in the environment this is not under torchrun; say how to start it.
    if "MASTER_ADDR" not in os.environ:
        raise SystemExit("allreduce_gloo: start it with torchrun --standalone --nproc_per_node N " + __file__)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    root = rank == 0
    impl = "gloo allreduce"
    if root:
        print(f"# torch.distributed allreduce: {ranks} ranks, backend gloo, torch {torch.__version__}, "
              f"torch threads {torch.get_num_threads()}, "
              f"OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS', 'unset')}, in place")
        print(f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} | {impl:<39} |")
        print(f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'':>5} |"
              f" {'time(us)':>9} {'algbw':>8} {'busbw':>8} {'#wrong':>7}  |")
    records = []
    lo, hi = parse_bytes(a.minbytes), parse_bytes(a.maxbytes)
    size = float(lo)
    while size <= hi * 1.0000001:
        count = max(1, int(size) // 4)
        buf = torch.empty(count, dtype=torch.float32)
        r = measure(buf, a.warmup_iters, a.iters, a.check, ranks, rank)
        if root:
            print(f"  {count * 4:>10} {count:>12} {'float':>8} {'sum':>6} {-1:>5} | {r['time_us']:9.1f} "
                  f"{r['algbw']:8.3f} {r['busbw']:8.3f} {r['wrong']:7d}  |", flush=True)
            records.append({"impl": impl, "size": count * 4, "count": count, "type": "float", "redop": "sum",
                            "ranks": ranks, **r})
        size *= a.stepfactor
    if root:
        avg = sum(r["busbw"] for r in records) / max(1, len(records))
        print(f"# Avg bus bandwidth: {impl} {avg:.3f} GB/s;")
        if a.json:
            with open(a.json, "w") as out:
                json.dump({"benchmark": "allreduce_gloo", "ranks": ranks, "torch": torch.__version__,
                           "results": records}, out, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
