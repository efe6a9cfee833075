#!/usr/bin/env python3
"""Chaos runs of the main job (issue 53): one rank of a chosen role is stopped (SIGSTOP) or killed
(SIGKILL) at a random time, and the job must end within FLEXCOMM_TIMEOUT + 5 s of the signal with a
non-zero exit, its first flexcomm line naming the victim's world rank.

  chaos.py --mpiexec mpiexec.mpich --mpi mpich --example build/examples/ensemble_fashion_mnist \
           [--runs 10] [--timeout 4] [--seed 1] [--cycle] [--logs DIR]

Roles and layouts (world ranks as ensemble_layout deals them: producers first, then each member's
trainers in order; the aggregator is the world rank `aggregator=` names):
  one host, 'producers=1 members=2,2,1,1 aggregator=5' (7 ranks), single_broadcast: the producer
    (world 0), a rank of the two-rank member 1 (world 4), the single-rank member 3 (world 6), the
    aggregator (world 5, member 2's only rank);
  pretend hosts 4+3 (FLEXCOMM_HOSTS), the same layout: the producer, whose host holds member 0;
  pretend hosts 3+3, adaptive feed without producer, 'members=2,2,1,1 aggregator=5': the courier
    of host 1 (world 3, its first rank, also member 1's rank 1), a rank of the two-rank member 0
    (world 1), the single-rank member 2 (world 4), the aggregator (world 5).
The signal comes 0-3 s after the job's first line (the aggregator's, once the data is loaded), so
that set-up, the first steps and training are all hit: before that line a rank only reads files,
and a rank stopped there is noticed when the others reach their first collective, not before.
Each rank runs under a shell that outlives it: Hydra ends the whole job when a rank dies of a
signal, -disable-auto-cleanup or not (a plain MPI program shows it too), while a rank that exits
leaves the others running; so a killed rank is seen by the launcher as an exit, and what the
survivors say is what is judged. Prints one line per run, then a table role x signal x layout:
runs, victim named in the first flexcomm line, runs that ended in time non-zero, worst seconds
from the signal to the end; exits 1 if any run missed. --cycle goes through every role and both
signals in turn (the CI test, 'fault chaos main job' in examples/meson.build), else each run draws
them; --signals stop|kill keeps to one.
"""
import argparse
import os
import random
import re
import signal
import subprocess
import sys
import time

KEEP_GOING = {'mpich': ['-disable-auto-cleanup'],
              'openmpi': ['--mca', 'orte_abort_on_non_zero_status', '0']}
RANK_VARIABLES = ('PMI_RANK', 'OMPI_COMM_WORLD_RANK')

ONE_HOST = dict(name='one host', layout='producers=1 members=2,2,1,1 aggregator=5', ranks=7, env={},
                preset='single_broadcast')
PRODUCER_HOSTS = dict(name='pretend hosts 4+3', layout='producers=1 members=2,2,1,1 aggregator=5', ranks=7,
                      env={'FLEXCOMM_HOSTS': '4+3'}, preset='single_broadcast')
PRETEND_HOSTS = dict(name='pretend hosts 3+3', layout='members=2,2,1,1 aggregator=5', ranks=6,
                     env={'FLEXCOMM_HOSTS': '3+3'}, preset='adaptive')
ROLES = [
    ('producer', ONE_HOST, 0),
    ('rank of a two-rank member', ONE_HOST, 4),
    ('single-rank member', ONE_HOST, 6),
    ('aggregator', ONE_HOST, 5),
    ('producer', PRODUCER_HOSTS, 0),
    ('courier (adaptive)', PRETEND_HOSTS, 3),
    ('rank of a two-rank member', PRETEND_HOSTS, 1),
    ('single-rank member', PRETEND_HOSTS, 4),
    ('aggregator', PRETEND_HOSTS, 5),
]
START_LINE = 'flexcomm ensemble on Fashion-MNIST'


