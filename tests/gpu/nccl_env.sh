#!/bin/sh
# Tests only: lets several ranks of one host share a single GPU under NCCL. NCCL refuses two ranks
# on one device of one host, so each rank claims a host of its own (NCCL_HOSTID) and NCCL then
# talks between them over sockets (NCCL_NET=Socket on the loopback). Never use this in production.
rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${MPI_LOCALRANKID:-0}}}
export NCCL_HOSTID="flexcomm-test-rank-$rank"
export NCCL_NET="${NCCL_NET:-Socket}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
exec "$@"
