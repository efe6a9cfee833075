#!/usr/bin/env python3
"""scaling_model: an alpha-beta cost model of flexcomm's allreduce routes, fitted to one
machine's runs and used to predict clusters this project cannot reach (docs/scaling.md).

    python3 benchmarks/scaling_model.py [--data benchmarks/scaling_data] [--out DIR (default: --data)]
    gnuplot -e "data='benchmarks/scaling_data/prediction.dat'; out='docs/scaling.png'" benchmarks/scaling_model.gp

Reads the JSON that build/benchmarks/allreduce -j wrote (shm_np{2,3,4}[_runK].json: one host;
cluster_{2x1,2x2,2-1-2}_{10,1}gbit.json: hosts simulated by tests/cluster/run.sh, links shaped
to 10 or 1 Gbit/s) and machine.json (the runs' machine: cores, the cache the buffers must fit),
fits the parameters by weighted least squares (relative error; python3's standard library only),
prints predicted against measured for every point, and writes check.md, prediction.md,
prediction.dat and params.json under --out.

The routes, as the code does them (S bytes, n ranks, H hosts of q ranks, P cores per host):
  host_reducer (backend/shm/host_reducer.hpp), the shared-memory allreduce of q ranks:
    S <= 16 KiB: one round, each rank copies S into its slot and reduces all q slots; the
    step's check rides in it.  Larger: k = ceil(S / 1 MiB) chunks of three steps; a rank copies
    (q-1)/q S in, reduces its 1/q share (q-1 adds), copies it into its slot and (q-1)/q S out,
    and one more small round per call for the check.  In place (the gradients in
    gradient_memory(), S > 16 KiB): two steps; a rank reduces its 1/q share from its peers'
    regions and writes it into theirs, a block at a time, the check carried.  Ranks beyond
    the cores share them: f = max(1, q/P).
  the ring (patterns/sync/route_ring.hpp): chunks of S/n cut into m = ceil(S/n / 1 MiB)
    segments, L = 2 lanes in flight, 2(n-1) steps per lane, each step one message per rank.
  the tiers (patterns/sync/route_hierarchical.hpp): intra-host reduce to the leader, the
    ring among the H leaders, intra-host broadcast, one after another for one bucket.
"""
import argparse
import glob
import json
import math
import os
import re
import sys

MiB = 1 << 20
SMALL = 16 * 1024        # host_reducer's one-round path ends here (shared_memory small slot)
SLOT = MiB               # -S 1M: each rank's large slot
SEGMENT = MiB            # -s 1M: the ring's segment
LANES = 2                # -l 2: segments in flight
CORES = 2                # this machine: every rank of every run shares 2 cores
LLC = 32 * MiB           # the runs' machine's last-level cache: the ranks' buffers fit it or not
                         # (machine.json in --data overrides it: the runs' machine, not this one)
CHECK_ROUND = False      # runs of code whose small step took a round more for the check (machine.json)
WITHIN = 0.25            # the check's tolerance


# ---------------------------------------------------------------- measurements

def load(path):
    with open(path) as f:
        return json.load(f)


def times(doc, impls):
    """{size: best time_us over the named columns} (columns that run the same code path)."""
    out = {}
    for r in doc["results"]:
        if r["impl"] in impls and r["time_us"] > 0:
            out[r["size"]] = min(out.get(r["size"], float("inf")), r["time_us"])
    return out


def merged(paths, impls):
    """Best of the repeated runs of one layout, per size: the least-disturbed measurement."""
    best = {}
    for p in paths:
        for s, t in times(load(p), impls).items():
            best[s] = min(best.get(s, float("inf")), t)
    return best


def in_cache(S, ranks, extra):
    """Whether the host's ranks' buffers (and each one's slots or segments in flight) fit the
    last-level cache: past it every copied byte comes from memory."""
    return ranks * (S + extra) <= LLC


# ---------------------------------------------------------------- the routes' features
# Each route's time is a sum of parameter x count; features() gives the counts, so that the
# same functions serve the fit (unknown parameters) and the prediction (known ones).

