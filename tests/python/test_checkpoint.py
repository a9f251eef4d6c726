"""strata.checkpoint from Python, in one process: exact round trips of
modules, optimizers and plain state, async semantics, interoperability with
the PyPI safetensors package, and the errors a user sees."""

import hashlib
import json
import math
import os
import random
import warnings

import pytest
import safetensors.torch
import torch

import strata
import strata.checkpoint as ckpt

ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.uint8, torch.int32, torch.int64, torch.int16, torch.bool]


def random_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)  # every bit pattern: NaN payloads, -0.0, inf


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_every_dtype_round_trips_bit_exactly(tmp_path):
    state = {f"t_{str(d)[6:]}": random_tensor(d, (3, 5, 2), i) for i, d in enumerate(ALL_DTYPES)}
    state["scalar"] = torch.tensor(3.25, dtype=torch.float64)
    state["empty"] = torch.empty(0, 4, dtype=torch.int32)
    state["strided"] = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]
    ckpt.save(state, tmp_path, step=3)
    back = ckpt.load(tmp_path)
    assert set(back) == set(state)
    for k, v in state.items():
        assert same_bits(back[k], v), k


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.bn(torch.relu(self.norm(self.fc1(x)))))


def train(model, opt, sched, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def make(seed):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def test_module_adam_and_scheduler_resume_exactly(tmp_path):
    model, opt, sched = make(0)
    train(model, opt, sched, 5, seed=1)
    ckpt.save({"model": model, "optimizer": opt, "sched": sched, "epoch": 7}, tmp_path, step=5,
              optimizer_step=5, data_loader={"index": 160})
    expected = train(model, opt, sched, 4, seed=2)

    model2, opt2, sched2 = make(123)  # different initial weights
    state = {"model": model2, "optimizer": opt2, "sched": sched2, "epoch": 0}
    out = ckpt.load(tmp_path, state)
    assert out is state and state["epoch"] == 7
    assert sched2.last_epoch == 5 and opt2.param_groups[0]["betas"] == (0.8, 0.99)
    assert set(opt2.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert train(model2, opt2, sched2, 4, seed=2) == expected  # bit-identical continuation

    meta = ckpt.info(tmp_path)
    assert meta["step"] == 5 and meta["optimizer_step"] == 5
    assert meta["data_loader"] == {"index": 160}
    assert meta["tensors"]["model.fc1.weight"] == (torch.float32, (16, 8))
    # Optimizer states are keyed by the parameter's name in the saved tree.
    assert "optimizer.state.model.fc1.weight.exp_avg_sq" in meta["tensors"]
    assert meta["tensors"]["model.bn.num_batches_tracked"][0] == torch.int64


def adam_states_by_name(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: opt.state[p] for p in opt.state}


def test_optimizer_states_follow_their_parameters_not_their_order(tmp_path):
    model, opt, sched = make(0)
    train(model, opt, sched, 3, seed=1)
    ckpt.save({"model": model, "optimizer": opt}, tmp_path, step=3)
    # The same model with its parameters given to the optimizer in reverse
    # order (and in two groups): each state lands on its own parameter.
    model2 = make(5)[0]
    params = list(model2.parameters())[::-1]
    opt2 = torch.optim.Adam([{"params": params[:3]}, {"params": params[3:]}], lr=1.0)
    ckpt.load(tmp_path, {"model": model2, "optimizer": opt2})
    want, got = adam_states_by_name(model, opt), adam_states_by_name(model2, opt2)
    assert set(got) == set(want)
    for name in want:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name][field], want[name][field]), (name, field)
    # Hyperparameters come from the saved group that held the parameters.
    assert [g["lr"] for g in opt2.param_groups] == [opt.param_groups[0]["lr"]] * 2
    assert opt2.param_groups[0]["betas"] == (0.8, 0.99)
    # state=None returns the named form as saved: names are paths in the state.
    back = ckpt.load(tmp_path)["optimizer"]
    assert set(back["state"]) == {"model." + n for n in want}
    assert back["param_groups"][0]["params"] == ["model." + n for n, _ in model.named_parameters()]


