"""In-process recovery for real: examples/elastic/train.py on 8 ranks
(dp4 x tp2) under ``mpirun --with-ft ulfm`` (MPI backend, ULFM) or
``torchrun --standalone`` (Gloo), one rank killed from outside with SIGKILL
(between steps, or at a random moment) or stopped with SIGSTOP (found by
its heartbeat). The launcher is STRATA_ELASTIC_LAUNCHER (mpirun or
torchrun), the case STRATA_ELASTIC_CASE (kill-between, kill-random, stop);
CMake registers one test per pair.

Checked in every case:
- the job exits 0; the killed rank is gone, the other rank of its replica
  left (exit 0 with a message saying why), the six others finished;
- every survivor holds the same recovery event (the failed set, the new
  epoch, the members) and ends on dp3 x tp2 at that epoch (2, or more when
  the regroup was retried);
- parameters are bitwise equal across the data-parallel replicas (per tp
  rank);
- the step counter, the scheduler's step and learning rate and the
  sampler's position are those of ``--steps`` committed steps;
- the final parameters equal, within floating-point tolerance, those of a
  reference computed here: the same example in one process (tp 1, dp 1) on
  the same global batches without any failure (the global batch is kept
  across the change of dp, so the sequence of updates is the same);
- the recovery took the path expected (SIGSTOP: the heartbeat found it).
"""

import math
import os
import random
import signal
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_driver as D  # noqa: E402

from strata import checkpoint  # noqa: E402

