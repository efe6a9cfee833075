#!/usr/bin/env bash
# Keeps docs/architecture.md's drawing of a batch's paths true: every hop it names between the
# markers <!-- path drawing --> and <!-- end of path drawing --> as `file function` (a file under
# include/flexcomm, a function as class::name or name) must be a file that defines that function.
# Usage: path_drawing.sh <source root>
set -uo pipefail
root=${1:?usage: path_drawing.sh <source root>}
doc="$root/docs/architecture.md"
inc="$root/include/flexcomm"
bad=0; hops=0
while read -r file fn; do
  hops=$((hops + 1))
  if [ ! -f "$inc/$file" ]; then echo "path drawing: $file: no such file under include/flexcomm"; bad=1; continue; fi
  name=${fn##*::}
  if ! grep -Eq "(^|[^A-Za-z0-9_])${name}[[:space:]]*\(" "$inc/$file"; then
    echo "path drawing: $file does not define $fn"; bad=1
  fi
done < <(sed -n '/<!-- path drawing -->/,/<!-- end of path drawing -->/p' "$doc" |
         grep -oE '[a-z_]+/[a-z_/]+\.hpp +[A-Za-z_:~<>]+' | sed -E 's/ +/ /')
[ "$hops" -gt 0 ] || { echo "path drawing: no hops found between the markers in docs/architecture.md"; exit 1; }
[ $bad = 0 ] && echo "path drawing: $hops hops, each file defines its function"
exit $bad
