#!/usr/bin/env bash
# Early stopping and the hand-over in the main job (issue 56): six members of widths 32-512 sized
# by members=auto:6, stopped by --early-stop, under the main job's default preset
# (single_broadcast: a producer feeds them, one_to_many) and under the baseline (each member loads
# its own, local_feed); each run must end 0, at least one member must stop before the last epoch
# with its ranks joining another member, and the aggregator must print how the members ended
# exactly once; the same under all_shared (no producers: the members take turns loading) and
# adaptive (a producer and the trainers make each step on the host's board in shared memory); and
# single_broadcast with a producer per host (one here; across hosts, the cluster suite's hand-over
# row covers it).
# The rule stops four members (two of them at once, at epoch 3): members=auto:6 gives one member
# two ranks, chosen by measured cost, so that member's ranks may have nowhere to go (no member has
# room for two); with patience alone only member 2 stopped, and where the plan gave it the two
# ranks (a loaded host's measurement, seen under Open MPI) no member took them and the run failed.
#   check_early_stop.sh MPIEXEC EXAMPLE EPOCHS [example arguments...]
# MPIEXEC_FLAGS (environment): what the launcher takes before -n (Open MPI: --oversubscribe ...).
set -uo pipefail
mpiexec=$1 example=$2 epochs=$3
shift 3
unset FLEXCOMM_LAYOUT
status=0
fail() { echo "$out"; echo "FAILED: $1"; status=1; }
rule="patience:1,accuracy:72"
for run in "single_broadcast|producers=1 members=auto:6 aggregator=1|8" "baseline|members=auto:6 aggregator=0|7" \
           "all_shared|members=auto:6 aggregator=0|7" "adaptive|producers=1 members=auto:6 aggregator=1|8" \
           "single_broadcast|producers=per-host members=auto:6 aggregator=1|8"; do
IFS='|' read -r preset layout ranks <<<"$run"
# shellcheck disable=SC2086  # the flags are words
out=$("$mpiexec" ${MPIEXEC_FLAGS:-} -n "$ranks" "$example" --preset "$preset" --layout "$layout" --epochs "$epochs" \
      --early-stop "$rule" --compare-baseline false "$@" 2>&1)
rc=$?
what="$ranks ranks, '$layout', $preset, --early-stop $rule"
if [ $rc != 0 ]; then
  fail "$what: exit status $rc"
elif [ "$(grep -c "^early stopping ($rule): how the members ended$" <<<"$out")" != 1 ]; then
  fail "$what: the report of how the members ended is not printed exactly once"
elif ! grep -qE "^  member [0-5] stopped after epoch [0-9]+ \(step [0-9]+\); its ranks joined member [0-5] at its step [0-9]+$" <<<"$out"; then
  fail "$what: no member stopped with its ranks joining another"
elif grep -E "^  member [0-5] stopped after epoch " <<<"$out" | grep -qvE "after epoch ([1-9]|[1-9][0-9]+) " ||
     grep -qE "^  member [0-5] stopped after epoch $epochs " <<<"$out"; then
  fail "$what: a member stopped outside epochs 1..$((epochs - 1))"
else
  echo "$what:"
  sed -n '/^layout /p; /^  epoch /p; /^early stopping/,$p' <<<"$out" | sed 's/^/    /'
fi
done
exit $status
