#!/usr/bin/env bash
# Tests run_multirank.sh against a stand-in mpirun (it runs the command
# after -np N): the exit status and output pass through; a launch that
# fails with Open MPI's "listener thread failed to start" before any rank
# ran is tried once more, and only once; another failure is not retried; a
# hang is killed at the time limit with a message.
set -u
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/mpirun" <<'FAKE'
#!/usr/bin/env bash
while [ $# -gt 0 ] && [ "$1" != "-np" ]; do shift; done
shift 2
echo call >> "$FAKE_CALLS"
if [ -n "${FAKE_PMIX_FAILS:-}" ] && [ "$(wc -l < "$FAKE_CALLS")" -le "$FAKE_PMIX_FAILS" ]; then
  echo "[host:1] PMIx: The PMIx server's listener thread failed to start" >&2
  exit 1
fi
exec "$@"
FAKE
chmod +x "$work/mpirun"
failures=0
check() {  # NAME EXPECTED_RC EXPECTED_CALLS PMIX_FAILS -- runner args
  local name=$1 want_rc=$2 want_calls=$3 fails=$4
  shift 5
  : > "$work/calls"
  out=$(FAKE_CALLS="$work/calls" FAKE_PMIX_FAILS=$fails STRATA_MPIRUN="$work/mpirun" \
        "$here/run_multirank.sh" "$@" 2>"$work/err")
  rc=$?
  calls=$(wc -l < "$work/calls")
  if [ "$rc" != "$want_rc" ] || [ "$calls" != "$want_calls" ]; then
    echo "FAIL $name: rc $rc (want $want_rc), $calls launches (want $want_calls); stdout: $out; stderr:" >&2
    cat "$work/err" >&2
    failures=$((failures + 1))
  else
    echo "ok $name"
  fi
}
check "status and output pass through" 3 1 0 -- --np 2 -- sh -c 'echo out; exit 3'
[ "$out" = out ] || { echo "FAIL: stdout '$out'" >&2; failures=$((failures + 1)); }
check "a PMIx listener failure is tried again" 0 2 1 -- --np 2 -- true
grep -q "trying once more" "$work/err" || { echo "FAIL: no retry message" >&2; failures=$((failures + 1)); }
check "only once" 1 2 2 -- --np 2 -- true
check "another failure is not retried" 5 1 0 -- --np 2 -- sh -c 'echo boom >&2; exit 5'
check "a hang is killed at the limit" 124 1 0 -- --np 2 --timeout 1 -- sleep 30
grep -q "did not finish within 1s" "$work/err" || { echo "FAIL: no hang message" >&2; failures=$((failures + 1)); }
exit $((failures > 0))
