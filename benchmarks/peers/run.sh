#!/usr/bin/env bash
# Peers side by side: flexcomm's allreduce and overlap benchmarks, then the same measurements by
# torch.distributed (Gloo) and DistributedDataParallel, back to back at each rank count, and one
# table of ratios (benchmarks/peers/table.py, from the JSON files).
#   bash benchmarks/peers/run.sh [--quick] [--out DIR] [RANKS...]     (default ranks: 2 4)
# --quick: 1, 4, 16 and 64 MiB only, few iterations (minutes; for development, not for numbers).
# Builds what it needs in ./build (meson setup build if missing) and installs Debian's
# python3-torch if Debian's python3 cannot import torch. Not part of CI: the full run is long.
set -euo pipefail
cd "$(dirname "$0")/../.."

quick=0
out=build/peers
ranks=()
while (($#)); do
  case "$1" in
    --quick) quick=1 ;;
    --out) out="$2"; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *[!0-9]*|'') echo "run.sh: expected --quick, --out DIR or a rank count, got '$1'" >&2; exit 2 ;;
    *) ranks+=("$1") ;;
  esac
  shift
done
((${#ranks[@]})) || ranks=(2 4)

# Debian's interpreter: python3-torch lives there, whatever python3 comes first on PATH.
py=/usr/bin/python3
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "run.sh: installing python3-torch" >&2
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get install -y -qq python3-torch >/dev/null
fi

[ -f build/build.ninja ] || meson setup build
ninja -C build benchmarks/allreduce benchmarks/overlap benchmarks/peers/peer_backward.so

if ((quick)); then
  sweep=(-b 1M -e 64M -f 4 -n 5 -w 2 -c 1)
  steps=(--scale 64 -n 10 -w 2)
else
  sweep=(-b 4K -e 64M -f 2 -n 20 -w 3 -c 1)
  steps=(--scale 64 -n 40 -w 5)
fi
mkdir -p "$out"
# One thread per rank for torch's own parallelism (ranks already fill the 2 cores); torchrun
# would set the same and warn. Gloo's communication threads are separate.
export OMP_NUM_THREADS=1
# flexcomm's build is on MPICH; plain `mpiexec` may be Open MPI's where both are installed.
launcher=$(command -v mpiexec.mpich || command -v mpiexec)
# A rank that hangs would hold torchrun (and mpiexec) forever: each benchmark gets 20 minutes.
limit=(timeout --signal=TERM --kill-after=30 1200)
torchrun=("${limit[@]}" "$py" benchmarks/peers/torchrun.py --standalone --nproc_per_node)

for n in "${ranks[@]}"; do
  echo "=== $n ranks, $(date -u '+%F %T') UTC, uptime: $(uptime)" | tee "$out/uptime_np$n.txt"
  "${limit[@]}" "$launcher" -n "$n" build/benchmarks/allreduce "${sweep[@]}" -j "$out/allreduce_np$n.json" \
    | tee "$out/allreduce_np$n.txt"
  "${torchrun[@]}" "$n" benchmarks/peers/allreduce_gloo.py "${sweep[@]}" -j "$out/gloo_np$n.json" \
    | tee "$out/gloo_np$n.txt"
  "${limit[@]}" "$launcher" -n "$n" build/benchmarks/overlap "${steps[@]}" -j "$out/overlap_np$n.json" \
    | tee "$out/overlap_np$n.txt"
  # The DDP host sits idle as long as flexcomm's did (its CPU backward in the run just made).
  idle=$("$py" -c 'import json, sys
rows = json.load(open(sys.argv[1]))["results"]
print(",".join(sorted({"%s=%.0f" % (x["model"], x["compute_us"]) for x in rows if x.get("backward") == "cpu"})))' \
    "$out/overlap_np$n.json")
  "${torchrun[@]}" "$n" benchmarks/peers/overlap_ddp.py "${steps[@]}" --idle-us "$idle" -j "$out/ddp_np$n.json" \
    | tee "$out/ddp_np$n.txt"
done

echo "=== done $(date -u '+%F %T') UTC, uptime: $(uptime)"
IFS=,; "$py" benchmarks/peers/table.py "$out" --ranks "${ranks[*]}" --json "$out/peers.json" | tee "$out/table.md"
