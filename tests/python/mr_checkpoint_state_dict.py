"""The state_dict idiom of strata.checkpoint under mpirun (4 and 8 ranks),
as torch.distributed.checkpoint users write it:

    ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, d, step=s, world=w)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    ckpt.load(d, sd, world=w)            # fills model's parameters in place
    opt.load_state_dict(sd["optim"])

A strata.nn GPT with its AdamW state, trained at tp=2, is saved as its
state dicts (flat, optimizer alone, nested) and as objects; each loads at
every tp that divides the world (and so every dp), in place, equal to the
global tensors gathered from the tp shards before the save; and
`strata-ckpt convert` writes those global tensors. Replicas that differ
(a rank-dependent buffer, tp shards that lost their layout) fail the save
on every rank, naming the tensor and the ranks, and leave nothing behind.

    mpirun -np 4 python -m pytest tests/python/mr_checkpoint_state_dict.py
"""

import os
import shutil
import subprocess
import tempfile

import pytest
import safetensors.torch
import torch

import strata
import strata.checkpoint as ckpt
import strata.nn as snn

torch.set_num_threads(1)
ENV = strata.launch_env()
N = ENV.world_size
TPS = [t for t in (1, 2, 4, 8) if N % t == 0]
SAVE_TP = 2


def world_of(tp):
    return strata.init(strata.Mesh(N, tp=tp))


