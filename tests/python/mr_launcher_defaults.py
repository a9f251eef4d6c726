"""A user's job under the launcher's default flags: plain `mpirun
--oversubscribe -np N` (Open MPI 5 binds ranks and numbers each node's local
ranks by the objects it binds them to) or plain `torchrun --standalone
--nproc-per-node N`, with none of the test suite's binding or yield
settings. strata.init, collectives, a few steps of a strata.nn model with
data-parallel gradients, and AsyncCheckpointer saves must all work, and in
bounded time.

    mpirun --oversubscribe -np 8 python -m pytest tests/python/mr_launcher_defaults.py
    torchrun --standalone --nproc-per-node 4 -m pytest tests/python/mr_launcher_defaults.py
"""

import os
import shutil
import tempfile
import time

import torch

import strata
import strata.checkpoint as ckpt
import strata.nn as snn

# No torch.set_num_threads(1): users do not write it either.
ENV = strata.launch_env()
N = ENV.world_size
VOCAB, HIDDEN, HEADS, LAYERS, SEQ, BATCH = 64, 64, 4, 2, 32, 4


def test_launch_env_describes_this_node():
    assert N == int(os.environ["STRATA_TEST_NP"])
    assert ENV.launcher in ("mpirun", "torchrun")
    with strata.init() as world:
        # One host: every rank is here, and the local ranks are 0..N-1 in
        # whatever order the launcher chose.
        locals_ = torch.zeros(N, dtype=torch.int64)
        world.group("world").all_gather(locals_, torch.tensor([ENV.local_rank]))
        assert sorted(locals_.tolist()) == list(range(N))
        assert (ENV.local_world_size, ENV.node_index, ENV.num_nodes) == (N, 0, 1)
        assert ENV.node_index_exact


def test_collectives_match_a_local_reference():
    with strata.init() as world:
        g = world.group("world")
        x = torch.arange(1000, dtype=torch.float32) * (g.rank + 1)
        g.all_reduce(x)
        expected = torch.arange(1000, dtype=torch.float32) * sum(r + 1 for r in range(N))
        assert torch.equal(x, expected)
        b = torch.full((17,), float(g.rank))
        g.broadcast(b, src=N - 1)
        assert torch.equal(b, torch.full((17,), float(N - 1)))
        out = torch.zeros(N * 3, dtype=torch.int32)
        g.all_gather(out, torch.full((3,), g.rank, dtype=torch.int32))
        assert torch.equal(out, torch.arange(N, dtype=torch.int32).repeat_interleave(3))
        g.barrier()


def shared_directory(world):
    name = tempfile.mkdtemp(prefix="strata-defaults-") if world.rank == 0 else ""
    buf = torch.zeros(256, dtype=torch.uint8)
    buf[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    world.group("world").broadcast(buf, src=0)
    return bytes(buf[buf != 0].tolist()).decode()


def test_train_and_save_asynchronously():
    tp = 2
    with strata.init(strata.Mesh(N, tp=tp)) as world:
        directory = shared_directory(world)
        try:
            torch.manual_seed(0)
            model = snn.ParallelGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ, group=world,
                                    sequence_parallel=True)
            opt = torch.optim.Adam(model.parameters(), lr=3e-3)
            dp = world.group("dp")
            data = torch.Generator().manual_seed(1 + dp.rank)
            saved = {}
            start = time.monotonic()
            with ckpt.AsyncCheckpointer(directory, world=world, keep_last=2) as saver:
                for step in range(6):
                    ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=data)
                    loss = model.loss(ids, ids.roll(1, 0))
                    opt.zero_grad()
                    loss.backward()
                    for p in model.parameters():
                        dp.all_reduce(p.grad)
                        p.grad /= dp.size
                    opt.step()
                    if step in (2, 5):
                        saver.save({"model": model, "optimizer": opt, "step": step}, step=step)
                        saved[step] = {k: v.detach().clone()
                                       for k, v in model.state_dict().items()}
                saver.wait()
            elapsed = time.monotonic() - start
            # The last checkpoint holds the weights at its save() call.
            torch.manual_seed(123)
            fresh = snn.ParallelGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ, group=world,
                                    sequence_parallel=True)
            state = {"model": fresh, "step": 0}
            ckpt.load(directory, state, world=world, strict=False)  # no optimizer here
            assert state["step"] == 5
            for k, v in fresh.state_dict().items():
                assert torch.equal(v, saved[5][k]), k
            if world.rank == 0:
                print(f"\n6 steps with 2 asynchronous saves on {N} ranks "
                      f"({ENV.launcher}, launcher defaults): {elapsed:.2f}s")
        finally:
            world.group("world").barrier()
            if world.rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
