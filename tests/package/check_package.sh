#!/usr/bin/env bash
# Installs strata from the build tree into a temporary prefix, builds
# examples/cpp_trainer against it with find_package(strata) from a separate
# CMake project, and runs it on 4 ranks. Proves the exported package config.
#   check_package.sh <build dir> <source dir> <mpirun>
set -euo pipefail
build=$1 src=$2 mpirun=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/examples/cpp_trainer" -B "$work/trainer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/trainer" >/dev/null
# The binary must resolve libstrata from the install prefix, not the build tree.
# (grep without -q: it must read all of ldd's output, or ldd dies of SIGPIPE
# and pipefail fails the check; libstrata now pulls in Open MPI's many libs.)
ldd "$work/trainer/cpp_trainer" | grep "$work/prefix/lib/libstrata" >/dev/null ||
  { echo "cpp_trainer does not link the installed libstrata:"; ldd "$work/trainer/cpp_trainer"; exit 1; }
out=$(timeout 120 "$mpirun" --allow-run-as-root --oversubscribe --bind-to none -np 4 \
  "$work/trainer/cpp_trainer" --tp 2 --pp 1)
echo "$out"
grep -q "cpp_trainer linked against strata" <<<"$out"
[ "$(grep -c '^\[rank' <<<"$out")" -eq 4 ]
