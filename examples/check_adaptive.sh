#!/usr/bin/env bash
# The adaptive feed trains the members a fixed feed trains: the main job at a small size under
# adaptive and under the fixed preset of the same layout, at 1 to 6 ranks, twice with a slow
# trainer (--slow-rank sleeps before every step, so the others make its share of the steps).
# Every member's and the ensemble's test accuracy must agree to the last digit printed. The cases
# with shared memory off have no claim board: the trainers claim pieces from the producer by message.
# The cases on pretend hosts (FLEXCOMM_HOSTS) have no producer: each step is made on its home host
# and carried to the other hosts by their couriers.
#   check_adaptive.sh MPIEXEC EXAMPLE [example arguments...]
# MPIEXEC_FLAGS (environment): what the launcher takes before -n (Open MPI: --oversubscribe ...).
set -uo pipefail
mpiexec=$1 example=$2
shift 2
unset FLEXCOMM_LAYOUT
# ranks | layout | the fixed preset to compare with | slow world rank (-1: none) | FLEXCOMM_SHM
#   | FLEXCOMM_HOSTS (empty: one host)
cases=(
  "1|members=1 aggregator=0|all_shared|-1|auto|"
  "2|producers=1 members=1 aggregator=1|single_broadcast|-1|auto|"
  "3|producers=1 members=2 aggregator=1|single_broadcast|2|auto|"
  "4|members=2,1,1 aggregator=0|all_shared|-1|auto|"
  "5|producers=2 members=2,1 aggregator=2|multi_broadcast|-1|auto|"
  "6|producers=1 members=2,2,1 aggregator=1|single_broadcast|5|auto|"
  "3|producers=1 members=2 aggregator=1|single_broadcast|2|off|"
  "5|producers=2 members=2,1 aggregator=2|multi_broadcast|-1|off|"
  "4|members=2,1,1 aggregator=0|all_shared|0|auto|2+2"
  "5|members=2,3 aggregator=0|all_shared|3|auto|2+1+2"
)
status=0
scores() { grep -E '^  (member [0-9]+ .*test accuracy|epoch [0-9]+:|ensemble \(averaged)' <<<"$1"; }
for c in "${cases[@]}"; do
  IFS='|' read -r n layout fixed slow shm hosts <<<"$c"
  slow_args=()
  [ "$slow" -ge 0 ] && slow_args=(--slow-rank "$slow" --slow-ms 3)
  declare -A got=()
  for preset in "$fixed" adaptive; do
    # shellcheck disable=SC2086  # the flags are words
    out=$(FLEXCOMM_SHM=$shm FLEXCOMM_HOSTS=$hosts "$mpiexec" ${MPIEXEC_FLAGS:-} -n "$n" "$example" --layout "$layout" --preset "$preset" --compare-baseline 0 \
          "${slow_args[@]}" "$@" 2>&1) || { echo "$out"; echo "$n ranks, $preset: failed"; exit 1; }
    got[$preset]=$(scores "$out")
    [ -n "${got[$preset]}" ] || { echo "$out"; echo "$n ranks, $preset: no accuracies printed"; exit 1; }
    echo "$out" | grep -E "^$preset: " | sed "s/^/$n ranks, slow rank $slow, shared memory $shm, hosts ${hosts:-1}: /"
  done
  if [ "${got[$fixed]}" == "${got[adaptive]}" ]; then
    echo "$n ranks, '$layout', shared memory $shm, hosts ${hosts:-1}: adaptive and $fixed trained the same members"
    echo "${got[adaptive]}" | sed 's/^/    /'
  else
    echo "$n ranks, '$layout', shared memory $shm, hosts ${hosts:-1}: adaptive and $fixed differ:"
    diff <(echo "${got[$fixed]}") <(echo "${got[adaptive]}")
    status=1
  fi
done
exit $status
