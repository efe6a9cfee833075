#!/usr/bin/env bash
# Simulated hosts for the cluster suite: network namespaces fc<id>h0..h<N-1> on one bridge (in a
# namespace of its own, fc<id>sw), addresses 10.213.<id>.1.. in a private test subnet, optionally
# a rate limit per link with tc. Nothing outside these namespaces is touched.
#   hosts.sh up ID N [RATE]   make N hosts (RATE like 10gbit: tbf on each host's egress)
#   hosts.sh down ID          remove them (idempotent)
#   hosts.sh check            exit 77 when namespaces cannot be made here
# ID (0-250) keeps concurrent clusters apart. Host i is named by its address, 10.213.ID.(i+1),
# which is also what goes into Hydra's host list; tests/cluster/launch.sh maps it back.
set -euo pipefail
cmd=${1:-}
prefix() { echo "fc$1"; }

down() {
  local p; p=$(prefix "$1")
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${p}(h[0-9]+|sw)$" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
}

case "$cmd" in
  check)
    command -v ip >/dev/null || { echo "cluster: iproute2 (ip) missing" >&2; exit 77; }
    probe="fcprobe$$"
    if ! ip netns add "$probe" 2>/dev/null; then
      echo "cluster: cannot make network namespaces here (need root and CAP_SYS_ADMIN)" >&2; exit 77
    fi
    ok=0
    ip netns exec "$probe" ip link add fcp0 type veth peer name fcp1 2>/dev/null && ok=1
    ip netns del "$probe"
    [ $ok = 1 ] || { echo "cluster: cannot make veth pairs here" >&2; exit 77; }
    ;;
  up)
    id=$2; n=$3; rate=${4:-}
    p=$(prefix "$id")
    down "$id"
    # On failure half-way, leave nothing behind.
    trap 'down "$id"' ERR
    ip netns add "${p}sw"
    ip -n "${p}sw" link add br0 type bridge
    ip -n "${p}sw" link set br0 up
    ip -n "${p}sw" link set lo up
    for ((i = 0; i < n; i++)); do
      h="${p}h$i"
      ip netns add "$h"
      ip -n "$h" link add eth0 type veth peer name "p$i" netns "${p}sw"
      ip -n "${p}sw" link set "p$i" master br0 up
      ip -n "$h" addr add "10.213.$id.$((i + 1))/24" dev eth0
      ip -n "$h" link set eth0 up
      ip -n "$h" link set lo up
      if [ -n "$rate" ]; then
        # Both directions of every host link: egress of the host, and egress of its bridge port.
        ip netns exec "$h" tc qdisc add dev eth0 root tbf rate "$rate" burst 1mbit latency 50ms
        ip netns exec "${p}sw" tc qdisc add dev "p$i" root tbf rate "$rate" burst 1mbit latency 50ms
      fi
    done
    trap - ERR
    ;;
  down)
    down "$2"
    ;;
  *)
    echo "usage: hosts.sh up ID N [RATE] | down ID | check" >&2; exit 2 ;;
esac
