"""Under mpirun on 8 ranks, dp2 x pp2 x tp2 from one World: each pipeline
stage is a tensor-parallel MLP block (column-parallel then row-parallel
linear, reduced over the tp group), the pipeline runs over the pp group and
the gradients are averaged over the dp group. After one step, for GPipe,
1F1B and interleaved 1F1B, every rank's losses and gradient shards equal
those of the whole model run unpipelined, unsharded, on the whole batch in
one process (computed here); 20 steps of SGD under 1F1B follow its loss
curve.

The tensor-parallel layers are strata.nn's ColumnParallelLinear and
RowParallelLinear on the world's tp group.
"""

import copy
import os

import pytest
import torch
from torch import nn

import strata
from strata import nn as snn
from strata import pipeline

N = int(os.environ["STRATA_TEST_NP"])
D, HIDDEN, OUT = 6, 8, 3
DTYPE = torch.float64


@pytest.fixture(scope="module")
def world():
    if N != 8:
        pytest.skip("needs 8 ranks")
    w = strata.init(strata.Mesh(8, tp=2, pp=2), timeout=120)
    yield w
    w.destroy()


def agree(world, problems):
    flag = torch.tensor([1 if problems else 0], dtype=torch.int32)
    world.group().all_reduce(flag, op="max")
    assert not problems, problems[:5]
    assert flag.item() == 0, "failed on another rank (see its report)"


class Block(nn.Module):
    """h + W2 tanh(W1 h + b1) + b2: the unsharded reference."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, HIDDEN, dtype=DTYPE)
        self.fc2 = nn.Linear(HIDDEN, D, dtype=DTYPE)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(h)))


class TPBlock(nn.Module):
    """The same block from strata.nn's tensor-parallel layers: fc1
    column-parallel (its rows split over tp), fc2 row-parallel (its columns
    split), each shard copied from the reference."""

    def __init__(self, full, tp):
        super().__init__()
        n = HIDDEN // tp.size
        rows = slice(tp.rank * n, (tp.rank + 1) * n)
        self.fc1 = snn.ColumnParallelLinear(D, HIDDEN, group=tp, dtype=DTYPE)
        self.fc2 = snn.RowParallelLinear(HIDDEN, D, group=tp, input_is_parallel=True,
                                         dtype=DTYPE)
        with torch.no_grad():
            self.fc1.weight.copy_(full.fc1.weight[rows])
            self.fc1.bias.copy_(full.fc1.bias[rows])
            self.fc2.weight.copy_(full.fc2.weight[:, rows])
            self.fc2.bias.copy_(full.fc2.bias)
        self.rows = rows

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(h)))

    def reference_grads(self, full):
        """The slices of the reference's gradients that this shard holds."""
        return {"fc1.weight": full.fc1.weight.grad[self.rows],
                "fc1.bias": full.fc1.bias.grad[self.rows],
                "fc2.weight": full.fc2.weight.grad[:, self.rows], "fc2.bias": full.fc2.bias.grad}


class Stage(nn.Module):
    """A block, plus the output head on the last stage."""

    def __init__(self, block, head=None):
        super().__init__()
        self.block, self.head = block, head

    def forward(self, h):
        h = self.block(h)
        return self.head(h) if self.head is not None else h


def make_model(num_stages, seed):
    torch.manual_seed(seed)
    return [Block() for _ in range(num_stages)], nn.Linear(D, OUT, dtype=DTYPE)


def batch(rows, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g, dtype=DTYPE)
    teacher = torch.randn(D, OUT, generator=torch.Generator().manual_seed(42), dtype=DTYPE)
    return x, torch.tanh(x @ teacher)


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def reference_step(blocks, head, x, y, m, dp):
    """The unpipelined step: each dp replica's half of the batch in m
    microbatches (mean over microbatches), averaged over replicas."""
    losses = []
    for xh, yh in zip(torch.tensor_split(x, dp), torch.tensor_split(y, dp)):
        mine = []
        for xi, yi in zip(torch.tensor_split(xh, m), torch.tensor_split(yh, m)):
            h = xi
            for b in blocks:
                h = b(h)
            loss = loss_fn(head(h), yi)
            (loss / (m * dp)).backward()
            mine.append(loss.detach())
        losses.append(mine)
    return losses


