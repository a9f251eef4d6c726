"""In-process recovery on meshes other than dp4 x tp2, and kills that land
inside an operation: examples/elastic/train.py on 8 ranks, one rank killed
from outside with SIGKILL, under ``mpirun --with-ft ulfm`` (MPI, ULFM) or
``torchrun --standalone`` (Gloo). STRATA_ELASTIC_LAUNCHER picks the
launcher, STRATA_ELASTIC_CASE the case; CMake registers one test per case:

- ``pp-send``: dp2 x tp2 x pp2 (1F1B), killed inside a pipeline send;
- ``pp-random``: dp2 x tp2 x pp2, killed at a random moment;
- ``ep-random``: dp8 x ep2 with a mixture-of-experts layer (experts split
  over ep, tokens moved by all-to-alls), killed at a random moment;
- ``allreduce``: dp4 x tp2, killed inside DataParallel's dp all-reduce;
- ``checkpoint``: dp4 x tp2 saving asynchronous checkpoints, killed inside
  the write of one (its first data file partly written).

"Inside an operation" is a point the example offers for tests (``--hold
OP:RANK:STEP``): the chosen rank announces that it is there and waits; the
test, which polls for the announcement, kills it while it waits. It is a
chosen point (see the example's docstring for each): the random-moment
cases cover arbitrary points.

Checked in every case:
- the job exits 0; the killed rank is gone, the other ranks of its replica
  left (exit 0, saying why), every other rank finished;
- every survivor holds the same recovery event (failed set, leaving ranks,
  epoch, members) and ends on the expected mesh at that epoch;
- parameters are bitwise equal across the data-parallel replicas (per
  model-parallel coordinate: tp, pp, ep);
- the step counter, the scheduler's step and learning rate and the
  sampler's position are those of ``STEPS`` committed steps, and every
  committed step is in each survivor's record once, in order;
- the final parameters equal, within floating-point tolerance, those of a
  reference computed here: the same example in one process (no tp, pp or
  ep) on the same global batches without any failure;
- a hold case: the kill landed while the rank waited inside the operation;
  checkpoint: the checkpoints saved after the recovery commit and verify,
  and the last one holds the final parameters.
"""

import math
import os
import random
import signal
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_driver as D  # noqa: E402

import strata  # noqa: E402
from strata import checkpoint  # noqa: E402

LAUNCHER = os.environ.get("STRATA_ELASTIC_LAUNCHER", "mpirun")
CASE = os.environ.get("STRATA_ELASTIC_CASE", "pp-send")
NP = 8
STEPS = 20
LR = 0.05
BATCH = 48
ARGS = ["--hidden", "32", "--layers", "2", "--batch", str(BATCH), "--lr", str(LR)]
CHECKPOINT_EVERY = 4

# case: (mesh flags, flags of the one-process reference, what is held)
CASES = {
    "pp-send": (["--tp", "2", "--pp", "2"], [], "send"),
    "pp-random": (["--tp", "2", "--pp", "2"], [], None),
    "ep-random": (["--tp", "1", "--ep", "2", "--experts", "4"], ["--experts", "4"], None),
    "allreduce": (["--tp", "2", "--bucket-kib", "4"], [], "allreduce"),
    "checkpoint": (["--tp", "2", "--checkpoint-every", str(CHECKPOINT_EVERY)], [], "checkpoint"),
}
MESH, REFERENCE_ARGS, HOLD = CASES[CASE]


def mesh_of(flags):
    """The strata.Mesh of NP ranks the example makes from ``flags``."""
    f = dict(zip(flags[::2], flags[1::2]))
    return strata.Mesh(NP, tp=int(f.get("--tp", 2)), pp=int(f.get("--pp", 1)),
                       ep=int(f.get("--ep", 1)))


