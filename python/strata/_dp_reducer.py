"""The gradient reducer behind strata.nn.DataParallel and strata.optim's
DistributedOptimizer (private).

It owns the flat buffers (gradients; under ZeRO-1 also parameters and this
rank's shard of the reduced gradients), lays them out (see _dp_layout),
and reduces them bucket by bucket over the data-parallel group:

- hooks (``register_post_accumulate_grad_hook``) mark each parameter ready
  as autograd accumulates its gradient; a bucket whose parameters are all
  ready starts its all-reduce (reduce-scatter under ZeRO-1) at once, buckets
  strictly in index order so that every rank issues the same collectives in
  the same order;
- a callback queued on autograd's engine runs when the backward pass ends:
  it starts what is left and waits for every bucket (or, inside a pipeline
  schedule, leaves the waiting to the schedule);
- the first backward decides the layout: the order gradients became ready,
  agreed across the ranks.

Step atomicity: nothing here changes a parameter or an optimizer state.
A failed reduction is raised after every bucket of the step has been
waited for (so no collective writes into the buffers afterwards) and
leaves the reducer *failed* until ``zero_grad()`` or ``rebuild()``: the
gradient buffers then hold a mix of reduced and local values, and the
DistributedOptimizer refuses to step on them.
"""

import hashlib
import struct
import weakref

import torch

from . import _dp_comm as C
from ._dp_layout import Entry, Layout
from .errors import CommError, InvalidArgument


class UnusedParametersError(InvalidArgument):
    """Parameters that require grad received no gradient in a backward pass
    that reduces gradients (pass ``find_unused_parameters=True``, or freeze
    them before wrapping)."""


class BucketMismatchError(InvalidArgument):
    """The ranks of a data-parallel group laid out their gradient buckets
    differently (another order of gradients in the first backward, or other
    options)."""


class ParameterMismatchError(InvalidArgument):
    """The ranks of a data-parallel group hold parameters of different
    shapes, dtypes or counts."""


class ModuleChangedError(InvalidArgument):
    """Parameters were added, removed, replaced, reshaped, frozen or moved
    out of DataParallel's buffers after wrapping."""


class GradientSyncFailed(CommError):
    """A previous gradient reduction failed and its step was not abandoned
    (``zero_grad()`` or ``rebuild()`` first)."""


_OPS = {"avg": 0, "sum": 1}
_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}


def _dtype_code(dtype):
    return _DTYPE_CODES.get(dtype, 99)


def _names(entries, limit=8):
    s = ", ".join(f"'{e.name}'" for e in entries[:limit])
    return s + (f" and {len(entries) - limit} more" if len(entries) > limit else "")


