#!/usr/bin/env python3
"""Every command in README.md and docs/ names its launcher: `mpiexec.mpich` or `mpiexec.openmpi`.

Debian installs MPICH and Open MPI side by side, and whichever came last takes plain `mpiexec`
(Open MPI's, once tests/run.sh openmpi has run, which then refuses root and the MPICH build's
binaries). A command is `mpiexec` followed by a flag (`mpiexec -n 4 ...`); prose that names the
launcher ("mpiexec sees every rank") is not one.

  doc_launchers.py SOURCE_ROOT
"""
import glob
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else '.'
files = [os.path.join(root, 'README.md')] + sorted(glob.glob(os.path.join(root, 'docs', '*.md')))
plain = re.compile(r'\bmpiexec(?![.\w])(?=\s+-)')
bad = 0
for path in files:
    for number, line in enumerate(open(path, encoding='utf-8'), 1):
        if plain.search(line):
            print(f'{os.path.relpath(path, root)}:{number}: plain mpiexec: {line.strip()}')
            bad += 1
print(f'{len(files)} files: {bad} commands with plain mpiexec' if bad else
      f'{len(files)} files: every mpiexec command names its launcher (mpiexec.mpich or mpiexec.openmpi)')
sys.exit(1 if bad else 0)
