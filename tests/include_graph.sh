#!/usr/bin/env bash
# The include graph of every folder under include/flexcomm, layer by layer:
#   core < backend < patterns < pipeline < interop   (flexcomm.hpp, the umbrella, sits above all)
# - a file includes nothing from a layer above its own;
# - core/ includes no MPI, NCCL or CUDA header;
# - no backend folder (mpi/, nccl/, staged/) includes another's files: what they share lives in
#   backend/ itself (the MPI side every backend has: mpi_*.hpp, call_check.hpp), or in the layers
#   they stand on: device/ and cuda/ (nccl, staged) and shm/, the shared-memory transport, which
#   names no MPI at all; backend/'s generic headers (contract, operations, request, arguments)
#   name no concrete library;
# - patterns/, pipeline/ and interop/ reach a backend through backend/contract.hpp alone;
# - patterns/feed/, sync/ and collect/ include none of one another.
# The exceptions below are what still breaks a rule, each with its reason; a new one fails.
# Usage: include_graph.sh <include/flexcomm>
set -uo pipefail
root=$(cd "${1:?usage: include_graph.sh <include/flexcomm>}" && pwd)
allowed=(
  # the presets' default Sync backend: `presets<>` means presets<mpi>
  "pipeline/presets.hpp -> backend/mpi.hpp"
  # train_ensemble is a whole job's entry: it starts MPI (environment) and builds the host
  # backend's communicators before any preset is chosen
  "interop/torch_ensemble.hpp -> backend/mpi.hpp"
  "interop/torch_ensemble.hpp -> backend/mpi/environment.hpp"
)
layer_of() {
  case "$1" in
    core/*) echo 0 ;; backend/*) echo 1 ;; patterns/*) echo 2 ;; pipeline/*) echo 3 ;; interop/*) echo 4 ;;
    *) echo 5 ;;
  esac
}
folder_of() { local d=${1%/*}; [ "$d" = "$1" ] && echo "" || echo "$d"; }
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
  while IFS= read -r line; do
    if [[ $line =~ ^#include\ \<(mpi|nccl)\.h\> || $line =~ ^#include\ \<(cuda[a-z_]*)\.h\> ]]; then
      sys="<${BASH_REMATCH[1]}.h>"
      case "$rel" in
        core/*) complain "$rel" "$sys" "core/ names no MPI, NCCL or CUDA header" ;;
        backend/shm/*) complain "$rel" "$sys" "the shared-memory transport names no MPI (its set-up comes through the backend)" ;;
        backend/*/*) ;;
        backend/contract.hpp | backend/operations.hpp | backend/request.hpp | backend/arguments.hpp)
          complain "$rel" "$sys" "backend/'s generic headers name no concrete library" ;;
        backend/*) ;;
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
        case "$to" in
          backend/"${folder#backend/}"/* | core/*) ;;
          backend/device/* | backend/cuda/* | backend/shm/*)
            [[ $rel == backend/shm/* ]] && complain "$rel" "$to" "the shared-memory transport stands on no other layer" ;;
          backend/*/*) complain "$rel" "$to" "another backend's internals (move what they share up to backend/)" ;;
          backend/mpi*.hpp | backend/call_check.hpp | backend/nccl.hpp | backend/staged.hpp)
            [[ $rel == backend/shm/* ]] && complain "$rel" "$to" "the shared-memory transport names no MPI" ;;
        esac ;;
      backend/*)
        case "$to" in
          backend/*/*) [[ $rel == backend/mpi.hpp || $rel == backend/nccl.hpp || $rel == backend/staged.hpp ]] ||
            complain "$rel" "$to" "backend/'s shared headers stand below every backend folder" ;;
          backend/mpi*.hpp | backend/call_check.hpp)
            case "$rel" in backend/contract.hpp | backend/operations.hpp | backend/request.hpp | backend/arguments.hpp)
              complain "$rel" "$to" "backend/'s generic headers name no concrete library" ;;
            esac ;;
        esac ;;
      patterns/* | pipeline/* | interop/*)
        if [[ $to == backend/* && $to != backend/contract.hpp ]]; then
          complain "$rel" "$to" "a concrete backend (include backend/contract.hpp)"
        elif [[ $rel == patterns/*/* && $to == patterns/*/* && $to_folder != "$folder" ]]; then
          complain "$rel" "$to" "feed, sync and collect include none of one another"
        fi ;;
    esac
  done < <(grep -E '^#include ' "$path")
done < <(find "$root" -name '*.hpp' -o -name '*.cuh' | sort)
[ $bad = 0 ] && echo "include graph: $files headers, $edges includes in the tree: layers in order, no backend in another's internals, patterns/pipeline/interop through contract.hpp, ${#allowed[@]} stated exceptions"
exit $bad
