#!/usr/bin/env bash
# Runs one MPI program across simulated hosts, repeatedly; a run that does not exit in time is a
# hang: the hung ranks' stacks are printed (gdb), then the run is killed and counted as failed.
#   run.sh [options] -- PROGRAM [ARGS...]
#     --hosts 2x2 | 2+1+2   ranks per host (default 2x2)
#     --repeat N            runs (default 1)
#     --rate RATE           tc rate limit of every host link, e.g. 10gbit (default: none)
#     --limit S             seconds one run may take before it counts as a hang (default 120)
#     --id ID               cluster id, keeps concurrent clusters apart (default 7)
#     --expect-status S     exit status every run must end with (default 0)
#     --no-stacks           do not print a hung run's stacks (hang-rate measurements)
#     --net-stats           print the bytes each host sent and received over all runs (eth0)
#     --show-output         print every run's output (benchmarks), not only a failed run's
#     --quick "ARGS"        arguments added to every run after the first (e.g. a Boost.Test
#                           filter that leaves out the slowest cases of a repeated binary)
#     --quick-first         the first run takes the --quick arguments too (--whole-first: it does not)
#     --whole "ARGS"        arguments of the first run when it is the whole one (e.g. a filter that
#                           leaves out cases whose hosts are only pretended, run by the MPI suite)
#     --mpi mpich|openmpi   the implementation PROGRAM was built with (default mpich): its launcher,
#                           mpiexec.mpich (Hydra) or mpiexec.openmpi (ORTE), started as below
#     --exit-times          measure each run's exit: from the last rank's shutdown barrier (stamped
#                           through FLEXCOMM_TEST_EXIT_STAMP by flexcomm's environment, or by
#                           plain_finalize) to the launcher's end; prints the distribution
# Environment (Open MPI only, for experiments): CLUSTER_OMPI_BTL replaces the BTL list
# (self,vader,tcp), CLUSTER_MPIEXEC_ARGS adds arguments to mpiexec.openmpi. CLUSTER_AUTOGROUP=keep
# leaves the kernel's autogroups as they are (see below).
# Exit: 0 when every run ended with the expected status, 1 otherwise, 77 without namespaces.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
hosts=2x2 repeat=1 rate="" limit=120 id=7 expect=0 quick="" whole="" stacks=1 net_stats=0 show=0 mpi=mpich quick_first=0
exit_times=0
while [ $# -gt 0 ]; do
  case "$1" in
    --hosts) hosts=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --limit) limit=$2; shift 2 ;;
    --id) id=$2; shift 2 ;;
    --expect-status) expect=$2; shift 2 ;;
    --quick) quick=$2; shift 2 ;;
    --whole) whole=$2; shift 2 ;;
    --mpi) mpi=$2; shift 2 ;;
    --quick-first) quick_first=1; shift ;;
    --whole-first) quick_first=0; shift ;;
    --no-stacks) stacks=0; shift ;;
    --net-stats) net_stats=1; shift ;;
    --show-output) show=1; shift ;;
    --exit-times) exit_times=1; shift ;;
    --) shift; break ;;
    *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: run.sh [options] -- PROGRAM [ARGS...]" >&2; exit 2; }
"$here/hosts.sh" check || exit 77
# One run at a time per id: a second one would tear down the first one's hosts (same names).
exec 9>"/tmp/flexcomm-cluster-$id.lock"
flock 9

# Ranks per host: "2x2" is two hosts of two, "2+1+2" three hosts of 2, 1 and 2.
if [[ "$hosts" == *x* ]]; then
  counts=(); for ((i = 0; i < ${hosts%x*}; i++)); do counts+=("${hosts#*x}"); done
else
  IFS=+ read -r -a counts <<<"$hosts"
