#!/usr/bin/env bash
# What trainkit's libraries export: what the installed headers declare, nothing of the core's
# internals (tk::detail) and nothing of the libraries they link privately (toml++, spdlog, fmt,
# nlohmann-json). Usage: check_exports.sh LIBRARY...
set -euo pipefail
status=0
for lib in "$@"; do
  syms="$(nm -DC --defined-only "$lib")"
  internal="$(grep -E ' tk::detail::' <<<"$syms" || true)"
  private="$(grep -E ' (toml::|spdlog::|fmt::|nlohmann::)' <<<"$syms" || true)"
  echo "$(basename "$lib"): $(grep -c ' tk::' <<<"$syms" || true) tk:: symbols exported;" \
       "$(grep -c . <<<"$internal" || true) of tk::detail, $(grep -c . <<<"$private" || true) of the private libraries"
  if [ -n "$internal" ]; then echo "exported internals:"; head -20 <<<"$internal"; status=1; fi
  if [ -n "$private" ]; then echo "exported symbols of private libraries:"; head -20 <<<"$private"; status=1; fi
done
exit $status
