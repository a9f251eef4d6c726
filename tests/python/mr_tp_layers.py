"""strata.nn layers under mpirun: for tp in every size that divides the
world (1, 2, 4, 8 on 8 ranks; dp2 x tp2 on 4), each layer and option
combination, fp32 and bf16, the forward output and every gradient equal
those of the unsharded layer computed here with plain torch operators
(fp32: relative error <= 1e-5, bf16: <= 1e-2).

    mpirun -np 8 python -m pytest tests/python/mr_tp_layers.py

With STRATA_TEST_DEVICE=cuda the layers and the reference run on the
rank's GPU (the local rank modulo the visible devices, so several ranks may
share one) and the groups on NCCL; tools/dev/gpu_checks.sh runs it so under
torchrun. On CUDA it also checks that the column-parallel backward really
overlaps its input-gradient all-reduce with the weight-gradient GEMM (the
kernels' times, from torch's profiler, overlap).

    STRATA_TEST_DEVICE=cuda torchrun --nproc-per-node 4 -m pytest tests/python/mr_tp_layers.py
"""

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

import strata
import strata.nn as snn

torch.set_num_threads(1)
ENV = strata.launch_env()
TPS = [t for t in (1, 2, 4, 8) if ENV.world_size % t == 0]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
S, B = 8, 2  # sequence, batch: divisible by every tp
DEVICE = torch.device(os.environ.get("STRATA_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    DEVICE = torch.device("cuda", ENV.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(DEVICE)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs in fp32, as on the CPU


@pytest.fixture(scope="module", params=TPS, ids=lambda t: f"tp{t}")
def world(request):
    backend = "nccl" if DEVICE.type == "cuda" else "auto"
    w = strata.init(strata.Mesh(ENV.world_size, tp=request.param), backend=backend)
    yield w
    w.destroy()


def rel_err(got, want):
    got, want = got.double(), want.double()
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return diff if scale == 0 else diff / scale


def check(got, want, dtype, what):
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


def data(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def rows(t, tp, r):
    n = t.shape[0] // tp
    return t[r * n:(r + 1) * n]


def cols(t, tp, r):
    n = t.shape[-1] // tp
    return t[..., r * n:(r + 1) * n]


def reference_linear(in_f, out_f, bias, seed, dtype):
    """torch.nn.Linear drawn from ``seed``, its parameters rounded to
    ``dtype`` (what the strata layer holds), computing in fp32."""
    torch.manual_seed(seed)
    ref = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(dtype).float())
    return ref.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_column_parallel_linear(world, dtype):
    tp_group = world.group("tp")
    tp, r = tp_group.size, tp_group.rank
    in_f, out_f = 12, 16
    for bias, gather, sp, skip in itertools.product([True, False], repeat=4):
        if gather and sp:
            continue
        what = f"column tp{tp} bias={bias} gather_output={gather} sp={sp} skip_bias_add={skip}"
        ref = reference_linear(in_f, out_f, bias, 7, dtype)
        x = data((S, B, in_f), 1, dtype)
        probe = data((S, B, out_f), 2, dtype)
        xr = x.detach().float().clone().requires_grad_()
        y = ref(xr)
        (y * probe.float()).sum().backward()

        torch.manual_seed(7)
        layer = snn.ColumnParallelLinear(in_f, out_f, group=world, bias=bias, gather_output=gather,
                                         sequence_parallel=sp, skip_bias_add=skip, dtype=dtype,
                                         device=DEVICE)
        assert torch.equal(layer.weight.float(), rows(ref.weight.detach(), tp, r)), what
        xs = (rows(x, tp, r) if sp else x).detach().clone().requires_grad_()
        out = layer(xs)
        if skip:
            out, b = out
            assert (b is None) == (not bias)
            out = out + b if b is not None else out
        want = y.detach() if gather else cols(y.detach(), tp, r)
        check(out.detach(), want, dtype, what + " output")
        p = probe if gather else cols(probe, tp, r)
        (out.float() * p.float()).sum().backward()
        check(xs.grad, rows(xr.grad, tp, r) if sp else xr.grad, dtype, what + " grad input")
        check(layer.weight.grad, rows(ref.weight.grad, tp, r), dtype, what + " grad weight")
        if bias:
            check(layer.bias.grad, cols(ref.bias.grad, tp, r), dtype, what + " grad bias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_parallel_linear(world, dtype):
    tp_group = world.group("tp")
    tp, r = tp_group.size, tp_group.rank
    in_f, out_f = 16, 12
    for bias, parallel_in, sp, skip in itertools.product([True, False], repeat=4):
        if sp and not parallel_in:
            continue
        what = f"row tp{tp} bias={bias} input_is_parallel={parallel_in} sp={sp} skip={skip}"
        ref = reference_linear(in_f, out_f, bias, 8, dtype)
        x = data((S, B, in_f), 3, dtype)
        probe = data((S, B, out_f), 4, dtype)
        xr = x.detach().float().clone().requires_grad_()
        y = ref(xr)
        (y * probe.float()).sum().backward()

        torch.manual_seed(8)
        layer = snn.RowParallelLinear(in_f, out_f, group=world.group("tp"), bias=bias,
                                      input_is_parallel=parallel_in, sequence_parallel=sp,
                                      skip_bias_add=skip, dtype=dtype, device=DEVICE)
        assert torch.equal(layer.weight.float(), cols(ref.weight.detach(), tp, r)), what
        xs = (cols(x, tp, r) if parallel_in else x).detach().clone().requires_grad_()
        out = layer(xs)
        if skip:
            out, b = out
            out = out + b if b is not None else out
        check(out.detach(), rows(y.detach(), tp, r) if sp else y.detach(), dtype, what + " output")
        (out.float() * (rows(probe, tp, r) if sp else probe).float()).sum().backward()
        check(xs.grad, cols(xr.grad, tp, r) if parallel_in else xr.grad, dtype, what + " grad input")
        check(layer.weight.grad, cols(ref.weight.grad, tp, r), dtype, what + " grad weight")
        if bias:
            check(layer.bias.grad, ref.bias.grad, dtype, what + " grad bias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_vocab_parallel_embedding(world, dtype, sp):
    tp_group = world.group("tp")
    tp, r = tp_group.size, tp_group.rank
    vocab, dim = 32, 6
    torch.manual_seed(9)
    ref = torch.nn.Embedding(vocab, dim)
    with torch.no_grad():
        ref.weight.copy_(ref.weight.to(dtype).float())
    ref = ref.to(DEVICE)
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(0, vocab, (S, B), generator=g).to(DEVICE)
    probe = data((S, B, dim), 11, dtype)
    y = ref(ids)
    (y.float() * probe.float()).sum().backward()
    torch.manual_seed(9)
    emb = snn.VocabParallelEmbedding(vocab, dim, group=world, sequence_parallel=sp, dtype=dtype,
                                     device=DEVICE)
    assert torch.equal(emb.weight.float(), rows(ref.weight.detach(), tp, r))
    out = emb(ids)
    check(out.detach(), rows(y.detach(), tp, r) if sp else y.detach(), dtype, "embedding output")
    (out.float() * (rows(probe, tp, r) if sp else probe).float()).sum().backward()
    check(emb.weight.grad, rows(ref.weight.grad, tp, r), dtype, "embedding grad weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vocab_parallel_cross_entropy_matches_torch(world, dtype):
    tp_group = world.group("tp")
    tp, r = tp_group.size, tp_group.rank
    vocab = 40
    logits = (data((S, B, vocab), 12, torch.float32) * 4).to(dtype)
    g = torch.Generator().manual_seed(13)
    base = torch.randint(0, vocab, (S, B), generator=g).to(DEVICE)
    base[5, 0] = 7
    for smoothing, ignore in itertools.product([0.0, 0.1], [-100, 7]):
        target = base.clone()
        target[0, 0] = target[3, 1] = ignore
        what = f"cross-entropy tp{tp} label_smoothing={smoothing} ignore_index={ignore}"
        zr = logits.clone().float().requires_grad_()
        want = F.cross_entropy(zr.flatten(0, 1), target.flatten(), reduction="none",
                               ignore_index=ignore, label_smoothing=smoothing).view(S, B)
        weights = data((S, B), 14, torch.float32)
        (want * weights).sum().backward()
        zs = cols(logits, tp, r).clone().requires_grad_()
        loss = snn.vocab_parallel_cross_entropy(zs, target, group=world, ignore_index=ignore,
                                                label_smoothing=smoothing)
        assert loss.dtype == torch.float32
        # The loss is computed in fp32 from the (possibly bf16) logits.
        check(loss.detach(), want.detach(), torch.float32, what + " loss")
        (loss * weights).sum().backward()
        check(zs.grad, cols(zr.grad, tp, r), dtype, what + " grad logits")
        # torch's default reduction is the mean over the tokens not ignored.
        mean = loss.sum() / (target != ignore).sum()
        torch_mean = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(),
                                     ignore_index=ignore, label_smoothing=smoothing)
        check(mean.detach(), torch_mean, torch.float32, what + " mean")


def _kernels(prof):
    """(name, start us, end us) of the CUDA kernels torch's profiler saw."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out


@pytest.mark.skipif(DEVICE.type != "cuda", reason="stream overlap is a CUDA property "
                    "(STRATA_TEST_DEVICE=cuda)")
def test_column_parallel_backward_overlaps_its_all_reduce_with_the_weight_gradient(world):
    tp_group = world.group("tp")
    tp = tp_group.size
    if tp == 1:
        pytest.skip("a group of one communicates nothing")
    from torch.profiler import ProfilerActivity, profile
    tokens, in_f, out_f = 2048, 4096, 2048 * tp  # the all-reduce: 32 MiB of fp32
    torch.manual_seed(21)
    layer = snn.ColumnParallelLinear(in_f, out_f, group=world, bias=False, device=DEVICE)
    x = torch.randn(tokens, 1, in_f, device=DEVICE, requires_grad=True)
    dy = torch.randn(tokens, 1, out_f // tp, device=DEVICE)

    def step():
        x.grad = None
        layer.weight.grad = None
        layer(x).backward(dy)
        torch.cuda.synchronize()

    step()  # warm-up: NCCL's and cuBLAS's first calls
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
    kernels = _kernels(prof)
    if not kernels:
        pytest.skip("torch's profiler recorded no CUDA kernels here (CUPTI unavailable?)")
    nccl = [k for k in kernels if "nccl" in k[0].lower()]
    compute = [k for k in kernels if "nccl" not in k[0].lower()
               and "memcpy" not in k[0].lower() and "memset" not in k[0].lower()]
    assert nccl, f"no NCCL kernel in the backward: {[k[0] for k in kernels]}"
    overlapping = [(c[0], n[0]) for c in compute for n in nccl
                   if c[1] < n[2] and c[2] > n[1]]
    timeline = "; ".join(f"{name[:40]} {start:.0f}-{end:.0f} us"
                         for name, start, end in sorted(kernels, key=lambda k: k[1]))
    assert overlapping, ("no compute kernel ran while the input-gradient all-reduce did (the "
                         f"collective was serialised with the weight-gradient GEMM): {timeline}")
    # And the values are still right: the same layer without overlap (tp of
    # one rank's shard computed here) is the reference for the weight.
    want_w = dy.reshape(tokens, -1).t().matmul(x.detach().reshape(tokens, -1))
    check(layer.weight.grad, want_w, torch.float32, "grad weight with overlap")


def test_errors_name_the_sizes(world):
    tp = world.group("tp").size
    if tp == 1:
        pytest.skip("every size divides by 1")
    with pytest.raises(strata.InvalidArgument, match=f"out_features 3 is not divisible by the "
                                                     f"tensor-parallel size {tp}"):
        snn.ColumnParallelLinear(4, 3, group=world)
    with pytest.raises(strata.InvalidArgument, match="in_features 5 is not divisible"):
        snn.RowParallelLinear(5, 4, group=world)
    with pytest.raises(strata.InvalidArgument, match="sequence_parallel needs input_is_parallel"):
        snn.RowParallelLinear(8, 4, group=world, sequence_parallel=True)
    with pytest.raises(strata.InvalidArgument, match="gather_output cannot be combined"):
        snn.ColumnParallelLinear(8, 8, group=world, gather_output=True, sequence_parallel=True)
    with pytest.raises(strata.InvalidArgument, match="num_embeddings 7 is not divisible"):
        snn.VocabParallelEmbedding(7, 4, group=world)
    with pytest.raises(strata.InvalidArgument, match="num_heads 3 is not divisible"):
        snn.ParallelSelfAttention(6 * tp, 3, group=world)
    emb = snn.VocabParallelEmbedding(8, 4, group=world)
    with pytest.raises(strata.InvalidArgument, match="id 8 is outside the vocabulary"):
        emb(torch.tensor([[1], [8]]))
    z = torch.zeros(2, 4)
    with pytest.raises(strata.InvalidArgument, match="label_smoothing 1.0 is outside"):
        snn.vocab_parallel_cross_entropy(z, torch.tensor([0, 1]), group=world, label_smoothing=1.0)
    with pytest.raises(strata.InvalidArgument, match=f"target {4 * tp} is outside the vocabulary"):
        snn.vocab_parallel_cross_entropy(z, torch.tensor([0, 4 * tp]), group=world)
    with pytest.raises(strata.InvalidArgument, match="group must be a strata.World"):
        snn.ColumnParallelLinear(4, 4, group="tp")
    row = snn.RowParallelLinear(8 * tp, 4, group=world, input_is_parallel=True,
                                sequence_parallel=True)
    with pytest.raises(strata.InvalidArgument, match=f"{tp + 1} rows \\(the sequence dimension\\) "
                                                     "are not divisible"):
        row(torch.zeros(tp + 1, 1, 8))
    sp_emb = snn.VocabParallelEmbedding(8, 4, group=world, sequence_parallel=True)
    with pytest.raises(strata.InvalidArgument, match="are not divisible by the tensor-parallel"):
        sp_emb(torch.zeros(tp + 1, 1, dtype=torch.long))
