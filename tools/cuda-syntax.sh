#!/usr/bin/env bash
# tools/cuda-syntax.sh BUILD_DIR [CACHE_DIR]
#
# Compiles every source file of core/, plugins/ and tools/ as a CUDA build of trainkit would
# (-DTK_WITH_CUDA), with -fsyntax-only, on a machine without CUDA: the code inside
# `#if defined(TK_WITH_CUDA)` is checked on every CI run, not only on a GPU machine.
#
# What it needs besides the build's own flags (BUILD_DIR/compile_commands.json):
# - the CUDA headers (cuda_runtime_api.h, driver_types.h, ...), from Debian's non-free package
#   nvidia-cuda-dev, fetched once with `apt-get download` under a private sources list and private
#   apt state (nothing is installed, the machine's apt configuration is left as it is) and unpacked
#   (its usr/include only, ~14 MiB) into CACHE_DIR (default BUILD_DIR/cuda-headers), reused after;
# - c10/cuda/impl/cuda_cmake_macros.h, which PyTorch generates at build time and Debian's
#   libtorch-dev leaves out: a one-line stand-in in CACHE_DIR/stand-in.
# The c10/cuda and ATen/cuda headers come with libtorch-dev.
#
# USE_C10D_NCCL (the NCCL branch of plugins/ddp) is defined only where nccl.h is found.
# The precompiled-header flags of the build are dropped: the precompiled LibTorch headers were made
# without TK_WITH_CUDA, and a header already in them would not be read again.
#
# Exit status: 0 all files compile, 1 a file failed (or a source file is missing from
# compile_commands.json), 2 a usage or configuration error, 77 the headers could not be fetched
# (no apt-get, no network, no non-free component on the mirror): ctest reports it as skipped.
#
# Environment:
#   TK_CUDA_MIRROR    Debian mirror to fetch from (default: the one in the machine's apt sources)
#   TK_CUDA_SUITE     Debian suite (default: VERSION_CODENAME of /etc/os-release)
#   TK_CUDA_PACKAGES  packages to fetch (default: nvidia-cuda-dev)
#   TK_CUDA_SYNTAX_JOBS  parallel compilers (default and maximum: nproc)
set -euo pipefail

usage() { echo "usage: $0 BUILD_DIR [CACHE_DIR]" >&2; exit 2; }
[[ $# -ge 1 && $# -le 2 ]] || usage
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ -d "$1" ]] || { echo "cuda-syntax: no build folder $1" >&2; exit 2; }
build="$(cd "$1" && pwd)"
cache="${2:-$build/cuda-headers}"
db="$build/compile_commands.json"
[[ -f "$db" ]] || { echo "cuda-syntax: $db not found (configure with bash tools/build.sh first)" >&2; exit 2; }
command -v python3 >/dev/null || { echo "cuda-syntax: python3 is needed" >&2; exit 2; }

skip() { echo "cuda-syntax: SKIPPED: $*" >&2; exit 77; }

mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
headers="$cache/usr/include"
standin="$cache/stand-in"

