#!/usr/bin/env bash
# Installs the Debian packages flexcomm's build, tests and examples need, where missing.
# Sourced by tests/run.sh, examples/run.sh and tests/fuzz/run.sh; runnable on its own.
# flexcomm_install PACKAGE...: installs those of the packages that are missing.
flexcomm_install() {
  local p missing=() sudo=""
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing: ${missing[*]}"
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}
# gnuplot-nox: the plots in docs/ (benchmarks/plot_feed_sweep.py, benchmarks/scaling_model.gp).
# libtorch-dev: flexcomm/interop/torch.hpp's test and examples/torch_ensemble (large: it pulls
# OpenCV and FFmpeg libraries in; without it those are left out, torch=auto).
flexcomm_install mpich libmpich-dev libboost-test-dev libboost-program-options-dev meson ninja-build \
                 pkg-config g++ zlib1g-dev libeigen3-dev nlohmann-json3-dev dataset-fashion-mnist \
                 iproute2 gdb cmake make gnuplot-nox libtorch-dev
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
true
