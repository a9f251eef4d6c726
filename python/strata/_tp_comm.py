"""Collectives of the tensor-parallel modules on torch tensors, and the
autograd functions that map activations between "replicated", "split by
features" and "split by tokens" across the tp group (Megatron-Core's
copy / reduce / scatter / gather regions).

Private to :mod:`strata.nn`. ``group`` is a :class:`strata.Group` or None
(a group of one rank: nothing is communicated). Tensors on a CUDA device
are staged through host memory while the group's backend moves host memory
only (the MPI backend); the result lands back on the tensor's device.
"""

import torch

from .errors import InvalidArgument

__all__ = []


def size_of(group):
    return 1 if group is None else group.size


def rank_of(group):
    return 0 if group is None else group.rank


class _Pending:
    """An asynchronous collective; ``wait()`` finishes it (and copies a
    staged result back to the device)."""

    def __init__(self, work=None, finish=None):
        self._work = work
        self._finish = finish

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None:
            self._finish()
            self._finish = None


def _host(t):
    return t if t.device.type == "cpu" else t.to("cpu")


def all_reduce(t, group, op="sum", async_op=False):
    """Reduces ``t`` over the group in place (``t`` must be contiguous)."""
    if size_of(group) == 1:
        return _Pending()
    h = _host(t)
    work = group.all_reduce(h, op=op, async_op=True)
    finish = None if h is t else (lambda: t.copy_(h))
    pending = _Pending(work, finish)
    if async_op:
        return pending
    pending.wait()
    return None


def _landed(work, out, like, async_op):
    """The result of ``work``, which fills the host tensor ``out``, on the
    device of ``like``: the tensor, or ``(tensor, pending)`` with ``async_op``."""
    if like.device.type == "cpu":
        result, pending = out, _Pending(work)
    else:
        result = torch.empty(out.shape, dtype=like.dtype, device=like.device)
        pending = _Pending(work, lambda: result.copy_(out))
    if async_op:
        return result, pending
    pending.wait()
    return result


def all_gather_rows(t, group, async_op=False):
    """[size * n, ...] = every rank's ``t`` [n, ...] in rank order (a new tensor);
    with ``async_op`` returns ``(tensor, pending)``."""
    n = size_of(group)
    if n == 1:
        return (t, _Pending()) if async_op else t
    src = _host(t.contiguous())
    out = torch.empty((n * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device="cpu")
    work = group.all_gather(out, src, async_op=True)
    return _landed(work, out, t, async_op)


def reduce_scatter_rows(t, group, async_op=False):
    """This rank's block [n / size, ...] of the sum of ``t`` [n, ...] over the group."""
    n = size_of(group)
    if n == 1:
        return (t, _Pending()) if async_op else t
    if t.shape[0] % n:
        raise InvalidArgument(f"sequence parallelism: {t.shape[0]} rows (the sequence dimension) "
                              f"are not divisible by the tensor-parallel size {n}")
    src = _host(t.contiguous())
    out = torch.empty((t.shape[0] // n,) + tuple(t.shape[1:]), dtype=t.dtype, device="cpu")
    work = group.reduce_scatter(out, src, async_op=True)
    return _landed(work, out, t, async_op)


def all_gather_last(t, group):
    """[..., size * k] from every rank's [..., k] (concatenated in rank order)."""
    n = size_of(group)
    if n == 1:
        return t
    rows = all_gather_rows(t.movedim(-1, 0).contiguous(), group)
    # rows: [n * k, ...] -> [..., n * k]: rank blocks along the last dim.
    return rows.movedim(0, -1).contiguous()


def split_last(t, group):
    """This rank's block of the last dimension."""
    n = size_of(group)
    if n == 1:
        return t
    k = t.shape[-1] // n
    return t.narrow(-1, rank_of(group) * k, k).contiguous()


def split_rows(t, group):
    n = size_of(group)
    if n == 1:
        return t
    k = t.shape[0] // n
    return t.narrow(0, rank_of(group) * k, k).contiguous()


class CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward. Used for a
    replicated input entering column-parallel work, and for a replicated
    parameter applied to token shards under sequence parallelism (each rank
    holds the gradient of its tokens only)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        all_reduce(g, ctx.group)
        return g, None


class ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _mapping(name, doc, forward, backward):
    """An autograd function that applies ``forward(x, group)`` to its input
    and ``backward(g, group)`` to the gradient."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, g):
        return backward(g.contiguous(), ctx.group), None

    return type(name, (torch.autograd.Function,),
                {"__doc__": doc, "__module__": __name__,
                 "forward": staticmethod(fwd), "backward": staticmethod(bwd)})


ReduceScatterToSP = _mapping(
    "ReduceScatterToSP", "Reduce-scatter along dim 0 (tokens) forward; all-gather backward.",
    reduce_scatter_rows, all_gather_rows)
GatherFromSP = _mapping(
    "GatherFromSP", "All-gather along dim 0 forward; reduce-scatter backward.",
    all_gather_rows, reduce_scatter_rows)
ScatterToSP = _mapping(
    "ScatterToSP", "Split along dim 0 forward (keep this rank's tokens); all-gather backward.",
    split_rows, all_gather_rows)
GatherFromTP = _mapping(
    "GatherFromTP", "All-gather along the last dim forward; split backward.",
    all_gather_last, split_last)
