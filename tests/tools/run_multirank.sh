#!/usr/bin/env bash
# Runs a command on N ranks under mpirun with a hard time limit, so a hang
# fails with a message instead of stalling CI.
#
#   run_multirank.sh [--mpirun PATH] --np N [--timeout S] [--ft] -- cmd args...
#
# --ft enables ULFM fault tolerance (mpirun --with-ft ulfm), needed by tests
# that kill ranks and expect the survivors to carry on.
set -u
mpirun=${STRATA_MPIRUN:-mpirun}
np=2
limit=180
ft=()
while [ $# -gt 0 ]; do
  case "$1" in
    --mpirun) mpirun=$2; shift 2 ;;
    --np) np=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --ft) ft=(--with-ft ulfm); shift ;;
    --) shift; break ;;
    *) echo "run_multirank.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "run_multirank.sh: no command given" >&2; exit 2; }

export STRATA_TEST_NP=$np
# --bind-to none: ranks outnumber cores here; binding would pile them up.
# Idle ranks must give their core away instead of spinning: MPI yields in
# its progress loop (mpi_yield_when_idle, on by default only when mpirun
# sees more ranks than slots) and yields by sleeping (nanosleep) rather
# than with sched_yield, which hands the core straight back on a busy
# machine. See docs/mpi.md.
timeout --kill-after=15 "$limit" "$mpirun" --allow-run-as-root --oversubscribe --bind-to none \
  --mca mpi_yield_when_idle 1 --mca threads_pthreads_yield_strategy nanosleep \
  "${ft[@]}" -np "$np" "$@"
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "FAILED: $np-rank run of '$*' did not finish within ${limit}s (a hang or deadlock); it was killed" >&2
fi
exit $rc
