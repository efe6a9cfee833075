#!/usr/bin/env bash
# What changes MPICH 4.0.2's finalize hang over UCX's TCP transport (docs/reliability.md,
# "Shutdown"): the plain-MPI program (tests/cluster/plain_finalize.cpp, no flexcomm) across
# simulated hosts, once per candidate setting, and on Open MPI across the same hosts.
#   tests/cluster/finalize_experiments.sh [RUNS] [HOSTS] [BUILD] [OPENMPI_BUILD]
#   defaults: 30 2+1+2 build build-openmpi (the Open MPI row only where that build has plain_finalize)
# A run still alive 6 s after it started counts as hung (a normal one takes about 1-2 s). Each row
# also gives the exit after the last rank's final stamp (just before MPI_Finalize).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
runs=${1:-30} hosts=${2:-2+1+2} build=${3:-build} ompi=${4:-build-openmpi}
row() {  # label, mpi, environment..., -- program
  local label=$1 mpi=$2; shift 2
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  local out
  out=$(env "${envs[@]}" bash "$here/run.sh" --mpi "$mpi" --hosts "$hosts" --repeat "$runs" --limit 6 --no-stacks \
        --exit-times --id 12 -- "$@")
  printf '| %s | %s | %s |\n' "$label" "$(tail -1 <<<"$out" | sed 's/^cluster: //')" \
    "$(grep 'exit after' <<<"$out" | sed 's/^.*runs: //')"
}
echo "| $hosts hosts, $runs runs each | result | exit after the last rank's stamp |"
echo "| --- | --- | --- |"
p=$build/tests/plain_finalize
row "MPI_THREAD_MULTIPLE (control)" mpich X=1 -- "$p"
row "MPI_THREAD_SINGLE" mpich PLAIN_SINGLE=1 -- "$p"
row "UCX_ADAPTIVE_PROGRESS=n (flexcomm's default)" mpich UCX_ADAPTIVE_PROGRESS=n -- "$p"
row "UCX_ASYNC_MODE=poll" mpich UCX_ASYNC_MODE=poll -- "$p"
row "UCX_ASYNC_MODE=signal" mpich UCX_ASYNC_MODE=signal -- "$p"
row "MPIR_CVAR_ASYNC_PROGRESS=1 (MPICH's progress thread)" mpich MPIR_CVAR_ASYNC_PROGRESS=1 -- "$p"
row "a final MPI_Alltoall (every pair connected both ways)" mpich PLAIN_ALLTOALL=1 -- "$p"
row "a final MPI_Barrier" mpich PLAIN_BARRIER=1 -- "$p"
if [ -x "$ompi/tests/plain_finalize" ]; then
  row "Open MPI (ob1, TCP between hosts)" openmpi OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 -- \
    "$ompi/tests/plain_finalize"
fi
