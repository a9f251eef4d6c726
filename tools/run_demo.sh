#!/usr/bin/env bash
# Launches the demo (examples/demo/demo.py) on N CPU ranks.
#   tools/run_demo.sh [--launcher mpirun|torchrun] [--np 8] [--mpirun PATH] [--timeout S]
# Under mpirun strata runs on its MPI backend; under torchrun
# (--standalone, one host) on its Gloo backend, bootstrapped through
# torchrun's TCPStore. The job is the same.
set -euo pipefail
launcher=mpirun
np=8
mpirun=mpirun
limit=${STRATA_DEMO_TIMEOUT:-900}
while [ $# -gt 0 ]; do
  case "$1" in
    --launcher) launcher=$2; shift 2 ;;
    --np) np=$2; shift 2 ;;
    --mpirun) mpirun=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    *) echo "run_demo.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
here=$(cd "$(dirname "$0")/.." && pwd)
case "$launcher" in
  mpirun)
    # Waiting ranks yield their core by sleeping (see docs/mpi.md).
    cmd=("$mpirun" --allow-run-as-root --oversubscribe --bind-to none
         --mca mpi_yield_when_idle 1 --mca threads_pthreads_yield_strategy nanosleep
         -np "$np" python3 "$here/examples/demo/demo.py") ;;
  torchrun)
    # torchrun would set this itself (with a warning): one thread per rank.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    cmd=(python3 -m torch.distributed.run --standalone --nproc-per-node "$np"
         "$here/examples/demo/demo.py") ;;
  *)
    echo "run_demo.sh: LAUNCHER=$launcher is not supported; use LAUNCHER=mpirun or LAUNCHER=torchrun" >&2
    exit 2 ;;
esac
set +e
timeout --kill-after=15 "$limit" "${cmd[@]}"
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "demo: did not finish within ${limit}s and was stopped" >&2
fi
[ $rc -eq 0 ] || exit $rc
# The last act: a watcher (examples/demo/recovery.py) runs strata's elastic
# example under torchrun with the example's strata.elastic.supervise() and
# SIGKILLs one rank from outside partway through (dp3 x tp2 and 2 hot
# spares: a spare takes its place, the other the place of a straggler it
# evicts later; both processes are started again and join back as spares).
# It runs under torchrun (Gloo) whatever the demo's launcher: the MPI
# backend cannot add a process to a running job. STRATA_DEMO_RECOVERY=0
# leaves it out.
if [ "${STRATA_DEMO_RECOVERY:-1}" != 0 ]; then
  timeout --kill-after=15 300 python3 "$here/examples/demo/recovery.py" \
    --launcher torchrun --np "$np" --mpirun "$(command -v "$mpirun" || echo "$mpirun")"
  rc=$?
fi
exit $rc
