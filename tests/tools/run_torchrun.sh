#!/usr/bin/env bash
# Runs a program on N processes under torchrun (--standalone: one host, its
# own rendezvous store) with a hard time limit, so a hang fails with a
# message instead of stalling CI.
#
#   run_torchrun.sh --np N [--timeout S] [--python PY] [--launcher-defaults] -- <torchrun program args>
#   run_torchrun.sh --np 4 -- --no-python build/tests/multirank/comm_conformance_test
#   run_torchrun.sh --np 4 -- -m pytest -q tests/python/mr_comm.py
#
# Exports STRATA_TEST_NP=N and STRATA_TEST_BACKEND (default gloo) for the
# tests, and, for C++ programs (--no-python), STRATA_STORE=file:<a fresh
# directory>: the test binaries do not link LibTorch, so they have no client
# for torchrun's TCPStore. Python programs bootstrap through torchrun's own
# store (strata.init connects to MASTER_ADDR:MASTER_PORT). The directory is
# removed afterwards.
#
# --launcher-defaults runs what a user types, `torchrun --standalone
# --nproc-per-node N` with nothing added to the environment but the test's
# own STRATA_TEST_* variables (torchrun itself sets OMP_NUM_THREADS=1 for
# several processes when it is unset).
set -u
python=${PYTHON:-python3}
np=2
limit=180
defaults=0
while [ $# -gt 0 ]; do
  case "$1" in
    --np) np=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --launcher-defaults) defaults=1; shift ;;
    --) shift; break ;;
    *) echo "run_torchrun.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "run_torchrun.sh: no program given" >&2; exit 2; }

store_dir=$(mktemp -d "${TMPDIR:-/tmp}/strata_torchrun.XXXXXX")
trap 'rm -rf "$store_dir"' EXIT
export STRATA_TEST_NP=$np
export STRATA_TEST_BACKEND=${STRATA_TEST_BACKEND:-gloo}
if [ "$1" = "--no-python" ]; then
  export STRATA_STORE=${STRATA_STORE:-file:$store_dir}
fi
if [ "$defaults" = 0 ]; then
  # One thread per process for torch's CPU kernels: ranks outnumber cores.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
# `python -m torch.distributed.run` is torchrun's entry point, run by the
# interpreter the build found.
timeout --kill-after=15 "$limit" "$python" -m torch.distributed.run --standalone \
  --nproc-per-node "$np" "$@"
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "FAILED: $np-process torchrun of '$*' did not finish within ${limit}s (a hang or deadlock); it was killed" >&2
fi
exit $rc
