#!/usr/bin/env bash
# The C++ section of docs/getting-started.md is a program that builds and
# runs: its code blocks (the CMakeLists.txt and main.cc) are extracted, built
# with find_package(strata) against strata installed from this build tree,
# and run on 2 ranks under mpirun with its default flags (binding included).
# Each rank's reported results are checked: the allreduce's sum against the
# expected one, the tensor-parallel product against the whole product, the
# checkpoint loaded back identical.
#   check_docs_cpp.sh <build dir> <source dir> <mpirun>
set -euo pipefail
build=$1 src=$2 mpirun=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
python3 "$src/tests/package/doc_code.py" "$src/docs/getting-started.md" "5. Use it from C++" \
  "$work/project"
cmake -S "$work/project" -B "$work/project/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/project/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
ldd "$work/project/build/my_trainer" | grep "$work/prefix/lib/libstrata" >/dev/null ||
  { echo "my_trainer does not link the installed libstrata"; exit 1; }
# As the page says: mpirun -np 2 build/my_trainer <dir>. Root needs Open
# MPI's consent, given through the environment so the command line stays
# the page's.
allow=()
[ "$(id -u)" -ne 0 ] || allow=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
cd "$work"
out=$("${allow[@]}" timeout --kill-after=15 180 "$mpirun" -np 2 \
      "$work/project/build/my_trainer" "$work/checkpoints" 2>&1) || { echo "$out"; exit 1; }
echo "$out"
for r in 0 1; do
  line=$(grep "^\[rank $r\] allreduce: " <<<"$out") || { echo "rank $r: no allreduce"; exit 1; }
  [[ "$line" =~ allreduce:\ ([0-9.e+-]+)\ \(expected\ ([0-9]+)\) ]] &&
    [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[2]}" ] || { echo "rank $r: wrong sum: $line"; exit 1; }
  line=$(grep "^\[rank $r\] tensor-parallel MLP on tp=2: max difference" <<<"$out") ||
    { echo "rank $r: no tensor-parallel result"; exit 1; }
  awk -v l="$line" 'BEGIN { n = split(l, f, " "); exit !(f[n] + 0 < 1e-4) }' ||
    { echo "rank $r: the tensor-parallel product differs: $line"; exit 1; }
  grep -q "^\[rank $r\] checkpoint step 100: saved and loaded back identical" <<<"$out" ||
    { echo "rank $r: the checkpoint did not round-trip"; exit 1; }
done
[ -e "$work/checkpoints/step-100" ] || { echo "no committed checkpoint directory"; exit 1; }
echo "docs/getting-started.md C++ section: ok"
