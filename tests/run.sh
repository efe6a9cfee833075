#!/usr/bin/env bash
# Installs what flexcomm's tests need (Debian packages) if missing, configures, builds and runs
# the suites.  Usage: tests/run.sh [plain|openmpi|asan|tsan] [--build-only [--for-tests] | meson test arguments...]
#   plain    the default build (CUDA code compiled when nvcc and NCCL are present), on MPICH; the
#            fault rows at 4 ranks (asan runs them at 2, openmpi and tsan at 3: each row at 2, 3 and 4)
#   openmpi  the same on Debian's Open MPI (installed beside MPICH), MPI tests at 1-4 ranks, the
#            fault rows at 3 (what differs there is the launcher and its abort, not the count); the
#            cluster suite runs each binary once per layout, its short cases only (the plain build
#            runs each 20 times, 10 per layout, the first whole: MPICH's finalize hang needs the
#            repeats)
#   asan   AddressSanitizer + UndefinedBehaviorSanitizer
#   tsan   ThreadSanitizer
#            (both: the MPI suites at 1-4 ranks, the fault rows at 2 (asan) or 3 (tsan); examples not built, since the
#            examples' runs are plain-build tests)
set -euo pipefail
cd "$(dirname "$0")/.."
variant=${1:-plain}
[ $# -gt 0 ] && shift

source tests/install-deps.sh
[ "$variant" = openmpi ] && flexcomm_install openmpi-bin libopenmpi-dev

# Sanitizer builds: no optimization and line tables only compile 5x faster than -O2 -g (CI has
# two cores), and keep file:line in the reports.
sanitized=(-Doptimization=0 -Ddebug=false -Dcpp_args=-g1)
case "$variant" in
  plain) options=() ;;
  openmpi) options=(-Dmpi=openmpi -Dcuda=disabled -Dtorch=disabled -Dbenchmarks=false -Dcluster_repeat=1 -Dcluster_whole_first=false -Dfault_ranks=3) ;;
  asan)  options=("${sanitized[@]}" -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled -Dbenchmarks=false -Dexamples=false -Dfault_ranks=2) ;;
  tsan)  options=("${sanitized[@]}" -Db_sanitize=thread -Db_lundef=false -Dcuda=disabled -Dbenchmarks=false -Dexamples=false -Dfault_ranks=3) ;;
  *) echo "usage: tests/run.sh [plain|openmpi|asan|tsan] [meson test arguments...]" >&2; exit 2 ;;
esac
build="build-$variant"
[ "$variant" = plain ] && build=build
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" "${options[@]}"
fi
if [ "${1:-}" = --build-only ] && [ "${2:-}" = --for-tests ]; then
  # Only what the tests run, but the benchmarks' command lines (suite benchmarks): CI compiles the
  # rest (the benchmarks, the CUDA-only programs: half the build) at idle priority later (.ci/run).
  mapfile -t targets < <(python3 - "$build" <<'PY'
import json, os, subprocess, sys
build = sys.argv[1]
ask = lambda what: json.loads(subprocess.check_output(["meson", "introspect", build, what]))
benchmarks = lambda test: any(suite.split(":")[-1] == "benchmarks" for suite in test["suite"])  # project:suite
needed = {d for test in ask("--tests") if not benchmarks(test) for d in test["depends"]}
for target in ask("--targets"):
    if target["id"] in needed:
        print(*(os.path.relpath(f, build) for f in target["filename"]), sep="\n")
PY
)
  ninja -C "$build" "${targets[@]}"
  exit 0
fi
# The whole suite and --build-only build everything, the CUDA benchmarks too (they must compile
# wherever nvcc is); chosen tests (meson test arguments) build what they need, as meson test does.
if [ $# -eq 0 ] || [ "$1" = --build-only ]; then
  meson compile -C "$build"
fi
[ "${1:-}" = --build-only ] && exit 0
# The compiler's verdict on misuse does not depend on the MPI library: checked on MPICH only.
[ "$variant" = openmpi ] && [ $# -eq 0 ] && set -- --no-suite compile_fail
meson test -C "$build" --print-errorlogs "$@"