def test_an_optimizer_saved_without_its_model_is_keyed_by_index(tmp_path):
    model, opt, sched = make(0)
    train(model, opt, sched, 3, seed=1)
    ckpt.save({"optimizer": opt}, tmp_path, step=3)  # no module: parameters have no names
    assert "optimizer.state.0.exp_avg" in ckpt.info(tmp_path)["tensors"]
    model2, opt2, _ = make(0)
    ckpt.load(tmp_path, {"optimizer": opt2})
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])


def test_states_of_parameters_the_optimizer_does_not_hold_are_unexpected(tmp_path):
    model, opt, sched = make(0)
    train(model, opt, sched, 1, seed=1)
    ckpt.save({"model": model, "optimizer": opt}, tmp_path, step=1)
    model2 = make(0)[0]
    opt2 = torch.optim.Adam(model2.fc2.parameters())  # fc2 only
    with pytest.raises(strata.CheckpointError, match=r"has 18 state tensor\(s\) of 'optimizer' "
                       r"for parameters it does not hold: 'optimizer.state.model.bn.bias.exp_avg'"):
        ckpt.load(tmp_path, {"model": model2, "optimizer": opt2})
    ckpt.load(tmp_path, {"model": model2, "optimizer": opt2}, strict=False)
    assert torch.equal(opt2.state[model2.fc2.weight]["exp_avg"], opt.state[model.fc2.weight]["exp_avg"])


def test_a_named_optimizer_needs_its_model_to_load(tmp_path):
    model, opt, sched = make(0)
    train(model, opt, sched, 1, seed=1)
    ckpt.save({"model": model, "optimizer": opt}, tmp_path, step=1)
    model2, opt2, _ = make(0)
    with pytest.raises(strata.CheckpointError, match=r"optimizer's parameter 0 \(shape \(16, 8\)\)"
                       r" belongs to no module of the state being loaded"):
        ckpt.load(tmp_path, {"optimizer": opt2}, strict=False)


def test_plain_values_keep_their_types(tmp_path):
    state = {"t": (1, 2.5, None), "ints": {0: "a", 7: [True, False]}, "big": 2**80,
             "nan": float("nan"), "inf": -math.inf, "raw": b"\x00\xff", "size": torch.Size([2, 3]),
             "nested": {"__weird": {"x": torch.ones(2)}}, "order": {"b": 1, "a": 2}}
    ckpt.save(state, tmp_path, step=1)
    back = ckpt.load(tmp_path)
    assert back["t"] == (1, 2.5, None)
    assert back["ints"] == {0: "a", 7: [True, False]}
    assert back["big"] == 2**80 and math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert back["raw"] == b"\x00\xff" and back["size"] == (2, 3)
    assert torch.equal(back["nested"]["__weird"]["x"], torch.ones(2))
    assert list(back["order"]) == ["b", "a"]


def test_values_are_those_at_save_time(tmp_path):
    w = torch.arange(1 << 20, dtype=torch.float32)
    before = w.clone()
    with ckpt.AsyncCheckpointer(tmp_path) as saver:
        saver.save({"w": w}, step=1)
        w.mul_(-1)  # training goes on while the save is written
        saver.wait()
        status = saver.status()
    assert status["last_committed_step"] == 1 and status["state"] == "idle"
    assert status["bytes_written"] >= w.numel() * 4 and status["staging_seconds"] >= 0
    assert torch.equal(ckpt.load(tmp_path)["w"], before)


def test_files_are_standard_safetensors(tmp_path):
    state = {"a": torch.randn(4, 4), "b": torch.arange(5, dtype=torch.int16),
             "c": random_tensor(torch.bfloat16, (7,), 1)}
    ckpt.save(state, tmp_path, step=2)
    files = [f for f in os.listdir(tmp_path / "step-2") if f.endswith(".safetensors")]
    loaded = {}
    for f in files:
        loaded.update(safetensors.torch.load_file(str(tmp_path / "step-2" / f)))
    assert set(loaded) == set(state)
    for k in state:
        assert same_bits(loaded[k], state[k])


def test_reads_files_written_by_pypi_safetensors(tmp_path):
    tensors = {f"x{i}": random_tensor(d, (2, 3), i) for i, d in enumerate(ALL_DTYPES)}
    tensors["scalar"] = torch.tensor(7, dtype=torch.int64)
    path = tmp_path / "pypi.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"who": "pypi"})
    back = ckpt.load_safetensors(path)
    assert set(back) == set(tensors)
    for k in tensors:
        assert same_bits(back[k], tensors[k])


