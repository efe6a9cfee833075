#!/usr/bin/env bash
# The port in numbers: the unified diff from plain.cpp to ensemble.cpp, then its line counts.
#   diff.sh          print both
#   diff.sh --check  exit 1 unless docs/porting.md holds exactly this diff and count
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
current() {
  (cd "$root" && diff -u --label plain.cpp --label ensemble.cpp examples/torch_ensemble/plain.cpp \
                  examples/torch_ensemble/ensemble.cpp || true)
  local added removed
  read -r added removed _ < <(cd "$root" && git diff --no-index --numstat examples/torch_ensemble/plain.cpp \
                                                 examples/torch_ensemble/ensemble.cpp || true)
  echo "lines added: $added, removed: $removed (of $(wc -l < "$root/examples/torch_ensemble/plain.cpp") in plain.cpp)"
}
if [ "${1:-}" = "--check" ]; then
  documented=$(sed -n '/^```diff$/,/^```$/p' "$root/docs/porting.md" | sed '1d;$d')
  if [ "$documented" != "$(current)" ]; then
    echo "docs/porting.md's diff is not the diff of plain.cpp and ensemble.cpp; paste examples/torch_ensemble/diff.sh's output"
    exit 1
  fi
  echo "docs/porting.md holds the current diff"
  exit 0
fi
current
