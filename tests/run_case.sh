#!/usr/bin/env bash
# Runs one doctest case for ctest ("$@": the test executable and its arguments). It passes only
# when the executable exits 0 having run one case, which passed: a name that matched no case
# (doctest then exits 0 having run nothing) fails. A case's "SKIPPED: " line is printed for ctest
# to report the skip. Listing the cases (when ctest discovers them) passes straight through.
case " $* " in *" --list-test-"*) exec "$@" ;; esac
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
[ "$rc" -eq 0 ] || exit "$rc"
if ! grep -Eq 'test cases: +1 \| +1 passed \| +0 failed' <<<"$out"; then
  echo "run_case: this entry ran no test case (its name matched none), or more than one"
  exit 1
fi
