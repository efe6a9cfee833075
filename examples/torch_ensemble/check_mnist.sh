#!/usr/bin/env bash
# CI run of the MNIST port at a small size: the original (one process), then mnist_ensemble.cpp
# under every preset, 3 members (2,1,1) at the rank count each layout needs, checking that every
# preset trained the same members (equal per-epoch accuracies: same seeds, same batches, same
# averages; upstream's shuffled test loader) and printed once per member; then a layout the rank count does not fit, which must end every rank with
# "flexcomm: rank N: ..." and exit status 1, not std::terminate.
#   check_mnist.sh MPIEXEC ORIGINAL PORT [trainer arguments...]
# The data: Debian's dataset-fashion-mnist ($FASHION_MNIST_DIR), gunzipped under MNIST's names.
set -uo pipefail
mpiexec=$1 original=$2 port=$3
shift 3
unset FLEXCOMM_LAYOUT
data=$(mktemp -d)
trap 'rm -rf "$data"' EXIT
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  gunzip -c "${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}/$f.gz" > "$data/$f" || exit 1
done

start=$(date +%s%N)
out=$("$original" --data "$data" "$@" 2>&1) || { echo "$out"; echo "original: failed"; exit 1; }
echo "$out" | grep -oE 'Test set: .*' | sed "s/^/original: /"
echo "original: $(( ($(date +%s%N) - start) / 1000000 )) ms"

declare -A ranks=([baseline]=4 [single_broadcast]=5 [multi_broadcast]=6 [all_shared]=4 [adaptive]=5)
declare -A layouts=([baseline]="members=2,1,1" [single_broadcast]="producers=1 members=2,1,1 aggregator=1"
                    [multi_broadcast]="producers=2 members=2,1,1 aggregator=2" [all_shared]="members=2,1,1"
                    [adaptive]="producers=1 members=2,1,1 aggregator=1")
reference="" status=0
for preset in baseline single_broadcast multi_broadcast all_shared adaptive; do
  start=$(date +%s%N)
  out=$("$mpiexec" -n "${ranks[$preset]}" "$port" --data "$data" --preset "$preset" --layout "${layouts[$preset]}" \
        "$@" 2>&1) || { echo "$out"; echo "$preset: failed"; exit 1; }
  # Anywhere in a line: another rank's progress (\r, no newline) may come first.
  epochs=$(echo "$out" | grep -oE 'Epoch [0-9]+: members [0-9. ]+\| ensemble [0-9.]+')
  echo "$epochs" | sed "s/^/$preset: /"
  echo "$preset: $(( ($(date +%s%N) - start) / 1000000 )) ms"
  # One test line per member and epoch: the replicas print nothing.
  tests=$(echo "$out" | grep -o 'Test set' | wc -l)
  [ "$(echo "$epochs" | grep -c .)" -ge 1 ] || { echo "$out"; echo "$preset: no report"; exit 1; }
  [ "$tests" -eq $(( 3 * $(echo "$epochs" | grep -c .) )) ] ||
    { echo "$out"; echo "$preset: $tests test lines, expected one per member and epoch"; exit 1; }
  # Output once per member: its setup line once, each line it prints after "member m: ", and its
  # progress counting the member's samples (member 0 trains on two ranks, each on half a batch).
  lines=$(echo "$out" | tr '\r' '\n')
  [ "$(echo "$lines" | grep -c 'Training on')" -eq 3 ] &&
    [ "$(echo "$lines" | grep -E 'Training on|Test set|Train Epoch' | grep -cvE '^member [0-2]: ')" -eq 0 ] ||
    { echo "$out"; echo "$preset: a member's lines are not once per member, each after 'member m: '"; exit 1; }
  progress=$(echo "$lines" | grep -oE '^member 0: Train Epoch: [0-9]+ \[ *[0-9]+/ *[0-9]+\]' | tr -d ' ' |
             sed -E 's/.*\[([0-9]+)\/([0-9]+)\]/\1 \2/' | sort -n | tail -1)
  read -r seen total <<< "$progress"
  [ -n "$total" ] && [ $(( 10 * seen )) -ge $(( 9 * total )) ] ||
    { echo "$out"; echo "$preset: member 0's progress ends at '$progress', not at its samples"; exit 1; }
  if [ -z "$reference" ]; then
    reference=$epochs
  elif [ "$epochs" != "$reference" ]; then
    echo "$preset trained different members than baseline"
    status=1
  fi
done

# single_broadcast's layout needs 5 ranks; started on 6, every rank says why and the job ends 1.
out=$("$mpiexec" -n 6 "$port" --data "$data" --preset single_broadcast --layout "${layouts[single_broadcast]}" \
      "$@" 2>&1)
code=$?
echo "$out" | grep -E '^flexcomm: rank' | sort | sed 's/^/wrong rank count: /'
if [ "$code" -ne 1 ] || echo "$out" | grep -q 'terminate called' ||
   [ "$(echo "$out" | grep -cE '^flexcomm: rank [0-9]+: ending the job')" -lt 1 ]; then
  echo "$out"
  echo "wrong rank count: exit status $code; expected 1, with flexcomm: rank N: messages and no std::terminate"
  status=1
fi
exit $status