def replica_of(mesh, rank):
    """The ranks of ``rank``'s model replica: those joined to it by a
    model-parallel group (tp, cp, pp; expert tp, ep), dropped whole when one
    of them fails."""
    groups = mesh.groups("tp-cp-pp") + mesh.expert_groups("tp-ep-pp")
    replica, grew = {rank}, True
    while grew:
        grew = False
        for g in groups:
            if replica & set(g) and not set(g) <= replica:
                replica |= set(g)
                grew = True
    return sorted(replica)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final parameters of the same training in one process."""
    out = str(tmp_path_factory.mktemp("reference"))
    job = D.Job("none", 1, ["--steps", str(STEPS), "--tp", "1"] + ARGS + REFERENCE_ARGS, out,
                timeout=120)
    rc = job.finish()
    assert rc == 0, job.tail()
    return checkpoint.load(os.path.join(job.report, "final"))["model"]


def load_all(directory):
    """Every tensor of a checkpoint. A checkpoint of a pipelined model keeps
    rank 0's structure (its stage's tensors), so a load with state=None
    returns stage 0's tensors only: ask for every saved key instead."""
    saved = checkpoint.info(directory)["tensors"]
    state = {"model": {k[len("model."):]: torch.empty(shape, dtype=dtype)
                       for k, (dtype, shape) in saved.items() if k.startswith("model.")}}
    return checkpoint.load(directory, state)["model"]


