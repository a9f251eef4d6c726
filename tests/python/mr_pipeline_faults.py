"""Under mpirun on 4 ranks (pp=4), run with and without ULFM (--with-ft
ulfm): a failure inside one rank's stage ends the step on every rank with
strata.PipelineError naming the rank, the action, its stage and its
microbatch, instead of a hang.

- One rank raises in a forward: that rank's error has the exception as its
  cause. Under ULFM the others stop at once, their pending operations
  revoked (ABORTED); without it Open MPI does not pass the revocation on,
  and they stop at the step's deadline (DEADLINE_EXCEEDED).
- One rank stalls past the deadline: its neighbours stop at the deadline,
  and so does the staller once it comes back.

Each test breaks the pipeline group of a world of its own; the ranks agree
on the verdict over the module's world.
"""

import os
import time

import pytest
import torch

import strata
from strata import pipeline
from pipeline_models import loss_fn, make_batch, make_stages

N = int(os.environ["STRATA_TEST_NP"])
ULFM = os.environ.get("OMPI_MCA_mpi_ft_enable", "0") not in ("0", "false", "")


@pytest.fixture(scope="module")
def world():
    w = strata.init(timeout=120)
    yield w
    w.destroy()


def agree(world, problems):
    flag = torch.tensor([1 if problems else 0], dtype=torch.int32)
    world.group().all_reduce(flag, op="max")
    assert not problems, problems[:5]
    assert flag.item() == 0, "failed on another rank (see its report)"


class Faulty(torch.nn.Module):
    """Runs `inner`; once armed, calls `fault` before forward number `at`."""

    def __init__(self, inner, at, fault):
        super().__init__()
        self.inner, self.at, self.fault, self.calls = inner, at, fault, 0
        self.armed = False

    def forward(self, *args):
        if self.armed:
            self.calls += 1
            if self.calls == self.at + 1:
                self.fault()
        return self.inner(*args)


def run_failing_step(faulty_rank, at, fault, timeout):
    """One 1F1B step (m=6) in a fresh world whose `faulty_rank` calls
    `fault` before its forward of microbatch `at`. Returns the error.

    A healthy step with a generous deadline runs first, so the failing
    step's deadline (`timeout`) needs to cover only a warm step."""
    w = strata.init(strata.Mesh(N, pp=N), timeout=60)
    try:
        pp = w.group("pp")
        module = make_stages(N)[pp.rank]
        if pp.rank == faulty_rank:
            module = Faulty(module, at, fault)
        stage = pipeline.PipelineStage(module, pp.rank, w)
        inputs, targets = make_batch(12)
        pipeline.Schedule1F1B(stage, 6, loss_fn, timeout=60).step(inputs, targets)
        if pp.rank == faulty_rank:
            module.armed = True
        schedule = pipeline.Schedule1F1B(stage, 6, loss_fn, timeout=timeout)
        try:
            schedule.step(inputs, targets)
        except strata.PipelineError as e:
            return e
        return None
    finally:
        w.destroy()


def test_an_exception_in_a_stage_ends_every_ranks_step(world):
    def boom():
        raise ValueError("boom")

    # Under ULFM a deadline far beyond the test's timeout: only the
    # revocation can end the other ranks' steps in time.
    e = run_failing_step(2, 3, boom, timeout=200 if ULFM else 5)
    problems = []
    r = world.rank
    msg = str(e)
    if e is None:
        problems.append(f"rank {r}: the step did not fail")
    elif f"pipeline rank {r} (world rank {r}, group 'pp') at action #" not in msg:
        problems.append(f"rank {r}: no rank and action in: {msg}")
    elif r == 2:
        if "2F3 (stage 2, microbatch 3): forward failed: ValueError: boom" not in msg:
            problems.append(f"rank 2: {msg}")
        if not isinstance(e.__cause__, ValueError):
            problems.append(f"rank 2: cause is {e.__cause__!r}")
    else:
        if f"(stage {r}, microbatch " not in msg:
            problems.append(f"rank {r}: no stage and microbatch in: {msg}")
        want = "ABORTED" if ULFM else "DEADLINE_EXCEEDED"
        if e.code != want:
            problems.append(f"rank {r}: code {e.code}, want {want}: {msg}")
    agree(world, problems)


def test_a_rank_that_stalls_past_the_deadline(world):
    timeout = 5
    e = run_failing_step(1, 0, lambda: time.sleep(2 * timeout), timeout=timeout)
    r = world.rank
    problems = []
    if e is None:
        problems.append(f"rank {r}: the step did not fail")
    else:
        if f"pipeline rank {r} (world rank {r}, group 'pp') at action #" not in str(e):
            problems.append(f"rank {r}: {e}")
        if e.code not in ("DEADLINE_EXCEEDED", "ABORTED"):
            problems.append(f"rank {r}: code {e.code}: {e}")
    # The ranks next to the staller wait for it; one of them hits the
    # deadline first.
    codes = torch.tensor([1 if e is not None and e.code == "DEADLINE_EXCEEDED" else 0])
    world.group().all_reduce(codes)
    if codes.item() == 0:
        problems.append("no rank reported the deadline")
    agree(world, problems)