# ---------------------------------------------------------------------------------------------
# The headers, once.
fetch_headers() {
  command -v apt-get >/dev/null || skip "apt-get not found (the CUDA headers come from Debian's nvidia-cuda-dev)"
  command -v dpkg-deb >/dev/null || skip "dpkg-deb not found"
  local suite="${TK_CUDA_SUITE:-}"
  if [[ -z "$suite" && -r /etc/os-release ]]; then
    suite="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
  fi
  [[ -n "$suite" ]] || skip "no Debian suite (set TK_CUDA_SUITE)"

  # One deb822 stanza: the first mirror of the machine's sources that serves the suite itself
  # (not -security), with its -updates suite if the sources name it too.
  local sources
  sources="$(TK_SUITE="$suite" python3 - <<'EOF'
import glob, os, re
suite = os.environ["TK_SUITE"]
mirror = os.environ.get("TK_CUDA_MIRROR", "").strip()
keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
entries = []  # (uri, suites, signed_by)
def add(uri, suites, signed):
    entries.append((uri.rstrip("/"), suites, signed))
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        line = line.split("#", 1)[0].strip()
        m = re.match(r"deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
        if m:
            opts = m.group(1) or ""
            s = re.search(r"signed-by=(\S+?)\s*(\]|$|\s)", opts)
            add(m.group(2), [m.group(3)], s.group(1) if s else "")
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    try:
        text = open(path).read()
    except OSError:
        continue
    for stanza in re.split(r"\n\s*\n", text):
        fields = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.strip()
        if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", "").split():
            continue
        for uri in fields.get("uris", "").split():
            add(uri, fields.get("suites", "").split(), fields.get("signed-by", ""))
if mirror:
    uri, suites, signed = mirror.rstrip("/"), [suite], ""
else:
    picked = [e for e in entries if suite in e[1]]
    if not picked:
        raise SystemExit(0)
    uri, _, signed = picked[0]
    suites = [suite] + [suite + "-updates"] * any(
        e[0] == uri and suite + "-updates" in e[1] for e in entries)
if not signed and os.path.exists(keyring):
    signed = keyring
print("Types: deb")
print("URIs: " + uri)
print("Suites: " + " ".join(suites))
print("Components: main contrib non-free non-free-firmware")
if signed and "\n" not in signed:
    print("Signed-By: " + signed)
EOF
)"
  [[ -n "$sources" ]] || skip "no Debian mirror for '$suite' in /etc/apt/sources.list* (set TK_CUDA_MIRROR)"
  local mirror suites
  mirror="$(sed -n 's/^URIs: //p' <<<"$sources")"
  suites="$(sed -n 's/^Suites: //p' <<<"$sources")"

  local tmp="$cache/.fetch"
  rm -rf "$tmp"
  mkdir -p "$tmp/etc" "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/debs"
  printf '%s\n' "$sources" >"$tmp/etc/cuda.sources"
  local apt=(-o "Dir::Etc::sourcelist=$tmp/etc/cuda.sources" -o "Dir::Etc::sourceparts=-"
    -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o "APT::Get::List-Cleanup=0")
  # As root apt hands the download to the _apt user, which cannot write into this folder.
  [[ $(id -u) -eq 0 ]] && apt+=(-o "APT::Sandbox::User=root")
  echo "cuda-syntax: fetching ${TK_CUDA_PACKAGES:-nvidia-cuda-dev} from $mirror ($suites, non-free)"
  if ! apt-get "${apt[@]}" -q update >"$tmp/update.log" 2>&1 || grep -q '^[WE]: Failed to fetch' "$tmp/update.log"; then
    sed 's/^/  /' "$tmp/update.log" | grep -E '^  (E|W|Err):' | head -5 >&2 || true
    rm -rf "$tmp"
    skip "apt-get update of $mirror $suites (non-free) failed: no network or no such mirror"
  fi
  local packages
  read -r -a packages <<<"${TK_CUDA_PACKAGES:-nvidia-cuda-dev}"
  if ! (cd "$tmp/debs" && apt-get "${apt[@]}" -q download "${packages[@]}") >"$tmp/download.log" 2>&1; then
    sed 's/^/  /' "$tmp/download.log" | grep -E '^  (E|W|Err):' | head -5 >&2 || true
    rm -rf "$tmp"
    skip "apt-get download ${packages[*]} from $mirror failed (is non-free on the mirror?)"
  fi
  local deb unpacked="$tmp/root"
  mkdir -p "$unpacked"
  for deb in "$tmp"/debs/*.deb; do
    # Only usr/include: the whole of nvidia-cuda-dev unpacks to 2.8 GB of libraries.
    if ! dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$unpacked" --wildcards './usr/include/*' 2>/dev/null; then
      rm -rf "$tmp"
      skip "could not unpack $(basename "$deb")"
    fi
  done
  local h
  for h in cuda_runtime_api.h driver_types.h cuda.h; do
    [[ -f "$unpacked/usr/include/$h" ]] || { rm -rf "$tmp"; skip "${packages[*]} has no $h"; }
  done
  rm -rf "$cache/usr"
  mv "$unpacked/usr" "$cache/usr"
  # name version (architecture), from the .deb file names (apt writes an epoch's colon as %3a).
  (cd "$tmp/debs" && for deb in *.deb; do
     IFS=_ read -r name version arch <<<"${deb%.deb}"
     echo "$name ${version//%3a/:} ($arch)"
   done) >"$cache/PACKAGES.tmp"
  echo "mirror $mirror $suites" >>"$cache/PACKAGES.tmp"
  rm -rf "$tmp"
  mv "$cache/PACKAGES.tmp" "$cache/PACKAGES"  # last: the cache is complete
}

exec 9>"$cache/.lock"
command -v flock >/dev/null && flock 9  # two runs on one cache fetch once
if [[ -f "$cache/PACKAGES" && -f "$headers/cuda_runtime_api.h" ]]; then
  echo "cuda-syntax: CUDA headers in $cache (cached)"
else
  t0=$SECONDS
  fetch_headers
  echo "cuda-syntax: fetched and unpacked in $((SECONDS - t0))s into $cache"
fi
exec 9>&-
grep -v '^mirror ' "$cache/PACKAGES" | sed 's/^/cuda-syntax: package /'

# PyTorch's build generates this header from cuda_cmake_macros.h.in (one #cmakedefine); LibTorch
# is a shared library, so the macro is defined. CUDAMacros.h reads it on Windows only.
mkdir -p "$standin/c10/cuda/impl"
echo '#define C10_CUDA_BUILD_SHARED_LIBS' >"$standin/c10/cuda/impl/cuda_cmake_macros.h"

# ---------------------------------------------------------------------------------------------
# One command per source file of core/, plugins/ and tools/, from compile_commands.json.
work="$(mktemp -d "${TMPDIR:-/tmp}/cuda-syntax.XXXXXX")"
trap 'rm -rf "$work"' EXIT
logs="$build/cuda-syntax-logs"
rm -rf "$logs"
mkdir -p "$logs"

TK_ROOT="$root" TK_BUILD="$build" TK_DB="$db" TK_WORK="$work" TK_HEADERS="$headers" TK_STANDIN="$standin" \
python3 - <<'EOF'
import json, os, shlex, subprocess, sys
root, build, work = os.environ["TK_ROOT"], os.environ["TK_BUILD"], os.environ["TK_WORK"]
headers, standin = os.environ["TK_HEADERS"], os.environ["TK_STANDIN"]
real = os.path.realpath

# Every source file of the three folders (the build folder excepted, wherever it is).
sources = []
for top in ("core", "plugins", "tools"):
    for d, dirs, files in os.walk(os.path.join(root, top)):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and real(os.path.join(d, x)) != real(build))
        sources += [os.path.join(d, f) for f in sorted(files) if f.endswith((".cpp", ".cc", ".cxx"))]

entries = {}
for e in json.load(open(os.environ["TK_DB"])):
    path = real(os.path.join(e["directory"], e["file"]))
    entries.setdefault(path, []).append(e)

def syntax_only(e, src):
    args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    if os.path.basename(args[0]) in ("ccache", "sccache"):
        args = args[1:]
    out, i = [args[0]], 1
    while i < len(args):
        a = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else ""
        if a in ("-o", "-MF", "-MT", "-MQ"):
            i += 2; continue
        if a == "-include" and nxt.endswith(("cmake_pch.hxx", "cmake_pch.h")):
            i += 2; continue
        if a in ("-c", "-Winvalid-pch", "-MD", "-MMD", "-fpch-preprocess") or a.startswith(("-MF", "-MT", "-MQ")) \
                or (a.startswith("-o") and len(a) > 2):
            i += 1; continue
        if real(os.path.join(e["directory"], a)) == src:
            i += 1; continue
        out.append(a); i += 1
    return out + ["-DTK_WITH_CUDA", "-fsyntax-only", "-isystem", headers, "-isystem", standin]

# NCCL's header: only then is the NCCL branch of the ddp plugin compiled.
nccl = False
first = next((v[0] for v in entries.values()), None)
if first is not None:
    cc = syntax_only(first, "")[0]
    probe = subprocess.run([cc, "-x", "c++", "-fsyntax-only", "-isystem", headers, "-"],
                           input=b"#include <nccl.h>\n", capture_output=True)
    nccl = probe.returncode == 0
print("cuda-syntax: USE_C10D_NCCL " + ("defined (nccl.h found)" if nccl else "not defined (no nccl.h)"))

with open(os.path.join(work, "list"), "w") as listing:
    for n, path in enumerate(sources):
        rel = os.path.relpath(path, root)
        job = os.path.join(work, "%03d" % n)
        with open(job + ".name", "w") as f:
            f.write(rel)
        found = entries.get(real(path), [])
        # JOB.sh: with TK_WITH_CUDA; JOB.cpu.sh: the same without it, run only when JOB.sh
        # failed, to tell an error of the CUDA code from one that the CPU build has too.
        for suffix, cuda in ((".sh", True), (".cpu.sh", False)):
            lines = ["set -u"]
            if not found:
                lines.append("echo 'error: not in compile_commands.json (not part of the build: reconfigure, or add it to a target)'; exit 3")
            for e in found:
                cmd = syntax_only(e, real(path))
                if not cuda:
                    cmd.remove("-DTK_WITH_CUDA")
                if nccl and cuda:
                    cmd.append("-DUSE_C10D_NCCL")
                cmd.append(path)
                lines.append("(cd %s && %s) || exit 1" % (shlex.quote(e["directory"]), shlex.join(cmd)))
            with open(job + suffix, "w") as f:
                f.write("\n".join(lines) + "\n")
        listing.write(job + "\n")
EOF

nfiles=$(wc -l <"$work/list")
[[ $nfiles -gt 0 ]] || { echo "cuda-syntax: no source files under core/, plugins/, tools/ of $root" >&2; exit 2; }
jobs=$(nproc)
if [[ -n "${TK_CUDA_SYNTAX_JOBS:-}" && "${TK_CUDA_SYNTAX_JOBS}" -lt $jobs ]]; then jobs=$TK_CUDA_SYNTAX_JOBS; fi
[[ $jobs -ge 1 ]] || jobs=1
echo "cuda-syntax: $nfiles files, $jobs at a time"

t0=$SECONDS
# Each job: its compiler output in JOB.log, its status in JOB.rc, its seconds in JOB.time; when it
# failed, the status without TK_WITH_CUDA in JOB.cpu.rc.
cat >"$work/worker.sh" <<'WORKER'
s=$SECONDS
bash "$1.sh" >"$1.log" 2>&1
rc=$?
echo $rc >"$1.rc"
echo $((SECONDS - s)) >"$1.time"
if [[ $rc -eq 1 ]]; then
  bash "$1.cpu.sh" >/dev/null 2>&1
  echo $? >"$1.cpu.rc"
fi
WORKER
xargs -d '\n' -P "$jobs" -n 1 bash "$work/worker.sh" <"$work/list"

failed=0
while read -r job; do
  name="$(cat "$job.name")"
  cp "$job.log" "$logs/$(tr / _ <<<"$name").log"
  if [[ "$(cat "$job.rc")" == 0 ]]; then
    warnings=$(grep -c 'warning:' "$job.log" || true)
    if [[ $warnings -gt 0 ]]; then
      echo "ok      $name ($(cat "$job.time")s, $warnings warnings)"
    else
      echo "ok      $name ($(cat "$job.time")s)"
    fi
  else
    failed=$((failed + 1))
    case "$(cat "$job.cpu.rc" 2>/dev/null)" in
      0) echo "FAILED  $name (only with TK_WITH_CUDA: the CPU build compiles it)" ;;
      1) echo "FAILED  $name (without TK_WITH_CUDA too: not an error of the CUDA code)" ;;
      *) echo "FAILED  $name" ;;
    esac
    # The first error and the lines after it (the notes that explain it).
    if grep -q 'error:' "$job.log"; then
      awk '/error:/ && !seen { seen = 1 } seen && n < 8 { print "          " $0; n++ }' "$job.log"
    else
      tail -n 8 "$job.log" | sed 's/^/          /'
    fi
  fi
done <"$work/list"

echo "$((nfiles - failed)) files compiled with TK_WITH_CUDA, $failed failed ($((SECONDS - t0))s; logs in $logs)"
[[ $failed -eq 0 ]] || exit 1
