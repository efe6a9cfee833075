#!/usr/bin/env bash
# Packs the GPU check into one archive for a GPU node that has the NVIDIA driver but not the
# build tools, MPI or Boost (docs/cuda.md, "Running the GPU check on a GPU node"):
#
#   bash tests/gpu/pack.sh [BUILD_DIR] [OUT_ARCHIVE]     (defaults: build, BUILD_DIR/flexcomm-gpu.tar.xz)
#   # on the node:  tar -xf flexcomm-gpu.tar.xz && cd flexcomm-gpu && bash run.sh
#
# The archive holds one folder, flexcomm-gpu/: run.sh (tests/gpu/run.sh), suite.tsv (the gpu
# suite as Meson runs it), bin/ (the gpu tests, the CUDA trainer, MPICH's Hydra launcher,
# nccl_env.sh), bench/ (the device benchmarks), lib/ (the shared libraries a bare node may lack),
# fallback/ (libstdc++ and libgcc_s, which run.sh uses only where the node's own are missing or
# older than the build's), data/ (Fashion-MNIST) and build-info.txt.
set -euo pipefail

build=${1:-build}
archive=${2:-$build/flexcomm-gpu.tar.xz}
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
top=flexcomm-gpu
max_mib=60
dataset=/usr/share/datasets/fashion-mnist

die() {
  echo "pack.sh: error: $*" >&2
  exit 1
}

[ -f "$build/build.ninja" ] || die "'$build' is not a Meson build directory (meson setup $build)"
for tool in meson python3 ldd strip xz tar; do
  command -v "$tool" > /dev/null || die "$tool not found"
done

# The gpu suite as Meson runs it: rank counts, wrapper and environment per test. Read from the
# build's own test list, so that the archive runs each test the way `meson test --suite gpu` does
# and a new GPU test needs no change here. One line per test:
#   binary <TAB> Meson's rank counts <TAB> wrapper paths <TAB> NAME=value ...
# with "-" for no wrapper or no variables (read splits on tabs, which would merge empty fields).
suite=$(meson introspect --tests "$build" | python3 -c '
import json, os, sys
rows = {}
for t in json.load(sys.stdin):
    if not any(s == "gpu" or s.endswith(":gpu") for s in t["suite"]):
        continue
    cmd = t["cmd"]
    n = cmd.index("-n")
    exe, wrappers = cmd[-1], cmd[n + 2:-1]
    env = [k + "=" + v for k, v in sorted(t["env"].items())]
    if any(c.isspace() for c in "".join(env + wrappers)):
        sys.exit("a gpu test has white space in its environment or wrapper: " + t["name"])
    row = rows.setdefault(exe, [[], wrappers, " ".join(env)])
    row[0].append(cmd[n + 1])
for exe, (ranks, wrappers, env) in rows.items():
    print("\t".join([exe, " ".join(ranks), " ".join(wrappers) or "-", env or "-"]))
')
if [ -z "$suite" ]; then
  die "the build in '$build' has no gpu tests: it was configured without CUDA (nvcc, NCCL or cuBLAS not
  found at setup; -Dcuda=disabled; or a sanitizer build). Configure with nvcc on PATH, e.g.
    export PATH=/usr/local/cuda/bin:\$PATH; meson setup --wipe $build -Dcuda=enabled"
fi

