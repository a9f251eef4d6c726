"""Models, data and references for the data-parallel tests (tests/python/
mr_data_parallel*.py): every rank computes, in the same test, the unsharded
model trained on the whole global batch in one process, and torch's
DistributedDataParallel (gloo, over the same dp groups) training the
unsharded model on each rank's part of the batch.

Models are float64 so that the comparison measures the reduction, not the
rounding of a different summation order.
"""

import datetime
import os
import socket
import sys

import torch
import torch.nn.functional as F

import strata
import strata.nn as snn

DTYPE = torch.float64
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "demo"))


def agree(world, problems):
    """Every rank fails if any rank found a problem (so no rank waits)."""
    flag = torch.tensor([1 if problems else 0], dtype=torch.int32)
    world.group().all_reduce(flag, op="max")
    assert not problems, problems[:6]
    assert flag.item() == 0, "failed on another rank (see its report)"


class MLP(torch.nn.Module):
    """x -> tanh(fc1) -> tanh(fc2) -> tanh(fc3) -> head."""

    def __init__(self, d=8, hidden=16, out=4, layers=3):
        super().__init__()
        dims = [d] + [hidden] * layers
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(a, b, dtype=DTYPE)
                                       for a, b in zip(dims, dims[1:]))
        self.head = torch.nn.Linear(hidden, out, dtype=DTYPE)

    def forward(self, x):
        for fc in self.fcs:
            x = torch.tanh(fc(x))
        return self.head(x)


def mlp(seed=0, **kw):
    torch.manual_seed(seed)
    return MLP(**kw)


def mlp_batch(step, rows=16, d=8, out=4):
    """The global batch of ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, d, generator=g, dtype=DTYPE)
    return x, torch.sin(x[:, :out] * 2.0) + 0.1 * torch.randn(rows, out, generator=g,
                                                              dtype=DTYPE)


def mse(out, y):
    return F.mse_loss(out, y)


def local(t, rank, size):
    """This dp rank's rows of a global batch."""
    return t.tensor_split(size)[rank]


# ---- GPT (tensor- and pipeline-parallel cases) ------------------------------------
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 32, 16, 2, 2, 8


def gpt(group, seed=0, sequence_parallel=None):
    torch.manual_seed(seed)
    sp = sequence_parallel if sequence_parallel is not None else group is not None
    return snn.ParallelGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ, group=group,
                           sequence_parallel=sp, dtype=DTYPE)


def gpt_batch(step, rows=8):
    """ids and next-token targets, batch-first [rows, SEQ], from a bigram rule."""
    g = torch.Generator().manual_seed(2000 + step)
    rule = torch.randint(0, VOCAB, (VOCAB,), generator=torch.Generator().manual_seed(7))
    first = torch.randint(0, VOCAB, (rows, 1), generator=g)
    ids = [first]
    for _ in range(SEQ):
        ids.append(rule[ids[-1]])
    seq = torch.cat(ids, dim=1)
    return seq[:, :-1], seq[:, 1:]


def gpt_loss(model, ids, targets):
    """Mean token loss of batch-first ids/targets; ``model`` a ParallelGPT
    or a DataParallel / DDP around one (whose forward then runs)."""
    inner = getattr(model, "module", model)
    logits = model(ids.t())
    return snn.vocab_parallel_cross_entropy(logits, targets.t(), group=inner.group).mean()


def shard_of(ref, param):
    """The part of the unsharded ``ref`` that tensor-parallel ``param`` holds."""
    spec = getattr(param, "tensor_parallel_sharding", None)
    if spec is None:
        return ref
    dim, index, count = spec
    return ref.chunk(count, dim)[index]


def compare(named, reference, tol, what):
    """Problems where a parameter of ``named`` ([(name, param)], names of
    ``reference``'s parameters, tp shards allowed) differs from the
    reference by more than ``tol`` relative (norm of the difference over the
    norm of the reference)."""
    ref = dict(reference.named_parameters())
    problems, worst = [], 0.0
    for name, p in named:
        r = shard_of(ref[name].detach(), p)
        err = ((p.detach() - r).norm() / r.norm().clamp(min=1e-30)).item()
        worst = max(worst, err)
        if not err <= tol:
            problems.append(f"{what}: '{name}' differs by {err:.2e} relative (> {tol:g})")
    return problems, worst


def strip(named, prefix="module."):
    return [(n[len(prefix):] if n.startswith(prefix) else n, p) for n, p in named]


# ---- torch.distributed (gloo), for DDP ----------------------------------------------
_DIST = {}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_dist(world):
    """torch.distributed on gloo over the same ranks as ``world`` (once per
    process), rendezvous at a port rank 0 picks and broadcasts with strata."""
    import torch.distributed as dist
    if not dist.is_initialized():
        port = torch.tensor([_free_port() if world.rank == 0 else 0], dtype=torch.int64)
        world.group().broadcast(port, src=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port)}",
                                rank=world.rank, world_size=world.size,
                                timeout=datetime.timedelta(seconds=120))
    return dist


def torch_dp_group(world, mesh):
    """The torch.distributed group of this rank's dp group of ``mesh``
    (every rank creates every group, in the same order)."""
    dist = torch_dist(world)
    key = (mesh.world_size, mesh.tp, mesh.pp, mesh.cp)
    if key not in _DIST:
        mine = None
        for ranks in mesh.groups("dp-cp" if mesh.cp > 1 else "dp"):
            g = dist.new_group(ranks)
            if world.rank in ranks:
                mine = g
        _DIST[key] = mine
    return _DIST[key]


def ddp(model, world, mesh, bucket_mb=0.001):
    """torch DDP over this rank's dp group, small buckets."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, process_group=torch_dp_group(world, mesh),
                                   bucket_cap_mb=bucket_mb)
