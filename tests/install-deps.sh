#!/usr/bin/env bash
# Installs the Debian packages flexcomm's build, tests and examples need, where missing.
# Sourced by tests/run.sh and examples/run.sh; runnable on its own.
flexcomm_packages=(mpich libmpich-dev libboost-test-dev libboost-program-options-dev meson ninja-build
                   pkg-config g++ zlib1g-dev libeigen3-dev nlohmann-json3-dev dataset-fashion-mnist)
flexcomm_missing=()
for p in "${flexcomm_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || flexcomm_missing+=("$p")
done
if [ ${#flexcomm_missing[@]} -gt 0 ]; then
  echo "installing: ${flexcomm_missing[*]}"
  flexcomm_sudo=""; [ "$(id -u)" -eq 0 ] || flexcomm_sudo=sudo
  $flexcomm_sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $flexcomm_sudo apt-get install -y -qq "${flexcomm_missing[@]}" >/dev/null
fi
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
true
