"""Collectives of the tensor-parallel modules on torch tensors, and the
autograd functions that map activations between "replicated", "split by
features" and "split by tokens" across the tp group (Megatron-Core's
copy / reduce / scatter / gather regions).

Private to :mod:`strata.nn`. ``group`` is a :class:`strata.Group` or None
(a group of one rank: nothing is communicated). A group on device memory
(NCCL) takes CUDA tensors as they are; with a group on host memory (MPI,
Gloo) CUDA tensors are staged through host memory and the result lands back
on the tensor's device. On a device group an asynchronous collective runs
on a side stream, ordered after the work already queued on the current
stream, so that the compute queued after it (the weight-gradient GEMM of
the backward) runs at the same time; waiting for it makes the current
stream wait for the side stream.
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


def _on_device(t, group):
    """Whether the group moves ``t`` where it is (a CUDA tensor on a group on
    device memory), rather than through host memory."""
    return t.device.type == "cuda" and group.memory == "cuda"


def _host(t, group):
    """``t`` in the memory the group moves: itself, or a host copy."""
    return t if t.device.type == "cpu" or _on_device(t, group) else t.to("cpu")


def _start(group, start, tensors):
    """Starts a collective (``start()`` issues it on the current stream):
    ``(work, finish)``. For CUDA tensors on a device group it is issued on a
    side stream that first waits for the current stream, and ``finish``
    makes the (then) current stream wait for the side stream; ``tensors``
    are marked as used there, so their memory is not reused before it is
    done. Otherwise ``finish`` is None."""
    if not tensors or not _on_device(tensors[0], group):
        return start(), None
    device = tensors[0].device
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)  # from torch's pool
    side.wait_stream(current)
    with torch.cuda.stream(side):
        work = start()
    for x in tensors:
        x.record_stream(side)
    return work, (lambda: torch.cuda.current_stream(device).wait_stream(side))


def _then(*fns):
    fns = [f for f in fns if f is not None]
    if not fns:
        return None

    def run():
        for f in fns:
            f()
    return run


def all_reduce(t, group, op="sum", async_op=False):
    """Reduces ``t`` over the group in place (``t`` must be contiguous)."""
    if size_of(group) == 1:
        return _Pending()
    h = _host(t, group)
    work, finish = _start(group, lambda: group.all_reduce(h, op=op, async_op=True), [h])
    pending = _Pending(work, _then(finish, None if h is t else (lambda: t.copy_(h))))
    if async_op:
        return pending
    pending.wait()
    return None


def _empty_for(shape, like, group):
    """A new tensor of ``shape`` for the group to fill: on ``like``'s device
    when the group moves it there, else on the host."""
    device = like.device if _on_device(like, group) else "cpu"
    return torch.empty(shape, dtype=like.dtype, device=device)


def _landed(work, finish, out, like, async_op):
    """The result of ``work``, which fills ``out``, on the device of
    ``like``: the tensor, or ``(tensor, pending)`` with ``async_op``."""
    if out.device == like.device:
        result, pending = out, _Pending(work, finish)
    else:
        result = torch.empty(out.shape, dtype=like.dtype, device=like.device)
        pending = _Pending(work, _then(finish, lambda: result.copy_(out)))
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
    src = _host(t.contiguous(), group)
    out = _empty_for((n * t.shape[0],) + tuple(t.shape[1:]), t, group)
    work, finish = _start(group, lambda: group.all_gather(out, src, async_op=True), [src, out])
    return _landed(work, finish, out, t, async_op)


def reduce_scatter_rows(t, group, async_op=False):
    """This rank's block [n / size, ...] of the sum of ``t`` [n, ...] over the group."""
    n = size_of(group)
    if n == 1:
        return (t, _Pending()) if async_op else t
    if t.shape[0] % n:
        raise InvalidArgument(f"sequence parallelism: {t.shape[0]} rows (the sequence dimension) "
                              f"are not divisible by the tensor-parallel size {n}")
    src = _host(t.contiguous(), group)
    out = _empty_for((t.shape[0] // n,) + tuple(t.shape[1:]), t, group)
    work, finish = _start(group, lambda: group.reduce_scatter(out, src, async_op=True), [src, out])
    return _landed(work, finish, out, t, async_op)


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
