#!/usr/bin/env bash
# Builds the libFuzzer targets (clang++ with -fsanitize=fuzzer,address,undefined) and runs each
# for a fixed time from its seed corpus. Any crash, sanitizer report or timeout fails the target.
# Usage: tests/fuzz/run.sh [seconds per target, default 20]
# Ends with one line: "fuzz: N passed, N failed" (.ci/run counts it).
set -uo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-${FUZZ_SECONDS:-20}}

source tests/install-deps.sh
flexcomm_install clang-14 libclang-rt-14-dev
cxx=$(command -v clang++-14 || command -v clang++)
# Parsers live beside MPI-facing code (sync.hpp includes the MPI backend): MPICH's flags too.
read -r -a mpi_flags <<< "$(pkg-config --cflags --libs mpich)"

out=build-fuzz
mkdir -p "$out"
passed=0; failed=0
for src in tests/fuzz/*.cpp; do
  name=$(basename "$src" .cpp)
  exe="$out/fuzz_$name"
  if ! "$cxx" -std=c++17 -g -O1 -Wall -Wextra -Werror -fsanitize=fuzzer,address,undefined \
       -fno-sanitize-recover=all -Iinclude "$src" "${mpi_flags[@]}" -o "$exe"; then
    echo "fuzz $name: FAIL (does not build)"; failed=$((failed + 1)); continue
  fi
  # A scratch copy of the seeds: libFuzzer adds what it finds to the corpus it is given.
  corpus="$out/corpus_$name"
  rm -rf "$corpus"; mkdir -p "$corpus"
  [ -d "tests/fuzz/corpus/$name" ] && cp tests/fuzz/corpus/"$name"/* "$corpus"/
  if UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
     "$exe" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
            -artifact_prefix="$out/crash_${name}_" "$corpus" > "$out/$name.log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$out/$name.log" | grep -o '[0-9]*$')
    echo "fuzz $name: PASS (${runs:-?} inputs in ${seconds} s)"; passed=$((passed + 1))
  else
    echo "fuzz $name: FAIL (see $out/$name.log)"; tail -30 "$out/$name.log"; failed=$((failed + 1))
  fi
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