def check_same_parameters(entries, group, timeout=None, who="DataParallel"):
    """Collective over ``group``: raises ParameterMismatchError on every
    rank unless every rank holds parameters of the same count, dtypes and
    shapes (one small all-reduce when they do)."""
    rows = [(_dtype_code(e.dtype), len(e.shape)) + e.shape for e in entries]
    h = struct.unpack("<q", hashlib.blake2b(repr(rows).encode(), digest_size=8).digest())[0] >> 2
    t = torch.tensor([h, -h, len(entries), max((len(e.shape) for e in entries), default=0)],
                     dtype=torch.int64)
    C.all_reduce_now(group, t, "max", timeout)
    if int(t[0]) == -int(t[1]):
        return
    n, nd = int(t[2]), int(t[3])
    width = 1 + n * (2 + nd)
    mine = torch.full((width,), -1, dtype=torch.int64)
    mine[0] = len(entries)
    for k, e in enumerate(entries):
        base = 1 + k * (2 + nd)
        mine[base] = _dtype_code(e.dtype)
        mine[base + 1] = len(e.shape)
        for j, d in enumerate(e.shape):
            mine[base + 2 + j] = d
    every = torch.empty(group.size * width, dtype=torch.int64)
    C.all_gather_now(group, every, mine, timeout)
    every = every.view(group.size, width)
    ref = every[0]
    names = [e.name for e in entries]
    code_names = {v: str(k) for k, v in _DTYPE_CODES.items()}

    def describe(row, k):
        base = 1 + k * (2 + nd)
        nd_k = int(row[base + 1])
        shape = tuple(int(x) for x in row[base + 2:base + 2 + nd_k])
        return f"shape {shape} {code_names.get(int(row[base]), 'of another dtype')}"

    for r in range(1, group.size):
        row = every[r]
        if int(row[0]) != int(ref[0]):
            raise ParameterMismatchError(
                f"{who}: dp rank {r} of group '{group.name}' has {int(row[0])} parameters that "
                f"require grad, dp rank 0 has {int(ref[0])}: every rank must wrap the same model "
                "(and freeze the same parameters)")
        for k in range(int(ref[0])):
            base = 1 + k * (2 + nd)
            if not torch.equal(row[base:base + 2 + nd], ref[base:base + 2 + nd]):
                name = names[k] if k < len(names) else f"#{k}"
                raise ParameterMismatchError(
                    f"{who}: parameter {k} ('{name}' on dp rank {group.rank}) has "
                    f"{describe(ref, k)} on dp rank 0 but {describe(row, k)} on dp rank {r} of "
                    f"group '{group.name}': every rank of a data-parallel group must hold the "
                    "same parameters (tensor-parallel shards are split over tp, not dp)")


