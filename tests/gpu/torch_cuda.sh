#!/usr/bin/env bash
# libtorch on the GPU (docs/cuda.md): builds the torch interop's CUDA test (tests/gpu/torch_cuda.cu)
# and the upstream-shaped MNIST port (examples/torch_ensemble/mnist_ensemble.cpp, unchanged) with
# nvcc against a CUDA libtorch, and runs both on a GPU node.
#
#   bash tests/gpu/torch_cuda.sh build [TORCH] [OUT]   build into OUT (default build/torch_cuda)
#   bash tests/gpu/torch_cuda.sh run [OUT] [DATA]      run what OUT holds; exit 77 without a GPU
#   bash tests/gpu/torch_cuda.sh [TORCH]               both
#
# TORCH is a torch package folder (headers in include/, libraries in lib/): PyPI's `torch` wheel
# is a CUDA build (python3 -m venv /work/torchcuda && /work/torchcuda/bin/pip install --no-deps
# torch==2.11.0: /work/torchcuda/lib/python3.11/site-packages/torch). Default: $TORCH_DIR, else
# that folder, else python3's torch. The build needs nvcc (/usr/local/cuda), NCCL, MPICH and Boost;
# linking leaves libtorch_cuda's own libraries (cuDNN, cuSPARSELt, ...) to the node, whose torch
# brings them. `run` takes libtorch from python3's torch there (TORCH_LIB overrides), the launcher
# from MPIEXEC (default mpiexec.mpich, else mpiexec on PATH), Fashion-MNIST from DATA (gzipped or
# not; default /usr/share/datasets/fashion-mnist, else data/ beside OUT). Every rank shares the
# node's GPUs through nccl_env.sh (tests only). It prints PASS/FAIL/SKIP per run and a last line
# `N passed, N failed, N skipped`; exit status 0 when nothing failed, 77 when no GPU is present.
set -uo pipefail

src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
arch=${GPU_ARCH:-90}

die() {
  echo "torch_cuda.sh: error: $*" >&2
  exit 1
}

find_torch() {
  local t=${1:-${TORCH_DIR:-}}
  if [ -z "$t" ]; then
    for candidate in /work/torchcuda/lib/python3*/site-packages/torch; do
      [ -d "$candidate/include" ] && t=$candidate
    done
  fi
  if [ -z "$t" ]; then
    t=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2> /dev/null) || t=
  fi
  [ -n "$t" ] && [ -f "$t/include/c10/cuda/impl/cuda_cmake_macros.h" ] && [ -f "$t/lib/libtorch_cuda.so" ] ||
    die "no CUDA libtorch found ('${t:-none}'): pass the torch package folder (PyPI's wheel: .../site-packages/torch)"
  echo "$t"
}

build() {
  local torch out nvcc common libs
  torch=$(find_torch "${1:-}") || exit 1
  out=${2:-$src/build/torch_cuda}
  nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  [ -x "$nvcc" ] || die "nvcc not found (PATH, NVCC, /usr/local/cuda/bin)"
  mkdir -p "$out"
  # The flags of a libtorch C++ program (TorchConfig.cmake's: C++17, the C++11 ABI), flexcomm's
  # CUDA parts (FLEXCOMM_HAVE_CUDA), MPICH's headers; torch's headers as system headers.
  common=(-std=c++17 -O1 -D_GLIBCXX_USE_CXX11_ABI=1 -DFLEXCOMM_HAVE_CUDA=1
          "-gencode=arch=compute_$arch,code=sm_$arch" "-gencode=arch=compute_$arch,code=compute_$arch"
          -I"$src/include" -isystem "$torch/include" -isystem "$torch/include/torch/csrc/api/include"
          $(pkg-config --cflags mpich))
  libs=(-L"$torch/lib" -Wl,--no-as-needed -ltorch -ltorch_cuda -ltorch_cpu -lc10_cuda -lc10 -Wl,--as-needed
        -Wl,--allow-shlib-undefined -Wl,-rpath,"$torch/lib" -L/usr/local/cuda/lib64 -lcudart -lnccl
        $(pkg-config --libs mpich))
  echo "torch_cuda.sh: building against $torch ($(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$torch/version.py" 2> /dev/null))"
  "$nvcc" "${common[@]}" -DBOOST_TEST_DYN_LINK -I"$src/tests" -c "$here/torch_cuda.cu" -o "$out/torch_cuda.o" &&
    g++ "$out/torch_cuda.o" -o "$out/gpu_torch_cuda" "${libs[@]}" -lboost_unit_test_framework ||
    die "gpu_torch_cuda did not build"
  # The port as upstream wrote it: only the compiler differs (nvcc compiles the .cpp as CUDA, for
  # the device Sync that train_ensemble makes for a CUDA module).
  "$nvcc" "${common[@]}" -I"$src/examples" -x cu -c "$src/examples/torch_ensemble/mnist_ensemble.cpp" \
      -o "$out/mnist_ensemble.o" &&
    g++ "$out/mnist_ensemble.o" -o "$out/torch_mnist_ensemble_cuda" "${libs[@]}" -lboost_program_options -lz ||
    die "torch_mnist_ensemble_cuda did not build"
  rm -f "$out/torch_cuda.o" "$out/mnist_ensemble.o"
  cp "$here/nccl_env.sh" "$here/torch_cuda.sh" "$out/"  # `OUT/torch_cuda.sh run OUT` runs them elsewhere
  echo "torch_cuda.sh: built $out/gpu_torch_cuda and $out/torch_mnist_ensemble_cuda"
}

