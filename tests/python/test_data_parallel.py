"""strata.nn.DataParallel and strata.optim.DistributedOptimizer in one
process: the bucket layout and ZeRO-1 pieces (exhaustively over small
cases), options and every error a user can cause in one process, training
on a world of one rank equal to plain training, one reduction per pipeline
step, ZeRO-1 state through state_dict and strata.checkpoint, and a failed
reduction that leaves the step abandonable whole (a group whose collective
fails on demand). The multi-rank behaviour is in mr_data_parallel*.py.
"""

import itertools

import pytest
import torch

import strata
import strata.checkpoint as ckpt
import strata.nn as snn
from strata import pipeline
from strata._dp_layout import Entry, Layout

torch.set_num_threads(1)
DT = torch.float64


@pytest.fixture(scope="module")
def world():
    w = strata.init()
    yield w
    w.destroy()


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12, dtype=DT), torch.nn.Tanh(),
                               torch.nn.Linear(12, 12, dtype=DT), torch.nn.Tanh(),
                               torch.nn.Linear(12, 3, dtype=DT))


def batch(step, rows=8):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows, 6, generator=g, dtype=DT)
    return x, torch.sin(x[:, :3])


def loss_of(model, step):
    x, y = batch(step)
    return torch.nn.functional.mse_loss(model(x), y)


