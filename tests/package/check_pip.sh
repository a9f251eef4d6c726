#!/usr/bin/env bash
# `pip install .` into a temporary target, then `import strata` from there
# (outside the source tree). Reuses the CMake build directory given.
#   check_pip.sh <build dir> <source dir> <python>
set -euo pipefail
build=$1 src=$2 py=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$src"
STRATA_CMAKE_BUILD_DIR="$build" "$py" -m pip install --no-build-isolation --no-deps -q \
  --target "$work/site" . 2>&1 | grep -v "Running pip as the 'root' user" || true
cd "$work"
env -u PYTHONPATH PYTHONPATH="$work/site" "$py" -c "
import strata, os
assert strata.__file__.startswith('$work/site'), strata.__file__
m = strata.Mesh(8, tp=2, pp=2)
assert m.groups('dp') == [[0, 2], [1, 3], [4, 6], [5, 7]]
print('import strata from', os.path.dirname(strata.__file__), 'ok:', m)
"
