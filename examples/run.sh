#!/usr/bin/env bash
# The README's main command: installs what is missing, builds, and trains an ensemble of four
# MLPs on Fashion-MNIST through flexcomm on this machine, then the same ensemble with the
# baseline preset, and prints both CPU times.  Extra arguments go to the example, e.g.
#   examples/run.sh --preset multi_broadcast --layout "producers=2 members=2,2,1,1 aggregator=2"
# FLEXCOMM_RANKS sets the rank count when the layout changes (default: what the layout needs).
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/install-deps.sh
if [ ! -f build/build.ninja ]; then
  meson setup build
fi
meson compile -C build ensemble_fashion_mnist
layout="producers=1 members=2,2,1,1 aggregator=1"
given=0
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [ "${args[$i]}" = "--layout" ] && [ $((i + 1)) -lt ${#args[@]} ]; then layout=${args[$((i + 1))]}; given=1; fi
done
[ $given -eq 0 ] && args=(--layout "$layout" "${args[@]}")
layout=${FLEXCOMM_LAYOUT:-$layout}
# Ranks the layout needs: its producers plus every member's ranks.
ranks=$(echo "$layout" | awk '{
  p = 0; t = 0
  for (i = 1; i <= NF; i++) {
    split($i, kv, "=")
    if (kv[1] == "producers") p = kv[2]
    if (kv[1] == "members") {
      if (index(kv[2], "x")) { split(kv[2], m, "x"); t = m[1] * m[2] }
      else { n = split(kv[2], m, ","); for (j = 1; j <= n; j++) t += m[j] }
    }
  }
  print p + t }')
ranks=${FLEXCOMM_RANKS:-$ranks}
shown=""
for a in "${args[@]}"; do case "$a" in *" "*) shown+=" \"$a\"" ;; *) shown+=" $a" ;; esac; done
# The build is on MPICH (meson's -Dmpi=auto prefers it); plain `mpiexec` may be Open MPI's where
# both are installed, and would start the ranks as unrelated one-rank jobs.
launcher=$(command -v mpiexec.mpich || command -v mpiexec)
echo "+ $(basename "$launcher") -n $ranks build/examples/ensemble_fashion_mnist$shown"
# More ranks than cores is fine: flexcomm waits with backoff where ranks outnumber cores.
exec "$launcher" -n "$ranks" build/examples/ensemble_fashion_mnist "${args[@]}"
