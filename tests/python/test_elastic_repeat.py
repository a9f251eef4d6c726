"""Several failures in one job, for real: examples/elastic/train.py on 8
ranks under ``mpirun --with-ft ulfm`` (dp4 x tp2) or ``torchrun
--standalone`` (dp8 x tp1), with three ranks killed from outside (SIGKILL):

1. rank 0 (rank 0 of the world, whose process the job's first collectives
   and the log lines start from) at a random moment after step 3: under
   torchrun the store lives in the agent, under mpirun it is a file store
   in the temporary directory, so neither goes with rank 0;
2. another rank, at a random moment after the first recovery completed
   and two more steps were committed (two failures in a row);
3. a third rank, the moment the agreement of the second recovery has
   written its decision (the test reads the decision key from the job's
   store as the ranks write it), so that it dies while the survivors
   shrink and rebuild: that recovery must start again with the larger
   failed set (one event, ``attempts`` >= 2, naming both).

The launcher is STRATA_ELASTIC_LAUNCHER (mpirun or torchrun); CMake
registers one test each. Checked:
- the job exits 0; the killed ranks are gone, the live ranks of their
  replicas left (exit 0 with a message saying why), the others finished;
- every survivor holds the same two recovery events (failed sets, epochs,
  members): the first names rank 0, the second the other two;
- parameters are bitwise equal across the data-parallel replicas;
- the step counter, the scheduler's step and learning rate, the sampler's
  position and the record of trained steps are those of ``STEPS`` committed
  steps;
- the final parameters equal, within floating-point tolerance, those of a
  reference computed here (the same example in one process, tp 1, on the
  same global batches, without any failure);
- the elastic layer's file store directory is gone when the job ends
  (mpirun).
"""

import math
import os
import random
import signal
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_driver as D  # noqa: E402

from strata import checkpoint  # noqa: E402