class Reducer:
    """See the module docstring. ``named_params``: [(name, parameter)] that
    require grad; ``group``: the dp (or dp-cp) strata.Group; ``tp``: the tp
    group (only for parameters marked ``sequence_parallel``); ``hooks``:
    reduce during backward (DataParallel) or only in finish() (a
    DistributedOptimizer on its own)."""

    def __init__(self, named_params, group, options, tp=None, hooks=True,
                 who="DataParallel"):
        self.who = who
        self.opts = options
        self.group, self.tp = group, tp
        self.entries = [Entry(i, n, p, bool(getattr(p, "sequence_parallel", False)))
                        for i, (n, p) in enumerate(named_params)]
        if any(e.tail for e in self.entries) and (tp is None or tp.size == 1):
            # Nothing to sum over: a tp of one, or no tp group known.
            if tp is None:
                tails = [e for e in self.entries if e.tail]
                raise InvalidArgument(
                    f"{who}: parameters {_names(tails)} are marked sequence_parallel (their "
                    "gradients are summed over tp) but the data-parallel group was given as a "
                    "Group; pass the strata.World so the tp group is known")
        devices = {e.param.device for e in self.entries}
        if len(devices) > 1:
            raise InvalidArgument(f"{who}: parameters live on several devices "
                                  f"({', '.join(sorted(map(str, devices)))}); one device per rank")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.side = C.SideStream(self.device)
        self.zero = None   # weakref to the attached DistributedOptimizer
        self.final = False
        self.seen, self._seen = [], set()  # the first backward's order
        self.user_sync = True      # no_sync() clears it
        self.backward_sync = True  # what the backward under way does
        self.pipeline = False      # inside a pipeline schedule's step
        self.in_backward = False
        self.failed = None
        self.events = [] if options.record_events else None
        self.grad, self.param, self.shard = {}, {}, {}
        self.views = [None] * len(self.entries)
        self.layout = Layout(self.entries, list(reversed(range(len(self.entries)))),
                             options.bucket_bytes, 1)
        self._alloc(None)
        self._reset_pass()
        self._hooks = []
        if hooks:
            me = weakref.ref(self)
            for e in self.entries:
                self._hooks.append(e.param.register_post_accumulate_grad_hook(
                    _hook(me, e.index)))

    # ---- buffers --------------------------------------------------------------
    @property
    def pad(self):
        return self.layout.pad

    def _alloc(self, old, discard_grads=False):
        """Buffers for self.layout; gradients (and ZeRO-1 parameters) copied
        from the previous layout's (``old``) or from the parameters. With
        ``discard_grads`` (no ZeRO-1), the gradient buffers of the same
        sizes are zeroed and reused instead."""
        lay = self.layout
        zero = self.zero is not None
        reuse = discard_grads and not zero and lay.sizes.keys() == self.grad.keys() and all(
            self.grad[d].numel() == n for d, n in lay.sizes.items())
        if reuse:
            grad = self.grad
            for buf in grad.values():
                buf.zero_()
        else:
            # A newcomer's model, built while its state arrives: its buffers
            # are zeroed when it adopts a member's layout (_adopt_layout),
            # their pages touched then, while the parameters arrive.
            from ._elastic_transfer import receiving_state
            make = torch.empty if old is None and not zero and receiving_state() else torch.zeros
            grad = {d: make(n, dtype=d, device=self.device) for d, n in lay.sizes.items()}
        param = ({d: torch.zeros(n, dtype=d, device=self.device) for d, n in lay.sizes.items()}
                 if zero else {})
        shard = ({d: torch.zeros(n, dtype=d, device=self.device)
                  for d, n in lay.shard_sizes.items()} if zero else {})
        with torch.no_grad():
            for e in self.entries:
                off = lay.offset[e.index]
                view = grad[e.dtype][off:off + e.numel].view(e.shape)
                g = e.param.grad
                if g is not None and not discard_grads:
                    view.copy_(g)
                e.param.grad = view
                self.views[e.index] = view
                if zero:
                    pv = param[e.dtype][off:off + e.numel]
                    pv.copy_(e.param.data.reshape(-1))
                    e.param.data = pv.view(e.shape)
        self.grad, self.param, self.shard = grad, param, shard
        self.reduced = self.fresh = False

    def params_in_place(self):
        """The entries whose parameter no longer lives in the flat parameter
        buffer (ZeRO-1): their .data was replaced."""
        if self.zero is None:
            return []
        lay = self.layout
        out = []
        for e in self.entries:
            off = lay.offset[e.index]
            if e.param.data_ptr() != self.param[e.dtype][off:off + 1].data_ptr() \
                    or tuple(e.param.shape) != e.shape:
                out.append(e)
        return out

    def adopt(self, e):
        """Makes ``e.param.grad`` the buffer's view again after the user set
        it to None or autograd replaced it (one copy; None counts as zero)."""
        view = self.views[e.index]
        g = e.param.grad
        if g is view:
            return
        with torch.no_grad():
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
                view.copy_(g)
        e.param.grad = view

    # ---- the backward pass ---------------------------------------------------
    def _reset_pass(self):
        self.ready = [False] * len(self.entries)
        self.pending = [len(b.entries) for b in self.layout.buckets]
        self.next_launch = 0
        self.works = {}

    def _event(self, *what):
        if self.events is not None:
            self.events.append(what)

    def on_grad(self, index):
        e = self.entries[index]
        self.adopt(e)
        self.fresh = True
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self._event("ready", e.name)
        if not self.final:
            if index not in self._seen:
                self._seen.add(index)
                self.seen.append(index)
            self.ready[index] = True
            return
        b = self.layout.bucket_of[index]
        if self.ready[index]:
            if self.backward_sync and b.index < self.next_launch:
                raise InvalidArgument(
                    f"{self.who}: parameter '{e.name}' received a second gradient in one "
                    f"backward pass after its bucket's reduction had started (reentrant "
                    "activation checkpointing? use torch.utils.checkpoint(use_reentrant=False))")
            return
        self.ready[index] = True
        if not self.backward_sync or b.tail:
            return
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:
            self._launch_ready()

    def _launch_ready(self):
        buckets = self.layout.buckets
        while (self.next_launch < len(buckets) and self.pending[self.next_launch] == 0
               and not buckets[self.next_launch].tail):
            self._launch(buckets[self.next_launch])
            self.next_launch += 1

    def _launch(self, b):
        flat = self.grad[b.dtype][b.start:b.start + b.length]
        group, op, timeout = self.group, self.opts.reduce_op, self.opts.timeout
        if self.zero is not None:
            block = b.length // self.pad
            out = self.shard[b.dtype][b.shard_offset:b.shard_offset + block]
            work = self.side.run(lambda: C.reduce_scatter(group, out, flat, op, timeout))
        else:
            work = self.side.run(lambda: C.all_reduce(group, flat, op, timeout))
        self.works[b.index] = work
        self._event("launch", b.index, b.nbytes)

    def _launch_rest(self):
        """Starts every bucket not started yet, in order; parameters that had
        no gradient in this pass are reduced as their buffers hold them
        (zero after zero_grad). Tail buckets are summed over tp first."""
        for e in self.entries:
            if not self.ready[e.index]:
                self.adopt(e)
        buckets = self.layout.buckets
        if self.next_launch < len(buckets):
            tails = [b for b in buckets[self.next_launch:] if b.tail]
            if tails and self.tp is not None and self.tp.size > 1:
                for dtype in {b.dtype for b in tails}:
                    first = min(b.start for b in tails if b.dtype == dtype)
                    C.all_reduce_now(self.tp, self.grad[dtype][first:], "sum", self.opts.timeout)
            for b in buckets[self.next_launch:]:
                self._launch(b)
            self.next_launch = len(buckets)

    def _backward_done(self):
        self.in_backward = False
        self._event("backward_end")
        sync = self.backward_sync
        unused = [e for e in self.entries if not self.ready[e.index]]
        try:
            if not self.final:  # (a new layout starts a new pass: ready flags are reset)
                self._finalize_layout(check_unused=sync and not self.pipeline)
            if not sync:
                return
            self._launch_rest()
            if self.pipeline:
                return  # the schedule waits once its step is done
            self.finish()
        finally:
            if not (sync and self.pipeline):
                self.ready = [False] * len(self.entries)
        if unused and not self.opts.find_unused_parameters:
            raise UnusedParametersError(_unused_message(self, {self.group.rank: unused}))

    def finish(self):
        """Starts what is left and waits for every bucket of this pass;
        raises the first failure after waiting for all of them."""
        self.check_failed()
        if self.reduced and not self.fresh and self._hooks and not self.works:
            return  # the backward's end reduced them, nothing came since
        if not self.final:
            self._finalize_layout(check_unused=False)
        self._launch_rest()
        error = None
        for k in sorted(self.works):
            try:
                self.works[k].wait()
                self._event("done", k)
            except Exception as e:  # noqa: BLE001: every bucket is waited for first
                if error is None:
                    error = e
        self.side.join()
        self._reset_pass()
        if error is not None:
            self.failed = f"{type(error).__name__}: {error}"
            raise error
        self.reduced, self.fresh = True, False

    def check_failed(self):
        if self.failed is not None:
            self.drain()
            raise GradientSyncFailed(
                f"{self.who}: the gradient reduction of a step failed ({self.failed}); abandon "
                "the step with zero_grad() (or rebuild() on a new group) before the next one")

    def drain(self):
        """Waits for whatever is in flight, ignoring its errors (before the
        buffers are zeroed or replaced)."""
        for w in self.works.values():
            try:
                w.wait()
            except Exception:  # noqa: BLE001: the step is being abandoned
                pass
        self.side.join()
        self.in_backward = False
        self._reset_pass()

    def zero_grad(self):
        self.drain()
        for buf in list(self.grad.values()) + list(self.shard.values()):
            buf.zero_()
        for e in self.entries:
            e.param.grad = self.views[e.index]
        self.failed = None
        self.reduced = self.fresh = False

    def begin_forward(self):
        self.check_failed()
        if self.in_backward:  # a backward that raised before its end
            self.drain()
        if not self.pipeline:
            self.backward_sync = self.user_sync

    # ---- the layout ---------------------------------------------------------
    def _extra(self):
        return (_OPS.get(self.opts.reduce_op, 9), self.zero is not None,
                bool(self.opts.find_unused_parameters))

    def _finalize_layout(self, check_unused):
        """Collective over the group: the layout of the first backward's order,
        the same on every rank (else BucketMismatchError), and the unused
        parameters of a first backward that reduces (UnusedParametersError
        on every rank, naming them)."""
        n = len(self.entries)
        order = self.seen + [i for i in reversed(range(n)) if i not in self._seen]
        unused_here = check_unused and not self.opts.find_unused_parameters and len(self.seen) < n
        layout = Layout(self.entries, order, self.opts.bucket_bytes, self.pad)
        d = layout.digest(self._extra())
        t = torch.tensor([d, -d, 1 if unused_here else 0], dtype=torch.int64)
        C.all_reduce_now(self.group, t, "max", self.opts.timeout)
        if self.opts.find_unused_parameters:
            # The graph may depend on the data: every rank takes rank 0's order.
            o = torch.tensor(order, dtype=torch.int64)
            C.broadcast(self.group, o, 0, self.opts.timeout)
            if o.tolist() != order:
                order = o.tolist()
                layout = Layout(self.entries, order, self.opts.bucket_bytes, self.pad)
        elif int(t[0]) != -int(t[1]):
            self._explain_mismatch(order)
        if int(t[2]):
            flags = torch.tensor([1 if i in self._seen else 0 for i in range(n)],
                                 dtype=torch.int64)
            every = torch.empty(self.group.size * n, dtype=torch.int64)
            C.all_gather_now(self.group, every, flags, self.opts.timeout)
            every = every.view(self.group.size, n)
            by_rank = {r: [self.entries[i] for i in range(n) if not int(every[r, i])]
                       for r in range(self.group.size)}
            self.seen, self._seen = [], set()
            self.drain()
            raise UnusedParametersError(_unused_message(self, {r: u for r, u in by_rank.items()
                                                               if u}))
        self.set_layout(layout)
        self.final = True
        self._event("layout", len(layout.buckets))

    def _explain_mismatch(self, order):
        n = len(self.entries)
        mine = torch.tensor(order + [self.opts.bucket_bytes] + list(self._extra()),
                            dtype=torch.int64)
        every = torch.empty(self.group.size * mine.numel(), dtype=torch.int64)
        C.all_gather_now(self.group, every, mine, self.opts.timeout)
        every = every.view(self.group.size, -1)
        names = {e.index: e.name for e in self.entries}
        self.drain()
        for r in range(1, self.group.size):
            row, ref = every[r].tolist(), every[0].tolist()
            if row[n:] != ref[n:]:
                raise BucketMismatchError(
                    f"{self.who}: dp rank {r} of group '{self.group.name}' was built with other "
                    f"options than dp rank 0 (bucket_bytes {row[n]} vs {ref[n]}, reduce_op, "
                    "ZeRO-1 or find_unused_parameters): every rank must wrap with the same "
                    "options")
            for k in range(n):
                if row[k] != ref[k]:
                    raise BucketMismatchError(
                        f"{self.who}: the gradient buckets of dp rank {r} of group "
                        f"'{self.group.name}' differ from dp rank 0's: position {k} of the order "
                        f"gradients became ready in the first backward is '{names[ref[k]]}' on "
                        f"rank 0 but '{names[row[k]]}' on rank {r}. Ranks must run the same "
                        "model the same way; when the graph depends on the data, pass "
                        "find_unused_parameters=True (rank 0's order is then used)")
        raise BucketMismatchError(f"{self.who}: the ranks of group '{self.group.name}' "
                                  "computed different gradient buckets")

    def set_layout(self, layout, keep=True, discard_grads=False):
        """Moves the buffers to ``layout`` (gradients and ZeRO-1 parameters
        copied over, or with ``discard_grads`` zeroed) and tells the attached
        optimizer."""
        old = self.layout
        if layout.describe() == old.describe() and layout.pad == old.pad:
            if discard_grads:
                for buf in self.grad.values():
                    buf.zero_()
            return
        self.drain()
        self.layout = layout
        self._alloc(old, discard_grads)
        self._reset_pass()
        opt = self.zero() if self.zero is not None else None
        if opt is not None:
            opt._layout_changed(self, old, self.group, keep)

    def attach_zero(self, optimizer):
        """Reduce-scatters from now on, for ``optimizer`` (a
        DistributedOptimizer holding every parameter of this reducer)."""
        current = self.zero() if self.zero is not None else None
        if current is not None and current is not optimizer:
            raise InvalidArgument(f"{self.who} already has a DistributedOptimizer; one "
                                  "DistributedOptimizer holds all of its parameters")
        self.drain()
        self.zero = weakref.ref(optimizer)
        old = self.layout
        self.layout = Layout(self.entries, old.order, self.opts.bucket_bytes, self.group.size)
        self._alloc(old)
        self._reset_pass()

    def relayout_for(self, group, keep_state, optimizer_moves):
        """The layout for a new group (``group`` None: this rank leaves);
        ``optimizer_moves(reducer, old layout, old group, keep_state)``
        moves the ZeRO-1 state."""
        self.drain()
        old = self.layout
        pad = group.size if (self.zero is not None and group is not None) else 1
        new = Layout(self.entries, old.order, self.opts.bucket_bytes, pad)
        if group is not None and group.size > 1:
            d = new.digest(self._extra())
            t = torch.tensor([d, -d], dtype=torch.int64)
            C.all_reduce_now(group, t, "max", self.opts.timeout)
            if int(t[0]) != -int(t[1]):
                raise BucketMismatchError(
                    f"{self.who}: after rebuild the ranks of group '{group.name}' hold different "
                    "gradient buckets (were they all trained through the same first backward?)")
        old_group = self.group
        self.group = group
        self.layout = new
        if self.zero is None and new.sizes == old.sizes and new.offset == old.offset:
            # The same buffers fit the new group (no ZeRO-1 padding to
            # change): reuse them, already drained and zeroed, instead of
            # allocating and copying the whole gradient again (in an elastic
            # recovery that was most of the restore phase).
            for e in self.entries:
                e.param.grad = self.views[e.index]
            self.reduced = self.fresh = False
        else:
            self._alloc(old)
        self._reset_pass()
        self.failed = None
        optimizer_moves(self, old, old_group, keep_state)

    # ---- ZeRO-1 parameters ----------------------------------------------------
    def gather_params(self):
        """All-gathers every bucket's parameters from their owners (after the
        optimizer stepped this rank's blocks); raises the first failure after
        waiting for all of them."""
        works, error = [], None
        group, timeout = self.group, self.opts.timeout
        for b in self.layout.buckets:
            flat = self.param[b.dtype][b.start:b.start + b.length]
            block = b.length // self.pad
            own = flat[group.rank * block:(group.rank + 1) * block]
            works.append(self.side.run(lambda f=flat, o=own: C.all_gather(group, f, o, timeout)))
        for w in works:
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001: every bucket is waited for first
                error = error or e
        self.side.join()
        if error is not None:
            raise error

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _hook(ref, index):
    def hook(param):
        reducer = ref()
        if reducer is not None:
            reducer.on_grad(index)
    return hook


def _unused_message(reducer, by_rank):
    parts = [f"dp rank {r}: {_names(u)}" for r, u in sorted(by_rank.items())]
    return (f"{reducer.who}: parameters received no gradient in a backward pass that reduces "
            f"gradients over group '{reducer.group.name}' ({'; '.join(parts)}). DataParallel "
            "starts a bucket's reduction when all its gradients are ready, so every parameter "
            "that requires grad must take part in the loss. Pass find_unused_parameters=True "
            "(their gradients are then reduced as the buffers hold them: zero after "
            "zero_grad()), or freeze them with param.requires_grad_(False) before wrapping")
