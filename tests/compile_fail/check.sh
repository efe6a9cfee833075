#!/usr/bin/env bash
# A compile-failure test (as KaMPIng has them): the snippet must compile with -DFLEXCOMM_CONTROL
# (so the failure below is the misuse, not a broken snippet), and must fail without it with
# a diagnostic that contains the expected text (so it is our static_assert that stops it).
# Usage: check.sh <expected text> <snippet> <compiler and flags...>
set -uo pipefail
expected=$1 snippet=$2
shift 2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$@" -fsyntax-only -DFLEXCOMM_CONTROL "$snippet" >"$log" 2>&1; then
  echo "FAIL: the control version of $snippet does not compile:"; head -40 "$log"; exit 1
fi
if "$@" -fsyntax-only "$snippet" >"$log" 2>&1; then
  echo "FAIL: $snippet compiled, expected a failure saying: $expected"; exit 1
fi
if ! grep -qF -- "$expected" "$log"; then
  echo "FAIL: $snippet failed to compile, but without saying: $expected"; head -40 "$log"; exit 1
fi
echo "ok: $snippet fails with: $expected"