def descendants(root):
    """Every process below `root` (pid), by the parent links in /proc."""
    children = {}
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open(f'/proc/{entry}/stat') as f:
                parent = int(f.read().rsplit(')', 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rank_process(root, rank, program):
    """The pid of world rank `rank` of the job launched as `root`, or None while it is not up."""
    for pid in descendants(root):
        try:
            with open(f'/proc/{pid}/environ', 'rb') as f:
                env = dict(v.split(b'=', 1) for v in f.read().split(b'\0') if b'=' in v)
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                exe = f.read().split(b'\0')[0].decode(errors='replace')
        except OSError:
            continue
        if os.path.basename(exe) != os.path.basename(program):
            continue
        for var in RANK_VARIABLES:
            if env.get(var.encode()) == str(rank).encode():
                return pid
    return None


def first_flexcomm_line(output):
    for line in output.splitlines():
        if line.startswith('flexcomm:'):
            return line
    return ''


def names(line, rank):
    """Whether `line` names world rank `rank` ("world rank 5", "world ranks 3, 5")."""
    for m in re.finditer(r'\bworld ranks? ((?:\d+(?:, host [^,;)]+)?(?:, )?)+)', line):
        if str(rank) in re.findall(r'(?<![\w-])\d+\b', re.sub(r'host [^,;)]+', '', m.group(1))):
            return True
    return False


def wait_for_line(path, text, job, limit):
    started = time.monotonic()
    while time.monotonic() - started < limit and job.poll() is None:
        with open(path, errors='replace') as f:
            if text in f.read():
                return True
        time.sleep(0.05)
    return False


def one_run(a, setup, victim, sig, delay, log_dir, index):
    env = dict(os.environ, FLEXCOMM_TIMEOUT=str(a.timeout), **setup['env'])
    # The shell outlives its rank (see the docstring): "$@" is not the last command, so not exec'd.
    cmd = [a.mpiexec, *a.mpiexec_flags.split(), *KEEP_GOING[a.mpi], '-n', str(setup['ranks']),
           'sh', '-c', '"$@"; exit $?', 'rank', a.example,
           '--layout', setup['layout'], '--preset', setup['preset'], '--epochs', '50', '--compare-baseline', 'false',
           '--train-images', '3000', '--progress-every', '1000000']
    out_path = os.path.join(log_dir, f'run{index}.log')
    with open(out_path, 'w') as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_for_line(out_path, START_LINE, job, 60)
        time.sleep(delay)
        pid = rank_process(job.pid, victim, a.example)
        signalled = None
        if pid is not None and job.poll() is None:
            os.kill(pid, sig)
            signalled = time.monotonic()
        limit = a.timeout + 5
        try:
            job.wait(timeout=limit + 30 if signalled else 120)
        except subprocess.TimeoutExpired:
            pass
        ended = time.monotonic()
        hung = job.poll() is None
        # Whatever is left (a stopped rank, a hung job) goes, so runs never pile up.
        if pid is not None:
            for s in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, s)
                except OSError:
                    pass
        if hung:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    with open(out_path, errors='replace') as f:
        output = f.read()
    first = first_flexcomm_line(output)
    took = ended - signalled if signalled else float('inf')
    named = names(first, victim)
    ok = signalled is not None and not hung and job.returncode != 0 and took <= limit and named
    return dict(ok=ok, named=named, took=took, status=job.returncode, first=first, log=out_path,
                signalled=signalled is not None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--mpiexec', required=True)
    ap.add_argument('--mpi', choices=sorted(KEEP_GOING), default='mpich')
    ap.add_argument('--mpiexec-flags', default='')
    ap.add_argument('--example', required=True, help='build/examples/ensemble_fashion_mnist')
    ap.add_argument('--runs', type=int, default=10)
    ap.add_argument('--timeout', type=float, default=4, help='FLEXCOMM_TIMEOUT, seconds')
    ap.add_argument('--seed', type=int, default=None)
    ap.add_argument('--cycle', action='store_true', help='every role and both signals in turn')
    ap.add_argument('--signals', choices=['both', 'stop', 'kill'], default='both')
    ap.add_argument('--logs', default='chaos-logs')
    a = ap.parse_args()
    rng = random.Random(a.seed)
    os.makedirs(a.logs, exist_ok=True)
    rows = {}
    missed = 0
    missed_lines = []
    signals = {'both': [signal.SIGSTOP, signal.SIGKILL], 'stop': [signal.SIGSTOP] * 2,
               'kill': [signal.SIGKILL] * 2}[a.signals]
    for i in range(a.runs):
        if a.cycle:
            role, setup, victim = ROLES[i % len(ROLES)]
            sig = signals[(i // len(ROLES) + i % len(ROLES)) % 2]
        else:
            role, setup, victim = rng.choice(ROLES)
            sig = rng.choice(signals)
        delay = rng.uniform(0.0, 3.0)
        r = one_run(a, setup, victim, sig, delay, a.logs, i)
        key = (role, signal.Signals(sig).name, setup['name'])
        row = rows.setdefault(key, dict(runs=0, named=0, ok=0, worst=0.0))
        row['runs'] += 1
        row['named'] += r['named']
        row['ok'] += r['ok']
        row['worst'] = max(row['worst'], r['took'])
        missed += not r['ok']
        if not r['ok']:
            with open(r['log'], errors='replace') as f:
                last = [line for line in f.read().splitlines() if line.strip()][-1:] or ['(empty)']
            missed_lines.append(f"MISSED run {i}: {role}, {key[1]} {delay:.1f} s after the first line, {setup['name']}: "
                                f"exit {r['status']}, {r['took']:.2f} s after the signal; first: "
                                f"{r['first'][:200] or '(no flexcomm line)'}; last: {last[0][:200]}")
        print(f"run {i}: {role} (world {victim}), {key[1]} {delay:.1f} s after the first line, {setup['name']}: "
              f"{'ok' if r['ok'] else 'MISSED'}, exit {r['status']} {r['took']:.2f} s after the signal; "
              f"first: {r['first'][:300] or '(no flexcomm line)'}  [{r['log']}]", flush=True)
    print()
    print('| role | signal | layout | runs | victim named first | ended in time, non-zero | worst s after signal |')
    print('| --- | --- | --- | --- | --- | --- | --- |')
    for (role, sig, layout), row in sorted(rows.items()):
        print(f"| {role} | {sig} | {layout} | {row['runs']} | {row['named']} | {row['ok']} | {row['worst']:.2f} |")
    # Again just above the count: CI keeps only a failed test's last lines.
    for line in missed_lines:
        print(line)
    print(f'chaos: {a.runs - missed} passed, {missed} failed')
    return 1 if missed else 0


if __name__ == '__main__':
    sys.exit(main())