def plain_run(steps, seed=0, skip=()):
    m = mlp(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for s in range(steps):
        if s in skip:
            continue
        opt.zero_grad()
        loss_of(m, s).backward()
        opt.step()
    return m


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ---- layout ---------------------------------------------------------------------------
class _P:
    def __init__(self, n, dtype):
        self.dtype, self.shape = dtype, (n,)

    def numel(self):
        return self.shape[0]


def entries(sizes, dtypes=None, tails=()):
    dtypes = dtypes or [torch.float32] * len(sizes)
    return [Entry(i, f"p{i}", _P(n, d), i in tails) for i, (n, d) in enumerate(zip(sizes, dtypes))]


def test_buckets_close_by_bytes_per_dtype_with_tails_last():
    es = entries([4, 4, 4, 2, 2, 8], [torch.float32] * 3 + [torch.float64] * 2 + [torch.float32],
                 tails={5})
    lay = Layout(es, [0, 3, 1, 4, 2, 5], bucket_bytes=32, pad=1)
    got = [(b.dtype, [e.index for e in b.entries], b.start, b.length, b.tail) for b in lay.buckets]
    assert got == [(torch.float32, [0, 1], 0, 8, False),   # 32 bytes: closes
                   (torch.float64, [3, 4], 0, 4, False),
                   (torch.float32, [2], 8, 4, False),      # left open, closed at the end
                   (torch.float32, [5], 12, 8, True)]      # the tail, after every other
    assert lay.sizes == {torch.float32: 20, torch.float64: 4}


@pytest.mark.parametrize("pad", [1, 2, 3, 4])
def test_zero1_pieces_cover_every_element_once(pad):
    for sizes in itertools.product([1, 3, 5], repeat=3):
        for cap in (4, 12, 1000):
            es = entries(list(sizes))
            lay = Layout(es, [2, 0, 1], bucket_bytes=cap, pad=pad)
            seen = {e.index: [0] * e.numel for e in es}
            shard_total = 0
            for r in range(pad):
                pieces = lay.pieces(r, pad)
                offs = [p[4] for p in pieces]
                assert offs == sorted(offs)
                for e, lo, hi, buf, sh in pieces:
                    assert buf == lay.offset[e.index] + lo
                    for k in range(lo, hi):
                        seen[e.index][k] += 1
                shard_total = lay.shard_sizes[torch.float32]
            assert all(c == 1 for v in seen.values() for c in v), (sizes, cap, pad, seen)
            assert all(b.length % pad == 0 for b in lay.buckets)
            assert shard_total * pad == lay.sizes[torch.float32]


# ---- options and construction errors ---------------------------------------------------
def test_options_are_checked(world):
    with pytest.raises(strata.InvalidArgument, match="bucket_bytes must be an int >= 1"):
        snn.DataParallel(mlp(), world, bucket_bytes=0)
    with pytest.raises(strata.InvalidArgument, match="reduce_op must be 'avg' or 'sum'"):
        snn.DataParallel(mlp(), world, reduce_op="max")
    with pytest.raises(strata.InvalidArgument, match=r"unknown DataParallelOptions option\(s\) "
                       r"\['bucket_mb'\]"):
        snn.DataParallel(mlp(), world, bucket_mb=25)
    with pytest.raises(strata.InvalidArgument, match="world must be a strata.World or a strata"):
        snn.DataParallel(mlp(), "dp")
    with pytest.raises(strata.InvalidArgument, match="wraps a torch.nn.Module"):
        snn.DataParallel(lambda x: x, world)
    m = mlp()
    first = snn.DataParallel(m, world)
    with pytest.raises(strata.InvalidArgument, match="already belong to another DataParallel"):
        snn.DataParallel(m, world)
    del first


def test_optimizer_errors(world):
    with pytest.raises(strata.InvalidArgument, match="LBFGS reads whole parameters"):
        strata.optim.DistributedOptimizer(torch.optim.LBFGS, mlp().parameters(), world)
    with pytest.raises(strata.InvalidArgument, match="must be a torch.optim.Optimizer subclass"):
        strata.optim.DistributedOptimizer("adamw", mlp().parameters(), world)
    m = mlp()
    m[0].bias.requires_grad_(False)
    with pytest.raises(strata.InvalidArgument, match="do not require grad"):
        strata.optim.DistributedOptimizer(torch.optim.AdamW, m.parameters(), world)
    dp = snn.DataParallel(mlp(), world)
    with pytest.raises(strata.InvalidArgument, match=r"holds parameters \['4.weight', '4.bias'\] "
                       "that are not given to this optimizer"):
        strata.optim.DistributedOptimizer(torch.optim.AdamW, list(dp.parameters())[:4], world)
    loose = torch.nn.Parameter(torch.zeros(3, dtype=DT))
    with pytest.raises(strata.InvalidArgument, match="belong to no DataParallel"):
        strata.optim.DistributedOptimizer(torch.optim.AdamW, list(dp.parameters()) + [loose],
                                          world)
    with pytest.raises(strata.InvalidArgument, match="options= applies only without"):
        strata.optim.DistributedOptimizer(torch.optim.AdamW, dp.parameters(), world,
                                          options={"bucket_bytes": 64})


# ---- training on one rank --------------------------------------------------------------
@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_one_rank_trains_as_plain_torch(world, zero, set_to_none):
    dp = snn.DataParallel(mlp(), world, bucket_bytes=256)
    opt = (strata.optim.DistributedOptimizer(torch.optim.AdamW, dp.parameters(), world, lr=1e-2)
           if zero else torch.optim.AdamW(dp.parameters(), lr=1e-2))
    for s in range(5):
        if set_to_none:  # torch's default: .grad None, copied into the buffer by the hook
            for p in dp.parameters():
                p.grad = None
        else:
            opt.zero_grad()
        loss_of(dp, s).backward()
        for p in dp.parameters():  # .grad is a view of the flat buffer
            assert any(p.grad.data_ptr() >= b.data_ptr()
                       and p.grad.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
                       for b in dp.grad_buffers().values())
        opt.step()
    assert len(dp.buckets) >= 2
    ref = plain_run(5)
    assert same(dp.module, ref)


def test_no_sync_accumulates_and_reduces_once(world):
    dp = snn.DataParallel(mlp(), world, record_events=True)
    x, y = batch(0)
    dp.zero_grad()
    with dp.no_sync():
        torch.nn.functional.mse_loss(dp(x[:4]), y[:4]).backward()
    torch.nn.functional.mse_loss(dp(x[4:]), y[4:]).backward()
    assert sum(1 for e in dp.events if e[0] == "launch") == len(dp.buckets)
    ref = mlp()
    torch.nn.functional.mse_loss(ref(x[:4]), y[:4]).backward()
    torch.nn.functional.mse_loss(ref(x[4:]), y[4:]).backward()
    for p, q in zip(dp.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-14, atol=0)


def test_pipeline_schedules_reduce_once_per_step(world):
    """A one-stage pipeline (pp of one rank): 4 microbatches, one reduction
    per step, gradients as the unpipelined model's."""
    for cls in (pipeline.Schedule1F1B, pipeline.ScheduleZeroBubble):
        dp = snn.DataParallel(mlp(), world, record_events=True)
        stage = pipeline.PipelineStage(dp, 0, world)
        schedule = cls(stage, 4, torch.nn.functional.mse_loss)
        x, y = batch(0)
        dp.zero_grad()
        schedule.step(x, y)
        assert sum(1 for e in dp.events if e[0] == "launch") == len(dp.buckets), cls
        ref = mlp()
        for xs, ys in zip(x.tensor_split(4), y.tensor_split(4)):
            (torch.nn.functional.mse_loss(ref(xs), ys) / 4).backward()
        for p, q in zip(dp.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15), cls


# ---- errors during training ------------------------------------------------------------------
def test_unused_parameters_are_named(world):
    class Spare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(3, 3, dtype=DT)
            self.spare = torch.nn.Linear(3, 3, dtype=DT)

        def forward(self, x):
            return self.used(x)

    dp = snn.DataParallel(Spare(), world)
    x = torch.ones(2, 3, dtype=DT)
    with pytest.raises(snn.UnusedParametersError,
                       match=r"dp rank 0: 'spare.weight', 'spare.bias'.*find_unused_parameters"):
        dp(x).sum().backward()
    with pytest.raises(snn.UnusedParametersError):  # again: every step says it
        dp(x).sum().backward()
    dp = snn.DataParallel(Spare(), world, find_unused_parameters=True)
    dp(x).sum().backward()
    dp(x).sum().backward()


def test_changes_after_wrapping_are_named(world):
    cases = [
        (lambda m: m.add_module("extra", torch.nn.Linear(2, 2, dtype=DT)), "'extra.weight' added"),
        (lambda m: delattr(m[4], "bias") or m[4].register_parameter("bias", None),
         "'4.bias' removed"),
        (lambda m: setattr(m[0].weight, "data", torch.zeros(3, 6, dtype=DT)),
         r"'0.weight' changed from \(12, 6\)"),
        (lambda m: m[2].weight.requires_grad_(False), "'2.weight' requires_grad changed"),
    ]
    for change, message in cases:
        dp = snn.DataParallel(mlp(), world)
        change(dp.module)
        with pytest.raises(snn.ModuleChangedError, match=message):
            dp(torch.ones(1, 6, dtype=DT))


class Flaky:
    """A strata Group whose gradient reductions fail while ``fail`` is set
    (control collectives, of a few elements, pass)."""

    def __init__(self, group):
        self.g, self.fail = group, False
        self.rank, self.size, self.name, self.memory = group.rank, group.size, "flaky", "host"

    def _maybe(self, work, t):
        if self.fail and t.numel() > 16:
            class Failed:
                def wait(self, timeout=None):
                    raise strata.CommError("injected failure of a bucket's reduction")
            return Failed()
        return work

    def all_reduce(self, t, op="sum", async_op=False, timeout=None):
        return self._maybe(self.g.all_reduce(t, op=op, async_op=async_op, timeout=timeout), t)

    def reduce_scatter(self, out, inp, op="sum", async_op=False, timeout=None):
        return self._maybe(self.g.reduce_scatter(out, inp, op=op, async_op=async_op,
                                                 timeout=timeout), inp)

    def all_gather(self, out, inp, async_op=False, timeout=None):
        return self.g.all_gather(out, inp, async_op=async_op, timeout=timeout)

    def broadcast(self, t, src=0, async_op=False, timeout=None):
        return self.g.broadcast(t, src=src, async_op=async_op, timeout=timeout)


@pytest.mark.parametrize("zero", [False, True])
def test_a_failed_reduction_leaves_the_step_abandonable(world, zero):
    """Step 2's reduction fails: backward raises after every bucket was
    waited for, nothing changed, the next forward and step() refuse until
    zero_grad(), and training then goes on as if step 2 had never been."""
    group = Flaky(world.group("dp"))
    dp = snn.DataParallel(mlp(), group, bucket_bytes=256)
    opt = (strata.optim.DistributedOptimizer(torch.optim.AdamW, dp.parameters(), group, lr=1e-2)
           if zero else torch.optim.AdamW(dp.parameters(), lr=1e-2))
    for s in range(2):
        opt.zero_grad()
        loss_of(dp, s).backward()
        opt.step()
    before = [p.detach().clone() for p in dp.parameters()]
    state = opt.state_bytes() if zero else None
    group.fail = True
    opt.zero_grad()
    with pytest.raises(strata.CommError, match="injected"):
        loss_of(dp, 2).backward()
    group.fail = False
    assert all(torch.equal(p, b) for p, b in zip(dp.parameters(), before))
    with pytest.raises(snn.GradientSyncFailed, match="abandon the step with zero_grad"):
        dp(batch(2)[0])
    if zero:
        with pytest.raises(snn.GradientSyncFailed):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(dp.parameters(), before))
        assert opt.state_bytes() == state
    # Abandons the step: DataParallel.zero_grad() (a DistributedOptimizer's
    # zero_grad() too; a plain torch optimizer's does not know of it).
    (opt if zero else dp).zero_grad()
    for s in range(3, 5):
        opt.zero_grad()
        loss_of(dp, s).backward()
        opt.step()
    assert same(dp.module, plain_run(5, skip={2}))