def shm_allreduce_counts(S, q, cores=CORES):
    """host_reducer allreduce of S bytes over q ranks: steps, copied and reduced bytes per rank."""
    f = max(1.0, q / cores)
    if S <= SMALL:
        # the step's check rides in this round (since 2026-11-27: before, a round of its own)
        steps, copied, reduced = (2 if CHECK_ROUND else 1), S, (q - 1) * S
    else:
        k = math.ceil(S / SLOT)
        steps = 3 * k + 1  # and the check's own small round
        copied = (2 * q - 1) / q * S
        reduced = (q - 1) / q * S
    return {"steps": steps, "copied": f * copied, "reduced": f * reduced, "f": f}


def shm_in_place_counts(S, q, cores=CORES):
    """host_reducer's in-place allreduce (the bucket in gradient_memory(), S above the small
    path; below it the route takes the slots): two steps, the check carried in the first; a
    rank reduces its 1/q share from its q-1 peers' regions and writes it into theirs."""
    if S <= SMALL:
        return shm_allreduce_counts(S, q, cores)
    f = max(1.0, q / cores)
    return {"steps": 2, "placed": f * (q - 1) / q * S, "copied": 0.0, "reduced": 0.0, "f": f}


def shm_broadcast_counts(S, q, cores=CORES):
    """host_reducer broadcast: two steps per chunk; the leader copies S in, the others S out."""
    f = max(1.0, q / cores)
    k = max(1, math.ceil(S / SLOT))
    return {"steps": 2 * k, "copied": f * S, "reduced": 0.0, "f": f}


def ring_counts(S, n):
    """flexcomm's ring over n ranks: latency units, bytes each rank sends, bytes it reduces."""
    if n < 2:
        return {"lat": 0, "sent": 0.0, "reduced": 0.0}
    chunk = S / n
    m = max(1, math.ceil(chunk / SEGMENT))
    return {"lat": 2 * (n - 1) * math.ceil(m / LANES), "sent": 2 * (n - 1) / n * S, "reduced": (n - 1) / n * S}


# ---------------------------------------------------------------- least squares by hand

