"""strata.checkpoint with world= under mpirun (4 and 8 ranks): exact round
trip of every dtype (tensor-parallel shards and replicated tensors), values
are those at save() time, a strata.nn GPT with its Adam state saved at one
tp/dp split loads at every other, each rank reading exactly the bytes of its
shards, and an error on one rank raises on all.

The reference is computed in the test: before saving, every rank gathers
the global tensors from the tp shards; after loading under another layout,
each rank's shard must equal its box of those.

    mpirun -np 4 python -m pytest tests/python/mr_checkpoint.py
"""

import json
import os
import shutil
import tempfile

import pytest
import torch

import strata
import strata.checkpoint as ckpt
import strata.nn as snn

torch.set_num_threads(1)
ENV = strata.launch_env()
N = ENV.world_size
TPS = [t for t in (1, 2, 4, 8) if N % t == 0]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]


def world_of(tp):
    return strata.init(strata.Mesh(N, tp=tp))


@pytest.fixture
def shared_dir():
    """A directory made by rank 0, known to all, removed at the end."""
    w = strata.init()
    name = tempfile.mkdtemp(prefix="strata-mrckpt-") if w.rank == 0 else ""
    buf = torch.zeros(256, dtype=torch.uint8)
    buf[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    w.group("world").broadcast(buf, src=0)
    path = bytes(buf[buf != 0].tolist()).decode()
    yield path
    w.group("world").barrier()
    if w.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    w.destroy()


def bits(t):
    """Exact comparison, NaN payloads included."""
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def random_tensor(shape, dtype, seed):
    """Every bit pattern possible (NaNs, -0, subnormals); the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape).clone()


class Shards(torch.nn.Module):
    """One parameter per dtype: rows [r * 2, r * 2 + 2) of a global [2 * tp, 3]
    tensor on tp rank r (marked as a strata.nn layer marks its shards), and
    one replicated parameter per dtype."""

    def __init__(self, tp_group, fill):
        super().__init__()
        r, n = tp_group.rank, tp_group.size
        for i, dtype in enumerate(DTYPES):
            name = str(dtype).split(".")[1]
            whole = random_tensor([2 * n, 3], dtype, 100 + i) if fill else torch.zeros(
                [2 * n, 3], dtype=dtype)
            p = torch.nn.Parameter(whole[2 * r:2 * r + 2].clone(), requires_grad=False)
            p.tensor_parallel_sharding = (0, r, n)
            self.register_parameter(f"split_{name}", p)
            rep = random_tensor([5], dtype, 200 + i) if fill else torch.zeros(5, dtype=dtype)
            self.register_parameter(f"rep_{name}", torch.nn.Parameter(rep, requires_grad=False))


def test_every_dtype_round_trips_exactly(shared_dir):
    with world_of(2) as w:
        saved = Shards(w.group("tp"), fill=True)
        ckpt.save({"m": saved, "n": 7}, shared_dir, step=1, world=w)
        got = Shards(w.group("tp"), fill=False)
        state = {"m": got, "n": 0}
        ckpt.load(shared_dir, state, world=w)
        assert state["n"] == 7
        for (name, a), (_, b) in zip(saved.named_parameters(), got.named_parameters()):
            assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), name
        # Each global tensor was written once: the checkpoint holds the
        # global shapes, and its data is the sum of the global sizes.
        info = ckpt.info(shared_dir)
        assert info["world_size"] == N
        # The writing is spread: every rank wrote a file (rank 0 is not the
        # writer of every replicated tensor).
        with open(os.path.join(info["directory"], "manifest.json")) as f:
            writers = {entry["rank"] for entry in json.load(f)["files"]}
        assert writers == set(range(N))
        for i, dtype in enumerate(DTYPES):
            name = str(dtype).split(".")[1]
            assert info["tensors"][f"m.split_{name}"] == (dtype, (2 * w.group("tp").size, 3))
            assert info["tensors"][f"m.rep_{name}"] == (dtype, (5,))


def test_values_are_those_at_save_time(shared_dir):
    with world_of(2) as w:
        m = Shards(w.group("tp"), fill=True)
        before = {k: v.detach().clone() for k, v in m.state_dict().items()}
        with ckpt.AsyncCheckpointer(shared_dir, world=w) as saver:
            saver.save({"m": m}, step=5)
            with torch.no_grad():  # training changes them while the write runs
                for p in m.parameters():
                    p.zero_() if p.dtype != torch.bool else p.logical_not_()
            saver.wait()
        ckpt.load(shared_dir, {"m": m}, world=w)
        for k, v in m.state_dict().items():
            assert torch.equal(bits(v), bits(before[k])), k


def gpt(tp_group):
    torch.manual_seed(7)  # the same global weights at every tp
    return snn.ParallelGPT(64, 32, 8, 2, 8, group=tp_group, sequence_parallel=True)


def global_state(model, opt, tp_group):
    """{(name, field): global tensor} of the parameters and their Adam states,
    gathered from the tp shards."""
    out = {}
    state = opt.state_dict()["state"]
    for i, (name, p) in enumerate(model.named_parameters()):
        spec = getattr(p, "tensor_parallel_sharding", None)
        for field, t in [("param", p.detach())] + [(f, v) for f, v in state[i].items()]:
            if spec is not None and t.shape == p.shape:
                dim = spec[0]
                parts = torch.empty((tp_group.size,) + tuple(t.movedim(dim, 0).shape),
                                    dtype=t.dtype)
                tp_group.all_gather(parts, t.movedim(dim, 0).contiguous())
                t = torch.cat(list(parts), dim=0).movedim(0, dim)
            out[(name, field)] = t.clone()
    return out


def train_step(model, opt, dp_group, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (8, 2), generator=g)
    loss = model.loss(ids, torch.roll(ids, 1, 0))
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dp_group.all_reduce(p.grad, op="avg")
    opt.step()


@pytest.mark.parametrize("save_tp", [t for t in TPS if t in (2, 4)])
def test_gpt_and_adam_reshard_across_tp_and_dp(shared_dir, save_tp):
    with world_of(save_tp) as w:
        model = gpt(w.group("tp"))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for s in range(2):
            train_step(model, opt, w.group("dp"), s)
        want = global_state(model, opt, w.group("tp"))
        ckpt.save({"model": model, "optimizer": opt}, shared_dir, step=10, world=w)
    for tp in TPS:
        with world_of(tp) as w:
            model = gpt(w.group("tp"))
            torch.manual_seed(99)  # different values from the saved ones
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_()
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # no state yet
            st = {}
            ckpt.load(shared_dir, {"model": model, "optimizer": opt}, world=w, verify=False,
                      merge_gap_bytes=0, training_state=st)
            got = global_state(model, opt, w.group("tp"))
            assert sorted(got) == sorted(want)
            for k, v in want.items():
                assert torch.equal(got[k], v), f"{k} saved at tp={save_tp}, loaded at tp={tp}"
            # Exactly the bytes of this rank's shards were read.
            mine = sum(p.numel() * p.element_size() for p in model.parameters())
            mine += sum(t.numel() * t.element_size() for s in opt.state_dict()["state"].values()
                        for t in s.values() if isinstance(t, torch.Tensor))
            assert st["bytes_read"] == mine, f"tp={tp}: read {st['bytes_read']} of {mine}"
            assert st["mesh"]["tp"] == save_tp and st["step"] == 10
            # And with verification (the default), the training continues.
            ckpt.load(shared_dir, {"model": model, "optimizer": opt}, world=w)
            train_step(model, opt, w.group("dp"), 5)


def test_an_error_on_one_rank_raises_on_every_rank(shared_dir):
    with world_of(2) as w:
        m = Shards(w.group("tp"), fill=True)
        ckpt.save({"m": m}, shared_dir, step=3, world=w)
        state = {"m": m}
        if w.rank == N - 1:
            state["extra"] = torch.zeros(2)
        with pytest.raises(strata.CheckpointError) as e:
            ckpt.load(shared_dir, state, world=w)
        if w.rank == N - 1:
            assert "'extra'" in str(e.value) and "not in checkpoint step 3" in str(e.value)
        else:
            assert f"rank {N - 1} of {N}" in str(e.value)
        # The world is still usable: a good load works afterwards.
        ckpt.load(shared_dir, {"m": m}, world=w)


def stage_model(world, layers):
    """This pipeline stage's layers, named by their index in the full model
    (layer l's weights a function of l), as a pipeline-split trainer should."""
    pp, stage = world.mesh.pp, world.mesh.coords(world.rank)["pp"]
    per = layers // pp
    m = torch.nn.ModuleDict()
    for layer in range(stage * per, (stage + 1) * per):
        torch.manual_seed(1000 + layer)
        m[str(layer)] = torch.nn.Linear(4, 4)
    return m


PPS = [p for p in (1, 2, 4, 8) if N % p == 0]


def stepped_adam(model):
    """Adam over ``model`` after one step whose gradients are a function of
    the layer alone, so each layer's state is the same under any split."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(
            50 + int(name.split(".")[0])))
    opt.step()
    return opt


@pytest.mark.parametrize("save_pp", [2])
def test_per_layer_tensors_load_under_another_pipeline_split(shared_dir, save_pp):
    layers = 8
    with strata.init(strata.Mesh(N, pp=save_pp)) as w:
        m = stage_model(w, layers)
        ckpt.save({"model": m, "optimizer": stepped_adam(m)}, shared_dir, step=1, world=w)
    for pp in PPS:
        with strata.init(strata.Mesh(N, pp=pp)) as w:
            want = stage_model(w, layers)
            want_opt = stepped_adam(want)
            got = stage_model(w, layers)
            with torch.no_grad():
                for p in got.parameters():
                    p.zero_()
            got_opt = torch.optim.Adam(got.parameters(), lr=1e-3)  # no state yet
            st = {}
            # Strict: each stage asks for its layers (and their optimizer
            # states, keyed by parameter name) only; nothing is left over.
            ckpt.load(shared_dir, {"model": got, "optimizer": got_opt}, world=w, verify=False,
                      merge_gap_bytes=0, training_state=st)
            for (name, a), (_, b) in zip(want.named_parameters(), got.named_parameters()):
                assert torch.equal(a, b), f"{name}: saved with pp={save_pp}, loaded with pp={pp}"
                for field in ("step", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(want_opt.state[a][field], got_opt.state[b][field]), \
                        f"{name} {field}: saved with pp={save_pp}, loaded with pp={pp}"
            params = list(got.parameters())
            # Each parameter: its values, exp_avg and exp_avg_sq, and a 0-d step.
            assert st["bytes_read"] == sum(3 * p.numel() * 4 + 4 for p in params)
    with strata.init(strata.Mesh(N, pp=2)) as w:
        # A layer no rank holds is still unexpected (on every rank).
        m = stage_model(w, layers)
        if w.mesh.coords(w.rank)["pp"] == 1:
            del m[str(layers - 1)]
        opt = torch.optim.Adam(m.parameters())
        with pytest.raises(strata.CheckpointError, match="no rank asked for: 'model.7.bias'"):
            ckpt.load(shared_dir, {"model": m, "optimizer": opt}, world=w)


def test_a_checkpointer_follows_a_rebuilt_world(shared_dir):
    """World ranks 2 and 3 (one tp=2 replica) leave; the survivors rebuild
    the world in place. The checkpointer made before the rebuild saves again
    (over a communicator it splits off the new generation) and the step
    loads back; on the ranks that left it raises instead of hanging."""
    if N < 4:
        pytest.skip("needs 4 ranks or more")
    w = strata.init(strata.Mesh(N, tp=2), timeout=120)
    c = ckpt.AsyncCheckpointer(shared_dir, world=w, commit_timeout=120)
    c.save({"w": torch.arange(4.0)}, step=1)
    c.wait()
    problems = []
    if w.rank in (2, 3):
        w.destroy()
        try:
            c.save({"w": torch.arange(4.0)}, step=2)
            problems.append("a checkpointer saved through a destroyed world")
        except strata.Error as e:
            if "destroyed" not in str(e):
                problems.append(f"leaver: {type(e).__name__}: {e}")
        c.close()
    else:
        root = w.group().shrink([2, 3], name="world")
        w._rebuild(root, strata.Mesh(N - 2, tp=2))
        c.save({"w": 2 * torch.arange(4.0)}, step=2)
        c.wait()
        c.close()
        state = {"w": torch.zeros(4)}
        ckpt.load(shared_dir, state, world=w)
        if not torch.equal(state["w"], 2 * torch.arange(4.0)):
            problems.append(f"loaded {state['w']}")
        info = ckpt.info(shared_dir)
        if (info["step"], info["world_size"]) != (2, N - 2):
            problems.append(f"step 2 saved as {info}")
        w.destroy()
    assert not problems, problems
