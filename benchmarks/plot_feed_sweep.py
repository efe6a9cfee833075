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

FEEDS = ['local_feed', 'one_to_many_1p', 'one_to_many_2p', 'all_shared', 'adaptive_1p', 'adaptive_2p']
FIXED = FEEDS[:4]
COLORS = {'local_feed': '#9467bd', 'one_to_many_1p': '#2ca02c', 'one_to_many_2p': '#17becf',
          'all_shared': '#ff7f0e', 'adaptive_1p': '#d62728', 'adaptive_2p': '#1f3fbf'}


def load(paths):
    runs = [json.load(open(p)) for p in paths]
    return sorted(runs, key=lambda r: r['members'])


def table(runs):
    """One row per point: the best fixed feed's wall time, then each feed's wall / best and CPU /
    lowest (both against the fixed feeds only); the worst of each feed over the sweep last."""
    out = ['| K | train ms | pre ms | steps | best fixed wall (s) | ' +
           ' | '.join(f'{f}: wall / best, cpu / lowest' for f in FEEDS) + ' |',
           '| --- | --- | --- | --- | --- | ' + ' | '.join('---' for _ in FEEDS) + ' |']
    worst = {f: [0.0, 0.0] for f in FEEDS}
    for run in runs:
        for p in run['points']:
            by = {f['feed']: f for f in p['feeds']}
            cells = []
            for name in FEEDS:
                f = by[name]
                cell = f"{f['wall_over_best']:.2f} / {f['cpu_over_lowest']:.2f}"
                cells.append(f'**{cell}**' if name in FIXED and f['wall_over_best'] <= 1.0 + 1e-9 else cell)
                worst[name][0] = max(worst[name][0], f['wall_over_best'])
                worst[name][1] = max(worst[name][1], f['cpu_over_lowest'])
            out.append(f"| {run['members']} | {p['train_ms']:g} | {p['pre_ms']:g} | {p['steps']} | "
                       f"{p['best_fixed_wall_s']:.3f} | " + ' | '.join(cells) + ' |')
    out.append('| worst | | | | | ' + ' | '.join(f'{w:.2f} / {c:.2f}' for w, c in worst.values()) + ' |')
    return '\n'.join(out)


def plot(runs, png):
    with tempfile.TemporaryDirectory() as tmp:
        script = [f"set terminal pngcairo size {420 * len(runs)},420 font ',9'" if has_cairo() else
                  f"set terminal png size {420 * len(runs)},420",
                  'set termoption noenhanced', f"set output '{png}'", f'set multiplot layout 1,{len(runs)}',
                  'set logscale x',
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
                width = 3 if name.startswith('adaptive') else 1
                series.append(f"'{path}' using 1:2 with linespoints lw {width} lc rgb '{COLORS[name]}' "
                              f"title '{name.replace('_', ' ')}'")
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
