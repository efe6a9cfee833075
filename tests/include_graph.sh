#!/usr/bin/env bash
# The layers' include graph: core/ includes no backend (and no MPI, NCCL or CUDA header);
# patterns/ and pipeline/ reach the backends through backend/contract.hpp. The exceptions below
# are what still names a concrete backend, each with its reason; a new one fails this check.
# Usage: include_graph.sh <include/flexcomm>
set -uo pipefail
root=${1:?usage: include_graph.sh <include/flexcomm>}
allowed=(
  # the presets' default Sync backend
  "pipeline/presets.hpp:mpi.hpp"
)
bad=0
for f in "$root"/core/*.hpp; do
  while IFS= read -r line; do
    echo "core includes a backend: ${f#"$root"/}: $line"; bad=1
  done < <(grep -E '^#include (".*backend/|<(mpi|nccl)\.h>|<cuda)' "$f")
done
for f in "$root"/patterns/*.hpp "$root"/pipeline/*.hpp; do
  rel=${f#"$root"/}
  while IFS= read -r line; do
    header=$(sed -E 's/^#include [<"](.*backend\/)?([^">]*)[">].*/\2/' <<<"$line")
    [ "$header" = contract.hpp ] && continue
    ok=0
    for a in "${allowed[@]}"; do [ "$a" = "$rel:$header" ] && ok=1; done
    [ $ok = 1 ] || { echo "$rel includes a concrete backend: $line (include backend/contract.hpp)"; bad=1; }
  done < <(grep -E '^#include (".*backend/|<(mpi|nccl)\.h>|<cuda)' "$f")
done
[ $bad = 0 ] && echo "include graph: core/ includes no backend; patterns/ and pipeline/ only contract.hpp and ${#allowed[@]} stated exceptions"
exit $bad
