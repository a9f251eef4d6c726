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
