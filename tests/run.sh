#!/usr/bin/env bash
# Installs what flexcomm's tests need (Debian packages) if missing, configures, builds and runs
# the suites.  Usage: tests/run.sh [plain|asan|tsan] [meson test arguments...]
#   plain  the default build (CUDA code compiled when nvcc and NCCL are present)
#   asan   AddressSanitizer + UndefinedBehaviorSanitizer
#   tsan   ThreadSanitizer
set -euo pipefail
cd "$(dirname "$0")/.."
variant=${1:-plain}
[ $# -gt 0 ] && shift

packages=(mpich libmpich-dev libboost-test-dev libboost-program-options-dev meson ninja-build
          pkg-config g++ zlib1g-dev libeigen3-dev dataset-fashion-mnist nlohmann-json3-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"

case "$variant" in
  plain) options=() ;;
  asan)  options=(-Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled -Dbenchmarks=false) ;;
  tsan)  options=(-Db_sanitize=thread -Db_lundef=false -Dcuda=disabled -Dbenchmarks=false -Dexamples=false) ;;
  *) echo "usage: tests/run.sh [plain|asan|tsan] [meson test arguments...]" >&2; exit 2 ;;
esac
build="build-$variant"
[ "$variant" = plain ] && build=build
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" "${options[@]}"
fi
meson compile -C "$build"
meson test -C "$build" --print-errorlogs "$@"
