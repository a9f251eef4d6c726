#!/usr/bin/env bash
# Runs a command on N ranks under mpirun with a hard time limit, so a hang
# fails with a message instead of stalling CI.
#
#   run_multirank.sh [--mpirun PATH] --np N [--timeout S] [--ft] [--launcher-defaults] -- cmd args...
#
# --ft enables ULFM fault tolerance (mpirun --with-ft ulfm), needed by tests
# that kill ranks and expect the survivors to carry on.
# --launcher-defaults runs what a user types: `mpirun --oversubscribe -np N`
# (plus --allow-run-as-root when run as root, which mpirun requires), with
# mpirun's default binding and MCA settings, none of the flags below.
set -u
mpirun=${STRATA_MPIRUN:-mpirun}
np=2
limit=180
ft=()
defaults=0
while [ $# -gt 0 ]; do
  case "$1" in
    --mpirun) mpirun=$2; shift 2 ;;
    --np) np=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --ft) ft=(--with-ft ulfm); shift ;;
    --launcher-defaults) defaults=1; shift ;;
    --) shift; break ;;
    *) echo "run_multirank.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "run_multirank.sh: no command given" >&2; exit 2; }

export STRATA_TEST_NP=$np
if [ "$defaults" = 1 ]; then
  root=()
  [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
  flags=("${root[@]}" --oversubscribe)
  how="plain mpirun (${flags[*]})"
else
  # --bind-to none: ranks outnumber cores here; binding would pile them up.
  # Idle ranks must give their core away instead of spinning: MPI yields in
  # its progress loop (mpi_yield_when_idle, on by default only when mpirun
  # sees more ranks than slots) and yields by sleeping (nanosleep) rather
  # than with sched_yield, which hands the core straight back on a busy
  # machine. See docs/mpi.md.
  flags=(--allow-run-as-root --oversubscribe --bind-to none
         --mca mpi_yield_when_idle 1 --mca threads_pthreads_yield_strategy nanosleep)
  how="mpirun"
fi
# mpirun's stderr is shown as it comes and kept, to recognise one launcher
# failure: Open MPI's mpirun now and then fails to start its PMIx server's
# listener thread on this loaded machine and ends within a second, before
# any rank ran. That run is tried once more; nothing else is.
errlog=$(mktemp "${TMPDIR:-/tmp}/strata-multirank-XXXXXX")
trap 'rm -f "$errlog"' EXIT
run_once() {
  local started=$SECONDS
  # stdout stays stdout (fd 3); stderr goes through tee, which the pipeline waits for.
  { timeout --kill-after=15 "$limit" "$mpirun" "${flags[@]}" "${ft[@]}" -np "$np" "$@" \
      2>&1 1>&3 3>&- | tee "$errlog" >&2 3>&-
    rc=${PIPESTATUS[0]}; } 3>&1
  elapsed=$((SECONDS - started))
}
run_once "$@"
if [ $rc -ne 0 ] && [ $elapsed -lt 10 ] &&
   grep -q "listener thread failed to start" "$errlog"; then
  echo "run_multirank.sh: mpirun could not start its PMIx listener (no rank ran, ${elapsed}s); trying once more" >&2
  run_once "$@"
fi
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "FAILED: $np-rank $how run of '$*' did not finish within ${limit}s (a hang or deadlock); it was killed" >&2
fi
exit $rc