@pytest.fixture
def shared_dir():
    """A directory made by rank 0, known to all, removed at the end."""
    w = strata.init()
    name = tempfile.mkdtemp(prefix="strata-mrsd-") if w.rank == 0 else ""
    buf = torch.zeros(256, dtype=torch.uint8)
    buf[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    w.group("world").broadcast(buf, src=0)
    path = bytes(buf[buf != 0].tolist()).decode()
    yield path
    w.group("world").barrier()
    if w.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    w.destroy()


def gpt(tp_group, seed=7):
    torch.manual_seed(seed)  # the same global weights at every tp
    return snn.ParallelGPT(64, 32, 8, 2, 8, group=tp_group, sequence_parallel=True)


def gathered(t, spec, tp_group):
    """The global tensor of which ``t`` is shard ``spec`` (None: ``t``)."""
    if spec is None:
        return t.clone()
    dim = spec[0]
    parts = torch.empty((tp_group.size,) + tuple(t.movedim(dim, 0).shape), dtype=t.dtype)
    tp_group.all_gather(parts, t.movedim(dim, 0).contiguous())
    return torch.cat(list(parts), dim=0).movedim(0, dim)


def global_state(model, opt, tp_group):
    """{(parameter name, field): global tensor}: the parameters ("param")
    and their AdamW states, gathered from the tp shards through the
    parameters' layouts (not the states' own)."""
    out = {}
    state = opt.state_dict()["state"]
    for i, (name, p) in enumerate(model.named_parameters()):
        spec = getattr(p, "tensor_parallel_sharding", None)
        out[(name, "param")] = gathered(p.detach(), spec, tp_group)
        for field, t in state[i].items():
            out[(name, field)] = gathered(t, spec if t.shape == p.shape else None, tp_group)
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


def with_states(model, lr=1e-2):
    """AdamW over ``model`` whose states exist (zeros; the parameters
    unchanged), as DCP's get_optimizer_state_dict makes them: loading into
    ``opt.state_dict()`` needs tensors to load into."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lr_was = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    opt.param_groups[0]["lr"] = lr_was
    opt.zero_grad()
    return opt


# How each form names the tensors: {form: (model key of a parameter name,
# optimizer state key of (index, parameter name, field))}.
FORMS = {
    "model.state_dict()": (lambda n: n, None),
    "optimizer.state_dict()": (None, lambda i, n, f: f"state.{i}.{f}"),
    "nested state dicts": (lambda n: f"model.{n}", lambda i, n, f: f"optim.state.{i}.{f}"),
    "objects": (lambda n: f"model.{n}", lambda i, n, f: f"optim.state.model.{n}.{f}"),
}


def state_of(form, model, opt):
    if form == "model.state_dict()":
        return model.state_dict()
    if form == "optimizer.state_dict()":
        return opt.state_dict()
    if form == "nested state dicts":
        return {"model": model.state_dict(), "optim": opt.state_dict()}
    return {"model": model, "optim": opt}


def converted(directory, out):
    """strata-ckpt convert's output, read back."""
    tool = os.environ.get("STRATA_CKPT_BIN") or shutil.which("strata-ckpt")
    assert tool, "set STRATA_CKPT_BIN to the strata-ckpt program"
    for args in (["verify", directory], ["convert", directory, out]):
        r = subprocess.run([tool] + args, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    return safetensors.torch.load_file(out)


@pytest.mark.parametrize("form", list(FORMS))
def test_state_dicts_save_global_tensors_and_load_in_place_at_every_split(shared_dir, form):
    model_key, optim_key = FORMS[form]
    with world_of(SAVE_TP) as w:
        model = gpt(w.group("tp"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for s in range(2):
            train_step(model, opt, w.group("dp"), s)
        want = global_state(model, opt, w.group("tp"))
        names = [n for n, _ in model.named_parameters()]
        ckpt.save(state_of(form, model, opt), shared_dir, step=10, world=w)
        # Each tensor was saved whole, at its global shape ...
        keys = {}
        for i, n in enumerate(names):
            if model_key:
                keys[(n, "param")] = model_key(n)
            if optim_key:
                for f in ("step", "exp_avg", "exp_avg_sq"):
                    keys[(n, f)] = optim_key(i, n, f)
        info = ckpt.info(shared_dir)
        for k, key in keys.items():
            assert info["tensors"][key][1] == tuple(want[k].shape), key
        # ... and strata-ckpt convert writes the global tensors.
        if w.rank == 0:
            full = converted(shared_dir, os.path.join(shared_dir, "full.safetensors"))
            assert set(full) == set(keys.values())
            for k, key in keys.items():
                assert torch.equal(full[key], want[k]), f"{key} of {form}"
        w.group("world").barrier()

    for tp in TPS:
        with world_of(tp) as w:
            model = gpt(w.group("tp"), seed=99)  # other weights
            opt = with_states(model) if form != "objects" else torch.optim.AdamW(
                model.parameters(), lr=1e-2)
            memory = {n: p.data_ptr() for n, p in model.named_parameters()}
            state = state_of(form, model, opt)
            assert ckpt.load(shared_dir, state, world=w) is state
            if form == "optimizer.state_dict()":
                opt.load_state_dict(state)
            elif form == "nested state dicts":
                opt.load_state_dict(state["optim"])
            got = global_state(model, opt, w.group("tp"))
            for k in keys:
                assert torch.equal(got[k], want[k]), \
                    f"{k} of {form}: saved at tp={SAVE_TP}, loaded at tp={tp}"
            # In place: the model's own memory holds the loaded values.
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == memory
            train_step(model, opt, w.group("dp"), 5)  # and training goes on


def test_loading_state_dicts_into_an_optimizer_without_states_is_refused(shared_dir):
    with world_of(SAVE_TP) as w:
        model = gpt(w.group("tp"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt, w.group("dp"), 0)
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, shared_dir, step=1,
                  world=w)
        fresh = torch.optim.AdamW(model.parameters())
        # No tensor says which box of a sharded exp_avg this rank holds.
        with pytest.raises(strata.CheckpointError, match=r"under 'optim' saved in shards that "
                           r"the state has no tensor for: 'optim.state.0.exp_avg'.*put the "
                           r"optimizer object in the state instead") as e:
            ckpt.load(shared_dir, {"model": model.state_dict(), "optim": fresh.state_dict()},
                      world=w)
        assert e.value.code == "NOT_FOUND"


def tp_coordinate(w, rank):
    return w.mesh.coords(rank)["tp"]


def ranks_text(ranks):
    ranks = sorted(ranks)
    return ("world rank " if len(ranks) == 1 else "world ranks ") + ", ".join(map(str, ranks))


def test_replicas_that_differ_fail_the_save_on_every_rank(shared_dir):
    with world_of(SAVE_TP) as w:
        model = gpt(w.group("tp"))
        ckpt.save(model.state_dict(), shared_dir, step=1, world=w)  # equal replicas pass

        # A buffer that differs from rank to rank, saved as one tensor.
        model.register_buffer("seen", torch.full((3,), float(w.rank)))
        with pytest.raises(strata.CheckpointError) as e:
            ckpt.save(model.state_dict(), shared_dir, step=2, world=w)
        msg = str(e.value)
        assert e.value.code == "INVALID_ARGUMENT"
        assert f"checkpoint step 2: the {N} ranks of group 'tp-dp-cp'" in msg
        assert "tensor 'seen': " in msg
        for r in range(N):
            assert f"world rank {r} holds fp32 [3] with content" in msg, msg
        assert "Nothing was saved" in msg and "strata.nn.ShardedParameter" in msg
        del model.seen

        # tp shards that lost their layout (a copy of the state dict): the
        # ranks of each tp coordinate hold one version.
        plain = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(strata.CheckpointError) as e:
            ckpt.save(plain, shared_dir, step=2, world=w)
        msg = str(e.value)
        versions = [ranks_text(r for r in range(N) if tp_coordinate(w, r) == c)
                    for c in range(SAVE_TP)]
        assert "tensor 'blocks.0.attn.qkv.weight': " in msg, msg
        assert f"{versions[0]} hold fp32 [48, 32]" in msg and f"{versions[1]} hold fp32 [48, 32]" \
            in msg, msg
        assert "more tensor(s) differ: 'blocks.0.mlp.fc1.weight'" in msg, msg

        # Nothing of step 2 was written; `latest` still names step 1.
        w.group("world").barrier()
        assert ckpt.latest_step(shared_dir) == 1 and ckpt.list_steps(shared_dir) == [1]
        assert not [f for f in os.listdir(shared_dir) if f.startswith("step-2")]
        # And the checkpointer and the world are still usable.
        ckpt.save(model.state_dict(), shared_dir, step=2, world=w)
        assert ckpt.latest_step(shared_dir) == 2


def test_a_rank_that_cannot_prepare_its_save_fails_every_rank_at_once(shared_dir):
    with world_of(SAVE_TP) as w:
        model = gpt(w.group("tp"))
        state = model.state_dict()
        if w.rank == N - 1:
            state["bad"] = torch.zeros(2, dtype=torch.complex64)
        with pytest.raises(strata.CheckpointError) as e:
            ckpt.save(state, shared_dir, step=1, world=w, commit_timeout=60)
        if w.rank == N - 1:
            assert "complex64" in str(e.value)
        else:
            assert f"rank {N - 1} of {N} could not prepare its part of checkpoint step 1" in \
                str(e.value)
        assert ckpt.latest_step(shared_dir) is None


def stage_layers(world, layers=8):
    """This pipeline stage's layers, named by their index in the full model
    (layer l's weights a function of l)."""
    pp, stage = world.mesh.pp, world.mesh.coords(world.rank)["pp"]
    per = layers // pp
    m = torch.nn.ModuleDict()
    for layer in range(stage * per, (stage + 1) * per):
        torch.manual_seed(1000 + layer)
        m[str(layer)] = torch.nn.Linear(4, 4)
    return m


def test_a_flat_state_dict_loads_under_another_pipeline_split(shared_dir):
    # Rank 0's structure names only its stage's keys: the others are found
    # in the manifest, and strictness is decided across ranks.
    with strata.init(strata.Mesh(N, pp=2)) as w:
        ckpt.save(stage_layers(w).state_dict(), shared_dir, step=1, world=w)
    for pp in (1, 2, 4):
        with strata.init(strata.Mesh(N, pp=pp)) as w:
            want = stage_layers(w)
            got = stage_layers(w)
            with torch.no_grad():
                for p in got.parameters():
                    p.zero_()
            sd = got.state_dict()
            assert ckpt.load(shared_dir, sd, world=w) is sd
            for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters()):
                assert torch.equal(a, b), f"{n} saved under pp=2, loaded under pp={pp}"
    with strata.init(strata.Mesh(N, pp=2)) as w:
        m = stage_layers(w)
        if w.mesh.coords(w.rank)["pp"] == 1:
            del m["7"]  # a layer no rank asks for is unexpected, on every rank
        with pytest.raises(strata.CheckpointError, match="no rank asked for: '7.bias', '7.weight'"):
            ckpt.load(shared_dir, m.state_dict(), world=w)
