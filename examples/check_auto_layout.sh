#!/usr/bin/env bash
# members=auto:N in the main job (issue 56): the members' ranks come from a warm-up that times each
# member's own step, at 3 to 5 ranks, under each of the five presets, once through FLEXCOMM_LAYOUT
# and once with a producer on each of two pretend hosts. Every run must end 0, print the plan
# table exactly once (the aggregator), and train on the layout the plan gives (the baseline run
# of the single_broadcast case too). A layout with more members than trainer ranks is refused by
# name, on every rank, before any training.
#   check_auto_layout.sh MPIEXEC EXAMPLE [example arguments...]
# MPIEXEC_FLAGS (environment): what the launcher takes before -n (Open MPI: --oversubscribe ...).
set -uo pipefail
mpiexec=$1 example=$2
shift 2
unset FLEXCOMM_LAYOUT
# ranks | layout | preset | the layout given by: flag or env | FLEXCOMM_HOSTS (empty: one host)
cases=(
  "3|members=auto:2 aggregator=0|baseline|flag|"
  "4|producers=1 members=auto:2 aggregator=1|single_broadcast|env|"
  "5|producers=2 members=auto:2 aggregator=2|multi_broadcast|flag|"
  "4|members=auto:3 aggregator=0|all_shared|flag|"
  "5|producers=per-host members=auto:2 aggregator=1|adaptive|flag|2+3"
)
status=0
fail() { echo "$out"; echo "FAILED: $1"; status=1; }
for c in "${cases[@]}"; do
  IFS='|' read -r n layout preset given hosts <<<"$c"
  args=(--preset "$preset")
  env_layout=()
  if [ "$given" == env ]; then env_layout=(FLEXCOMM_LAYOUT="$layout"); else args+=(--layout "$layout"); fi
  [ "$preset" == single_broadcast ] || args+=(--compare-baseline 0)
  what="$n ranks, '$layout', $preset (layout by $given, hosts ${hosts:-1})"
  # shellcheck disable=SC2086  # the flags are words
  out=$(env "${env_layout[@]}" FLEXCOMM_HOSTS="$hosts" "$mpiexec" ${MPIEXEC_FLAGS:-} -n "$n" "$example" "${args[@]}" "$@" 2>&1) \
    || { fail "$what: exit status $?"; continue; }
  tables=$(grep -c "^member  ranks        cost    expected$" <<<"$out")
  [ "$tables" == 1 ] || { fail "$what: $tables plan tables, not 1"; continue; }
  planned=$(sed -n "s/^layout '\(.*\)' planned:$/\1/p" <<<"$out")
  grep -q "members=auto" <<<"$planned" && { fail "$what: the plan gave '$planned'"; continue; }
  grep -q "^flexcomm ensemble on Fashion-MNIST: .*, layout '$planned', preset $preset," <<<"$out" \
    || { fail "$what: the job did not train on the planned layout '$planned'"; continue; }
  grep -q "^$preset: .* s wall" <<<"$out" || { fail "$what: the run did not finish"; continue; }
  if [ "$preset" == single_broadcast ] && ! grep -q "^baseline: .* s wall" <<<"$out"; then
    fail "$what: the baseline run did not finish"; continue
  fi
  echo "$what: planned '$planned'"
  sed -n '/^member  ranks/,/^flexcomm ensemble/p' <<<"$out" | sed '$d' | sed 's/^/    /'
done
# Too few trainer ranks: 4 members, 3 ranks after the producer.
# shellcheck disable=SC2086  # the flags are words
out=$("$mpiexec" ${MPIEXEC_FLAGS:-} -n 4 "$example" --layout "producers=1 members=auto:4 aggregator=1" \
      --compare-baseline 0 "$@" 2>&1)
rc=$?
if [ $rc == 0 ] || ! grep -q "4 members need at least 4 ranks, one each; the budget is 3 trainer ranks" <<<"$out"; then
  fail "4 ranks, members=auto:4 after a producer: not refused by name (exit status $rc)"
else
  echo "4 ranks, 'producers=1 members=auto:4 aggregator=1': refused ($(grep -m1 'member plan' <<<"$out"))"
fi
exit $status
