"""overlap_ddp: benchmarks/overlap's synthetic backward under PyTorch's DistributedDataParallel (Gloo).

    torchrun --standalone --nproc_per_node 2 benchmarks/peers/overlap_ddp.py --scale 64 -n 40 -w 5 -j ddp.json

The module has one parameter per tensor of torchvision's ResNet-50 / VGG-16 (the profiles of
overlap.cpp, divided by --scale), chained in forward order by an autograd Function whose backward
computes that tensor's gradient. Backprop therefore runs from the last tensor to the first, and as
each gradient lands DDP's own autograd hooks mark it ready and its reducer launches a Gloo
allreduce per full bucket (bucket_cap_mb = overlap.cpp's bucket, 25 MiB / scale), which Gloo's
threads run while backward goes on.

Two kinds of backward, as overlap.cpp:
- cpu: each gradient is computed by peer_backward.so (benchmarks/peers/backward.cpp), the same
  `-k` dependent multiply-adds per parameter as overlap.cpp's compute_gradient, on the thread
  that runs backward (ctypes releases the GIL during the call);
- idle: the gradient is written without compute and the backward thread sleeps until the share of
  the CPU backward's time that the tensors so far stand for has passed (time.sleep: the GIL is
  released, the core is free for Gloo's threads), as a host whose accelerator computes.

Rows: "gloo after backward" (plain backward, then the same buckets allreduced by Gloo, the
baseline that exposes all communication) and "DDP". Columns and definitions are overlap.cpp's:
Overall (step with sync), Compute (the same backward, no sync), Pure-Comm (the row's
communication with no compute), Overlap(%) = 100 (1 - (Overall - Compute) / Pure-Comm),
Hidden(%) the same with the exposed time of sync-after-backward in place of Pure-Comm, speedup
over sync-after-backward. Times are the slowest rank's mean over -n steps after -w warm-up steps.
"""
import argparse
import ctypes
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def resnet50():
    """torchvision's resnet50, every parameter tensor in forward order (as overlap.cpp)."""
    p = []
    conv = lambda i, o, k: p.append(i * o * k * k)  # noqa: E731
    bn = lambda c: p.extend([c, c])  # noqa: E731
    conv(3, 64, 7)
    bn(64)
    inplanes = 64
    for planes, blocks in zip([64, 128, 256, 512], [3, 4, 6, 3]):
        for b in range(blocks):
            width, out = planes, planes * 4
            conv(inplanes, width, 1); bn(width)  # noqa: E702
            conv(width, width, 3); bn(width)  # noqa: E702
            conv(width, out, 1); bn(out)  # noqa: E702
            if b == 0:
                conv(inplanes, out, 1); bn(out)  # noqa: E702  downsample
            inplanes = out
    p.extend([2048 * 1000, 1000])
    assert len(p) == 161 and sum(p) == 25557032
    return p


def vgg16():
    """torchvision's vgg16 (no batch norm), weights and biases in forward order."""
    p, cin = [], 3
    for c in [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]:
        p.extend([cin * c * 9, c])
        cin = c
    for i, o in [(25088, 4096), (4096, 4096), (4096, 1000)]:
        p.extend([i * o, o])
    assert len(p) == 32 and sum(p) == 138357544
    return p


class Layer(torch.autograd.Function):
    """Forward passes the chain's token on; backward produces the weight's gradient."""

    @staticmethod
    def forward(ctx, token, weight, index, model):
        ctx.index, ctx.model = index, model
        return token.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.model.gradient(ctx.index), None, None


class Synthetic(torch.nn.Module):
    def __init__(self, sizes, work, library):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n)) for n in sizes)
        # Plain lists: ParameterList's indexing costs microseconds per call, per layer and step.
        self.tensors, self.sizes = list(self.weights), sizes
        self.work, self.compute_gradient = work, library.flexcomm_peer_gradient
        self.compute_gradient.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        self.compute_gradient.restype = None
        self.mode, self.step, self.idle_s, self.start = "cpu", 0, 0.0, 0.0
        # Share of all parameters whose gradients exist once tensor i's is done (backward order).
        total, done, self.share = sum(sizes), 0, [0.0] * len(sizes)
        for i in reversed(range(len(sizes))):
            done += sizes[i]
            self.share[i] = done / total

    def forward(self, token):
        for i, w in enumerate(self.tensors):
            token = Layer.apply(token, w, i, self)
        return token

    def gradient(self, i):
        if i == len(self.sizes) - 1:  # backward begins (after forward, as overlap.cpp's clock)
            self.start = time.perf_counter()
        g = torch.empty(self.sizes[i])
        self.compute_gradient(g.data_ptr(), self.sizes[i], self.work if self.mode == "cpu" else 0, self.step)
        if self.mode == "idle":
            left = self.start + self.idle_s * self.share[i] - time.perf_counter()
            if left > 0:
                time.sleep(left)
        return g


