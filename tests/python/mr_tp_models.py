"""strata.nn composite modules under mpirun: ParallelMLP, ParallelSelfAttention
and ParallelTransformerBlock against unsharded references written here with
plain torch operators (tp = every size dividing the world), sequence
parallelism against no sequence parallelism, and data x tensor parallelism
(gradients averaged over dp equal the reference's on the whole batch).

    mpirun -np 4 python -m pytest tests/python/mr_tp_models.py
"""

import pytest
import torch
import torch.nn.functional as F

import strata
import strata.nn as snn

torch.set_num_threads(1)
ENV = strata.launch_env()
TPS = [t for t in (1, 2, 4, 8) if ENV.world_size % t == 0]
S, B, H, HEADS, FFN = 8, 2, 16, 8, 32


@pytest.fixture(scope="module", params=TPS, ids=lambda t: f"tp{t}")
def world(request):
    w = strata.init(strata.Mesh(ENV.world_size, tp=request.param))
    yield w
    w.destroy()


def rel_err(got, want):
    scale = want.abs().max().item()
    diff = (got.double() - want.double()).abs().max().item()
    return diff if scale == 0 else diff / scale


def close(got, want, what, tol=1e-5):
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def rows(t, tp, r):
    n = t.shape[0] // tp
    return t[r * n:(r + 1) * n]


def cols(t, tp, r):
    n = t.shape[-1] // tp
    return t[..., r * n:(r + 1) * n]


def randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class RefAttention(torch.nn.Module):
    """Unsharded causal self-attention, QKV features laid out per head."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(H, 3 * H)
        self.proj = torch.nn.Linear(H, H)

    def forward(self, x):
        s, b, d = x.shape[0], x.shape[1], H // HEADS
        qkv = self.qkv(x).view(s, b, HEADS, 3, d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(3))
        scores = q @ k.transpose(-1, -2) / d ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        a = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(a.permute(2, 0, 1, 3).reshape(s, b, H))


class RefMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(H, FFN)
        self.fc2 = torch.nn.Linear(FFN, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class RefBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(H)
        self.attn = RefAttention()
        self.ln2 = torch.nn.LayerNorm(H)
        self.mlp = RefMLP()

    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))


# How each parameter of the strata modules is a shard of the reference's.
def shard_of(name, ref_param, tp, r):
    if name.endswith(("qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias")):
        return rows(ref_param, tp, r)
    if name.endswith(("proj.weight", "fc2.weight")):
        return cols(ref_param, tp, r)
    return ref_param  # replicated: row-parallel biases, layer norms


def compare_module(world, ref_cls, make, sp, what):
    tp_group = world.group("tp")
    tp, r = tp_group.size, tp_group.rank
    torch.manual_seed(5)
    ref = ref_cls()
    torch.manual_seed(5)
    mod = make(group=world, sequence_parallel=sp)
    x = randn((S, B, H), 6)
    probe = randn((S, B, H), 7)
    xr = x.clone().requires_grad_()
    y = ref(xr)
    (y * probe).sum().backward()
    xs = (rows(x, tp, r) if sp else x).clone().requires_grad_()
    out = mod(xs)
    close(out.detach(), rows(y.detach(), tp, r) if sp else y.detach(), f"{what} output")
    (out * (rows(probe, tp, r) if sp else probe)).sum().backward()
    close(xs.grad, rows(xr.grad, tp, r) if sp else xr.grad, f"{what} grad input")
    ref_params = dict(ref.named_parameters())
    for name, p in mod.named_parameters():
        want = ref_params[name]
        assert torch.equal(p.detach(), shard_of(name, want.detach(), tp, r)), f"{what} init {name}"
        close(p.grad, shard_of(name, want.grad, tp, r), f"{what} grad {name}")
    return out, xs.grad, {n: p.grad for n, p in mod.named_parameters()}


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_parallel_mlp(world, sp):
    compare_module(world, RefMLP, lambda **kw: snn.ParallelMLP(H, FFN, **kw), sp, f"mlp sp={sp}")


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_parallel_self_attention(world, sp):
    compare_module(world, RefAttention, lambda **kw: snn.ParallelSelfAttention(H, HEADS, **kw),
                   sp, f"attention sp={sp}")


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_parallel_transformer_block(world, sp):
    compare_module(world, RefBlock,
                   lambda **kw: snn.ParallelTransformerBlock(H, HEADS, FFN, **kw), sp,
                   f"block sp={sp}")


def test_sequence_parallel_equals_non_sequence_parallel(world):
    tp_group = world.group("tp")
    tp, r = tp_group.size, tp_group.rank
    results = {}
    for sp in (False, True):
        torch.manual_seed(3)
        block = snn.ParallelTransformerBlock(H, HEADS, FFN, group=world, sequence_parallel=sp)
        x = randn((S, B, H), 4)
        xs = (rows(x, tp, r) if sp else x).clone().requires_grad_()
        out = block(xs)
        # Under sequence parallelism the objective is the sum of every rank's
        # token-shard term: the same objective as the whole sum without it.
        out.pow(2).sum().backward()
        full_out = out.detach()
        if sp:
            full_out = torch.empty((S, B, H))
            tp_group.all_gather(full_out, out.detach().contiguous())
        results[sp] = (full_out, xs.grad,
                       {n: p.grad.clone() for n, p in block.named_parameters()})
    (y0, g0, p0), (y1, g1, p1) = results[False], results[True]
    close(y1, y0, "sp output vs no sp")
    close(g1, rows(g0, tp, r), "sp grad input vs no sp")
    for name in p0:
        close(p1[name], p0[name], f"sp grad {name} vs no sp")


def test_data_times_tensor_parallel_gradients(world):
    """Each dp replica takes its own part of the batch; gradients averaged
    over dp equal the reference's on the whole batch."""
    dp_group, tp_group = world.group("dp"), world.group("tp")
    dp, d = dp_group.size, dp_group.rank
    tp, r = tp_group.size, tp_group.rank
    batch = 2 * dp
    torch.manual_seed(11)
    ref = RefMLP()
    torch.manual_seed(11)
    mlp = snn.ParallelMLP(H, FFN, group=world)
    x = randn((S, batch, H), 12)
    ref(x).pow(2).mean().backward()
    mine = x[:, d * 2:(d + 1) * 2]
    mlp(mine).pow(2).mean().backward()
    for name, p in mlp.named_parameters():
        g = p.grad.contiguous()
        dp_group.all_reduce(g, op="avg")
        close(g, shard_of(name, dict(ref.named_parameters())[name].grad, tp, r),
              f"dp{dp} x tp{tp} grad {name}")
