"""The straggler policy on real jobs: examples/elastic/train.py under
``mpirun --with-ft ulfm`` with ``--straggler-policy evict``.

STRATA_STRAGGLER_CASE picks the cases (CMake registers one test per group):

- ``sleeps`` (4 ranks; the exact exchange, and once the histogram exchange
  large jobs use): a rank slowed with sleeps (``--slow``: FACTOR x the
  step's 100 ms sleep) at 1.5x for the whole run, at 3x for 4 steps then
  back, and at 10x for 4 steps: nobody is evicted; at 3x (dp4) and at 10x
  (dp2 x tp2: its tp partner leaves with it): evicted after the window (5
  steps; later when load from other jobs on this machine made one of the
  others as slow in a step, which restarts the streak); two ranks at 3x with the median as the percentile (the
  P95 of 3 others is their max, which a second slow rank sets): both
  evicted at once. Each eviction: one recovery with reason "straggler", the
  evicted rank exits 0 with a message naming its measured times, the
  survivors' loss curve and final parameters equal a one-process reference
  without any slowdown (the global batch is kept).
- ``outside`` (8 ranks, dp4 x tp2, compute-bound steps): tools/slow_rank.py
  stops and continues one rank at a duty cycle (running 10% of each 20 ms)
  from outside; the default policy evicts it, its first named slow step
  within a window of the onset. With 8 ranks on this machine's 2 cores
  the ranks' compute times vary by 2-3x from step to step (the P95 of 7
  others is their max), so a gentler duty cycle (25% running) is not
  reliably above 2x that max here.
"""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_driver as D  # noqa: E402

import strata  # noqa: E402,F401
from strata import checkpoint  # noqa: E402

import torch  # noqa: E402

CASES = os.environ.get("STRATA_STRAGGLER_CASE", "sleeps")
ROOT = D.ROOT
STEPS = 24
SMALL = ["--hidden", "32", "--layers", "2", "--batch", "48", "--lr", "0.05",
         "--step-sleep", "0.1", "--steps", str(STEPS)]
WINDOW = 5

