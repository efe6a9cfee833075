#!/usr/bin/env bash
# Finalize hang rates across simulated hosts (docs/reliability.md, "Shutdown"): the plain-MPI
# program initialised with and without threads, and a flexcomm test binary with the finalize
# guard off (FLEXCOMM_FINALIZE_TIMEOUT=0: MPI_Finalize may take for ever) and on (1 s).
#   tests/cluster/hang_rates.sh [RUNS] [HOSTS] [BUILD]     defaults: 40 2x2 build
# A run that has not exited within 15 s counts as hung (a normal run takes 1-4 s).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
runs=${1:-40} hosts=${2:-2x2} build=${3:-build}
row() {  # label, environment..., -- program...
  local label=$1; shift
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  local out
  out=$(env "${envs[@]}" bash "$here/run.sh" --hosts "$hosts" --repeat "$runs" --limit 15 --no-stacks --id 11 -- "$@" |
        tail -1)
  printf '| %s | %s |\n' "$label" "${out#cluster: }"
}
echo "| $hosts hosts, $runs runs each | result |"
echo "| --- | --- |"
row "plain MPI, MPI_THREAD_MULTIPLE" -- "$build/tests/plain_finalize"
row "plain MPI, MPI_THREAD_SINGLE" PLAIN_SINGLE=1 -- "$build/tests/plain_finalize"
row "flexcomm mpi_progress, guard off" FLEXCOMM_FINALIZE_TIMEOUT=0 -- "$build/tests/mpi_progress"
row "flexcomm mpi_progress, guard 1 s" FLEXCOMM_FINALIZE_TIMEOUT=1 -- "$build/tests/mpi_progress"
