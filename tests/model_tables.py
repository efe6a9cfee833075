#!/usr/bin/env python3
"""The scaling model's tables, as kept in the repository, are what its script makes from the
kept runs (each data folder), so docs/scaling.md cannot quote a fit the script no longer gives.

    python3 tests/model_tables.py SOURCE_ROOT
"""
import filecmp
import os
import subprocess
import sys
import tempfile

root = sys.argv[1]
folders = [os.path.join(root, "benchmarks", "scaling_data"),
           os.path.join(root, "benchmarks", "scaling_data", "xeon_2026-11-27")]
failed = 0
for data in folders:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, os.path.join(root, "benchmarks", "scaling_model.py"), "--data", data, "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
        for name in ("check.md", "prediction.md", "prediction.dat"):
            if not filecmp.cmp(os.path.join(out, name), os.path.join(data, name), shallow=False):
                print(f"{os.path.relpath(os.path.join(data, name), root)}: not what benchmarks/scaling_model.py makes "
                      "from the runs beside it (rerun it, and update docs/scaling.md)")
                failed += 1
print(f"{len(folders)} data folders, {failed} table(s) out of date")
sys.exit(1 if failed else 0)
