#!/usr/bin/env python3
"""Draws benchmarks/feed_sweep's JSON (one file per K) as a PNG, and prints the markdown table of
docs/benchmarks.md.

For each K, a panel: every feed's wall time over the best fixed feed's at that point, against the
point's cost ratio (preprocessing ms / training ms per step, log scale). Needs gnuplot
(Debian: gnuplot-nox).

    python3 benchmarks/plot_feed_sweep.py --png docs/feed_sweep.png sweep_k2.json sweep_k4.json sweep_k8.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

FEEDS = ['local_feed', 'one_to_many_1p', 'one_to_many_2p', 'all_shared', 'adaptive']


def load(paths):
    runs = [json.load(open(p)) for p in paths]
    return sorted(runs, key=lambda r: r['members'])


def table(runs):
    out = ['| K | train ms | pre ms | steps | ' + ' | '.join(f'{f} wall (s) / best' for f in FEEDS) +
           ' | adaptive cpu / lowest | made by trainers |',
           '| --- | --- | --- | --- | ' + ' | '.join('---' for _ in FEEDS) + ' | --- | --- |']
    worst_wall = worst_cpu = 0.0
    # How far each fixed feed is from the best, at its worst point.
    fixed_worst = {f: 0.0 for f in FEEDS[:-1]}
    for run in runs:
        for p in run['points']:
            by = {f['feed']: f for f in p['feeds']}
            cells = []
            for name in FEEDS:
                f = by[name]
                cell = f"{f['wall_s']:.3f} / {f['wall_over_best']:.2f}"
                if f['wall_over_best'] <= 1.0 + 1e-9 and name != 'adaptive':
                    cell = f'**{cell}**'
                cells.append(cell)
                if name in fixed_worst:
                    fixed_worst[name] = max(fixed_worst[name], f['wall_over_best'])
            a = by['adaptive']
            worst_wall = max(worst_wall, a['wall_over_best'])
            worst_cpu = max(worst_cpu, a['cpu_over_lowest'])
            out.append(f"| {run['members']} | {p['train_ms']:g} | {p['pre_ms']:g} | {p['steps']} | " + ' | '.join(cells) +
                       f" | {a['cpu_over_lowest']:.2f} | {a['made_by_trainers']} |")
    out.append('')
    out.append(f'adaptive: worst wall / best fixed {worst_wall:.2f}, worst cpu / lowest fixed {worst_cpu:.2f}; '
               'each fixed feed at its worst point: ' +
               ', '.join(f'{f} {w:.2f}' for f, w in fixed_worst.items()))
    return '\n'.join(out)


def plot(runs, png):
    with tempfile.TemporaryDirectory() as tmp:
        script = [f"set terminal pngcairo size {420 * len(runs)},420 font ',9'" if has_cairo() else
                  f"set terminal png size {420 * len(runs)},420",
                  f"set output '{png}'", f'set multiplot layout 1,{len(runs)}', 'set logscale x',
                  'set xlabel "preprocessing / training time per step"', 'set ylabel "wall / best fixed feed"',
                  'set key top left', 'set grid', 'set yrange [0.8:*]']
        for run in runs:
            series = []
            for name in FEEDS:
                rows = sorted((p['pre_ms'] / p['train_ms'], next(f for f in p['feeds'] if f['feed'] == name)['wall_over_best'])
                              for p in run['points'])
                path = os.path.join(tmp, f"k{run['members']}_{name}.dat")
                with open(path, 'w') as f:
                    f.writelines(f'{x} {y}\n' for x, y in rows)
                width = 3 if name == 'adaptive' else 1
                series.append(f"'{path}' using 1:2 with linespoints lw {width} title '{name}'")
            script.append(f"set title 'K = {run['members']} members'")
            script.append('plot ' + ', '.join(series))
        script.append('unset multiplot')
        subprocess.run(['gnuplot'], input='\n'.join(script), text=True, check=True)


def has_cairo():
    out = subprocess.run(['gnuplot', '-e', 'set terminal'], capture_output=True, text=True)
    return 'pngcairo' in out.stdout + out.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('json', nargs='+')
    ap.add_argument('--png', help='write the plot here (needs gnuplot)')
    a = ap.parse_args()
    runs = load(a.json)
    print(table(runs))
    if a.png:
        plot(runs, a.png)
    return 0


if __name__ == '__main__':
    sys.exit(main())
