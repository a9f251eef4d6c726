"""The collectives of strata.nn.DataParallel and strata.optim's
DistributedOptimizer, in one place (private).

Every collective the data-parallel layer issues goes through these
functions (the Group's torch.distributed names: ``all_reduce``,
``reduce_scatter``, ``all_gather``, ``broadcast(src=)``,
``all_to_all_single``), so that the layer's use of the group is in one
place.

On CUDA tensors (backend nccl) a bucket's collective runs on a stream of
the data-parallel layer's own, ordered after the gradients' producer: an
event recorded on the current stream (autograd's, in a hook) is waited for
on the side stream before the collective is issued there, and
:func:`join` makes the current stream wait for the side stream once the
work is done. On host tensors (mpi, gloo) there are no streams.
"""

import torch


class SideStream:
    """The stream a data-parallel layer's collectives run on for CUDA
    tensors of ``device``; None-like (no-op) for host tensors."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)

    def run(self, issue):
        """Calls ``issue()`` (which starts a collective and returns its Work)
        on the side stream, after the work queued so far on the current
        stream (the tensors' producer)."""
        if self.stream is None:
            return issue()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            return issue()

    def join(self):
        """Orders the current stream after everything issued on the side
        stream (call after the works were waited for)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def all_reduce(group, tensor, op, timeout=None):
    """Starts an in-place all-reduce; returns its Work."""
    return group.all_reduce(tensor, op=op, async_op=True, timeout=timeout)


def reduce_scatter(group, output, input, op, timeout=None):
    """Starts a reduce-scatter of ``input`` (group.size x output elements)
    into ``output``; returns its Work."""
    return group.reduce_scatter(output, input, op=op, async_op=True, timeout=timeout)


def all_gather(group, output, input, timeout=None):
    """Starts an all-gather of every rank's ``input`` into ``output`` (in
    place when ``input`` is this rank's block of ``output``); returns its Work."""
    return group.all_gather(output, input, async_op=True, timeout=timeout)


def _staged(group, *tensors):
    """The tensors as ``group`` takes them: themselves on a host backend, a
    copy on the current CUDA device for nccl (control data: digests,
    flags, orders, moved optimizer state)."""
    if getattr(group, "memory", "host") != "cuda":
        return tensors
    return tuple(t.cuda() for t in tensors)


def _back(staged, tensors):
    for s, t in zip(staged, tensors):
        if s is not t:
            t.copy_(s)  # synchronises with the stream


def all_reduce_now(group, tensor, op, timeout=None):
    """Blocking all-reduce (small control tensors: digests, flags)."""
    (t,) = _staged(group, tensor)
    all_reduce(group, t, op, timeout).wait(timeout)
    _back((t,), (tensor,))


def broadcast(group, tensor, src, timeout=None):
    """Blocking broadcast from group rank ``src``."""
    (t,) = _staged(group, tensor)
    group.broadcast(t, src=src, timeout=timeout)
    _back((t,), (tensor,))


def all_gather_now(group, output, input, timeout=None):
    out, inp = _staged(group, output, input)
    all_gather(group, out, inp, timeout).wait(timeout)
    _back((out,), (output,))


def all_to_all_now(group, output, input, output_splits, input_splits, timeout=None):
    """Blocking all_to_all_single with splits (lists of first-dimension
    lengths, one per rank)."""
    out, inp = _staged(group, output, input)
    group.all_to_all_single(out, inp, output_split_sizes=output_splits,
                            input_split_sizes=input_splits, timeout=timeout)
    _back((out,), (output,))
