"""Under mpirun on 4 ranks (pp=4): strata.pipeline's schedules train a small
model exactly as the same model run unpipelined in one process (computed
here on every rank): the losses and every parameter gradient after one
step, for GPipe, 1F1B (also with fewer microbatches than ranks) and
interleaved 1F1B; the mean or the plain sum of the gradients; 20 steps of
SGD following the unpipelined loss curve, with batch sizes (so shapes)
changing from step to step; and the peak number of activations alive
during execution equal to the simulator's.

Every rank runs every test in the same order and the ranks agree on each
test's verdict (``agree``), so a failure on one rank cannot leave the
others waiting.
"""

import os

import pytest
import torch

import strata
from strata import pipeline
from pipeline_models import copy_of, loss_fn, make_batch, make_stages, reference_step

N = int(os.environ["STRATA_TEST_NP"])
CLASSES = {"gpipe": pipeline.ScheduleGPipe, "1f1b": pipeline.Schedule1F1B,
           "interleaved": pipeline.ScheduleInterleaved1F1B, "zb": pipeline.ScheduleZeroBubble}
# (kind, stages per rank, microbatches)
CASES = [("gpipe", 1, 6), ("1f1b", 1, 8), ("1f1b", 1, N - 1), ("interleaved", 2, 2 * N),
         ("zb", 1, 8), ("zb", 1, N - 1)]


@pytest.fixture(scope="module")
def world():
    w = strata.init(strata.Mesh(N, pp=N), timeout=120)
    yield w
    w.destroy()


def agree(world, problems):
    """Fails on every rank if any rank found a problem."""
    flag = torch.tensor([1 if problems else 0], dtype=torch.int32)
    world.group().all_reduce(flag, op="max")
    assert not problems, problems[:5]
    assert flag.item() == 0, "failed on another rank (see its report)"


def build(world, kind, v, m, scale_grads=True, seed=0):
    """The reference model, this rank's pipelined copy of it, and the
    schedule over this rank's stages."""
    pp = world.group("pp")
    n = pp.size * v
    reference = make_stages(n, seed=seed)
    piped = copy_of(reference)
    mine = list(range(pp.rank, n, pp.size))
    stages = [pipeline.PipelineStage(piped[s], s, world, num_stages=n) for s in mine]
    arg = stages if kind == "interleaved" else stages[0]
    schedule = CLASSES[kind](arg, m, loss_fn, scale_grads=scale_grads, timeout=60)
    return reference, piped, mine, schedule


def compare_grads(problems, reference, piped, mine, tol=1e-10):
    for s in mine:
        for (name, a), (_, b) in zip(piped[s].named_parameters(), reference[s].named_parameters()):
            if a.grad is None or not torch.allclose(a.grad, b.grad, rtol=tol, atol=tol):
                err = None if a.grad is None else (a.grad - b.grad).abs().max().item()
                problems.append(f"stage {s} {name}: gradient differs (max error {err})")


def compare_losses(problems, got, want, tol=1e-12):
    if len(got) != len(want):
        problems.append(f"{len(got)} losses, want {len(want)}")
        return
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.allclose(a, b, rtol=tol, atol=tol):
            problems.append(f"microbatch {i}: loss {a.item()} != {b.item()}")


def check_peak(problems, schedule, rank):
    want = schedule.schedule.peak_in_flight()[rank]
    if schedule.stats.peak_in_flight != want:
        problems.append(f"runner held {schedule.stats.peak_in_flight} activations, "
                        f"simulator says {want}")
    if schedule.peak_live_activations != want:
        problems.append(f"{schedule.peak_live_activations} activations were alive at once in "
                        f"Python, simulator says {want}")


@pytest.mark.parametrize("kind,v,m", CASES, ids=[f"{k}-v{v}-m{m}" for k, v, m in CASES])
def test_one_step_equals_unpipelined(world, kind, v, m):
    reference, piped, mine, schedule = build(world, kind, v, m)
    inputs, targets = make_batch(13)  # 13 rows: microbatches of different sizes
    losses = schedule.step(inputs, targets)
    want = reference_step(reference, inputs, targets, m)
    problems = []
    last = schedule.num_stages - 1 in mine
    if last:
        compare_losses(problems, losses, want)
    elif losses is not None:
        problems.append(f"rank without the last stage returned {losses!r}")
    compare_grads(problems, reference, piped, mine)
    check_peak(problems, schedule, world.group("pp").rank)
    agree(world, problems)


def test_scale_grads_false_sums(world):
    reference, piped, mine, schedule = build(world, "1f1b", 1, 4, scale_grads=False)
    inputs, targets = make_batch(8)
    schedule.step(inputs, targets)
    reference_step(reference, inputs, targets, 4, scale_grads=False)
    problems = []
    compare_grads(problems, reference, piped, mine)
    agree(world, problems)


@pytest.mark.parametrize("kind,v,m", [("gpipe", 1, 4), ("1f1b", 1, 8), ("interleaved", 2, N),
                                     ("zb", 1, 8)])
def test_twenty_steps_follow_the_unpipelined_loss_curve(world, kind, v, m):
    reference, piped, mine, schedule = build(world, kind, v, m, seed=3)
    opt = torch.optim.SGD([p for s in mine for p in piped[s].parameters()], lr=0.2)
    ref_opt = torch.optim.SGD([p for s in reference for p in s.parameters()], lr=0.2)
    initial = {s: copy_of([piped[s]])[0] for s in mine}
    problems = []
    for step in range(20):
        inputs, targets = make_batch(m + 3 + step % 5, seed=100 + step)
        opt.zero_grad()
        ref_opt.zero_grad()
        losses = schedule.step(inputs, targets)
        want = reference_step(reference, inputs, targets, m)
        opt.step()
        ref_opt.step()
        if losses is not None:
            compare_losses(problems, losses, want, tol=1e-9)
    for s in mine:
        for (name, a), (_, b) in zip(piped[s].named_parameters(),
                                     reference[s].named_parameters()):
            if not torch.allclose(a, b, rtol=1e-9, atol=1e-9):
                problems.append(f"after 20 steps, stage {s} {name} differs")
        # The updates were real (equal curves of a model that never moves
        # would prove nothing).
        moved = max((a - b).abs().max().item() for a, b in
                    zip(piped[s].parameters(), initial[s].parameters()))
        if moved < 1e-3:
            problems.append(f"stage {s}'s parameters moved by at most {moved} in 20 steps")
    agree(world, problems)


def test_activations_are_released_after_each_step(world):
    reference, piped, mine, schedule = build(world, "1f1b", 1, 8)
    inputs, targets = make_batch(8)
    for _ in range(2):
        schedule.step(inputs, targets)
    problems = []
    if schedule._live.now != 0:
        problems.append(f"{schedule._live.now} activations still alive after the step")
    check_peak(problems, schedule, world.group("pp").rank)
    agree(world, problems)