fi
n=0; hostfile=$(mktemp); for ((i = 0; i < ${#counts[@]}; i++)); do
  case "$mpi" in
    openmpi) echo "10.213.$id.$((i + 1)) slots=${counts[$i]}" >>"$hostfile" ;;
    *) echo "10.213.$id.$((i + 1)):${counts[$i]}" >>"$hostfile" ;;
  esac
  n=$((n + counts[i])); done
# Every simulated host shares this machine's two cores and one scheduler, which a real cluster
# never does. With the kernel's autogroups on (one scheduling group per session: the launcher's
# ranks in one, each remote daemon's ranks in another), this kernel (6.18) now and then gives no
# CPU at all to any thread that sleeps, anywhere on the machine, for as long as ranks of the other
# groups compute without sleeping: the progress threads, and this script's own watch loop, stood
# still for exactly the 20 s that a test's ranks spun (docs/reliability.md, the Open MPI "hang";
# 2-4 runs in 100 of mpi_progress's compute-while-MPI-progresses case, 0 of 350 with autogroups
# off). So the runs go with autogroups off, and the setting is put back when this script ends.
autogroup=/proc/sys/kernel/sched_autogroup_enabled autogroup_was=""
if [ "${CLUSTER_AUTOGROUP:-off}" != keep ] && [ -w "$autogroup" ] && [ "$(cat "$autogroup")" = 1 ]; then autogroup_was=1; echo 0 >"$autogroup"; fi
cleanup() {
  "$here/hosts.sh" down "$id"; rm -f "$hostfile"
  [ -n "$autogroup_was" ] && echo "$autogroup_was" >"$autogroup"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
"$here/hosts.sh" up "$id" "${#counts[@]}" "$rate" || { echo "cluster: could not make the hosts" >&2; exit 1; }
echo "cluster: ${#counts[@]} hosts (${hosts} ranks), link ${rate:-unshaped (no tc rate limit)}, no added delay" \
     "(this kernel has no netem), $repeat run(s) of: $*${quick:+ (runs after the first add: $quick)}"

prog=$(command -v "$1" || echo "$1"); shift
comm=$(basename "$prog" | cut -c1-15)  # the kernel keeps 15 characters of a process name
ranks() { pgrep -x "$comm"; }
failed=0 hung=0 fallback=0 exits=()
for ((run = 1; run <= repeat; run++)); do
  log=$(mktemp)
  if [ "$exit_times" = 1 ]; then
    export FLEXCOMM_TEST_EXIT_STAMP="$log.stamps"
    rm -f "$log.stamps" "$log.end"
  fi
  extra=()
  if [ "$run" -gt $((1 - quick_first)) ]; then
    [ -n "$quick" ] && read -r -a extra <<<"$quick"
  else
    [ -n "$whole" ] && read -r -a extra <<<"$whole"
  fi
  # The launcher runs in host 0; every other host is reached through launch.sh (as ssh).
  # FLEXCOMM_TEST_HOSTS tells the tests which host map they must find for themselves.
  export FLEXCOMM_TEST_HOSTS="$(IFS=+; echo "${counts[*]}")"
  case "$mpi" in
    openmpi)
      # ORTE: daemons started through launch.sh (plm_rsh_agent; each host named after its namespace,
      # as launch.sh explains), out-of-band and MPI traffic over
      # eth0 (TCP between hosts, shared memory inside one). Unlike Hydra it does not pass the
      # environment to remote ranks: every FLEXCOMM_, UCX_ and PLAIN_ variable is named with -x.
      forward=(); for v in $(compgen -e | grep -E '^(FLEXCOMM_|UCX_|PLAIN_)'); do forward+=(-x "$v"); done
      { ip netns exec "fc${id}h0" mpiexec.openmpi --hostfile "$hostfile" -n "$n" --oversubscribe \
          --mca plm_rsh_agent "$here/launch.sh --own-hostname" --mca plm_rsh_no_tree_spawn 1 \
          --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include eth0 --mca pml ob1 --mca btl "${CLUSTER_OMPI_BTL:-self,vader,tcp}" \
          ${CLUSTER_MPIEXEC_ARGS:-} "${forward[@]}" "$prog" "$@" "${extra[@]}" >"$log" 2>&1
        rc=$?; date +%s%N >"$log.end"; exit $rc; } &
      ;;
    *)
      # Hydra: ranks started through launch.sh (-launcher ssh); UCX's TCP transport between
      # hosts, MPICH's shared memory inside one.
      { ip netns exec "fc${id}h0" env UCX_TLS=tcp,self UCX_NET_DEVICES=eth0 HYDRA_LAUNCHER_EXTRA_ARGS= \
          mpiexec.mpich -f "$hostfile" -n "$n" -launcher ssh -launcher-exec "$here/launch.sh" -iface eth0 \
          "$prog" "$@" "${extra[@]}" >"$log" 2>&1
        rc=$?; date +%s%N >"$log.end"; exit $rc; } &
      ;;
  esac
  pid=$!
  start=$SECONDS
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - start)) -lt "$limit" ]; do sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    hung=$((hung + 1)); failed=$((failed + 1))
    echo "run $run: HUNG after ${limit}s (at $(date +%s.%N)); stacks of the ranks still alive:"
    for p in $( [ "$stacks" = 1 ] && ranks); do
      echo "--- pid $p ($(tr '\0' ' ' </proc/$p/cmdline 2>/dev/null | cut -c1-80))"
      timeout 20 gdb -p "$p" -batch -ex "thread apply all bt 15" 2>/dev/null | grep -E '^#|^Thread' | head -40
    done
    tail -20 "$log"
    # The TCP connections between hosts as the hang left them (which pair never connected, or
    # holds two sockets or unsent bytes).
    for ((i = 0; i < ${#counts[@]}; i++)); do
      echo "--- host $i: TCP on eth0"; ip netns exec "fc${id}h$i" ss -tnpo state all 2>/dev/null | grep -v "127.0.0.1\|LISTEN"
    done
    pkill -9 -P "$pid" 2>/dev/null; kill -9 "$pid" 2>/dev/null
    for p in $(ranks); do kill -9 "$p" 2>/dev/null; done
    wait "$pid" 2>/dev/null
  else
    wait "$pid"; status=$?
    grep -q "MPI_Finalize has not returned" "$log" && fallback=$((fallback + 1))
    if [ "$exit_times" = 1 ] && [ -s "$log.stamps" ] && [ -s "$log.end" ]; then
      last=$(awk 'BEGIN { m = 0 } $2 + 0 > m { m = $2 + 0 } END { printf "%.0f", m }' "$log.stamps")
      exits+=("$(awk -v e="$(cat "$log.end")" -v b="$last" 'BEGIN { printf "%.0f", (e - b) / 1e6 }')")
    fi
    if [ "$status" != "$expect" ]; then
      failed=$((failed + 1))
      echo "run $run: exit status $status (expected $expect)"; tail -40 "$log"
    elif [ "$show" = 1 ]; then
      cat "$log"
    fi
  fi
  rm -f "$log" "$log.stamps" "$log.end"
done
if [ "$net_stats" = 1 ]; then
  for ((i = 0; i < ${#counts[@]}; i++)); do
    stat() { ip netns exec "fc${id}h$i" cat "/sys/class/net/eth0/statistics/$1"; }
    echo "cluster: host $i (${counts[$i]} ranks): sent $(stat tx_bytes) bytes, received $(stat rx_bytes) bytes"
  done
fi
if [ "$exit_times" = 1 ]; then
  if [ ${#exits[@]} -gt 0 ]; then
    printf '%s\n' "${exits[@]}" | sort -n | awk '{ v[NR] = $1 } END {
      n = NR
      printf "cluster: exit after the last rank'"'"'s shutdown barrier, %d runs: min %d ms, median %d ms, p90 %d ms, p99 %d ms, max %d ms\n",
             n, v[1], v[int((n + 1) / 2)], v[int(n * 0.9 + 0.999)], v[int(n * 0.99 + 0.999)], v[n] }'
  else
    echo "cluster: exit after the last rank's shutdown barrier: no run stamped it (not a flexcomm or plain_finalize program?)"
  fi
fi
echo "cluster: $repeat runs, $failed failed, $hung hung, $fallback left MPI_Finalize by its time limit"
[ "$failed" = 0 ]
