#!/usr/bin/env bash
# Installs every Debian 12 package trainkit needs to build, test and run. Safe to run twice.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libopenblas0-pthread libjemalloc2
  libboost-dev libboost-filesystem-dev zlib1g-dev
  libtomlplusplus-dev libspdlog-dev libfmt-dev doctest-dev libgloo-dev libcli11-dev nlohmann-json3-dev
  libsentencepiece-dev libpcre2-dev
  python3 python3-torch python3-sentencepiece python3-regex
  chromium
  valgrind
  dataset-fashion-mnist fortunes
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo > /dev/null 2>&1; then
    echo "setup: ${#missing[@]} packages are missing and installing them needs root; this user is not root and" >&2
    echo "setup: there is no sudo. As root, run:" >&2
    echo "  apt-get update && apt-get install -y --no-install-recommends ${missing[*]}" >&2
    echo "setup: then run this command again." >&2
    exit 1
  fi
  SUDO="sudo"
fi
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
