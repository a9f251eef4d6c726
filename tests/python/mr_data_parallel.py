"""strata.nn.DataParallel and strata.optim.DistributedOptimizer on 4 ranks
under mpirun: 20 AdamW steps at dp4 and dp2 x tp2 equal torch's
DistributedDataParallel (gloo, the same dp groups, the unsharded model) and
the unsharded model trained on the whole batch in one process, all in this
test (parameters within 1e-6 relative); ZeRO-1 equals plain AdamW; four
microbatches accumulated under no_sync() equal one big batch; the first
bucket's reduction starts before backward ends (the recorded order of
events); every named error is provoked on real ranks.

    mpirun -np 4 python -m pytest tests/python/mr_data_parallel.py
"""

import os

import pytest
import torch

import strata
import strata.nn as snn
from dp_models import (DTYPE, agree, compare, ddp, gpt, gpt_batch, gpt_loss, local, mlp,
                       mlp_batch, mse, strip)

torch.set_num_threads(1)
N = int(os.environ.get("STRATA_TEST_NP", "1"))
STEPS, LR, TOL = 20, 1e-2, 1e-6
pytestmark = pytest.mark.skipif(N != 4, reason="needs 4 ranks")


@pytest.fixture(scope="module")
def world():
    w = strata.init(strata.Mesh(4), timeout=120)
    yield w
    w.destroy()


@pytest.fixture(scope="module")
def world_tp():
    w = strata.init(strata.Mesh(4, tp=2), timeout=120)
    yield w
    w.destroy()


def train_mlp(world, model, opt, steps=STEPS, microbatches=1):
    """``steps`` of this dp rank's part of the global batches; with
    ``microbatches`` > 1 the part is cut into that many, accumulated under
    no_sync() but the last (each loss scaled 1/m)."""
    dp = world.group("dp")
    losses = []
    for step in range(steps):
        x, y = mlp_batch(step)
        x, y = local(x, dp.rank, dp.size), local(y, dp.rank, dp.size)
        opt.zero_grad()
        xs, ys = x.tensor_split(microbatches), y.tensor_split(microbatches)
        for k in range(microbatches):
            if k < microbatches - 1:
                with model.no_sync():
                    loss = mse(model(xs[k]), ys[k]) / microbatches
                    loss.backward()
            else:
                loss = mse(model(xs[k]), ys[k]) / microbatches
                loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def reference_mlp(steps=STEPS):
    ref = mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(steps):
        x, y = mlp_batch(step)
        opt.zero_grad()
        mse(ref(x), y).backward()
        opt.step()
    return ref


def test_dp4_equals_ddp_and_unsharded(world):
    ref = reference_mlp()
    problems = []
    m = snn.DataParallel(mlp(), world, bucket_bytes=1024)
    train_mlp(world, m, torch.optim.AdamW(m.parameters(), lr=LR))
    assert len(m.buckets) >= 3, m.buckets  # several buckets, not one
    p, worst = compare(strip(m.named_parameters()), ref, TOL, "DataParallel vs unsharded")
    problems += p
    torch_ddp = ddp(mlp(), world, world.mesh)
    train_mlp(world, torch_ddp, torch.optim.AdamW(torch_ddp.parameters(), lr=LR))
    problems += compare(strip(torch_ddp.named_parameters()), ref, TOL, "DDP vs unsharded")[0]
    ddp_params = dict(strip(torch_ddp.named_parameters()))
    for name, q in strip(m.named_parameters()):
        err = ((q - ddp_params[name]).norm() / ddp_params[name].norm()).item()
        if not err <= TOL:
            problems.append(f"DataParallel vs DDP: '{name}' differs by {err:.2e}")
    if world.rank == 0:
        print(f"\ndp4: largest relative difference to the unsharded model {worst:.1e}")
    agree(world, problems)


@pytest.mark.parametrize("reduce_op", ["avg", "sum"])
def test_zero1_equals_adamw(world, reduce_op):
    """ZeRO-1 (DistributedOptimizer around DataParallel, and on its own)
    follows plain AdamW; each rank holds about a quarter of the state."""
    ref = reference_mlp()
    problems = []
    # "sum" reduces the sum: with losses scaled 1/dp it is the same mean.
    scale = world.size if reduce_op == "sum" else 1
    m = snn.DataParallel(mlp(), world, bucket_bytes=1024, reduce_op=reduce_op)
    opt = strata.optim.DistributedOptimizer(torch.optim.AdamW, m.parameters(), world, lr=LR)

    if scale != 1:
        dpr = world.group("dp")
        for step in range(STEPS):
            x, y = mlp_batch(step)
            x, y = local(x, dpr.rank, dpr.size), local(y, dpr.rank, dpr.size)
            opt.zero_grad()
            (mse(m(x), y) / scale).backward()
            opt.step()
    else:
        train_mlp(world, m, opt)
    problems += compare(strip(m.named_parameters()), ref, TOL, f"ZeRO-1 ({reduce_op})")[0]
    full = sum(2 * p.numel() * p.element_size() for p in m.parameters())  # exp_avg, exp_avg_sq
    got = opt.state_bytes()
    if not got <= 0.3 * full:
        problems.append(f"ZeRO-1 state {got} bytes on rank {world.rank}, replicated {full}")
    # Without a DataParallel: it reduces in step().
    plain = mlp()
    alone = strata.optim.DistributedOptimizer(torch.optim.AdamW, plain.parameters(), world, lr=LR,
                                              options={"bucket_bytes": 1024})
    train_mlp(world, _NoSync(plain), alone)
    problems += compare(plain.named_parameters(), ref, TOL, "ZeRO-1 without DataParallel")[0]
    agree(world, problems)


