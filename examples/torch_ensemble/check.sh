#!/usr/bin/env bash
# CI run of the torch example at a small size: ensemble.cpp under every preset (each at the rank
# count its layout needs), then the check that every preset trained the same members (equal
# accuracies and prediction fingerprints: same seeds, same batches, same averages).
#   check.sh MPIEXEC EXAMPLE [example arguments...]
set -uo pipefail
mpiexec=$1 example=$2
shift 2
# Each preset spreads the 3 members over the ranks after its producers (2,1,1 at the rank counts
# below); a FLEXCOMM_LAYOUT of the caller's would change that.
unset FLEXCOMM_LAYOUT
declare -A ranks=([baseline]=4 [single_broadcast]=5 [multi_broadcast]=6 [all_shared]=4 [adaptive]=4)
reference="" status=0
for preset in baseline single_broadcast multi_broadcast all_shared adaptive; do
  start=$(date +%s%N)
  out=$("$mpiexec" -n "${ranks[$preset]}" "$example" --preset "$preset" \
        "$@" 2>&1) || { echo "$out"; echo "$preset: failed"; exit 1; }
  echo "$out" | grep -E '^(member [0-9]+:|ensemble:)' | sed "s/^/$preset: /"
  echo "$preset: $(( ($(date +%s%N) - start) / 1000000 )) ms"
  members=$(echo "$out" | grep -E '^member [0-9]+:')
  [ "$(echo "$members" | grep -c .)" -eq 3 ] || { echo "$preset: expected 3 members in:"; echo "$out"; exit 1; }
  if [ -z "$reference" ]; then
    reference=$members
  elif [ "$members" != "$reference" ]; then
    echo "$preset trained different members than baseline"
    status=1
  fi
done
exit $status