LAUNCHER = os.environ.get("STRATA_ELASTIC_LAUNCHER", "mpirun")
CASE = os.environ.get("STRATA_ELASTIC_CASE", "kill-random")
NP = 8
STEPS = 24
LR = 0.05
# Small and quick: the job's time goes to starting 8 Python processes.
ARGS = ["--hidden", "32", "--layers", "2", "--batch", "48", "--lr", str(LR)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final parameters of the same training in one process, tp 1."""
    out = str(tmp_path_factory.mktemp("reference"))
    job = D.Job("none", 1, ["--steps", str(STEPS), "--tp", "1"] + ARGS, out, timeout=120)
    rc = job.finish()
    assert rc == 0, job.tail()
    return checkpoint.load(os.path.join(job.report, "final"))["model"]


def run_case(tmp):
    seed = int(os.environ.get("STRATA_ELASTIC_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    rank = rng.randrange(NP)
    args = ["--steps", str(STEPS)] + ARGS
    sig, when = signal.SIGKILL, "random"
    if CASE == "kill-between":
        when = "between"
        args += ["--step-sleep", "0.3"]  # every rank sleeps, outside any collective
    elif CASE == "stop":
        sig = signal.SIGSTOP
        # Steps long enough that the signal (up to 1 s after step 4) comes
        # while the job trains, not while it saves its final report.
        args += ["--heartbeat-timeout", "2", "--step-sleep", "0.1"]
    else:
        args += ["--step-sleep", "0.1"]
    print(f"{LAUNCHER} {CASE}: seed {seed}, signal {sig.name} to rank {rank}", flush=True)
    job = D.Job(LAUNCHER, NP, args, tmp, timeout=170)
    try:
        killed_at = D.kill_rank(job, rank, sig, after_steps=4, when=when, rng=rng, timeout=150)
        rc = job.finish()
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
        try:
            os.kill(job.pids()[rank], signal.SIGKILL)  # a stopped rank, if not fenced
        except (ProcessLookupError, KeyError):
            pass
    return job, rc, rank, killed_at


def test_survivors_recover_and_finish_like_the_reference(reference, tmp_path):
    job, rc, killed, killed_at = run_case(str(tmp_path))
    print(job.tail(60))
    assert rc == 0, f"the job failed ({rc}):\n{job.tail()}"
    partner = killed ^ 1  # dp4 x tp2: ranks 2d and 2d+1 form replica d
    reports = job.reports()
    survivors = sorted(set(range(NP)) - {killed, partner})
    assert sorted(reports) == survivors, (sorted(reports), job.tail())
    assert any(f"rank {partner} leaves the job" in line for line in job.stderr), job.tail()

    # One failed set and one epoch, everywhere.
    first = reports[survivors[0]]
    assert len(first["events"]) == 1, first["events"]
    event = first["events"][0]
    assert event["failed"] == [killed], event
    assert event["leaving"] == [partner], event
    # A shrink that failed on some rank (an MPI peer's failure surfacing
    # during it) is retried as the next epoch: one event either way.
    assert event["epoch"] == 1 + event["attempts"], event
    assert event["dp"] == 3 and event["world"] == 6, event
    for r in survivors:
        e = reports[r]["events"]
        assert [(x["failed"], x["leaving"], x["epoch"], x["members"]) for x in e] == \
            [(x["failed"], x["leaving"], x["epoch"], x["members"]) for x in first["events"]], r
        assert reports[r]["epoch"] == event["epoch"] and reports[r]["world"] == 6
    if CASE == "stop":
        assert event["cause"]["source"] == "heartbeat", event["cause"]
        assert event["cause"]["suspect"] == killed, event["cause"]

    # Replicas are bitwise equal (per tp rank); counters match the steps.
    by_tp = {}
    for r in survivors:
        rep = reports[r]
        by_tp.setdefault(rep["coords"]["tp"], set()).add(rep["param_hash"])
        assert rep["steps"] == STEPS
        assert rep["scheduler_epoch"] == STEPS
        assert math.isclose(rep["lr"], LR * min(1.0, (STEPS + 1) / 10)), rep["lr"]
        assert rep["sampler_position"] == STEPS * 48
        # Every committed step is in this rank's record once, in order.
        assert [s[0] for s in rep["trained_samples"]] == list(range(STEPS))
    assert all(len(h) == 1 for h in by_tp.values()), by_tp

    # The same parameters as the reference run.
    final = checkpoint.load(os.path.join(job.report, "final"))["model"]
    assert sorted(final) == sorted(reference)
    for name in reference:
        torch.testing.assert_close(final[name], reference[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")

    # The recovery line and its phases.
    lines = job.recoveries()
    assert len(lines) == 1, job.tail()
    line = lines[0]
    for k in ("failed", "detect_s", "agree_s", "rebuild_s", "restore_s", "world", "dp"):
        assert k in line, line
    # From the signal (this process's clock; the ranks run on this host):
    # every survivor knew, the new world's first collective completed, the
    # first step after it completed.
    known = line["known_by_all_at"] - killed_at
    rebuilt = line["rebuilt_at"] - killed_at
    first_step = steps_after(job, line)[0]["_t"] - killed_at
    print(f"recovery ({LAUNCHER} {CASE}): signal to rank {killed} at {killed_at:.3f}; from it: "
          f"all survivors knew after {known:.3f} s, new world's first collective done after "
          f"{rebuilt:.3f} s, first step done after {first_step:.3f} s; phases: detect "
          f"{line['detect_s']:.3f} s (from the first report), agree {line['agree_s']:.3f} s, "
          f"rebuild {line['rebuild_s']:.3f} s, restore {line['restore_s']:.3f} s; source "
          f"{event['cause']['source']}")
    # Bounded detection: a dead rank within seconds on this loaded machine
    # (sub-second when idle), a stopped one within its heartbeat timeout
    # (2 s here) and a few seconds.
    bound = 2.0 + 4.0 if CASE == "stop" else 4.0
    assert 0 <= known < bound, (known, line)


def steps_after(job, recovery):
    """The step lines printed after the recovery line."""
    lines = job.lines
    i = next(k for k, ln in enumerate(lines) if ln is recovery)
    return [ln for ln in lines[i + 1:] if ln.get("event") == "step"]
