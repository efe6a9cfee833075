#!/usr/bin/env python3
"""Draws benchmarks/hetero's JSON as a PNG (wall per configuration, one bar each) and prints the
markdown table of docs/benchmarks.md. Needs gnuplot (Debian: gnuplot-nox).

    python3 benchmarks/plot_hetero.py --png docs/hetero.png hetero.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from plot_feed_sweep import has_cairo  # beside this script


def table(run):
    out = ['| config | layout | wall (s) | CPU (s) | speedup over even |', '| --- | --- | --- | --- | --- |']
    for r in run['rows']:
        name = f"{r['config']} (best fixed)" if r['config'] == run['best_fixed'] else r['config']
        out.append(f"| {name} | `{r['layout']}` | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {r['speedup_vs_even']:.2f} |")
    return '\n'.join(out)


def plot(run, png):
    rows = run['rows']
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, 'rows.dat')
        with open(data, 'w') as f:
            for i, r in enumerate(rows):
                f.write(f"{i} {r['wall_s']} \"{r['config']}\"\n")
        script = ["set terminal pngcairo size 640,360 font ',9'" if has_cairo() else 'set terminal png size 640,360',
                  'set termoption noenhanced', f"set output '{png}'",
                  f"set title 'hetero: {run['ranks']} ranks, costs {run['costs']}, stopping at {run['steps']}'",
                  'set ylabel "wall until every member finished (s)"', 'set style fill solid 0.6', 'set boxwidth 0.6',
                  'set yrange [0:*]', 'set grid ytics', 'unset key', f'set xrange [-0.6:{len(rows) - 0.4}]',
                  f"plot '{data}' using 1:2:xtic(3) with boxes lc rgb '#1f77b4', "
                  f"'' using 1:2:(sprintf('%.2f', $2)) with labels offset 0,0.7"]
        subprocess.run(['gnuplot'], input='\n'.join(script), text=True, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('json')
    ap.add_argument('--png', help='write the plot here (needs gnuplot)')
    a = ap.parse_args()
    run = json.load(open(a.json))
    print(table(run))
    if a.png:
        plot(run, a.png)
    return 0


if __name__ == '__main__':
    sys.exit(main())