# ---- ZeRO-1 state ----------------------------------------------------------------------------
def test_zero1_state_dict_round_trip(world):
    def make():
        dp = snn.DataParallel(mlp(), world, bucket_bytes=256)
        return dp, strata.optim.DistributedOptimizer(torch.optim.AdamW, dp.module.named_parameters(),
                                                     world, lr=1e-2)

    a, oa = make()
    for s in range(3):
        oa.zero_grad()
        loss_of(a, s).backward()
        oa.step()
    sd = oa.state_dict()
    assert set(sd["state"]) == {n for n, _ in a.module.named_parameters()}
    b, ob = make()
    b.module.load_state_dict(a.module.state_dict())
    ob.load_state_dict(sd)
    for s in range(3, 5):
        for dp, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            loss_of(dp, s).backward()
            opt.step()
    assert same(a, b)
    with pytest.raises(strata.InvalidArgument, match="not a DistributedOptimizer state dict"):
        ob.load_state_dict(torch.optim.AdamW(mlp().parameters()).state_dict())


def test_zero1_state_through_checkpoint(world, tmp_path):
    def make():
        dp = snn.DataParallel(mlp(), world, bucket_bytes=256)
        return dp, strata.optim.DistributedOptimizer(torch.optim.AdamW, dp.parameters(), world,
                                                     lr=1e-2)

    a, oa = make()
    for s in range(3):
        oa.zero_grad()
        loss_of(a, s).backward()
        oa.step()
    ckpt.save({"model": a, "optimizer": oa}, tmp_path, step=3)
    keys = ckpt.info(tmp_path)["tensors"]
    assert keys["optimizer.state.model.module.0.weight.exp_avg"] == (DT, (1, 72))
    b, ob = make()  # loaded before its first backward: the layout is provisional
    ckpt.load(tmp_path, {"model": b, "optimizer": ob})
    for s in range(3, 6):
        for dp, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            loss_of(dp, s).backward()
            opt.step()
    assert same(a, b)
    assert same(a.module, plain_run(6))