class Setup:
    """This rank's pipelined, sharded part of a model, beside the whole
    model as the reference."""

    def __init__(self, world, kind, v, m, seed=0):
        pp, tp, dp = world.group("pp"), world.group("tp"), world.group("dp")
        self.world, self.pp, self.dp, self.m = world, pp, dp, m
        n = pp.size * v
        self.blocks, self.head = make_model(n, seed)
        self.mine = list(range(pp.rank, n, pp.size))
        self.tp_blocks = {s: TPBlock(self.blocks[s], tp) for s in self.mine}
        self.my_head = copy.deepcopy(self.head) if n - 1 in self.mine else None
        self.modules = {s: Stage(self.tp_blocks[s], self.my_head if s == n - 1 else None)
                        for s in self.mine}
        stages = [pipeline.PipelineStage(self.modules[s], s, world) for s in self.mine]
        cls = {"gpipe": pipeline.ScheduleGPipe, "1f1b": pipeline.Schedule1F1B,
               "interleaved": pipeline.ScheduleInterleaved1F1B,
               "zb": pipeline.ScheduleZeroBubble}[kind]
        self.schedule = cls(stages if kind == "interleaved" else stages[0], m, loss_fn,
                            timeout=60)

    def parameters(self):
        return [p for s in self.mine for p in self.modules[s].parameters()]

    def step(self, x, y):
        """The pipelined step on this replica's half, gradients averaged
        over dp; and the reference step."""
        half = self.dp.rank
        xs, ys = torch.tensor_split(x, self.dp.size), torch.tensor_split(y, self.dp.size)
        losses = self.schedule.step(xs[half], ys[half])
        for p in self.parameters():
            self.dp.all_reduce(p.grad, op="avg")
        want = reference_step(self.blocks, self.head, x, y, self.m, self.dp.size)[half]
        return losses, want

    def compare(self, problems, losses, want, tol):
        if losses is not None:
            for i, (a, b) in enumerate(zip(losses, want)):
                if not torch.allclose(a, b, rtol=tol, atol=tol):
                    problems.append(f"microbatch {i}: loss {a.item()} != {b.item()}")
        elif self.my_head is not None:
            problems.append("the last stage returned no losses")
        for s in self.mine:
            for name, ref in self.tp_blocks[s].reference_grads(self.blocks[s]).items():
                got = self.tp_blocks[s].get_parameter(name).grad
                if not torch.allclose(got, ref, rtol=tol, atol=tol):
                    problems.append(f"stage {s} {name}: max error {(got - ref).abs().max()}")
        if self.my_head is not None:
            for (name, a), (_, b) in zip(self.my_head.named_parameters(),
                                         self.head.named_parameters()):
                if not torch.allclose(a.grad, b.grad, rtol=tol, atol=tol):
                    problems.append(f"head {name}: max error {(a.grad - b.grad).abs().max()}")


@pytest.mark.parametrize("kind,v,m", [("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved", 2, 4),
                                     ("zb", 1, 4)])
def test_one_step_equals_unpipelined(world, kind, v, m):
    setup = Setup(world, kind, v, m)
    x, y = batch(22, seed=1)  # halves of 11 rows: uneven microbatches
    losses, want = setup.step(x, y)
    problems = []
    setup.compare(problems, losses, want, 1e-10)
    peak = setup.schedule.schedule.peak_in_flight()[setup.pp.rank]
    if (setup.schedule.stats.peak_in_flight, setup.schedule.peak_live_activations) != (peak,) * 2:
        problems.append(f"peak activations {setup.schedule.stats.peak_in_flight} (runner), "
                        f"{setup.schedule.peak_live_activations} (alive), simulator {peak}")
    agree(world, problems)


def test_twenty_steps_follow_the_unpipelined_loss_curve(world):
    setup = Setup(world, "1f1b", 1, 4, seed=5)
    opt = torch.optim.SGD(setup.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([p for b in setup.blocks for p in b.parameters()] +
                              list(setup.head.parameters()), lr=0.1)
    problems = []
    for step in range(20):
        x, y = batch(16 + 2 * (step % 3), seed=200 + step)
        opt.zero_grad()
        ref_opt.zero_grad()
        losses, want = setup.step(x, y)
        setup.compare(problems, losses, want, 1e-9)
        opt.step()
        ref_opt.step()
    agree(world, problems)
