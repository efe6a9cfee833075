#!/usr/bin/env bash
# The ssh of the simulated hosts, for Hydra (mpiexec.mpich -launcher ssh -launcher-exec launch.sh) and
# ORTE (mpiexec.openmpi --mca plm_rsh_agent launch.sh):
# Each calls it as an ssh client, "launch.sh [ssh options] HOST COMMAND...", and it runs COMMAND
# inside HOST's network namespace. HOST is 10.213.ID.K, host K-1 of cluster ID (hosts.sh).
# --own-hostname (Open MPI): the host also gets a UTS namespace named after it, since Open MPI names
# its shared-memory segments by hostname and jobid: two simulated hosts both called like this
# machine would open each other's segments.
set -euo pipefail
own_hostname=0
[ "${1:-}" = --own-hostname ] && { own_hostname=1; shift; }
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
  case "$1" in -x|-q|-t|-T|-n|-4|-6) shift ;; *) shift 2 ;; esac
done
host=$1; shift
IFS=. read -r a b id k <<<"$host"
[ "$a.$b" = "10.213" ] || { echo "launch.sh: $host is not a simulated host" >&2; exit 255; }
ns="fc${id}h$((k - 1))"
[ $own_hostname = 1 ] && exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && eval "$1"' "$ns" "$*"
exec ip netns exec "$ns" sh -c "$*"
