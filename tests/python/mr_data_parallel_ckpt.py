"""ZeRO-1 state through strata.checkpoint, and re-partitioning for a new
dp size, on 4 ranks under mpirun.

A model trained 5 steps at dp4 (DataParallel + DistributedOptimizer(AdamW))
is saved with its sharded optimizer state; then, in the same job, it is
continued 5 more steps after loading at dp4 (the losses are bit for bit the
uninterrupted run's), at dp2 and dp3 (on 2 and 3 of the ranks, each
loading its new boxes), at dp2 on a World of another layout (a collective
load), and after rebuild() moves the live state from dp4 to dp2 or drops
it and a checkpoint restores it (in-process recovery). Every continued
run's losses equal those of the uninterrupted run, computed in this test by
the unsharded model trained in one process, within 1e-12 relative (float64;
a dp change reorders the gradient sums, so bitwise equality holds only at
the same dp). A GPT with tensor-parallel shards saved at dp2 x tp2 loads at
dp1 x tp2, and at tp1 the ZeRO-1 state is refused with a message.

    mpirun -np 4 python -m pytest tests/python/mr_data_parallel_ckpt.py
"""

import os
import shutil
import tempfile

import pytest
import torch

import strata
import strata.checkpoint as ckpt
import strata.nn as snn
from dp_models import agree, gpt, gpt_batch, gpt_loss, local, mlp, mlp_batch, mse

torch.set_num_threads(1)
N = int(os.environ.get("STRATA_TEST_NP", "1"))
SAVE_AT, STEPS, LR, TOL = 5, 10, 1e-2, 1e-12
pytestmark = pytest.mark.skipif(N != 4, reason="needs 4 ranks")


@pytest.fixture(scope="module")
def world():
    w = strata.init(strata.Mesh(4), timeout=120)
    yield w
    w.destroy()


