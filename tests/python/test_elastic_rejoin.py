"""Growing back for real: examples/elastic/train.py under ``torchrun
--standalone`` (Gloo) with ``--restarts 1``: strata.elastic.supervise starts
a new process for a rank that was SIGKILLed from outside (or that left with
its dropped replica), and that process joins the running job.

Cases (STRATA_REJOIN_CASE):
- ``dp``: 4 ranks, dp4. A random rank is killed at a random moment after
  step 4: dp4 -> dp3; its restarted process joins at a step boundary,
  completes a fourth replica and dp grows back to 4.
- ``tp``: 8 ranks, dp4 x tp2. The killed rank's replica is dropped (its
  partner leaves, dp3); both processes are restarted, join as spares, and
  once both are in they form a replica: dp4 again.
- ``dies``: as ``dp``, but the first joiner is SIGKILLed while it would
  receive its state (the example's --joiner-dies): the members' send
  fails, they recover without it (dp3), and the second restart joins (dp4).
- ``evict``: 4 ranks, dp4, no kill: rank 2 turns 4x slow at step 6 (the
  example's --slow) and the straggler policy evicts it (dp3); its process,
  started again, joins and dp grows back to 4.

In every case the loss of every step equals the reference run's (the
global batch is kept through every change of dp, so the loss curve does not
depend on the membership changes).

Checked: the job exits 0; every member of the final world holds the same
events (a failure, then joins) and the final mesh is the first one; rank 0
printed a {"event": "join"} line; the joiners received the state of their
place: step counter, scheduler, sampler position and the record of every
committed step equal the others', and the parameters are bitwise equal
across replicas (per tp rank); the final parameters equal a one-process
reference on the same global batches (the global batch is kept through
every change of dp).
"""

import os
import random
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_driver as D  # noqa: E402

from strata import checkpoint  # noqa: E402

CASE = os.environ.get("STRATA_REJOIN_CASE", "dp")
NP, TP = (8, 2) if CASE == "tp" else (4, 1)
JOINERS = 2 if CASE in ("tp", "dies") else 1
KILL = CASE != "evict"
# Two restarts in a row (``dies``) take 8-10 s of a 60-step run before the
# second joiner asks; one that comes after the end finds the job finished.
STEPS, LR, BATCH = (100 if CASE == "dies" else 60), 0.05, 48
ARGS = ["--hidden", "32", "--layers", "2", "--batch", str(BATCH), "--lr", str(LR)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reference"))
    job = D.Job("none", 1, ["--steps", str(STEPS), "--tp", "1"] + ARGS, out, timeout=120)
    assert job.finish() == 0, job.tail()
    losses = {x["step"]: x["loss"] for x in job.steps()}
    return checkpoint.load(os.path.join(job.report, "final"))["model"], losses


def test_a_restarted_rank_joins_and_dp_grows_back(reference, tmp_path):
    reference, reference_losses = reference
    seed = int(os.environ.get("STRATA_ELASTIC_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    killed = rng.randrange(NP) if KILL else 2
    print(f"{CASE}: seed {seed}, {'SIGKILL to' if KILL else 'slowing'} rank {killed}", flush=True)
    args = ["--steps", str(STEPS), "--tp", str(TP), "--restarts", str(2 if CASE == "dies" else 1),
            "--step-sleep", "0.15"] + ARGS
    if CASE == "dies":
        args += ["--joiner-dies", str(tmp_path / "joiner-died")]
    if CASE == "evict":  # slow from step 6 to 14: its restarted process is not
        args += ["--straggler-policy", "evict", "--slow", f"{killed}:4:6:14"]
    if KILL:
        job, _, rc = D.run_and_kill("torchrun", NP, args, str(tmp_path), killed, 4, rng,
                                    timeout=200)
    else:
        job = D.Job("torchrun", NP, args, str(tmp_path), timeout=200)
        try:
            rc = job.finish()
        finally:
            if job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
    print(job.tail(60))
    assert rc == 0, f"the job failed ({rc}):\n{job.tail()}"
    reports = job.reports()
    assert sorted(reports) == list(range(NP)), (sorted(reports), job.tail())
    # A rank that stayed throughout (the killed rank's report, and its tp
    # partner's, come from the processes that joined in their places).
    replica = {killed - killed % TP + t for t in range(TP)}
    stayed = min(set(range(NP)) - replica)
    events = reports[stayed]["events"]
    assert events[0]["failed"] == [killed], events
    if CASE == "evict":
        assert events[0]["cause"]["source"] == "request" and events[0]["reason"] == "straggler", \
            events[0]
    joins = [e for e in events if e["cause"]["source"] == "join"]
    assert joins, events
    grown = [r for e in joins for r in e["grown"]]
    joined = [r for e in joins for r in e["joined"]]
    assert len(joined) == JOINERS and sorted(grown) == sorted(joined), events
    if CASE == "dies":
        died = joined[0]
        assert any(e["failed"] == [died] for e in events), events
        assert (tmp_path / "joiner-died").exists()
    assert all(r >= NP for r in joined), joined  # joiners get new job ranks
    assert events[-1]["dp"] == NP // TP and events[-1]["world"] == NP, events[-1]
    for r in replica:
        assert reports[r]["events"][0]["cause"]["source"] == "join", reports[r]["events"]
    for r in range(NP):
        rep = reports[r]
        assert rep["world"] == NP, (r, rep["world"])
        mine = [(e["epoch"], e["members"]) for e in rep["events"]]
        assert mine[-1] == (events[-1]["epoch"], events[-1]["members"]), (r, mine)
    lines = [x for x in job.lines if x.get("event") == "join"]
    assert lines, job.tail()
    assert lines[-1]["dp"] == NP // TP, lines
    steps = [x for x in job.lines if x.get("event") == "step"]
    print(f"join lines: {lines}", flush=True)

    D.check_survivors(job, range(NP), STEPS, LR, BATCH, reference)
    assert len(steps) >= STEPS
    # The loss curve: every step's, against the reference's.
    losses = {x["step"]: x["loss"] for x in steps}
    assert sorted(losses) == sorted(reference_losses), (sorted(losses), sorted(reference_losses))
    for n, want in reference_losses.items():
        assert abs(losses[n] - want) <= 1e-4 * max(1.0, abs(want)), (n, losses[n], want)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