def run_case(tmp):
    seed = int(os.environ.get("STRATA_ELASTIC_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    rank = rng.randrange(NP)
    args = ["--steps", str(STEPS)] + ARGS + MESH
    if HOLD == "checkpoint":
        step = rng.choice([CHECKPOINT_EVERY, 2 * CHECKPOINT_EVERY])
    else:
        step = rng.randrange(3, 9)
    if HOLD is not None:
        args += ["--hold", f"{HOLD}:{rank}:{step}"]
        what = f"inside {HOLD} at step {step}"
    else:
        # Steps long enough that the signal (up to 1 s after step 4) comes
        # while the job trains, not while it saves its final report.
        args += ["--step-sleep", "0.1"]
        what = "at a random moment"
    print(f"{LAUNCHER} {CASE}: seed {seed}, SIGKILL to rank {rank} {what}", flush=True)
    job = D.Job(LAUNCHER, NP, args, tmp, timeout=170)
    hold = None
    try:
        if HOLD is not None:
            killed_at, hold = D.kill_on_hold(job, signal.SIGKILL, timeout=150)
            assert hold["rank"] == rank and hold["op"] == HOLD, hold
        else:
            killed_at = D.kill_rank(job, rank, signal.SIGKILL, after_steps=4, when="random",
                                    rng=rng, timeout=150)
        rc = job.finish()
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
    return job, rc, rank, killed_at, hold


def test_survivors_recover_and_finish_like_the_reference(reference, tmp_path):
    job, rc, killed, killed_at, hold = run_case(str(tmp_path))
    print(job.tail(60))
    assert rc == 0, f"the job failed ({rc}):\n{job.tail()}"
    if hold is not None:
        # The rank was killed while it waited inside the operation (it would
        # have written hold.released on going on).
        assert not D.hold_released(job), (hold, killed_at)
        print(f"hold: {hold}; killed {killed_at - hold['time']:.3f} s after it began")
    mesh = mesh_of(MESH)
    replica = replica_of(mesh, killed)
    leaving = [r for r in replica if r != killed]
    survivors = sorted(set(range(NP)) - set(replica))
    reports = job.reports()
    assert sorted(reports) == survivors, (sorted(reports), job.tail())
    for r in leaving:
        assert any(f"rank {r} leaves the job" in line for line in job.stderr), (r, job.tail())

    # One failed set and one epoch, everywhere; the mesh lost one replica.
    first = reports[survivors[0]]
    assert len(first["events"]) == 1, first["events"]
    event = first["events"][0]
    assert event["failed"] == [killed], event
    assert event["leaving"] == leaving, event
    assert event["epoch"] == 1 + event["attempts"], event
    assert event["members"] == survivors, event
    before, after = event["mesh_before"], event["mesh_after"]
    # dp shrinks with the world (dp8 x ep2 loses two dp ranks: an ep pair).
    assert after["world"] == len(survivors), event
    assert after["dp"] == before["dp"] * len(survivors) // NP, event
    for axis in ("tp", "pp", "ep", "cp"):
        assert after[axis] == before[axis] == getattr(mesh, axis), (axis, event)
    for r in survivors:
        e = reports[r]["events"]
        assert [(x["failed"], x["leaving"], x["epoch"], x["members"]) for x in e] == \
            [(x["failed"], x["leaving"], x["epoch"], x["members"]) for x in first["events"]], r
        assert reports[r]["epoch"] == event["epoch"] and reports[r]["world"] == len(survivors)

    # Replicas are bitwise equal (per model-parallel coordinate); the
    # counters match the committed steps.
    by_place = {}
    for r in survivors:
        rep = reports[r]
        c = rep["coords"]
        by_place.setdefault((c["tp"], c["pp"], c["ep"]), set()).add(rep["param_hash"])
        assert rep["steps"] == STEPS
        assert rep["scheduler_epoch"] == STEPS
        assert math.isclose(rep["lr"], LR * min(1.0, (STEPS + 1) / 10)), rep["lr"]
        assert rep["sampler_position"] == STEPS * BATCH
        assert [s[0] for s in rep["trained_samples"]] == list(range(STEPS)), r
    assert all(len(h) == 1 for h in by_place.values()), by_place
    if after["dp"] > 1:  # more than one replica left: the comparison compared
        assert any(len([r for r in survivors if (reports[r]["coords"]["tp"],
                                                 reports[r]["coords"]["pp"],
                                                 reports[r]["coords"]["ep"]) == k]) > 1
                   for k in by_place)

    # The same parameters as the reference run.
    final = load_all(os.path.join(job.report, "final"))
    assert sorted(final) == sorted(reference)
    for name in reference:
        torch.testing.assert_close(final[name], reference[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")

    if HOLD == "checkpoint":
        # The save the kill interrupted never committed; those after the
        # recovery did (keep_last 2), and the last holds the final model.
        ckpt = os.path.join(job.report, "ckpt")
        steps = checkpoint.list_steps(ckpt)
        assert steps == [STEPS - CHECKPOINT_EVERY, STEPS], steps
        checkpoint.verify(ckpt)
        saved = checkpoint.load(ckpt)  # the State: model0 is the DataParallel
        assert saved["step"] == STEPS, saved["step"]
        model = {k[len("module."):]: v for k, v in saved["model0"].items()}
        assert sorted(model) == sorted(final), sorted(saved["model0"])
        for name, t in final.items():
            torch.testing.assert_close(model[name], t, rtol=0, atol=0)
        assert event["restored_from"] == "memory", event

    # The recovery line, and the times from the signal (this process's
    # clock; the ranks run on this host): every survivor knew, the new
    # world's first collective completed, the first step after it completed.
    lines = job.recoveries()
    assert len(lines) == 1, job.tail()
    line = lines[0]
    known = line["known_by_all_at"] - killed_at
    rebuilt = line["rebuilt_at"] - killed_at
    i = next(k for k, ln in enumerate(job.lines) if ln is line)
    first_step = next(ln for ln in job.lines[i + 1:] if ln.get("event") == "step")["_t"] \
        - killed_at
    print(f"recovery ({LAUNCHER} {CASE}, {before['describe']} -> {after['describe']}): signal "
          f"to rank {killed} at {killed_at:.3f}; from it: all survivors knew after {known:.3f} "
          f"s, new world's first collective done after {rebuilt:.3f} s, first step done after "
          f"{first_step:.3f} s; phases: detect {line['detect_s']:.3f} s (from the first "
          f"report), agree {line['agree_s']:.3f} s, rebuild {line['rebuild_s']:.3f} s, restore "
          f"{line['restore_s']:.3f} s; source {event['cause']['source']}")
    # Bounded detection: a dead rank within seconds on this loaded machine.
    assert 0 <= known < 4.0, (known, line)