def test_sha256_checksums_match_hashlib(tmp_path):
    ckpt.save({"w": torch.randn(1000)}, tmp_path, step=1, checksum="sha256", chunk_bytes=4096)
    manifest = json.loads((tmp_path / "step-1" / "manifest.json").read_text())
    assert manifest["checksum"]["algorithm"] == "sha256"
    for f in manifest["files"]:
        data = (tmp_path / "step-1" / f["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["checksum"]
        assert len(data) == f["size"]
    assert ckpt.verify(tmp_path) == []


def test_rng_states_restore(tmp_path):
    torch.manual_seed(5)
    random.seed(6)
    ckpt.save({"x": torch.zeros(1)}, tmp_path, step=1)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(98)
    ckpt.load(tmp_path, {"x": torch.zeros(1)}, restore_rng=True)
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_retention_latest_and_steps(tmp_path):
    assert ckpt.latest_step(tmp_path) is None
    with ckpt.AsyncCheckpointer(tmp_path, keep_last=2) as saver:
        for step in (10, 20, 30):
            saver.save({"w": torch.full((3,), float(step))}, step=step)
    assert ckpt.list_steps(tmp_path) == [20, 30]
    assert ckpt.latest_step(tmp_path) == 30
    assert ckpt.load(tmp_path, step=20)["w"][0].item() == 20.0


def test_background_failure_raises_on_next_save(tmp_path):
    saver = ckpt.AsyncCheckpointer(tmp_path, _fail_at="files_written")
    saver.save({"w": torch.ones(3)}, step=1)
    with pytest.raises(strata.CheckpointError, match="background save of step 1") as e:
        saver.save({"w": torch.ones(3)}, step=2)
    assert e.value.code == "INTERNAL"
    saver.close()
    assert ckpt.latest_step(tmp_path) is None


def test_test_hook_runs_on_the_writer_at_each_point_and_can_fail_the_save(tmp_path):
    # The hook the elastic tests hold a rank inside a checkpoint write with.
    import threading
    points = []

    def hook(point):
        points.append((point, threading.current_thread() is threading.main_thread()))
        if point == "renamed" and len(points) > 8:
            raise RuntimeError("stop here")

    with ckpt.AsyncCheckpointer(tmp_path, _test_hook=hook) as saver:
        saver.save({"w": torch.ones(3)}, step=1)
        saver.wait()
        first = [p for p, _ in points]
        assert first[:2] == ["prepared", "file_partial"] and "latest_written" in first, first
        assert not any(main for _, main in points)  # the writer's thread, not the caller's
        saver.save({"w": torch.ones(3)}, step=2)
        with pytest.raises(strata.CheckpointError, match="test_hook at renamed: .*stop here"):
            saver.wait()
    assert ckpt.latest_step(tmp_path) == 1


def test_background_failure_warns_and_training_goes_on(tmp_path):
    saver = ckpt.AsyncCheckpointer(tmp_path, on_failure="warn", _fail_at="renamed")
    saver.save({"w": torch.ones(3)}, step=1)
    with pytest.warns(ckpt.CheckpointWarning, match="step 1"):
        saver.save({"w": torch.ones(3)}, step=2)
    with pytest.raises(strata.CheckpointError, match="step 2"):
        saver.wait()
    saver.close()


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(strata.CheckpointError, match="no committed checkpoint") as e:
        ckpt.load(tmp_path)
    assert e.value.code == "NOT_FOUND"
    model = torch.nn.Linear(4, 2)
    ckpt.save({"model": model}, tmp_path, step=1)
    with pytest.raises(strata.CheckpointError, match="missing from checkpoint step 1: 'model.extra'"):
        m = torch.nn.Linear(4, 2)
        m.register_buffer("extra", torch.zeros(1))
        ckpt.load(tmp_path, {"model": m})
    with pytest.raises(strata.CheckpointError, match="under 'model' that the state does not"):
        ckpt.load(tmp_path, {"model": torch.nn.Linear(4, 2, bias=False)})
    ckpt.load(tmp_path, {"model": torch.nn.Linear(4, 2, bias=False)}, strict=False)
    with pytest.raises(strata.CheckpointError, match="tensor 'model.weight': shape mismatch"):
        ckpt.load(tmp_path, {"model": torch.nn.Linear(5, 2)})
    with pytest.raises(strata.CheckpointError, match="entries 'other' of state are not in"):
        ckpt.load(tmp_path, {"model": model, "other": 1})
    with pytest.raises(strata.CheckpointError, match="has entries 'model' that state does not"):
        ckpt.load(tmp_path, {})
    with pytest.raises(strata.CheckpointError, match="complex64"):
        ckpt.save({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path, step=2)
    with pytest.raises(strata.CheckpointError, match="cannot save object at 'x.y'"):
        ckpt.save({"x": {"y": object()}}, tmp_path, step=2)
    with pytest.raises(strata.CheckpointError, match="step 1 is already committed"):
        ckpt.save({"model": model}, tmp_path, step=1)
    with pytest.raises(strata.CheckpointError, match="on_busy 'sometimes'"):
        ckpt.AsyncCheckpointer(tmp_path, on_busy="sometimes")
    with pytest.raises(strata.CheckpointError, match="world must be a strata.World.*builtins.object"):
        ckpt.save({"model": model}, tmp_path, step=3, world=object())
    data = next((tmp_path / "step-1").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(strata.CheckpointError, match="checksum mismatch") as e:
        ckpt.load(tmp_path)
    assert e.value.code == "DATA_LOSS"
    assert any("checksum mismatch" in p for p in ckpt.verify(tmp_path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_are_staged_through_pinned_memory(tmp_path):
    w = torch.randn(1 << 20, device="cuda")
    expected = w.cpu()
    with ckpt.AsyncCheckpointer(tmp_path) as saver:
        saver.save({"w": w, "cpu": torch.ones(3)}, step=1)
        w.zero_()
        saver.wait()
    back = ckpt.load(tmp_path)
    assert torch.equal(back["w"], expected)
    target = {"w": torch.empty(1 << 20, device="cuda"), "cpu": torch.zeros(3)}
    ckpt.load(tmp_path, target)
    assert torch.equal(target["w"].cpu(), expected)


def test_tensor_parallel_layers_mark_their_shards():
    import strata.nn as snn
    col = snn.ColumnParallelLinear(4, 6, group=None)
    row = snn.RowParallelLinear(6, 4, group=None)
    emb = snn.VocabParallelEmbedding(8, 4, group=None)
    assert snn.tensor_sharding(col) == {"weight": (0, 0, 1), "bias": (0, 0, 1)}
    assert snn.tensor_sharding(row) == {"weight": (1, 0, 1)}  # the bias is whole
    assert snn.tensor_sharding(emb) == {"weight": (0, 0, 1)}
    model = torch.nn.Sequential(col, torch.nn.LayerNorm(6), row)
    assert snn.tensor_sharding(model) == {"0.weight": (0, 0, 1), "0.bias": (0, 0, 1),
                                          "2.weight": (1, 0, 1)}


# ---- the state_dict idiom: shard layouts, and loading in place ---------------------


def sharded_mlp():
    """A strata.nn MLP as tp rank 1 of 2 would hold it, built in one process:
    its parameters are ShardedParameters laid out as on that rank."""
    import strata.nn as snn
    torch.manual_seed(3)
    model = snn.ParallelMLP(4, 8, group=None)
    for mod, dim in ((model.fc1, 0), (model.fc2, 1)):
        for name, p in list(mod.named_parameters(recurse=False)):
            if isinstance(p, snn.ShardedParameter):
                setattr(mod, name, snn.ShardedParameter(p.detach(), sharding=(dim, 1, 2)))
    return model


def unsharded(model):
    """``model`` with each ShardedParameter replaced by a plain Parameter."""
    import strata.nn as snn
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if isinstance(p, snn.ShardedParameter):
                setattr(mod, name, torch.nn.Parameter(p.detach().clone()))
    return model


def test_state_dict_and_optimizer_states_of_tensor_parallel_layers_carry_their_layout():
    import strata.nn as snn
    col = snn.ColumnParallelLinear(4, 6, group=None)
    sd = col.state_dict()
    # model.state_dict() detaches: the layout comes along, as DTensor's does.
    assert sd["weight"].tensor_parallel_sharding == (0, 0, 1)
    assert sd["bias"].tensor_parallel_sharding == (0, 0, 1)
    assert type(sd["weight"]) is torch.Tensor  # a plain tensor, in the parameter's memory
    assert sd["weight"].data_ptr() == col.weight.data_ptr()
    x = torch.randn(5, 2, 4)
    for foreach in (False, True):  # torch's two AdamW implementations
        m, ref = sharded_mlp(), unsharded(sharded_mlp())
        y = m(x)
        assert type(y) is torch.Tensor  # activations are not ShardedParameters
        y.sum().backward()
        ref(x).sum().backward()
        assert type(m.fc1.weight.grad) is torch.Tensor
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=foreach)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, foreach=foreach)
        for _ in range(2):
            opt.step()
            ref_opt.step()
        # The same updates as on plain parameters.
        for (n, a), (_, b) in zip(m.named_parameters(), ref.named_parameters()):
            assert torch.equal(a, b), (n, foreach)
        st = opt.state_dict()["state"]
        for i, (name, p) in enumerate(m.named_parameters()):
            spec = getattr(p, "tensor_parallel_sharding", None)
            assert getattr(st[i]["exp_avg"], "tensor_parallel_sharding", None) == spec, name
            assert getattr(st[i]["exp_avg_sq"], "tensor_parallel_sharding", None) == spec, name
            assert getattr(st[i]["step"], "tensor_parallel_sharding", None) is None
        assert st[0]["exp_avg"].tensor_parallel_sharding == (0, 1, 2)  # fc1.weight


def test_sharded_parameters_survive_copies_and_conversions():
    import copy
    import strata.nn as snn
    p = snn.ShardedParameter(torch.randn(2, 3), sharding=(1, 1, 4))
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    for t in (p.detach(), p.clone(), p.data, torch.zeros_like(p), torch.empty_like(p),
              torch.full_like(p, 2.0), torch.randn_like(p)):
        assert type(t) is torch.Tensor and t.tensor_parallel_sharding == (1, 1, 4)
    for t in (p * 2, p.sum(), p.t(), p.detach() + 1, p.reshape(-1)):
        assert type(t) is torch.Tensor and not hasattr(t, "tensor_parallel_sharding")
    q = copy.deepcopy(p)
    assert type(q) is snn.ShardedParameter and q.tensor_parallel_sharding == (1, 1, 4)
    assert torch.equal(q, p) and q.data_ptr() != p.data_ptr()
    lin = torch.nn.Linear(3, 2)
    lin.weight = p
    lin.to(torch.float64)
    assert type(lin.weight) is snn.ShardedParameter and lin.weight.dtype == torch.float64
    assert lin.state_dict()["weight"].tensor_parallel_sharding == (1, 1, 4)
    assert "dim 1, shard 1 of 4" in repr(p)
    with pytest.raises(strata.InvalidArgument, match=r"0 <= dim < 2 .* got \(2, 0, 1\)"):
        snn.ShardedParameter(torch.zeros(2, 3), sharding=(2, 0, 1))
    with pytest.raises(strata.InvalidArgument, match=r"got \(0, 3, 2\)"):
        snn.ShardedParameter(torch.zeros(2, 3), sharding=(0, 3, 2))


def test_torch_optimizers_pick_their_usual_implementation_for_sharded_parameters(monkeypatch):
    import torch.optim.optimizer as O
    import strata.nn as snn
    p = snn.ShardedParameter(torch.zeros(2, 2), sharding=(0, 0, 1))
    q = torch.nn.Parameter(torch.zeros(2, 2))
    # torch picks the multi-tensor (foreach) kernels by default on CUDA only;
    # where it would, it picks them for a ShardedParameter as for a plain one
    # (a type it does not know would get the per-parameter loop).
    assert O._default_to_fused_or_foreach([p], False) == (False, False)  # CPU: the loop
    monkeypatch.setattr(O, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    assert O._default_to_fused_or_foreach([q], False) == (False, True)
    assert O._default_to_fused_or_foreach([p, q], False) == (False, True)
    assert O._default_to_fused_or_foreach([p], False, use_fused=True) == (True, False)


def stepped(seed=0):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, torch.optim.lr_scheduler.StepLR(opt, 2), 3, seed=1)
    return model, opt


def test_loading_into_state_dicts_fills_the_model_and_optimizer_in_place(tmp_path):
    model, opt = stepped()
    ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path, step=3)
    expected = train(model, opt, torch.optim.lr_scheduler.StepLR(opt, 2), 3, seed=2)

    model2, opt2 = stepped(seed=5)  # other weights, other Adam states
    before = {n: p.data_ptr() for n, p in model2.named_parameters()}
    sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    inner, exp_avg = sd["model"], sd["optim"]["state"][0]["exp_avg"]
    assert ckpt.load(tmp_path, sd) is sd
    assert sd["model"] is inner and sd["optim"]["state"][0]["exp_avg"] is exp_avg
    # The model was loaded without load_state_dict: its own memory was filled.
    for n, p in model2.named_parameters():
        assert p.data_ptr() == before[n]
    ckpt.load(tmp_path, {"model": model.state_dict(), "optim": opt.state_dict()}, step=3)
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    opt2.load_state_dict(sd["optim"])  # as torch.distributed.checkpoint users do
    assert train(model2, opt2, torch.optim.lr_scheduler.StepLR(opt2, 2), 3, seed=2) == expected


def test_loading_into_a_flat_state_dict_fills_the_model(tmp_path):
    model, _ = stepped()
    ckpt.save(model.state_dict(), tmp_path, step=1)
    model2, _ = stepped(seed=9)
    sd = model2.state_dict()
    assert ckpt.load(tmp_path, sd) is sd
    for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(a, b), n


def test_an_optimizer_state_dict_without_states_gets_them_from_the_checkpoint(tmp_path):
    model, opt = stepped()
    ckpt.save(opt.state_dict(), tmp_path, step=1)
    model2 = stepped(seed=4)[0]
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)  # no states yet
    sd = opt2.state_dict()
    states, groups = sd["state"], sd["param_groups"]
    assert ckpt.load(tmp_path, sd) is sd
    assert sd["state"] is states and sd["param_groups"] is groups  # filled, not replaced
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), model2.parameters()):
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][field], opt2.state[q][field])