# name: (ranks, extra flags, {evicted job rank: onset step}, ranks leaving
# with them, exchanges after the window's last step until the eviction)
SLEEPS = {
    "below-threshold": (4, ["--tp", "1", "--slow", "1:1.5:2", "--slow", "2:3:4:7",
                            "--slow", "3:10:12:15"], {}, [], 0),
    "3x": (4, ["--tp", "1", "--slow", "2:3:6"], {2: 6}, [], 0),
    "10x": (4, ["--tp", "2", "--slow", "1:10:3"], {1: 3}, [0], 0),
    "two": (4, ["--tp", "1", "--straggler-percentile", "50", "--slow", "1:3:4",
                "--slow", "3:3:4"], {1: 4, 3: 4}, [], 0),
    # The exchange large worlds use (an all-reduce of histograms): one
    # exchange later.
    "3x-histogram": (4, ["--tp", "1", "--straggler-exchange", "histogram", "--slow", "2:3:6"],
                     {2: 6}, [], 1),
}

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses and final parameters of the same training in one process."""
    out = str(tmp_path_factory.mktemp("reference"))
    job = D.Job("none", 1, SMALL + ["--tp", "1"], out, timeout=120)
    assert job.finish() == 0, job.tail()
    losses = {ln["step"]: ln["loss"] for ln in job.steps()}
    return losses, checkpoint.load(os.path.join(job.report, "final"))["model"]


def events(job, kind):
    return [ln for ln in job.lines if ln.get("event") == kind]


@pytest.mark.skipif(CASES != "sleeps", reason="STRATA_STRAGGLER_CASE is not 'sleeps'")
@pytest.mark.parametrize("case", sorted(SLEEPS))
def test_sleeps(case, reference, tmp_path):
    np_, flags, evicted, partners, lag = SLEEPS[case]
    job = D.Job("mpirun", np_, SMALL + flags + ["--straggler-policy", "evict"], str(tmp_path),
                timeout=150)
    rc = job.finish()
    print(job.tail(60))
    assert rc == 0, job.tail()
    evictions = events(job, "eviction")
    recoveries = job.recoveries()
    gone = set(evicted) | set(partners)
    survivors = sorted(set(range(np_)) - gone)
    reports = job.reports()
    assert sorted(reports) == survivors, job.tail()
    if not evicted:
        assert evictions == [] and recoveries == [] and events(job, "straggler") == []
        assert all(r["epoch"] == 1 for r in reports.values())
    else:
        # One decision, naming every slow rank, after the window: on a quiet
        # machine its first named step is the onset (unit tests check the
        # rule's exact timing); load from other jobs here can slow one of
        # the other ranks as much in a step, which restarts the streak: at
        # most one window later.
        assert sorted(e["rank"] for e in evictions) == sorted(evicted), evictions
        slip = evictions[0]["first_step"] - (min(evicted.values()) + lag)
        assert 0 <= slip <= WINDOW, evictions
        print(f"{case}: the eviction names the steps from {slip} step(s) after the onset")
        for e in evictions:
            onset = evicted[e["rank"]] + lag + slip  # the last `window` slow steps are named
            assert (e["first_step"], e["last_step"], e["steps"]) == \
                (onset, onset + WINDOW - 1, WINDOW), e
            assert e["reason"] == "straggler" and e["ratio"] > 2.0, e
            for mine, ref in zip(e["compute_s"], e["others_percentile_s"]):
                assert mine > 2.0 * ref, e
        assert len(recoveries) == 1, job.tail()
        rec = recoveries[0]
        assert rec["reason"] == "straggler" and rec["cause"]["source"] == "request", rec
        assert sorted(rec["failed"]) == sorted(evicted) and sorted(rec["leaving"]) == partners
        # The step it evicted before.
        assert rec["step"] == max(evicted.values()) + WINDOW + lag + slip, rec
        for r in evicted:
            said = [ln for ln in job.stderr if f"rank {r} leaves the job: it was evicted "
                    f"(straggler: " in ln]
            assert len(said) == 1, job.tail()
            first = evicted[r] + lag + slip
            assert f"rank {r}'s compute time over steps {first}-{first + 4} was [" \
                in said[0] and "ms against a P" in said[0], said
        for r in partners:
            assert any(f"rank {r} leaves the job: its data-parallel replica was dropped with "
                       f"evicted rank(s)" in ln for ln in job.stderr), job.tail()
        for r in survivors:
            assert reports[r]["epoch"] == 2 and reports[r]["world"] == np_ - len(gone)
    # Every step committed once; the loss curve and the final parameters
    # are the reference's (same global batches whatever dp is).
    losses, final_ref = reference
    got = {ln["step"]: ln["loss"] for ln in job.steps()}
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    for s in got:
        assert got[s] == pytest.approx(losses[s], rel=1e-4, abs=1e-6), (s, got[s], losses[s])
    for r in survivors:
        assert reports[r]["steps"] == STEPS
        assert [x[0] for x in reports[r]["trained_samples"]] == list(range(STEPS))
    final = checkpoint.load(os.path.join(job.report, "final"))["model"]
    for name in final_ref:
        torch.testing.assert_close(final[name], final_ref[name], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(CASES != "outside", reason="STRATA_STRAGGLER_CASE is not 'outside'")
def test_outside_duty_cycle_is_evicted_by_the_default_policy(tmp_path):
    steps, target, partner = 80, 5, 4  # dp4 x tp2: ranks 4 and 5 are replica 2
    flags = ["--hidden", "128", "--layers", "2", "--batch", "2048", "--lr", "0.01", "--steps",
             str(steps), "--tp", "2", "--straggler-policy", "evict"]
    job = D.Job("mpirun", 8, flags, str(tmp_path), timeout=240)
    slow = None
    try:
        job.wait_for(lambda: len(job.steps()) >= 8, "8 steps", 150)
        pid = job.pids()[target]
        onset = max(ln["step"] for ln in job.steps())  # the step running now
        slow = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "slow_rank.py"),
                                 "--pid", str(pid), "--stopped", "0.9", "--period", "0.02"],
                                stdout=subprocess.PIPE, text=True)
        rc = job.finish()
        out, _ = slow.communicate(timeout=60)
    finally:
        if slow is not None and slow.poll() is None:
            slow.kill()
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, 9)
    print(job.tail(30))
    print(out)
    assert rc == 0, job.tail()
    evictions = events(job, "eviction")
    assert [e["rank"] for e in evictions] == [target], job.tail()
    e = evictions[0]
    # The first slow step is the one the slowdown started in, or the next;
    # with 8 ranks on 2 cores and other jobs' load, another rank can be as
    # slow in a step now and then (the P95 of 7 others is their max), which
    # restarts the streak: within the window's length of the onset.
    assert onset <= e["first_step"] <= onset + WINDOW, (onset, e)
    assert e["last_step"] == e["first_step"] + WINDOW - 1 and e["ratio"] > 2.0, e
    rec = job.recoveries()
    assert len(rec) == 1 and rec[0]["reason"] == "straggler", job.tail()
    assert rec[0]["failed"] == [target] and rec[0]["leaving"] == [partner], rec[0]
    assert rec[0]["step"] == e["last_step"] + 1, rec[0]
    assert any(f"rank {target} leaves the job: it was evicted (straggler: rank {target}'s "
               "compute time" in ln for ln in job.stderr), job.tail()
    reports = job.reports()
    assert sorted(reports) == [0, 1, 2, 3, 6, 7], job.tail()
    assert all(r["steps"] == steps and r["world"] == 6 for r in reports.values())
    assert '"ended": true' in out, out  # the slowed process exited (evicted)