def buckets_of(params, cap):
    """Gradient buckets in backward order, each filled up to `cap` bytes (at least one tensor)."""
    out, cur, used = [], [], 0
    for p in reversed(list(params)):
        b = p.numel() * p.element_size()
        if cur and used + b > cap:
            out.append(cur)
            cur, used = [], 0
        cur.append(p)
        used += b
    if cur:
        out.append(cur)
    return out


def slowest(value):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def time_steps(warmup, iters, step):
    """Mean step time in microseconds of the slowest rank over `iters` steps after `warmup`."""
    for s in range(warmup):
        step(s)
    dist.barrier()
    start = time.perf_counter()
    for s in range(iters):
        step(warmup + s)
    return slowest((time.perf_counter() - start) * 1e6 / iters)


def overlap_percent(overall, compute, comm):
    if comm <= 0:
        return 0.0
    return min(100.0, max(0.0, 100.0 * (1.0 - (overall - compute) / comm)))


def main():
    p = argparse.ArgumentParser(description="overlap.cpp's synthetic backward under DDP (Gloo)")
    p.add_argument("-m", "--models", default="resnet50,vgg16")
    p.add_argument("--scale", type=float, default=64)
    p.add_argument("-b", "--bucket", type=int, default=0, help="bucket bytes (default: 25 MiB / scale)")
    p.add_argument("-k", "--work", type=int, default=16, help="multiply-adds per parameter in backward")
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("-w", "--warmup_iters", type=int, default=3)
    p.add_argument("--first-bucket", type=int, default=0,
                   help="DDP's first bucket in bytes (default: DDP's own 1 MiB / scale, as the model is scaled)")
    p.add_argument("--idle-us", default="",
                   help="MODEL=US,...: the idle backward's length (default: this run's CPU backward); "
                        "run.sh passes flexcomm's, so that both hosts sit idle equally long")
    p.add_argument("-j", "--json")
    p.add_argument("--library", default=os.path.join("build", "benchmarks", "peers", "peer_backward.so"),
                   help="peer_backward.so built by meson (ninja -C build benchmarks/peers/peer_backward.so)")
    a = p.parse_args()
    if "MASTER_ADDR" not in os.environ:
        raise SystemExit("overlap_ddp: start it with torchrun --standalone --nproc_per_node N " + __file__)
    if not os.path.exists(a.library):
        raise SystemExit(f"overlap_ddp: {a.library} not found; build it: "
                         "ninja -C build benchmarks/peers/peer_backward.so")
    library = ctypes.CDLL(os.path.abspath(a.library))
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    root = rank == 0
    bucket = a.bucket or max(4096, int(25 * 2**20 / a.scale))  # flexcomm's default_bucket_bytes / scale
    # DDP caps the bucket that fills first (the last layers') at 1 MiB of a 25 MiB model-scale
    # bucket; scaled with the model, as the 25 MiB are.
    dist._DEFAULT_FIRST_BUCKET_BYTES = a.first_bucket or max(4096, int(dist._DEFAULT_FIRST_BUCKET_BYTES / a.scale))
    idle_us = {m: float(v) for m, v in (x.split("=") for x in a.idle_us.split(",") if x)}
    if root:
        print(f"# DDP overlap: {ranks} ranks, backend gloo, torch {torch.__version__}, torch threads "
              f"{torch.get_num_threads()}, OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS', 'unset')}, "
              f"{os.cpu_count()} cores, scale 1/{a.scale:g}, {a.work} multiply-adds/param")
    records = []
    token = torch.zeros(1)
    for name, profile in (("resnet50", resnet50), ("vgg16", vgg16)):
        if name not in a.models:
            continue
        full = profile()
        sizes = [max(1, round(n / a.scale)) for n in full]
        model = Synthetic(sizes, a.work, library)
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket / 2**20)
        groups = buckets_of(model.parameters(), bucket)

        def plain(s, sync=None):
            model.step = s
            model.zero_grad(set_to_none=True)
            model(token).sum().backward()
            if sync:
                sync()

        def after():
            # What DDP does, but after backward: flatten each bucket, allreduce them all, average.
            flats = [torch.cat([p.grad.view(-1) for p in g]) for g in groups]
            for w in [dist.all_reduce(f, async_op=True) for f in flats]:
                w.wait()
            for g, f in zip(groups, flats):
                f.div_(ranks)
                for p, v in zip(g, torch._utils._unflatten_dense_tensors(f, [p.grad for p in g])):
                    p.grad.copy_(v)

        def with_ddp(s):
            model.step = s
            ddp.zero_grad(set_to_none=True)
            ddp(token).sum().backward()

        model.mode = "cpu"
        cpu_compute = time_steps(a.warmup_iters, a.iters, plain)
        for kind in ("cpu", "idle"):
            model.idle_s = idle_us.get(name, cpu_compute) / 1e6
            model.mode = kind
            compute = cpu_compute if kind == "cpu" else time_steps(a.warmup_iters, a.iters, plain)
            rows = []
            for row, step in (("gloo after backward (same buckets)", lambda s: plain(s, after)),
                              ("DDP (its buckets and hooks)", with_ddp)):
                model.mode = kind
                overall = time_steps(a.warmup_iters, a.iters, step)
                model.mode = "none"  # gradients written, no compute, no waiting: communication alone
                comm = time_steps(a.warmup_iters, a.iters, step)
                rows.append((row, overall, comm))
            # DDP rebuilds its buckets in the order gradients became ready after its first step.
            logged = ddp._get_ddp_logging_data()
            ddp_buckets = str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes", ""))
            counts = [len(groups), len([x for x in ddp_buckets.split(",") if x.strip()])]
            if root:
                print(f"# {name}: {len(sizes)} tensors, {sum(full)} parameters (full model), "
                      f"{sum(sizes)} after scaling = {sum(sizes) * 4 / 2**20:.2f} MiB of float gradients, "
                      f"buckets of {bucket} bytes (DDP's, bytes: {ddp_buckets})")
                print("# backward: " + (f"host idle for {model.idle_s * 1e6:.0f} us "
                                        f"({'given' if name in idle_us else 'as long as the CPU backward took'}: "
                                        "an accelerator computes)"
                                        if kind == "idle" else "CPU multiply-adds on the thread running backward"))
                print(f"# {'adapter':<42} {'buckets':>8} {'Overall(us)':>12} {'Compute(us)':>12} {'Pure-Comm(us)':>13} "
                      f"{'Overlap(%)':>11} {'Hidden(%)':>10} {'speedup':>13}")
                exposed = rows[0][1] - compute
                for (row, overall, comm), count in zip(rows, counts):
                    print(f"  {row:<42} {count:>8} {overall:12.0f} {compute:12.0f} {comm:13.0f} "
                          f"{overlap_percent(overall, compute, comm):11.1f} "
                          f"{overlap_percent(overall, compute, exposed):10.1f} {rows[0][1] / overall:13.2f}",
                          flush=True)
                    records.append({"model": name, "backward": kind, "adapter": row, "ranks": ranks, "scale": a.scale,
                                    "parameters": sum(sizes), "buckets": count, "overall_us": overall,
                                    "compute_us": compute, "pure_comm_us": comm,
                                    "idle_us": model.idle_s * 1e6 if kind == "idle" else 0,
                                    "overlap_percent": overlap_percent(overall, compute, comm),
                                    "hidden_vs_after_backward_percent": overlap_percent(overall, compute, exposed)})

    if root and a.json:
        with open(a.json, "w") as out:
            json.dump({"benchmark": "overlap_ddp", "ranks": ranks, "work": a.work, "torch": torch.__version__,
                       "results": records}, out, indent=1)
    # Leave without destructors: in torch 1.13 the Reducer's ProcessGroupGloo destructor joins Gloo's
    # worker threads while holding the GIL, and a worker dropping the last reference to a Python
    # tensor waits for the GIL: the rank hangs at exit (seen here, with its TCPStore thread spinning).
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
