#!/usr/bin/env bash
# Installs strata from the build tree into a temporary prefix, builds
# examples/cpp_trainer against it with find_package(strata) from a separate
# CMake project, and runs it on 4 ranks. Proves the exported package config.
# When strata::torch is installed the trainer also trains a tensor-parallel
# MLP, and the loss must fall; a second build with LibTorch hidden must
# still build and run (mesh only).
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
if grep -q "trained a tensor-parallel MLP" <<<"$out"; then
  # "... loss <first> -> <last>": the loss must at least halve.
  awk '/trained a tensor-parallel MLP/ { if (!($(NF) < $(NF-2) / 2)) exit 1 }' <<<"$out" ||
    { echo "the MLP's loss did not fall"; exit 1; }
else
  grep -q "built without LibTorch" <<<"$out"
fi
# Without LibTorch (as on a machine without the torch wheel) the trainer
# still builds against the same installed package.
cmake -S "$src/examples/cpp_trainer" -B "$work/trainer-notorch" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON >/dev/null
cmake --build "$work/trainer-notorch" >/dev/null
out=$(timeout 120 "$mpirun" --allow-run-as-root --oversubscribe --bind-to none -np 2 \
  "$work/trainer-notorch/cpp_trainer" --tp 2 --pp 1)
grep -q "built without LibTorch" <<<"$out"
echo "cpp_trainer without LibTorch: ok"
