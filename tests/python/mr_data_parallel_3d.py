"""strata.nn.DataParallel with pipeline and tensor parallelism on 8 ranks
under mpirun: dp2 x pp2 x tp2, one DataParallel per pipeline stage (a
GPT with sequence parallelism cut in two stages), 20 AdamW steps of
strata's 1F1B schedule with plain AdamW and with ZeRO-1, and of its
zero-bubble schedule with ZeRO-1.
Parameters equal, within 1e-6 relative, those of torch's
DistributedDataParallel (gloo, the same dp groups, the unsharded GPT on
each dp rank's part of the batch) and of the unsharded GPT trained on the
whole batch in one process, both computed in this test; the schedules
reduce once per step.

    mpirun -np 8 python -m pytest tests/python/mr_data_parallel_3d.py
"""

import os

import pytest
import torch

import strata
import strata.nn as snn
from dp_models import agree, compare, ddp, gpt, gpt_batch, gpt_loss, local, strip
from gpt_stages import GPTStage
from strata import pipeline

torch.set_num_threads(1)
N = int(os.environ.get("STRATA_TEST_NP", "1"))
STEPS, LR, TOL, MICRO, ROWS = 20, 1e-2, 1e-6, 2, 8
pytestmark = pytest.mark.skipif(N != 8, reason="needs 8 ranks")


@pytest.fixture(scope="module")
def world():
    w = strata.init(strata.Mesh(8, tp=2, pp=2), timeout=120)
    yield w
    w.destroy()


@pytest.fixture(scope="module")
def references(world):
    """The unsharded GPT on the whole batch, and DDP over dp on each dp
    rank's part, both after STEPS steps."""
    ref = gpt(None)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(STEPS):
        ids, targets = gpt_batch(step, ROWS)
        opt.zero_grad()
        gpt_loss(ref, ids, targets).backward()
        opt.step()
    dp = world.group("dp")
    d = ddp(gpt(None), world, world.mesh)
    dopt = torch.optim.AdamW(d.parameters(), lr=LR)
    for step in range(STEPS):
        ids, targets = gpt_batch(step, ROWS)
        dopt.zero_grad()
        gpt_loss(d, local(ids, dp.rank, dp.size), local(targets, dp.rank, dp.size)).backward()
        dopt.step()
    return ref, d.module


# Zero-bubble reduces after its last W, as it does with plain AdamW: one
# run of it (with ZeRO-1) keeps the test within a minute on 2 cores.
@pytest.mark.parametrize("schedule_cls, zero", [(pipeline.Schedule1F1B, False),
                                                (pipeline.Schedule1F1B, True),
                                                (pipeline.ScheduleZeroBubble, True)])
def test_dp2_pp2_tp2_equals_ddp_and_unsharded(world, references, schedule_cls, zero):
    ref, ddp_model = references
    tp, pp, dp = world.group("tp"), world.group("pp"), world.group("dp")
    stage_module = GPTStage(gpt(tp), pp.rank, pp.size)
    m = snn.DataParallel(stage_module, world, bucket_bytes=4096, record_events=True)
    opt = (strata.optim.DistributedOptimizer(torch.optim.AdamW, m.parameters(), world, lr=LR)
           if zero else torch.optim.AdamW(m.parameters(), lr=LR))
    stage = pipeline.PipelineStage(m, pp.rank, world, num_stages=pp.size)
    schedule = schedule_cls(stage, MICRO, stage_module.loss)
    for step in range(STEPS):
        ids, targets = gpt_batch(step, ROWS)
        opt.zero_grad()
        schedule.step(local(ids, dp.rank, dp.size), local(targets, dp.rank, dp.size))
        opt.step()
    problems = []
    name = f"{schedule_cls.__name__}{' ZeRO-1' if zero else ''}"
    p, worst = compare(strip(m.named_parameters()), ref, TOL, f"{name} vs unsharded")
    problems += p
    problems += compare(strip(m.named_parameters()), ddp_model, TOL, f"{name} vs DDP")[0]
    launches = sum(1 for e in m.events if e[0] == "launch")
    if launches != STEPS * len(m.buckets):
        problems.append(f"{name}: {launches} bucket launches in {STEPS} steps of "
                        f"{len(m.buckets)} buckets (one reduction per step expected)")
    if world.rank == 0:
        print(f"\n{name}: largest relative difference to the unsharded GPT {worst:.1e}")
    agree(world, problems)