LAUNCHER = os.environ.get("STRATA_ELASTIC_LAUNCHER", "mpirun")
NP = 8
TP = 2 if LAUNCHER == "mpirun" else 1
STEPS = 22
LR = 0.05
BATCH = 48
ARGS = ["--hidden", "32", "--layers", "2", "--batch", str(BATCH), "--lr", str(LR),
        "--tp", str(TP), "--step-sleep", "0.1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final parameters of the same training in one process, tp 1."""
    out = str(tmp_path_factory.mktemp("reference"))
    args = ["--steps", str(STEPS), "--tp", "1"] + ARGS[:-4]
    job = D.Job("none", 1, args, out, timeout=120)
    rc = job.finish()
    assert rc == 0, job.tail()
    return checkpoint.load(os.path.join(job.report, "final"))["model"]


def replica(rank):
    return rank // TP  # the example's default order: tp is the fastest axis


def kill(job, rank):
    t = time.time()
    os.kill(job.pids()[rank], signal.SIGKILL)
    return t


def run_job(tmp, rng):
    job = D.Job(LAUNCHER, NP, ["--steps", str(STEPS)] + ARGS, tmp, timeout=170)
    kills = []  # (rank, time, what)
    watch = None
    store_dir = None
    try:
        pids = job.wait_pids(150)
        watch = D.StoreWatch(LAUNCHER, pids[2])
        store_dir = watch.directory  # mpirun: the job's file store
        # 1. Rank 0, at a random moment after step 3.
        job.wait_for(lambda: len(job.steps()) >= 3, "3 steps", 150)
        time.sleep(rng.uniform(0.0, 0.3))
        kills.append((0, kill(job, 0), "at a random moment"))
        # 2. After the first recovery and two more steps.
        job.wait_for(lambda: len(job.recoveries()) >= 1, "the first recovery", 150)
        first = job.recoveries()[0]
        epoch = first["epoch"]
        n = len(job.steps())
        job.wait_for(lambda: len(job.steps()) >= n + 2, "two steps after the first recovery",
                     150)
        gone = {replica(0)}
        second = rng.choice([r for r in range(NP) if replica(r) not in gone])
        gone.add(replica(second))
        time.sleep(rng.uniform(0.0, 0.1))
        kills.append((second, kill(job, second), "at a random moment"))
        # 3. When the second recovery's decision is written: the survivors
        # are shrinking their communicators.
        watch.wait(watch.key(epoch, "decision"), 60, job)
        third = rng.choice([r for r in range(NP) if replica(r) not in gone])
        kills.append((third, kill(job, third), f"when epoch {epoch}'s decision was written"))
        rc = job.finish()
    finally:
        if watch is not None:
            watch.close()
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
    return job, rc, kills, store_dir


def test_three_failures_two_in_a_row_and_one_during_a_recovery(reference, tmp_path):
    seed = int(os.environ.get("STRATA_ELASTIC_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"{LAUNCHER}: dp{NP // TP} x tp{TP}, seed {seed}", flush=True)
    job, rc, kills, store_dir = run_job(str(tmp_path), rng)
    print(job.tail(60))
    for rank, t, what in kills:
        print(f"SIGKILL to rank {rank} at {t:.3f} ({what})")
    assert rc == 0, f"the job failed ({rc}):\n{job.tail()}"
    killed = [k[0] for k in kills]
    lost = {replica(r) for r in killed}
    partners = sorted(r for r in range(NP) if replica(r) in lost and r not in killed)
    survivors = sorted(r for r in range(NP) if replica(r) not in lost)
    reports = job.reports()
    assert sorted(reports) == survivors, (sorted(reports), job.tail())
    for p in partners:
        assert any(f"rank {p} leaves the job" in line for line in job.stderr), (p, job.tail())

    # The same two events on every survivor: rank 0's failure, then the
    # second and third ranks' in one recovery (the third died during it).
    first = reports[survivors[0]]
    events = first["events"]
    assert len(events) == 2, (f"expected 2 recoveries (the third kill during the second), got "
                              f"{len(events)}: {events}")
    e1, e2 = events
    assert e1["failed"] == [0], e1
    assert sorted(e1["leaving"]) == [r for r in partners if replica(r) == replica(0)], e1
    assert sorted(e2["failed"]) == sorted(killed[1:]), e2
    assert e2["epoch_before"] == e1["epoch"], (e1, e2)
    assert e2["attempts"] >= 2, ("the third rank died during the second recovery's regroup: "
                                 f"it must have started again, {e2}")
    assert e2["epoch"] == e2["epoch_before"] + e2["attempts"], e2
    assert e2["members"] == survivors, e2
    assert e2["dp"] == NP // TP - 3 and e2["world"] == len(survivors), e2
    for r in survivors:
        mine = reports[r]["events"]
        assert [(x["failed"], x["leaving"], x["epoch"], x["members"]) for x in mine] == \
            [(x["failed"], x["leaving"], x["epoch"], x["members"]) for x in events], r
        assert reports[r]["epoch"] == e2["epoch"] and reports[r]["world"] == len(survivors)

    # Replicas are bitwise equal (per tp rank); counters match the steps.
    by_tp = {}
    for r in survivors:
        rep = reports[r]
        by_tp.setdefault(rep["coords"]["tp"], set()).add(rep["param_hash"])
        assert rep["steps"] == STEPS
        assert rep["scheduler_epoch"] == STEPS
        assert math.isclose(rep["lr"], LR * min(1.0, (STEPS + 1) / 10)), rep["lr"]
        assert rep["sampler_position"] == STEPS * BATCH
        assert [s[0] for s in rep["trained_samples"]] == list(range(STEPS))
    assert all(len(h) == 1 for h in by_tp.values()), by_tp

    # The same parameters as the reference run.
    final = checkpoint.load(os.path.join(job.report, "final"))["model"]
    assert sorted(final) == sorted(reference)
    for name in reference:
        torch.testing.assert_close(final[name], reference[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")

    lines = job.recoveries()
    assert [ln["failed"] for ln in lines] == [e1["failed"], e2["failed"]], lines
    for (rank, t, what), line in zip([kills[0], kills[1]], lines):
        print(f"recovery ({LAUNCHER}): rank {rank} killed {what}; all survivors knew after "
              f"{line['known_by_all_at'] - t:.3f} s, new world's first collective after "
              f"{line['rebuilt_at'] - t:.3f} s; attempts {line['attempts']}; phases: detect "
              f"{line['detect_s']:.3f} agree {line['agree_s']:.3f} rebuild "
              f"{line['rebuild_s']:.3f} restore {line['restore_s']:.3f} s; source "
              f"{line['cause']['source']}")
    print(f"wall time of the job: {job.lines[-1]['_t'] - job.started:.1f} s")

    # The elastic layer's file store (mpirun: in the temporary directory,
    # named after the job) is removed when the job ends.
    if store_dir is not None:
        assert not os.path.exists(store_dir), \
            f"the job left its elastic store behind: {store_dir}: {os.listdir(store_dir)[:5]}"
