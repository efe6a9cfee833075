#!/usr/bin/env bash
# The GPU check, run from the folder that tests/gpu/pack.sh's archive unpacks to:
#
#   tar -xf flexcomm-gpu.tar.xz && cd flexcomm-gpu && bash run.sh      (OUT=dir: where the logs go)
#
# Runs the gpu suite at 1-4 ranks, the CUDA trainer's four variants (baseline/streamlined x
# MPI/NCCL) and baseline against streamlined at four trainers, the device benchmarks and
# compute-sanitizer's memcheck, each under its own time limit, the whole within five minutes on
# one H100, and prints one line per run:
#   PASS name (12.3 s) | FAIL name rc=N (12.3 s) | SKIP name: reason
# then "N passed, N failed, N skipped". Exit status 0 iff nothing failed. Full logs in $OUT.
# Needs on the node: the NVIDIA driver, CUDA 13's runtime, NCCL and cuBLAS (installed anywhere,
# Python wheels included: they are looked for), bash, coreutils, findutils and ldd. Not MPI, not
# Boost, not the CUDA toolkit (compute-sanitizer is used where found).
#
# Not `set -e`: a failing run is a result to report, not a reason to stop.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
start=$(date +%s)
# The whole check must fit five minutes on one GPU: past this many seconds no run starts, and a
# run's limit is cut to what is left.
budget=${BUDGET:-280}
OUT=${OUT:-$here/out-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
bin=$here/bin
mpx=$bin/mpiexec.hydra

passed=0 failed=0 skipped=0 step=0
line() {  # a line of the report, also kept in summary.txt
  echo "$*"
  echo "$*" >> "$OUT/summary.txt"
}
info() { line "# $*"; }
say() { echo "$*" >> "$OUT/env.txt"; }

# ---- the environment the runs get -------------------------------------------------------------

# Every rank on this node, whatever batch system surrounds the run (Hydra would otherwise ask
# Slurm for hosts and launch through srun). Hydra starts hydra_pmi_proxy from beside itself or
# from PATH.
export PATH=$bin:$PATH HYDRA_LAUNCHER=fork HYDRA_RMK=user
export FASHION_MNIST_DIR=$here/data
# A caller's FLEXCOMM_* (a layout, a chunk size, a timeout) would change what the runs check.
for v in $(compgen -e | grep '^FLEXCOMM_' || true); do unset "$v"; done
# UCX (MPICH's transport) loads its plugins from the archive, not from a UCX of another version
# the node may have installed.
[ -d "$here/lib/ucx" ] && export UCX_MODULE_DIR=$here/lib/ucx

elf_files() {
  local f
  for f in "$@"; do
    [ -f "$f" ] && [ "$(head -c 4 "$f" | tr -d '\177')" = ELF ] && echo "$f"
  done
  return 0
}
mapfile -t elves < <(elf_files "$bin"/* "$here"/bench/* "$here"/host/* "$here"/lib/ucx/*)

# Libraries: the archive's own first; then, for what is still missing (CUDA's runtime, NCCL,
# cuBLAS), the folders where the node keeps them; libstdc++/libgcc_s from the archive last and
# only where the node's own are missing or older than the build's.
# (lib/ucx too: one UCX plugin links another by name.)
ldpath=$here/lib:$here/lib/ucx
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
  [ -d "$d" ] && ldpath=$ldpath:$d # containers' driver mount (libcuda is loaded at run time)
done
export LD_LIBRARY_PATH=$ldpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
missing_libs() {
  ldd "${elves[@]}" 2> /dev/null | awk '$2 == "=>" && $3 == "not" {print $1}' | sort -u
}
python_roots() {  # where the node's Python keeps packages, NVIDIA's wheels first
  command -v python3 > /dev/null || return 0
  timeout 30 python3 - 2> /dev/null << 'EOF'
import os, site
paths = []
try:
    import nvidia
    paths += list(nvidia.__path__)
except Exception:
    pass
try:
    paths += site.getsitepackages() + [site.getusersitepackages()]
except Exception:
    pass
for p in paths:
    if os.path.isdir(p):
        print(p)
EOF
}
mapfile -t roots < <(
  python_roots
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 \
    /usr/local/lib/python3*/dist-packages /usr/local/lib/python3*/site-packages \
    /usr/lib/python3/dist-packages "$HOME"/.local/lib/python3*/site-packages /opt; do
    [ -d "$d" ] && echo "$d"
  done
)
# One find per folder and pass, for every missing name at once; a library found in an earlier
# folder wins. A second pass finds what the libraries found in the first one need.
for _ in 1 2 3; do
  missing=$(missing_libs)
  [ -n "$missing" ] || break
  names=()
  for so in $missing; do names+=(-o -name "$so"); done
  for r in "${roots[@]}"; do
    [ -n "$missing" ] || break
    while IFS= read -r f; do
      so=$(basename "$f") d=$(dirname "$f")
      grep -qxF "$so" <<< "$missing" || continue
      missing=$(grep -vxF "$so" <<< "$missing")
      case ":$LD_LIBRARY_PATH:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d ;; esac
      say "found $so in $d"
    done < <(timeout 20 find "$r" -maxdepth 8 \( "${names[@]:1}" \) \( -type f -o -type l \) 2> /dev/null)
  done
done
# (Output kept, not piped into grep -q: with pipefail an early grep exit fails the pipeline.)
old_cxx=$( (missing_libs; ldd "${elves[@]}" 2>&1 > /dev/null | grep -E "version .* not found") |
  grep -E 'lib(stdc\+\+|gcc_s)\.so' || true)
if [ -n "$old_cxx" ]; then
  export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$here/fallback
  say "using the archive's libstdc++/libgcc_s"
fi
missing=$(missing_libs | paste -sd ' ')
versions=$(ldd "${elves[@]}" 2>&1 > /dev/null | grep -E "version .* not found" | sort -u)

# compute-sanitizer: on PATH, in the CUDA toolkit, or inside a Python wheel
# (nvidia-cuda-sanitizer-api and the like).
sanitizer=$(command -v compute-sanitizer || true)
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
  [ -z "$sanitizer" ] && [ -x "$c" ] && sanitizer=$c
done
if [ -z "$sanitizer" ]; then
  for r in "${roots[@]}"; do
    sanitizer=$(timeout 30 find "$r" -maxdepth 6 -name compute-sanitizer -type f -perm -u+x -print -quit 2> /dev/null)
    [ -n "$sanitizer" ] && break
  done
fi

# The GPU: nvidia-smi's list, or the device node where a container has no nvidia-smi.
gpu=""
if command -v nvidia-smi > /dev/null; then
  if smi=$(timeout 30 nvidia-smi -L 2>&1) && grep -q '^GPU ' <<< "$smi"; then
    gpu=$(grep -c '^GPU ' <<< "$smi")" GPU(s): $(grep -m1 '^GPU ' <<< "$smi" | sed 's/ (UUID.*//')"
  else
    no_gpu="nvidia-smi -L failed: $(head -n1 <<< "$smi")"
  fi
elif [ -e /dev/nvidia0 ]; then
  gpu="/dev/nvidia0 (no nvidia-smi)"
else
  no_gpu="no nvidia-smi and no /dev/nvidia0"
fi

{
  cat "$here/build-info.txt" 2> /dev/null
  echo "host: $(hostname) $(. /etc/os-release 2> /dev/null && echo "$PRETTY_NAME"), $(nproc) cores"
  echo "gpu: ${gpu:-none: $no_gpu}"
  [ -n "$gpu" ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "compute-sanitizer: ${sanitizer:-not found}"
  for f in "${elves[@]}"; do
    echo "== ldd $f"
    ldd "$f" 2>&1
  done
} >> "$OUT/env.txt" 2>&1

info "flexcomm GPU check, $(sed -n 's/^source: //p' "$here/build-info.txt" 2> /dev/null); logs in $OUT"
info "GPU: ${gpu:-none ($no_gpu)}"
if [ -n "$missing" ] || [ -n "$versions" ]; then
  info "libraries not found: ${missing:-}${versions:+(version errors, see env.txt)}"
fi

# ---- one run ----------------------------------------------------------------------------------

# run NAME LIMIT_S [NAME=VALUE...] -- COMMAND...: runs COMMAND under `timeout` with those
# variables, prints its line, keeps its log. Exit status 77 = skipped (no usable GPU).
run() {
  local name=$1 limit=$2
  shift 2
  local vars=()
  while [ "$1" != -- ]; do
    vars+=("$1")
    shift
  done
  shift
  step=$((step + 1))
  local log
  log=$OUT/$(printf '%02d' "$step")-$(tr -c 'A-Za-z0-9_.=,-' '_' <<< "$name" | sed 's/_*$//').log
  last_log=$log
  local left=$((budget - ($(date +%s) - start)))
  if [ "$left" -lt 15 ]; then
    line "SKIP $name: the time budget (${budget} s) is spent"
    skipped=$((skipped + 1))
    return
  fi
  [ "$limit" -le $((left - 8)) ] || limit=$((left - 8))
  local t0 rc t
  t0=$(date +%s.%N)
  {
    echo "\$ ${vars[*]} $*"
    echo "(limit ${limit} s)"
  } > "$log"
  env "${vars[@]}" timeout -k 5 "$limit" "$@" >> "$log" 2>&1 < /dev/null
  rc=$?
  t=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  echo "exit status $rc after $t s" >> "$log"
  if [ $rc -eq 77 ] && [ -z "$gpu" ]; then
    line "SKIP $name: no GPU (exit 77)"
    skipped=$((skipped + 1))
  elif [ $rc -eq 77 ]; then
    line "SKIP $name: exit 77, the program found no usable CUDA device"
    skipped=$((skipped + 1))
  elif [ $rc -eq 0 ]; then
    line "PASS $name ($t s)"
    passed=$((passed + 1))
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    line "FAIL $name rc=$rc (timed out after $limit s)"
    failed=$((failed + 1))
  else
    line "FAIL $name rc=$rc ($t s)"
    failed=$((failed + 1))
  fi
}
skip() {  # skip NAME REASON
  step=$((step + 1))
  line "SKIP $1: $2"
  skipped=$((skipped + 1))
}
# Without a GPU the suite and the trainer still start (they exit 77 at once, which checks the
# launcher and the libraries) where every library is there; programs that would report success
# with nothing measured, or could not even load, are not started.
gpu_run() {  # like run, for a program that exits 77 without a GPU
  if [ -z "$gpu" ] && [ -n "$missing$versions" ]; then
    skip "$1" "no GPU"
  else
    run "$@"
  fi
}
gpu_only_run() {  # like run, for a program that needs a GPU to mean anything
  if [ -z "$gpu" ]; then
    skip "$1" "no GPU"
  else
    run "$@"
  fi
}

# ---- the runs ---------------------------------------------------------------------------------

# The gpu suite, each test with the wrapper and environment Meson gives it (suite.tsv, written
# by pack.sh from the build's test list; "-" for none). Tests Meson runs at one rank only are
# single-process; the others run at 1, 2, 3 and 4 ranks (all on this node's GPUs: ranks share one
# through nccl_env.sh's host ids and sockets). Meson's FLEXCOMM_TIMEOUT (60 s) turns a hang into
# an error naming the missing ranks, so a test's limit is a little longer.
suite_limit=75
for n in 1 2 3 4; do
  while IFS=$'\t' read -r exe ranks wrappers vars; do
    [ "$ranks" = 1 ] && [ "$n" -gt 1 ] && continue
    cmd=()
    [ "$wrappers" = - ] || for w in $wrappers; do cmd+=("$bin/$w"); done
    [ "$vars" = - ] && vars=""
    # shellcheck disable=SC2086 # vars: NAME=value words
    gpu_run "$exe np$n" "$suite_limit" $vars -- "$mpx" -n "$n" "${cmd[@]}" "$bin/$exe"
  done < "$here/suite.tsv"
done

# The CUDA trainer: baseline/streamlined x MPI (staged)/NCCL, short runs (300 steps on
# Fashion-MNIST: every variant should report the same accuracies). Its own timeout turns a hang
# into a named error before the run's limit.
trainer=(--steps 300 --log-every 100)
trainer_limit=60
for v in "baseline mpi 2 members=2x1" "baseline nccl 2 members=2x1" \
  "streamlined mpi 3 producers=1_members=2x1" "streamlined nccl 3 producers=1_members=2x1" \
  "streamlined mpi 5 producers=1_members=2,2" "streamlined nccl 5 producers=1_members=2,2"; do
  read -r pipeline backend n layout <<< "$v"
  layout=${layout//_/ }
  wrap=()
  [ "$backend" = nccl ] && wrap=("$bin/nccl_env.sh")
  gpu_run "cuda_trainer $pipeline $backend $layout" "$trainer_limit" FLEXCOMM_TIMEOUT=45 -- \
    "$mpx" -n "$n" "${wrap[@]}" "$bin/cuda_trainer" --pipeline "$pipeline" --backend "$backend" \
    --layout "$layout" "${trainer[@]}"
done

# libtorch on the GPU: CUDA tensors through the device Syncs at 1-4 ranks, then the unchanged MNIST
# port (docs/porting.md) under baseline and single_broadcast, with the node's own libtorch.
if [ -x "$here/torch_cuda/gpu_torch_cuda" ]; then
  gpu_run "torch_cuda (libtorch on the GPU)" 420 MPIEXEC="$mpx" -- \
    bash "$here/torch_cuda/torch_cuda.sh" run "$here/torch_cuda" "$here/data"
fi

# Baseline against streamlined at four trainers, with preprocessing as costly as a real input
# pipeline's (--preprocess-us: CPU work per sample in the loader). The baseline's trainers each
# preprocess between their steps; the streamlined producer preprocesses each step once, ahead.
# Each member's first rank prints its step time and the share of it spent waiting for data; those
# lines go to the summary under the run's PASS line, whose seconds are the wall time. On a node
# with one GPU the four trainers share it (node-local rank % 1 devices; CUDA_VISIBLE_DEVICES per
# rank cannot spread one GPU), so the step times include four ranks time-slicing it.
# Both on the same five ranks: the baseline's producer rank has nothing to do.
preprocess_us=20
for pipeline in baseline streamlined; do
  layout="producers=1 members=4x1"
  last_log=
  gpu_run "cuda_trainer $pipeline nccl $layout preprocess-us=$preprocess_us" "$trainer_limit" FLEXCOMM_TIMEOUT=45 -- \
    "$mpx" -n 5 "$bin/nccl_env.sh" "$bin/cuda_trainer" --pipeline "$pipeline" --backend nccl \
    --layout "$layout" --preprocess-us "$preprocess_us" "${trainer[@]}"
  if [ -n "$last_log" ] && [ -f "$last_log" ]; then
    while read -r l; do info "  $l"; done < <(grep -E '^member [0-9]+: .* ms/step' "$last_log")
  fi
done

# Device benchmarks, short sizes: that they run and check their results, not the numbers.
# (allreduce_nccl says "no CUDA device" and exits 0 without a GPU: not started there.)
gpu_only_run "allreduce_nccl np1" 45 FLEXCOMM_TIMEOUT=30 -- "$mpx" -n 1 "$here/bench/allreduce_nccl" \
  -b 8 -e 16M -f 16 -n 10 -w 3 -c 1 -J "$OUT/allreduce_nccl_np1.json"
gpu_only_run "allreduce_nccl np2" 45 FLEXCOMM_TIMEOUT=30 -- "$mpx" -n 2 "$bin/nccl_env.sh" \
  "$here/bench/allreduce_nccl" -b 8 -e 1M -f 32 -n 5 -w 2 -c 1 -J "$OUT/allreduce_nccl_np2.json"
# The ceilings (issue 52): staged up to 64 MiB against pinned h2d+d2h, nccl against ncclAllReduce,
# at 1 and 2 ranks (docs/benchmarks.md, "The device"); the 64 MiB line goes to the summary.
for n in 1 2; do
  wrap=()
  [ "$n" = 2 ] && wrap=("$bin/nccl_env.sh")
  last_log=
  gpu_only_run "allreduce_nccl ceilings np$n" 60 FLEXCOMM_TIMEOUT=30 -- "$mpx" -n "$n" "${wrap[@]}" \
    "$here/bench/allreduce_nccl" -b 4M -e 64M -f 4 -n 10 -w 3 -c 1 -J "$OUT/allreduce_nccl_ceilings_np$n.json"
  [ -n "$last_log" ] && [ -f "$last_log" ] && while read -r l; do info "  ${l#\# }"; done < <(grep "^# at " "$last_log")
done
# The host time a post adds over the raw call (docs/cuda.md, "Host work per operation"): 200
# posts per row at one rank; at two, where every NCCL call crosses host sockets (nccl_env.sh), 10
# per row at 8 B and 32 KiB, so that it ends within its limit (25 s on the stand-in here, its two
# cores busy with other work).
gpu_only_run "device_host_cost np1" 60 FLEXCOMM_TIMEOUT=60 -- "$mpx" -n 1 "$here/bench/device_host_cost" \
  -b 8 -e 64K -f 8 -n 200 -w 20 -J "$OUT/device_host_cost_np1.json"
gpu_only_run "device_host_cost np2" 60 FLEXCOMM_TIMEOUT=60 -- "$mpx" -n 2 "$bin/nccl_env.sh" \
  "$here/bench/device_host_cost" -b 8 -e 32K -f 4096 -n 10 -w 2 -J "$OUT/device_host_cost_np2.json"
# A ring step over flexcomm's nccl sends and receives (its blocking point-to-point child) against
# a raw blocking NCCL send/receive ring (issue 52, item 2: ratio <= 1.1; docs/cuda.md, "Point to
# point on a blocking child"): at one rank (a send to itself) and at two, where every NCCL call
# crosses host sockets (nccl_env.sh); the table goes to the summary.
for n in 1 2; do
  wrap=()
  [ "$n" = 2 ] && wrap=("$bin/nccl_env.sh")
  last_log=
  gpu_only_run "device_p2p_ring np$n" 60 FLEXCOMM_TIMEOUT=30 -- "$mpx" -n "$n" "${wrap[@]}" \
    "$here/bench/device_p2p_ring" -b 8 -e 16M -f 16 -n 20 -w 5 -J "$OUT/device_p2p_ring_np$n.json"
  if [ -n "$last_log" ] && [ -f "$last_log" ]; then
    while read -r l; do info "  $l"; done < <(grep -E '^ +[0-9]+ ' "$last_log")
  fi
done
# The reduction kernels against a device-to-device copy (issue 52): GB/s and the ratio to the copy
# for every type and op, 4 KiB to 256 MiB, beside the kernels as they were; its two verdict lines
# (the worst ratio at >= 16 MiB, target >= 0.9; the worst time against the old kernels at
# <= 1 MiB, target <= 1) go to the summary. docs/cuda.md, "Device reductions".
last_log=
gpu_only_run "device_kernels np1" 60 -- "$mpx" -n 1 "$here/bench/device_kernels" -b 4K -e 256M -f 4 -n 20 -w 5 -c 1 \
  -J "$OUT/device_kernels.json"
if [ -n "$last_log" ] && [ -f "$last_log" ]; then
  while read -r l; do info "  $l"; done < <(grep -E '^# verdict' "$last_log")
fi
# Other device benchmarks (pack.sh globs *device* and *kernels*) run with their own defaults at
# one rank, from $OUT so that whatever they write lands beside the logs.
for b in "$here"/bench/*; do
  name=$(basename "$b")
  if [ -f "$b" ] && [ "$name" != allreduce_nccl ] && [ "$name" != device_host_cost ] && [ "$name" != device_kernels ] &&
    [ "$name" != device_p2p_ring ]; then
    # shellcheck disable=SC2016 # expanded by that sh
    gpu_only_run "$(basename "$b") np1" 45 -- sh -c 'cd "$1" && shift && exec "$@"' sh "$OUT" "$mpx" -n 1 "$b"
  fi
done

# compute-sanitizer's memcheck on the reduction kernels (exit 9: it found errors).
if [ -z "$gpu" ]; then
  skip "memcheck gpu_reduce_kernels np1" "no GPU"
elif [ -z "$sanitizer" ]; then
  skip "memcheck gpu_reduce_kernels np1" "compute-sanitizer not found (PATH, /usr/local/cuda*/bin, Python wheels)"
else
  run "memcheck gpu_reduce_kernels np1" 90 FLEXCOMM_TIMEOUT=60 -- "$mpx" -n 1 \
    "$sanitizer" --tool memcheck --error-exitcode 9 "$bin/gpu_reduce_kernels"
fi

# The host benchmarks on this node's cores, last and only while the budget lasts: the 2-rank
# allreduce sweep three times in a row (issue 33 compares runs side by side), at 4 ranks, and the
# overlap of ResNet-50's and VGG-16's buckets with backward. Bound to cores, as a node without
# other work would run a job. The JSON lands in $OUT.
if [ -d "$here/host" ]; then
  for n in 2 2 2 4; do
    step_json=$OUT/allreduce_np${n}_$((step + 1)).json
    gpu_only_run "host allreduce np$n" 40 -- "$mpx" -bind-to core -n "$n" "$here/host/allreduce" \
      -b 4 -e 64M -f 4 -n 20 -w 5 -c 1 -j "$step_json"
  done
  gpu_only_run "host overlap np2" 60 -- "$mpx" -bind-to core -n 2 "$here/host/overlap" --scale 64 -n 25 -w 5 \
    -j "$OUT/overlap_np2.json"
fi

line "$passed passed, $failed failed, $skipped skipped"
# Every log in one file too, for a transfer that brings back few files.
tar -C "$OUT" --exclude=logs.tar.gz -czf "$OUT/logs.tar.gz" . 2> /dev/null || true
[ "$failed" -eq 0 ]