passed=0 failed=0 skipped=0
report() {  # name, status, log
  case $2 in
    0) echo "PASS $1"; passed=$((passed + 1)) ;;
    77) echo "SKIP $1: no usable CUDA device"; skipped=$((skipped + 1)) ;;
    *) echo "FAIL $1 rc=$2 (log: $3)"; failed=$((failed + 1)) ;;
  esac
}

run() {
  local out=${1:-} data=${2:-} mpiexec lib logs tmp rc
  if [ -z "$out" ]; then  # beside this script where `build` copied it, else the build's folder
    out=$src/build/torch_cuda
    [ -x "$here/gpu_torch_cuda" ] && out=$here
  fi
  out=$(cd "$out" && pwd) || die "no build folder '$out'"
  if ! { command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; } && [ ! -e /dev/nvidia0 ]; then
    echo "SKIP torch_cuda: no GPU (no nvidia-smi -L, no /dev/nvidia0)"
    echo "0 passed, 0 failed, 1 skipped"
    exit 77
  fi
  lib=${TORCH_LIB:-$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2> /dev/null)}
  # libtorch, and the CUDA runtime and NCCL of the wheels beside it (site-packages/nvidia/*/lib),
  # which the programs need for themselves too (libtorch_cuda finds its own through its RPATH).
  if [ -n "$lib" ]; then
    for d in "$lib"/../../nvidia/*/lib; do
      [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  mpiexec=${MPIEXEC:-$(command -v mpiexec.mpich || command -v mpiexec)} || die "no MPI launcher (MPIEXEC)"
  logs=${OUT:-$out/logs}
  mkdir -p "$logs"
  export FLEXCOMM_TIMEOUT=${FLEXCOMM_TIMEOUT:-60}
  for n in 1 2 3 4; do
    timeout 180 "$mpiexec" -n "$n" "$out/nccl_env.sh" "$out/gpu_torch_cuda" > "$logs/gpu_torch_cuda-np$n.log" 2>&1
    report "gpu_torch_cuda np$n" $? "$logs/gpu_torch_cuda-np$n.log"
  done
  # The MNIST port at full size, one epoch: upstream's device branch picks CUDA, train_ensemble
  # makes NCCL's Sync for the module; each run must print the GPU line and an ensemble over 0.6.
  for d in "$data" /usr/share/datasets/fashion-mnist "$out/../data" "$out/data"; do
    [ -n "$d" ] && ls "$d"/train-images-idx3-ubyte* > /dev/null 2>&1 && data=$d && break
  done
  if [ -z "$data" ]; then
    echo "SKIP torch_mnist_ensemble_cuda: no Fashion-MNIST (DATA)"
    skipped=$((skipped + 1))
  else
    tmp=$(mktemp -d)
    for f in "$data"/*-ubyte*; do
      case $f in *.gz) gunzip -c "$f" > "$tmp/$(basename "$f" .gz)" ;; *) cp "$f" "$tmp/" ;; esac
    done
    for run in "baseline 3 members=2,1" "single_broadcast 4 producers=1 members=2,1 aggregator=1"; do
      set -- $run
      local preset=$1 ranks=$2 log="$logs/torch_mnist_ensemble_cuda-$1.log"
      shift 2
      timeout 300 "$mpiexec" -n "$ranks" "$out/nccl_env.sh" "$out/torch_mnist_ensemble_cuda" --data "$tmp" \
          --epochs 1 --preset "$preset" --layout "$*" > "$log" 2>&1
      rc=$?
      if [ $rc = 0 ] && ! { grep -q "Training on GPU" "$log" &&
          awk '/ensemble/ { if ($NF + 0 > 0.6) ok = 1 } END { exit !ok }' "$log"; }; then
        echo "torch_mnist_ensemble_cuda: no GPU line or no ensemble accuracy over 0.6" >> "$log"
        rc=1
      fi
      report "torch_mnist_ensemble_cuda $preset" $rc "$log"
    done
    rm -rf "$tmp"
  fi
  echo "$passed passed, $failed failed, $skipped skipped"
  [ $failed = 0 ]
}

case ${1:-} in
  build) shift; build "$@" ;;
  run) shift; run "$@" ;;
  *) build "${1:-}" && run ;;
esac
