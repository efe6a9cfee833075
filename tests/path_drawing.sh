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
# Each path (a line ending in "files...)" opens it) counts from its entry, the unnumbered line
# naming a function of patterns/feed; its numbered hops and the files of entry and hops stay <= 5.
counts=$(sed -n '/<!-- path drawing -->/,/<!-- end of path drawing -->/p' "$doc" | awk '
  / hops over / { if (name != "") print name, hops, files; name = $1; hops = 0; files = 0; delete seen; next }
  name != "" && $1 ~ /^[0-9]+$/ && $2 ~ /\.hpp$/ { hops++; if (!($2 in seen)) { seen[$2] = 1; files++ } next }
  name != "" && $1 ~ /^patterns\/feed\/.*\.hpp$/ { if (!($1 in seen)) { seen[$1] = 1; files++ } }
  END { if (name != "") print name, hops, files }')
while read -r path n f; do
  [ -n "$path" ] || continue
  if [ "$n" -gt 5 ] || [ "$f" -gt 5 ] || [ "$n" -lt 1 ]; then
    echo "path drawing: $path takes $n hops over $f files (at most 5 and 5)"; bad=1
  else
    echo "path drawing: $path $n hops over $f files"
  fi
done <<< "$counts"
[ $bad = 0 ] && echo "path drawing: $hops hops, each file defines its function"
exit $bad
