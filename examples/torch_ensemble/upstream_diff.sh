#!/usr/bin/env bash
# The port measured against upstream's own file, which this tree does not hold as it is
# upstream (it commits no other project's file verbatim): pytorch/examples' cpp/mnist/mnist.cpp
# at commit 29a38c6, downloaded by the reader (mnist.cpp here is its adaptation for CI). Prints
# the unified diff from it to mnist.cpp (what CI changed: flags, sizes, 120 columns, the
# training set read first) and the counts of that diff and of the one to the port.
#   curl -LO https://raw.githubusercontent.com/pytorch/examples/29a38c6c441c3969d9f48b7ffe25a42b4599d80a/cpp/mnist/mnist.cpp
#   examples/torch_ensemble/upstream_diff.sh mnist.cpp
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
upstream=${1:?usage: upstream_diff.sh PATH-TO-UPSTREAM-mnist.cpp}
want=8b169c0774d93c5125bcfbfcc3c6ce4f5116c21a9fdb6ae86fd88d83455b92a4
have=$(sha256sum "$upstream" | cut -d' ' -f1)
[ "$have" = "$want" ] || { echo "upstream_diff.sh: $upstream is not upstream's file at 29a38c6 (sha256 $have)" >&2; exit 1; }
diff -u --label upstream/mnist.cpp --label mnist.cpp "$upstream" "$here/mnist.cpp" || true
for file in mnist.cpp mnist_ensemble.cpp; do
  read -r added removed _ < <(git diff --no-index --numstat "$upstream" "$here/$file" || true)
  echo "upstream to $file: $added added, $removed removed ($((added + removed)) changed)"
done
