#!/usr/bin/env bash
# The examples and benchmarks refuse a count that is negative, zero where it must be positive, or
# not a number, at the command line and naming the flag (examples/common/counts.hpp), instead of
# reading "-5" as 18446744073709551611.
#   bad_counts.sh MPIEXEC PROGRAM FLAG VALUE [PROGRAM FLAG VALUE ...]
# Each program runs alone (mpiexec -n 1) and must exit with status 2 and Boost.Program_options'
# message for that flag. Prints one line per case and ends with `N passed, N failed`.
set -uo pipefail
mpiexec=$1; shift
passed=0 failed=0
while [ $# -ge 3 ]; do
  program=$1 flag=$2 value=$3; shift 3
  out=$("$mpiexec" -n 1 "$program" "$flag" "$value" 2>&1); rc=$?
  name=$(basename "$program")
  if [ "$rc" -eq 2 ] && grep -qF -- "for option '$flag' is invalid" <<<"$out"; then
    echo "ok: $name $flag $value: $(grep -F -- "for option '$flag'" <<<"$out" | head -1)"
    passed=$((passed + 1))
  else
    echo "FAILED: $name $flag $value: exit $rc"; sed 's/^/  | /' <<<"$out" | head -8
    failed=$((failed + 1))
  fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
