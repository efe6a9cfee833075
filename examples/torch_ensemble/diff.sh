#!/usr/bin/env bash
# A port in numbers: the unified diff from the original trainer to its port, then its line counts.
#   diff.sh [mnist|ensemble]          print both (mnist: mnist.cpp to mnist_ensemble.cpp, the
#                                     default; ensemble: plain.cpp to ensemble.cpp)
#   diff.sh --check [mnist|ensemble]  exit 1 unless docs/porting.md holds exactly this diff and count
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
check=""
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
case "${1:-mnist}" in
  mnist) original=mnist.cpp port=mnist_ensemble.cpp ;;
  ensemble) original=plain.cpp port=ensemble.cpp ;;
  *) echo "diff.sh: unknown port '$1' (mnist, ensemble)" >&2; exit 2 ;;
esac
current() {
  (cd "$root/examples/torch_ensemble" && diff -u --label "$original" --label "$port" "$original" "$port" || true)
  local added removed
  read -r added removed _ < <(cd "$root/examples/torch_ensemble" && git diff --no-index --numstat "$original" "$port" || true)
  echo "lines added: $added, removed: $removed (of $(wc -l < "$root/examples/torch_ensemble/$original") in $original)"
}
if [ -n "$check" ]; then
  # The ```diff block of docs/porting.md that starts with this original's name.
  documented=$(awk -v first="--- $original" '
    /^```diff$/ { inside = 1; n = 0; next }
    /^```$/ && inside { if (block) exit; inside = 0; next }
    inside { if (n++ == 0 && $0 == first) block = 1; if (block) print }' "$root/docs/porting.md")
  if [ "$documented" != "$(current)" ]; then
    echo "docs/porting.md's diff is not the diff of $original and $port; paste examples/torch_ensemble/diff.sh $1's output"
    exit 1
  fi
  echo "docs/porting.md holds the current diff of $original and $port"
  exit 0
fi
current