def shared_dir(world):
    name = tempfile.mkdtemp(prefix="strata-dpckpt-") if world.rank == 0 else ""
    buf = torch.zeros(256, dtype=torch.uint8)
    buf[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    world.group("world").broadcast(buf, src=0)
    return bytes(buf[buf != 0].tolist()).decode()


def global_loss(group, loss):
    """The mean over the dp group of the ranks' losses (= the loss of the
    whole batch, the parts being equal)."""
    t = torch.tensor([loss], dtype=torch.float64)
    group.all_reduce(t, op="avg")
    return t.item()


def train(model, opt, group, steps, rows=12):
    """Steps ``steps`` (global step numbers) on ``group``'s parts of the
    batches; returns the whole batch's losses."""
    losses = []
    for step in steps:
        x, y = mlp_batch(step, rows)
        x, y = local(x, group.rank, group.size), local(y, group.rank, group.size)
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        losses.append(global_loss(group, loss.item()))
    return losses


def zero1(group):
    m = snn.DataParallel(mlp(seed=3), group, bucket_bytes=768)
    return m, strata.optim.DistributedOptimizer(torch.optim.AdamW, m.parameters(), group, lr=LR)


@pytest.fixture(scope="module")
def saved(world):
    """(directory, the uninterrupted run's losses of steps SAVE_AT..STEPS-1
    at dp4, the unsharded model's)."""
    directory = shared_dir(world)
    m, opt = zero1(world)
    train(m, opt, world.group("dp"), range(SAVE_AT))
    ckpt.save({"model": m, "optimizer": opt}, directory, step=SAVE_AT, world=world)
    dp4 = train(m, opt, world.group("dp"), range(SAVE_AT, STEPS))
    ref = mlp(seed=3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = mlp_batch(step, 12)
        ropt.zero_grad()
        loss = mse(ref(x), y)
        loss.backward()
        ropt.step()
        losses.append(loss.item())
    yield directory, dp4, losses[SAVE_AT:]
    world.group().barrier()
    if world.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)


def close(got, want, what):
    return [f"{what}: step {SAVE_AT + i} loss {a!r} vs uninterrupted {b!r}"
            for i, (a, b) in enumerate(zip(got, want)) if not abs(a - b) <= TOL * abs(b)] + (
        [f"{what}: {len(got)} losses, expected {len(want)}"] if len(got) != len(want) else [])


def subgroup(world, size):
    """The first ``size`` ranks as a group (None on the others)."""
    return world.group("world").split(0 if world.rank < size else -1, name=f"dp{size}")


def test_dp4_checkpoint_continues_bit_for_bit_at_dp4(world, saved):
    directory, dp4, _ = saved
    m, opt = zero1(world)
    ckpt.load(directory, {"model": m, "optimizer": opt}, world=world)
    got = train(m, opt, world.group("dp"), range(SAVE_AT, STEPS))
    agree(world, [f"step {SAVE_AT + i}: {a!r} != {b!r}" for i, (a, b) in enumerate(zip(got, dp4))
                  if a != b])


@pytest.mark.parametrize("size", [2, 3])
def test_dp4_checkpoint_continues_at_smaller_dp(world, saved, size):
    directory, _, ref = saved
    problems = []
    group = subgroup(world, size)
    if group is not None:
        m, opt = zero1(group)  # a fresh model and optimizer at the new dp size
        ckpt.load(directory, {"model": m, "optimizer": opt})  # each rank its own boxes
        problems += close(train(m, opt, group, range(SAVE_AT, STEPS)), ref, f"dp{size}")
    agree(world, problems)


def test_dp4_checkpoint_loads_collectively_on_another_mesh(world, saved):
    """A World of dp2 x tp2 (the MLP replicated over tp): a collective load,
    each rank reading its dp2 boxes."""
    directory, _, ref = saved
    with strata.init(strata.Mesh(4, tp=2), timeout=120) as w2:
        m, opt = zero1(w2)
        ckpt.load(directory, {"model": m, "optimizer": opt}, world=w2)
        problems = close(train(m, opt, w2.group("dp"), range(SAVE_AT, STEPS)), ref, "dp2 x tp2")
    agree(world, problems)


def test_rebuild_moves_the_state_to_dp2(world, saved):
    """dp4 trained to the checkpoint's step, then rebuild() for the first two
    ranks: the other two hand their shards over and leave."""
    _, _, ref = saved
    m, opt = zero1(world)
    train(m, opt, world.group("dp"), range(SAVE_AT))
    before = opt.state_bytes()
    group = subgroup(world, 2)
    m.rebuild(group, keep_state=True)
    problems = []
    if group is not None:
        if not opt.state_bytes() > before:
            problems.append(f"state {opt.state_bytes()} bytes at dp2, {before} at dp4")
        problems += close(train(m, opt, group, range(SAVE_AT, STEPS)), ref, "rebuilt dp2")
    elif opt.state_bytes() != 0:
        problems.append(f"a rank that left holds {opt.state_bytes()} bytes of state")
    agree(world, problems)


def test_rebuild_after_a_loss_restores_from_the_checkpoint(world, saved):
    """The old group is taken as broken (keep_state=False): the state is
    dropped, step() refuses until a checkpoint is loaded, then training
    continues at dp3."""
    directory, _, ref = saved
    m, opt = zero1(world)
    train(m, opt, world.group("dp"), range(SAVE_AT))
    group = subgroup(world, 3)
    m.rebuild(group, keep_state=False)
    problems = []
    if group is not None:
        x, y = mlp_batch(SAVE_AT, 12)
        mse(m(x), y).backward()
        with pytest.raises(strata.InvalidArgument, match="dropped by rebuild.*load a checkpoint"):
            opt.step()
        opt.zero_grad()
        ckpt.load(directory, {"model": m, "optimizer": opt})
        problems += close(train(m, opt, group, range(SAVE_AT, STEPS)), ref, "restored dp3")
    agree(world, problems)


def test_tensor_parallel_state_reshards_across_dp(world):
    """A GPT over dp2 x tp2 with ZeRO-1 saved after 3 steps loads on one tp
    group (dp1 x tp2) and continues as the unsharded GPT does; under tp1
    the load is refused (ZeRO-1 state reshards across dp, not tp)."""
    directory = shared_dir(world)
    problems = []
    rows, steps = 4, 6
    with strata.init(strata.Mesh(4, tp=2), timeout=120) as w:
        dp, tp = w.group("dp"), w.group("tp")

        def run(model, opt, group, which):
            out = []
            for step in which:
                ids, targets = gpt_batch(step, rows)
                opt.zero_grad()
                loss = gpt_loss(model, local(ids, group.rank, group.size),
                                local(targets, group.rank, group.size))
                loss.backward()
                opt.step()
                out.append(global_loss(group, loss.item()))
            return out

        m = snn.DataParallel(gpt(tp), w, bucket_bytes=4096)
        opt = strata.optim.DistributedOptimizer(torch.optim.AdamW, m.parameters(), w, lr=LR)
        run(m, opt, dp, range(3))
        ckpt.save({"model": m, "optimizer": opt}, directory, step=3, world=w)
        ref = gpt(None)
        ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
        want = []
        for step in range(steps):
            ids, targets = gpt_batch(step, rows)
            ropt.zero_grad()
            loss = gpt_loss(ref, ids, targets)
            loss.backward()
            ropt.step()
            want.append(loss.item())
        alone = w.group("world").split(w.rank, name="dp1")  # a dp group of one
        if dp.rank == 0:
            m1 = snn.DataParallel(gpt(tp), alone, bucket_bytes=4096)
            opt1 = strata.optim.DistributedOptimizer(torch.optim.AdamW, m1.parameters(), alone,
                                                     lr=LR)
            ckpt.load(directory, {"model": m1, "optimizer": opt1})
            got = run(m1, opt1, alone, range(3, steps))
            problems += [f"dp1 x tp2 step {3 + i}: {a!r} vs {b!r}"
                         for i, (a, b) in enumerate(zip(got, want[3:]))
                         if not abs(a - b) <= 1e-6 * abs(b)]
    with strata.init(strata.Mesh(4), timeout=120) as w1:  # tp 1: the model reshards, ZeRO-1 not
        m1 = snn.DataParallel(gpt(w1.group("tp")), w1)
        opt1 = strata.optim.DistributedOptimizer(torch.optim.AdamW, m1.parameters(), w1, lr=LR)
        with pytest.raises(strata.CheckpointError, match=r"global shape \(2, \d+\).*now needs "
                           r"\(1, \d+\).*reshards across data-parallel sizes"):
            ckpt.load(directory, {"model": m1, "optimizer": opt1}, world=w1)
    world.group().barrier()
    if world.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    agree(world, problems)