def test_strata_optim_is_reachable_from_import_strata():
    import importlib
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import strata; "
                          "print(strata.optim.DistributedOptimizer.__name__, "
                          "strata.nn.DataParallel.__name__)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["DistributedOptimizer", "DataParallel"], out.stderr
    assert importlib.import_module("strata.optim").__all__ == ["DistributedOptimizer"]


# ---- a newcomer's model (elastic) --------------------------------------------------------------
@pytest.mark.parametrize("other_order", [False, True])
def test_a_newcomers_gradient_buffers_are_zero_once_it_adopts_a_members_layout(world,
                                                                             other_order):
    """Built while its state arrives (strata.elastic.Receiving), a model's
    gradient buffers are left unwritten until it takes a member's bucket
    order (the same order, or another): then they hold zeros, and the
    model trains as a fresh one does."""
    from strata._elastic_transfer import Receiving
    member = snn.DataParallel(mlp(), world, bucket_bytes=256)
    loss_of(member, 0).backward()  # its first backward fixes its bucket order
    order, final = member._layout_state()
    if other_order:
        order = order[::-1]
    with Receiving():
        newcomer = snn.DataParallel(mlp(), world, bucket_bytes=256)
    for buf in newcomer._reducer.grad.values():
        buf.fill_(float("nan"))  # what fresh memory may hold
    newcomer._adopt_layout((order, final))
    assert newcomer._layout_state()[0] == order
    for p in newcomer.parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    fresh = snn.DataParallel(mlp(), world, bucket_bytes=256)
    loss_of(newcomer, 1).backward()
    loss_of(fresh, 1).backward()
    for p, q in zip(newcomer.parameters(), fresh.parameters()):
        assert torch.equal(p.grad, q.grad)
