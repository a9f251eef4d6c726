"""Resuming from a checkpoint is exact, under mpirun (dp x tp2): train N
steps, save asynchronously (model, AdamW, LR schedule, step; RNG states of
torch, numpy and Python and the data-loader position per rank), train M
more; then rebuild everything from other seeds, load with restore_rng and
train M steps: the losses are identical, bit for bit, to the uninterrupted
run's (computed in the same test).

    mpirun -np 4 python -m pytest tests/python/mr_checkpoint_resume.py
"""

import random
import shutil
import tempfile

import numpy as np
import pytest
import torch

import strata
import strata.checkpoint as ckpt
import strata.nn as snn

torch.set_num_threads(1)
ENV = strata.launch_env()
N_STEPS, M_STEPS = 3, 3


@pytest.fixture
def world():
    w = strata.init(strata.Mesh(ENV.world_size, tp=2))
    yield w
    w.destroy()


@pytest.fixture
def shared_dir(world):
    name = tempfile.mkdtemp(prefix="strata-resume-") if world.rank == 0 else ""
    buf = torch.zeros(256, dtype=torch.uint8)
    buf[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    world.group("world").broadcast(buf, src=0)
    path = bytes(buf[buf != 0].tolist()).decode()
    yield path
    world.group("world").barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


class Trainer:
    """A GPT on the world's tp group, AdamW with a one-cycle LR schedule, and
    a data loader that uses all three RNGs and a position (the same on the
    ranks of a tp group, different across dp)."""

    def __init__(self, world, seed):
        self.world = world
        self.tp, self.dp = world.group("tp"), world.group("dp")
        torch.manual_seed(seed)
        self.model = snn.ParallelGPT(64, 32, 4, 2, 8, group=self.tp, sequence_parallel=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=3e-3, total_steps=20)
        self.step = 0
        self.position = 0  # the data loader's: sequences consumed
        data_seed = seed * 100 + self.dp.rank
        torch.manual_seed(data_seed)
        np.random.seed(data_seed)
        random.seed(data_seed)

    def batch(self):
        base = torch.randint(0, 64, (8, 2))
        shift = int(np.random.randint(0, 64))
        flip = random.random() < 0.5
        ids = (base + shift + self.position) % 64
        self.position += 2
        return ids.flip(0) if flip else ids

    def train(self, steps):
        losses = []
        for _ in range(steps):
            ids = self.batch()
            loss = self.model.loss(ids, torch.roll(ids, 1, 0))
            self.opt.zero_grad()
            loss.backward()
            for p in self.model.parameters():
                self.dp.all_reduce(p.grad, op="avg")
            self.opt.step()
            self.sched.step()
            self.step += 1
            shown = torch.tensor([loss.item()], dtype=torch.float64)
            self.dp.all_reduce(shown, op="avg")
            losses.append(shown.item())
        return losses

    def state(self):
        return {"model": self.model, "optimizer": self.opt, "sched": self.sched,
                "step": self.step}


def test_resume_is_exact(world, shared_dir):
    a = Trainer(world, seed=1)
    a.train(N_STEPS)
    with ckpt.AsyncCheckpointer(shared_dir, world=world) as saver:
        saver.save(a.state(), step=a.step, optimizer_step=a.step,
                   data_loader={"position": a.position})
        after_save = a.train(M_STEPS)  # overlaps the background write
        saver.wait()

    b = Trainer(world, seed=2)  # other weights, other RNG streams
    assert b.step == 0
    st = {}
    state = b.state()
    ckpt.load(shared_dir, state, world=world, restore_rng=True, training_state=st)
    b.step = state["step"]
    b.position = st["data_loader"]["position"]
    assert b.step == N_STEPS and st["step"] == N_STEPS and st["optimizer_step"] == N_STEPS
    assert b.sched.last_epoch == N_STEPS
    assert st["mesh"]["tp"] == 2 and st["mesh"]["world_size"] == world.size
    assert st["library_version"] == strata.__version__
    resumed = b.train(M_STEPS)
    assert resumed == after_save, f"uninterrupted {after_save}, resumed {resumed}"


def test_without_restoring_rng_the_run_differs(world, shared_dir):
    # The test above is not vacuous: the RNG states do matter.
    a = Trainer(world, seed=1)
    a.train(1)
    ckpt.save(a.state(), shared_dir, step=1, world=world, data_loader={"position": a.position})
    want = a.train(2)
    b = Trainer(world, seed=2)
    st = {}
    state = b.state()
    ckpt.load(shared_dir, state, world=world, training_state=st)
    b.position = st["data_loader"]["position"]
    assert b.train(2) != want
