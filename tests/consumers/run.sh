#!/usr/bin/env bash
# Proves the three ways of using flexcomm from another project: installs flexcomm (meson install)
# into a staging prefix, builds tests/consumers/consumer.cpp with the installed CMake package
# (find_package) and pkg-config file, and as a Meson subproject of the source tree, and runs each
# at 1, 2, 3 and 4 ranks. Prints "consumer X: ok|FAILED (seconds)" per consumer; exits 1 if any failed.
#   tests/consumers/run.sh [WORK_DIR]   (default build-consumers; emptied first)
# The consumers use the MPI that the installed flexcomm.pc names (mpich, or Open MPI's ompi*),
# with that MPI's own compiler wrapper and launcher, whatever Debian's mpi alternative points at.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-$root/build-consumers}
rm -rf "$work" && mkdir -p "$work" || exit 1
work=$(cd "$work" && pwd)
prefix=$work/staging
failed=0

# Runs a named step quietly, its output kept in $work/NAME.log and shown when it fails.
step() {
  local name=$1; shift
  if "$@" >>"$work/$name.log" 2>&1; then return 0; fi
  echo "--- $name: '$*' failed; its log ($work/$name.log) ends:"
  tail -n 40 "$work/$name.log"
  return 1
}

# flexcomm itself: nothing to compile, only headers and the package files to install.
if ! step install meson setup "$work/flexcomm-build" "$root" --prefix "$prefix" -Dtests=false -Dexamples=false \
       -Dbenchmarks=false -Dcuda=disabled ||
   ! step install meson install -C "$work/flexcomm-build"; then
  echo "consumer install: FAILED"
  exit 1
fi
export PKG_CONFIG_PATH=$prefix/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}

case "$(pkg-config --print-requires flexcomm)" in
  *mpich*) mpicxx=mpicxx.mpich; mpiexec=mpiexec.mpich ;;
  *ompi*) mpicxx=mpicxx.openmpi; mpiexec=mpiexec.openmpi ;;
  *) mpicxx=mpicxx; mpiexec=mpiexec ;;
esac
command -v "$mpicxx" >/dev/null || mpicxx=mpicxx
command -v "$mpiexec" >/dev/null || mpiexec=mpiexec
launch=("$mpiexec")
# Open MPI refuses root and more ranks than cores unless told.
case "$("$mpiexec" --version 2>&1)" in
  *"Open MPI"*|*OpenRTE*) launch+=(--oversubscribe); [ "$(id -u)" -eq 0 ] && launch+=(--allow-run-as-root) ;;
esac

# Runs a consumer at each rank count, telling it how many ranks it must find.
run_at_each_size() {  # NAME PROGRAM
  local n
  for n in 1 2 3 4; do step "$1" "${launch[@]}" -n "$n" "$2" "$n" || return 1; done
}

started=$SECONDS
report() {  # report NAME STATUS: one line, with the seconds since the last one
  local took="($((SECONDS - started)) s)"
  started=$SECONDS
  if [ "$2" -eq 0 ]; then echo "consumer $1: ok $took"; else echo "consumer $1: FAILED $took"; failed=1; fi
}

# What is installed is the library: no test double (the device stand-in lives in tests/standin)
# and nothing a consumer's include path could pick up by mistake.
installed_tests=$(cd "$prefix" && find . -path '*standin*' -o -path '*/tests/*' -o -name '*fixture*')
if [ -n "$installed_tests" ]; then
  echo "--- installed: test files under $prefix:"; echo "$installed_tests"
  report installed-headers 1
else
  report installed-headers 0
fi

# The three consumers build at once (three compiles of flexcomm.hpp: on CI's two cores this halves
# the test's time), then each runs at every size.
# CMake: find_package(flexcomm) through CMAKE_PREFIX_PATH.
build_cmake() {
  step cmake cmake -S "$root/tests/consumers/cmake" -B "$work/cmake" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
       -DMPI_CXX_COMPILER="$(command -v "$mpicxx")" &&
  step cmake cmake --build "$work/cmake"
}
# pkg-config: a plain Makefile, `pkg-config --cflags --libs flexcomm`.
build_pkgconfig() {
  mkdir -p "$work/pkgconfig" && (cd "$work/pkgconfig" && step pkgconfig make -f "$root/tests/consumers/pkgconfig/Makefile")
}
# Meson: the consumer's tree beside a subprojects/flexcomm link to this source tree; the
# subproject is used even where an installed flexcomm.pc could be found.
build_meson() {
  cp -r "$root/tests/consumers" "$work/src" && mkdir -p "$work/src/meson/subprojects" &&
  ln -s "$root" "$work/src/meson/subprojects/flexcomm" &&
  step meson meson setup "$work/meson" "$work/src/meson" --force-fallback-for=flexcomm &&
  step meson meson compile -C "$work/meson"
}
declare -A builder=()
for name in cmake pkgconfig meson; do
  "build_$name" &
  builder[$name]=$!
done
for name in cmake pkgconfig meson; do
  program=$work/$name/consumer
  wait "${builder[$name]}" && run_at_each_size "$name" "$program"
  report "$name" $?
done

exit $failed
