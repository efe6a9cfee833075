#!/usr/bin/env bash
# Hydra's launcher for the simulated hosts (mpiexec -launcher ssh -launcher-exec launch.sh):
# Hydra calls it as an ssh client, "launch.sh [ssh options] HOST COMMAND...", and it runs COMMAND
# inside HOST's network namespace. HOST is 10.213.ID.K, host K-1 of cluster ID (hosts.sh).
set -euo pipefail
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
  case "$1" in -x|-q|-t|-T|-n|-4|-6) shift ;; *) shift 2 ;; esac
done
host=$1; shift
IFS=. read -r a b id k <<<"$host"
[ "$a.$b" = "10.213" ] || { echo "launch.sh: $host is not a simulated host" >&2; exit 255; }
exec ip netns exec "fc${id}h$((k - 1))" sh -c "$*"
