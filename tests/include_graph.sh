#!/usr/bin/env bash
# The include graph of every folder under include/flexcomm, layer by layer:
#   core < backend < patterns < pipeline < interop   (flexcomm.hpp, the umbrella, sits above all)
# - a file includes nothing from a layer above its own;
# - core/ includes no MPI, NCCL or CUDA header;
# - backend/'s top level holds the generic headers (contract, operations, request, arguments),
#   which name no concrete library and include only core/ and one another, and the umbrellas
#   (mpi.hpp, nccl.hpp, staged.hpp), each of which gathers its own folder and nothing else;
# - each backend is whole in its folder, and the folders stand on one another one way:
#     shm/    the shared-memory transport: core/ only, and no MPI; shm/feed/ holds the feeds'
#             shared-memory protocols (host_slots, claim_board, board_courier), generic over B
#     mpi/    all MPI code: shm/ (which it plugs in) and the generic headers
#     cuda/   device buffers, events, kernels and, at its bottom, the device runtime layer
#             (runtime.hpp, runtime_cuda.hpp, reduce_kernels.cuh: the CUDA runtime and NCCL, or
#             the test stand-in); it stands on mpi/ (a rank's GPU by node-local rank)
#     nccl/, staged/   built on mpi/ and cuda/; neither includes the other
#   a folder may include its own files, core/, the generic headers, the folders below it and their
#   umbrellas; within cuda/ the runtime layer includes no other cuda/ file;
# - only cuda/'s runtime layer names CUDA or NCCL headers; mpi/ and nccl/, staged/ may name <mpi.h>;
# - patterns/, pipeline/ and interop/ reach a backend through backend/contract.hpp alone, but for
#   patterns/feed/, which also includes its shared-memory protocols in backend/shm/feed/ (and
#   nothing else of shm/);
# - patterns/feed/, sync/ and collect/ include none of one another.
# The exceptions below are what still breaks a rule, each with its reason; a new one fails.
# Usage: include_graph.sh <include/flexcomm>
set -uo pipefail
root=$(cd "${1:?usage: include_graph.sh <include/flexcomm>}" && pwd)
allowed=(
  # the presets' default Sync backend: `presets<>` means presets<mpi>
  "pipeline/presets.hpp -> backend/mpi.hpp"
  # train_ensemble is a whole job's entry: it starts MPI (environment) and builds the host
  # backend's communicators before any preset is chosen; a module on a GPU gets a device Sync
  # (nccl or staged) on its rank's GPU, made when average_gradients() sees the module's device
  "interop/torch_ensemble.hpp -> backend/mpi.hpp"
  "interop/torch_ensemble.hpp -> backend/mpi/environment.hpp"
  "interop/torch_ensemble.hpp -> backend/cuda/local_device.hpp"
  "interop/torch_ensemble.hpp -> backend/nccl.hpp"
  "interop/torch_ensemble.hpp -> backend/staged.hpp"
  # CUDA tensors: a typed feed's batches land in device memory (cuda::device_batch)
  "interop/torch_cuda.hpp -> backend/cuda/device_batch.hpp"
  "interop/torch_cuda.hpp -> backend/cuda/error.hpp"
)
# What each backend folder stands on besides itself, core/ and the generic headers.
declare -A stands_on=([shm]="" [mpi]="shm" [cuda]="mpi shm" [nccl]="cuda mpi shm" [staged]="cuda mpi shm")
generic="backend/contract.hpp backend/operations.hpp backend/request.hpp backend/arguments.hpp"
umbrellas="backend/mpi.hpp backend/nccl.hpp backend/staged.hpp"
runtime_layer="backend/cuda/runtime.hpp backend/cuda/runtime_cuda.hpp backend/cuda/reduce_kernels.cuh"
in_list() { local x; for x in $2; do [ "$x" = "$1" ] && return 0; done; return 1; }
layer_of() {
  case "$1" in
    core/*) echo 0 ;; backend/*) echo 1 ;; patterns/*) echo 2 ;; pipeline/*) echo 3 ;; interop/*) echo 4 ;;
    *) echo 5 ;;
  esac
}
folder_of() { local d=${1%/*}; [ "$d" = "$1" ] && echo "" || echo "$d"; }
# backend/X/... -> X; backend/X.hpp (an umbrella) -> X
backend_folder_of() { local r=${1#backend/}; r=${r%%/*}; echo "${r%.hpp}"; }
bad=0
complain() {
  local a
  for a in "${allowed[@]}"; do [ "$a" = "$1 -> $2" ] && return; done
  echo "include graph: $1 -> $2: $3"
  bad=1
}
files=0; edges=0
while IFS= read -r path; do
  rel=${path#"$root"/}
  files=$((files + 1))
  layer=$(layer_of "$rel")
  folder=$(folder_of "$rel")
  if [[ $rel == backend/* && $rel != backend/*/* ]] && ! in_list "$rel" "$generic $umbrellas"; then
    echo "include graph: $rel: backend/'s top level holds only the contract, the front end and the umbrellas"
    bad=1
  fi
  while IFS= read -r line; do
    if [[ $line =~ ^#include\ \<(mpi|nccl)\.h\> || $line =~ ^#include\ \<(cuda[a-z0-9_]*)\.h\> ]]; then
      lib=${BASH_REMATCH[1]}
      sys="<$lib.h>"
      case "$rel" in
        core/*) complain "$rel" "$sys" "core/ names no MPI, NCCL or CUDA header" ;;
        backend/shm/*) complain "$rel" "$sys" "the shared-memory transport names no MPI (its set-up comes through the backend)" ;;
        backend/cuda/*) in_list "$rel" "$runtime_layer" || [ "$lib" = mpi ] ||
          complain "$rel" "$sys" "above the device runtime layer, CUDA and NCCL are reached through cuda/runtime.hpp" ;;
        backend/mpi/* | backend/nccl/* | backend/staged/*) [ "$lib" = mpi ] ||
          complain "$rel" "$sys" "only the device runtime layer (cuda/runtime.hpp) names CUDA or NCCL" ;;
        backend/*) complain "$rel" "$sys" "backend/'s top level names no concrete library" ;;
        *) complain "$rel" "$sys" "only backend/ names MPI, NCCL or CUDA" ;;
      esac
      continue
    fi
    [[ $line =~ ^#include\ \"([^\"]+)\" ]] || continue
    target=$(realpath -m "$(dirname "$path")/${BASH_REMATCH[1]}")
    [[ $target == "$root"/* ]] || continue
    to=${target#"$root"/}
    edges=$((edges + 1))
    [ -f "$target" ] || { echo "include graph: $rel -> $to: no such file"; bad=1; continue; }
    to_layer=$(layer_of "$to")
    if [ "$to_layer" -gt "$layer" ]; then
      complain "$rel" "$to" "includes a layer above its own"
      continue
    fi
    to_folder=$(folder_of "$to")
    case "$rel" in
      backend/*/*)
        from=$(backend_folder_of "$rel")
        case "$to" in
          core/*) ;;
          backend/*/* | backend/mpi.hpp | backend/nccl.hpp | backend/staged.hpp)
            dest=$(backend_folder_of "$to")
            if [ "$dest" = "$from" ]; then
              if [[ $from == cuda ]] && in_list "$rel" "$runtime_layer" && ! in_list "$to" "$runtime_layer"; then
                complain "$rel" "$to" "the device runtime layer stands below the rest of cuda/"
              fi
            elif ! in_list "$dest" "${stands_on[$from]-}"; then
              complain "$rel" "$to" "$from/ does not stand on $dest/ (shm < mpi < cuda < nccl, staged)"
            elif [[ $from == cuda ]] && in_list "$rel" "$runtime_layer"; then
              complain "$rel" "$to" "the device runtime layer stands on core/ alone"
            fi ;;
          backend/*)
            if [[ $from == shm ]]; then
              complain "$rel" "$to" "the shared-memory transport stands on core/ alone"
            elif [[ $from == cuda ]] && in_list "$rel" "$runtime_layer"; then
              complain "$rel" "$to" "the device runtime layer stands on core/ alone"
            fi ;;
        esac ;;
      backend/*)
        if in_list "$rel" "$generic"; then
          [[ $to == core/* ]] || in_list "$to" "$generic" ||
            complain "$rel" "$to" "backend/'s generic headers name no concrete backend"
        elif in_list "$rel" "$umbrellas"; then
          [[ $to == backend/$(backend_folder_of "$rel")/* ]] ||
            complain "$rel" "$to" "an umbrella gathers its own folder"
        fi ;;
      patterns/* | pipeline/* | interop/*)
        if [[ $to == backend/shm/feed/* && $rel == patterns/feed/* ]]; then
          :
        elif [[ $to == backend/* && $to != backend/contract.hpp ]]; then
          complain "$rel" "$to" "a concrete backend (include backend/contract.hpp)"
        elif [[ $rel == patterns/*/* && $to == patterns/*/* && $to_folder != "$folder" ]]; then
          complain "$rel" "$to" "feed, sync and collect include none of one another"
        fi ;;
    esac
  done < <(grep -E '^#include ' "$path")
done < <(find "$root" -name '*.hpp' -o -name '*.cuh' | sort)
[ $bad = 0 ] && echo "include graph: $files headers, $edges includes in the tree: layers in order, backend folders one way (shm < mpi < cuda < nccl, staged; cuda's runtime layer at its bottom), backend/ top level generic and umbrellas, patterns/pipeline/interop through contract.hpp (feed/ also shm/feed/), ${#allowed[@]} stated exceptions"
exit $bad