class _NoSync(torch.nn.Module):
    """A plain module with a no-op no_sync (for train_mlp)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)

    def no_sync(self):
        import contextlib
        return contextlib.nullcontext()


@pytest.mark.parametrize("zero", [False, True])
def test_accumulating_four_microbatches_equals_one_batch(world, zero):
    problems = []
    params = {}
    for m_count in (1, 4):
        m = snn.DataParallel(mlp(), world, bucket_bytes=1024, record_events=True)
        opt = (strata.optim.DistributedOptimizer(torch.optim.AdamW, m.parameters(), world, lr=LR)
               if zero else torch.optim.AdamW(m.parameters(), lr=LR))
        train_mlp(world, m, opt, microbatches=m_count)
        params[m_count] = dict(strip(m.named_parameters()))
        launches = sum(1 for e in m.events if e[0] == "launch")
        # One reduction per step: each bucket launched STEPS times, whatever m.
        if launches != STEPS * len(m.buckets):
            problems.append(f"{m_count} microbatches: {launches} bucket launches in {STEPS} "
                            f"steps of {len(m.buckets)} buckets")
    for name, a in params[4].items():
        b = params[1][name]
        err = ((a - b).norm() / b.norm()).item()
        if not err <= TOL:
            problems.append(f"'{name}': 4 microbatches vs one batch differ by {err:.2e}")
    problems += compare(params[4].items(), reference_mlp(), TOL, "accumulated vs unsharded")[0]
    agree(world, problems)


@pytest.mark.parametrize("zero", [False, True])
def test_first_bucket_starts_before_backward_ends(world, zero):
    """The order of events: the first bucket's collective is started (its
    Work exists) while gradients of later layers are still to come."""
    m = snn.DataParallel(mlp(layers=4), world, bucket_bytes=600, record_events=True)
    opt = (strata.optim.DistributedOptimizer(torch.optim.AdamW, m.parameters(), world, lr=LR)
           if zero else torch.optim.AdamW(m.parameters(), lr=LR))
    train_mlp(world, m, opt, steps=2)  # the first backward sets the layout
    # The first backward ends by setting the layout; what follows is step 2's.
    second = m.events[m.events.index(("layout", len(m.buckets))) + 1:]
    end = second.index(("backward_end",))
    launch0 = next(i for i, e in enumerate(second) if e[:2] == ("launch", 0))
    ready = [i for i, e in enumerate(second[:end]) if e[0] == "ready"]
    problems = []
    if len(m.buckets) < 3:
        problems.append(f"only {len(m.buckets)} buckets")
    if not launch0 < ready[-1] < end:
        problems.append(f"bucket 0 launched at event {launch0}, last gradient at {ready[-1]}, "
                        f"backward ended at {end}: {second[:end + 1]}")
    launched_before_end = sum(1 for e in second[:end] if e[0] == "launch")
    if not launched_before_end >= len(m.buckets) - 1:
        problems.append(f"{launched_before_end} of {len(m.buckets)} buckets launched during "
                        f"backward: {second[:end + 1]}")
    agree(world, problems)


def test_dp2_tp2_equals_ddp_and_unsharded(world_tp):
    """A GPT with sequence parallelism over tp2, DataParallel over dp2 (plain
    AdamW and ZeRO-1), against DDP over the same dp groups on the unsharded
    GPT, and the unsharded GPT on the whole batch."""
    world = world_tp
    dp, tp = world.group("dp"), world.group("tp")
    ref = gpt(None)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(STEPS):
        ids, targets = gpt_batch(step)
        ropt.zero_grad()
        gpt_loss(ref, ids, targets).backward()
        ropt.step()

    def run(model, opt):
        for step in range(STEPS):
            ids, targets = gpt_batch(step)
            ids, targets = local(ids, dp.rank, dp.size), local(targets, dp.rank, dp.size)
            opt.zero_grad()
            gpt_loss(model, ids, targets).backward()
            opt.step()

    problems = []
    for zero in (False, True):
        m = snn.DataParallel(gpt(tp), world, bucket_bytes=4096)
        opt = (strata.optim.DistributedOptimizer(torch.optim.AdamW, m.parameters(), world, lr=LR)
               if zero else torch.optim.AdamW(m.parameters(), lr=LR))
        run(m, opt)
        problems += compare(strip(m.named_parameters()), ref, TOL,
                            f"dp2 x tp2{' ZeRO-1' if zero else ''} vs unsharded")[0]
    d = ddp(gpt(None), world, world.mesh)
    run(d, torch.optim.AdamW(d.parameters(), lr=LR))
    problems += compare(strip(d.named_parameters()), ref, TOL, "DDP vs unsharded")[0]
    agree(world, problems)


# ---- named errors ------------------------------------------------------------------------
def test_parameter_shape_differs_across_ranks(world):
    d = 5 if world.rank == 2 else 4
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, d, dtype=DTYPE), torch.nn.Linear(d, 2, dtype=DTYPE))
    with pytest.raises(snn.ParameterMismatchError, match=r"'0.weight'.*shape \(4, 8\).*dp rank 0"
                       r".*\(5, 8\).*dp rank 2"):
        snn.DataParallel(m, world)


def test_unused_parameters_are_named_on_every_rank(world):
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4, dtype=DTYPE)
            self.used = torch.nn.Linear(4, 2, dtype=DTYPE)
            self.spare = torch.nn.Linear(4, 2, dtype=DTYPE)

        def forward(self, x):
            h = self.body(x)
            return self.used(h) if world.rank != 1 else self.used(h) + 0 * h.sum()

    x = torch.randn(3, 4, dtype=DTYPE)
    m = snn.DataParallel(TwoHeads(), world)
    with pytest.raises(snn.UnusedParametersError,
                       match=r"spare.weight.*find_unused_parameters=True.*requires_grad_\(False\)"):
        m(x).sum().backward()
    # Marked as the message says: reduced as zeros, training goes on.
    m = snn.DataParallel(TwoHeads(), world, find_unused_parameters=True)
    m(x).sum().backward()
    assert float(m.module.spare.weight.grad.abs().sum()) == 0.0
    assert float(m.module.used.weight.grad.abs().sum()) > 0.0


def test_bucket_order_differs_across_ranks(world):
    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4, dtype=DTYPE)
            self.b = torch.nn.Linear(4, 4, dtype=DTYPE)

        def forward(self, x):
            if world.rank == 3:  # b runs first: its gradients come last
                hb = self.b(x)
                return self.a(x) + hb
            ha = self.a(x)
            return ha + self.b(x)

    m = snn.DataParallel(Branches(), world, bucket_bytes=64)
    with pytest.raises(snn.BucketMismatchError, match=r"dp rank 3.*position 0.*'b\.bias' on rank 0"
                       r" but 'a\.bias' on rank 3"):
        m(torch.randn(2, 4, dtype=DTYPE)).sum().backward()


def test_options_differ_across_ranks(world):
    m = snn.DataParallel(mlp(), world, bucket_bytes=1024 if world.rank else 2048)
    with pytest.raises(snn.BucketMismatchError, match="other options"):
        m(torch.randn(2, 8, dtype=DTYPE)).sum().backward()


def test_module_changed_after_wrapping(world):
    m = snn.DataParallel(mlp(), world)
    m.module.head = torch.nn.Linear(16, 4, dtype=DTYPE)
    with pytest.raises(snn.ModuleChangedError, match="'head.weight' replaced"):
        m(torch.randn(2, 8, dtype=DTYPE))
    m = snn.DataParallel(mlp(), world)
    opt = strata.optim.DistributedOptimizer(torch.optim.AdamW, m.parameters(), world, lr=LR)
    m.module.head.weight.data = m.module.head.weight.data.clone()
    with pytest.raises(snn.ModuleChangedError, match="head.weight.*.data replaced"):
        m(torch.randn(2, 8, dtype=DTYPE))
    with pytest.raises(snn.ModuleChangedError, match="head.weight"):
        opt.step()


def test_reduces_over_dp_cp_when_cp_is_two():
    """With cp > 1 the group is dp-cp (as Megatron): dp2 x cp2 reduces over
    all four ranks, each holding a quarter of the batch."""
    with strata.init(strata.Mesh(4, cp=2), timeout=120) as w:
        m = snn.DataParallel(mlp(), w, bucket_bytes=1024)
        group = m.group
        problems = [] if (group.name, group.size) == ("dp-cp", 4) else [
            f"reduces over {group.name} of {group.size}"]
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        for step in range(STEPS):
            x, y = mlp_batch(step)
            opt.zero_grad()
            mse(m(local(x, group.rank, 4)), local(y, group.rank, 4)).backward()
            opt.step()
        problems += compare(strip(m.named_parameters()), reference_mlp(), TOL, "dp2 x cp2")[0]
        agree(w, problems)
