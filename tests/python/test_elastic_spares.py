"""Hot spares for real: examples/elastic/train.py on 8 ranks, dp3 x tp2 and
two spares (``--spares 2``: ranks 6 and 7 stand by), under ``mpirun
--with-ft ulfm`` (MPI, ULFM) or ``torchrun --standalone`` (Gloo)
(STRATA_ELASTIC_LAUNCHER). A random member is SIGKILLed from outside at a
random moment after step 4.

Checked:
- the job exits 0; spare 6 takes the killed rank's mesh position (its
  replica partner does not leave) and dp stays 3; spare 7 stands by to the
  end and says so;
- every member holds the same recovery event (failed, replaced, members,
  epoch) and rank 0 printed a {"event": "spare"} line with the time from
  the kill to the first step at the full dp;
- the placed spare received its position's state: the step counter, the
  scheduler, the sampler position and the user values (the record of every
  committed step) equal the others', and the parameters are bitwise equal
  across the replicas (per tp rank);
- the final parameters equal those of a one-process reference on the same
  global batches without failure (dp never changed, so the sequence of
  updates is the same).
"""

import os
import random
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_driver as D  # noqa: E402

from strata import checkpoint  # noqa: E402

LAUNCHER = os.environ.get("STRATA_ELASTIC_LAUNCHER", "mpirun")
NP, SPARES, STEPS, LR = 8, 2, 24, 0.05
ARGS = ["--hidden", "32", "--layers", "2", "--batch", "48", "--lr", str(LR)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reference"))
    job = D.Job("none", 1, ["--steps", str(STEPS), "--tp", "1"] + ARGS, out, timeout=120)
    assert job.finish() == 0, job.tail()
    return checkpoint.load(os.path.join(job.report, "final"))["model"]


def test_a_spare_takes_the_killed_ranks_place(reference, tmp_path):
    seed = int(os.environ.get("STRATA_ELASTIC_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    killed = rng.randrange(NP - SPARES)
    print(f"{LAUNCHER}: seed {seed}, SIGKILL to rank {killed}", flush=True)
    args = ["--steps", str(STEPS), "--spares", str(SPARES), "--step-sleep", "0.1"] + ARGS
    job = D.Job(LAUNCHER, NP, args, str(tmp_path), timeout=170)
    try:
        killed_at = D.kill_rank(job, killed, signal.SIGKILL, after_steps=4, when="random",
                                rng=rng, timeout=150)
        rc = job.finish()
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
    print(job.tail(40))
    assert rc == 0, f"the job failed ({rc}):\n{job.tail()}"
    reports = job.reports()
    assert sorted(reports) == sorted(set(range(NP)) - {killed}), (sorted(reports), job.tail())
    assert reports[7].get("stood_by") is True, reports[7]
    members = sorted(set(range(NP - 1)) - {killed})
    first = reports[members[0]]
    assert len(first["events"]) == 1, first["events"]
    event = first["events"][0]
    assert event["failed"] == [killed] and event["leaving"] == [], event
    assert event["replaced"] == [[killed, 6]], event
    assert event["spares"] == [7], event
    assert event["dp"] == 3 and event["world"] == 6, event
    assert event["members"][killed] == 6, event  # the spare holds the killed rank's position
    for r in members:
        rep = reports[r]
        assert [(x["failed"], x["replaced"], x["epoch"], x["members"]) for x in rep["events"]] \
            == [(x["failed"], x["replaced"], x["epoch"], x["members"]) for x in first["events"]]
        assert rep["world"] == 6 and rep["epoch"] == event["epoch"]
    assert reports[6]["events"][0]["placed"] is True
    assert reports[6]["world_rank"] == killed  # its mesh position
    # The spare line: rank 0 of the new world printed it at the first step.
    spare_lines = [x for x in job.lines if x.get("event") == "spare"]
    assert len(spare_lines) == 1, job.tail()
    line = spare_lines[0]
    assert line["placed"] == [{"failed": killed, "spare": 6}] and line["dp"] == 3, line
    assert 0 < line["first_step_s"] < 30, line
    print(f"kill -> first step at full dp: {line['first_step_s']:.3f} s "
          f"(killed at {killed_at:.3f})", flush=True)

    D.check_survivors(job, members, STEPS, LR, 48, reference)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