def test_a_state_dict_tensor_the_checkpoint_lacks_is_an_error(tmp_path):
    model, _ = stepped()
    ckpt.save({"model": model.state_dict()}, tmp_path, step=1)
    sd = {"model": model.state_dict()}
    sd["model"]["extra"] = torch.zeros(2)
    with pytest.raises(strata.CheckpointError, match=r"missing from checkpoint step 1: "
                       r"'model.extra'") as e:
        ckpt.load(tmp_path, sd)
    assert e.value.code == "NOT_FOUND"
    ckpt.load(tmp_path, sd, strict=False)
    assert torch.equal(sd["model"]["extra"], torch.zeros(2))
    wrong = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    wrong["model"]["fc1.weight"] = torch.zeros(3, 3)
    with pytest.raises(strata.CheckpointError, match="tensor 'model.fc1.weight': shape mismatch"):
        ckpt.load(tmp_path, wrong)


def test_the_device_digest_of_replicas_sees_every_byte():
    # The digest strata compares replicas on a GPU by, run here on the CPU
    # (the same torch operators).
    from strata._checkpoint_tree import device_digest

    def d(t, chunk_words=1 << 22):
        return int(device_digest(t.contiguous(), chunk_words))

    x = random_tensor(torch.float32, (1001, 7), 5)  # 28028 bytes: not whole 8-byte words
    base = d(x)
    assert d(x.clone()) == base
    assert d(x, chunk_words=1000) == base  # chunked or not
    flat = x.reshape(-1).view(torch.uint8)
    for at in (0, 7, 8, 20000, flat.numel() - 1):
        y = flat.clone()
        y[at] ^= 1
        assert d(y) != d(flat), at
    words = x.reshape(-1)[:7000].view(torch.int64)
    assert d(words.flip(0)) != d(words)  # the order of the words counts
    assert d(x.reshape(-1)[:-1]) != base  # and the length
    assert d(torch.zeros(0)) != d(torch.zeros(2))
    for dt in ALL_DTYPES:
        t = random_tensor(dt, (3, 5), 1)
        assert d(t) == d(t.clone())
    if torch.cuda.is_available():
        assert d(x.cuda()) == base
