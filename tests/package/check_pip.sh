#!/usr/bin/env bash
# `pip install .` as a user runs it on a fresh clone, and the installed
# package on 2 ranks.
#
#   check_pip.sh install <work dir> <source dir> <python> <gloo: 0|1>
#     Copies the source tree as a commit would hold it (tracked and new
#     files, nothing git ignores: no build/) to <work dir>/src, makes a
#     virtual environment (--system-site-packages, so torch and numpy are not
#     downloaded) and runs a plain `pip install .` there: build isolation, so
#     pyproject.toml's build requirements, and setup.py's default build
#     directory, empty. Then a second `pip install .` on the same tree: what
#     the first left behind must not break it. Then the copy is deleted, so
#     the package can only work from what it installed, and every library
#     and tool it installed must resolve its libraries (RUNPATH), none from
#     a source tree or build directory. Then `import strata`, strata-topo and
#     strata-ckpt from a directory outside any source tree.
#   check_pip.sh ranks <work dir> <mpirun>
#     A 2-rank allreduce under mpirun with the installed package (after
#     `install`; ctest runs them as a fixture).
#
# <work dir> is the same path on every run (wiped first), so ccache hits
# and the from-scratch build takes minutes only the first time.
set -euo pipefail
mode=$1 work=$2
venv=$work/venv
here=$(cd "$(dirname "$0")" && pwd)

fail() { echo "FAILED: $*" >&2; exit 1; }

site_dir() { "$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])"; }

install() {
  local src=$1 py=$2 gloo=$3
  rm -rf "$work"
  mkdir -p "$work/src"
  # The source tree as a clone of it would be.
  if git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$src" && git ls-files -z --cached --others --exclude-standard |
       while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
       tar --null -T - -cf -) | tar -xf - -C "$work/src"
  else
    (cd "$src" && tar --exclude='./build*' -cf - .) | tar -xf - -C "$work/src"
  fi
  [ ! -e "$work/src/build" ] || fail "the copy of the source tree has a build/ directory"
  "$py" -m venv --system-site-packages "$venv"
  local n
  for n in 1 2; do
    local start=$SECONDS
    # Exactly what the user types, in the virtual environment.
    if ! (cd "$work/src" && env -u PYTHONPATH -u STRATA_CMAKE_BUILD_DIR "$venv/bin/python" -m pip \
            install -v . >"$work/pip-$n.log" 2>&1); then
      tail -n 80 "$work/pip-$n.log"
      fail "pip install . (run $n) failed; the whole log: $work/pip-$n.log"
    fi
    echo "pip install . (run $n): $((SECONDS - start)) s"
  done
  # The second run found the first's build directory and compiled nothing.
  if grep -E "Building (CXX|CUDA)|Linking" "$work/pip-2.log"; then
    fail "the second pip install . rebuilt the above (log: $work/pip-2.log)"
  fi
  rm -rf "$work/src"

  local site pkg
  site=$(site_dir)
  pkg=$site/strata
  local expect=("$pkg"/_strata*.so "$pkg/libstrata.so.0" "$pkg/bin/strata-topo" "$pkg/bin/strata-ckpt")
  [ "$gloo" = 1 ] && expect+=("$pkg/libstrata_gloo.so")
  local f
  for f in "${expect[@]}"; do [ -e "$f" ] || fail "pip install did not install $f"; done
  # Every ELF file the package holds finds its libraries through its own
  # RUNPATH: none missing, none from a source tree or build directory (the
  # virtual environment lives in this build directory and is allowed).
  local real_src real_venv
  real_src=$(cd "$src" && pwd -P)
  real_venv=$(cd "$venv" && pwd -P)
  while IFS= read -r -d '' f; do
    head -c 4 "$f" | grep -q "ELF" || continue
    local deps
    deps=$(env -u LD_LIBRARY_PATH ldd "$f" 2>&1) || true
    if grep -q "not found" <<<"$deps"; then
      echo "$deps"; fail "$f has unresolved libraries"
    fi
    local lib
    for lib in $(awk '$2 == "=>" && $3 ~ /^\// { print $3 }' <<<"$deps"); do
      lib=$(readlink -f "$lib")
      case "$lib" in
        "$real_venv"/*) ;;
        "$real_src"/* | "$work/src"/*) echo "$deps"; fail "$f loads $lib from a source tree" ;;
      esac
    done
    if readelf -d "$f" | grep -E "\((RPATH|RUNPATH)\)" | grep -q -e "$work/src" -e "$real_src"; then
      readelf -d "$f" | grep -E "R(UN)?PATH"; fail "$f has a RUNPATH into a source tree"
    fi
  done < <(find "$pkg" -type f -print0)

  local run
  run=$(mktemp -d)
  trap 'rm -rf "$run"' RETURN
  cd "$run"
  env -u PYTHONPATH "$venv/bin/python" - "$site" <<'EOF'
import os, sys
import strata
site = sys.argv[1]
assert strata.__file__.startswith(site + os.sep), strata.__file__
m = strata.Mesh(8, tp=2, pp=2)
assert m.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
print("import strata from", os.path.dirname(strata.__file__), "ok:", m)
EOF
  # The commands pip put on the environment's PATH.
  env -u PYTHONPATH "$venv/bin/strata-topo" --json --no-conf-files >"$run/topo.json" ||
    [ $? -eq 1 ]  # 1: the lint found errors in this environment, still a report
  "$venv/bin/python" -c "import json, sys; d = json.load(open(sys.argv[1])); print('strata-topo:', d['class'], 'NCCL', d['nccl_version'], d['nccl_version_source'])" "$run/topo.json"
  env -u PYTHONPATH "$venv/bin/strata-ckpt" --help >/dev/null || fail "strata-ckpt --help failed"
  echo "installed package: ok"
}

ranks() {
  local mpirun=$1
  [ -x "$venv/bin/python" ] || fail "no virtual environment at $venv: run 'check_pip.sh install' first"
  local site run
  site=$(site_dir)
  run=$(mktemp -d)
  trap 'rm -rf "$run"' RETURN
  cp "$here/pip_ranks.py" "$run/"
  cd "$run"
  local out
  out=$(env -u PYTHONPATH STRATA_PIP_SITE="$site" STRATA_PIP_FORBIDDEN="$(cd "$here/../.." && pwd -P)" \
        STRATA_PIP_ALLOWED="$(cd "$venv" && pwd -P)" \
        timeout --kill-after=15 120 "$mpirun" --allow-run-as-root --oversubscribe -np 2 \
          -x STRATA_PIP_SITE -x STRATA_PIP_FORBIDDEN -x STRATA_PIP_ALLOWED \
        "$venv/bin/python" "$run/pip_ranks.py" 2>&1) || { echo "$out"; fail "the 2-rank job failed"; }
  echo "$out"
  [ "$(grep -c "^\[rank [01]\] ok" <<<"$out")" -eq 2 ] || fail "not every rank reported ok"
}

case "$mode" in
  install) install "$3" "$4" "$5" ;;
  ranks) ranks "$3" ;;
  *) echo "check_pip.sh: unknown mode $mode" >&2; exit 2 ;;
esac