def solve(a, b):
    """Gaussian elimination with partial pivoting: a x = b."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            raise ZeroDivisionError("singular system")
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                k = m[r][c] / m[c][c]
                for j in range(c, n + 1):
                    m[r][j] -= k * m[c][j]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit(rows, names):
    """Non-negative weighted least squares on relative error: minimises sum ((x.theta - t)/t)^2.
    rows: (features dict, measured time, known part). A coefficient the unconstrained solution
    makes negative is held at zero and the rest refitted (costs cannot be negative)."""
    # A parameter no row exercises (runs left out) stays at zero instead of making the system singular.
    free = [nm for nm in names if any(x.get(nm, 0.0) for x, _, _ in rows)]
    while free:
        a = [[0.0] * len(free) for _ in free]
        b = [0.0] * len(free)
        for x, t, known in rows:
            w = 1.0 / (t * t)
            v = [x[nm] for nm in free]
            y = t - known
            for i in range(len(free)):
                b[i] += w * v[i] * y
                for j in range(len(free)):
                    a[i][j] += w * v[i] * v[j]
        theta = dict(zip(free, solve(a, b)))
        negative = [nm for nm in free if theta[nm] < 0]
        if not negative:
            return {nm: theta.get(nm, 0.0) for nm in names}
        free.remove(min(negative, key=lambda nm: theta[nm]))
    return {nm: 0.0 for nm in names}


def dot(x, theta):
    return sum(x.get(k, 0.0) * v for k, v in theta.items())


# ---------------------------------------------------------------- the model

class model:
    """Times in microseconds, sizes in bytes, per-byte costs in us/byte."""

    def __init__(self, p):
        self.p = p

    def shm_features(self, S, q, cores=CORES, in_place=False):
        c = (shm_in_place_counts if in_place else shm_allreduce_counts)(S, q, cores)
        over = q > cores
        # in place there are no slots: only the gradients themselves need to fit the cache
        cached = in_cache(S, q, 0 if in_place and S > SMALL else 2 * SLOT)
        placed = c.get("placed", 0.0)
        return {"a_shm": 0.0 if over else c["steps"], "a_shm_over": c["steps"] if over else 0.0,
                "q_over": 1.0 if over else 0.0, "c_copy": c["copied"] if cached else 0.0,
                "c_copy_mem": 0.0 if cached else c["copied"], "c_reduce": c["reduced"],
                "c_place": placed if cached else 0.0, "c_place_mem": 0.0 if cached else placed}

    def shm_allreduce(self, S, q, cores=CORES, in_place=False):
        return dot(self.shm_features(S, q, cores, in_place), self.p) if q > 1 else 0.0

    def shm_broadcast(self, S, q, cores=CORES):
        if q < 2:
            return 0.0
        c = shm_broadcast_counts(S, q, cores)
        a = self.p["a_shm_over"] if q > cores else self.p["a_shm"]
        return c["steps"] * a + c["copied"] * self.p["c_copy" if in_cache(S, q, 2 * SLOT) else "c_copy_mem"]

    # the ring within one host, over MPI point-to-point (MPICH's shared-memory transport)
    def p2p_features(self, S, n, cores=CORES):
        c = ring_counts(S, n)
        f = max(1.0, n / cores)
        cached = in_cache(S, n, LANES * SEGMENT)
        return ({"a_p2p": f * c["lat"], "b_p2p": f * c["sent"] if cached else 0.0,
                 "b_p2p_mem": 0.0 if cached else f * c["sent"]}, f * c["reduced"] * self.p["c_reduce"])

    def ring_on_host(self, S, n, cores=CORES):
        x, known = self.p2p_features(S, n, cores)
        return dot(x, self.p) + known

    # the ring across hosts: each step's slowest hop is the one over the host link (hosts are
    # blocks of consecutive ranks, so each host link carries one hop of every step). `busy`
    # ranks share this machine's cores: the CPU's part of every message and byte (not the
    # wire's) stretches by f = busy / cores.
    def x_features(self, S, n, rate_bps, busy, cores=CORES):
        c = ring_counts(S, n)
        f = max(1.0, busy / cores)
        link = c["sent"] * 8.0 / rate_bps * 1e6
        return {"a_x": f * c["lat"], "b_x": f * c["sent"], "k_link": link}, f * c["reduced"] * self.p["c_reduce"]

    def ring_across(self, S, n, rate_bps, busy=1, cores=CORES, software_per_byte=True, q=1):
        x, known = self.x_features(S, n, rate_bps, busy, cores)
        # software_per_byte false: a transport that keeps the CPU out of the byte path and fills
        # the link (RDMA): the bytes cost the line rate alone.
        t = dot(x, {"a_x": self.p["a_x"], "b_x": self.p["b_x"] if software_per_byte else 0.0,
                    "k_link": self.p["k_link"] if software_per_byte else 1.0}) + known
        if q > 1:
            # the ring's other hops stay inside a host (MPI point-to-point through shared
            # memory): a step waits for the slower of the two kinds of hop.
            c = ring_counts(S, n)
            per_byte = self.p["b_p2p" if in_cache(S, q, LANES * SEGMENT) else "b_p2p_mem"]
            t = max(t, c["lat"] * self.p["a_p2p"] + c["sent"] * per_byte + c["reduced"] * self.p["c_reduce"])
        return t

    # The tiers as benchmarks/allreduce -H 1 runs them: shared memory off, so an MPI_Ireduce to
    # the leader and an MPI_Ibcast from it inside each host (one message of S each way for two
    # ranks, and the reduce), around the ring among the leaders. b_tier is the per-byte cost of
    # those two stages, fitted: MPICH's collectives on busy cores are not the ring's messages.
    def tier_features(self, S, hosts, rate_bps, cores=CORES):
        n = sum(hosts)
        f = max(1.0, n / cores)
        across = self.ring_across(S, len(hosts), rate_bps, busy=n, cores=cores)
        if max(hosts) < 2:
            return {"b_tier": 0.0}, across
        return {"b_tier": f * S}, across + f * 2 * self.p["a_p2p"]

    def tiers_measured(self, S, hosts, rate_bps, cores=CORES):
        x, known = self.tier_features(S, hosts, rate_bps, cores)
        return dot(x, self.p) + known

    # the tiers on a cluster: shared memory in each host (the default where ranks share a host)
    def tiers(self, S, H, q, rate_bps, cores, software_per_byte):
        if H == 1:
            return self.shm_allreduce(S, q, cores)
        return (self.shm_allreduce(S, q, cores) + self.ring_across(S, H, rate_bps, 1, cores, software_per_byte)
                + self.shm_broadcast(S, q, cores))

    def flat(self, S, H, q, rate_bps, cores, software_per_byte):
        if H == 1:
            return self.ring_on_host(S, q, cores)
        return self.ring_across(S, H * q, rate_bps, 1, cores, software_per_byte, q=q)


# ---------------------------------------------------------------- the runs

def cluster_files(data):
    """(path, ranks per host, link rate in bit/s) for each cluster run."""
    out = []
    for p in sorted(glob.glob(os.path.join(data, "cluster_*.json"))):
        m = re.match(r"cluster_([0-9x-]+)_([0-9]+)gbit", os.path.basename(p))
        if not m:
            continue
        layout = m.group(1)
        hosts = [int(layout.split("x")[1])] * int(layout.split("x")[0]) if "x" in layout else [int(h) for h in layout.split("-")]
        out.append((p, hosts, int(m.group(2)) * 1e9))
    return out


def shm_runs(data):
    """{q: [paths]} for the one-host runs (repeats: shm_npQ.json, shm_npQ_run2.json, ...)."""
    out = {}
    for p in sorted(glob.glob(os.path.join(data, "shm_np*.json"))):
        m = re.match(r"shm_np([0-9]+)", os.path.basename(p))
        out.setdefault(int(m.group(1)), []).append(p)
    return out


def pretty(S):
    for unit, b in (("MiB", MiB), ("KiB", 1024)):
        if S >= b:
            return f"{S / b:g} {unit}"
    return f"{S} B"


def crossing(m, S, q, rate_g, tcp, stays=False):
    """Where the tiers beat the flat ring, from 2 hosts to 128 (8..1024 ranks at q per host):
    the rank counts, or (stays) the first count from which they stay ahead."""
    ahead = []
    for e in range(1, 8):
        H = 1 << e
        ahead.append((H * q, m.tiers(S, H, q, rate_g * 1e9, q, tcp) < m.flat(S, H, q, rate_g * 1e9, q, tcp)))
    if stays:
        first = None
        for n, a in ahead:
            first = (first or n) if a else None
        return f">= {first}" if first else "never"
    won = [str(n) for n, a in ahead if a]
    return ", ".join(won) + " ranks" if won else "no rank count up to 1024"


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(here, "scaling_data"))
    ap.add_argument("--out", help="where the tables go (default: --data)")
    args = ap.parse_args()
    args.out = args.out or args.data

    machine = os.path.join(args.data, "machine.json")
    if os.path.exists(machine):
        global LLC, CHECK_ROUND
        spec = load(machine)
        CHECK_ROUND = spec.get("small_check_round", False)
        if spec.get("cores", CORES) != CORES:
            sys.exit(f"scaling_model: {machine}: the model is written for runs on {CORES} cores")
        LLC = spec["cache_bytes"]
    shm = shm_runs(args.data)
    if not shm:
        sys.exit(f"scaling_model: no shm_np*.json under {args.data}")
    clusters = cluster_files(args.data)
    names = ("a_shm", "a_shm_over", "q_over", "c_copy", "c_copy_mem", "c_reduce", "c_place", "c_place_mem",
             "a_p2p", "b_p2p", "b_p2p_mem", "a_x", "b_x", "k_link", "b_tier")
    p = {k: 0.0 for k in names}
    m = model(p)
    checks = []  # (route, layout, S, measured, predicted, "fit" or "check", ranks beyond cores?)

    # 1. host_reducer, through its slots and in place (the gradients in gradient_memory()): the
    # steps and the waits shared, the bytes priced per route. Fit on every other size of the
    # sweep (factor 16), check on the sizes between.
    routes = (("shared memory (host_reducer)", "subgroup_allreduce shm", False),
              ("shared memory in place (gradient_memory)", "subgroup_allreduce shm in place", True))
    shm_meas = {(q, in_place): merged(paths, {column}) for _, column, in_place in routes for q, paths in shm.items()}
    sizes = sorted({s for t in shm_meas.values() for s in t})
    fit_sizes = set(sizes[0::2])
    # The bytes' costs from the runs with a core per rank; then what ranks beyond the cores add,
    # from the others (their waits come in the wait policy's sleeps, and fitted together they
    # would bend the per-byte costs to the sleeps).
    own = ["a_shm", "c_copy", "c_copy_mem", "c_reduce", "c_place", "c_place_mem"]
    rows = [(m.shm_features(S, q, in_place=in_place), t, 0.0)
            for (q, in_place), tt in shm_meas.items() for S, t in tt.items() if S in fit_sizes and q <= CORES]
    p.update(fit(rows, own))
    rows = []
    for (q, in_place), tt in shm_meas.items():
        for S, t in tt.items():
            if S in fit_sizes and q > CORES:
                x = m.shm_features(S, q, in_place=in_place)
                rows.append((x, t, dot({k: x[k] for k in own}, p)))
    p.update(fit(rows, ["a_shm_over", "q_over"]))
    for group, _, in_place in routes:
        for q in sorted(shm):
            for S, t in sorted(shm_meas[(q, in_place)].items()):
                checks.append((group, f"{q} ranks, 1 host", S, t, m.shm_allreduce(S, q, in_place=in_place),
                               "fit" if S in fit_sizes else "check", q > CORES))

    # 2. the ring over MPI point-to-point on one host (overlapped_ring, shared memory off): the
    # intra-host hop of a flat ring. From 256 KiB (below, one message per step is all latency
    # and the engine's hand-over); fit on every other size at 2 ranks, check the rest.
    ring_meas = {q: merged(paths, {"overlapped_ring"}) for q, paths in shm.items()}
    ring_sizes = sorted(S for S in ring_meas.get(2, {}) if S >= 256 * 1024)
    ring_fit = set(ring_sizes[0::2])
    rows = []
    for S in ring_fit:
        x, known = m.p2p_features(S, 2)
        rows.append((x, ring_meas[2][S], known))
    p.update(fit(rows, ["a_p2p", "b_p2p", "b_p2p_mem"]))
    for q, tt in sorted(ring_meas.items()):
        for S, t in sorted(tt.items()):
            if S >= 256 * 1024:
                checks.append(("ring over MPI p2p", f"{q} ranks, 1 host", S, t, m.ring_on_host(S, q),
                               "fit" if q == 2 and S in ring_fit else "check", q > CORES))

    # 3. the ring across simulated hosts: fit on two hosts (1+1 and 2+2), check on 2+1+2.
    # Then the tiers' intra-host stages: b_tier fitted on 2+2, checked on 2+1+2.
    runs = []
    for path, hosts, rate in clusters:
        doc = load(path)
        flat = times(doc, {"overlapped_ring", "overlapped_ring shm"})  # the same route across hosts
        tiers = times(doc, {"overlapped_ring hier"})
        runs.append((hosts, rate, flat, tiers, len(hosts) == 2))
    rows = []
    for hosts, rate, flat, tiers, fitted in runs:
        for S, t in flat.items():
            if fitted:
                x, known = m.x_features(S, sum(hosts), rate, sum(hosts))
                rows.append((x, t, known))
    if rows:
        p.update(fit(rows, ["a_x", "b_x", "k_link"]))
    rows = []
    for hosts, rate, flat, tiers, fitted in runs:
        for S, t in tiers.items():
            if fitted and max(hosts) > 1:
                x, known = m.tier_features(S, hosts, rate)
                rows.append((x, t, known))
    if rows:
        p.update(fit(rows, ["b_tier"]))
    for hosts, rate, flat, tiers, fitted in runs:
        layout = "+".join(map(str, hosts))
        n = sum(hosts)
        for S, t in sorted(flat.items()):
            checks.append(("flat ring across hosts", f"{layout} at {rate / 1e9:g} Gbit/s", S, t,
                           m.ring_across(S, n, rate, busy=n), "fit" if fitted else "check", n > CORES))
        if max(hosts) < 2:
            continue  # one rank per host: the tiers are the ring among the leaders, already there
        for S, t in sorted(tiers.items()):
            checks.append(("hierarchical (tiers) across hosts", f"{layout} at {rate / 1e9:g} Gbit/s", S, t,
                           m.tiers_measured(S, hosts, rate), "fit" if fitted else "check", n > CORES))

    os.makedirs(args.out, exist_ok=True)
    units = {"a_shm": "us/step", "a_shm_over": "us/step", "q_over": "us/call", "c_copy": "us/B", "c_copy_mem": "us/B",
             "c_reduce": "us/B", "c_place": "us/B", "c_place_mem": "us/B", "a_p2p": "us/message", "b_p2p": "us/B", "b_p2p_mem": "us/B", "a_x": "us/message",
             "b_x": "us/B", "k_link": "x line time", "b_tier": "us/B"}
    with open(os.path.join(args.out, "params.json"), "w") as f:
        json.dump({k: {"value": v, "unit": units[k]} for k, v in p.items()}, f, indent=1)
        f.write("\n")

    # ------------------------------------------------------------ the check
    lines = ["| route | layout | size | measured (us) | predicted (us) | predicted / measured | used for |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for group, label, S, t, pred, use, over in checks:
        r = pred / t
        miss = abs(r - 1) > WITHIN
        mark = "**" if miss else ""
        lines.append(f"| {group} | {label}{' (ranks > cores)' if over else ''} | {pretty(S)} | {t:.1f} | {pred:.1f} | "
                     f"{mark}{r:.2f}{mark} | {use} |")
    lines.append("")
    lines.append(f"Points within {WITHIN:.0%} of the measurement (the rest in bold above):")
    lines.append("")
    lines.append("| route | a core per rank | ranks beyond the 2 cores |")
    lines.append("| --- | --- | --- |")
    for group in dict.fromkeys(c[0] for c in checks):
        cells = []
        for over in (False, True):
            mine = [c for c in checks if c[0] == group and c[6] == over]
            hit = sum(abs(c[4] / c[3] - 1) <= WITHIN for c in mine)
            cells.append(f"{hit} of {len(mine)}" if mine else "-")
        lines.append(f"| {group} | {cells[0]} | {cells[1]} |")
    check_md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "check.md"), "w") as f:
        f.write(check_md)

    # ------------------------------------------------------------ the prediction
    # 8 ranks per host with a core each; one link per host at the given rate. Two views of the
    # per-byte software cost across hosts: "rdma" (the link alone: a zero-copy transport keeps
    # the CPU out of the byte path) and "tcp" (this machine's fitted b_x stays in every byte).
    q = 8
    pred_lines = ["| ranks | hosts | link | gradients | flat ring (ms) | hierarchical (ms) | hier / flat | flat, TCP stack (ms) | hierarchical, TCP stack (ms) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    dat = ["# ranks hosts rate_gbit size_mib flat_ms hier_ms flat_tcp_ms hier_tcp_ms"]
    for rate_g in (100, 400):
        for size_mib in (25, 100):
            S = size_mib * MiB
            for e in range(3, 11):
                n = 1 << e
                H = n // q
                fl = m.flat(S, H, q, rate_g * 1e9, q, False) / 1e3
                hi = m.tiers(S, H, q, rate_g * 1e9, q, False) / 1e3
                fl_t = m.flat(S, H, q, rate_g * 1e9, q, True) / 1e3
                hi_t = m.tiers(S, H, q, rate_g * 1e9, q, True) / 1e3
                pred_lines.append(f"| {n} | {H} | {rate_g} Gbit/s | {size_mib} MiB | {fl:.2f} | {hi:.2f} | {hi / fl:.2f} | {fl_t:.2f} | {hi_t:.2f} |")
                dat.append(f"{n} {H} {rate_g} {size_mib} {fl:.4f} {hi:.4f} {fl_t:.4f} {hi_t:.4f}")
            dat.append("")
            dat.append("")
    pred_lines.append("")
    wins = {}
    for key in ("rdma", "tcp"):
        for rate_g in (100, 400):
            for size_mib in (25, 100):
                won = wins.setdefault((key, rate_g, size_mib), [])
                pred_lines.append(f"- {'link alone' if key == 'rdma' else 'with this TCP stack'}, {rate_g} Gbit/s, "
                                  f"{size_mib} MiB: hierarchical faster at {crossing(m, size_mib * MiB, q, rate_g, key == 'tcp')}")
    # How the answer moves with the per-message latency across hosts (a user's own network):
    # the first rank count from which the tiers stay ahead, link alone.
    pred_lines.append("")
    pred_lines.append("| per-message latency across hosts (us) | 100 Gbit/s, 25 MiB | 100 Gbit/s, 100 MiB | 400 Gbit/s, 25 MiB | 400 Gbit/s, 100 MiB |")
    pred_lines.append("| --- | --- | --- | --- | --- |")
    fitted_a = p["a_x"]
    for a in (fitted_a, 100.0, 30.0, 10.0, 3.0):
        p["a_x"] = a
        cells = [crossing(m, size_mib * MiB, q, rate_g, False, stays=True) for rate_g in (100, 400) for size_mib in (25, 100)]
        label = f"{a:.0f} (fitted)" if a == fitted_a else f"{a:g}"
        pred_lines.append(f"| {label} | " + " | ".join(cells) + " |")
    p["a_x"] = fitted_a
    # ... and with the intra-host hop of the flat ring (MPI point-to-point between ranks on a
    # host, beyond the cache) as fast as a user's host makes it, at 100 Gbit/s.
    pred_lines.append("")
    fitted_b = p["b_p2p_mem"]
    rates = (1e-3 / fitted_b, 12.5, 50.0)  # GB/s
    pred_lines.append("| per-message latency (us) | " + " | ".join(
        f"{size_mib} MiB, intra-host hop {gb:.1f} GB/s{' (fitted)' if i == 0 else ''}"
        for size_mib in (25, 100) for i, gb in enumerate(rates)) + " |")
    pred_lines.append("| --- " * 7 + "|")
    for a in (fitted_a, 30.0, 3.0):
        p["a_x"] = a
        cells = []
        for size_mib in (25, 100):
            for gb in rates:
                p["b_p2p_mem"] = 1e-3 / gb
                cells.append(crossing(m, size_mib * MiB, q, 100, False, stays=True))
        p["b_p2p_mem"] = fitted_b
        label = f"{a:.0f} (fitted)" if a == fitted_a else f"{a:g}"
        pred_lines.append(f"| {label} | " + " | ".join(cells) + " |")
    p["a_x"] = fitted_a
    # One host of 8 ranks with the gradients in gradient_memory(): the in-place route, where the
    # adapters take it (one host; the tiers' intra-host stages use the slots).
    pred_lines.append("")
    if not (p["c_place"] or p["c_place_mem"]):
        pred_lines.append("(no in-place runs in these data: the in-place route is not predicted)")
    else:
        pred_lines.append("| one host, 8 ranks | shared memory, slots (ms) | shared memory, in place (ms) | in place / slots |")
        pred_lines.append("| --- | --- | --- | --- |")
        for size_mib in (25, 100):
            S = size_mib * MiB
            slots, placed = m.shm_allreduce(S, q, q) / 1e3, m.shm_allreduce(S, q, q, in_place=True) / 1e3
            pred_lines.append(f"| {size_mib} MiB | {slots:.2f} | {placed:.2f} | {placed / slots:.2f} |")
    # The configurations of the published figures docs/scaling.md compares with.
    pred_lines.append("")
    pred_lines.append("| published configuration | ranks | hosts | link | size | model: flat ring (ms) | model: hierarchical (ms) |")
    pred_lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    for what, n, qq, rate_g, S in (("NCCL 2.4.7, 8-GPU hosts, EFA (nccl#235)", 16, 8, 100, 70e6),
                                   ("NCCL 2.4.7, 8-GPU hosts, EFA (nccl#235)", 32, 8, 100, 70e6),
                                   ("NCCL 2.4.7, 8-GPU hosts, EFA (nccl#235)", 64, 8, 100, 70e6),
                                   ("Horovod, 4 GPUs/server, 25 Gbit/s RoCE", 512, 4, 25, 100 * MiB)):
        H = n // qq
        pred_lines.append(f"| {what} | {n} | {H} | {rate_g} Gbit/s | {S / 1e6:.0f} MB | "
                          f"{m.flat(S, H, qq, rate_g * 1e9, qq, False) / 1e3:.1f} | {m.tiers(S, H, qq, rate_g * 1e9, qq, False) / 1e3:.1f} |")
    pred_md = "\n".join(pred_lines) + "\n"
    with open(os.path.join(args.out, "prediction.md"), "w") as f:
        f.write(pred_md)
    with open(os.path.join(args.out, "prediction.dat"), "w") as f:
        f.write("\n".join(dat) + "\n")

    print("# fitted parameters")
    for k, v in p.items():
        print(f"  {k:11s} {v:.6g} {units[k]}")
    print("\n# predicted vs measured\n" + check_md)
    print("# prediction: 8 ranks per host\n" + pred_md)


if __name__ == "__main__":
    main()