# Programs: every gpu test Meson knows and the CUDA example (into bin/), the device benchmarks
# (into bench/; globbed, so that a new *device* or *kernels* benchmark travels without a change
# here, and kept apart from the tests whose names match the same patterns). Stand-in builds of a
# benchmark (*_standin) stay behind: they measure the host stand-in, not the GPU.
programs=()
benches=("$build/benchmarks/allreduce_nccl")
missing=()
in_build() {  # Meson names a test's files relative to the build directory or absolutely
  case $1 in /*) echo "$1" ;; *) echo "$build/$1" ;; esac
}
while IFS=$'\t' read -r exe _ _ _; do
  programs+=("$(in_build "$exe")")
done <<< "$suite"
programs+=("$build/examples/cuda_trainer")
shopt -s nullglob
for f in "$build"/benchmarks/*device* "$build"/benchmarks/*kernels*; do
  case $f in *_standin) continue ;; esac
  case " ${benches[*]} " in *" $f "*) continue ;; esac # device_kernels matches both patterns
  [ -f "$f" ] && [ -x "$f" ] && benches+=("$f")
done
shopt -u nullglob
# The host allreduce and overlap benchmarks (into host/): a GPU node has cores to spare where the
# build machine has two, and run.sh measures the shared-memory path there too.
hosts=("$build/benchmarks/allreduce" "$build/benchmarks/overlap")
for f in "${programs[@]}" "${benches[@]}" "${hosts[@]}"; do
  [ -f "$f" ] && [ -x "$f" ] || missing+=("${f#"$build"/}")
done
if [ ${#missing[@]} -gt 0 ]; then
  die "the build in '$build' lacks ${missing[*]}. Build them first:
    meson compile -C $build ${missing[*]}"
fi
# The archive carries MPICH's launcher, so the programs must be MPICH programs.
if ! grep -q 'libmpich\.so' <<< "$(ldd "$build/examples/cuda_trainer")"; then
  die "$build/examples/cuda_trainer is not linked against MPICH; the archive carries MPICH's Hydra.
  Configure with -Dmpi=mpich."
fi
hydra=(/usr/bin/mpiexec.hydra /usr/bin/hydra_pmi_proxy)
for f in "${hydra[@]}"; do
  [ -x "$f" ] || die "$f not found (Debian package mpich)"
done
ls "$dataset"/*.gz > /dev/null 2>&1 || die "no Fashion-MNIST in $dataset (Debian package dataset-fashion-mnist)"

elf_files() {  # the ELF files among the arguments
  local f
  for f in "$@"; do
    [ -f "$f" ] && [ "$(head -c 4 "$f" | tr -d '\177')" = ELF ] && echo "$f"
  done
  return 0
}

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
out=$stage/$top
mkdir -p "$out/bin" "$out/bench" "$out/host" "$out/lib" "$out/fallback" "$out/data"

cp "${programs[@]}" "${hydra[@]}" "$out/bin/"
cp "${benches[@]}" "$out/bench/"
cp "${hosts[@]}" "$out/host/"
# Wrappers (nccl_env.sh) by their name: run.sh finds them in bin/.
while IFS=$'\t' read -r _ _ wrappers _; do
  [ "$wrappers" = - ] || for w in $wrappers; do cp "$(in_build "$w")" "$out/bin/"; done
done <<< "$suite"
cp "$src/tests/gpu/nccl_env.sh" "$out/bin/"
chmod +x "$out"/bin/*.sh
cp "$src/tests/gpu/run.sh" "$out/run.sh"
while IFS=$'\t' read -r exe ranks wrappers env; do
  names=()
  [ "$wrappers" = - ] || for w in $wrappers; do names+=("$(basename "$w")"); done
  printf '%s\t%s\t%s\t%s\n' "$(basename "$exe")" "$ranks" "${names[*]:--}" "$env"
done <<< "$suite" > "$out/suite.tsv"
cp "$dataset"/*.gz "$out/data/"
# libtorch on the GPU (docs/cuda.md): its test and the MNIST port, built against PyPI's CUDA torch
# where it is installed (tests/gpu/torch_cuda.sh); outside bin/, so libtorch is not packed.
bash "$src/tests/gpu/torch_cuda.sh" build "" "$out/torch_cuda" ||
  echo "pack.sh: no CUDA libtorch here: torch_cuda left out" >&2

# Shared libraries: what ldd resolves for every program, less what the node must bring itself.
# glibc (and its loader) has to be the node's own: a second one in the path breaks every program.
# The NVIDIA driver matches the node's kernel module. CUDA's runtime, NCCL and cuBLAS come with
# the node's CUDA (often only as Python wheels), and they are the bulk of the size.
keep_lib() {  # keep_lib SONAME PATH: lib, fallback or skip
  case $1 in
    ld-linux* | libc.so.* | libm.so.* | libmvec.so.* | libpthread.so.* | libdl.so.* | librt.so.* | \
      libresolv.so.* | libutil.so.* | libnsl.so.* | libanl.so.* | libBrokenLocale.so.* | libnss_* | \
      libthread_db.so.* | libc_malloc_debug.so.* | libmemusage.so | libpcprofile.so)
      echo skip ;;
    libcuda.so.* | libcudadebugger.so.* | libnvidia* | libnvcuvid.so.* | libnvoptix.so.*) echo skip ;;
    libcudart.so.* | libnccl.so.* | libcublas.so.* | libcublasLt.so.* | libnvrtc* | libnvJitLink.so.* | \
      libcufft* | libcurand.so.* | libcusolver* | libcusparse.so.* | libnvToolsExt.so.*)
      echo skip ;;
    libstdc++.so.* | libgcc_s.so.*) echo fallback ;;
    # UCX's plugins stay together in lib/ucx (below), which run.sh puts on the library path.
    *) case $2 in /usr/local/cuda*) echo skip ;; */ucx/*) echo skip ;; *) echo lib ;; esac ;;
  esac
}
copy_libs_of() {  # copy_libs_of ELF...: its libraries into lib/ or fallback/
  local soname path where
  ldd "$@" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
    while read -r soname path; do
      where=$(keep_lib "$soname" "$path")
      [ "$where" = skip ] || [ -e "$out/$where/$soname" ] || cp -L "$path" "$out/$where/$soname"
    done
}
mapfile -t elves < <(elf_files "$out"/bin/* "$out"/bench/* "$out"/host/*)
copy_libs_of "${elves[@]}"
# MPICH talks through UCX, and UCX loads its transports (cma, ib, rdmacm) as plugins from the
# folder beside libucs (lib/ucx in the archive; run.sh also points UCX_MODULE_DIR there).
ucs=$(ldd "$out/bin/cuda_trainer" | awk '$1 ~ /^libucs\.so/ {print $3}')
if [ -n "$ucs" ] && [ -d "$(dirname "$ucs")/ucx" ]; then
  mkdir -p "$out/lib/ucx"
  for p in "$(dirname "$ucs")"/ucx/lib*.so.[0-9]; do cp -L "$p" "$out/lib/ucx/"; done
  copy_libs_of "$out"/lib/ucx/*
fi
# Unpacked here, the programs must find every library in the archive or the system.
mapfile -t elves < <(elf_files "$out"/bin/* "$out"/bench/* "$out"/host/* "$out"/lib/*.so* "$out"/lib/ucx/* \
  "$out"/fallback/*)
unresolved=$(LD_LIBRARY_PATH=$out/lib:$out/lib/ucx:$out/fallback ldd "${elves[@]}" 2>/dev/null | grep 'not found' | sort -u || true)
[ -z "$unresolved" ] || die "some libraries are not found here:
$unresolved"
strip --strip-unneeded "${elves[@]}"

{
  echo "source: $(git -C "$src" describe --always --dirty 2>/dev/null || echo unknown)" \
    "($(git -C "$src" log -1 --format=%cd --date=short 2>/dev/null || echo '?'))"
  echo "packed: $(date -u '+%Y-%m-%d %H:%M UTC') on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "nvcc: $({ nvcc --version || /usr/local/cuda/bin/nvcc --version; } 2>/dev/null | sed -n 's/.*release \([^,]*\),.*/\1/p')"
  echo "gpu_arch: $(meson introspect --buildoptions "$build" | python3 -c '
import json, sys
print(next((o["value"] for o in json.load(sys.stdin) if o["name"] == "gpu_arch"), "?"))')"
  echo "mpich: $(dpkg-query -W -f '${Version}' mpich 2>/dev/null || echo '?')"
} > "$out/build-info.txt"

mkdir -p "$(dirname "$archive")"
rm -f "$archive"
tar -C "$stage" -cf - "$top" | xz -T0 -6 > "$archive"
size=$(stat -c %s "$archive")
if [ "$size" -gt $((max_mib * 1024 * 1024)) ]; then
  rm -f "$archive"
  du -sh "$out"/* >&2
  die "the archive would be $((size / 1024 / 1024)) MiB, over the limit of $max_mib MiB (removed)"
fi
echo "packed $archive: $(awk -v s="$size" 'BEGIN {printf "%.1f", s / 1048576}') MiB" \
  "($(wc -l < "$out/suite.tsv") gpu tests, $(find "$out/bin" -type f | wc -l) programs, $(find "$out/lib" "$out/fallback" -name '*.so*' | wc -l) libraries)"
echo "on the GPU node: tar -xf $(basename "$archive") && cd $top && bash run.sh"
